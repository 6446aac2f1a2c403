"""Durable puts against the same I/O written by plain threads.

A thin command line over ``kvstore.bench.write_shape``: its docstring says what it measures.

    .venv/bin/python tools/write_shape.py --dir ./bench-data               # 2 GiB per variant
    .venv/bin/python tools/write_shape.py --dir ./bench-data --rounds 3 --json
"""

from __future__ import annotations

import sys

from kvstore.bench.write_shape import main

if __name__ == "__main__":
    sys.exit(main())

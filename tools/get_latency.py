"""Where a single ``get`` spends its time beyond the read.

A thin command line over ``kvstore.bench.get_latency``: its docstring says what it measures.

    .venv/bin/python tools/get_latency.py --dir ./bench-data            # 2 GiB store
    .venv/bin/python tools/get_latency.py --dir ./bench-data --json
"""

from __future__ import annotations

import sys

from kvstore.bench.get_latency import main

if __name__ == "__main__":
    sys.exit(main())

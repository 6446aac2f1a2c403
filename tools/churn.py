"""Churn benchmark: overwrite, delete and read random keys at a fixed fill.

A thin command line over ``kvstore.bench.churn``: its docstring says what it measures.

    .venv/bin/python tools/churn.py --dir ./churn-data --capacity-mib 512
"""

from __future__ import annotations

import sys

from kvstore.bench.churn import main

if __name__ == "__main__":
    sys.exit(main())

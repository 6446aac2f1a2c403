#!/usr/bin/env python3
"""Reopen-after-crash benchmark: a big checkpointed table plus a long WAL tail.

A thin command line over ``kvstore.bench.reopen``: its docstring says what it measures.

    .venv/bin/python tools/reopen_bench.py --dir /tmp/reopen --pages 1000000 --tail 100000
"""

from __future__ import annotations

import sys

from kvstore.bench.reopen import main

if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Simulated power loss, torn writes and the Nth-I/O error loop for kvstore: a thin
command line over ``kvstore.testing.powerloss_cli`` (its docstring says what each mode
does).

    .venv/bin/python tools/powerloss.py --cases 1200 --seed 20261129 --json
    .venv/bin/python tools/powerloss.py --mode tear-page --json
    .venv/bin/python tools/powerloss.py --mode tear-wal --json
    .venv/bin/python tools/powerloss.py --mode double --cases 300 --json
    .venv/bin/python tools/powerloss.py --mode eio --json

Exit status: 0 when no case found a violation, 1 otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from kvstore.testing.powerloss_cli import main

if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The corruption sweep: a thin CLI over ``kvstore.testing.corruption`` (its docstring
says what is injected where and how each outcome is judged).

    python tools/corruption_sweep.py --flips 3000 --seed 4 --workers 2 --json
"""

from __future__ import annotations

import sys

from kvstore.testing.corruption import main

if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The kill -9 crash loop: a thin CLI over ``kvstore.testing.crashloop`` (its
docstring says what a cycle does and what counts as a violation).

    .venv/bin/python tools/crashloop.py --dir /tmp/cl --cycles 200 --capacity-mib 64 --retain
"""

from __future__ import annotations

import sys

from kvstore.testing.crashloop import main

if __name__ == "__main__":
    sys.exit(main())

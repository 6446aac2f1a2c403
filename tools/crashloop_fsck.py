#!/usr/bin/env python3
"""The kill -9 loop plus fsck after every recovery: a thin command line over
``kvstore.testing.crashloop_fsck`` (its docstring says what it checks).

    .venv/bin/python tools/crashloop_fsck.py --dir /tmp/cl --cycles 500 --seed 1 \\
        --capacity-mib 64 --retain --json
"""

from __future__ import annotations

import sys

from kvstore.testing.crashloop_fsck import main

if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Read-only readers and read-only fsck beside a churning writer, for minutes: a thin
command line over ``kvstore.testing.reader_soak`` (its docstring says what is checked).

    .venv/bin/python tools/reader_soak.py --seconds 300 --json

Exit status: 0 when nothing false was reported and no byte was wrong, else 1.
"""

from __future__ import annotations

import sys

from kvstore.testing.reader_soak import main

if __name__ == "__main__":
    sys.exit(main())

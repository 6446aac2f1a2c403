"""Repeated opens of the tier manager under hostile measurements: what stays resident.

    python tools/tier_soundness.py [--opens 3] [--pages 65536,262144,2097152] [--json]

A thin command line over ``kvstore.testing.tier_soundness`` (its docstring says what
each case does). Exit 1 if any open kept fewer than 90% of the offered pages.
"""

from __future__ import annotations

import sys

from kvstore.testing.tier_soundness import main

if __name__ == "__main__":
    sys.exit(main())

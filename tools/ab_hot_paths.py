"""The store's hot paths, for a before/after comparison of two source trees.

A thin command line over ``kvstore.bench.ab_hot_paths``: its docstring says what it measures.

    python tools/ab_hot_paths.py --tree /path/to/old/checkout --json
    python tools/ab_hot_paths.py --tree . --json
"""

from __future__ import annotations

import sys

from kvstore.bench.ab_hot_paths import main

if __name__ == "__main__":
    sys.exit(main())

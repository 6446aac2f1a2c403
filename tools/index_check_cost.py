"""What the open-time check of the LMDB index costs (docs/reliability.md).

A thin command line over ``kvstore.bench.index_check``: its docstring says what it measures.

    python tools/index_check_cost.py --dir /tmp/idx --pages 100000 --json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from kvstore.bench.index_check import main

if __name__ == "__main__":
    sys.exit(main())

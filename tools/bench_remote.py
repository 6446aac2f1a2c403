"""Remote loads through kvstore against Mooncake's own batched get, over loopback.

A thin command line over ``kvstore.testing.cluster_bench``: its docstring says what it measures.

    .venv/bin/python tools/bench_remote.py                 # 8 rounds of 64 x 256 KiB
    .venv/bin/python tools/bench_remote.py --pages 64 --rounds 8 --json
"""

from __future__ import annotations

import sys

from kvstore.testing.cluster_bench import main

if __name__ == "__main__":
    sys.exit(main())

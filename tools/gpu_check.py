"""One prepared check of the HBM path on a machine with a GPU (and, reduced, on one without).

A thin command line over ``kvstore.bench.gpu_check``: its docstring says what is checked
and measured.

    python tools/gpu_check.py --dir /nvme/kvstore-gpu-check [--pages 256] [--page-mib 1]
"""

from __future__ import annotations

import sys

from kvstore.bench.gpu_check import main

if __name__ == "__main__":
    sys.exit(main())

"""The tier manager's soundness checks on a CUDA device (run where a GPU is lent).

    python tools/gpu_tier_sound.py --dir /tmp/kvt-gpu [--page-kib 256]

A thin command line over ``kvstore.testing.gpu_tier_sound`` (its docstring says what
is checked and when it fails).
"""

from __future__ import annotations

import sys

from kvstore.testing.gpu_tier_sound import main

if __name__ == "__main__":
    sys.exit(main())

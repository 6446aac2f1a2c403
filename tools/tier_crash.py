#!/usr/bin/env python3
"""The tier manager's kill -9 workloads: a thin CLI over ``kvstore.testing.tier_crash``."""

from __future__ import annotations

import sys

from kvstore.testing.tier_crash import main

if __name__ == "__main__":
    sys.exit(main())

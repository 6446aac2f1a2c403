#!/usr/bin/env python3
"""vLLM offloading-tier benchmark: the kvstore tier against vLLM's built-in ``fs`` tier.

A thin command line over ``kvstore.bench.vllm_tier`` (its docstring says what is
timed and checked). Needs the integration venv (tools/setup_integ_env.sh).

    .venv-integ/bin/python tools/vllm_tier_bench.py --dir /nvme/bench --chunks 2048
"""

from __future__ import annotations

import sys

from kvstore.bench.vllm_tier import main

if __name__ == "__main__":
    sys.exit(main())

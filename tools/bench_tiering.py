"""The tier manager's costs on this machine, each beside a reference measured in the same run.

A thin command line over ``kvstore.bench.tiering_cli``; the measurements and what each
part times are kvstore/bench/tiering.py's. See docs/benchmarks.md, "The tier manager".

    .venv/bin/python tools/bench_tiering.py --dir ./bench-data/tiering --out run.json
    .venv/bin/python tools/bench_tiering.py --only bookkeeping plan --reps 15 --profile 14
    .venv/bin/python tools/bench_tiering.py --report run.json
"""

from __future__ import annotations

import sys

from kvstore.bench.tiering_cli import main

if __name__ == "__main__":
    sys.exit(main())

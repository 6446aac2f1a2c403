"""Scaling sweeps alone (page size, queue depth, store fill, page count), with plots.

    .venv/bin/python tools/scaling.py --dir ./bench-data --plots docs/img --out run.json
    .venv/bin/python tools/scaling.py --dir ./bench-data --sweep pages --max-pages 100000
    .venv/bin/python tools/scaling.py --replot run.json --plots docs/img

The same sweeps run inside ``kvstore bench --scaling``; this runs only them
(kvstore/bench/scaling.py documents each sweep and holds this command's code).
See docs/benchmarks.md.
"""

from __future__ import annotations

import sys

from kvstore.bench.scaling import main

if __name__ == "__main__":
    sys.exit(main())

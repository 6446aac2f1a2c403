"""Scaling sweeps alone (page size, queue depth, store fill, page count), with plots.

    .venv/bin/python tools/scaling.py --dir ./bench-data --plots docs/img --out run.json
    .venv/bin/python tools/scaling.py --dir ./bench-data --sweep pages --max-pages 100000
    .venv/bin/python tools/scaling.py --replot run.json --plots docs/img

The same sweeps run inside ``kvstore bench --scaling``; this runs only them
(kvstore/bench/scaling.py documents each sweep). See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from kvstore.bench.common import MIB, NullReporter
from kvstore.bench.report import to_json_ready
from kvstore.bench.scaling import SWEEPS, ScalingConfig, plot, run_scaling


def _page_counts(max_pages: int) -> tuple[int, ...]:
    counts, count = [], 1_000
    while count < max_pages:
        counts.append(count)
        count *= 10
    return (*counts, max_pages)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("./bench-data"))
    parser.add_argument("--plots", type=Path, default=Path("docs/img"))
    parser.add_argument("--out", type=Path, help="save the points as JSON")
    parser.add_argument("--sweep", action="append", choices=SWEEPS, help="default: all")
    parser.add_argument("--max-pages", type=int, default=1_000_000)
    parser.add_argument("--scaling-mib", type=int, default=256, help="bytes per sweep point")
    parser.add_argument("--fill-mib", type=int, default=1024, help="capacity of the fill sweep")
    parser.add_argument("--runtime", type=float, default=30.0, help="cap per point (seconds)")
    parser.add_argument("--replot", type=Path, help="only redraw the plots of a saved run")
    args = parser.parse_args(argv)
    if args.replot is not None:
        document = json.loads(args.replot.read_text())
        scaling = document.get("scaling", document)
    else:
        config = ScalingConfig(
            bytes_per_point=args.scaling_mib * MIB,
            fill_capacity_bytes=args.fill_mib * MIB,
            fill_segment_bytes=16 * MIB if args.fill_mib >= 512 else 4 * MIB,
            page_counts=_page_counts(args.max_pages),
            runtime_s=args.runtime,
        )
        args.dir.mkdir(parents=True, exist_ok=True)
        scaling = run_scaling(args.dir, config, NullReporter(), tuple(args.sweep or SWEEPS))
        if args.out is not None:
            args.out.write_text(json.dumps(to_json_ready({"scaling": scaling}), indent=2) + "\n")
    for path in plot(scaling, args.plots):
        print(path)
    slope = scaling.get("pages_put_cost_slope")
    if slope is not None:
        print(f"per-page put cost vs page count, log-log slope: {slope:.3f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

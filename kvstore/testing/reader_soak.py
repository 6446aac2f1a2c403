"""Read-only readers and read-only fsck beside a churning writer, for minutes.

One writer process churns a small store (puts of pages derived from key and
version, deletes, flushes, gc(), checkpoint(), the GC thread and flusher on
short intervals, a capacity small enough that puts evict). Beside it,
``--readers`` processes open the store ``readonly=True`` again and again and
read random keys, checking every byte they get against what the writer could
have written for that key; ``--fsckers`` processes run a read-only
``check_store`` again and again (some deep) and, every ``--cli-every``-th run,
``kvstore fsck --json``. The writer never damages the store, so every finding,
every failed open and every failed read is a false one. At the end, with the
writer closed, a deep fsck and a read of every key must be clean too.

    .venv/bin/python tools/reader_soak.py --seconds 300 --json

Exit status: 0 when nothing false was reported and no byte was wrong, else 1.
The harness is kvstore/testing/readers.py (tests/reliability/ runs it briefly); this
module is the command line of tools/reader_soak.py.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kvstore.testing.readers import soak


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="How long the readers run.")
    parser.add_argument("--readers", type=int, default=2, help="Read-only reader processes.")
    parser.add_argument("--fsckers", type=int, default=1, help="Read-only fsck processes.")
    parser.add_argument("--keys", type=int, default=160, help="Key space of the writer.")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--cli-every", type=int, default=10, help="Every Nth fsck run is `kvstore fsck` (0: none)."
    )
    parser.add_argument("--io-engine", default=None, help="The writer's io_engine (default auto).")
    parser.add_argument("--dir", type=Path, help="Where the store goes (default: a temp dir).")
    parser.add_argument("--json", action="store_true", help="Print the result as JSON.")
    args = parser.parse_args(argv)
    base = args.dir or Path(tempfile.mkdtemp(prefix="kvstore-reader-soak-"))
    root = base / "store"
    if root.exists():
        shutil.rmtree(root)
    base.mkdir(parents=True, exist_ok=True)
    options = {} if args.io_engine is None else {"io_engine": args.io_engine}
    try:
        result = soak(
            root,
            seconds=args.seconds,
            readers=args.readers,
            fsckers=args.fsckers,
            keys=args.keys,
            seed=args.seed,
            cli_every=args.cli_every,
            options=options,
        )
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print(
            f"{result.seconds:.0f} s: writer {result.writer_ops}; {result.opens} read-only opens "
            f"({result.failed_opens} failed), {result.reads} pages read ({result.hits} hits, "
            f"{result.misses} misses of which {result.stale_reads} stale, "
            f"{result.failed_reads} failed reads), {result.wrong_bytes} wrong; "
            f"{result.fsck_runs} fsck runs + {result.fsck_cli_runs} CLI runs, "
            f"{result.false_findings} false findings, {result.fsck_failed} failed, "
            f"{result.changed_while_checking} objects changed while checking; after the "
            f"writer closed: {result.final_findings} findings, "
            f"{result.final_wrong_bytes} wrong pages"
        )
        for kind, messages in result.samples.items():
            for message in messages[:3]:
                print(f"  {kind}: {message}")
    return 0 if result.ok else 1

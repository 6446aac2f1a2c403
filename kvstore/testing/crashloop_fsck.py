"""The kill -9 loop (kvstore.testing.crashloop), plus fsck after every recovery.

Runs the kill -9 loop of kvstore.testing.crashloop unchanged (same options, same
oracle), and after the parent has reopened the store and checked it against
the oracle in each cycle, runs ``store.check()`` (``--fsck-deep``: with
payload checksums) on that recovered store. Any finding is a violation: it
is printed, counted in ``fsck_findings`` and makes the exit status 1.

``--parent-engine threadpool`` makes the parent (which reopens, checks and
fscks the store every cycle) use the thread-pool engine; the children, which
are the ones killed, keep the default. With io_uring the parent leaks every
I/O buffer it ever used (the liburing binding's ``Iovec`` never releases its
buffer export; tests/reliability/test_resource_leaks.py), which after a few
hundred cycles exhausts vm.max_map_count or memory.

``--stall-s S`` raises the no-progress limit after which a live child counts
as stalled (crashloop's default is 5 s, which a heavily loaded machine can
exceed: a child importing numpy under load average 11 was flagged).

    .venv/bin/python tools/crashloop_fsck.py --dir /tmp/cl --cycles 500 --seed 1 \\
        --capacity-mib 64 --retain --json
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore import KVStore
from kvstore.clikit import progress_line
from kvstore.testing import crashloop

__all__ = ["FsckTally", "main"]

MAX_EXAMPLES = 20


@dataclass(slots=True)
class FsckTally:
    """fsck of each recovered store: how many runs, what they found."""

    deep: bool
    runs: int = 0
    findings: int = 0
    examples: list[str] = field(default_factory=list)

    def check(self, store: KVStore, cycle: int) -> None:
        found = store.check(deep=self.deep)
        self.runs += 1
        if not found:
            return
        self.findings += len(found)
        for finding in found[:3]:
            line = f"cycle {cycle}: fsck {finding.kind}: {finding.message}"
            progress_line(line)
            if len(self.examples) < MAX_EXAMPLES:
                self.examples.append(line)


def main(argv: Sequence[str] | None = None) -> int:
    parser = crashloop.build_parser()
    parser.description = (__doc__ or "").split("\n\n")[0]
    parser.add_argument("--fsck-deep", action="store_true", help="fsck with payload checksums")
    parser.add_argument(
        "--parent-engine", default=None, help="io_engine of the parent's reopens and fsck"
    )
    args = parser.parse_args(argv)
    if args.child:
        return crashloop.child_main(args)
    tally = FsckTally(deep=args.fsck_deep)
    summary = crashloop.run_from_args(
        args, parent_engine=args.parent_engine, after_recovery=tally.check
    )
    if args.json:
        document = {
            **summary.as_dict(),
            "fsck_runs": tally.runs,
            "fsck_findings": tally.findings,
            "fsck_examples": tally.examples,
            "fsck_deep": tally.deep,
            "parent_engine": args.parent_engine,
            "stall_s": args.stall_s,
        }
        document["violations"] += tally.findings
        print(json.dumps(document, indent=2))
    else:
        print(crashloop.format_summary(summary))
        print(f"fsck runs {tally.runs}, findings {tally.findings}")
    return 1 if summary.violations or tally.findings else 0

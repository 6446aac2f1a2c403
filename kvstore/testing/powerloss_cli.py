"""Simulated power loss, torn writes and the Nth-I/O error loop for kvstore.

Modes (see kvstore/testing/ and docs/reliability.md):

``powerloss`` (default)
    Record random workloads (puts, batches, deletes, pins, deletes of pinned
    pages, retains, releases, GC, checkpoints, flushes, close) with every file
    system call the store makes, cut each recording at random points, rebuild
    the disk under each policy (``drop``: unsynced writes lost; ``prefix``: a
    random prefix of them kept, the next one cut at a random byte; ``dirs``:
    also entries created, renamed or unlinked since their directory's last
    fsync undone), open the store and check it against the oracle, fsck
    (deep), then write, close, reopen and check again. ``--cases`` cases in
    all, the policies in turn.
``tear-page``
    An unacknowledged 1 MiB page record torn at every 4 KiB boundary
    (``--stride``), with zero and garbage tails.
``tear-wal``
    The WAL append of one PUT record torn at every byte (``--stride``).
``double``
    A crash during recovery: cut a recording, rebuild it, recover it under a
    new recording (plus 30 more workload steps on other keys), cut that one
    too and recover again. What the first recovery showed must not change;
    the second workload has its own oracle. ``--cases`` cases, the 9 policy
    pairs in turn.
``eio``
    Fail the Nth I/O with EIO and ENOSPC, once and persistently, for N = 1, 2,
    ... until the operation completes, over put, flush, checkpoint, gc, close,
    open (crash recovery) and recover (``kvstore recover``).

    .venv/bin/python tools/powerloss.py --cases 1200 --seed 20261129 --json
    .venv/bin/python tools/powerloss.py --mode tear-page --json
    .venv/bin/python tools/powerloss.py --mode tear-wal --json
    .venv/bin/python tools/powerloss.py --mode double --cases 300 --json
    .venv/bin/python tools/powerloss.py --mode eio --json

Exit status: 0 when no case found a violation, 1 otherwise. This module is the
command line of tools/powerloss.py; the cases are kvstore/testing/powerloss.py's and
kvstore/testing/ioerrors.py's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import re
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.clikit import progress_line
from kvstore.testing.faults import POLICIES
from kvstore.testing.ioerrors import ERRNOS, OPERATIONS, run_loop
from kvstore.testing.powerloss import (
    Trace,
    Violation,
    record_trace,
    run_case,
    run_double_case,
    tear_page_cases,
    tear_wal_cases,
)

EVICTION_POLICIES = ("fifo", "lru", "cost")
MAX_EXAMPLES = 20  # cases with violations kept in the summary, 5 violations each


@dataclass(slots=True)
class _Violations:
    """Violations counted by kind, and the first cases that had any."""

    kinds: Counter[str] = field(default_factory=Counter)
    examples: list[dict[str, Any]] = field(default_factory=list)

    def add(self, violations: Sequence[Violation], case: dict[str, Any], *, kinds: bool) -> None:
        """Count ``violations``; keep them as an example of ``case`` (``kinds``: each
        text is ``kind: detail``, else the detail alone)."""
        for violation in violations:
            self.kinds[violation.kind] += 1
        if violations and len(self.examples) < MAX_EXAMPLES:
            texts = [f"{v.kind}: {v.detail}" if kinds else v.detail for v in violations[:5]]
            self.examples.append({**case, "violations": texts})

    @property
    def total(self) -> int:
        return sum(self.kinds.values())


def _record(args: argparse.Namespace, trace_dir: Path, trace_seed: int) -> Trace:
    if args.capacity_mib is None:
        return record_trace(trace_dir, trace_seed, steps=args.steps, keys=args.keys)
    return record_trace(
        trace_dir,
        trace_seed,
        steps=args.steps,
        keys=args.keys,
        capacity_bytes=args.capacity_mib << 20,
        eviction_policy=EVICTION_POLICIES[trace_seed % len(EVICTION_POLICIES)],
    )


def _traces(args: argparse.Namespace, work: Path, rng: random.Random) -> Iterator[Trace]:
    """Seeded recordings, one after another; each is removed when the next is asked for."""
    for number in itertools.count():
        trace_seed = rng.randrange(1 << 30)
        trace_dir = work / f"trace-{number}"
        yield _record(args, trace_dir, trace_seed)
        shutil.rmtree(trace_dir, ignore_errors=True)


def run_powerloss(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    rng = random.Random(args.seed)
    policies = POLICIES if args.policy == "all" else (args.policy,)
    per_policy: Counter[str] = Counter()
    found = _Violations()
    acknowledged = 0
    traces = 0
    record_ops = 0
    open_seconds: list[float] = []
    done = 0
    started = time.monotonic()
    for trace in _traces(args, work, rng):
        traces += 1
        record_ops += len(trace.recorder.ops)
        for _ in range(min(args.cases_per_trace, args.cases - done)):
            policy = policies[done % len(policies)]
            cut = rng.randint(0, len(trace.recorder.ops))
            result = run_case(trace, cut, policy, work, rng)
            done += 1
            per_policy[policy] += 1
            acknowledged += result.acknowledged_pages
            open_seconds.append(result.open_seconds)
            case = {"trace_seed": trace.seed, "cut": cut, "policy": policy}
            found.add(result.violations, case, kinds=True)
            if done % 100 == 0:
                progress_line(f"{done} cases, violations {found.total}", quiet=args.quiet)
        if done >= args.cases:
            break
    open_seconds.sort()
    return {
        "mode": "powerloss",
        "seed": args.seed,
        "capacity_mib": args.capacity_mib,
        "cases": done,
        "cases_per_policy": dict(per_policy),
        "traces": traces,
        "recorded_calls": record_ops,
        "acknowledged_pages_checked": acknowledged,
        "violations": found.total,
        "violations_by_kind": dict(found.kinds),
        "examples": found.examples,
        "open_seconds_p50": open_seconds[len(open_seconds) // 2] if open_seconds else 0.0,
        "open_seconds_max": open_seconds[-1] if open_seconds else 0.0,
        "seconds": round(time.monotonic() - started, 1),
    }


def run_double(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    rng = random.Random(args.seed)
    pairs = [(first, second) for first in POLICIES for second in POLICIES]
    found = _Violations()
    done = traces = 0
    started = time.monotonic()
    for trace in _traces(args, work, rng):
        traces += 1
        for _ in range(min(args.cases_per_trace, args.cases - done)):
            first, second = pairs[done % len(pairs)]
            cut = rng.randint(0, len(trace.recorder.ops))
            violations = run_double_case(trace, cut, first, second, work, rng)
            done += 1
            case = {"trace_seed": trace.seed, "cut": cut, "policies": [first, second]}
            found.add(violations, case, kinds=True)
            if done % 50 == 0:
                progress_line(f"{done} cases, violations {found.total}", quiet=args.quiet)
        if done >= args.cases:
            break
    return {
        "mode": "double",
        "seed": args.seed,
        "capacity_mib": args.capacity_mib,
        "cases": done,
        "traces": traces,
        "violations": found.total,
        "violations_by_kind": dict(found.kinds),
        "examples": found.examples,
        "seconds": round(time.monotonic() - started, 1),
    }


def run_tear(args: argparse.Namespace, work: Path, kind: str) -> dict[str, Any]:
    started = time.monotonic()
    if kind == "page":
        stride = args.stride or 4096
        results = tear_page_cases(work, seed=args.seed, stride=stride)
    else:
        stride = args.stride or 1
        results = tear_wal_cases(work, seed=args.seed, stride=stride)
    found = _Violations()
    for point, tail, violations in results:
        found.add(violations, {"point": point, "tail": tail}, kinds=False)
    points = sorted({point for point, _, _ in results})
    return {
        "mode": f"tear-{kind}",
        "seed": args.seed,
        "stride_bytes": stride,
        "tear_points": len(points),
        "write_bytes": points[-1] if points else 0,
        "cases": len(results),
        "violations": found.total,
        "violations_by_kind": dict(found.kinds),
        "examples": found.examples,
        "seconds": round(time.monotonic() - started, 1),
    }


def _site(violation: str) -> str:
    """Where a loop violation came from: the raising function, or what went wrong."""
    match = re.search(r" from (\S+?:\w+)", violation)
    if match:
        return match.group(1)
    return re.sub(r"^N=\d+: ", "", violation).split(":")[0][:60]


def run_eio(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    started = time.monotonic()
    operations = OPERATIONS if args.operations == "all" else tuple(args.operations.split(","))
    loops = []
    total_violations = 0
    iterations = 0
    sites: Counter[str] = Counter()
    for operation in operations:
        for error in ERRNOS:
            for persistent in (False, True):
                result = run_loop(
                    work / operation,
                    operation,
                    error,
                    persistent=persistent,
                    seed=args.seed,
                    stride=args.stride or 1,
                )
                iterations += result.iterations
                total_violations += len(result.violations)
                for violation in result.violations:
                    sites[_site(violation)] += 1
                loops.append(
                    {
                        "operation": operation,
                        "errno": error,
                        "mode": "persistent" if persistent else "single",
                        "n_tried": result.iterations,
                        "completed_at_n": result.completed_at,
                        "raised": result.raised,
                        "fault_absorbed": result.swallowed,
                        "absorbed_calls": result.swallowed_calls,
                        "violations": len(result.violations),
                        "examples": result.violations[:5],
                    }
                )
                progress_line(
                    f"{operation} {error} {'persistent' if persistent else 'single'}: "
                    f"N up to {result.completed_at}, violations {len(result.violations)}",
                    quiet=args.quiet,
                )
    return {
        "mode": "eio",
        "seed": args.seed,
        "loops": loops,
        "iterations": iterations,
        "violations": total_violations,
        "violations_by_site": dict(sites),
        "seconds": round(time.monotonic() - started, 1),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--mode",
        choices=("powerloss", "double", "tear-page", "tear-wal", "eio"),
        default="powerloss",
    )
    parser.add_argument("--cases", type=int, default=300, help="power-loss cases in all")
    parser.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--policy", choices=("all", *POLICIES), default="all")
    parser.add_argument("--steps", type=int, default=150, help="workload steps per recording")
    parser.add_argument("--keys", type=int, default=16, help="key space of the workload")
    parser.add_argument(
        "--capacity-mib",
        type=int,
        default=None,
        help="powerloss/double: store capacity (1 MiB segments, at least 5): pages are "
        "evicted (fifo, lru, cost in turn) and an unretained page may be absent",
    )
    parser.add_argument(
        "--cases-per-trace", type=int, default=40, help="cuts taken from each recording"
    )
    parser.add_argument(
        "--stride", type=int, default=0, help="tear: bytes between tear points; eio: N step"
    )
    parser.add_argument(
        "--operations", default="all", help=f"eio: comma-separated, of {','.join(OPERATIONS)}"
    )
    parser.add_argument("--work-dir", type=Path, default=None, help="scratch directory")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    args = parser.parse_args(argv)
    if args.seed is None:
        args.seed = random.randrange(1 << 31)
        progress_line(f"seed {args.seed}", quiet=args.quiet)
    scratch = Path(tempfile.mkdtemp(prefix="kvstore-powerloss-", dir=args.work_dir))
    try:
        if args.mode == "powerloss":
            summary = run_powerloss(args, scratch)
        elif args.mode == "double":
            summary = run_double(args, scratch)
        elif args.mode == "tear-page":
            summary = run_tear(args, scratch, "page")
        elif args.mode == "tear-wal":
            summary = run_tear(args, scratch, "wal")
        else:
            summary = run_eio(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary["date"] = time.strftime("%Y-%m-%d", time.gmtime())
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for key, value in summary.items():
            if key not in ("examples", "loops"):
                print(f"{key}: {value}")
        for example in summary.get("examples", []):
            print("  violation:", example)
        for loop in summary.get("loops", []):
            print(
                f"  {loop['operation']:<10} {loop['errno']:<6} {loop['mode']:<10} "
                f"N 1..{loop['completed_at_n']:<4} raised {loop['raised']} "
                f"violations {loop['violations']}"
            )
    return 1 if summary["violations"] else 0

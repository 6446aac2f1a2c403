"""Where does kvstore's time go? Profile the put and get paths of tools/bench.py.

    .venv/bin/python tools/profile_kvstore.py --dir ./bench-data                # all workloads
    .venv/bin/python tools/profile_kvstore.py --dir ./bench-data --workload put_1m --top 25

Runs the same workloads as ``tools/bench.py`` (durable ``put_many(32 pages); flush()``
of 1 MiB / 256 KiB pages, ``get_many`` of 64 random 256 KiB pages, single ``get``) and
reports, per workload:

- wall time split into the caller-visible calls (``put_many`` vs ``flush``, ...);
- every blocking syscall the store makes from Python, timed by wrapping the ``os`` /
  ``liburing`` functions for the run and classified by the file it touches
  (``fdatasync`` of a segment vs of the WAL, ``posix_fallocate`` of a new segment,
  ``os.read`` of the io_uring eventfd = waiting for I/O, ``io_uring_submit``, ...);
- CPU seconds, minor page faults per page, and the top functions by own time (cProfile).

Wrapping adds ~1 us per wrapped call and cProfile slows Python code by ~1.3-2x, so
absolute numbers are pessimistic; use tools/bench.py for throughput.
For native frames (xxhash, memcpy, the kernel side) use py-spy on tools/bench.py:
``py-spy record --native --idle -r 250 -f raw -o out.txt -- .venv/bin/python tools/bench.py``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import resource
import shutil
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import liburing

from kvstore import KVStore
from kvstore.bench.common import KIB, MIB

# -- syscall timing ------------------------------------------------------------


def _fd_kind(fd: object) -> str:
    """What an fd is, from /proc/self/fd: segment, wal, index, dir, eventfd, ..."""
    if not isinstance(fd, int):
        return "?"
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "closed"
    if "eventfd" in target:
        return "eventfd"
    if "/segments/" in target:
        return "segment"
    if "/wal/" in target:
        return "wal"
    if "/index/" in target:
        return "index"
    if os.path.isdir(target):
        return "dir"
    return "other"


@dataclass(slots=True)
class CallStats:
    count: int = 0
    total_ns: int = 0
    samples: list[int] = field(default_factory=list)

    def add(self, elapsed_ns: int) -> None:
        self.count += 1
        self.total_ns += elapsed_ns
        self.samples.append(elapsed_ns)

    def percentile_us(self, pct: float) -> float:
        ordered = sorted(self.samples)
        if not ordered:
            return 0.0
        return ordered[min(len(ordered) - 1, int(pct / 100.0 * len(ordered)))] / 1000.0


class SyscallTimer:
    """Wrap module-level functions; time each call, keyed by name and the fd it touches."""

    WRAPPED: tuple[tuple[ModuleType, str, bool], ...] = (
        # (module, function name, first argument is an fd worth classifying)
        (os, "fdatasync", True),
        (os, "fsync", True),
        (os, "posix_fallocate", True),
        (os, "pwritev", True),
        (os, "preadv", True),
        (os, "read", True),
        (os, "write", True),
        (os, "open", False),
        (os, "unlink", False),
        (liburing, "io_uring_submit", False),
    )

    def __init__(self) -> None:
        self.calls: dict[str, CallStats] = defaultdict(CallStats)
        self._saved: list[tuple[ModuleType, str, Callable[..., Any]]] = []

    def _wrap(self, name: str, original: Callable[..., Any], classify: bool) -> Callable[..., Any]:
        calls = self.calls
        clock = time.perf_counter_ns

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = clock() - start
                kind = _fd_kind(args[0]) if classify and args else ""
                calls[f"{name}({kind})" if kind else name].add(elapsed)

        return wrapper

    def __enter__(self) -> SyscallTimer:
        for module, name, classify in self.WRAPPED:
            original = getattr(module, name)
            self._saved.append((module, name, original))
            setattr(module, name, self._wrap(name, original, classify))
        return self

    def __exit__(self, *exc: object) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()


# -- workloads -----------------------------------------------------------------


@dataclass(slots=True)
class Report:
    workload: str
    pages: int
    page_bytes: int
    wall_s: float
    mbps: float
    cpu_user_s: float
    cpu_sys_s: float
    minor_faults: int
    phases: dict[str, float]
    syscalls: dict[str, CallStats]
    top: str


@contextmanager
def measured(timer: SyscallTimer, profiler: cProfile.Profile | None) -> Iterator[dict[str, float]]:
    """Wall/CPU/fault counters around the block (filled into the yielded dict at exit)."""
    out: dict[str, float] = {}
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    with timer:
        if profiler is not None:
            profiler.enable()
        try:
            yield out
        finally:
            if profiler is not None:
                profiler.disable()
    out["wall_s"] = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    out["user_s"] = after.ru_utime - before.ru_utime
    out["sys_s"] = after.ru_stime - before.ru_stime
    out["minflt"] = after.ru_minflt - before.ru_minflt


def _report(
    workload: str,
    pages: int,
    page_bytes: int,
    out: dict[str, float],
    phases: dict[str, float],
    timer: SyscallTimer,
    profiler: cProfile.Profile | None,
    top: int,
) -> Report:
    """A workload's report from what ``measured`` filled in."""
    return Report(
        workload,
        pages,
        page_bytes,
        out["wall_s"],
        pages * page_bytes / out["wall_s"] / 1e6,
        out["user_s"],
        out["sys_s"],
        int(out["minflt"]),
        phases,
        dict(timer.calls),
        _top(profiler, top),
    )


def _top(profiler: cProfile.Profile | None, count: int) -> str:
    if profiler is None:
        return ""
    buffer = io.StringIO()
    stats = pstats.Stats(profiler, stream=buffer)
    stats.strip_dirs().sort_stats("tottime").print_stats(count)
    lines = buffer.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    return "\n".join(lines[start:])


def _open(root: Path, args: argparse.Namespace, *, create: bool) -> KVStore:
    store = KVStore.open(
        root, create=create, segment_bytes=args.segment_mib * MIB, io_depth=args.io_depth
    )
    if not store.stats().direct_io:
        raise SystemExit(f"{root}: O_DIRECT refused; profile would measure the page cache")
    return store


def profile_puts(args: argparse.Namespace, page_bytes: int, name: str) -> Report:
    root = args.dir / f"prof-{name}"
    shutil.rmtree(root, ignore_errors=True)
    payloads = [os.urandom(page_bytes) for _ in range(args.batch)]
    batches = max(1, args.size_mib * MIB // (page_bytes * args.batch))
    work = [
        [(b"p/%09d" % (b * args.batch + i), payloads[i]) for i in range(args.batch)]
        for b in range(batches)
    ]
    timer = SyscallTimer()
    profiler = cProfile.Profile() if args.cprofile else None
    phases = {"put_many": 0.0, "flush": 0.0}
    store = _open(root, args, create=True)
    try:
        with measured(timer, profiler) as out:
            for items in work:
                t0 = time.perf_counter()
                store.put_many(items)
                t1 = time.perf_counter()
                store.flush()
                t2 = time.perf_counter()
                phases["put_many"] += t1 - t0
                phases["flush"] += t2 - t1
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)
    pages = batches * args.batch
    return _report(name, pages, page_bytes, out, phases, timer, profiler, args.top)


def _profile_reads(
    args: argparse.Namespace, workload: str, pages: int, page_bytes: int, run: Callable[[], None]
) -> Report:
    """One read workload, ``run``, measured: its one phase is the whole of it."""
    timer = SyscallTimer()
    profiler = cProfile.Profile() if args.cprofile else None
    with measured(timer, profiler) as out:
        run()
    phases = {workload: out["wall_s"]}
    return _report(workload, pages, page_bytes, out, phases, timer, profiler, args.top)


def profile_reads(args: argparse.Namespace) -> list[Report]:
    page_bytes = 256 * KIB
    root = args.dir / "prof-reads"
    shutil.rmtree(root, ignore_errors=True)
    payloads = [os.urandom(page_bytes) for _ in range(64)]
    count = max(256, args.size_mib * MIB // page_bytes)
    keys = [b"r/%09d" % i for i in range(count)]
    with _open(root, args, create=True) as store:
        for first in range(0, count, 256):
            chunk = range(first, min(first + 256, count))
            store.put_many([(keys[i], payloads[i % 64]) for i in chunk])
        store.flush()
    os.sync()
    rng = random.Random(7)
    reports: list[Report] = []
    try:
        with _open(root, args, create=False) as store:
            store.get_many(rng.sample(keys, 64))  # warm-up
            plan = [rng.sample(keys, 64) for _ in range(max(16, count // 64))]

            def get_many(reader: KVStore = store) -> None:
                for wanted in plan:
                    reader.get_many(wanted)

            reports.append(_profile_reads(args, "get_many", len(plan) * 64, page_bytes, get_many))
            singles = [rng.choice(keys) for _ in range(min(count, 4096))]

            def get(reader: KVStore = store) -> None:
                for key in singles:
                    reader.get(key)

            reports.append(_profile_reads(args, "get", len(singles), page_bytes, get))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return reports


# -- output --------------------------------------------------------------------


def print_report(report: Report) -> None:
    per_page_us = report.wall_s / report.pages * 1e6
    print(f"\n=== {report.workload}: {report.pages} pages of {report.page_bytes // KIB} KiB")
    print(
        f"wall {report.wall_s:.2f}s = {report.mbps:,.0f} MB/s, {per_page_us:.0f} us/page; "
        f"cpu user {report.cpu_user_s:.2f}s sys {report.cpu_sys_s:.2f}s "
        f"({(report.cpu_user_s + report.cpu_sys_s) / report.wall_s:.0%} of wall); "
        f"minor faults {report.minor_faults} ({report.minor_faults / report.pages:.1f}/page)"
    )
    print("phases: " + ", ".join(f"{k} {v:.2f}s" for k, v in report.phases.items()))
    print(f"{'call (fd kind)':<28} {'count':>7} {'total ms':>9} {'% wall':>7} "
          f"{'mean us':>9} {'p50 us':>8} {'p99 us':>8}")  # fmt: skip
    ordered = sorted(report.syscalls.items(), key=lambda item: -item[1].total_ns)
    for name, stats in ordered:
        total_ms = stats.total_ns / 1e6
        print(
            f"{name:<28} {stats.count:>7} {total_ms:>9.1f} "
            f"{total_ms / 1e3 / report.wall_s:>7.1%} {stats.total_ns / stats.count / 1e3:>9.1f} "
            f"{stats.percentile_us(50):>8.1f} {stats.percentile_us(99):>8.1f}"
        )
    if report.top:
        print("top functions by own time (cProfile):")
        print(report.top)


def as_json(report: Report) -> dict[str, object]:
    return {
        "workload": report.workload,
        "pages": report.pages,
        "page_bytes": report.page_bytes,
        "wall_s": report.wall_s,
        "mbps": report.mbps,
        "cpu_user_s": report.cpu_user_s,
        "cpu_sys_s": report.cpu_sys_s,
        "minor_faults": report.minor_faults,
        "phases": report.phases,
        "syscalls": {
            name: {
                "count": stats.count,
                "total_ms": stats.total_ns / 1e6,
                "p50_us": stats.percentile_us(50),
                "p99_us": stats.percentile_us(99),
            }
            for name, stats in report.syscalls.items()
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("./bench-data"))
    parser.add_argument("--size-mib", type=int, default=2048, help="bytes per workload")
    parser.add_argument(
        "--workload",
        choices=("put_1m", "put_256k", "reads", "all"),
        default="all",
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--io-depth", type=int, default=32)
    parser.add_argument("--segment-mib", type=int, default=256)
    parser.add_argument("--top", type=int, default=15, help="functions to list per workload")
    parser.add_argument(
        "--cprofile", action=argparse.BooleanOptionalAction, default=True, help="run cProfile"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the numbers here too")
    args = parser.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    reports: list[Report] = []
    if args.workload in ("put_1m", "all"):
        reports.append(profile_puts(args, MIB, "put_1m"))
        print_report(reports[-1])
    if args.workload in ("put_256k", "all"):
        reports.append(profile_puts(args, 256 * KIB, "put_256k"))
        print_report(reports[-1])
    if args.workload in ("reads", "all"):
        for report in profile_reads(args):
            reports.append(report)
            print_report(report)
    if args.json is not None:
        args.json.write_text(json.dumps([as_json(r) for r in reports], indent=2) + "\n")
    sys.stdout.flush()
    return 0

"""kvstore against fio on the same directory, in one run: the ratio table of the
Done-when targets (``kvstore bench --against-fio``; ``tools/bench.py`` is its CLI with
every option).

    kvstore bench --against-fio --dir ./bench-data          # full size (4 GiB per workload)
    kvstore bench --against-fio --dir ./bench-data --quick  # 512 MiB, short caps
    python tools/bench.py --json --out result.json          # JSON on stdout (and a file)

First the fio profiles in ``fio_profiles/`` run against ``--dir`` (``BENCH_DIR``,
``BENCH_SIZE`` and ``BENCH_RUNTIME`` are set in their environment), then the kvstore
workloads run in fresh store directories under ``--dir``:

  put_1m         durable puts of 1 MiB pages from 4 KiB-aligned memory (written without
                 a copy), pipelined: ``put_many_async(batch of 32, sync=True)`` with
                 ``--pipeline-depth`` batches in flight, each acknowledged once durable
  put_256k       the same with 256 KiB pages
  put_*_x4       four caller threads, each ``put_many(batch); flush()``
  put_*_sync     one caller, ``put_many(batch); flush()`` (not pipelined)
  put_1m_bytes   put_1m from ``bytes`` (copied into the store's buffers)
  get_many       ``get_many`` of 64 random 256 KiB pages (checksums verified by the store)
                 over a store of ``--size-mib`` of pages, repeated
  get_many_into  ``get_many_into_async`` of 64 random pages into aligned buffers (read
                 there without a copy), ``--pipeline-depth`` calls in flight
  get            single ``get`` of a random 256 KiB page: median and p99 latency

Every workload reports its process CPU (user + system, all threads) per GB moved.

Afterwards the target fio profiles run again (``--no-recheck`` skips that), so each
kvstore number is judged against fio measured before and after it in the same run
(targets in ``TARGETS``; PASS/FAIL when both agree, MIXED when they straddle the
target). Throughput is payload bytes per second in MB/s (10^6 bytes), the unit of
fio's ``bw_bytes``. ``--report run.json`` re-prints a run saved with ``--out``.
See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import math
import mmap
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvstore import KVStore
from kvstore.bench.common import finite, read_sysfs, remove_tree
from kvstore.bench.common import machine_info as common_machine_info
from kvstore.bench.fio import PROFILES_DIR  # fio_profiles/ at the repository root
from kvstore.bench.report import SMOKE_TEST_CAVEAT

MIB = 1 << 20
KIB = 1 << 10
FIO_PROFILES = (
    "seq_write_1m",
    "seq_write_256k",
    "seq_write_1m_sync32",
    "seq_write_256k_sync32",
    "randread_256k_qd32",
    "randread_256k_qd1",
    "randread_256k_qd1_psync",
    "mixed_70_30",
    "wal_append",
)
WAL_RUNTIME_S = 10
# Profiles rerun after the kvstore workloads (--recheck) to show how much the disk drifted.
RECHECK_PROFILES = (
    "seq_write_1m",
    "seq_write_256k",
    "seq_write_1m_sync32",
    "seq_write_256k_sync32",
    "randread_256k_qd32",
    "randread_256k_qd1",
    "randread_256k_qd1_psync",
)


@dataclass(frozen=True, slots=True)
class Target:
    """``kvstore metric`` compared with ``fio metric``: ratio >= bound (or <= for latency).

    A target without a fio profile bounds the kvstore metric itself (CPU per byte).
    """

    workload: str
    label: str
    fio_profile: str | None
    fio_metric: str | None
    kv_metric: str
    unit: str
    bound: float
    higher_is_better: bool

    def describe(self) -> str:
        op = ">=" if self.higher_is_better else "<="
        return f"{op} {self.bound:.2f}" if self.fio_profile is None else f"{op} {self.bound:.1f}x"


# The durable puts run pipelined (put_many_async(batch, sync=True), pipeline_depth batches
# in flight) from one caller thread, and put_many + flush from four; pages in 4 KiB-aligned
# memory (written without a copy). fio's reference does the same durability: an fdatasync
# every 32 writes. docs/benchmarks.md, "The store".
TARGETS = (
    Target("put_1m", "durable put 1 MiB x32, pipelined, 1 thread", "seq_write_1m_sync32",
           "write_mbps", "mbps", "MB/s", 0.9, True),
    Target("put_256k", "durable put 256 KiB x32, pipelined, 1 thread", "seq_write_256k_sync32",
           "write_mbps", "mbps", "MB/s", 0.9, True),
    Target("put_1m_x4", "durable put 1 MiB x32 + flush, 4 threads", "seq_write_1m_sync32",
           "write_mbps", "mbps", "MB/s", 0.9, True),
    Target("put_256k_x4", "durable put 256 KiB x32 + flush, 4 threads", "seq_write_256k_sync32",
           "write_mbps", "mbps", "MB/s", 0.9, True),
    Target("get_many", "get_many 64 x 256 KiB (bytes)", "randread_256k_qd32", "read_mbps",
           "mbps", "MB/s", 0.9, True),
    Target("get_many_into", "get_many_into 64 x 256 KiB, aligned, pipelined",
           "randread_256k_qd32", "read_mbps", "mbps", "MB/s", 0.9, True),
    Target("get", "get 256 KiB p50 vs fio pvsync2 clat p50", "randread_256k_qd1_psync",
           "read_clat_p50_us", "p50_us", "us", 1.1, False),
    Target("put_1m", "CPU per GB: put 1 MiB from aligned memory", None, None, "cpu_s_per_gb",
           "core-s/GB", 0.15, False),
    Target("put_256k", "CPU per GB: put 256 KiB from aligned memory", None, None,
           "cpu_s_per_gb", "core-s/GB", 0.15, False),
    Target("get_many_into", "CPU per GB: get_many_into 256 KiB, aligned", None, None,
           "cpu_s_per_gb", "core-s/GB", 0.15, False),
)  # fmt: skip

# Informational rows (no target): (workload, label, fio profile, fio metric, kv metric, unit).
EXTRA_ROWS = (
    ("get", "get 256 KiB median vs fio lat (slat+clat) p50", "randread_256k_qd1",
     "read_lat_p50_us", "p50_us", "us"),
    ("get", "get 256 KiB median vs fio io_uring qd1 clat p50", "randread_256k_qd1",
     "read_clat_p50_us", "p50_us", "us"),
    ("put_1m_sync", "durable put 1 MiB x32 + flush, 1 thread, not pipelined",
     "seq_write_1m_sync32", "write_mbps", "mbps", "MB/s"),
    ("put_256k_sync", "durable put 256 KiB x32 + flush, 1 thread, not pipelined",
     "seq_write_256k_sync32", "write_mbps", "mbps", "MB/s"),
    ("put_1m_bytes", "durable put 1 MiB, pipelined, from bytes (copied)", "seq_write_1m_sync32",
     "write_mbps", "mbps", "MB/s"),
    ("put_1m", "durable put 1 MiB, pipelined, vs fio without syncs", "seq_write_1m",
     "write_mbps", "mbps", "MB/s"),
    ("put_256k", "durable put 256 KiB, pipelined, vs fio without syncs", "seq_write_256k",
     "write_mbps", "mbps", "MB/s"),
    ("put_1m_x4", "CPU per GB: put 1 MiB, 4 threads", None, None, "cpu_s_per_gb", "core-s/GB"),
    ("put_256k_x4", "CPU per GB: put 256 KiB, 4 threads", None, None, "cpu_s_per_gb",
     "core-s/GB"),
    ("put_1m_sync", "CPU per GB: put 1 MiB, not pipelined", None, None, "cpu_s_per_gb",
     "core-s/GB"),
    ("put_1m_bytes", "CPU per GB: put 1 MiB from bytes (copied)", None, None, "cpu_s_per_gb",
     "core-s/GB"),
    ("get_many", "CPU per GB: get_many 256 KiB (bytes)", None, None, "cpu_s_per_gb",
     "core-s/GB"),
    # The CPU targets above are absolute; these put fio's own CPU for the same I/O beside
    # them (docs/benchmarks.md: the kernel's share differs between machines).
    ("put_1m", "CPU per GB: put 1 MiB vs fio's own (same syncs)", "seq_write_1m_sync32",
     "cpu_s_per_gb", "cpu_s_per_gb", "core-s/GB"),
    ("put_256k", "CPU per GB: put 256 KiB vs fio's own (same syncs)", "seq_write_256k_sync32",
     "cpu_s_per_gb", "cpu_s_per_gb", "core-s/GB"),
    ("get_many_into", "CPU per GB: get_many_into 256 KiB vs fio randread QD32's own",
     "randread_256k_qd32", "cpu_s_per_gb", "cpu_s_per_gb", "core-s/GB"),
    ("get", "get 256 KiB p99 latency (vs fio clat p99)", "randread_256k_qd1",
     "read_clat_p99_us", "p99_us", "us"),
    ("put_1m", "put 1 MiB: batch (32 MiB) latency p50", "seq_write_1m", None, "batch_p50_ms", "ms"),
    ("put_256k", "put 256 KiB: batch (8 MiB) latency p50", "seq_write_256k", None, "batch_p50_ms",
     "ms"),
    ("get_many", "get_many: call (16 MiB) latency p50", "randread_256k_qd32", None, "call_p50_ms",
     "ms"),
    (None, "fio mixed 70/30 256k qd32 read", "mixed_70_30", "read_mbps", None, "MB/s"),
    (None, "fio mixed 70/30 256k qd32 write", "mixed_70_30", "write_mbps", None, "MB/s"),
    (None, "fio WAL append 4k + fdatasync p50", "wal_append", "sync_p50_us", None, "us"),
    (None, "fio WAL append 4k + fdatasync IOPS", "wal_append", "write_iops", None, "IOPS"),
)  # fmt: skip


# -- small helpers -------------------------------------------------------------


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile (``pct`` in 0..100) of ``values``; nan when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100.0 * len(ordered)))
    return float(ordered[rank - 1])


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def settle(seconds: float) -> None:
    """Let deferred work (writeback, ext4 discards of freed blocks) finish between workloads."""
    os.sync()
    if seconds > 0:
        time.sleep(seconds)


def cpu_seconds() -> tuple[float, float, int]:
    """User and system CPU seconds of this process, and its minor page faults."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime, usage.ru_minflt


@contextmanager
def maybe_profile(profile_dir: Path | None, name: str) -> Iterator[None]:
    """cProfile the block into ``profile_dir/name.prof`` when profiling is on."""
    if profile_dir is None:
        yield
        return
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        profile_dir.mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(profile_dir / f"{name}.prof")


# -- machine description -------------------------------------------------------


def _block_device(path: Path) -> dict[str, str]:
    dev = os.stat(path).st_dev
    sys_dir = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if not sys_dir.exists():
        return {}
    queue = sys_dir / "queue"
    if not queue.exists():  # a partition: the queue lives on the parent disk
        queue = sys_dir.resolve().parent / "queue"
    info = {"name": sys_dir.resolve().name}
    size_sectors = read_sysfs(str(sys_dir / "size"))
    if size_sectors.isdigit():
        info["size_gib"] = f"{int(size_sectors) * 512 / (1 << 30):.0f}"
    for key in ("scheduler", "rotational", "nr_requests", "max_sectors_kb", "logical_block_size"):
        info[key] = read_sysfs(str(queue / key))
    info["model"] = read_sysfs(str(sys_dir.resolve() / "device" / "model"))
    return info


def pressure() -> dict[str, float]:
    """PSI ``some avg10`` for io and cpu: how much other work was competing just now."""
    found: dict[str, float] = {}
    for resource_name in ("io", "cpu"):
        for line in read_sysfs(f"/proc/pressure/{resource_name}").splitlines():
            if line.startswith("some"):
                fields = dict(part.split("=", 1) for part in line.split()[1:])
                found[resource_name] = float(fields.get("avg10", "nan"))
    return found


def machine_info(bench_dir: Path, fio: str) -> dict[str, Any]:
    """``kvstore bench``'s machine facts, with the fio version and the block device."""
    import kvstore

    info: dict[str, Any] = dict(common_machine_info(bench_dir))
    try:
        fio_version = subprocess.run(
            [fio, "--version"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:  # not installed: a --skip-fio run needs no fio
        fio_version = "not found"
    info.update(
        kvstore=kvstore.__version__,
        fio=fio_version,
        block_device=_block_device(bench_dir),
        loadavg_start=os.getloadavg(),
    )
    return info


# -- fio -----------------------------------------------------------------------


@dataclass(slots=True)
class FioResult:
    profile: str
    read_mbps: float
    write_mbps: float
    read_iops: float
    write_iops: float
    read_clat_p50_us: float
    read_clat_p99_us: float
    read_lat_mean_us: float
    read_lat_p50_us: float
    read_slat_mean_us: float
    write_clat_p50_us: float
    sync_p50_us: float
    sync_p99_us: float
    runtime_s: float
    usr_cpu_pct: float
    sys_cpu_pct: float
    loadavg: float
    pressure: dict[str, float]

    @property
    def cpu_s_per_gb(self) -> float:
        """fio's own CPU (user + system) per 10^9 bytes moved: what the kernel (and, on a
        virtual machine, the hypervisor's exits) costs the same I/O without kvstore's work.
        The reference beside kvstore's CPU per GB (fio's percentages are of one CPU)."""
        mbps = self.read_mbps + self.write_mbps
        return (self.usr_cpu_pct + self.sys_cpu_pct) * 10.0 / mbps if mbps > 0 else math.nan


def _pct_us(stats: dict[str, Any], pct: str) -> float:
    value = stats.get("percentile", {}).get(pct)
    return value / 1000.0 if value is not None else math.nan


def parse_fio(profile: str, document: dict[str, Any]) -> FioResult:
    """Pull the numbers the report uses out of ``fio --output-format=json``."""
    job = document["jobs"][0]
    if job.get("error"):
        raise RuntimeError(f"fio profile {profile} failed with error {job['error']}")
    read, write, sync = job["read"], job["write"], job.get("sync", {})
    return FioResult(
        profile=profile,
        read_mbps=read["bw_bytes"] / 1e6,
        write_mbps=write["bw_bytes"] / 1e6,
        read_iops=read["iops"],
        write_iops=write["iops"],
        read_clat_p50_us=_pct_us(read["clat_ns"], "50.000000"),
        read_clat_p99_us=_pct_us(read["clat_ns"], "99.000000"),
        read_lat_mean_us=read["lat_ns"]["mean"] / 1000.0,
        read_lat_p50_us=_pct_us(read["lat_ns"], "50.000000"),
        read_slat_mean_us=read["slat_ns"]["mean"] / 1000.0,
        write_clat_p50_us=_pct_us(write["clat_ns"], "50.000000"),
        sync_p50_us=_pct_us(sync.get("lat_ns", {}), "50.000000"),
        sync_p99_us=_pct_us(sync.get("lat_ns", {}), "99.000000"),
        runtime_s=job["job_runtime"] / 1000.0,
        usr_cpu_pct=job["usr_cpu"],
        sys_cpu_pct=job["sys_cpu"],
        loadavg=os.getloadavg()[0],
        pressure=pressure(),
    )


def run_fio(fio: str, profile: str, bench_dir: Path, size_mib: int, runtime_s: int) -> FioResult:
    env = dict(os.environ)
    env.update(
        BENCH_DIR=str(bench_dir.resolve()),
        BENCH_SIZE=f"{size_mib}m",
        BENCH_RUNTIME=str(min(runtime_s, WAL_RUNTIME_S) if profile == "wal_append" else runtime_s),
    )
    job_file = PROFILES_DIR / f"{profile}.fio"
    with tempfile.NamedTemporaryFile(prefix="fio-", suffix=".json", dir=bench_dir) as output:
        command = [fio, "--output-format=json", f"--output={output.name}", str(job_file)]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"fio {profile} exited {done.returncode}: {done.stderr.strip() or done.stdout}"
            )
        text = Path(output.name).read_text()
    # fio may print notes before the JSON document; start at the first brace.
    return parse_fio(profile, json.loads(text[text.index("{") :]))


# -- kvstore workloads ----------------------------------------------------------

# workload: (page bytes, caller threads, pipelined, pages in aligned memory)
PUT_MODES = {
    "put_1m": (MIB, 1, True, True),
    "put_256k": (256 * KIB, 1, True, True),
    "put_1m_x4": (MIB, 4, False, True),
    "put_256k_x4": (256 * KIB, 4, False, True),
    "put_1m_sync": (MIB, 1, False, True),
    "put_256k_sync": (256 * KIB, 1, False, True),
    "put_1m_bytes": (MIB, 1, True, False),
}
PUT_WORKLOADS = tuple(PUT_MODES)


@dataclass(slots=True)
class KvResult:
    workload: str
    page_bytes: int
    ops: int
    bytes: int
    seconds: float
    mbps: float
    cpu_user_s: float
    cpu_sys_s: float
    minor_faults: int
    loadavg: float
    pressure: dict[str, float]
    p50_us: float = math.nan
    p99_us: float = math.nan
    batch_p50_ms: float = math.nan
    batch_p99_ms: float = math.nan
    call_p50_ms: float = math.nan
    call_p99_ms: float = math.nan
    # Process CPU (user + system, every thread) per 10^9 payload bytes moved.
    cpu_s_per_gb: float = math.nan
    notes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StoreOptions:
    segment_bytes: int
    io_depth: int
    io_engine: str = "auto"
    uring_binding: str = "auto"
    pipeline_depth: int = 2


def open_store(root: Path, options: StoreOptions, *, create: bool = False) -> KVStore:
    store = KVStore.open(
        root,
        create=create,
        segment_bytes=options.segment_bytes,
        io_depth=options.io_depth,
        io_engine=options.io_engine,
        uring_binding=options.uring_binding,
        pipeline_depth=options.pipeline_depth,
    )
    stats = store.stats()
    if not stats.direct_io:
        store.close()
        raise RuntimeError(f"{root}: O_DIRECT is refused here; reads would hit the page cache")
    return store


def engine_in_force(options: StoreOptions) -> str:
    """Which engine the stores of this run get, and why (the probe's reason)."""
    from kvstore.io.engine import make_engine

    engine = make_engine(options.io_engine, options.io_depth, options.uring_binding)
    try:
        return engine.why
    finally:
        engine.close()


def page_key(page_bytes: int, index: int) -> bytes:
    return b"bench/%d/%09d" % (page_bytes, index)


def aligned_payloads(count: int, page_bytes: int) -> list[memoryview]:
    """``count`` random pages in one anonymous mmap (4 KiB aligned, writable): what
    the store writes without copying (an arena's slots, pinned staging, aligned
    numpy/torch buffers)."""
    region = mmap.mmap(-1, count * page_bytes)
    for i in range(count):
        region[i * page_bytes : (i + 1) * page_bytes] = os.urandom(page_bytes)
    view = memoryview(region)
    return [view[i * page_bytes : (i + 1) * page_bytes] for i in range(count)]


def durable_puts(
    root: Path,
    options: StoreOptions,
    payloads: Sequence[bytes | memoryview],
    total_bytes: int,
    batch: int,
    profile_dir: Path | None,
    *,
    workload: str,
    threads: int = 1,
    pipelined: bool = False,
    sync: bool = True,
) -> KvResult:
    """Durable batches of ``batch`` pages until ``total_bytes`` of pages are durable.

    ``pipelined``: one caller keeps ``pipeline_depth`` batches of
    ``put_many_async(batch, sync=True)`` in flight (each acknowledged once durable).
    Else each of ``threads`` callers runs ``put_many(batch); flush()`` on its share of
    the batches. Batch latency: from the call to the batch being durable. ``sync``
    False: the same puts, left to the flusher's group commits (what the commit costs,
    by difference).
    """
    page_bytes = len(payloads[0])
    batches = max(1, total_bytes // (page_bytes * batch))
    work = [
        [
            (page_key(page_bytes, b * batch + i), payloads[(b * batch + i) % len(payloads)])
            for i in range(batch)
        ]
        for b in range(batches)
    ]
    remove_tree(root)
    store = open_store(root, options, create=True)
    latencies: list[float] = []

    def run_share(share: list[list[tuple[bytes, bytes | memoryview]]]) -> None:
        for items in share:
            t0 = time.perf_counter()
            store.put_many(items)
            if sync:
                store.flush()
            latencies.append(time.perf_counter() - t0)

    def run_pipelined() -> None:
        window: collections.deque[tuple[float, Future[list[bool]]]] = collections.deque()
        for items in work:
            if len(window) >= options.pipeline_depth:
                t0, future = window.popleft()
                future.result()
                latencies.append(time.perf_counter() - t0)
            window.append((time.perf_counter(), store.put_many_async(items, sync=sync)))
        while window:
            t0, future = window.popleft()
            future.result()
            latencies.append(time.perf_counter() - t0)

    try:
        user0, sys0, faults0 = cpu_seconds()
        with maybe_profile(profile_dir, workload):
            start = time.perf_counter()
            if pipelined:
                run_pipelined()
            elif threads == 1:
                run_share(work)
            else:
                callers = [
                    threading.Thread(target=run_share, args=(work[t::threads],))
                    for t in range(threads)
                ]
                for caller in callers:
                    caller.start()
                for caller in callers:
                    caller.join()
            seconds = time.perf_counter() - start
        user1, sys1, faults1 = cpu_seconds()
        stats = store.stats()
    finally:
        store.close()
    total = batches * batch * page_bytes
    if stats.pages != batches * batch:
        raise RuntimeError(f"{root}: expected {batches * batch} pages, store has {stats.pages}")
    return KvResult(
        workload=workload,
        page_bytes=page_bytes,
        ops=batches * batch,
        bytes=total,
        seconds=seconds,
        mbps=total / seconds / 1e6,
        cpu_user_s=user1 - user0,
        cpu_sys_s=sys1 - sys0,
        minor_faults=faults1 - faults0,
        loadavg=os.getloadavg()[0],
        pressure=pressure(),
        batch_p50_ms=percentile(latencies, 50) * 1e3,
        batch_p99_ms=percentile(latencies, 99) * 1e3,
        cpu_s_per_gb=(user1 - user0 + sys1 - sys0) / (total / 1e9),
        notes={
            "batches": batches,
            "batch_pages": batch,
            "threads": threads,
            "pipelined": pipelined,
            "sync": sync,
            "pipeline_depth": options.pipeline_depth if pipelined else 0,
            "payload": "bytes" if isinstance(payloads[0], bytes) else "aligned memory",
            "segments": stats.segments,
            "commits": stats.counters.get("commits", 0),
            "segment_bytes_written": stats.counters.get("segment_bytes_written", 0),
        },
    )


def fill_store(
    root: Path, options: StoreOptions, payloads: Sequence[bytes], total_bytes: int
) -> list[bytes]:
    """Write ``total_bytes`` of pages (untimed) for the read workloads; return the keys."""
    page_bytes = len(payloads[0])
    count = max(64, total_bytes // page_bytes)
    keys = [page_key(page_bytes, i) for i in range(count)]
    remove_tree(root)
    with open_store(root, options, create=True) as store:
        for first in range(0, count, 256):
            store.put_many(
                [
                    (keys[i], payloads[i % len(payloads)])
                    for i in range(first, min(first + 256, count))
                ]
            )
        store.flush()
    return keys


def get_many_workload(
    store: KVStore,
    keys: Sequence[bytes],
    payloads: Sequence[bytes],
    per_call: int,
    target_bytes: int,
    max_seconds: float,
    rng: random.Random,
    profile_dir: Path | None,
) -> KvResult:
    """``get_many`` of ``per_call`` distinct random keys until ``target_bytes`` or time is up."""
    page_bytes = len(payloads[0])
    index = {key: i for i, key in enumerate(keys)}
    # Warm-up call (untimed): creates the ring and the buffers, and checks the bytes.
    sample = rng.sample(keys, per_call)
    for key, value in zip(sample, store.get_many(sample), strict=True):
        if value != payloads[index[key] % len(payloads)]:
            raise RuntimeError(f"get_many returned wrong bytes for {key!r}")
    calls = max(20, target_bytes // (per_call * page_bytes))
    plan = [rng.sample(keys, per_call) for _ in range(calls)]
    latencies: list[float] = []
    done = 0
    user0, sys0, faults0 = cpu_seconds()
    with maybe_profile(profile_dir, "get_many"):
        start = time.perf_counter()
        for wanted in plan:
            t0 = time.perf_counter()
            values = store.get_many(wanted)
            now = time.perf_counter()
            latencies.append(now - t0)
            done += 1
            if any(value is None for value in values):
                raise RuntimeError("get_many missed a page that was written")
            if now - start >= max_seconds:
                break
        seconds = time.perf_counter() - start
    user1, sys1, faults1 = cpu_seconds()
    total = done * per_call * page_bytes
    return KvResult(
        workload="get_many",
        page_bytes=page_bytes,
        ops=done * per_call,
        bytes=total,
        seconds=seconds,
        mbps=total / seconds / 1e6,
        cpu_user_s=user1 - user0,
        cpu_sys_s=sys1 - sys0,
        minor_faults=faults1 - faults0,
        loadavg=os.getloadavg()[0],
        pressure=pressure(),
        call_p50_ms=percentile(latencies, 50) * 1e3,
        call_p99_ms=percentile(latencies, 99) * 1e3,
        cpu_s_per_gb=(user1 - user0 + sys1 - sys0) / (total / 1e9),
        notes={"calls": done, "pages_per_call": per_call, "store_pages": len(keys)},
    )


def get_many_into_workload(
    store: KVStore,
    keys: Sequence[bytes],
    payloads: Sequence[bytes],
    per_call: int,
    target_bytes: int,
    max_seconds: float,
    rng: random.Random,
    depth: int,
) -> KvResult:
    """``get_many_into_async`` of ``per_call`` random keys into 4 KiB-aligned buffers
    (read there without a copy), ``depth`` calls in flight, each with its own buffers,
    until ``target_bytes`` or time is up."""
    page_bytes = len(payloads[0])
    index = {key: i for i, key in enumerate(keys)}
    region = mmap.mmap(-1, depth * per_call * page_bytes)
    view = memoryview(region)
    slots = [
        [
            view[(d * per_call + i) * page_bytes : (d * per_call + i + 1) * page_bytes]
            for i in range(per_call)
        ]
        for d in range(depth)
    ]
    sample = rng.sample(keys, per_call)  # warm-up (untimed), and a check of the bytes
    store.get_many_into(sample, slots[0])
    for key, got in zip(sample, slots[0], strict=True):
        if got != payloads[index[key] % len(payloads)]:
            raise RuntimeError(f"get_many_into read wrong bytes for {key!r}")
    calls = max(20, target_bytes // (per_call * page_bytes))
    plan = [rng.sample(keys, per_call) for _ in range(calls)]
    latencies: list[float] = []
    done = 0
    window: collections.deque[tuple[float, Future[list[int | None]]]] = collections.deque()

    def finish_oldest() -> float:
        nonlocal done
        t0, future = window.popleft()
        if any(size is None for size in future.result()):
            raise RuntimeError("get_many_into missed a page that was written")
        now = time.perf_counter()
        latencies.append(now - t0)
        done += 1
        return now

    user0, sys0, faults0 = cpu_seconds()
    start = time.perf_counter()
    for call, wanted in enumerate(plan):
        if len(window) >= depth and finish_oldest() - start >= max_seconds:
            break
        window.append((time.perf_counter(), store.get_many_into_async(wanted, slots[call % depth])))
    while window:
        finish_oldest()
    seconds = time.perf_counter() - start
    user1, sys1, faults1 = cpu_seconds()
    total = done * per_call * page_bytes
    return KvResult(
        workload="get_many_into",
        page_bytes=page_bytes,
        ops=done * per_call,
        bytes=total,
        seconds=seconds,
        mbps=total / seconds / 1e6,
        cpu_user_s=user1 - user0,
        cpu_sys_s=sys1 - sys0,
        minor_faults=faults1 - faults0,
        loadavg=os.getloadavg()[0],
        pressure=pressure(),
        call_p50_ms=percentile(latencies, 50) * 1e3,
        call_p99_ms=percentile(latencies, 99) * 1e3,
        cpu_s_per_gb=(user1 - user0 + sys1 - sys0) / (total / 1e9),
        notes={"calls": done, "pages_per_call": per_call, "calls_in_flight": depth},
    )


def get_latency_workload(
    store: KVStore,
    keys: Sequence[bytes],
    page_bytes: int,
    max_gets: int,
    max_seconds: float,
    rng: random.Random,
    profile_dir: Path | None,
) -> KvResult:
    """Single ``get`` of a random page, one at a time; per-call latency percentiles."""
    for key in rng.sample(keys, 16):  # warm-up (untimed)
        store.get(key)
    plan = [rng.choice(keys) for _ in range(max_gets)]
    latencies: list[float] = []
    clock = time.perf_counter_ns
    user0, sys0, faults0 = cpu_seconds()
    with maybe_profile(profile_dir, "get"):
        start = time.perf_counter()
        deadline = clock() + int(max_seconds * 1e9)
        for key in plan:
            t0 = clock()
            value = store.get(key)
            t1 = clock()
            latencies.append((t1 - t0) / 1000.0)
            if value is None:
                raise RuntimeError(f"get missed {key!r}")
            if t1 >= deadline:
                break
        seconds = time.perf_counter() - start
    user1, sys1, faults1 = cpu_seconds()
    total = len(latencies) * page_bytes
    return KvResult(
        workload="get",
        page_bytes=page_bytes,
        ops=len(latencies),
        bytes=total,
        seconds=seconds,
        mbps=total / seconds / 1e6,
        cpu_user_s=user1 - user0,
        cpu_sys_s=sys1 - sys0,
        minor_faults=faults1 - faults0,
        loadavg=os.getloadavg()[0],
        pressure=pressure(),
        p50_us=percentile(latencies, 50),
        p99_us=percentile(latencies, 99),
        notes={"mean_us": sum(latencies) / len(latencies), "max_us": max(latencies)},
    )


# -- report --------------------------------------------------------------------


@dataclass(slots=True)
class Row:
    label: str
    unit: str
    kv: float | None
    fio: float | None
    ratio: float | None
    fio_recheck: float | None
    ratio_recheck: float | None
    target: str
    status: str  # PASS / FAIL against both fio runs, MIXED when they disagree, "" for info rows


def _ratio(kv_value: float | None, fio_value: float | None) -> float | None:
    if kv_value is None or not fio_value or math.isnan(kv_value) or math.isnan(fio_value):
        return None
    return kv_value / fio_value


def _metric(result: FioResult | KvResult | None, metric: str | None) -> float | None:
    if result is None or metric is None:
        return None
    value = getattr(result, metric)
    return None if value is None else float(value)


def _status(target: Target, *ratios: float | None) -> str:
    """PASS/FAIL when every measured fio baseline agrees, MIXED when they do not."""
    verdicts = {
        (ratio >= target.bound if target.higher_is_better else ratio <= target.bound)
        for ratio in ratios
        if ratio is not None
    }
    if not verdicts:
        return ""
    if len(verdicts) == 2:
        return "MIXED"
    return "PASS" if verdicts == {True} else "FAIL"


def build_rows(
    fio: dict[str, FioResult], kv: dict[str, KvResult], recheck: dict[str, FioResult]
) -> list[Row]:
    """Target rows (pass/fail on the fio run before kvstore), then informational rows."""
    rows: list[Row] = []
    for target in TARGETS:
        kv_value = _metric(kv.get(target.workload), target.kv_metric)
        if target.fio_profile is None:  # an absolute bound (CPU per byte): no fio column
            verdict = _status(target, kv_value)
            rows.append(
                Row(target.label, target.unit, kv_value, None, None, None, None,
                    target.describe(), verdict)
            )  # fmt: skip
            continue
        fio_value = _metric(fio.get(target.fio_profile), target.fio_metric)
        again = _metric(recheck.get(target.fio_profile), target.fio_metric)
        ratio = _ratio(kv_value, fio_value)
        ratio_again = _ratio(kv_value, again)
        rows.append(
            Row(
                target.label,
                target.unit,
                kv_value,
                fio_value,
                ratio,
                again,
                ratio_again,
                target.describe(),
                _status(target, ratio, ratio_again),
            )
        )
    for workload, label, profile, fio_metric, kv_metric, unit in EXTRA_ROWS:
        kv_value = _metric(kv.get(workload) if workload else None, kv_metric)
        fio_value = _metric(fio.get(profile) if profile else None, fio_metric)
        again = _metric(recheck.get(profile) if profile else None, fio_metric)
        if kv_value is None and fio_value is None:
            continue
        rows.append(
            Row(
                label,
                unit,
                kv_value,
                fio_value,
                _ratio(kv_value, fio_value),
                again,
                _ratio(kv_value, again),
                "-",
                "",
            )
        )
    return rows


def _fmt(value: float | None, digits: int = 0) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value:,.{digits}f}"


def print_table(rows: list[Row], title: str, to_stderr: bool) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text fallback
        out = sys.stderr if to_stderr else sys.stdout
        print(title, file=out)
        for row in rows:
            digits = {"ms": 1, "core-s/GB": 3}.get(row.unit, 0)
            print(
                f"{row.label:<48} {_fmt(row.kv, digits):>9} {_fmt(row.fio, digits):>9} "
                f"{_fmt(row.ratio, 2):>6} "
                f"{_fmt(row.fio_recheck):>9} {_fmt(row.ratio_recheck, 2):>6} {row.target:>8} "
                f"{row.status}",
                file=out,
            )
        return
    table = Table(title=title)
    table.add_column("workload")
    table.add_column("unit")
    table.add_column("kvstore", justify="right")
    table.add_column("fio", justify="right")
    table.add_column("ratio", justify="right")
    table.add_column("fio after", justify="right")
    table.add_column("ratio", justify="right")
    table.add_column("target", justify="right")
    table.add_column("", justify="center")
    for row in rows:
        colour = {"PASS": "[green]", "FAIL": "[red]", "MIXED": "[yellow]"}.get(row.status, "")
        status = colour + row.status
        digits = {"ms": 1, "core-s/GB": 3}.get(row.unit, 0)
        table.add_row(
            row.label,
            row.unit,
            _fmt(row.kv, digits),
            _fmt(row.fio, digits),
            _fmt(row.ratio, 2),
            _fmt(row.fio_recheck, digits),
            _fmt(row.ratio_recheck, 2),
            row.target,
            status,
        )
    Console(stderr=to_stderr, width=140).print(table)


def run_fio_phase(
    args: argparse.Namespace,
    bench_dir: Path,
    size_mib: int,
    runtime: int,
    results: dict[str, FioResult],
) -> None:
    if args.warmup:
        # On the virtio disk this was written on, the fio write baselines before kvstore ran
        # 15-35% below the same profiles after it; a warm-up pass did not remove that (the
        # recheck columns show it), so it is off by default.
        log("fio seq_write_1m (untimed warm-up) ...")
        run_fio(args.fio, "seq_write_1m", bench_dir, size_mib, runtime)
        settle(args.settle)
    for profile in FIO_PROFILES:
        log(f"fio {profile} ...")
        result = run_fio(args.fio, profile, bench_dir, size_mib, runtime)
        results[profile] = result
        log(
            f"  read {result.read_mbps:,.0f} MB/s  write {result.write_mbps:,.0f} MB/s  "
            f"read clat p50 {_fmt(result.read_clat_p50_us)} us  ({result.runtime_s:.1f}s)"
        )
    settle(args.settle)


def run_recheck_phase(
    args: argparse.Namespace,
    bench_dir: Path,
    size_mib: int,
    runtime: int,
    results: dict[str, FioResult],
) -> None:
    settle(args.settle)
    for profile in RECHECK_PROFILES:
        log(f"fio {profile} (recheck) ...")
        result = run_fio(args.fio, profile, bench_dir, size_mib, runtime)
        results[profile] = result
        log(
            f"  read {result.read_mbps:,.0f} MB/s  write {result.write_mbps:,.0f} MB/s  "
            f"read clat p50 {_fmt(result.read_clat_p50_us)} us"
        )


def run_kvstore_phase(
    args: argparse.Namespace,
    bench_dir: Path,
    total_bytes: int,
    runtime: int,
    options: StoreOptions,
    rng: random.Random,
    results: dict[str, KvResult],
) -> None:
    only = set(args.only or (*PUT_WORKLOADS, "reads"))
    # Random payloads, generated once and reused, so generation is never timed.
    payloads_by_kind: dict[tuple[int, bool], Sequence[bytes | memoryview]] = {}
    for workload in PUT_WORKLOADS:
        if workload not in only:
            continue
        page_bytes, threads, pipelined, aligned = PUT_MODES[workload]
        payloads = payloads_by_kind.get((page_bytes, aligned))
        if payloads is None:
            payloads = payloads_by_kind[(page_bytes, aligned)] = (
                aligned_payloads(args.batch, page_bytes)
                if aligned
                else [os.urandom(page_bytes) for _ in range(args.batch)]
            )
        root = bench_dir / f"kv-{workload}"
        log(f"kvstore {workload}: {total_bytes // page_bytes} pages ...")
        put = durable_puts(
            root,
            options,
            payloads,
            total_bytes,
            args.batch,
            args.profile_dir,
            workload=workload,
            threads=threads,
            pipelined=pipelined,
        )
        results[workload] = put
        log(
            f"  {put.mbps:,.0f} MB/s in {put.seconds:.1f}s, batch p50 "
            f"{put.batch_p50_ms:.1f} ms p99 {put.batch_p99_ms:.1f} ms, "
            f"{put.cpu_s_per_gb:.3f} core-s/GB"
        )
        if not args.keep:
            remove_tree(root)
        settle(args.settle)
    if "reads" not in only:
        return
    page_bytes = 256 * KIB
    pages = [os.urandom(page_bytes) for _ in range(64)]
    root = bench_dir / "kv-reads"
    log(f"kvstore reads: filling {total_bytes // MIB} MiB of 256 KiB pages (untimed) ...")
    keys = fill_store(root, options, pages, total_bytes)
    settle(args.settle)
    try:
        with open_store(root, options) as store:  # reopened: the index comes from LMDB
            log("kvstore get_many ...")
            many = get_many_workload(
                store, keys, pages, args.get_batch, total_bytes, runtime, rng, args.profile_dir
            )
            results["get_many"] = many
            log(f"  {many.mbps:,.0f} MB/s, call p50 {many.call_p50_ms:.1f} ms")
            log("kvstore get_many_into (aligned buffers, pipelined) ...")
            into = get_many_into_workload(
                store,
                keys,
                pages,
                args.get_batch,
                total_bytes,
                runtime,
                rng,
                options.pipeline_depth,
            )
            results["get_many_into"] = into
            log(
                f"  {into.mbps:,.0f} MB/s, call p50 {into.call_p50_ms:.1f} ms, "
                f"{into.cpu_s_per_gb:.3f} core-s/GB"
            )
            log("kvstore get latency ...")
            single = get_latency_workload(
                store,
                keys,
                page_bytes,
                max(1000, total_bytes // page_bytes),
                runtime,
                rng,
                args.profile_dir,
            )
            results["get"] = single
            log(f"  p50 {single.p50_us:,.0f} us p99 {single.p99_us:,.0f} us")
    finally:
        if not args.keep:
            remove_tree(root)


# -- main ----------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Benchmark kvstore against fio baselines on the same directory."
    )
    parser.add_argument("--dir", type=Path, default=Path("./bench-data"), help="scratch directory")
    parser.add_argument(
        "--size-mib",
        type=int,
        default=None,
        help="bytes per write workload, fio file size and read-store size (default 4096; 512 "
        "with --quick)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print JSON on stdout (table to stderr)"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON to this file")
    parser.add_argument("--quick", action="store_true", help="small sizes and short time caps")
    parser.add_argument("--runtime", type=int, default=None, help="cap per workload, seconds")
    parser.add_argument("--batch", type=int, default=32, help="pages per put_many (default 32)")
    parser.add_argument("--get-batch", type=int, default=64, help="pages per get_many (64)")
    parser.add_argument("--io-depth", type=int, default=32, help="store io_depth (default 32)")
    parser.add_argument(
        "--pipeline-depth",
        type=int,
        default=2,
        help="store pipeline_depth: pipelined batches in flight (default 2)",
    )
    parser.add_argument("--segment-mib", type=int, default=256, help="store segment size")
    parser.add_argument("--settle", type=float, default=2.0, help="pause between workloads, s")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--fio", default=shutil.which("fio") or "fio", help="fio binary")
    parser.add_argument("--skip-fio", action="store_true", help="kvstore workloads only")
    parser.add_argument("--skip-kvstore", action="store_true", help="fio profiles only")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=(*PUT_WORKLOADS, "reads"),
        default=None,
        help="run only these kvstore workloads",
    )
    parser.add_argument(
        "--profile-dir",
        type=Path,
        default=None,
        help="cProfile each kvstore workload into DIR/<workload>.prof (slows it down)",
    )
    parser.add_argument(
        "--recheck",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="rerun the target fio profiles after kvstore to show drift (default on)",
    )
    parser.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="one untimed fio seq_write_1m pass before the baselines",
    )
    parser.add_argument(
        "--engine",
        nargs="+",
        choices=("auto", "io_uring", "threadpool"),
        default=["auto"],
        help="the store's io_engine (default auto: io_uring where its probe passes); "
        "several run the kvstore workloads once each, between the same fio runs",
    )
    parser.add_argument(
        "--binding",
        choices=("auto", "liburing-2024", "liburing-2026"),
        default="auto",
        help="the io_uring binding to demand (it must be the importable liburing)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the data files afterwards")
    parser.add_argument(
        "--report", type=Path, default=None, help="only print the table of a saved --out JSON"
    )
    return parser.parse_args(argv)


def make_title(
    machine: dict[str, Any], size_mib: int, io_depth: int, *, quick: bool = False
) -> str:
    code = machine.get("code", {})
    engine = machine.get("io_engine")
    caveat = f" ({SMOKE_TEST_CAVEAT})" if quick else ""
    return (
        f"kvstore vs fio{caveat} - {size_mib} MiB, io_depth {io_depth}, "
        f"{f'engine: {engine}, ' if engine else ''}"
        f"{machine.get('nproc')} CPUs, {machine.get('mount', {}).get('fs', '?')} on "
        f"{machine.get('block_device', {}).get('name', '?')}, kvstore {code.get('git_head', '?')}"
        f"{'+dirty' if code.get('kvstore_dirty') else ''}"
    )


def rerender(path: Path) -> int:
    """Print the table of a run saved with ``--out``, judged by this version's targets."""
    document = json.loads(path.read_text())
    fio = {name: FioResult(**values) for name, values in document["fio"].items()}
    kv = {name: KvResult(**values) for name, values in document["kvstore"].items()}
    recheck = {name: FioResult(**values) for name, values in document["fio_recheck"].items()}
    settings = document["settings"]
    title = make_title(
        document["machine"],
        settings["size_mib"],
        settings["io_depth"],
        quick=bool(settings.get("quick")),
    )
    print_table(build_rows(fio, kv, recheck), title, to_stderr=False)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report is not None:
        return rerender(args.report)
    if not args.skip_fio and shutil.which(args.fio) is None:
        print(
            f"kvstore bench: fio not found ({args.fio!r}): install it (Debian/Ubuntu: "
            "apt-get install fio), name it with --fio PATH, or run --skip-fio",
            file=sys.stderr,
        )
        return 2
    size_mib: int = args.size_mib or (512 if args.quick else 4096)
    runtime: int = args.runtime or (10 if args.quick else 60)
    bench_dir: Path = args.dir
    bench_dir.mkdir(parents=True, exist_ok=True)
    total_bytes = size_mib * MIB
    engines = [
        StoreOptions(
            segment_bytes=args.segment_mib * MIB,
            io_depth=args.io_depth,
            io_engine=engine,
            uring_binding=args.binding,
            pipeline_depth=args.pipeline_depth,
        )
        for engine in dict.fromkeys(args.engine)
    ]
    rng = random.Random(args.seed)

    machine = machine_info(bench_dir, args.fio)
    engine_names = {options.io_engine: engine_in_force(options) for options in engines}
    machine["io_engine"] = engine_names[engines[0].io_engine]
    for name, why in engine_names.items():
        log(f"engine {name}: {why}")
    log(
        f"dir={machine['bench_dir']} fs={machine['mount'].get('fs')} size={size_mib} MiB "
        f"runtime cap={runtime}s nproc={machine['nproc']} load={machine['loadavg_start'][0]:.2f}"
    )

    fio_results: dict[str, FioResult] = {}
    kv_by_engine: dict[str, dict[str, KvResult]] = {options.io_engine: {} for options in engines}
    kv_results = kv_by_engine[engines[0].io_engine]
    recheck_results: dict[str, FioResult] = {}
    started = time.time()
    settle(args.settle)  # let a previous run's deletes (ext4 discards) and writeback drain
    try:
        if not args.skip_fio:
            run_fio_phase(args, bench_dir, size_mib, runtime, fio_results)
        if not args.skip_kvstore:
            for options in engines:
                log(f"-- kvstore on {engine_names[options.io_engine]}")
                results = kv_by_engine[options.io_engine]
                run_kvstore_phase(args, bench_dir, total_bytes, runtime, options, rng, results)
            if args.recheck and not args.skip_fio:
                run_recheck_phase(args, bench_dir, size_mib, runtime, recheck_results)
    finally:
        if not args.keep:
            for name in (
                "fio-read.dat",
                "fio-seqwrite-1m.dat",
                "fio-seqwrite-256k.dat",
                "fio-seqwrite-1m-sync32.dat",
                "fio-seqwrite-256k-sync32.dat",
            ):
                (bench_dir / name).unlink(missing_ok=True)
            os.sync()

    rows = build_rows(fio_results, kv_results, recheck_results)
    title = make_title(machine, size_mib, args.io_depth, quick=args.quick)
    others = {
        name: build_rows(fio_results, results, recheck_results)
        for name, results in kv_by_engine.items()
        if results is not kv_results
    }
    document = {
        "machine": machine,
        "settings": {
            "size_mib": size_mib,
            "runtime_cap_s": runtime,
            "batch": args.batch,
            "get_batch": args.get_batch,
            "io_depth": args.io_depth,
            "pipeline_depth": args.pipeline_depth,
            "segment_mib": args.segment_mib,
            "quick": args.quick,
            "warmup": args.warmup,
            "recheck": args.recheck,
            "profiled": args.profile_dir is not None,
            "seed": args.seed,
            "command": " ".join([sys.executable, *sys.argv]),
        },
        "started_unix": started,
        "elapsed_s": time.time() - started,
        "loadavg_end": os.getloadavg(),
        "fio": {name: asdict(result) for name, result in fio_results.items()},
        "kvstore": {name: asdict(result) for name, result in kv_results.items()},
        "engines": engine_names,
        "kvstore_by_engine": {
            engine: {name: asdict(result) for name, result in results.items()}
            for engine, results in kv_by_engine.items()
        },
        "table_by_engine": {
            engine: [asdict(row) for row in engine_rows] for engine, engine_rows in others.items()
        },
        "fio_recheck": {name: asdict(result) for name, result in recheck_results.items()},
        "table": [asdict(row) for row in rows],
    }
    text = json.dumps(finite(document), indent=2, default=_json_default, allow_nan=False)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print_table(rows, title, to_stderr=args.json)
    for engine, engine_rows in others.items():
        engine_machine = {**machine, "io_engine": engine_names[engine]}
        engine_title = make_title(engine_machine, size_mib, args.io_depth, quick=args.quick)
        print_table(engine_rows, engine_title, args.json)
    if args.json:
        print(text)
    return 0


def _json_default(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot encode {type(value).__name__}")


if __name__ == "__main__":
    sys.exit(main())

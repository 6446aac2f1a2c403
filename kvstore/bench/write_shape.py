"""Durable puts against the same I/O written by plain threads, interleaved in one process.

    .venv/bin/python tools/write_shape.py --dir ./bench-data               # 2 GiB per variant
    .venv/bin/python tools/write_shape.py --dir ./bench-data --rounds 3 --json

It separates what the store's own code costs a durable put from what the on-disk
format's I/O costs. Each round runs, in random order, on a fresh directory:

  store, sync          ``put_many_async(32 pages, sync=True)``, ``pipeline_depth``
                       batches in flight, pages in 4 KiB-aligned memory (written
                       without a copy): the bench's pipelined durable-put row
  store, no sync       the same with ``sync=False`` (the flusher commits every
                       ``flush_interval_ms``)
  threads, two flushes the store's I/O shape written by plain threads: each record a
                       4 KiB header block and its payload, records gathered into
                       O_DIRECT ``pwritev``s of up to the store's ``GATHER_BYTES``
                       (four 256 KiB pages, one 1 MiB page),
                       from 8 I/O threads, batches of 32 on ``pipeline_depth``
                       threads; per batch, under one lock, an ``fdatasync`` of the
                       data file, then a WAL-sized append and ``fdatasync`` of a
                       second file (the group commit's two flushes, in its order)
  threads, no flush    the same writes and no flush
  fio, sync32          fio's ``seq_write_256k_sync32`` / ``seq_write_1m_sync32``
                       profile (an fdatasync every 32 writes), when fio is found and
                       the page is 256 KiB or 1 MiB: the bench's reference

The threads have no checksums, index, WAL records or locks: what the store gets
below them is its own code's cost, not the format's or the commit's. (Their file is
preallocated before the clock starts, as fio's is; the store creates its segments as
it fills them, inside the timed run.) See
docs/benchmarks.md ("What limits 256 KiB durable puts").
"""

from __future__ import annotations

import argparse
import collections
import errno
import json
import mmap
import os
import random
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from kvstore.bench.common import KIB, MIB, NullReporter
from kvstore.bench.fio import FioStatus, find_fio, run_fio_profiles
from kvstore.bench.fio_ratios import StoreOptions, aligned_payloads, durable_puts
from kvstore.config import StoreConfig
from kvstore.format.constants import BLOCK_BYTES
from kvstore.io.files import open_data_file
from kvstore.runtime.writer import GATHER_BYTES

BATCH = 32  # pages per put_many call, as the bench's durable-put rows
IO_THREADS = 8
FIO_RUNTIME_S = 60  # BENCH_RUNTIME for run_fio_profiles; these profiles stop at their size
WAL_RECORD_BYTES = 100  # about a PUT record with a short key

VARIANTS = ("store, sync", "store, no sync", "threads, two flushes", "threads, no flush")
MIN_PAGE_KIB = 16  # smaller pages the store copies into its own buffers (another shape)
MAX_PAGE_KIB = 16 * 1024  # the store's default max_page_bytes
FIO = "fio, sync32"
FIO_PROFILE = {256 * KIB: "seq_write_256k_sync32", MIB: "seq_write_1m_sync32"}


def batch_of(payloads: Sequence[memoryview], index: int) -> list[memoryview]:
    """Batch ``index``'s pages: ``durable_puts``'s choice of payload per page."""
    return [payloads[(index * BATCH + i) % len(payloads)] for i in range(BATCH)]


def store_puts(
    root: Path,
    payloads: Sequence[memoryview],
    total_bytes: int,
    depth: int,
    *,
    sync: bool,
    segment_bytes: int | None = None,
) -> float:
    """MB/s of the bench's pipelined puts (``fio_ratios.durable_puts``), durable or
    left to the flusher; ``segment_bytes`` (default: the store's) for small tests."""
    defaults = StoreConfig()
    options = StoreOptions(
        segment_bytes=segment_bytes or defaults.segment_bytes,
        io_depth=defaults.io_depth,
        pipeline_depth=depth,
    )
    workload = "store, sync" if sync else "store, no sync"
    result = durable_puts(
        root,
        options,
        payloads,
        total_bytes,
        BATCH,
        None,
        workload=workload,
        pipelined=True,
        sync=sync,
    )
    return result.mbps


def thread_writes(
    root: Path, payloads: Sequence[memoryview], batches: int, depth: int, *, flush: bool
) -> float:
    """Seconds for the same records written by plain threads (module docstring)."""
    root.mkdir(parents=True, exist_ok=True)
    page_bytes = payloads[0].nbytes
    span = BLOCK_BYTES + page_bytes
    # Records per write, as the store's writer queues a gathered write: once its
    # records' spans reach GATHER_BYTES (four 256 KiB pages, one 1 MiB page).
    gather = min(BATCH, -(-GATHER_BYTES // span))
    commit = threading.Lock()
    record = os.urandom(WAL_RECORD_BYTES * BATCH)
    headers = mmap.mmap(-1, depth * BATCH * BLOCK_BYTES)
    header_view = memoryview(headers)
    data = wal = -1
    try:
        data = open_data_file(root / "data", direct=True, create=True)
        wal = os.open(root / "wal", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.posix_fallocate(data, 0, batches * BATCH * span)
        with (
            ThreadPoolExecutor(IO_THREADS) as io,
            ThreadPoolExecutor(depth) as pipeline,
        ):

            def one_batch(index: int, offset: int) -> None:
                pages = batch_of(payloads, index)
                slot = (index % depth) * BATCH * BLOCK_BYTES
                writes = []
                for first in range(0, BATCH, gather):
                    vectors: list[memoryview] = []
                    for i in range(first, min(first + gather, BATCH)):
                        start = slot + i * BLOCK_BYTES
                        vectors += [header_view[start : start + BLOCK_BYTES], pages[i]]
                    at = offset + first * span
                    wanted = sum(v.nbytes for v in vectors)
                    writes.append((io.submit(os.pwritev, data, vectors, at), at, wanted))
                for write, at, wanted in writes:
                    if write.result() != wanted:
                        raise OSError(errno.EIO, f"short write at byte {at} of {root / 'data'}")
                if flush:
                    with commit:
                        os.fdatasync(data)
                        if os.write(wal, record) != len(record):
                            raise OSError(errno.EIO, f"short write to {root / 'wal'}")
                        os.fdatasync(wal)

            def run(first: int, count: int) -> None:
                in_flight: collections.deque[Future[None]] = collections.deque()
                for index in range(first, first + count):
                    if len(in_flight) >= depth:
                        in_flight.popleft().result()
                    in_flight.append(pipeline.submit(one_batch, index, index * BATCH * span))
                while in_flight:
                    in_flight.popleft().result()

            started = time.perf_counter()
            run(0, batches)
            elapsed = time.perf_counter() - started
    finally:
        for fd in (data, wal):
            if fd >= 0:
                os.close(fd)
        header_view.release()
        headers.close()
    return elapsed


def fio_rate(fio: FioStatus, directory: Path, profile: str, total_bytes: int) -> float:
    """fio's MB/s for ``profile`` writing ``total_bytes`` into ``directory``."""
    (found,) = run_fio_profiles(
        fio, directory, max(1, total_bytes // MIB), FIO_RUNTIME_S, NullReporter(), (profile,)
    )
    return float(found.extra["write_mb_per_s"])


def measure(
    directory: Path,
    page_bytes: int,
    total_bytes: int,
    depth: int,
    rounds: int,
    seed: int,
    fio: FioStatus | None = None,
    segment_bytes: int | None = None,
) -> dict[str, list[float]]:
    """MB/s per variant per round (module docstring), variants in random order; fio's
    row where fio is available and has a profile for the page size."""
    rng = random.Random(seed)
    batches = max(1, total_bytes // (BATCH * page_bytes))
    payloads = aligned_payloads((depth + 2) * BATCH, page_bytes)
    profile = FIO_PROFILE.get(page_bytes) if fio is not None and fio.available else None
    variants = VARIANTS + ((FIO,) if profile is not None else ())
    rates: dict[str, list[float]] = {variant: [] for variant in variants}
    payload = batches * BATCH * page_bytes
    for _ in range(rounds):
        order = list(variants)
        rng.shuffle(order)
        for variant in order:
            root = directory / "write-shape"
            shutil.rmtree(root, ignore_errors=True)
            try:
                if variant == FIO:
                    assert fio is not None and profile is not None
                    rates[variant].append(fio_rate(fio, root, profile, payload))
                    continue
                if variant.startswith("store"):
                    sync = variant == "store, sync"
                    rate = store_puts(
                        root, payloads, payload, depth, sync=sync, segment_bytes=segment_bytes
                    )
                else:
                    elapsed = thread_writes(root, payloads, batches, depth, flush="two" in variant)
                    rate = payload / elapsed / 1e6
            finally:
                shutil.rmtree(root, ignore_errors=True)
            rates[variant].append(rate)
    return rates


def fio_row(fio: FioStatus, page_bytes: int) -> str:
    """Why there is or is not a fio row: fio's version, or the reason."""
    if not fio.available:
        return f"no fio row: {fio.reason}"
    if page_bytes not in FIO_PROFILE:
        sizes = " or ".join(f"{size // KIB} KiB" for size in FIO_PROFILE)
        return f"no fio row: fio has a durable-write profile for {sizes} pages only"
    return fio.version


def report(rates: dict[str, list[float]]) -> dict[str, object]:
    """Medians and the ratios that matter: the store's against the threads' (and fio's)."""
    medians = {variant: statistics.median(values) for variant, values in rates.items()}
    against_fio: dict[str, float] = {}
    if FIO in medians:
        against_fio = {
            "store_sync_over_fio": round(medians["store, sync"] / medians[FIO], 3),
            "threads_two_flushes_over_fio": round(
                medians["threads, two flushes"] / medians[FIO], 3
            ),
        }
    return {
        "mb_per_s": {variant: [round(v) for v in values] for variant, values in rates.items()},
        "median_mb_per_s": {variant: round(v) for variant, v in medians.items()},
        "store_sync_over_threads_two_flushes": round(
            medians["store, sync"] / medians["threads, two flushes"], 3
        ),
        "store_no_sync_over_threads_no_flush": round(
            medians["store, no sync"] / medians["threads, no flush"], 3
        ),
        **against_fio,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dir", type=Path, required=True, help="a directory on the disk to measure"
    )
    parser.add_argument("--page-kib", type=int, default=256, help="page size (default 256)")
    parser.add_argument("--mib", type=int, default=2048, help="MiB written per variant and round")
    parser.add_argument("--depth", type=int, default=2, help="batches in flight (pipeline_depth)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1, help="the variants' order")
    parser.add_argument(
        "--fio", default=None, help="fio's path, or 'none' to skip it (default: fio on PATH)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    if not MIN_PAGE_KIB <= args.page_kib <= MAX_PAGE_KIB or args.page_kib % 4:
        parser.error(
            f"--page-kib must be a multiple of 4 from {MIN_PAGE_KIB} to {MAX_PAGE_KIB} (the "
            f"pages the store writes from their own memory, up to its largest page), got "
            f"{args.page_kib}"
        )
    for name in ("mib", "depth", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    args.dir.mkdir(parents=True, exist_ok=True)
    fio = find_fio(args.fio)
    page_bytes = args.page_kib * KIB
    batches = max(1, args.mib * MIB // (BATCH * page_bytes))
    rates = measure(args.dir, page_bytes, args.mib * MIB, args.depth, args.rounds, args.seed, fio)
    summary: dict[str, object] = {
        "page_kib": args.page_kib,
        "bytes_per_variant": batches * BATCH * page_bytes,  # whole batches of 32 pages
        "depth": args.depth,
        "rounds": args.rounds,
        "seed": args.seed,
        "fio": fio_row(fio, page_bytes),
        **report(rates),
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    medians = summary["median_mb_per_s"]
    assert isinstance(medians, dict)
    print(
        f"{args.page_kib} KiB pages, {batches * BATCH * page_bytes / MIB:,.0f} MiB per "
        f"variant, depth {args.depth}, MB/s per round:"
    )
    for variant in rates:
        values = ", ".join(f"{v:,.0f}" for v in rates[variant])
        print(f"  {variant:<22} {values}   (median {medians[variant]:,})")
    print(
        f"  store / threads: sync {summary['store_sync_over_threads_two_flushes']}, "
        f"no sync {summary['store_no_sync_over_threads_no_flush']}"
    )
    if "store_sync_over_fio" in summary:
        print(
            f"  against fio: store, sync {summary['store_sync_over_fio']}; "
            f"threads, two flushes {summary['threads_two_flushes_over_fio']}"
        )
    else:
        print(f"  ({summary['fio']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

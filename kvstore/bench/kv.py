"""kvstore's own workloads: durable puts, cold gets (batched and single), a 70/30 mix,
and the hot paths from Python (lookups, pin/unpin, group-committed metadata
updates, CPU per page).

Every workload runs in a fresh store under the bench directory, deleted after.
Reads go through O_DIRECT (the store refuses the run otherwise unless
``allow_buffered`` is set, for tmpfs in tests), so they are cold by
construction: ``Measurement.cold`` says "O_DIRECT".

CPU per page is ``getrusage`` user time (all threads of the process, so the
flusher is included; kernel time excluded) over a large ``put_many`` or
``get_many`` loop, divided by pages. User time also covers the C work on the
payload (copy into the aligned buffer, xxh3), which grows with the page size,
so ``extra["payload_us_per_page"]`` measures that part alone and
``extra["python_us_per_page"]`` is the rest.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.bench.common import (
    CpuTimes,
    Measurement,
    Reporter,
    payload_pool,
    percentile,
    remove_tree,
)
from kvstore.format.checksum import checksum
from kvstore.store import KVStore

__all__ = ["HotPathConfig", "KvConfig", "hot_paths", "kv_workloads", "open_bench_store"]


@dataclass(frozen=True, slots=True)
class KvConfig:
    """Sizes of the kvstore workloads."""

    page_bytes: int = 256 << 10
    total_bytes: int = 1 << 30
    put_batch: int = 64
    get_batch: int = 64
    single_gets: int = 2000
    segment_bytes: int = 256 << 20
    io_depth: int = 32
    runtime_s: float = 30.0  # cap per workload
    seed: int = 1
    allow_buffered: bool = False


@dataclass(frozen=True, slots=True)
class HotPathConfig:
    """Sizes of the hot-path measurements (small pages: per-page costs dominate)."""

    page_bytes: int = 16 << 10
    pages: int = 20_000
    group_sizes: tuple[int, ...] = (1, 16, 256, 1024)
    segment_bytes: int = 64 << 20
    runtime_s: float = 10.0
    allow_buffered: bool = False


def open_bench_store(
    root: Path, *, segment_bytes: int, io_depth: int = 32, allow_buffered: bool, **options: Any
) -> KVStore:
    """A fresh store; RuntimeError if reads would come from the page cache."""
    remove_tree(root)
    store = KVStore.open(
        root, create=True, segment_bytes=segment_bytes, io_depth=io_depth, **options
    )
    if not store.stats().direct_io and not allow_buffered:
        store.close()
        raise RuntimeError(f"{root}: O_DIRECT is refused here, reads would hit the page cache")
    return store


def _read_mode(store: KVStore) -> str:
    return "O_DIRECT" if store.stats().direct_io else "page cache (O_DIRECT refused)"


def page_key(index: int) -> bytes:
    return b"bench/%010d" % index


def payload_cost_us(page_bytes: int, rounds: int = 256) -> float:
    """User CPU of the per-page payload work alone: one copy and one xxh3 (µs per page).

    Sources and targets rotate over more memory than the CPU caches hold, as in
    the real loops (a pool of payloads, a pool of aligned buffers).
    """
    sources = payload_pool(page_bytes, count=8)
    targets = [memoryview(bytearray(page_bytes + 4096)) for _ in range(32)]
    start = CpuTimes.now()
    for round_index in range(rounds):
        source = sources[round_index % len(sources)]
        targets[round_index % len(targets)][4096 : 4096 + page_bytes] = source
        checksum(source)
    return CpuTimes.now().since(start).user_s / rounds * 1e6


def _cpu_extra(cpu: CpuTimes, pages: int, payload_us: float) -> dict[str, float]:
    user_us = cpu.user_s / pages * 1e6
    return {
        "user_us_per_page": user_us,
        "system_us_per_page": cpu.system_s / pages * 1e6,
        "payload_us_per_page": payload_us,
        "python_us_per_page": max(0.0, user_us - payload_us),
    }


def kv_workloads(root: Path, config: KvConfig, reporter: Reporter) -> list[Measurement]:
    """Durable puts, cold get_many, cold single get, and the 70/30 mix."""
    rng = random.Random(config.seed)
    payloads = payload_pool(config.page_bytes)
    pages = max(config.put_batch, config.total_bytes // config.page_bytes)
    keys = [page_key(i) for i in range(pages)]
    found: list[Measurement] = []
    payload_us = payload_cost_us(config.page_bytes)
    store_root = root / "kvstore"
    store = open_bench_store(
        store_root,
        segment_bytes=config.segment_bytes,
        io_depth=config.io_depth,
        allow_buffered=config.allow_buffered,
    )
    try:
        # -- durable puts: put_many(batch, sync=True) ---------------------------
        latencies: list[float] = []
        written = 0
        reporter.start(f"kvstore put_many({config.put_batch}, sync=True)", pages)
        cpu0 = CpuTimes.now()
        start = time.perf_counter()
        for first in range(0, pages, config.put_batch):
            batch = [
                (keys[i], payloads[i % len(payloads)])
                for i in range(first, min(first + config.put_batch, pages))
            ]
            t0 = time.perf_counter()
            store.put_many(batch, sync=True)
            latencies.append((time.perf_counter() - t0) * 1e6)
            written += len(batch)
            reporter.advance(len(batch))
            if time.perf_counter() - start > config.runtime_s:
                break
        seconds = time.perf_counter() - start
        cpu = CpuTimes.now().since(cpu0)
        reporter.finish()
        found.append(
            Measurement(
                name="kvstore.put_durable",
                label=f"kvstore put_many({config.put_batch}, sync=True)",
                group="kvstore",
                page_bytes=config.page_bytes,
                ops=written,
                bytes_moved=written * config.page_bytes,
                seconds=seconds,
                p50_us=percentile(latencies, 50),
                p99_us=percentile(latencies, 99),
                durable=True,
                extra=_cpu_extra(cpu, written, payload_us),
                notes="latency is per durable batch",
            )
        )
        keys = keys[:written]
        store.close()
        # Reopen: the index now comes from LMDB (checkpointed at close).
        store = KVStore.open(store_root, io_depth=config.io_depth)
        cold = _read_mode(store)

        # -- get_many, cold -------------------------------------------------------
        sample = rng.sample(keys, min(config.get_batch, len(keys)))
        for key, value in zip(sample, store.get_many(sample), strict=True):
            if value != payloads[int(key[6:]) % len(payloads)]:
                raise RuntimeError(f"get_many returned wrong bytes for {key!r}")
        order = keys[:]
        rng.shuffle(order)

        def get_many(wanted: list[bytes]) -> None:
            if any(value is None for value in store.get_many(wanted)):
                raise RuntimeError("get_many missed a page that was written")

        found.append(
            _batched_reads(
                order,
                get_many,
                "kvstore.get_many_cold",
                f"kvstore get_many({config.get_batch}) random, cold",
                config,
                reporter,
                cold,
                payload_us,
            )
        )

        # -- get_many_into reused buffers, cold (how an engine loads pages) --------
        rng.shuffle(order)
        targets = [bytearray(config.page_bytes) for _ in range(config.get_batch)]

        def get_many_into(wanted: list[bytes]) -> None:
            sizes = store.get_many_into(wanted, targets[: len(wanted)])
            if any(size != config.page_bytes for size in sizes):
                raise RuntimeError("get_many_into missed a page that was written")
            if targets[0] != payloads[int(wanted[0][6:]) % len(payloads)]:
                raise RuntimeError("get_many_into returned wrong bytes")

        found.append(
            _batched_reads(
                order,
                get_many_into,
                "kvstore.get_many_into_cold",
                f"kvstore get_many_into({config.get_batch}) random, reused buffers, cold",
                config,
                reporter,
                cold,
                payload_us,
            )
        )

        # -- single get, cold -----------------------------------------------------
        found.append(_single_gets(store, keys, config, rng, reporter, cold))

        # -- mixed 70/30 (pages): get_many batches and durable put_many batches -----
        found.append(_mixed(store, keys, payloads, config, rng, reporter, cold))
    finally:
        store.close()
        remove_tree(store_root)
    return found


def _batched_reads(
    order: list[bytes],
    read_batch: Callable[[list[bytes]], None],
    name: str,
    label: str,
    config: KvConfig,
    reporter: Reporter,
    cold: str,
    payload_us: float,
) -> Measurement:
    """Read ``order`` in batches of ``get_batch`` with ``read_batch``: MB/s and latency per call."""
    latencies: list[float] = []
    reporter.start(label, len(order))
    read = 0
    cpu0 = CpuTimes.now()
    start = time.perf_counter()
    for first in range(0, len(order), config.get_batch):
        wanted = order[first : first + config.get_batch]
        t0 = time.perf_counter()
        read_batch(wanted)
        latencies.append((time.perf_counter() - t0) * 1e6)
        read += len(wanted)
        reporter.advance(len(wanted))
        if time.perf_counter() - start > config.runtime_s:
            break
    seconds = time.perf_counter() - start
    cpu = CpuTimes.now().since(cpu0)
    reporter.finish()
    return Measurement(
        name=name,
        label=label,
        group="kvstore",
        page_bytes=config.page_bytes,
        ops=read,
        bytes_moved=read * config.page_bytes,
        seconds=seconds,
        p50_us=percentile(latencies, 50),
        p99_us=percentile(latencies, 99),
        cold=cold,
        extra=_cpu_extra(cpu, read, payload_us),
        notes="latency is per call",
    )


def _single_gets(
    store: KVStore,
    keys: Sequence[bytes],
    config: KvConfig,
    rng: random.Random,
    reporter: Reporter,
    cold: str,
) -> Measurement:
    count = min(config.single_gets, len(keys))
    plan = rng.sample(keys, count)
    latencies: list[float] = []
    clock = time.perf_counter_ns
    reporter.start("kvstore get, cold", count)
    start = time.perf_counter()
    deadline = clock() + int(config.runtime_s * 1e9)
    for key in plan:
        t0 = clock()
        value = store.get(key)
        t1 = clock()
        latencies.append((t1 - t0) / 1000.0)
        if value is None:
            raise RuntimeError(f"get missed {key!r}")
        reporter.advance()
        if t1 > deadline:
            break
    seconds = time.perf_counter() - start
    reporter.finish()
    return Measurement(
        name="kvstore.get_single_cold",
        label="kvstore get (one page at a time), cold",
        group="kvstore",
        page_bytes=config.page_bytes,
        ops=len(latencies),
        bytes_moved=len(latencies) * config.page_bytes,
        seconds=seconds,
        p50_us=percentile(latencies, 50),
        p99_us=percentile(latencies, 99),
        cold=cold,
    )


def _mixed(
    store: KVStore,
    keys: Sequence[bytes],
    payloads: Sequence[bytes],
    config: KvConfig,
    rng: random.Random,
    reporter: Reporter,
    cold: str,
) -> Measurement:
    """70 % of batches are cold get_many of random keys, 30 % durable put_many of new keys."""
    batches = max(10, len(keys) // config.get_batch)
    plan = [rng.random() < 0.7 for _ in range(batches)]
    next_key = len(keys) + 1_000_000
    read = written = 0
    latencies: list[float] = []
    reporter.start("kvstore mixed 70/30", batches)
    start = time.perf_counter()
    for is_read in plan:
        t0 = time.perf_counter()
        if is_read:
            wanted = rng.sample(keys, min(config.get_batch, len(keys)))
            store.get_many(wanted)
            read += len(wanted)
        else:
            items = [
                (page_key(next_key + i), payloads[i % len(payloads)])
                for i in range(config.put_batch)
            ]
            next_key += config.put_batch
            store.put_many(items, sync=True)
            written += len(items)
        latencies.append((time.perf_counter() - t0) * 1e6)
        reporter.advance()
        if time.perf_counter() - start > config.runtime_s:
            break
    seconds = time.perf_counter() - start
    reporter.finish()
    return Measurement(
        name="kvstore.mixed_70_30",
        label="kvstore 70% get_many / 30% durable put_many",
        group="kvstore",
        page_bytes=config.page_bytes,
        ops=read + written,
        bytes_moved=(read + written) * config.page_bytes,
        seconds=seconds,
        p50_us=percentile(latencies, 50),
        p99_us=percentile(latencies, 99),
        durable=True,
        cold=cold,
        extra={
            "read_mb_per_s": read * config.page_bytes / seconds / 1e6,
            "write_mb_per_s": written * config.page_bytes / seconds / 1e6,
        },
        notes="latency is per batch",
    )


def _rate(
    name: str,
    label: str,
    ops: int,
    seconds: float,
    latencies: list[float] | None = None,
    **extra: float,
) -> Measurement:
    return Measurement(
        name=name,
        label=label,
        group="hot_path",
        ops=ops,
        seconds=seconds,
        p50_us=percentile(latencies, 50) if latencies else None,
        p99_us=percentile(latencies, 99) if latencies else None,
        extra=extra,
    )


def _loop(
    keys: Sequence[bytes], body: Callable[[bytes], object], runtime_s: float
) -> tuple[int, float, float]:
    """Run ``body`` over ``keys`` (whole passes, at least 0.2 s); ops, wall and thread CPU s."""
    done = 0
    cpu0 = time.thread_time()
    start = time.perf_counter()
    while True:
        for key in keys:
            body(key)
        done += len(keys)
        elapsed = time.perf_counter() - start
        if elapsed >= min(0.2, runtime_s):
            return done, elapsed, time.thread_time() - cpu0


def hot_paths(root: Path, config: HotPathConfig, reporter: Reporter) -> list[Measurement]:
    """Per-page CPU of put_many/get_many, lookups, pin/unpin, group-committed metadata."""
    payloads = payload_pool(config.page_bytes)
    keys = [page_key(i) for i in range(config.pages)]
    payload_us = payload_cost_us(config.page_bytes)
    found: list[Measurement] = []
    store_root = root / "hot"
    store = open_bench_store(
        store_root,
        segment_bytes=config.segment_bytes,
        io_depth=64,
        allow_buffered=config.allow_buffered,
    )
    try:
        reporter.start("hot paths", 8)
        batch = 256
        cpu0 = CpuTimes.now()
        start = time.perf_counter()
        for first in range(0, len(keys), batch):
            last = min(first + batch, len(keys))
            store.put_many(
                [(keys[i], payloads[i % len(payloads)]) for i in range(first, last)], sync=True
            )
        seconds = time.perf_counter() - start
        cpu = CpuTimes.now().since(cpu0)
        found.append(
            Measurement(
                name="hot.cpu_put_many",
                label=f"CPU per page, put_many({batch}, sync=True)",
                group="hot_path",
                page_bytes=config.page_bytes,
                ops=len(keys),
                bytes_moved=len(keys) * config.page_bytes,
                seconds=seconds,
                durable=True,
                extra=_cpu_extra(cpu, len(keys), payload_us),
            )
        )
        reporter.advance()

        # Lookups and pins while the entries sit in the in-memory overlay.
        ops, seconds, cpu_s = _loop(keys, store.__contains__, config.runtime_s)
        found.append(
            _rate(
                "hot.lookup_overlay",
                "page-table lookup (`key in store`), entry in the overlay",
                ops,
                seconds,
                ops_per_cpu_s=ops / cpu_s,
            )
        )
        reporter.advance()

        def pin_pair(key: bytes) -> None:
            store.pin(key)
            store.unpin(key)

        ops, seconds, cpu_s = _loop(keys, pin_pair, config.runtime_s)
        found.append(
            _rate(
                "hot.pin_unpin_overlay",
                "pin + unpin pair, entry in the overlay",
                ops,
                seconds,
                ops_per_cpu_s=ops / cpu_s,
            )
        )
        reporter.advance()

        # After a checkpoint every lookup goes to LMDB (the state after a reopen).
        store.checkpoint()
        ops, seconds, cpu_s = _loop(keys, store.__contains__, config.runtime_s)
        found.append(
            _rate(
                "hot.lookup",
                "page-table lookup (`key in store`), entry in LMDB",
                ops,
                seconds,
                ops_per_cpu_s=ops / cpu_s,
            )
        )
        reporter.advance()
        ops, seconds, cpu_s = _loop(keys, pin_pair, config.runtime_s)
        found.append(
            _rate(
                "hot.pin_unpin",
                "pin + unpin pair, entry in LMDB",
                ops,
                seconds,
                ops_per_cpu_s=ops / cpu_s,
            )
        )
        reporter.advance()
        ops, seconds, cpu_s = _loop(keys, store.info, config.runtime_s)
        found.append(
            _rate(
                "hot.lookup_entry",
                "page-table entry lookup (`store.info`), entry in LMDB",
                ops,
                seconds,
                ops_per_cpu_s=ops / cpu_s,
            )
        )
        pin_many = getattr(store, "pin_many", None)
        unpin_many = getattr(store, "unpin_many", None)
        if pin_many is not None and unpin_many is not None:
            batches = [keys[i : i + 64] for i in range(0, len(keys), 64)]
            thread_cpu0, start = time.thread_time(), time.perf_counter()
            for batch_keys in batches:
                pin_many(batch_keys)
                unpin_many(batch_keys)
            seconds, cpu_s = time.perf_counter() - start, time.thread_time() - thread_cpu0
            found.append(
                _rate(
                    "hot.pin_unpin_batched",
                    "pin_many(64) + unpin_many(64), per pair, entries in LMDB",
                    len(keys),
                    seconds,
                    ops_per_cpu_s=len(keys) / cpu_s,
                )
            )

        # get_many over every page: CPU per page.
        order = keys[:]
        random.Random(3).shuffle(order)
        cpu0 = CpuTimes.now()
        start = time.perf_counter()
        for first in range(0, len(order), 64):
            store.get_many(order[first : first + 64])
        seconds = time.perf_counter() - start
        cpu = CpuTimes.now().since(cpu0)
        found.append(
            Measurement(
                name="hot.cpu_get_many",
                label="CPU per page, get_many(64) random",
                group="hot_path",
                page_bytes=config.page_bytes,
                ops=len(order),
                bytes_moved=len(order) * config.page_bytes,
                seconds=seconds,
                cold=_read_mode(store),
                extra=_cpu_extra(cpu, len(order), payload_us),
            )
        )
        reporter.advance()

        found.extend(_metadata_updates(store, keys, config))
        reporter.advance()
    finally:
        reporter.finish()
        store.close()
        remove_tree(store_root)
    return found


def _metadata_updates(
    store: KVStore, keys: Sequence[bytes], config: HotPathConfig
) -> list[Measurement]:
    """retain/release alternately, ``flush()`` after every ``group`` updates.

    Each update is one WAL record (RETAIN or RELEASE); ``flush`` is one group
    commit (write + fdatasync of the WAL), so the rate is durable updates per second.
    """
    found = []
    for group in config.group_sizes:
        done = 0
        commit_latencies: list[float] = []
        # Four passes over the keys (retain, release, retain, release) or the time cap.
        plan = [(store.retain if p % 2 == 0 else store.release, p) for p in range(4)]
        start = time.perf_counter()
        for update, _ in plan:
            for first in range(0, len(keys), group):
                chunk = keys[first : first + group]
                for key in chunk:
                    update(key)
                t0 = time.perf_counter()
                store.flush()
                commit_latencies.append((time.perf_counter() - t0) * 1e6)
                done += len(chunk)
                if time.perf_counter() - start >= min(2.0, config.runtime_s):
                    break
            else:
                continue
            break
        seconds = time.perf_counter() - start
        # Leave nothing retained for the next group size.
        for key in keys:
            store.release(key)
        store.flush()
        found.append(
            _rate(
                f"hot.meta_updates_g{group}",
                f"durable retain/release, group commit every {group}",
                done,
                seconds,
                commit_latencies,
                group=float(group),
            )
        )
    return found

"""Churn benchmark: overwrite, delete and read random keys at a fixed fill.

One seeded trace is replayed against each eviction policy on a fresh store.
The key space is sized so that the live data would fill ``--fill`` of the
capacity; the trace writes ``--written-x`` times the capacity. Reported per
policy: write amplification (every byte the store wrote to segments and the
WAL / payload bytes written by the caller), hit ratio of the reads, evictions,
GC bytes copied, and peak disk use against capacity + documented overhead.

    .venv/bin/python tools/churn.py --dir ./churn-data --capacity-mib 512
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kvstore import KVStore
from kvstore.format.constants import record_span


@dataclass
class ChurnResult:
    policy: str
    write_amplification: float
    hit_ratio: float
    reads: int
    evictions: int
    gc_bytes_copied: int
    host_bytes: int
    store_bytes: int
    peak_disk_bytes: int
    capacity_bytes: int
    overhead_bound_bytes: int
    seconds: float


def disk_use(path: Path) -> int:
    total = 0
    for directory, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(directory, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def make_trace(
    seed: int, operations: int, key_count: int, read_every: int
) -> list[tuple[str, int]]:
    """(op, key index) with op in put/delete/get; reads skewed towards hot keys."""
    rng = random.Random(seed)
    trace: list[tuple[str, int]] = []
    hot = max(1, key_count // 10)
    for _ in range(operations):
        roll = rng.random()
        if roll < 0.9:
            trace.append(("put", rng.randrange(key_count)))
        else:
            trace.append(("delete", rng.randrange(key_count)))
        for _ in range(read_every):
            # 80% of reads go to the hottest 10% of keys
            if rng.random() < 0.8:
                trace.append(("get", rng.randrange(hot)))
            else:
                trace.append(("get", rng.randrange(key_count)))
    return trace


def run_policy(
    policy: str,
    directory: Path,
    trace: list[tuple[str, int]],
    *,
    capacity_bytes: int,
    segment_bytes: int,
    page_bytes: int,
) -> ChurnResult:
    shutil.rmtree(directory, ignore_errors=True)
    payload = os.urandom(page_bytes)
    store = KVStore.open(
        directory,
        create=True,
        capacity_bytes=capacity_bytes,
        segment_bytes=segment_bytes,
        eviction_policy=policy,
        checkpoint_wal_bytes=16 << 20,
    )
    reads = hits = 0
    peak = 0
    latest: dict[int, int] = {}
    started = time.perf_counter()
    batch: list[tuple[bytes, bytes]] = []
    with store:
        for step, (op, index) in enumerate(trace):
            key = f"page/{index:06d}".encode()
            if op == "put":
                version = latest.get(index, 0) + 1
                latest[index] = version
                value = version.to_bytes(8, "little") + payload[8:]
                batch.append((key, value))
                if len(batch) >= 32:
                    store.put_many(batch)
                    batch.clear()
            else:
                if batch:
                    store.put_many(batch)
                    batch.clear()
                if op == "delete":
                    store.delete(key)
                    latest.pop(index, None)
                else:
                    reads += 1
                    data = store.get(key)
                    if data is not None:
                        if int.from_bytes(data[:8], "little") != latest.get(index):
                            raise SystemExit(f"wrong version read for {key!r}")
                        hits += 1
            if step % 2000 == 0:
                peak = max(peak, disk_use(directory))
        if batch:
            store.put_many(batch)
        store.flush()
        peak = max(peak, disk_use(directory))
        stats = store.stats()
    seconds = time.perf_counter() - started
    counters = stats.counters
    host = counters["host_bytes_written"]
    written = counters["segment_bytes_written"] + counters["wal_bytes_written"]
    overhead = 16 << 20  # WAL before checkpoint (checkpoint_wal_bytes) ...
    overhead += 2 * (16 << 20)  # ... plus one WAL file of slack and the LMDB index
    shutil.rmtree(directory, ignore_errors=True)
    return ChurnResult(
        policy,
        written / host if host else 0.0,
        hits / reads if reads else 0.0,
        reads,
        sum(stats.evictions.values()),
        stats.gc_bytes_copied,
        host,
        written,
        peak,
        capacity_bytes,
        overhead,
        seconds,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", type=Path, default=Path("./churn-data"))
    parser.add_argument("--capacity-mib", type=int, default=512)
    parser.add_argument("--segment-mib", type=int, default=16)
    parser.add_argument("--page-kib", type=int, default=256)
    parser.add_argument("--fill", type=float, default=0.8)
    parser.add_argument("--written-x", type=float, default=10.0)
    parser.add_argument("--read-every", type=int, default=1, help="reads per write")
    parser.add_argument("--policies", default="fifo,lru,cost")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    capacity = args.capacity_mib << 20
    page = args.page_kib << 10
    span = record_span(page)
    key_count = int(args.fill * capacity / span)
    operations = int(args.written_x * capacity / page / 0.9)
    trace = make_trace(args.seed, operations, key_count, args.read_every)
    results = [
        run_policy(
            policy,
            args.dir / policy,
            trace,
            capacity_bytes=capacity,
            segment_bytes=args.segment_mib << 20,
            page_bytes=page,
        )
        for policy in args.policies.split(",")
    ]
    if args.json:
        print(json.dumps([asdict(result) for result in results], indent=2))
        return 0
    print(
        f"churn: capacity {args.capacity_mib} MiB, segments {args.segment_mib} MiB, "
        f"pages {args.page_kib} KiB, {key_count} keys (fill {args.fill:.0%}), "
        f"{len(trace)} operations, {args.written_x}x capacity written"
    )
    print(
        f"{'policy':<8}{'WA':>8}{'hit ratio':>11}{'evictions':>11}{'GC copied MiB':>15}"
        f"{'peak disk MiB':>15}{'bound MiB':>11}{'seconds':>9}"
    )
    for result in results:
        bound = (result.capacity_bytes + result.overhead_bound_bytes) >> 20
        print(
            f"{result.policy:<8}{result.write_amplification:>8.3f}{result.hit_ratio:>11.3f}"
            f"{result.evictions:>11}{result.gc_bytes_copied / 2**20:>15.1f}"
            f"{result.peak_disk_bytes / 2**20:>15.1f}{bound:>11}{result.seconds:>9.1f}"
        )
    return 0

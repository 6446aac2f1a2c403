"""Where a single ``get`` spends its time beyond the read, interleaved in one process.

    .venv/bin/python tools/get_latency.py --dir ./bench-data            # 2 GiB store
    .venv/bin/python tools/get_latency.py --dir ./bench-data --json

Fills a store with 256 KiB pages (untimed), then times, in random order on random
pages (so disk drift hits every variant alike):

  read, untouched buffer   O_DIRECT ``preadv`` of the record into a buffer the CPU
                           never reads (what fio measures: it does not look at data)
  read, consumed buffer    the same, into a buffer the CPU then hashes and copies
                           (what every verifying reader does); the timed part is
                           still only the ``preadv``
  get, polled              ``store.get`` with the default ``read_poll_us``
  get, sleeping            ``store.get`` with polling off (``read_poll_us=0``)

On a virtual machine whose host writes the read data into guest memory with its
own CPU (virtio-blk under Firecracker here), the consumed buffer's read is
slower: the host must take back cache lines the guest just read. That cost is
the platform's, not kvstore's; the rest of the gap between ``get`` and the
untouched read is kvstore's own work. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

import xxhash

from kvstore import KVStore
from kvstore.bench.common import KIB
from kvstore.format.names import segment_path

PAGE_BYTES = 256 * KIB


def fill(root: Path, pages: int) -> list[bytes]:
    keys = [f"page-{i:08d}".encode() for i in range(pages)]
    payloads = [os.urandom(PAGE_BYTES) for _ in range(16)]
    with KVStore.open(root, create=True) as store:
        for first in range(0, pages, 64):
            batch = range(first, min(first + 64, pages))
            store.put_many([(keys[i], payloads[i % len(payloads)]) for i in batch])
        store.flush()
    return keys


def measure(root: Path, keys: list[bytes], samples: int, seed: int) -> dict[str, list[float]]:
    rng = random.Random(seed)
    store = KVStore.open(root, readonly=True)
    fds: dict[int, int] = {}
    untouched = memoryview(mmap.mmap(-1, 512 * KIB))
    consumed = memoryview(mmap.mmap(-1, 512 * KIB))
    polled_ns = store.internals.reader.poll_ns  # the A/B switch of this diagnostic
    times: dict[str, list[float]] = {
        "read, untouched buffer": [],
        "read, consumed buffer": [],
        "get, polled": [],
        "get, sleeping": [],
    }
    variants = list(times)
    try:
        for key in keys[:16]:  # warm-up: rings, buffers, LMDB pages
            store.get(key)
        for _ in range(samples):
            key = rng.choice(keys)
            variant = rng.choice(variants)
            if variant.startswith("read"):
                info = store.info(key)
                assert info is not None
                fd = fds.get(info.segment_id)
                if fd is None:
                    path = segment_path(root, info.segment_id)
                    fd = fds[info.segment_id] = os.open(path, os.O_RDONLY | os.O_DIRECT)
                buffer = untouched if variant == "read, untouched buffer" else consumed
                span = 4 * KIB + info.payload_bytes
                t0 = time.perf_counter_ns()
                os.preadv(fd, [buffer[:span]], info.offset)
                elapsed = time.perf_counter_ns() - t0
                if buffer is consumed:  # untimed: what a verifying reader does next
                    xxhash.xxh3_64_intdigest(buffer[4 * KIB : span])
                    bytes(buffer[4 * KIB : span])
            else:
                store.internals.reader.poll_ns = polled_ns if variant == "get, polled" else 0
                t0 = time.perf_counter_ns()
                value = store.get(key)
                elapsed = time.perf_counter_ns() - t0
                assert value is not None
            times[variant].append(elapsed / 1000.0)
    finally:
        for fd in fds.values():
            os.close(fd)
        store.close()
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("./bench-data"))
    parser.add_argument("--size-mib", type=int, default=2048, help="store size (default 2048)")
    parser.add_argument("--samples", type=int, default=8000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep", action="store_true", help="keep the store afterwards")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    root = args.dir / "get-latency"
    if root.exists():
        shutil.rmtree(root)
    args.dir.mkdir(parents=True, exist_ok=True)
    keys = fill(root, args.size_mib * 1024 // 256)
    try:
        times = measure(root, keys, args.samples, args.seed)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    base = statistics.median(times["read, untouched buffer"])
    rows = {
        name: {
            "p50_us": round(statistics.median(values), 1),
            "p99_us": round(sorted(values)[int(len(values) * 0.99)], 1),
            "p50_minus_untouched_read_us": round(statistics.median(values) - base, 1),
            "samples": len(values),
        }
        for name, values in times.items()
    }
    if args.json:
        json.dump({"loadavg": os.getloadavg()[0], "rows": rows}, sys.stdout, indent=2)
        print()
        return 0
    print(f"{'variant':24s} {'p50 us':>8s} {'p99 us':>8s} {'p50 - untouched read':>22s}")
    for name, row in rows.items():
        print(
            f"{name:24s} {row['p50_us']:8.0f} {row['p99_us']:8.0f} "
            f"{row['p50_minus_untouched_read_us']:22.0f}"
        )
    return 0

"""What the open-time check of the LMDB index costs (docs/reliability.md).

Builds (once) a store of ``--pages`` small pages under LMCache-like keys, then
opens it ``--opens`` times read-only and as the writer and reports the median
open time and ``stats().index_check_seconds`` (the structural walk of
``data.mdb``), with ``data.mdb``'s size. With ``--damage`` it also flips a leaf
node's offset in a copy of the index and times the salvaging open.

    python tools/index_check_cost.py --dir /tmp/idx --pages 100000 --json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import struct
import time
from collections.abc import Sequence
from pathlib import Path

from kvstore import KVStore

# The thread-pool engine and no GC thread: the open is what is timed.
ENGINE = "threadpool"


def build(root: Path, pages: int) -> None:
    with KVStore.open(
        root,
        create=True,
        segment_bytes=64 << 20,
        max_page_bytes=1 << 20,
        io_engine=ENGINE,
        gc_interval_s=0,
    ) as store:
        batch: list[tuple[str, bytes]] = []
        for index in range(pages):
            key = f"lmcache/vllm@Qwen/Qwen3-8B@1@0@{index:016x}{index * 2654435761 % (1 << 32):08x}"
            batch.append((key, index.to_bytes(4, "little")))
            if len(batch) == 256:
                store.put_many(batch)
                batch = []
        if batch:
            store.put_many(batch)


def measure(root: Path, opens: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for readonly in (True, False):
        times, checks = [], []
        for _ in range(opens):
            started = time.perf_counter()
            store = KVStore.open(root, readonly=readonly, io_engine=ENGINE, gc_interval_s=0)
            times.append(time.perf_counter() - started)
            checks.append(store.stats().index_check_seconds)
            store.close()
        mode = "readonly" if readonly else "writer"
        out[f"{mode}_open_ms"] = round(1000 * statistics.median(times), 2)
        out[f"{mode}_check_ms"] = round(1000 * statistics.median(checks), 2)
    return out


def damaged_open(root: Path) -> dict[str, object]:
    """Flip one leaf node offset in a copy (segments hard-linked) and open it read-only."""
    copy = root.with_name(root.name + "-damaged")
    shutil.rmtree(copy, ignore_errors=True)
    copy.mkdir()
    shutil.copytree(root / "segments", copy / "segments", copy_function=_link)
    for name in ("wal", "index"):
        shutil.copytree(root / name, copy / name)
    for name in ("KVSTORE", "LOCK"):
        shutil.copy2(root / name, copy / name)
    path = copy / "index" / "data.mdb"
    data = bytearray(path.read_bytes())
    pages = len(data) // 4096
    for pgno in range(pages // 2, pages):
        base = pgno * 4096
        flags, lower = struct.unpack_from("<HH", data, base + 10)
        if flags == 0x02 and lower > 16:  # a leaf with at least one node
            data[base + 17] ^= 0x40  # the high byte of its first node's offset
            break
    path.write_bytes(bytes(data))
    started = time.perf_counter()
    with KVStore.open(copy, readonly=True, io_engine=ENGINE, gc_interval_s=0) as store:
        seconds = time.perf_counter() - started
        stats = store.stats()
    shutil.rmtree(copy)
    return {
        "salvage_open_s": round(seconds, 3),
        "index_salvaged": stats.index_salvaged,
        "pages_lost": stats.quarantined_pages,
        "pages_kept": stats.pages,
    }


def _link(source: str, target: str) -> None:
    Path(target).hardlink_to(source)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--pages", type=int, default=100_000)
    parser.add_argument("--opens", type=int, default=7)
    parser.add_argument("--damage", action="store_true", help="also time a salvaging open")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not (args.dir / "KVSTORE").exists():
        build(args.dir, args.pages)
    result: dict[str, object] = {
        "pages": args.pages,
        "data_mdb_bytes": (args.dir / "index" / "data.mdb").stat().st_size,
        **measure(args.dir, args.opens),
    }
    if args.damage:
        result.update(damaged_open(args.dir))
    print(json.dumps(result, indent=2) if args.json else result)
    return 0

"""The store's hot paths, for a before/after comparison of two source trees.

    python tools/ab_hot_paths.py --tree /path/to/old/checkout --json
    python tools/ab_hot_paths.py --tree . --json

Run it alternately on the two trees (several pairs; this machine's disk drifts) and
compare medians. It measures pin+unpin pairs per CPU-second, single-get p50 (256 KiB
and 16 KiB), put_many CPU per page (256 KiB and 16 KiB) and get_many throughput of
64 x 256 KiB over a 512 MiB store. docs/benchmarks.md, "The store taken apart".

The loops are this module's; the ``kvstore`` they measure is ``--tree``'s: ``main``
puts the tree first on ``sys.path`` and forgets every ``kvstore`` module imported so
far, and ``measure`` imports ``KVStore`` only when it runs. The loops use the public
API alone, so an older tree without this module is measured the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence


def measure(root: str) -> dict[str, float]:
    from kvstore import KVStore

    res: dict[str, float] = {}
    store = KVStore.open(root, create=True, segment_bytes=256 << 20, io_depth=32)
    try:
        keys = [f"k{i}".encode() for i in range(2048)]  # 512 MiB of 256 KiB pages
        page = os.urandom(256 << 10)
        started = time.process_time()
        for i in range(0, len(keys), 32):
            store.put_many([(k, page) for k in keys[i : i + 32]])
        res["put_many_cpu_us_per_256k_page"] = (time.process_time() - started) / len(keys) * 1e6
        small = os.urandom(16 << 10)
        smalls = [b"s" + k for k in keys[:1024]]
        started = time.process_time()
        for i in range(0, len(smalls), 64):
            store.put_many([(k, small) for k in smalls[i : i + 64]])
        res["put_many_cpu_us_per_16k_page"] = (time.process_time() - started) / len(smalls) * 1e6
        store.flush()
        pairs = 200_000
        started = time.process_time()
        for _ in range(pairs):
            store.pin(keys[7])
            store.unpin(keys[7])
        res["pin_unpin_pairs_per_cpu_s"] = pairs / (time.process_time() - started)
        for name, sample in (("256k", keys), ("16k", smalls)):
            latencies = []
            for i in range(3000):
                begun = time.perf_counter_ns()
                store.get(sample[(i * 7) % 256])
                latencies.append(time.perf_counter_ns() - begun)
            res[f"get_p50_us_{name}"] = statistics.median(latencies) / 1000
        rnd = random.Random(1)
        started = time.perf_counter()
        read = 0
        while time.perf_counter() - started < 5:
            store.get_many(rnd.sample(keys, 64))
            read += 64
        res["get_many_MBps"] = read * (256 << 10) / (time.perf_counter() - started) / 1e6
    finally:
        store.close()
    return res


def use_tree(tree: str) -> None:
    """Make ``import kvstore`` load ``tree``'s package from now on."""
    sys.path.insert(0, os.path.abspath(tree))
    for name in [m for m in sys.modules if m == "kvstore" or m.startswith("kvstore.")]:
        del sys.modules[name]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--tree", default=".", help="source tree whose kvstore to measure")
    parser.add_argument("--dir", default=None, help="where the scratch store goes")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    use_tree(args.tree)
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        res = measure(os.path.join(scratch, "store"))
    import kvstore

    res_out: dict[str, str | float] = {"kvstore": os.path.dirname(kvstore.__file__), **res}
    if args.json:
        print(json.dumps(res_out))
    else:
        for name, value in res_out.items():
            print(f"{name:34s} {value if isinstance(value, str) else f'{value:,.1f}'}")
    return 0

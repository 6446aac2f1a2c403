"""How kvstore's cost grows with the work: page size, queue depth, store fill, page count.

Four sweeps, each in a fresh store under the bench directory (deleted after):

- ``page_size``: durable ``put_many`` and cold ``get_many`` throughput, single-get
  p50/p99, for 64 KiB - 4 MiB pages.
- ``queue_depth``: the store's ``io_depth`` = qd and ``get_many`` of qd pages per call
  (qd 1 is the single-page path); throughput and per-call p50/p99. Durable puts
  with ``io_depth`` = qd too.
- ``fill``: a store with ``capacity_bytes`` filled to 10 % ... 95 %; durable put
  throughput while it fills up to each level, then cold get_many throughput and
  single-get p50/p99 at that level.
- ``pages``: one store grown to 10^3 ... 10^6 pages of 4 KiB (a page record is a
  4 KiB header block plus the payload, so 10^6 pages take 8 GB on disk; 64 KiB
  pages would take 68 GB). At each size, after a checkpoint (lookups go to
  LMDB): per-page put cost (wall and user CPU) of the pages added to reach it,
  lookups per second, single-get p50/p99 and get_many cost per page.
  ``put_cost_slope`` is the log-log slope of per-page put wall time against the
  page count: 0 is constant per-page cost, 1 would be quadratic total cost
  (``pages_get_p50_slope`` and ``pages_lookup_slope`` likewise).

``plot`` writes one PNG per sweep (matplotlib, Agg backend). ``main`` is the command
line of tools/scaling.py: the sweeps alone, without the rest of ``kvstore bench``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.bench.common import (
    KIB,
    MIB,
    CpuTimes,
    NullReporter,
    Reporter,
    finite,
    payload_pool,
    percentile,
    remove_tree,
)
from kvstore.bench.kv import open_bench_store, page_key
from kvstore.store import KVStore

__all__ = ["SWEEPS", "ScalingConfig", "main", "plot", "run_scaling"]

SWEEPS = ("page_size", "queue_depth", "fill", "pages")


@dataclass(frozen=True, slots=True)
class ScalingConfig:
    page_sizes: tuple[int, ...] = (64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB)
    bytes_per_point: int = 256 * MIB
    queue_depths: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    fill_levels: tuple[float, ...] = (0.10, 0.25, 0.50, 0.75, 0.90, 0.95)
    fill_capacity_bytes: int = 1 << 30
    fill_segment_bytes: int = 16 * MIB
    page_counts: tuple[int, ...] = (1_000, 10_000, 100_000, 1_000_000)
    small_page_bytes: int = 4 * KIB
    single_gets: int = 1000
    runtime_s: float = 20.0  # cap per point
    allow_buffered: bool = False
    seed: int = 5


def _store(root: Path, config: ScalingConfig, **options: Any) -> KVStore:
    options.setdefault("segment_bytes", 256 * MIB)
    return open_bench_store(root, allow_buffered=config.allow_buffered, **options)


def _durable_puts(
    store: KVStore,
    keys: Sequence[bytes],
    payloads: Sequence[bytes],
    batch: int,
    runtime_s: float,
    offset: int = 0,
) -> tuple[int, float, list[float], CpuTimes]:
    """put_many(batch, sync=True) over ``keys``; (pages, seconds, batch latencies µs, CPU)."""
    latencies: list[float] = []
    done = 0
    cpu0 = CpuTimes.now()
    start = time.perf_counter()
    for first in range(0, len(keys), batch):
        chunk = keys[first : first + batch]
        t0 = time.perf_counter()
        store.put_many(
            [(key, payloads[(offset + first + i) % len(payloads)]) for i, key in enumerate(chunk)],
            sync=True,
        )
        latencies.append((time.perf_counter() - t0) * 1e6)
        done += len(chunk)
        if time.perf_counter() - start > runtime_s:
            break
    return done, time.perf_counter() - start, latencies, CpuTimes.now().since(cpu0)


def _get_many(
    store: KVStore, keys: Sequence[bytes], per_call: int, calls: int, runtime_s: float, seed: int
) -> tuple[int, float, list[float]]:
    rng = random.Random(seed)
    latencies: list[float] = []
    pages = 0
    start = time.perf_counter()
    for _ in range(calls):
        wanted = rng.sample(keys, min(per_call, len(keys)))
        t0 = time.perf_counter()
        values = store.get_many(wanted)
        latencies.append((time.perf_counter() - t0) * 1e6)
        if any(value is None for value in values):
            raise RuntimeError("get_many missed a page that was written")
        pages += len(wanted)
        if time.perf_counter() - start > runtime_s:
            break
    return pages, time.perf_counter() - start, latencies


def _single_gets(store: KVStore, keys: Sequence[bytes], count: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    clock = time.perf_counter_ns
    latencies = []
    for key in rng.sample(keys, min(count, len(keys))):
        t0 = clock()
        if store.get(key) is None:
            raise RuntimeError(f"get missed {key!r}")
        latencies.append((clock() - t0) / 1000.0)
    return latencies


def sweep_page_size(root: Path, config: ScalingConfig, reporter: Reporter) -> list[dict[str, Any]]:
    points = []
    reporter.start("scaling: page size", len(config.page_sizes))
    for page_bytes in config.page_sizes:
        payloads = payload_pool(page_bytes, count=4)
        count = max(64, config.bytes_per_point // page_bytes)
        keys = [page_key(i) for i in range(count)]
        batch = max(4, min(64, (16 * MIB) // page_bytes))
        store = _store(root / "page-size", config)
        try:
            done, seconds, put_lat, _ = _durable_puts(
                store, keys, payloads, batch, config.runtime_s
            )
            keys = keys[:done]
            pages, read_seconds, call_lat = _get_many(
                store, keys, 64, max(8, len(keys) // 64), config.runtime_s, config.seed
            )
            single = _single_gets(store, keys, config.single_gets, config.seed)
        finally:
            store.close()
            remove_tree(root / "page-size")
        points.append(
            {
                "page_bytes": page_bytes,
                "put_batch_pages": batch,
                "put_mb_per_s": done * page_bytes / seconds / 1e6,
                "put_batch_p50_us": percentile(put_lat, 50),
                "put_batch_p99_us": percentile(put_lat, 99),
                "get_many_mb_per_s": pages * page_bytes / read_seconds / 1e6,
                "get_many_call_p50_us": percentile(call_lat, 50),
                "get_many_call_p99_us": percentile(call_lat, 99),
                "get_p50_us": percentile(single, 50),
                "get_p99_us": percentile(single, 99),
            }
        )
        reporter.advance()
    reporter.finish()
    return points


def sweep_queue_depth(
    root: Path, config: ScalingConfig, reporter: Reporter
) -> list[dict[str, Any]]:
    page_bytes = 256 * KIB
    payloads = payload_pool(page_bytes, count=4)
    count = max(256, config.bytes_per_point // page_bytes)
    keys = [page_key(i) for i in range(count)]
    directory = root / "queue-depth"
    store = _store(directory, config)
    try:
        _durable_puts(store, keys, payloads, 64, 10 * config.runtime_s)
    finally:
        store.close()
    points = []
    reporter.start("scaling: queue depth", len(config.queue_depths))
    try:
        for depth in config.queue_depths:
            store = KVStore.open(directory, io_depth=depth)
            try:
                calls = max(16, count // depth)
                pages, seconds, call_lat = _get_many(
                    store, keys, depth, calls, config.runtime_s / 2, config.seed + depth
                )
                extra = [page_key(count + depth * 100_000 + i) for i in range(max(64, count // 4))]
                done, put_seconds, put_lat, _ = _durable_puts(
                    store, extra, payloads, 64, config.runtime_s / 2
                )
                for key in extra[:done]:  # keep the store the same size for the next depth
                    store.delete(key)
                store.flush()
            finally:
                store.close()
            points.append(
                {
                    "queue_depth": depth,
                    "page_bytes": page_bytes,
                    "get_many_mb_per_s": pages * page_bytes / seconds / 1e6,
                    "get_many_call_p50_us": percentile(call_lat, 50),
                    "get_many_call_p99_us": percentile(call_lat, 99),
                    "put_mb_per_s": done * page_bytes / put_seconds / 1e6,
                    "put_batch_p50_us": percentile(put_lat, 50),
                    "put_batch_p99_us": percentile(put_lat, 99),
                }
            )
            reporter.advance()
    finally:
        reporter.finish()
        remove_tree(directory)
    return points


def sweep_fill(root: Path, config: ScalingConfig, reporter: Reporter) -> list[dict[str, Any]]:
    page_bytes = 256 * KIB
    payloads = payload_pool(page_bytes, count=4)
    capacity = config.fill_capacity_bytes
    directory = root / "fill"
    store = _store(
        directory,
        config,
        segment_bytes=config.fill_segment_bytes,
        capacity_bytes=capacity,
        max_page_bytes=page_bytes,
    )
    points = []
    written = 0
    keys: list[bytes] = []
    reporter.start("scaling: store fill", len(config.fill_levels))
    try:
        for level in config.fill_levels:
            target_pages = int(level * capacity) // (page_bytes + 4 * KIB)
            new = [page_key(i) for i in range(written, max(written, target_pages))]
            done, seconds, put_lat, _ = _durable_puts(
                store, new, payloads, 64, config.runtime_s, offset=written
            )
            written += done
            keys.extend(new[:done])
            live = [key for key in keys if key in store]  # evictions may have dropped some
            pages, read_seconds, call_lat = _get_many(
                store, live, 64, max(8, min(200, len(live) // 64)), config.runtime_s, config.seed
            )
            single = _single_gets(store, live, config.single_gets, config.seed)
            stats = store.stats()
            points.append(
                {
                    "fill_target": level,
                    "fill": stats.live_bytes / capacity,
                    "pages": stats.pages,
                    "evictions": sum(stats.evictions.values()),
                    "put_mb_per_s": done * page_bytes / seconds / 1e6 if done else None,
                    "put_batch_p50_us": percentile(put_lat, 50),
                    "put_batch_p99_us": percentile(put_lat, 99),
                    "get_many_mb_per_s": pages * page_bytes / read_seconds / 1e6,
                    "get_many_call_p50_us": percentile(call_lat, 50),
                    "get_many_call_p99_us": percentile(call_lat, 99),
                    "get_p50_us": percentile(single, 50),
                    "get_p99_us": percentile(single, 99),
                }
            )
            reporter.advance()
    finally:
        reporter.finish()
        store.close()
        remove_tree(directory)
    return points


def sweep_pages(
    root: Path, config: ScalingConfig, reporter: Reporter
) -> tuple[list[dict[str, Any]], float | None]:
    page_bytes = config.small_page_bytes
    payloads = payload_pool(page_bytes, count=16)
    directory = root / "pages"
    store = _store(directory, config, io_depth=64)
    points = []
    written = 0
    total = max(config.page_counts)
    reporter.start("scaling: page count", total)
    try:
        for target in config.page_counts:
            new = [page_key(i) for i in range(written, target)]
            done, seconds, _, cpu = _durable_puts(
                store, new, payloads, 1024, 30 * config.runtime_s, offset=written
            )
            if done < len(new):
                raise RuntimeError(f"page-count sweep hit its time cap at {written + done} pages")
            written += done
            reporter.advance(done)
            store.checkpoint()  # lookups below go to LMDB, as after a reopen
            rng = random.Random(config.seed + target)
            keys = [page_key(rng.randrange(written)) for _ in range(min(20_000, written))]
            t0 = time.perf_counter()
            for key in keys:
                if key not in store:
                    raise RuntimeError(f"lookup missed {key!r}")
            lookup_seconds = time.perf_counter() - t0
            single = _single_gets(store, keys, config.single_gets, config.seed)
            pages, read_seconds, _ = _get_many(store, keys, 64, 100, config.runtime_s, config.seed)
            points.append(
                {
                    "pages": written,
                    "page_bytes": page_bytes,
                    "added_pages": done,
                    "put_wall_us_per_page": seconds / done * 1e6,
                    "put_user_us_per_page": cpu.user_s / done * 1e6,
                    "put_system_us_per_page": cpu.system_s / done * 1e6,
                    "lookups_per_s": len(keys) / lookup_seconds,
                    "lookup_us": lookup_seconds / len(keys) * 1e6,
                    "get_p50_us": percentile(single, 50),
                    "get_p99_us": percentile(single, 99),
                    "get_many_us_per_page": read_seconds / pages * 1e6,
                }
            )
    finally:
        reporter.finish()
        store.close()
        remove_tree(directory)
    return points, _slope(points, "pages", "put_wall_us_per_page")


def _slope(points: Sequence[dict[str, Any]], x: str, y: str) -> float | None:
    """Least-squares slope of log(y) against log(x)."""
    pairs = [(math.log(p[x]), math.log(p[y])) for p in points if p.get(y) and p[x] > 0]
    if len(pairs) < 2:
        return None
    mean_x = sum(a for a, _ in pairs) / len(pairs)
    mean_y = sum(b for _, b in pairs) / len(pairs)
    spread = sum((a - mean_x) ** 2 for a, _ in pairs)
    if spread == 0:
        return None
    return sum((a - mean_x) * (b - mean_y) for a, b in pairs) / spread


def run_scaling(
    root: Path, config: ScalingConfig, reporter: Reporter, sweeps: Sequence[str] = SWEEPS
) -> dict[str, Any]:
    """Run the chosen sweeps; a JSON-ready dict of their points."""
    root = root / "scaling"
    root.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {}
    started = time.perf_counter()
    if "page_size" in sweeps:
        result["page_size"] = sweep_page_size(root, config, reporter)
    if "queue_depth" in sweeps:
        result["queue_depth"] = sweep_queue_depth(root, config, reporter)
    if "fill" in sweeps:
        result["fill"] = sweep_fill(root, config, reporter)
    if "pages" in sweeps:
        points, slope = sweep_pages(root, config, reporter)
        result["pages"] = points
        result["pages_put_cost_slope"] = slope
        result["pages_get_p50_slope"] = _slope(points, "pages", "get_p50_us")
        result["pages_lookup_slope"] = _slope(points, "pages", "lookup_us")
    result["seconds"] = time.perf_counter() - started
    remove_tree(root)
    return result


def plot(scaling: dict[str, Any], out_dir: Path) -> list[Path]:
    """One PNG per sweep present in ``scaling``; the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def figure(
        name: str,
        x_key: str,
        x_label: str,
        left: Sequence[tuple[str, str]],
        left_label: str,
        right: Sequence[tuple[str, str]],
        title: str,
        x_scale: float = 1.0,
        log_x: bool = True,
    ) -> None:
        points = scaling.get(name)
        if not points:
            return
        xs = [p[x_key] / x_scale for p in points]
        fig, (ax_left, ax_right) = plt.subplots(1, 2, figsize=(11, 4))
        for key, label in left:
            ax_left.plot(xs, [p.get(key) or math.nan for p in points], marker="o", label=label)
        ax_left.set_xlabel(x_label)
        ax_left.set_ylabel(left_label)
        ax_left.grid(True, alpha=0.3)
        ax_left.legend(fontsize=8)
        for key, label in right:
            ax_right.plot(xs, [p.get(key) or math.nan for p in points], marker="o", label=label)
        ax_right.set_xlabel(x_label)
        ax_right.set_ylabel("latency (µs)")
        ax_right.set_yscale("log")
        ax_right.grid(True, alpha=0.3, which="both")
        ax_right.legend(fontsize=8)
        ax_left.set_ylim(bottom=0)
        if log_x:
            base = 10 if x_key == "pages" else 2
            for axis in (ax_left, ax_right):
                axis.set_xscale("log", base=base)
                if base == 2:  # plain numbers (64, 256, ...) rather than 2^6
                    axis.set_xticks(xs, [f"{x:g}" for x in xs])
                    axis.minorticks_off()
        fig.suptitle(title)
        fig.tight_layout()
        path = out_dir / f"scaling_{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    figure(
        "page_size",
        "page_bytes",
        "page size (KiB)",
        [("put_mb_per_s", "durable put_many MB/s"), ("get_many_mb_per_s", "get_many(64) MB/s")],
        "throughput (MB/s)",
        [
            ("get_p50_us", "get p50"),
            ("get_p99_us", "get p99"),
            ("put_batch_p50_us", "put batch p50"),
            ("put_batch_p99_us", "put batch p99"),
        ],
        "kvstore vs page size (durable puts, cold O_DIRECT reads)",
        x_scale=KIB,
    )
    figure(
        "queue_depth",
        "queue_depth",
        "queue depth (io_depth; get_many of qd pages)",
        [("get_many_mb_per_s", "get_many MB/s"), ("put_mb_per_s", "durable put_many(64) MB/s")],
        "throughput (MB/s)",
        [
            ("get_many_call_p50_us", "get_many call p50"),
            ("get_many_call_p99_us", "get_many call p99"),
        ],
        "kvstore vs queue depth (256 KiB pages)",
    )
    figure(
        "fill",
        "fill_target",
        "store fill (fraction of capacity_bytes)",
        [("put_mb_per_s", "durable put MB/s (filling)"), ("get_many_mb_per_s", "get_many MB/s")],
        "throughput (MB/s)",
        [("get_p50_us", "get p50"), ("get_p99_us", "get p99")],
        "kvstore vs store fill (256 KiB pages, capacity-bounded store)",
        log_x=False,
    )
    figure(
        "pages",
        "pages",
        "pages in the store",
        [
            ("put_wall_us_per_page", "put wall µs/page"),
            ("put_user_us_per_page", "put user CPU µs/page"),
            ("get_many_us_per_page", "get_many µs/page"),
            ("lookup_us", "lookup (`in`) µs"),
        ],
        "per-page cost (µs)",
        [("get_p50_us", "get p50"), ("get_p99_us", "get p99")],
        "kvstore vs page count (4 KiB pages; flat = linear total cost)",
    )
    return written


# -- the command line (tools/scaling.py) ----------------------------------------

CLI_DESCRIPTION = (
    "Scaling sweeps alone (page size, queue depth, store fill, page count), with plots."
)


def _page_counts(max_pages: int) -> tuple[int, ...]:
    counts, count = [], 1_000
    while count < max_pages:
        counts.append(count)
        count *= 10
    return (*counts, max_pages)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=CLI_DESCRIPTION)
    parser.add_argument("--dir", type=Path, default=Path("./bench-data"))
    parser.add_argument("--plots", type=Path, default=Path("docs/img"))
    parser.add_argument("--out", type=Path, help="save the points as JSON")
    parser.add_argument("--sweep", action="append", choices=SWEEPS, help="default: all")
    parser.add_argument("--max-pages", type=int, default=1_000_000)
    parser.add_argument("--scaling-mib", type=int, default=256, help="bytes per sweep point")
    parser.add_argument("--fill-mib", type=int, default=1024, help="capacity of the fill sweep")
    parser.add_argument("--runtime", type=float, default=30.0, help="cap per point (seconds)")
    parser.add_argument("--replot", type=Path, help="only redraw the plots of a saved run")
    args = parser.parse_args(argv)
    if args.replot is not None:
        document = json.loads(args.replot.read_text())
        scaling = document.get("scaling", document)
    else:
        config = ScalingConfig(
            bytes_per_point=args.scaling_mib * MIB,
            fill_capacity_bytes=args.fill_mib * MIB,
            fill_segment_bytes=16 * MIB if args.fill_mib >= 512 else 4 * MIB,
            page_counts=_page_counts(args.max_pages),
            runtime_s=args.runtime,
        )
        args.dir.mkdir(parents=True, exist_ok=True)
        scaling = run_scaling(args.dir, config, NullReporter(), tuple(args.sweep or SWEEPS))
        if args.out is not None:
            args.out.write_text(json.dumps(finite({"scaling": scaling}), indent=2) + "\n")
    for path in plot(scaling, args.plots):
        print(path)
    slope = scaling.get("pages_put_cost_slope")
    if slope is not None:
        print(f"per-page put cost vs page count, log-log slope: {slope:.3f}", file=sys.stderr)
    return 0

"""One bench run: the phases in order, on one directory, into one JSON document.

Order: fio (with ``compare``), kvstore workloads, hot paths, peers (with
``compare``), scaling sweeps (with ``scaling``). Each phase works in its own
subdirectory of ``bench_dir`` and deletes it afterwards, with ``sync`` and a
short pause between phases so one phase's writeback does not land in the next.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvstore.bench.common import (
    COLD_METHODS,
    MIB,
    Measurement,
    Reporter,
    drop_caches_allowed,
    machine_info,
)
from kvstore.bench.fio import find_fio, run_fio_profiles
from kvstore.bench.kv import HotPathConfig, KvConfig, hot_paths, kv_workloads
from kvstore.bench.peers import PEERS, PeerConfig, run_peers
from kvstore.bench.report import SCHEMA_VERSION, evaluate_targets, to_json_ready
from kvstore.bench.scaling import SWEEPS, ScalingConfig, plot, run_scaling

__all__ = ["BenchOptions", "run_bench"]


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """Everything one run needs. Sizes are per workload."""

    bench_dir: Path
    compare: bool = False
    scaling: bool = False
    page_bytes: int = 256 << 10
    total_bytes: int = 1 << 30
    runtime_s: float = 30.0
    io_depth: int = 32
    fio: str | None = None  # a path, "none", or None for $PATH
    fio_size_mib: int = 1024
    fio_runtime_s: int = 10
    cold_method: str = "fadvise"
    peer_reads: int = 2000
    peers: tuple[str, ...] = tuple(PEERS)
    hot: HotPathConfig = field(default_factory=HotPathConfig)
    scaling_config: ScalingConfig = field(default_factory=ScalingConfig)
    sweeps: tuple[str, ...] = SWEEPS
    plots_dir: Path | None = None
    settle_s: float = 1.0
    allow_buffered: bool = False  # tests on tmpfs; never for published numbers


def _settle(seconds: float) -> None:
    os.sync()
    time.sleep(seconds)


def run_bench(options: BenchOptions, reporter: Reporter) -> dict[str, Any]:
    """Run every selected phase; the JSON-ready document (see docs/benchmarks.md)."""
    if options.cold_method not in COLD_METHODS:
        raise ValueError(f"cold method must be one of {COLD_METHODS}")
    if options.cold_method == "drop_caches" and not drop_caches_allowed():
        raise PermissionError("drop_caches needs root and a writable /proc/sys/vm/drop_caches")
    bench_dir = options.bench_dir
    bench_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    machine = machine_info(bench_dir)
    fio = find_fio(options.fio)
    measurements: list[Measurement] = []
    phases: dict[str, float] = {}

    def phase() -> float:
        """Settle (sync, pause), then the start time of the next phase."""
        _settle(options.settle_s)
        return time.perf_counter()

    if options.compare:
        t0 = phase()
        measurements += run_fio_profiles(
            fio, bench_dir, options.fio_size_mib, options.fio_runtime_s, reporter
        )
        phases["fio"] = time.perf_counter() - t0
    kv = KvConfig(
        page_bytes=options.page_bytes,
        total_bytes=options.total_bytes,
        io_depth=options.io_depth,
        runtime_s=options.runtime_s,
        allow_buffered=options.allow_buffered,
    )
    t0 = phase()
    measurements += kv_workloads(bench_dir, kv, reporter)
    phases["kvstore"] = time.perf_counter() - t0
    t0 = phase()
    hot = HotPathConfig(
        page_bytes=options.hot.page_bytes,
        pages=options.hot.pages,
        group_sizes=options.hot.group_sizes,
        segment_bytes=options.hot.segment_bytes,
        runtime_s=options.hot.runtime_s,
        allow_buffered=options.allow_buffered,
    )
    measurements += hot_paths(bench_dir, hot, reporter)
    phases["hot_paths"] = time.perf_counter() - t0
    if options.compare:
        t0 = phase()
        peers = PeerConfig(
            page_bytes=options.page_bytes,
            total_bytes=options.total_bytes,
            io_depth=options.io_depth,
            reads=options.peer_reads,
            runtime_s=options.runtime_s,
            cold_method=options.cold_method,
        )
        measurements += run_peers(bench_dir, peers, reporter, options.peers)
        phases["peers"] = time.perf_counter() - t0
    scaling: dict[str, Any] | None = None
    plots: list[str] = []
    if options.scaling:
        t0 = phase()
        config = options.scaling_config
        if options.allow_buffered and not config.allow_buffered:
            config = ScalingConfig(**{**asdict(config), "allow_buffered": True})
        scaling = run_scaling(bench_dir, config, reporter, options.sweeps)
        phases["scaling"] = time.perf_counter() - t0
        slope = scaling.get("pages_put_cost_slope")
        if slope is not None:
            largest = max(p["pages"] for p in scaling["pages"])
            measurements.append(
                Measurement(
                    name="scaling.pages",
                    label=f"per-page put cost slope, 10^3..{largest:,} pages (log-log)",
                    group="scaling",
                    extra={"put_cost_slope": slope, "max_pages": float(largest)},
                )
            )
        if options.plots_dir is not None:
            plots = [str(path) for path in plot(scaling, options.plots_dir)]
    document: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "title": (
            f"kvstore bench: {options.page_bytes >> 10} KiB pages, "
            f"{options.total_bytes / MIB:,.0f} MiB per workload, {machine['nproc']} CPUs, "
            f"{machine['mount'].get('fs', '?') if isinstance(machine['mount'], dict) else '?'}, "
            f"engine: {machine['io_engine']}"
        ),
        "started_unix": started,
        "seconds": time.time() - started,
        "machine": machine,
        "options": {
            "bench_dir": str(bench_dir),
            "compare": options.compare,
            "scaling": options.scaling,
            "page_bytes": options.page_bytes,
            "total_bytes": options.total_bytes,
            "runtime_s": options.runtime_s,
            "io_depth": options.io_depth,
            "cold_method": options.cold_method,
            "peer_reads": options.peer_reads,
            "hot_pages": options.hot.pages,
            "hot_page_bytes": options.hot.page_bytes,
            "fio_size_mib": options.fio_size_mib,
            "fio_runtime_s": options.fio_runtime_s,
        },
        "fio": {
            "available": fio.available,
            "path": fio.path,
            "version": fio.version,
            "reason": fio.reason,
            "ran": options.compare and fio.available,
        },
        "phases_s": phases,
        "loadavg_end": list(os.getloadavg()),
        "measurements": [m.as_dict() for m in measurements],
        "targets": evaluate_targets(measurements),
        "scaling": scaling,
        "plots": plots,
    }
    return to_json_ready(document)

"""Prometheus metrics of the tier manager: its registry, and the persisted statistics'.

Names as docs/tiering.md, "Metrics and alerts", lists them: the common
``kv_cache_hit_total{layer}`` (layer 0 HBM, 1 DRAM, 2 NVMe) with ``kv_cache_miss_total``
beside it, ``kv_offload_latency_seconds{src_layer,dst_layer}`` and
``kv_page_table_size_bytes``, then ``kvstore_tier_*`` for the rest. Units and suffixes as in
``kvstore.telemetry.prometheus`` (whose ``lint_exposition`` the tests run on every
exposition): counters end in ``_total``, sizes in ``_bytes``, times in ``_seconds``.

Every scrape reads a fresh ``TierStats`` through the callable given to
``registry_for``: ``TierManager.stats`` live, or a view of ``tiering-stats.json``
(``StatsFileCollector``, for ``kvstore metrics PATH`` beside a running manager).

The store's own collector exports those ``kv_*`` names too (as layer 2 only). Both in one
exposition would declare a family twice and count layer 2 twice, so
``registry_beside_store`` drops the store's families of those names: the manager's,
which see every layer, replace them (the store's latencies stay in
``kvstore_operation_latency_seconds``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvstore.errors import KVStoreError
from kvstore.tiering.results import UNBOUNDED_BYTES, TierStats
from kvstore.tiering.statsfile import read_stats_file, stats_file_of, stats_view_from_file

__all__ = [
    "SEED_FAMILIES",
    "StatsFileCollector",
    "TierCollector",
    "WithoutFamilies",
    "persisted_families",
    "registry_beside_store",
    "registry_for",
    "registry_for_data",
    "registry_for_file",
    "tier_families",
]

TIER_NAMES = ("hbm", "dram", "nvme")
LAYERS = ("0", "1", "2")  # the ``layer`` label of each tier
SEED_FAMILIES = frozenset(
    {"kv_cache_hit", "kv_cache_miss", "kv_offload_latency_seconds", "kv_page_table_size_bytes"}
)
LOAD_FAILURE = "load_failure:"  # the manager's counters of failed loads, by reason
NO_TIER = "none"  # the tier label of a counter key without one ("orphan")


class TierCollector(Collector):
    """Yields the tier manager's metric families from a fresh ``TierStats`` each scrape."""

    def __init__(self, stats: Callable[[], TierStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        yield from tier_families(self._stats())


def tier_families(stats: TierStats) -> Iterator[Metric]:
    """The metric families of one snapshot (docs/tiering.md, "Metrics and alerts")."""
    hit = CounterMetricFamily(
        "kv_cache_hit",
        "KV-cache page lookups served, by the layer that served them (0 HBM, 1 DRAM, 2 NVMe)",
        labels=["layer"],
    )
    for layer, hits in zip(LAYERS, stats.hits_by_tier, strict=True):
        hit.add_metric([layer], hits)
    yield hit
    yield _counter("kv_cache_miss", "KV-cache page lookups found in no tier", stats.misses)
    yield _offload_latency(stats.offload_latency_s)
    yield _gauge(
        "kv_page_table_size_bytes",
        "Memory of the tier manager's page table (page records and keys)",
        stats.page_table_bytes,
    )
    yield _counter("kvstore_tier_lookups", "Lookups the tier manager answered", stats.lookups)
    remote = stats.remote
    for name, values, documentation in (
        ("kvstore_tier_used_bytes", stats.used_bytes, "Bytes of pages held in each tier"),
        ("kvstore_tier_pages", stats.pages_by_tier, "Pages held in each tier"),
        ("kvstore_tier_kappa", stats.kappa, "Recompute time over load time of a page, per tier"),
        (
            "kvstore_tier_tau_seconds_per_byte",
            stats.tau,
            "Admission bar per tier: seconds of recompute saved per byte (admit at VD >= tau)",
        ),
    ):
        remote_kappa = float(remote["kappa"]) if remote and name == "kvstore_tier_kappa" else None
        yield _per_tier(name, documentation, values, remote_kappa)
    # A tier without a bound (NVMe without capacity_bytes) has no capacity sample: a
    # ratio to it is then no series rather than a fraction of a made-up number.
    capacity = GaugeMetricFamily(
        "kvstore_tier_capacity_bytes",
        "Each tier's capacity (no sample for a tier without a bound)",
        labels=["tier"],
    )
    for tier, capacity_bytes in zip(TIER_NAMES, stats.capacity_bytes, strict=True):
        if capacity_bytes < UNBOUNDED_BYTES:
            capacity.add_metric([tier], capacity_bytes)
    yield capacity
    yield _per_tier(
        "kvstore_tier_in_use",
        "1 where the tier is used for loads (HBM always; DRAM and NVMe while kappa >= 1), "
        "0 where loading from it is measured slower than recomputing",
        tuple(1.0 if used else 0.0 for used in stats.in_use),
        (1.0 if remote["in_use"] else 0.0) if remote else None,
    )
    if remote:
        yield from _remote_families(remote)
    if stats.nvme_write_gate is not None:
        gate = GaugeMetricFamily(
            "kvstore_tier_nvme_write_gate",
            "1 where NVMe takes the writes of a class of page (seen_once, seen_again), "
            "0 where their writes are measured not to be read back",
            labels=["class"],
        )
        for name, open_ in zip(("seen_once", "seen_again"), stats.nvme_write_gate, strict=True):
            gate.add_metric([name], 1.0 if open_ else 0.0)
        yield gate
    if stats.nvme_displacement is not None:
        yield GaugeMetricFamily(
            "kvstore_tier_nvme_displacement_on",
            "1 while a write into a full NVMe must be of a page asked for at least twice "
            "lately and more often than the page it displaces (measured to serve more "
            "hits), else 0",
            value=1.0 if stats.nvme_displacement["on"] else 0.0,
        )
    yield _split_counter(
        "kvstore_tier_admissions",
        "Admission decisions by tier and decision (admitted, below_tau, full, ...)",
        ("tier", "decision"),
        stats.admissions,
    )
    yield _split_counter(
        "kvstore_tier_evictions",
        "Pages evicted from a tier, by reason (clean, dropped, emergency, ...)",
        ("tier", "reason"),
        stats.evictions,
    )
    for name, value, documentation in (
        ("kvstore_tier_demotions", stats.demotions, "Pages moved down a tier"),
        ("kvstore_tier_promotions", stats.promotions, "Pages moved up a tier"),
        (
            "kvstore_tier_hysteresis_blocks",
            stats.hysteresis_blocks,
            "Page moves within hysteresis_s of the page's last demotion",
        ),
        (
            "kvstore_tier_thrash",
            stats.thrash,
            "Pages promoted back within hysteresis_s of their demotion",
        ),
        (
            "kvstore_tier_emergency_evictions",
            stats.emergency_evictions,
            "Pages evicted without write-back while NVMe writes fell behind",
        ),
        (
            "kvstore_tier_nvme_written_bytes",
            stats.nvme_bytes_written,
            "Page bytes the tier manager wrote to NVMe",
        ),
        (
            "kvstore_tier_nvme_written_pages",
            stats.nvme_pages_written,
            "Pages the tier manager wrote to NVMe",
        ),
    ):
        yield _counter(name, documentation, value)
    failures = CounterMetricFamily(
        "kvstore_tier_load_failures",
        "Page loads that failed, by reason (nvme_read, no_slot, copy, unreadable; unknown "
        "where the manager did not say): recomputed, never served",
        labels=["reason"],
    )
    reasons = {reason: count for reason, count in stats.load_failure_reasons.items() if count}
    unknown = stats.load_failures - sum(reasons.values())
    if unknown > 0 or not reasons:
        reasons["unknown"] = reasons.get("unknown", 0) + max(unknown, 0)
    for reason, count in sorted(reasons.items()):
        failures.add_metric([reason], count)
    yield failures
    recompute = CounterMetricFamily(
        "kvstore_tier_recompute_decisions",
        "Lookups answered with recompute instead of a load, by reason",
        labels=["reason"],
    )
    for reason, count in sorted(stats.recompute_decisions.items()):
        recompute.add_metric([reason], count)
    yield recompute
    yield _per_path(
        "kvstore_tier_bandwidth_bytes_per_second",
        "Fitted bandwidth of each transfer path",
        stats.bandwidth_bytes_per_s,
    )
    yield _per_path(
        "kvstore_tier_transfer_latency_seconds",
        "Fitted fixed cost of one transfer on each path",
        stats.latency_s,
    )
    yield _per_path(
        "kvstore_tier_in_flight_bytes",
        "Bytes queued or moving on each transfer path",
        stats.in_flight_bytes,
    )
    yield _gauge(
        "kvstore_tier_emergency",
        "1 while NVMe writes are too far behind and DRAM evicts without write-back",
        1.0 if stats.emergency else 0.0,
    )
    yield _gauge(
        "kvstore_tier_compute_flops_per_second",
        "Fitted effective compute rate C_eff (floating-point operations per second) that "
        "recompute costs assume",
        stats.compute_flops,
    )
    policies = (stats.mover, stats.placement, stats.admission, stats.eviction)
    if any(policies):
        info = GaugeMetricFamily(
            "kvstore_tier_policy_info",
            "The manager's mover and policies (value 1)",
            labels=["mover", "placement", "admission", "eviction"],
        )
        info.add_metric(list(policies), 1.0)
        yield info


def _offload_latency(
    histograms: Mapping[str, tuple[tuple[float, ...], tuple[int, ...], float, int]],
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(
        "kv_offload_latency_seconds",
        "Page transfer latency between cache layers, submit to completion (0 HBM, 1 DRAM, 2 NVMe)",
        labels=["src_layer", "dst_layer"],
    )
    for path, (bounds, cumulative, total_s, count) in sorted(histograms.items()):
        source, _, destination = path.partition("->")
        if len(bounds) != len(cumulative):
            raise ValueError(
                f"offload latency {path!r}: {len(bounds)} bounds, {len(cumulative)} counts"
            )
        buckets = [
            (repr(float(bound)), float(n)) for bound, n in zip(bounds, cumulative, strict=True)
        ]
        buckets.append(("+Inf", float(count)))
        family.add_metric([source, destination], buckets, total_s)
    return family


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation)
    family.add_metric([], value)
    return family


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation)
    family.add_metric([], value)
    return family


def _per_tier(
    name: str, documentation: str, values: Iterable[float], remote: float | None = None
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=["tier"])
    for tier, value in zip(TIER_NAMES, values, strict=True):
        family.add_metric([tier], value)
    if remote is not None:
        family.add_metric(["remote"], remote)
    return family


def _remote_families(remote: Mapping[str, Any]) -> Iterator[Metric]:
    """The remote tier's own families (docs/tiering.md, "The remote tier"), labelled
    ``tier="remote"`` like the per-tier ones."""
    yield _labelled(
        GaugeMetricFamily,
        "kvstore_tier_degraded",
        "1 while the remote tier is degraded (master unreachable, a call past its "
        "deadline): local tiers serve alone",
        1.0 if remote["state"] != "up" else 0.0,
    )
    yield _labelled(
        CounterMetricFamily,
        "kvstore_tier_remote_hits",
        "Pages read from the remote tier, verified and admitted to DRAM",
        remote["hits"],
    )
    yield _labelled(
        CounterMetricFamily,
        "kvstore_tier_remote_published",
        "Pages published to the remote tier",
        remote["published"],
    )
    misses = CounterMetricFamily(
        "kvstore_tier_remote_misses",
        "Remote reads that served no page, by reason (absent, transfer, master, short, "
        "empty, late, mismatched, checksum, unverifiable, orphan, no_slot, busy)",
        labels=["tier", "reason"],
    )
    for reason, count in sorted(remote["miss_reasons"].items()):
        misses.add_metric(["remote", reason], count)
    yield misses
    bandwidth = GaugeMetricFamily(
        "kvstore_tier_remote_bandwidth_bytes_per_second",
        "Fitted bandwidth of the remote tier's reads and writes",
        labels=["tier", "path"],
    )
    for path, fit in sorted(remote["bandwidth"].items()):
        bandwidth.add_metric(["remote", path], float(fit["bytes_per_s"]))
    yield bandwidth


def _labelled(kind: Any, name: str, documentation: str, value: float) -> Metric:
    family = kind(name, documentation, labels=["tier"])
    family.add_metric(["remote"], value)
    return family  # type: ignore[no-any-return]


def _per_path(name: str, documentation: str, values: Mapping[str, float]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=["path"])
    for path, value in sorted(values.items()):
        family.add_metric([path], value)
    return family


def _split_counter(
    name: str, documentation: str, labels: tuple[str, str], counts: Mapping[str, int]
) -> CounterMetricFamily:
    """A counter keyed "tier:what" (a key without a tier gets tier="none")."""
    family = CounterMetricFamily(name, documentation, labels=list(labels))
    for key, count in sorted(counts.items()):
        tier, _, what = key.partition(":")
        family.add_metric([tier, what] if what else [NO_TIER, tier], count)
    return family


def registry_for(stats: Callable[[], TierStats]) -> CollectorRegistry:
    """A registry that reads ``stats()`` at each scrape (``TierManager.metrics_registry``)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TierCollector(stats))
    return registry


class StatsFileCollector(Collector):
    """The tier metrics of ``tiering-stats.json``, re-read at each scrape.

    Adds ``kvstore_tier_stats_readable`` (0 when the file is missing or damaged at
    this scrape: then nothing else is yielded, and the scrape still succeeds) and
    ``kvstore_tier_stats_saved_timestamp_seconds``. Fields the file does not keep
    read as zero (``stats_view_from_file``).
    """

    def __init__(self, path: str | Path) -> None:
        self.file = stats_file_of(path)

    def collect(self) -> Iterator[Metric]:
        try:
            data = read_stats_file(self.file)
        except KVStoreError:
            yield _readable(0.0)
            return
        yield from persisted_families(data)


def persisted_families(data: Mapping[str, Any]) -> Iterator[Metric]:
    """The families of one read of the statistics file (``read_stats_file``)."""
    yield _readable(1.0)
    yield _gauge(
        "kvstore_tier_stats_saved_timestamp_seconds",
        "When the tier manager last persisted its statistics (unix time)",
        float(data["saved_at_unix_s"]),
    )
    view = stats_view_from_file(data)
    if not view.load_failure_reasons:  # the manager's "load_failure:<reason>" counters
        counters: Mapping[str, Any] = data["summary"]["counters"]
        reasons = {
            name.removeprefix(LOAD_FAILURE): int(count)
            for name, count in counters.items()
            if name.startswith(LOAD_FAILURE)
        }
        view = dataclasses.replace(view, load_failure_reasons=reasons)
    yield from tier_families(view)


def _readable(value: float) -> GaugeMetricFamily:
    return _gauge(
        "kvstore_tier_stats_readable",
        "1 when the tier manager's statistics file could be read at this scrape, else 0",
        value,
    )


def registry_for_file(path: str | Path) -> CollectorRegistry:
    """A registry serving the persisted statistics at ``path`` (store dir or file)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsFileCollector(path))
    return registry


class _Persisted(Collector):
    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = data

    def collect(self) -> Iterator[Metric]:
        yield from persisted_families(self._data)


def registry_for_data(data: Mapping[str, Any]) -> CollectorRegistry:
    """A registry over one read of the file (``kvstore tier metrics``: one exposition,
    the same families the exporter serves)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Persisted(data))
    return registry


class WithoutFamilies(Collector):
    """Another collector's families, less those named in ``names``."""

    def __init__(self, collector: Collector, names: Iterable[str]) -> None:
        self._collector = collector
        self._names = frozenset(names)

    def collect(self) -> Iterator[Metric]:
        for family in self._collector.collect():
            if family.name not in self._names:
                yield family


def registry_beside_store(store: Collector, tier: Collector) -> CollectorRegistry:
    """One registry with the store's metrics and the tier manager's; the manager's
    families of the ``kv_*`` names replace the store's (module docstring)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WithoutFamilies(store, SEED_FAMILIES))
    registry.register(tier)
    return registry

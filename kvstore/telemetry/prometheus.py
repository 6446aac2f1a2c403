"""Prometheus metrics of a store: a registry the engine can mount, and the exporter.

Names follow the design notes where they name a metric (``kv_cache_hit_total{layer}``
and ``kv_cache_miss_total`` beside it,
``kv_offload_latency_seconds{src_layer,dst_layer}``, ``kv_page_table_size_bytes``;
this store is layer 2, the NVMe tier, so a put is an offload 1 -> 2 and a get a
load 2 -> 1) and ``kvstore_*`` for the rest. Counters end in ``_total``; units are
base units (``_seconds``, ``_bytes``); ``lint_exposition`` checks that, as
``promtool check metrics`` does, and the tests run it on every exposition.

Every scrape reads a fresh ``TelemetrySnapshot`` through the callable given to
``registry_for``: the live counters for ``KVStore.metrics_registry()``, the
persisted ones for ``kvstore metrics PATH`` (which runs beside the writer): there the
gauges (fill levels, a degraded open) are the writer's at its last save.
Imports prometheus_client; only the exporter and the engine's mount import this.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from kvstore.telemetry import TelemetrySnapshot
from kvstore.telemetry.counters import LATENCY_BOUNDS_S, LATENCY_OPS, WRITE_KINDS
from kvstore.telemetry.smart import SmartReport

__all__ = ["StoreCollector", "lint_exposition", "registry_for"]

STORE_LAYER = "2"  # the design notes' layers: 0 HBM, 1 DRAM, 2 NVMe
_OFFLOAD = {"put": ("1", STORE_LAYER), "get": (STORE_LAYER, "1")}
_OPERATIONS = {
    "put": "puts",
    "get": "gets",
    "delete": "deletes",
    "commit": "commits",
    "checkpoint": "checkpoints",
    "gc_pass": "gc_passes",
}


def _histogram(name: str, documentation: str, labels: list[str]) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, documentation, labels=labels)


def _buckets(counts: tuple[int, ...]) -> list[tuple[str, float]]:
    cumulative = 0
    out: list[tuple[str, float]] = []
    for bound, count in zip((*LATENCY_BOUNDS_S, float("inf")), counts, strict=True):
        cumulative += count
        out.append(("+Inf" if bound == float("inf") else repr(bound), float(cumulative)))
    return out


class StoreCollector(Collector):
    """Yields the store's metric families from a fresh snapshot at each scrape."""

    def __init__(
        self,
        snapshot: Callable[[], TelemetrySnapshot],
        smart: Callable[[], SmartReport] | None = None,
    ) -> None:
        self._snapshot = snapshot
        self._smart = smart

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        counters = snap.counters()
        wear = snap.wear_report()

        hit = CounterMetricFamily(
            "kv_cache_hit",
            "KV-cache page lookups served, by the layer that served them (2 = this NVMe store)",
            labels=["layer"],
        )
        hit.add_metric([STORE_LAYER], counters["hits"])
        yield hit
        miss = CounterMetricFamily("kv_cache_miss", "KV-cache page lookups this store missed")
        miss.add_metric([], counters["misses"])
        yield miss

        offload = _histogram(
            "kv_offload_latency_seconds",
            "Page transfer latency between cache layers (put: 1 -> 2, get: 2 -> 1)",
            ["src_layer", "dst_layer"],
        )
        latency = _histogram(
            "kvstore_operation_latency_seconds",
            "Latency of store operations: put (until readable), get, flush (group "
            "commit), gc (one pass)",
            ["op"],
        )
        for op in LATENCY_OPS:
            counts, total_s = snap.histogram(op)
            latency.add_metric([op], _buckets(counts), total_s)
            if op in _OFFLOAD:
                offload.add_metric(list(_OFFLOAD[op]), _buckets(counts), total_s)
        yield offload
        yield latency

        host = CounterMetricFamily(
            "kvstore_host_written_bytes",
            "Payload bytes callers stored (host writes)",
        )
        host.add_metric([], counters["host_bytes"])
        yield host
        written = CounterMetricFamily(
            "kvstore_written_bytes",
            "Every byte the store wrote to the drive, by kind (host payload included)",
            labels=["kind"],
        )
        for kind in WRITE_KINDS:
            written.add_metric([kind], counters[f"{kind}_bytes"])
        yield written
        read = CounterMetricFamily("kvstore_read_bytes", "Payload bytes returned to callers")
        read.add_metric([], counters["read_bytes"])
        yield read
        operations = CounterMetricFamily(
            "kvstore_operations", "Store operations by kind", labels=["op"]
        )
        for op, name in _OPERATIONS.items():
            operations.add_metric([op], counters[name])
        yield operations
        for name, key, documentation in (
            ("kvstore_put_declined", "declined_puts", "Puts the DWPD budget did not admit"),
            (
                "kvstore_put_declined_bytes",
                "declined_bytes",
                "Payload bytes of puts the DWPD budget did not admit",
            ),
            ("kvstore_evicted_pages", "evicted_pages", "Pages evicted to make room"),
            ("kvstore_evicted_bytes", "evicted_bytes", "Payload bytes evicted to make room"),
            ("kvstore_gc_moved_pages", "gc_moved_pages", "Pages GC copied forward"),
            ("kvstore_segments_freed", "segments_freed", "Segment files GC freed"),
        ):
            family = CounterMetricFamily(name, documentation)
            family.add_metric([], counters[key])
            yield family

        yield _gauge(
            "kvstore_write_amplification",
            "Store bytes written per host byte, lifetime (all kinds)",
            wear.write_amplification,
        )
        dwpd = GaugeMetricFamily(
            "kvstore_dwpd",
            "Drive writes per day caused by this store over a window",
            labels=["window"],
        )
        for window, value in wear.dwpd.items():
            dwpd.add_metric([window], value)
        yield dwpd
        yield _gauge(
            "kvstore_rated_dwpd", "The drive's rated drive writes per day", wear.rated_dwpd
        )
        if wear.max_dwpd is not None:
            yield _gauge(
                "kvstore_dwpd_budget",
                "The store's DWPD budget (max_dwpd); puts beyond it are declined",
                wear.max_dwpd,
            )
        if wear.budget_used_ratio is not None:
            yield _gauge(
                "kvstore_dwpd_budget_used_ratio",
                "DWPD over 24 h divided by the budget (or by the rating without a budget)",
                wear.budget_used_ratio,
            )
        if wear.drive_capacity_bytes:
            yield _gauge(
                "kvstore_drive_capacity_bytes",
                "Capacity of the drive DWPD is computed against",
                wear.drive_capacity_bytes,
            )
        if wear.projected_life_days is not None:
            yield _gauge(
                "kvstore_projected_life_seconds",
                "Rated endurance left after this store's writes, at the 24 h write rate",
                wear.projected_life_days * 86_400,
            )
        yield _gauge(
            "kvstore_telemetry_start_timestamp_seconds",
            "When this store's counters began (unix time)",
            snap.created_s,
        )
        if snap.saved_s is not None:
            yield _gauge(
                "kvstore_telemetry_saved_timestamp_seconds",
                "When the counters were last persisted (unix time)",
                snap.saved_s,
            )
        gauges = dict(snap.gauges)
        if "page_table_bytes" in gauges:
            yield _gauge(
                "kv_page_table_size_bytes",
                "Size of the page table (the LMDB index file)",
                gauges.pop("page_table_bytes"),
            )
        for name, documentation in (
            ("pages", "Live pages"),
            ("segments", "Segment files in use"),
            ("live_bytes", "Record bytes of live pages"),
            ("pinned_pages", "Pins held in this process"),
            ("retained_pages", "Retained pages"),
            ("capacity_bytes", "The store's capacity (no sample without one)"),
            ("free_bytes", "Capacity less the segment files' bytes: room left to grow into"),
            # A degraded open (docs/operations.md, "Degraded open"): nonzero means the
            # store opened around damage; `kvstore fsck PATH` says what to repair.
            ("degraded", "1 when this open found damage it repaired, salvaged or quarantined"),
            ("quarantined_segments", "Segments with a damaged header or file, never written"),
            ("quarantined_pages", "Pages the index named that failed verification (misses)"),
            ("salvaged_pages", "Pages of quarantined segments that verified and are served"),
            ("damaged_wal_headers", "WAL files whose header was damaged (records replayed)"),
            ("index_salvaged", "1 when the LMDB index was damaged and rebuilt at open"),
        ):
            if name in gauges:
                yield _gauge(f"kvstore_{name}", documentation, gauges[name])
        if self._smart is not None:
            yield from _smart_metrics(self._smart())


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation)
    family.add_metric([], value)
    return family


def _smart_metrics(report: SmartReport) -> Iterator[Metric]:
    yield _gauge(
        "kvstore_device_smart_available",
        "1 when the drive's SMART wear counters could be read, else 0",
        1.0 if report.available else 0.0,
    )
    if report.data_written_bytes is not None:
        family = CounterMetricFamily(
            "kvstore_device_written_bytes", "Bytes the drive reports written in its lifetime"
        )
        family.add_metric([], report.data_written_bytes)
        yield family
    if report.percentage_used is not None:
        yield _gauge(
            "kvstore_device_wear_used_ratio",
            "The drive's own estimate of endurance used (NVMe Percentage Used / 100)",
            report.percentage_used / 100,
        )


def registry_for(
    snapshot: Callable[[], TelemetrySnapshot],
    smart: Callable[[], SmartReport] | None = None,
) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(snapshot, smart))
    return registry


_SNAKE = re.compile(r"^[a-z][a-z0-9_]*$")
_NON_BASE_UNITS = (
    "milliseconds",
    "microseconds",
    "nanoseconds",
    "minutes",
    "hours",
    "days",
    "kilobytes",
    "megabytes",
    "gigabytes",
    "kib",
    "mib",
    "gib",
    "percent",
    "bits",
)
_ABBREVIATIONS = ("_sec", "_secs", "_ms", "_msec", "_us", "_ns", "_kb", "_mb", "_pct")
_TYPE_WORDS = ("_counter", "_gauge", "_histogram", "_summary")


def lint_exposition(text: str) -> list[str]:
    """Problems in a text exposition, in the spirit of ``promtool check metrics``.

    Parses with ``prometheus_client.parser`` (so a malformed exposition raises), then
    checks: snake_case metric and label names, ``_total`` on counters and only
    there, base units (no milliseconds, percent, ...), no unit abbreviations, no
    type names in metric names, histograms named for a unit (``_seconds`` or
    ``_bytes``), non-empty help, no family declared twice, no reserved labels.
    """
    problems: list[str] = []
    seen: set[str] = set()
    for family in text_string_to_metric_families(text):
        name = family.name
        problems.extend(_lint_family(family.type, name, family.documentation, seen))
        for sample in family.samples:
            for label in sample.labels:
                if label == "le" and family.type == "histogram":
                    continue
                if label.startswith("__") or not _SNAKE.match(label):
                    problems.append(f"{name}: label {label!r} is not snake_case")
    return problems


def _lint_family(kind: str, name: str, documentation: str, seen: set[str]) -> list[str]:
    problems = []
    # prometheus_client strips "_total" from counter family names when parsing.
    full = f"{name}_total" if kind == "counter" else name
    if name in seen:
        problems.append(f"{full}: declared more than once")
    seen.add(name)
    if not _SNAKE.match(full) or "__" in full:
        problems.append(f"{full}: not snake_case")
    if kind != "counter" and full.endswith("_total"):
        problems.append(f"{full}: only counters end in _total")
    if not documentation.strip():
        problems.append(f"{full}: no help text")
    words = full.split("_")
    for unit in _NON_BASE_UNITS:
        if unit in words:
            problems.append(f"{full}: use base units (seconds, bytes, ratio), not {unit}")
    for abbreviation in _ABBREVIATIONS:
        if f"{full}_".find(f"{abbreviation}_") >= 0:
            problems.append(f"{full}: unit abbreviation {abbreviation.strip('_')}")
    for word in _TYPE_WORDS:
        if word in full:
            problems.append(f"{full}: metric type in the name")
    if kind == "histogram" and not (name.endswith("_seconds") or name.endswith("_bytes")):
        problems.append(f"{full}: a histogram is named for its unit (_seconds or _bytes)")
    for suffix in ("_bucket", "_count", "_sum"):
        if kind not in ("histogram", "summary") and full.endswith(suffix):
            problems.append(f"{full}: {suffix} is reserved for histograms and summaries")
    return problems

"""The tier manager's Prometheus metrics and its persisted statistics file, read back.

Expositions are parsed with prometheus_client.parser and linted with
``lint_exposition`` (as ``promtool check metrics``); values are checked against the
``TierStats`` or the file they came from.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvstore.telemetry.prometheus import StoreCollector, lint_exposition
from kvstore.tiering.metrics import (
    StatsFileCollector,
    TierCollector,
    registry_beside_store,
    registry_for,
    registry_for_file,
)
from kvstore.tiering.results import TierStats
from kvstore.tiering.statsfile import (
    STATS_FILE,
    STATS_VERSION,
    TierStatsCorruptError,
    TierStatsNotFoundError,
    TierStatsVersionError,
    read_stats_file,
    stats_view_from_file,
    summarize,
)
from tests.conftest import OpenStore

BOUNDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5)


def fake_stats(**changes: Any) -> TierStats:
    """A snapshot with a distinct value in every field (``changes`` override some)."""
    fields: dict[str, Any] = {
        "pages": 9,
        "used_bytes": (100, 200, 300),
        "capacity_bytes": (1000, 2000, 3000),
        "pages_by_tier": (1, 2, 6),
        "hits_by_tier": (70, 20, 5),
        "misses": 5,
        "lookups": 40,
        "admissions": {"dram:admitted": 4, "nvme:below_tau": 2, "orphan": 1},
        "evictions": {"hbm:clean": 3, "dram:emergency": 11},
        "demotions": 7,
        "promotions": 8,
        "hysteresis_blocks": 12,
        "thrash": 13,
        "recompute_decisions": {"no_hit": 3, "faster": 2},
        "emergency_evictions": 14,
        "emergency": True,
        "tau": (1e-9, 2e-9, math.inf),
        "kappa": (10.0, 5.0, 1.5),
        "bandwidth_bytes_per_s": {"d2h": 2.5e10, "nvme_read": 6e9},
        "latency_s": {"d2h": 1e-5, "nvme_read": 1e-4},
        "compute_flops": 3e14,
        "in_flight_bytes": {"d2h": 4096, "nvme_write": 0},
        "nvme_bytes_written": 123_456,
        "nvme_pages_written": 15,
        "load_failures": 16,
        "load_failure_reasons": {"nvme_read": 10, "no_slot": 4},
        "offload_latency_s": {
            "1->2": (BOUNDS, (1, 2, 3, 3, 4, 4), 0.3, 5),
            "2->1": (BOUNDS, (0, 0, 0, 1, 1, 2), 0.25, 2),
        },
        "page_table_bytes": 3600,
        "mover": "FakeMover",
        "placement": "value_density",
        "admission": "vd",
        "eviction": "lru",
    }
    fields.update(changes)
    return TierStats(**fields)


def exposition(registry: Any) -> str:
    text: str = generate_latest(registry).decode()
    assert lint_exposition(text) == []
    return text


def samples(text: str) -> dict[str, list[Sample]]:
    """Every sample by its sample name (``..._total``, ``..._bucket``, ...)."""
    out: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def by(found: dict[str, list[Sample]], name: str, *labels: str) -> dict[Any, float]:
    rows = {}
    for sample in found[name]:
        key = tuple(sample.labels[label] for label in labels)
        rows[key[0] if len(key) == 1 else key] = sample.value
    return rows


def value(found: dict[str, list[Sample]], name: str) -> float:
    [sample] = found[name]
    return sample.value


# -- TierCollector -----------------------------------------------------------------------------


def test_every_field_is_exported_under_its_name_and_labels() -> None:
    text = exposition(registry_for(fake_stats))
    types = {family.name: family.type for family in text_string_to_metric_families(text)}
    assert types["kv_cache_hit"] == "counter"
    assert types["kv_offload_latency_seconds"] == "histogram"
    assert types["kvstore_tier_tau_seconds_per_byte"] == "gauge"
    assert types["kv_cache_miss"] == "counter"
    found = samples(text)
    assert by(found, "kv_cache_hit_total", "layer") == {"0": 70, "1": 20, "2": 5}
    assert value(found, "kv_cache_miss_total") == 5
    assert value(found, "kv_page_table_size_bytes") == 3600
    assert value(found, "kvstore_tier_lookups_total") == 40
    for name, expected in (
        ("kvstore_tier_used_bytes", (100, 200, 300)),
        ("kvstore_tier_capacity_bytes", (1000, 2000, 3000)),
        ("kvstore_tier_pages", (1, 2, 6)),
        ("kvstore_tier_kappa", (10.0, 5.0, 1.5)),
        ("kvstore_tier_tau_seconds_per_byte", (1e-9, 2e-9, math.inf)),
    ):
        assert by(found, name, "tier") == dict(
            zip(("hbm", "dram", "nvme"), expected, strict=True)
        ), name
    assert by(found, "kvstore_tier_admissions_total", "tier", "decision") == {
        ("dram", "admitted"): 4,
        ("nvme", "below_tau"): 2,
        ("none", "orphan"): 1,  # a key without a tier
    }
    assert by(found, "kvstore_tier_evictions_total", "tier", "reason") == {
        ("hbm", "clean"): 3,
        ("dram", "emergency"): 11,
    }
    assert by(found, "kvstore_tier_recompute_decisions_total", "reason") == {
        "no_hit": 3,
        "faster": 2,
    }
    for name, single in (
        ("kvstore_tier_demotions_total", 7),
        ("kvstore_tier_promotions_total", 8),
        ("kvstore_tier_hysteresis_blocks_total", 12),
        ("kvstore_tier_thrash_total", 13),
        ("kvstore_tier_emergency_evictions_total", 14),
        ("kvstore_tier_nvme_written_pages_total", 15),
        ("kvstore_tier_nvme_written_bytes_total", 123_456),
        ("kvstore_tier_emergency", 1),
        ("kvstore_tier_compute_flops_per_second", 3e14),
    ):
        assert value(found, name) == single, name
    assert by(found, "kvstore_tier_load_failures_total", "reason") == {
        "nvme_read": 10,
        "no_slot": 4,
        "unknown": 2,  # what the manager counted without a reason
    }
    assert by(found, "kvstore_tier_bandwidth_bytes_per_second", "path") == {
        "d2h": 2.5e10,
        "nvme_read": 6e9,
    }
    assert by(found, "kvstore_tier_transfer_latency_seconds", "path") == {
        "d2h": 1e-5,
        "nvme_read": 1e-4,
    }
    assert by(found, "kvstore_tier_in_flight_bytes", "path") == {"d2h": 4096, "nvme_write": 0}
    [info] = found["kvstore_tier_policy_info"]
    assert info.labels == {
        "mover": "FakeMover",
        "placement": "value_density",
        "admission": "vd",
        "eviction": "lru",
    }


def test_the_nvme_gates_are_gauges_present_only_where_the_manager_has_them() -> None:
    found = samples(exposition(registry_for(fake_stats)))
    assert "kvstore_tier_nvme_write_gate" not in found
    assert "kvstore_tier_nvme_displacement_on" not in found
    rule = {"on": True, "moves": 3, "model_hits": [10.0, 40.0]}
    found = samples(
        exposition(
            registry_for(lambda: fake_stats(nvme_write_gate=(False, True), nvme_displacement=rule))
        )
    )
    assert by(found, "kvstore_tier_nvme_write_gate", "class") == {
        "seen_once": 0,
        "seen_again": 1,
    }
    assert value(found, "kvstore_tier_nvme_displacement_on") == 1
    off = dict(rule, on=False)
    found = samples(exposition(registry_for(lambda: fake_stats(nvme_displacement=off))))
    assert value(found, "kvstore_tier_nvme_displacement_on") == 0


def test_offload_latency_is_a_histogram_per_layer_pair_with_the_seed_buckets() -> None:
    found = samples(exposition(registry_for(fake_stats)))
    buckets = by(found, "kv_offload_latency_seconds_bucket", "src_layer", "dst_layer", "le")
    bounds = ["0.001", "0.005", "0.01", "0.05", "0.1", "0.5", "+Inf"]
    assert [buckets[("1", "2", le)] for le in bounds] == [1, 2, 3, 3, 4, 4, 5]
    assert [buckets[("2", "1", le)] for le in bounds] == [0, 0, 0, 1, 1, 2, 2]
    counts = by(found, "kv_offload_latency_seconds_count", "src_layer", "dst_layer")
    sums = by(found, "kv_offload_latency_seconds_sum", "src_layer", "dst_layer")
    assert counts == {("1", "2"): 5, ("2", "1"): 2}
    assert sums == {("1", "2"): 0.3, ("2", "1"): 0.25}


def test_a_histogram_with_bounds_and_counts_of_different_lengths_is_refused() -> None:
    broken = fake_stats(offload_latency_s={"1->2": (BOUNDS, (1, 2), 0.1, 2)})
    with pytest.raises(ValueError, match="6 bounds, 2 counts"):
        list(TierCollector(lambda: broken).collect())


def test_each_scrape_reads_fresh_stats_and_quiet_fields_export_zeros() -> None:
    snapshots = iter([fake_stats(), fake_stats(misses=9, emergency=False)])
    registry = registry_for(lambda: next(snapshots))
    assert value(samples(exposition(registry)), "kv_cache_miss_total") == 5
    second = samples(exposition(registry))
    assert value(second, "kv_cache_miss_total") == 9
    assert value(second, "kvstore_tier_emergency") == 0
    empty = fake_stats(
        admissions={},
        evictions={},
        offload_latency_s={},
        mover="",
        placement="",
        admission="",
        eviction="",
    )
    found = samples(exposition(registry_for(lambda: empty)))
    assert "kvstore_tier_admissions_total" not in found
    assert "kv_offload_latency_seconds_count" not in found
    assert "kvstore_tier_policy_info" not in found  # no policy names: no info sample


def test_beside_the_store_the_seed_families_are_the_managers_only(
    open_store: OpenStore,
) -> None:
    store = open_store()
    store.put("k", b"x" * 100)
    store.get("k")
    store.get("absent")
    alone = samples(exposition(store.metrics_registry()))
    assert by(alone, "kv_cache_hit_total", "layer") == {"2": 1}
    assert value(alone, "kv_cache_miss_total") == 1
    registry = registry_beside_store(
        StoreCollector(store.telemetry_snapshot), TierCollector(fake_stats)
    )
    text = exposition(registry)  # the linter refuses a family declared twice
    found = samples(text)
    assert by(found, "kv_cache_hit_total", "layer") == {"0": 70, "1": 20, "2": 5}
    assert value(found, "kv_cache_miss_total") == 5  # the manager's: in no tier
    assert value(found, "kv_page_table_size_bytes") == 3600
    assert set(by(found, "kv_offload_latency_seconds_count", "src_layer", "dst_layer")) == {
        ("1", "2"),
        ("2", "1"),
    }
    assert value(found, "kvstore_host_written_bytes_total") == 100  # the store's stay
    assert by(found, "kvstore_operation_latency_seconds_count", "op")["get"] == 2


# -- the statistics file -----------------------------------------------------------------------


def stats_data(**changes: Any) -> dict[str, Any]:
    """A statistics file as the manager writes it (TierManager._stats_snapshot)."""
    data: dict[str, Any] = {
        "version": STATS_VERSION,
        "saved_at_unix_s": 1_700_000_000.0,
        "reuse": [
            [0, False, "", 1.0, 9.0],
            [2, True, "tenant-a", 30.0, 2.0],
            [4, True, "tenant-b", 6.0, 0.0],
        ],
        "tau": {"tau": [1e-9, 2e-9, 4e-9], "gain": [0.0, 0.1, 0.2], "victim_vd": [0.0, 0.0, 0.0]},
        "bandwidth": {
            "d2h": {"bytes_per_s": 2.5e10, "latency_s": 1e-5, "samples": 12},
            "nvme_read": {"bytes_per_s": 6e9, "latency_s": 8e-5, "samples": 3},
        },
        "compute_flops": 3e14,
        "heat": [["00ff", 3.5, 1.0], ["0a0b", 1.0, 20.0]],
        "summary": {
            "pages_by_tier": [2, 8, 40],
            "used_bytes": [2 << 20, 8 << 20, 40 << 20],
            "capacity_bytes": [4 << 20, 16 << 20, 1 << 30],
            "hits_by_tier": [60, 30, 10],
            "misses": 20,
            "lookups": 50,
            "nvme_pages_written": 41,
            "nvme_bytes_written": 41 << 20,
            "counters": {
                "admission:dram:admitted": 9,
                "admission:orphan": 1,
                "evict:hbm:clean": 4,
                "evict:dram:emergency": 2,
                "demotions": 5,
                "promotions": 6,
                "hysteresis": 7,
                "thrash": 8,
                "recompute:no_hit": 20,
                "emergency_evictions": 2,
                "load_failures": 1,
                "restart:stats_loaded": 1,
            },
            "kappa": [12.0, 6.0, 2.0],
        },
    }
    data.update(changes)
    return data


def write_stats(directory: Path, data: object) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / STATS_FILE
    tmp = path.with_name(path.name + ".tmp")  # as the manager: replace, never a torn file
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
    return path


def test_the_file_reads_from_its_directory_or_its_own_path(tmp_path: Path) -> None:
    file = write_stats(tmp_path / "store", stats_data())
    assert read_stats_file(tmp_path / "store") == read_stats_file(file) == stats_data()


def test_a_missing_file_says_where_it_looked_and_who_writes_it(tmp_path: Path) -> None:
    with pytest.raises(TierStatsNotFoundError) as caught:
        read_stats_file(tmp_path)
    message = str(caught.value)
    assert f"no tier statistics at {tmp_path / STATS_FILE}" in message
    assert "every persist_stats_s and on close" in message


@pytest.mark.parametrize(
    ("content", "error", "phrase"),
    [
        ("{not json", TierStatsCorruptError, "is not valid JSON"),
        (b"\xff\xfe", TierStatsCorruptError, "is not valid JSON"),
        ("[1, 2]", TierStatsCorruptError, "not a JSON object"),
        (json.dumps(stats_data(version=2)), TierStatsVersionError, "version 2; this build"),
        (json.dumps(stats_data(version="1")), TierStatsVersionError, "version '1'"),
        (json.dumps({"version": 1}), TierStatsCorruptError, "field saved_at_unix_s is missing"),
        (
            json.dumps(stats_data(tau={"tau": [1.0, 2.0]})),
            TierStatsCorruptError,
            "tau.tau is not three numbers",
        ),
        (
            json.dumps(stats_data(reuse=[[0, "yes", "", 1, 2]])),
            TierStatsCorruptError,
            "is not [depth_bucket, reused",
        ),
        (
            json.dumps(stats_data(bandwidth={"d2h": {"bytes_per_s": 1.0}})),
            TierStatsCorruptError,
            "bandwidth.d2h.latency_s is missing",
        ),
        (
            json.dumps(stats_data(summary={**stats_data()["summary"], "misses": "5"})),
            TierStatsCorruptError,
            "summary.misses is not a number",
        ),
        (
            json.dumps(stats_data(summary={**stats_data()["summary"], "counters": {"x": True}})),
            TierStatsCorruptError,
            "summary.counters.x is not a number",
        ),
    ],
)
def test_a_damaged_file_is_refused_naming_the_file_and_the_field(
    tmp_path: Path, content: str | bytes, error: type[Exception], phrase: str
) -> None:
    file = tmp_path / STATS_FILE
    if isinstance(content, bytes):
        file.write_bytes(content)
    else:
        file.write_text(content)
    with pytest.raises(error) as caught:
        read_stats_file(tmp_path)
    assert str(file) in str(caught.value)
    assert phrase in str(caught.value)


def test_a_fifo_in_place_of_the_file_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / STATS_FILE)
    with pytest.raises(TierStatsCorruptError, match="is not a regular file"):
        read_stats_file(tmp_path)


def test_summary_says_what_is_where() -> None:
    summary = summarize(stats_data(), now_s=1_700_000_100.0, top=2)
    assert summary["saved_age_s"] == 100.0
    hbm, dram, nvme = (summary["tiers"][name] for name in ("hbm", "dram", "nvme"))
    assert (hbm["pages"], hbm["used_bytes"], hbm["capacity_bytes"]) == (2, 2 << 20, 4 << 20)
    assert hbm["used_ratio"] == 0.5
    assert hbm["hit_rate"] == 60 / 80  # hits / (hits + misses)
    assert dram["hit_rate"] == 30 / 50
    assert nvme["hit_rate"] == 10 / 30
    assert summary["hit_rate"] == 100 / 120
    assert [t["tau_s_per_byte"] for t in (hbm, dram, nvme)] == [1e-9, 2e-9, 4e-9]
    assert [t["kappa"] for t in (hbm, dram, nvme)] == [12.0, 6.0, 2.0]
    assert (summary["nvme_pages_written"], summary["nvme_bytes_written"]) == (41, 41 << 20)
    assert summary["bandwidth"]["nvme_read"] == {
        "bytes_per_s": 6e9,
        "latency_s": 8e-5,
        "samples": 3,
    }
    assert summary["compute_flops"] == 3e14
    assert (summary["heat_pages"], summary["reuse_classes"]) == (2, 3)
    # p = (reuses + 1) / (reuses + non_reuses + 4): 31/36 = 0.861 > 7/10 > 2/14
    assert [(row["tag"], row["p_reuse"]) for row in summary["top_reuse_classes"]] == [
        ("tenant-a", 31 / 36),
        ("tenant-b", 7 / 10),
    ]


def test_a_tier_without_capacity_or_traffic_has_no_ratio() -> None:
    quiet = stats_data()
    quiet["summary"] = {
        **quiet["summary"],
        "capacity_bytes": [0, 16 << 20, 0],
        "hits_by_tier": [0, 0, 0],
        "misses": 0,
    }
    summary = summarize(quiet, now_s=0.0)
    assert summary["tiers"]["hbm"]["used_ratio"] is None
    assert summary["tiers"]["hbm"]["hit_rate"] is None
    assert summary["hit_rate"] is None


def test_the_view_of_a_file_maps_counters_and_zeroes_what_it_does_not_keep() -> None:
    view = stats_view_from_file(stats_data())
    assert view.hits_by_tier == (60, 30, 10) and view.misses == 20 and view.lookups == 50
    assert view.pages_by_tier == (2, 8, 40)
    assert dict(view.admissions) == {"dram:admitted": 9, "orphan": 1}
    assert dict(view.evictions) == {"hbm:clean": 4, "dram:emergency": 2}
    assert dict(view.recompute_decisions) == {"no_hit": 20}
    assert (view.demotions, view.promotions, view.hysteresis_blocks, view.thrash) == (5, 6, 7, 8)
    assert (view.emergency_evictions, view.load_failures) == (2, 1)
    assert view.tau == (1e-9, 2e-9, 4e-9) and view.kappa == (12.0, 6.0, 2.0)
    assert dict(view.bandwidth_bytes_per_s) == {"d2h": 2.5e10, "nvme_read": 6e9}
    assert dict(view.latency_s) == {"d2h": 1e-5, "nvme_read": 8e-5}
    assert view.compute_flops == 3e14
    assert (view.nvme_pages_written, view.nvme_bytes_written) == (41, 41 << 20)
    assert view.pages == 0 and view.page_table_bytes == 0 and view.emergency is False
    assert not view.offload_latency_s and not view.in_flight_bytes and view.mover == ""


def test_the_file_collector_rereads_at_each_scrape_and_survives_a_bad_file(
    tmp_path: Path,
) -> None:
    registry = registry_for_file(tmp_path)
    found = samples(exposition(registry))
    assert value(found, "kvstore_tier_stats_readable") == 0  # no file yet: a scrape, no error
    assert "kv_cache_hit_total" not in found
    write_stats(tmp_path, stats_data())
    found = samples(exposition(registry))
    assert value(found, "kvstore_tier_stats_readable") == 1
    assert value(found, "kvstore_tier_stats_saved_timestamp_seconds") == 1_700_000_000.0
    assert by(found, "kv_cache_hit_total", "layer") == {"0": 60, "1": 30, "2": 10}
    assert value(found, "kv_cache_miss_total") == 20
    assert by(found, "kvstore_tier_evictions_total", "tier", "reason")[("dram", "emergency")] == 2
    newer = stats_data(saved_at_unix_s=1_700_000_030.0)
    newer["summary"] = {**newer["summary"], "misses": 25}
    write_stats(tmp_path, newer)
    found = samples(exposition(registry))
    assert value(found, "kv_cache_miss_total") == 25
    assert value(found, "kvstore_tier_stats_saved_timestamp_seconds") == 1_700_000_030.0
    (tmp_path / STATS_FILE).write_text("{torn")
    found = samples(exposition(registry))
    assert value(found, "kvstore_tier_stats_readable") == 0
    assert "kv_cache_hit_total" not in found
    assert StatsFileCollector(tmp_path / STATS_FILE).file == tmp_path / STATS_FILE


def test_the_readers_names_are_the_managers_and_they_read_what_it_writes() -> None:
    """The manager imports torch-side modules; the reader may not, so both name the file."""
    manager = pytest.importorskip("kvstore.tiering.manager")
    from kvstore.tiering.config import TierConfig
    from kvstore.tiering.statsfile import check_stats

    assert (manager.STATS_FILE, manager.STATS_VERSION) == (STATS_FILE, STATS_VERSION)
    tiers = manager.TierManager.open(
        TierConfig(mover="fake", control_interval_s=0, probe_at_open=False)
    )
    try:
        snapshot: Callable[[], dict[str, Any]] = tiers._stats_snapshot
        data = json.loads(json.dumps(snapshot()))
    finally:
        tiers.close()
    check_stats(data, "the manager's snapshot")
    assert summarize(data, now_s=time.time())["tiers"]["dram"]["pages"] == 0


def test_an_unbounded_tier_exports_no_capacity_sample(tmp_path: Path) -> None:
    """Not 4.6e18 (the manager's stand-in for no bound): a ratio to it is no series."""
    found = samples(exposition(registry_for(lambda: fake_stats(capacity_bytes=(10, 20, 1 << 62)))))
    assert by(found, "kvstore_tier_capacity_bytes", "tier") == {"hbm": 10, "dram": 20}
    assert by(found, "kvstore_tier_used_bytes", "tier")["nvme"] == 300
    data = stats_data()
    data["summary"] = {**data["summary"], "capacity_bytes": [4 << 20, 16 << 20, 1 << 62]}
    write_stats(tmp_path, data)
    found = samples(exposition(registry_for_file(tmp_path)))
    assert by(found, "kvstore_tier_capacity_bytes", "tier") == {"hbm": 4 << 20, "dram": 16 << 20}


def test_load_failures_carry_a_reason_live_and_from_the_file(tmp_path: Path) -> None:
    quiet = samples(
        exposition(registry_for(lambda: fake_stats(load_failures=0, load_failure_reasons={})))
    )
    assert by(quiet, "kvstore_tier_load_failures_total", "reason") == {"unknown": 0}
    write_stats(tmp_path, stats_data())  # load_failures 1, no reasons: an older manager
    found = samples(exposition(registry_for_file(tmp_path)))
    assert by(found, "kvstore_tier_load_failures_total", "reason") == {"unknown": 1}
    data = stats_data()
    counters = {**data["summary"]["counters"], "load_failures": 5}
    counters.update({"load_failure:nvme_read": 3, "load_failure:copy": 2})
    data["summary"] = {**data["summary"], "counters": counters}
    write_stats(tmp_path, data)
    found = samples(exposition(registry_for_file(tmp_path)))
    assert by(found, "kvstore_tier_load_failures_total", "reason") == {"nvme_read": 3, "copy": 2}

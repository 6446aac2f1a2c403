"""Prometheus exposition: parsed with prometheus_client.parser and linted the way
``promtool check metrics`` does; names and values follow the counters."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.telemetry.prometheus import lint_exposition
from tests.conftest import OpenStore

REPO_ROOT = Path(__file__).resolve().parents[3]


def families(text: str) -> dict[str, object]:
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_live_registry_parses_lints_clean_and_matches_the_counters(
    open_store: OpenStore,
) -> None:
    store = open_store(max_dwpd=5.0, drive_capacity_bytes=1 << 40)
    store.put_many([(f"k{index}", b"x" * 5000) for index in range(7)])
    store.get("k1")
    store.get("k2")
    store.get("absent")
    store.flush()
    text = generate_latest(store.metrics_registry()).decode()
    assert lint_exposition(text) == []
    parsed = {family.name: family for family in text_string_to_metric_families(text)}
    hit = parsed["kv_cache_hit"]
    assert hit.type == "counter"
    by_layer = {s.labels["layer"]: s.value for s in hit.samples if s.name == "kv_cache_hit_total"}
    assert by_layer == {"2": 2.0}  # a miss is no layer: kv_cache_miss_total
    miss = parsed["kv_cache_miss"]
    assert miss.type == "counter"
    assert [s.value for s in miss.samples if s.name == "kv_cache_miss_total"] == [1.0]
    offload = parsed["kv_offload_latency_seconds"]
    assert offload.type == "histogram"
    counts = {
        (s.labels["src_layer"], s.labels["dst_layer"]): s.value
        for s in offload.samples
        if s.name.endswith("_count")
    }
    assert counts == {("1", "2"): 7.0, ("2", "1"): 3.0}
    buckets = [s for s in offload.samples if s.name.endswith("_bucket")]
    assert {"0.001", "0.005", "0.01", "0.05", "0.1", "0.5"} <= {s.labels["le"] for s in buckets}
    snapshot = store.telemetry_snapshot()
    written = {
        s.labels["kind"]: s.value
        for s in parsed["kvstore_written_bytes"].samples
        if s.name == "kvstore_written_bytes_total"
    }
    assert written["host"] == 35_000 == snapshot.counter("host_bytes")
    assert written["wal"] == snapshot.counter("wal_bytes")
    dwpd = {s.labels["window"] for s in parsed["kvstore_dwpd"].samples}
    assert dwpd == {"1h", "24h", "7d"}
    assert parsed["kvstore_dwpd_budget"].samples[0].value == 5.0
    assert "kv_page_table_size_bytes" in parsed


def test_the_linter_catches_what_promtool_would() -> None:
    bad = """# HELP foo_total a gauge named like a counter
# TYPE foo_total gauge
foo_total 1
# HELP requestCount camel case counter
# TYPE requestCount counter
requestCount_total 2
# HELP latency_milliseconds not base units
# TYPE latency_milliseconds histogram
latency_milliseconds_bucket{le="+Inf"} 1
latency_milliseconds_count 1
latency_milliseconds_sum 3
# HELP disk_used_percent percent
# TYPE disk_used_percent gauge
disk_used_percent{Device="a"} 3
# HELP queue_gauge type in name
# TYPE queue_gauge gauge
queue_gauge 1
"""
    problems = "\n".join(lint_exposition(bad))
    assert "foo_total: only counters end in _total" in problems
    assert "requestCount_total: not snake_case" in problems
    assert "use base units (seconds, bytes, ratio), not milliseconds" in problems
    assert "not percent" in problems
    assert "label 'Device' is not snake_case" in problems
    assert "queue_gauge: metric type in the name" in problems


def test_exporter_serves_the_persisted_counters(open_store: OpenStore, store_path: Path) -> None:
    store = open_store()
    store.put_many([(f"k{index}", b"y" * 3000) for index in range(4)])
    store.close()
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvstore.cli",
            "metrics",
            str(store_path),
            "--port",
            "0",
            "--addr",
            "127.0.0.1",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", line)
        assert match, line
        url = f"http://127.0.0.1:{match.group(1)}/metrics"
        deadline = time.monotonic() + 30
        while True:
            try:
                text = urllib.request.urlopen(url, timeout=10).read().decode()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        assert lint_exposition(text) == []
        parsed = families(text)
        host = parsed["kvstore_host_written_bytes"]
        assert host.samples[0].value == 12_000  # type: ignore[attr-defined]
        assert "kvstore_telemetry_saved_timestamp_seconds" in parsed
    finally:
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=30) == 0


def test_alert_rules_use_only_metrics_the_store_exports(open_store: OpenStore) -> None:
    from kvstore.telemetry.prometheus import registry_for
    from kvstore.telemetry.smart import SmartReport

    store = open_store(max_dwpd=5.0, drive_capacity_bytes=1 << 40)
    store.put("k", b"x" * 100)
    store.flush()
    store.close()
    from kvstore.telemetry import read_snapshot

    path = store.root
    registry = registry_for(
        lambda: read_snapshot(path),
        lambda: SmartReport(True, "nvme-cli", data_written_bytes=10, percentage_used=3),
    )
    from kvstore.tiering.metrics import registry_for as tier_registry_for
    from tests.unit.tiering.test_tiering_metrics import fake_stats

    exported = set()
    remote = {  # a remote tier's summary (docs/tiering.md, "The remote tier")
        "state": "degraded",
        "hits": 1,
        "published": 2,
        "miss_reasons": {"absent": 3},
        "bandwidth": {"read": {"bytes_per_s": 1e9}},
        "kappa": 2.0,
        "in_use": True,
    }
    tier_registries = (
        tier_registry_for(fake_stats),
        tier_registry_for(lambda: fake_stats(remote=remote)),
    )
    for each in (registry, *tier_registries):  # the tier manager's: kvstore-tier
        for family in text_string_to_metric_families(generate_latest(each).decode()):
            exported.update(sample.name for sample in family.samples)
    rules = (REPO_ROOT / "docs" / "alerts" / "kvstore.rules.yml").read_text()
    expressions = re.findall(r"expr: (?:\|\n)?((?:.*\n)+?)\s+(?:for|labels):", rules)
    assert (
        len(expressions) == 15
    )  # the store's, the tier manager's, the remote tier's degraded alert
    used = set()
    for expression in expressions:
        for name in re.findall(r"\b(kv[a-z0-9_]*)\b", expression):
            used.add(name)
    assert used and used <= exported, used - exported
    assert "expr: kvstore_degraded > 0" in rules
    for alert in (
        "DwpdOver80PercentOfRating",
        "EvictionStorm",
        "HitRateLow",
        "HitRateCritical",
        "KVStoreDegraded",
    ):
        assert alert in rules
    assert "* 60 > 1000" in rules and "< 0.6" in rules and "< 0.4" in rules
    tier_rules = rules[rules.index("- name: kvstore-tier") :]
    assert "rate(kvstore_tier_evictions_total[5m])) * 60 > 1000" in tier_rules
    for floor in ("0.6", "0.4"):  # L0 over every layer and the misses, 5 m windows
        assert (
            'sum by (instance, job) (rate(kv_cache_hit_total{layer="0"}[5m]))\n'
            "            / (sum by (instance, job) (rate(kv_cache_hit_total[5m]))\n"
            "              + sum by (instance, job) (rate(kv_cache_miss_total[5m])))"
            f" < {floor}\n"
            "        for: 15m"
        ) in tier_rules
    # The NVMe layer's floor divides by the lookups that reached NVMe (its hits and the
    # misses): beside the tier manager, layer 0 and 1 hits are no NVMe misses.
    assert rules.count("+ sum by (instance, job) (rate(kv_cache_miss_total[10m]))) < 0.") == 2
    assert "miss" not in re.sub(r"kv_cache_miss_total|misses", "", "".join(expressions))


def test_the_cli_exporter_has_the_writers_fill_levels_and_its_degraded_open(
    store_path: Path,
) -> None:
    """`kvstore metrics PATH` beside a degraded writer: kvstore_degraded and the fill
    levels (pages, live, free and capacity bytes) as the writer last saved them."""
    from kvstore import KVStore
    from tests.unit.telemetry.test_promtool import scrape_cli_exporter
    from tests.unit.test_degraded_open import OPTIONS, build, flip, segment_files

    build(store_path)
    flip(segment_files(store_path)[1], 20)  # a damaged segment header: quarantined
    with KVStore.open(store_path, capacity_bytes=64 << 20, **OPTIONS) as store:
        stats = store.stats()
        assert stats.degraded and stats.free_bytes is not None
        store.checkpoint()  # the counters and gauges are saved
        text = scrape_cli_exporter(store_path, "--no-tier")
        assert lint_exposition(text) == []
        found = {
            sample.name: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }
        assert found["kvstore_degraded"] == 1
        assert found["kvstore_quarantined_segments"] == 1
        assert found["kvstore_pages"] == stats.pages > 0
        assert found["kvstore_live_bytes"] == stats.live_bytes > 0
        assert found["kvstore_capacity_bytes"] == 64 << 20
        assert found["kvstore_free_bytes"] == stats.free_bytes > 0
        live = {
            sample.name: sample.value
            for family in text_string_to_metric_families(
                generate_latest(store.metrics_registry()).decode()
            )
            for sample in family.samples
        }
        assert live["kvstore_free_bytes"] == stats.free_bytes

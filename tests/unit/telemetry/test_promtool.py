"""Prometheus's own checker on what we ship: ``promtool check rules`` on the alert rules
and ``promtool check metrics`` on every exposition (the store's registry, ``kvstore
metrics`` alone and beside the tier manager's statistics, the tier manager's registry).

promtool comes from Debian's ``prometheus`` package; ``make unit`` / ``make test``
install it where missing (the Makefile's ``promtool`` target). These tests skip only
where it cannot be installed that way (no apt-get), and say so.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from tests.conftest import OpenStore
from tests.unit.tiering.test_tier_cli import scrape, serve, stop

REPO_ROOT = Path(__file__).resolve().parents[3]
RULES = REPO_ROOT / "docs" / "alerts" / "kvstore.rules.yml"


def promtool() -> str:
    found = shutil.which("promtool")
    if found is not None:
        return found
    if shutil.which("apt-get") is None:
        pytest.skip("promtool is not installed and there is no apt-get to install it with")
    pytest.fail("promtool is missing: `make promtool` installs it (Debian's prometheus package)")


def check_metrics(text: str) -> None:
    """``promtool check metrics`` on ``text``: exit 0 and not one complaint."""
    done = subprocess.run(
        [promtool(), "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), (
        done.stdout + done.stderr
    )


def scrape_cli_exporter(path: Path, *options: str) -> str:
    """One scrape of ``kvstore metrics PATH --port 0`` (then SIGTERM, exit 0)."""
    child, line = serve(path, *options)
    try:
        match = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", line)
        assert match, line
        return scrape(f"http://127.0.0.1:{match.group(1)}/metrics")
    finally:
        stop(child)


def test_promtool_accepts_the_alert_rules() -> None:
    done = subprocess.run(
        [promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr


def test_promtool_accepts_the_live_store_registry(open_store: OpenStore) -> None:
    store = open_store(max_dwpd=5.0, drive_capacity_bytes=1 << 40)
    store.put_many([(f"k{index}", b"x" * 5000) for index in range(5)])
    store.get("k1")
    store.get("absent")
    store.flush()
    check_metrics(generate_latest(store.metrics_registry()).decode())


def test_promtool_accepts_the_cli_exporter_alone_and_beside_the_tier_statistics(
    open_store: OpenStore, store_path: Path
) -> None:
    from tests.unit.tiering.test_tiering_metrics import stats_data, write_stats

    store = open_store(capacity_bytes=8 << 20)
    store.put_many([(f"k{index}", b"y" * 3000) for index in range(4)])
    store.get("k0")
    store.get("absent")
    store.close()
    alone = scrape_cli_exporter(store_path, "--no-tier")
    assert "kvstore_host_written_bytes_total" in alone
    check_metrics(alone)
    write_stats(store_path, stats_data())
    beside = scrape_cli_exporter(store_path, "--tier")
    assert "kvstore_tier_lookups_total" in beside and "kvstore_host_written_bytes_total" in beside
    check_metrics(beside)


def test_promtool_accepts_the_tier_managers_registries(tmp_path: Path) -> None:
    from kvstore.tiering.metrics import registry_for, registry_for_file
    from tests.unit.tiering.test_tiering_metrics import fake_stats, stats_data, write_stats

    check_metrics(generate_latest(registry_for(fake_stats)).decode())
    write_stats(tmp_path, stats_data())
    check_metrics(generate_latest(registry_for_file(tmp_path)).decode())
    manager = pytest.importorskip("kvstore.tiering.manager")
    from kvstore.tiering.config import TierConfig

    tiers = manager.TierManager.open(
        TierConfig(mover="fake", control_interval_s=0, probe_at_open=False)
    )
    try:
        check_metrics(generate_latest(tiers.metrics_registry()).decode())
    finally:
        tiers.close()


def test_the_alert_rules_fire_on_the_series_the_exporters_export() -> None:
    """kvstore.rules.test.yml: the hit-rate floors count kv_cache_miss_total, the DWPD
    alerts compare with the rating, kvstore_degraded fires KVStoreDegraded."""
    tests = Path(__file__).with_name("kvstore.rules.test.yml")
    done = subprocess.run(
        [promtool(), "test", "rules", str(tests)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr

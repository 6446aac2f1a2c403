"""``kvstore tier stat|metrics`` on a hand-written statistics file, and ``kvstore
metrics`` serving the tier manager's metrics beside the store's.

Exit codes as every command's (tests/unit/test_cli_exit_codes.py): 0 ok, 4 a damaged
file, 8 no file or a newer version; with ``--json`` a failure prints
``{"error": {"type", "message"}, "exit_code"}``.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from prometheus_client.parser import text_string_to_metric_families

from kvstore.cli import main
from kvstore.telemetry.prometheus import lint_exposition
from kvstore.tiering.statsfile import STATS_FILE
from tests.conftest import OpenStore
from tests.unit.tiering.test_tiering_metrics import stats_data, write_stats

REPO_ROOT = Path(__file__).resolve().parents[3]


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), env={"COLUMNS": "160"})


def hits_by_layer(text: str) -> dict[str, float]:
    """kv_cache_hit_total by layer, and kv_cache_miss_total as "miss" (a counter of its
    own: no hit carries layer="miss")."""
    found = {family.name: family for family in text_string_to_metric_families(text)}
    hits = {s.labels["layer"]: s.value for s in found["kv_cache_hit"].samples}
    assert "miss" not in hits
    [miss] = found["kv_cache_miss"].samples
    return {**hits, "miss": miss.value}


@pytest.fixture
def stats_dir(tmp_path: Path) -> Path:
    write_stats(tmp_path / "nvme", stats_data(saved_at_unix_s=time.time() - 30))
    return tmp_path / "nvme"


def test_tier_stat_json(stats_dir: Path) -> None:
    result = run("tier", "stat", str(stats_dir), "--json", "--top", "1")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["path"] == str(stats_dir / STATS_FILE)
    assert out["tiers"]["hbm"]["hit_rate"] == 60 / 80
    assert out["tiers"]["nvme"]["used_bytes"] == 40 << 20
    assert out["misses"] == 20 and out["lookups"] == 50
    assert 29 <= out["saved_age_s"] < 120
    assert [row["tag"] for row in out["top_reuse_classes"]] == ["tenant-a"]
    assert out["counters"]["restart:stats_loaded"] == 1


def test_tier_stat_json_is_strict_json_with_an_infinite_kappa(tmp_path: Path) -> None:
    data = stats_data()
    data["summary"]["kappa"] = [float("inf"), 6.0, 2.0]  # a free transfer: json writes Infinity
    write_stats(tmp_path, data)
    assert "Infinity" in (tmp_path / STATS_FILE).read_text()
    result = run("tier", "stat", str(tmp_path / STATS_FILE), "--json")
    assert result.exit_code == 0, result.output

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in --json output")

    out = json.loads(result.stdout, parse_constant=refuse)
    assert out["tiers"]["hbm"]["kappa"] is None and out["tiers"]["dram"]["kappa"] == 6.0


def test_tier_stat_table(stats_dir: Path) -> None:
    result = run("tier", "stat", str(stats_dir / STATS_FILE))
    assert result.exit_code == 0, result.output
    text = result.stdout
    rows = {line.split("│")[1].strip(): line for line in text.splitlines() if "│" in line}
    assert "75.0%" in rows["hbm"] and "2.0 MiB" in rows["hbm"] and "4.0 MiB" in rows["hbm"]
    assert "33.3%" in rows["nvme"] and "1.000e-09" in rows["hbm"] and "12.00" in rows["hbm"]
    assert "83.3%" in rows["hit rate (all tiers)"]
    assert "s ago" in rows["saved"]
    assert "25.00" in rows["d2h"] and "10.0" in rows["d2h"]  # GB/s, latency in us
    assert "0.861" in text and "tenant-a" in text  # the likeliest reuse class


def test_tier_stat_shows_the_nvme_write_gate(tmp_path: Path) -> None:
    data = stats_data()
    data["payoff"] = {"open": [0, 1], "paid": [1.0, 30.0], "unpaid": [99.0, 10.0]}
    write_stats(tmp_path, data)
    result = run("tier", "stat", str(tmp_path), "--json")
    assert result.exit_code == 0, result.output
    gate = json.loads(result.stdout)["nvme_write_gate"]
    assert gate["seen_once"] == {"open": False, "read_back_share": 0.01}
    assert gate["seen_again"] == {"open": True, "read_back_share": 0.75}
    text = run("tier", "stat", str(tmp_path)).stdout
    rows = {line.split("│")[1].strip(): line for line in text.splitlines() if "│" in line}
    assert "not written (1.0% of writes read back)" in rows["NVMe: pages seen once"]
    assert "written (75.0% of writes read back)" in rows["NVMe: pages seen again"]
    # A file saved without the gate (before it existed) has no such rows.
    write_stats(tmp_path, stats_data())
    assert (
        json.loads(run("tier", "stat", str(tmp_path), "--json").stdout)["nvme_write_gate"] is None
    )


def test_tier_stat_shows_the_displacement_rule_and_a_damaged_one_as_absent(
    tmp_path: Path,
) -> None:
    data = stats_data()
    data["summary"]["nvme_displacement"] = {"on": True, "moves": 3, "model_hits": [89.0, 917.0]}
    write_stats(tmp_path, data)
    result = run("tier", "stat", str(tmp_path), "--json")
    assert result.exit_code == 0, result.output
    rule = json.loads(result.stdout)["nvme_displacement"]
    assert rule == {"on": True, "moves": 3, "model_hits": [89.0, 917.0]}
    text = run("tier", "stat", str(tmp_path)).stdout
    rows = {line.split("│")[1].strip(): line for line in text.splitlines() if "│" in line}
    # Short enough for an 80-column terminal (a longer value wrapped in CI).
    assert "on: 917 model hits vs 89" in rows["NVMe displacement rule"]
    # The exporter reading the file shows it too.
    metrics = run("tier", "metrics", str(tmp_path))
    assert metrics.exit_code == 0, metrics.output
    assert "kvstore_tier_nvme_displacement_on 1.0" in metrics.stdout
    # Shown, never applied: a damaged one reads as absent, the file is not refused.
    data["summary"]["nvme_displacement"] = {"on": True, "moves": 3, "model_hits": [-1, "x"]}
    write_stats(tmp_path, data)
    result = run("tier", "stat", str(tmp_path), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["nvme_displacement"] is None
    assert "NVMe displacement rule" not in run("tier", "stat", str(tmp_path)).stdout


def test_a_manager_saves_its_displacement_rule_for_tier_stat(tmp_path: Path) -> None:
    from kvstore.tiering import TierManager
    from tests.unit.tiering.test_tiering_manager import SLOT
    from tests.unit.tiering.test_tiering_manager import config as manager_config

    cfg = manager_config(
        tmp_path, dram_bytes=4 * SLOT, nvme_bytes=8 * SLOT, admission="value_density"
    )
    with TierManager.open(cfg) as tm:
        assert tm.stats().nvme_displacement is not None
    result = run("tier", "stat", str(tmp_path / "nvme"), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["nvme_displacement"] == {
        "on": False,
        "moves": 0,
        "model_hits": [0.0, 0.0],
    }


def test_tier_commands_on_a_missing_file_exit_8(tmp_path: Path) -> None:
    tmp_path = tmp_path / ("a-directory-name-long-enough-that-a-wrapped-line-would-break-it" * 2)
    tmp_path.mkdir()
    for args in (["stat"], ["stat", "--json"], ["metrics"]):
        result = run("tier", args[0], str(tmp_path), *args[1:])
        assert result.exit_code == 8, result.output
        assert "no tier statistics at" in result.stderr
        assert str(tmp_path / STATS_FILE) in result.stderr
        assert "Traceback" not in result.output
    out = json.loads(run("tier", "stat", str(tmp_path / "absent.json"), "--json").stdout)
    assert out["exit_code"] == 8
    assert out["error"]["type"] == "TierStatsNotFoundError"
    assert "absent.json" in out["error"]["message"]


def test_tier_commands_on_a_bad_file(tmp_path: Path) -> None:
    file = tmp_path / STATS_FILE
    file.write_text('{"version": 1, "saved_at')  # torn: the manager replaces atomically
    for command in ("stat", "metrics"):
        result = run("tier", command, str(tmp_path))
        assert result.exit_code == 4, result.output
        assert f"{file} is not valid JSON" in result.stderr
        assert "move the file aside" in result.stderr
    out = json.loads(run("tier", "stat", str(tmp_path), "--json").stdout)
    assert (out["exit_code"], out["error"]["type"]) == (4, "TierStatsCorruptError")
    write_stats(tmp_path, stats_data(version=7))
    result = run("tier", "stat", str(tmp_path), "--json")
    assert result.exit_code == 8
    assert json.loads(result.stdout)["error"]["type"] == "TierStatsVersionError"


def test_tier_metrics_prints_the_persisted_exposition(stats_dir: Path) -> None:
    result = run("tier", "metrics", str(stats_dir))
    assert result.exit_code == 0, result.output
    assert lint_exposition(result.stdout) == []
    assert hits_by_layer(result.stdout) == {"0": 60, "1": 30, "2": 10, "miss": 20}
    assert 'kvstore_tier_evictions_total{reason="clean",tier="hbm"} 4.0' in result.stdout
    assert "kvstore_tier_stats_readable 1.0" in result.stdout


def test_metrics_with_tier_requires_the_file(open_store: OpenStore, store_path: Path) -> None:
    open_store().close()
    result = run("metrics", str(store_path), "--port", "0", "--tier")
    assert result.exit_code == 8  # before serving anything
    assert "no tier statistics at" in result.stderr


def scrape(url: str) -> str:
    deadline = time.monotonic() + 30
    while True:
        try:
            text: str = urllib.request.urlopen(url, timeout=10).read().decode()
            return text
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def serve(store_path: Path, *args: str) -> tuple[subprocess.Popen[str], str]:
    command = ["metrics", str(store_path), "--port", "0", "--addr", "127.0.0.1", *args]
    child = subprocess.Popen(
        [sys.executable, "-m", "kvstore.cli", *command],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )
    assert child.stdout is not None
    line = child.stdout.readline()
    match = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", line)
    if not match:
        child.kill()
        raise AssertionError(line)
    return child, line


def stop(child: subprocess.Popen[str]) -> None:
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=30) == 0


def test_the_exporter_serves_tier_metrics_beside_the_stores(
    open_store: OpenStore, store_path: Path
) -> None:
    store = open_store()
    store.put_many([(f"k{index}", b"y" * 3000) for index in range(4)])
    store.close()
    write_stats(store_path, stats_data())
    child, line = serve(store_path)
    try:
        assert f"with the tier statistics of {store_path / STATS_FILE}" in line
        url = re.findall(r"http://\S+/metrics", line)[0]
        text = scrape(url)
        assert lint_exposition(text) == []  # kv_cache_hit declared once
        assert hits_by_layer(text) == {"0": 60, "1": 30, "2": 10, "miss": 20}
        assert "kvstore_host_written_bytes_total 12000.0" in text  # the store's stay
        newer: dict[str, Any] = stats_data()
        newer["summary"]["hits_by_tier"] = [61, 30, 10]
        write_stats(store_path, newer)
        assert hits_by_layer(scrape(url))["0"] == 61  # re-read at each scrape
    finally:
        stop(child)
    child, line = serve(store_path, "--no-tier")
    try:
        text = scrape(re.findall(r"http://\S+/metrics", line)[0])
        assert hits_by_layer(text) == {"2": 0, "miss": 0}  # the store's own
        assert "kvstore_tier_" not in text
    finally:
        stop(child)


def test_a_tier_out_of_use_says_so_in_stat_and_metrics(tmp_path: Path) -> None:
    data = stats_data()
    data["summary"]["kappa"] = [12.0, 6.0, 0.25]  # NVMe measured slower than recompute
    write_stats(tmp_path, data)
    table = run("tier", "stat", str(tmp_path))
    assert table.exit_code == 0, table.output
    assert "nvme is not in use" in table.stdout and "kappa 0.25 < 1" in table.stdout
    assert "dram is not in use" not in table.stdout
    out = json.loads(run("tier", "stat", str(tmp_path), "--json").stdout)
    assert [out["tiers"][t]["in_use"] for t in ("hbm", "dram", "nvme")] == [True, True, False]
    metrics = run("tier", "metrics", str(tmp_path)).stdout
    assert lint_exposition(metrics) == []
    assert 'kvstore_tier_in_use{tier="nvme"} 0.0' in metrics
    assert 'kvstore_tier_in_use{tier="dram"} 1.0' in metrics

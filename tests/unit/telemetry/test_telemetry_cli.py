"""``kvstore stat``, ``wear`` and ``report`` on a store with days of simulated history."""

from __future__ import annotations

import base64
import io
import json
import math
import re
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvstore.cli import main
from tests.conftest import OpenStore

HOUR = 3600.0
DAYS = 4
# The history ends now: the CLI reads it with the real clock.
T0 = (time.time() // HOUR - DAYS * 24) * HOUR


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def build_history(open_store: OpenStore, days: int = DAYS) -> tuple[int, int]:
    """A store written for ``days`` simulated days with a daily cycle; (host, puts)."""
    clock = FakeClock(T0)
    store = open_store(
        telemetry_clock=clock,
        drive_capacity_bytes=256 << 20,
        rated_dwpd=3.0,
        max_dwpd=2.0,
        max_dwpd_burst_s=3600.0,
        gc_interval_s=0,
    )
    host = puts = 0
    for hour in range(days * 24):
        clock.now = T0 + hour * HOUR + 1
        store.telemetry_snapshot()  # the telemetry thread samples every second in real life
        busy = 4 + int(12 * (1 + math.sin(hour / 24 * 2 * math.pi)))
        items = [(f"h{hour}/p{index}", bytes([hour % 251]) * 20_000) for index in range(busy)]
        results = store.put_many(items)
        host += sum(20_000 for ok in results if ok)
        puts += sum(results)
        store.get_many([key for key, _ in items[: busy // 2]] + ["absent"])
        for index in range(0, busy, 3):
            store.delete(f"h{hour}/p{index}")
        if hour % 6 == 5:
            store.flush()
            store.gc()
    clock.now = T0 + days * 24 * HOUR - 60
    store.close()
    return host, puts


@pytest.fixture
def history(open_store: OpenStore, store_path: Path) -> tuple[Path, int, int]:
    host, puts = build_history(open_store)
    return store_path, host, puts


def test_stat_json_has_the_wear_keys(history: tuple[Path, int, int]) -> None:
    path, host, puts = history
    result = CliRunner().invoke(main, ["stat", str(path), "--json"])
    assert result.exit_code == 0, result.output
    stats = json.loads(result.output)
    assert stats["host_bytes"] == host
    assert stats["telemetry"]["puts"] == puts
    assert set(stats["dwpd"]) == {"1h", "24h", "7d"}
    assert stats["write_amplification"] == stats["store_bytes"] / host > 1
    assert stats["store_bytes"] == sum(stats["store_bytes_by_kind"].values())
    table = CliRunner().invoke(main, ["stat", str(path)])
    assert table.exit_code == 0 and "write_amplification" in table.output


def test_wear_json_and_smart_unavailable_plainly(history: tuple[Path, int, int]) -> None:
    path, host, _ = history
    result = CliRunner().invoke(main, ["wear", str(path), "--json", "--rated-dwpd", "3"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["host_bytes"] == host
    assert report["rated_dwpd"] == 3.0 and report["rated_dwpd_source"] == "config"
    assert report["max_dwpd"] == 2.0
    assert report["drive_capacity_bytes"] == 256 << 20
    assert report["capacity_source"] == "config"
    assert report["projected_life_days"] is not None
    smart = report["smart"]
    if not smart["available"]:  # this machine: a virtio disk, no nvme-cli, no smartctl
        assert smart["reason"].startswith("SMART unavailable")
        assert smart["data_written_bytes"] is None and smart["percentage_used"] is None
    human = CliRunner().invoke(main, ["wear", str(path)])
    assert human.exit_code == 0 and "dwpd" in human.output


def test_report_renders_a_self_contained_page(
    history: tuple[Path, int, int], tmp_path: Path
) -> None:
    import matplotlib.image

    path, _, _ = history
    page_path = tmp_path / "report.html"
    png_dir = tmp_path / "png"
    result = CliRunner().invoke(
        main, ["report", str(path), "--html", str(page_path), "--png-dir", str(png_dir)]
    )
    assert result.exit_code == 0, result.output
    page = page_path.read_text()
    # No external resources. (Inline PNGs are dropped first: base64 can spell "http".)
    text = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", page)
    assert "<html" in page and "http" not in text.split("<body>")[1].split("docs/")[0]
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == 4
    for encoded in images:
        png = base64.b64decode(encoded)
        assert png.startswith(b"\x89PNG\r\n\x1a\n")
        pixels = matplotlib.image.imread(io.BytesIO(png), format="png")
        assert pixels.shape[0] > 200 and pixels.shape[1] > 600
        assert pixels.std() > 0.01  # not a blank canvas
    assert sorted(p.name for p in png_dir.iterdir()) == [f"plot{i}.png" for i in range(1, 5)]
    assert "write amplification" in page and "DWPD 24h" in page

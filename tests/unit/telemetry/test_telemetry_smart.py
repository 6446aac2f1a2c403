"""SMART parsing against recorded outputs of real drives (tests/unit/fixtures/smart/),
and the plain "unavailable because ..." on a machine without SMART."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.telemetry import smart as smart_module
from kvstore.telemetry.smart import (
    NVME_DATA_UNIT_BYTES,
    parse_nvme_smart_log,
    parse_smartctl,
    read_smart,
)
from kvstore.telemetry.wear import detect_drive

FIXTURES = Path(__file__).parents[1] / "fixtures" / "smart"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_nvme_cli_1x_numbers() -> None:
    report = parse_nvme_smart_log(fixture("nvme_cli_1x_smart_log.json"), "/dev/nvme0")
    assert report.available and report.source == "nvme-cli"
    assert report.data_written_bytes == 1474968593 * NVME_DATA_UNIT_BYTES
    assert (report.percentage_used, report.power_on_hours) == (15, 38313)
    assert (report.media_errors, report.available_spare_percent) == (0, 100)


def test_nvme_cli_2x_strings_with_thousands_separators() -> None:
    report = parse_nvme_smart_log(fixture("nvme_cli_2x_smart_log_wd_sn850x.json"))
    assert report.available
    assert report.data_written_bytes == 6_226_522 * 512_000
    assert (report.percentage_used, report.power_on_hours, report.media_errors) == (0, 20, 0)


def test_smartctl_nvme() -> None:
    report = parse_smartctl(fixture("smartctl_nvme_samsung_mzvl21t0hclr.json"))
    assert report.available and report.source == "smartctl"
    assert report.device == "/dev/nvme0"
    assert report.model == "SAMSUNG MZVL21T0HCLR-00B00"
    assert report.data_written_bytes == 113662783 * 512_000  # 58.2 TB on a 1 TB drive
    assert (report.percentage_used, report.power_on_hours) == (16, 10423)
    assert report.capacity_bytes == 1024209543168


def test_smartctl_sata_ssd_attributes() -> None:
    report = parse_smartctl(fixture("smartctl_sata_samsung_mz7wd240.json"))
    assert report.available
    assert report.data_written_bytes == 216456537880 * 512  # Total_LBAs_Written x 512
    assert report.percentage_used == 9  # 100 - Wear_Leveling_Count normalised value 91
    assert report.capacity_bytes == 240057409536
    assert any("241" in note for note in report.notes)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("not json", "no JSON"),
        ('{"critical_warning": 0}', "no data_units_written"),
    ],
)
def test_nvme_cli_garbage_is_unavailable_not_zero(text: str, reason: str) -> None:
    report = parse_nvme_smart_log(text)
    assert not report.available and reason in report.reason
    assert report.data_written_bytes is None and report.percentage_used is None


def test_smartctl_virtio_disk_says_why() -> None:
    text = (
        '{"smartctl": {"messages": [{"string": "/dev/vda: Unable to detect device type",'
        ' "severity": "error"}], "exit_status": 1}}'
    )
    report = parse_smartctl(text, "/dev/vda")
    assert not report.available
    assert report.reason == "/dev/vda: Unable to detect device type"


def test_read_smart_without_tools_is_unavailable_with_reasons(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(smart_module.shutil, "which", lambda name: None)
    report = read_smart("vda", sysfs_written=12345)
    assert not report.available and report.source == "sysfs"
    assert "virtio" in report.reason and "nvme-cli is not installed" in report.reason
    assert "smartctl is not installed" in report.reason
    assert report.written_bytes_since_boot == 12345 and report.data_written_bytes is None
    assert not read_smart(None).available


def test_read_smart_runs_the_installed_tool(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []

    def fake_run(argv: list[str]) -> tuple[int, str, str]:
        calls.append(argv)
        return 0, fixture("nvme_cli_1x_smart_log.json"), ""

    monkeypatch.setattr(smart_module.shutil, "which", lambda name: f"/usr/sbin/{name}")
    monkeypatch.setattr(smart_module, "_run", fake_run)
    report = read_smart("nvme0n1")
    assert calls == [["nvme", "smart-log", "/dev/nvme0n1", "-o", "json"]]
    assert report.available and report.percentage_used == 15


def test_detect_drive_finds_the_disk_under_a_path(tmp_path: Path) -> None:
    drive = detect_drive(tmp_path)
    assert drive.capacity_bytes is not None and drive.capacity_bytes > 0
    assert drive.capacity_source in ("sysfs", "statvfs")

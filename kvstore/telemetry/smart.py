"""The drive's own wear counters: NVMe SMART / health log, ATA attributes, sysfs.

Sources, tried in order: ``nvme smart-log DEV -o json`` (nvme-cli), ``smartctl -j -a
DEV`` (smartmontools), sysfs (``/sys/block/<dev>/stat``: the kernel's count of
sectors written since boot; no wear). Whatever is missing is reported as
unavailable with the reason (no tool, not an NVMe or SATA device, permission
denied, virtio disk), never as zeros.

Parsing is separate from running the tools so recorded outputs can be tested
(tests/unit/fixtures/smart/). Quirks handled: nvme-cli 1.x prints numbers; 2.x
prints 128-bit counters as strings, sometimes with thousands separators
("2,752,848"); smartctl nests NVMe fields under
``nvme_smart_health_information_log`` and ATA ones under ``ata_smart_attributes``.
An NVMe data unit is 1000 x 512 bytes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "NVME_DATA_UNIT_BYTES",
    "SmartReport",
    "parse_nvme_smart_log",
    "parse_smartctl",
    "read_smart",
]

NVME_DATA_UNIT_BYTES = 512_000
_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class SmartReport:
    """The drive's view of its wear. ``available`` False means ``reason`` says why."""

    available: bool
    source: str  # "nvme-cli", "smartctl", "sysfs" or "none"
    reason: str = ""
    device: str | None = None
    model: str | None = None
    data_written_bytes: int | None = None  # lifetime, from the drive
    percentage_used: int | None = None  # NVMe "Percentage Used" (may exceed 100)
    power_on_hours: int | None = None
    capacity_bytes: int | None = None
    media_errors: int | None = None
    available_spare_percent: int | None = None
    written_bytes_since_boot: int | None = None  # sysfs only
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def _number(value: Any) -> int | None:
    """An integer from nvme-cli/smartctl JSON: int, float, "123" or "2,752,848"."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value)
    if isinstance(value, str):
        text = value.replace(",", "").strip()
        try:
            return int(text)
        except ValueError:
            try:
                return int(float(text))
            except ValueError:
                return None
    return None


def parse_nvme_smart_log(text: str, device: str | None = None) -> SmartReport:
    """``nvme smart-log DEV -o json`` output (nvme-cli 1.x or 2.x)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        return SmartReport(False, "nvme-cli", f"nvme-cli printed no JSON: {e}", device)
    if not isinstance(data, dict):
        return SmartReport(False, "nvme-cli", "nvme-cli JSON is not an object", device)
    units = _number(data.get("data_units_written"))
    used = _number(data.get("percent_used", data.get("percentage_used")))
    if units is None and used is None:
        return SmartReport(
            False, "nvme-cli", "the smart-log has no data_units_written or percent_used", device
        )
    return SmartReport(
        True,
        "nvme-cli",
        device=device,
        data_written_bytes=None if units is None else units * NVME_DATA_UNIT_BYTES,
        percentage_used=used,
        power_on_hours=_number(data.get("power_on_hours")),
        media_errors=_number(data.get("media_errors")),
        available_spare_percent=_number(data.get("avail_spare", data.get("available_spare"))),
    )


def parse_smartctl(text: str, device: str | None = None) -> SmartReport:
    """``smartctl -j -a DEV`` output: NVMe health log, or ATA attributes for SATA SSDs."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        return SmartReport(False, "smartctl", f"smartctl printed no JSON: {e}", device)
    if not isinstance(data, dict):
        return SmartReport(False, "smartctl", "smartctl JSON is not an object", device)
    device = (data.get("device") or {}).get("name") or device
    model = data.get("model_name")
    capacity = _number((data.get("user_capacity") or {}).get("bytes")) or _number(
        data.get("nvme_total_capacity")
    )
    hours = _number((data.get("power_on_time") or {}).get("hours"))
    nvme = data.get("nvme_smart_health_information_log")
    if isinstance(nvme, dict):
        units = _number(nvme.get("data_units_written"))
        return SmartReport(
            units is not None or nvme.get("percentage_used") is not None,
            "smartctl",
            "" if units is not None else "the NVMe health log has no data_units_written",
            device,
            model,
            None if units is None else units * NVME_DATA_UNIT_BYTES,
            _number(nvme.get("percentage_used")),
            _number(nvme.get("power_on_hours")) or hours,
            capacity,
            _number(nvme.get("media_errors")),
            _number(nvme.get("available_spare")),
        )
    table = (data.get("ata_smart_attributes") or {}).get("table")
    if isinstance(table, list):
        attributes = {row.get("id"): row for row in table if isinstance(row, dict)}
        notes: list[str] = []
        written: int | None = None
        lbas = attributes.get(241)  # Total_LBAs_Written (most SATA SSDs: 512-byte units)
        if lbas is not None:
            raw = _number((lbas.get("raw") or {}).get("value"))
            if raw is not None:
                block = _number(data.get("logical_block_size")) or 512
                written = raw * block
                notes.append(f"data written = attribute 241 raw x {block}-byte logical blocks")
        used: int | None = None
        for attribute_id in (233, 231, 177, 202, 169):  # vendor wear indicators, % left
            row = attributes.get(attribute_id)
            value = _number(row.get("value")) if row else None
            if row is not None and value is not None and 0 <= value <= 100:
                used = 100 - value
                notes.append(f"percentage used = 100 - attribute {attribute_id} {row.get('name')}")
                break
        if written is None and used is None:
            return SmartReport(
                False,
                "smartctl",
                "the ATA attributes have no written-bytes or wear indicator",
                device,
                model,
            )
        return SmartReport(
            True,
            "smartctl",
            device=device,
            model=model,
            data_written_bytes=written,
            percentage_used=used,
            power_on_hours=hours,
            capacity_bytes=capacity,
            notes=notes,
        )
    messages = [
        message.get("string", "")
        for message in (data.get("smartctl") or {}).get("messages", [])
        if isinstance(message, dict)
    ]
    reason = "; ".join(message for message in messages if message) or (
        "smartctl reports no NVMe health log and no ATA attributes for this device"
    )
    return SmartReport(False, "smartctl", reason, device, model)


def _run(argv: list[str]) -> tuple[int, str, str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return -1, "", str(e)
    return done.returncode, done.stdout, done.stderr.strip()


def read_smart(device: str | None, *, sysfs_written: int | None = None) -> SmartReport:
    """Ask the installed tools about ``device`` (``nvme0n1`` or ``/dev/nvme0n1``).

    ``sysfs_written`` (from ``detect_drive``) is reported when no tool can help.
    """
    if device is None:
        return SmartReport(
            False, "none", "the store's block device is unknown (pass --device)", None
        )
    path = device if device.startswith("/dev/") else f"/dev/{device}"
    name = Path(path).name
    reasons: list[str] = []
    if name.startswith("vd") or name.startswith("xvd"):
        reasons.append(f"{name} is a virtio/Xen virtual disk: it has no SMART log")
    if shutil.which("nvme") and name.startswith("nvme"):
        code, out, err = _run(["nvme", "smart-log", path, "-o", "json"])
        if code == 0:
            report = parse_nvme_smart_log(out, path)
            if report.available:
                return report
            reasons.append(report.reason)
        else:
            reasons.append(f"nvme smart-log failed ({err or f'exit {code}'})")
    elif not shutil.which("nvme"):
        reasons.append("nvme-cli is not installed")
    if shutil.which("smartctl"):
        code, out, err = _run(["smartctl", "-j", "-a", path])
        # smartctl's exit status is a bit mask; bits 0-1 mean it could not read at all.
        if out and not code & 0b11:
            report = parse_smartctl(out, path)
            if report.available:
                return report
            reasons.append(report.reason)
        else:
            reasons.append(f"smartctl could not read {path} ({err or f'exit status {code}'})")
    else:
        reasons.append("smartctl is not installed")
    reason = "; ".join(reason for reason in reasons if reason)
    if sysfs_written is not None:
        return SmartReport(
            False,
            "sysfs",
            f"SMART unavailable: {reason}",
            path,
            written_bytes_since_boot=sysfs_written,
            notes=["sysfs gives bytes written since boot (kernel block layer), not drive wear"],
        )
    return SmartReport(False, "none", f"SMART unavailable: {reason}", path)

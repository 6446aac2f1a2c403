"""The wear model: write amplification, DWPD over windows, projected drive life.

Inputs are the store's telemetry (lifetime totals and hourly buckets, see
counters.py), the drive's capacity and rating (``StoreConfig`` fields, else read
from sysfs, else assumed and said so), and optionally SMART (smart.py).

Definitions (docs/operations.md, "Wear"):
- store bytes: every byte the store wrote, all kinds; host bytes: payload bytes
  callers asked to store; write amplification = store bytes / host bytes.
- DWPD over a window W = store bytes written in the last W / drive capacity,
  scaled to a day: x 86400 / E, where E = min(W, time since the counters began).
  Hourly buckets are the resolution: the oldest bucket that the window only
  partly covers counts pro rata.
- projected life: the drive's rated endurance (rated DWPD x capacity x 365 x
  warranty years) left after what the store has written, at the 24 h rate.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.telemetry.counters import SECONDS_PER_HOUR, WRITE_KINDS, HourBucket

__all__ = [
    "DWPD_WINDOWS_S",
    "DriveInfo",
    "WearReport",
    "detect_drive",
    "dwpd_over",
    "wear_report",
]

DAY_S = 86_400
DWPD_WINDOWS_S = {"1h": 3_600, "24h": DAY_S, "7d": 7 * DAY_S}
DEFAULT_RATED_DWPD = 1.0  # a mainstream data-center TLC rating; used only when nothing says
DEFAULT_WARRANTY_YEARS = 5.0


@dataclass(frozen=True, slots=True)
class DriveInfo:
    """The block device under a path, as far as sysfs tells.

    ``capacity_source`` says where ``capacity_bytes`` came from: "config",
    "sysfs" (the whole disk), "statvfs" (the file system: not the drive), or
    "unknown".
    """

    name: str | None
    capacity_bytes: int | None
    capacity_source: str
    model: str | None = None
    rotational: bool | None = None
    sysfs_path: str | None = None
    written_bytes_since_boot: int | None = None  # /sys/block/<dev>/stat, sectors x 512


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _whole_disk(sysfs: Path) -> Path:
    """A partition's sysfs directory -> its disk's (partitions have a ``partition`` file)."""
    if (sysfs / "partition").exists():
        return sysfs.resolve().parent
    return sysfs.resolve()


def detect_drive(path: str | os.PathLike[str], device: str | None = None) -> DriveInfo:
    """The drive holding ``path`` (or the named ``device``, e.g. ``nvme0n1``)."""
    sysfs: Path | None = None
    if device is not None:
        name = Path(device).name
        candidate = Path("/sys/class/block") / name
        if candidate.exists():
            sysfs = _whole_disk(candidate)
    else:
        try:
            st_dev = os.stat(path).st_dev
        except OSError:
            st_dev = 0
        major, minor = os.major(st_dev), os.minor(st_dev)
        candidate = Path(f"/sys/dev/block/{major}:{minor}")
        if major and candidate.exists():
            sysfs = _whole_disk(candidate)
    if sysfs is not None:
        size = _read(sysfs / "size")
        stat = (_read(sysfs / "stat") or "").split()
        written = int(stat[6]) * 512 if len(stat) > 6 and stat[6].isdigit() else None
        rotational = _read(sysfs / "queue" / "rotational")
        model = _read(sysfs / "device" / "model")
        if size is not None and size.isdigit() and int(size) > 0:
            return DriveInfo(
                sysfs.name,
                int(size) * 512,
                "sysfs",
                model,
                None if rotational is None else rotational == "1",
                str(sysfs),
                written,
            )
    try:
        vfs = os.statvfs(path)
        return DriveInfo(None, vfs.f_blocks * vfs.f_frsize, "statvfs")
    except OSError:
        return DriveInfo(None, None, "unknown")


def dwpd_over(
    buckets: Sequence[HourBucket],
    *,
    now_s: float,
    window_s: float,
    capacity_bytes: int,
    created_s: float,
) -> float:
    """Drive writes per day over the last ``window_s`` (see the module docstring)."""
    if capacity_bytes <= 0:
        return 0.0
    start = now_s - window_s
    written = 0.0
    for bucket in buckets:
        bucket_start = bucket.hour * SECONDS_PER_HOUR
        bucket_end = min(bucket_start + SECONDS_PER_HOUR, now_s)
        if bucket_end <= start or bucket_start >= now_s:
            continue
        if bucket_start >= start:
            written += bucket.store_bytes
        else:  # the oldest bucket, partly inside the window
            span = bucket_end - bucket_start
            written += bucket.store_bytes * (bucket_end - start) / span if span > 0 else 0
    elapsed = min(window_s, max(now_s - created_s, 1.0))
    return written / capacity_bytes * DAY_S / elapsed


@dataclass(frozen=True, slots=True)
class WearReport:
    """What ``kvstore wear`` and ``stat`` print; ``as_dict`` is the JSON form."""

    host_bytes: int
    store_bytes: int
    store_bytes_by_kind: dict[str, int]
    write_amplification: float
    dwpd: dict[str, float]
    drive_capacity_bytes: int | None
    capacity_source: str
    rated_dwpd: float
    rated_dwpd_source: str
    warranty_years: float
    warranty_source: str
    max_dwpd: float | None
    rated_endurance_bytes: int | None
    projected_life_days: float | None
    budget_used_ratio: float | None  # dwpd 24h / max_dwpd (or the rating, without a budget)
    counters_since_unix_s: float
    counters_saved_unix_s: float | None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def wear_report(
    totals: Sequence[int],
    buckets: Sequence[HourBucket],
    *,
    now_s: float,
    created_s: float,
    saved_s: float | None,
    capacity_bytes: int | None,
    capacity_source: str,
    rated_dwpd: float | None,
    warranty_years: float | None,
    max_dwpd: float | None,
    notes: Sequence[str] = (),
) -> WearReport:
    by_kind = {kind: int(totals[position]) for position, kind in enumerate(WRITE_KINDS)}
    host = by_kind["host"]
    written = sum(by_kind.values())
    out_notes = list(notes)
    if capacity_bytes:
        dwpd = {
            name: dwpd_over(
                buckets,
                now_s=now_s,
                window_s=window,
                capacity_bytes=capacity_bytes,
                created_s=created_s,
            )
            for name, window in DWPD_WINDOWS_S.items()
        }
    else:
        dwpd = dict.fromkeys(DWPD_WINDOWS_S, 0.0)
        out_notes.append(
            "drive capacity unknown: DWPD cannot be computed (set drive_capacity_bytes)"
        )
    rated_source = "config" if rated_dwpd else "assumed"
    rated = rated_dwpd or DEFAULT_RATED_DWPD
    warranty_source = "config" if warranty_years else "assumed"
    warranty = warranty_years or DEFAULT_WARRANTY_YEARS
    if rated_source == "assumed":
        out_notes.append(
            f"rated DWPD not configured and not readable from the device: assuming {rated:g}"
        )
    endurance = int(rated * capacity_bytes * 365 * warranty) if capacity_bytes else None
    life_days: float | None = None
    daily = dwpd["24h"] * capacity_bytes if capacity_bytes else 0.0
    if endurance is not None and daily > 0:
        life_days = max(0.0, (endurance - written) / daily)
    limit = max_dwpd or rated
    return WearReport(
        host_bytes=host,
        store_bytes=written,
        store_bytes_by_kind=by_kind,
        write_amplification=written / host if host else 0.0,
        dwpd=dwpd,
        drive_capacity_bytes=capacity_bytes,
        capacity_source=capacity_source,
        rated_dwpd=rated,
        rated_dwpd_source=rated_source,
        warranty_years=warranty,
        warranty_source=warranty_source,
        max_dwpd=max_dwpd,
        rated_endurance_bytes=endurance,
        projected_life_days=life_days,
        budget_used_ratio=dwpd["24h"] / limit if limit else None,
        counters_since_unix_s=created_s,
        counters_saved_unix_s=saved_s,
        notes=out_notes,
    )

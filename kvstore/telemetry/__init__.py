"""Telemetry: persistent counters, the wear model, SMART, the DWPD budget, Prometheus
metrics and the HTML report (see docs/operations.md, "Wear and performance").

The core (store.py) imports only ``counters`` and ``budget``; ``prometheus`` and
``report`` import prometheus_client and matplotlib, and are imported only when used.

``TelemetrySnapshot`` is the one value every surface reads: a live store makes one
with ``KVStore.telemetry_snapshot()``; ``read_snapshot(path)`` reads the persisted
state of any store, also beside a live writer (LMDB readers never block it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmdb

from kvstore.errors import AlreadyOpenError, CorruptionError, StoreNotFoundError
from kvstore.format.names import INDEX_DIR, SUPERBLOCK_NAME
from kvstore.index.lmdb_env import open_environment
from kvstore.log.regular import require_regular
from kvstore.telemetry.counters import (
    COUNTER_NAMES,
    HISTOGRAM_SLOTS,
    LATENCY_BOUNDS_S,
    LATENCY_OPS,
    TELEMETRY_DB,
    WRITE_KINDS,
    HourBucket,
    Telemetry,
    WearSettings,
    histogram_base,
)
from kvstore.telemetry.wear import WearReport, detect_drive, wear_report

__all__ = ["TelemetrySnapshot", "read_snapshot"]


@dataclass(frozen=True, slots=True)
class TelemetrySnapshot:
    """Lifetime counters, hourly history and wear settings of one store at ``now_s``."""

    path: str
    values: tuple[int, ...]
    buckets: tuple[HourBucket, ...]
    now_s: float
    created_s: float
    saved_s: float | None
    wear: WearSettings
    drive_capacity_bytes: int | None
    capacity_source: str
    live: bool  # from the writer's memory (True) or the persisted state (False)
    throughput: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    gauges: Mapping[str, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def counter(self, name: str) -> int:
        return self.values[COUNTER_NAMES.index(name)]

    def counters(self) -> dict[str, int]:
        return {name: self.values[position] for position, name in enumerate(COUNTER_NAMES)}

    def histogram(self, op: str) -> tuple[tuple[int, ...], float]:
        """(bucket counts with +Inf last, sum in seconds), lifetime."""
        base = histogram_base(LATENCY_OPS.index(op))
        buckets = self.values[base : base + len(LATENCY_BOUNDS_S) + 1]
        return buckets, self.values[base + HISTOGRAM_SLOTS - 1] / 1e9

    def wear_report(self) -> WearReport:
        return wear_report(
            self.values,
            self.buckets,
            now_s=self.now_s,
            created_s=self.created_s,
            saved_s=self.saved_s,
            capacity_bytes=self.drive_capacity_bytes,
            capacity_source=self.capacity_source,
            rated_dwpd=self.wear.rated_dwpd or None,
            warranty_years=self.wear.warranty_years or None,
            max_dwpd=self.wear.max_dwpd or None,
            notes=self.notes,
        )

    def store_bytes_by_kind(self) -> dict[str, int]:
        return {kind: self.values[position] for position, kind in enumerate(WRITE_KINDS)}


def snapshot_of(
    telemetry: Telemetry,
    values: list[int],
    *,
    path: str,
    capacity_bytes: int | None,
    capacity_source: str,
    live: bool,
    throughput: Mapping[str, Mapping[str, float]] | None = None,
    gauges: Mapping[str, float] | None = None,
    now_s: float | None = None,
) -> TelemetrySnapshot:
    now = telemetry.clock() if now_s is None else now_s
    return TelemetrySnapshot(
        path=path,
        values=tuple(values),
        buckets=tuple(telemetry.series(values, now)),
        now_s=now,
        created_s=telemetry.created_unix_ns / 1e9,
        saved_s=telemetry.saved_unix_ns / 1e9 if telemetry.saved_unix_ns else None,
        wear=telemetry.wear,
        drive_capacity_bytes=capacity_bytes,
        capacity_source=capacity_source,
        live=live,
        throughput=throughput or {},
        gauges=gauges or {},
        notes=tuple(telemetry.notes),
    )


def resolve_capacity(
    path: str | os.PathLike[str], wear: WearSettings, device: str | None = None
) -> tuple[int | None, str]:
    """The drive capacity for DWPD: configured, else sysfs, else the file system size."""
    if wear.drive_capacity_bytes:
        return wear.drive_capacity_bytes, "config"
    drive = detect_drive(path, device)
    return drive.capacity_bytes, drive.capacity_source


def read_snapshot(
    path: str | os.PathLike[str],
    *,
    device: str | None = None,
    clock: Any = time.time,
    capacity_bytes: int | None = None,
) -> TelemetrySnapshot:
    """The persisted telemetry of the store at ``path`` (read-only; any process).

    Opens only the store's LMDB environment, read-only, for one transaction. A store
    with no telemetry yet (never opened by a writer of this version) reads as zeros
    with a note.
    """
    root = Path(path)
    if not (root / SUPERBLOCK_NAME).exists():
        raise StoreNotFoundError(f"no kvstore at {root}")
    telemetry = Telemetry(clock, retention_hours=1 << 30)
    notes: list[str] = []
    for name in ("data.mdb", "lock.mdb"):  # LMDB opens them itself: a FIFO would block
        require_regular(root / INDEX_DIR / name)
    try:
        env = open_environment(root / INDEX_DIR, readonly=True)
    except lmdb.Error as e:
        if "already open in this process" in str(e):
            raise AlreadyOpenError(
                f"{root} is open in this process: use its KVStore.telemetry_snapshot()"
            ) from e
        raise CorruptionError(f"cannot open the LMDB index of {root}: {e}") from e
    try:
        try:
            db = env.open_db(TELEMETRY_DB, create=False)
        except lmdb.NotFoundError:
            db = None
            notes.append("no telemetry recorded yet (open the store as a writer once)")
        if db is not None:
            try:
                telemetry.load(env, db)
            except lmdb.MapResizedError:
                env.set_mapsize(0)
                telemetry.load(env, db)
    finally:
        env.close()
    telemetry.notes[:0] = notes
    capacity: int | None = capacity_bytes
    source = "option"
    if not capacity:
        capacity, source = resolve_capacity(root, telemetry.wear, device)
    return snapshot_of(
        telemetry,
        list(telemetry.values),
        path=str(root),
        capacity_bytes=capacity,
        capacity_source=source,
        live=False,
        gauges=telemetry.gauges,  # the writer's at its last save (fill levels, degraded)
    )

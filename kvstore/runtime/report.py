"""What ``KVStore.stats()`` and ``telemetry_snapshot()`` report of the shared state, and
what an open could not vouch for (docs/operations.md, "Degraded open")."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvstore.format.constants import BLOCK_BYTES, FORMAT_VERSION
from kvstore.format.entries import SEGMENT_ACTIVE
from kvstore.runtime.state import StoreState
from kvstore.telemetry import TelemetrySnapshot
from kvstore.telemetry.wear import WearReport
from kvstore.types import StoreStats

__all__ = ["Degraded", "gauges_locked", "store_stats_locked"]


@dataclasses.dataclass(slots=True)
class Degraded:
    """What this open could not vouch for (``stats()``; docs/operations.md, "Degraded open")."""

    reasons: list[str] = dataclasses.field(default_factory=list)
    segments: dict[int, str] = dataclasses.field(default_factory=dict)  # id -> why
    served: dict[int, int] = dataclasses.field(default_factory=dict)  # id -> pages verified
    pages: int = 0  # dropped: misses
    salvaged_pages: int = 0
    damaged_wal_headers: int = 0
    salvaged_wal_records: int = 0
    index_salvaged: bool = False

    def fields(self, index_check_seconds: float) -> dict[str, Any]:
        """The ``StoreStats`` fields of a degraded open."""
        return {
            "degraded": bool(self.reasons),
            "degraded_reasons": tuple(self.reasons),
            "quarantined_segments": len(self.segments),
            "quarantined_pages": self.pages,
            "salvaged_pages": self.salvaged_pages,
            "damaged_wal_headers": self.damaged_wal_headers,
            "salvaged_wal_records": self.salvaged_wal_records,
            "index_salvaged": self.index_salvaged,
            "index_check_seconds": index_check_seconds,
        }


def gauges_locked(
    st: StoreState, degraded: dict[str, Any], segment_bytes: int | None = None
) -> dict[str, float]:
    """The gauges of a telemetry snapshot (``free_bytes`` as ``stats()``, given the
    segment size). Caller holds the state lock."""
    gauges = {
        "pages": float(len(st.table)),
        "segments": float(len(st.segments)),
        "live_bytes": float(sum(state.live_bytes for state in st.segment_states.values())),
        "pinned_pages": float(sum(len(stack) for stack in st.pins.values())),
        "retained_pages": float(len(st.retains)),
    }
    if st.capacity_bytes is not None:
        gauges["capacity_bytes"] = float(st.capacity_bytes)
        if segment_bytes is not None:
            gauges["free_bytes"] = float(st.capacity_bytes - len(st.segments) * segment_bytes)
    for name, value in degraded.items():
        if isinstance(value, bool | int) and name != "index_check_seconds":
            gauges[name] = float(value)
    return gauges


def store_stats_locked(
    st: StoreState,
    snapshot: TelemetrySnapshot,
    wear: WearReport,
    counters: dict[str, int],
    degraded: dict[str, Any],
    *,
    path: str,
    io_engine: str,
    io_engine_reason: str,
    direct_io: bool,
    readonly: bool,
    segment_bytes: int,
    wal_files: int,
    wal_bytes: int,
) -> StoreStats:
    """``KVStore.stats()``. Caller holds the state lock (``wear`` is the snapshot's
    report, computed before taking it)."""
    active = st.active.segment_id if st.active is not None else 0
    overlay = len(st.table.active) + len(st.table.frozen or {})
    live = sum(state.live_bytes for state in st.segment_states.values())
    used = sum(  # record bytes written so far (the header block is not garbage)
        state.head_bytes - BLOCK_BYTES for state in st.segment_states.values()
    )
    by_state = {"active": 0, "sealed": 0}
    for state in st.segment_states.values():
        by_state["active" if state.state == SEGMENT_ACTIVE else "sealed"] += 1
    on_disk = len(st.segments) * segment_bytes
    return StoreStats(
        path=path,
        format_version=FORMAT_VERSION,
        io_engine=io_engine,
        io_engine_reason=io_engine_reason,
        direct_io=direct_io,
        readonly=readonly,
        pages=len(st.table),
        segments=len(st.segments),
        segment_bytes=segment_bytes,
        active_segment_id=active,
        bytes_on_disk=on_disk,
        next_lsn=st.next_lsn,
        durable_lsn=st.durable_lsn,
        checkpoint_lsn=st.checkpoint_lsn,
        wal_files=wal_files,
        wal_bytes=wal_bytes,
        overlay_entries=overlay,
        counters=counters,
        capacity_bytes=st.capacity_bytes,
        live_bytes=live,
        garbage_bytes=used - live,
        free_bytes=None if st.capacity_bytes is None else st.capacity_bytes - on_disk,
        segments_by_state=by_state,
        pinned_pages=sum(len(stack) for stack in st.pins.values()),
        retained_pages=len(st.retains),
        eviction_policy=st.policy.name,
        evictions=dict(st.evictions),
        gc_bytes_copied=counters["gc_bytes_copied"],
        write_amplification=wear.write_amplification,
        host_bytes=wear.host_bytes,
        store_bytes=wear.store_bytes,
        store_bytes_by_kind=wear.store_bytes_by_kind,
        dwpd=wear.dwpd,
        drive_capacity_bytes=wear.drive_capacity_bytes,
        max_dwpd=wear.max_dwpd,
        declined_puts=snapshot.counter("declined_puts"),
        telemetry=snapshot.counters(),
        throughput=snapshot.throughput,
        **degraded,
    )

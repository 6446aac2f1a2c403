"""Values that cross the public boundary: frozen, slotted dataclasses.

The caller owns every instance it receives; the store never mutates one after
handing it out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeAlias

__all__ = ["GCReport", "Key", "Meta", "MetaValue", "PageInfo", "StoreStats"]

Key: TypeAlias = bytes | str
MetaValue: TypeAlias = str | int | float | bool | list["MetaValue"] | dict[str, "MetaValue"] | None
Meta = Mapping[str, MetaValue]


@dataclass(frozen=True, slots=True)
class PageInfo:
    """Where a page lives and what it is; returned by ``KVStore.info``."""

    key: bytes
    payload_bytes: int
    segment_id: int
    offset: int
    generation: int
    lsn: int
    checksum: int
    meta: Mapping[str, MetaValue]


@dataclass(frozen=True, slots=True)
class HeldExtent:
    """A page's payload on disk, verified and held (``KVStore.held_extents``): while the
    ``with`` block runs, the segment file at ``path`` is neither freed nor reused, so
    ``length`` bytes at ``offset`` stay this page's payload even if the key is
    overwritten or deleted meanwhile. ``offset`` and ``length`` are 4 KiB aligned
    whenever the page is a whole number of 4 KiB blocks (O_DIRECT, cuFile)."""

    key: bytes
    path: str
    offset: int  # of the payload (the record header block is before it)
    length: int
    checksum: int  # xxh3-64 of the payload
    meta: Mapping[str, MetaValue]
    segment_id: int

    def matches(self, payload: bytes | memoryview) -> bool:
        """Whether ``payload`` (read from this extent) is the page's bytes (xxh3-64)."""
        from kvstore.format.checksum import checksum

        return checksum(payload) == self.checksum


@dataclass(frozen=True, slots=True)
class StoreStats:
    """A snapshot of the store's state; returned by ``KVStore.stats``."""

    path: str
    format_version: int
    io_engine: str
    direct_io: bool
    readonly: bool
    pages: int
    segments: int
    segment_bytes: int
    active_segment_id: int
    bytes_on_disk: int
    next_lsn: int
    durable_lsn: int
    checkpoint_lsn: int
    wal_files: int
    wal_bytes: int
    overlay_entries: int
    counters: Mapping[str, int] = field(default_factory=dict)
    capacity_bytes: int | None = None
    live_bytes: int = 0
    garbage_bytes: int = 0
    free_bytes: int | None = None
    segments_by_state: Mapping[str, int] = field(default_factory=dict)
    pinned_pages: int = 0
    retained_pages: int = 0
    eviction_policy: str = "fifo"
    evictions: Mapping[str, int] = field(default_factory=dict)
    gc_bytes_copied: int = 0
    # Lifetime telemetry (persisted; survives restarts). write_amplification is
    # store_bytes / host_bytes over every kind of byte the store wrote.
    write_amplification: float = 0.0
    host_bytes: int = 0
    store_bytes: int = 0
    store_bytes_by_kind: Mapping[str, int] = field(default_factory=dict)
    dwpd: Mapping[str, float] = field(default_factory=dict)
    drive_capacity_bytes: int | None = None
    max_dwpd: float | None = None
    declined_puts: int = 0
    telemetry: Mapping[str, int] = field(default_factory=dict)
    throughput: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    # Which engine runs and why (the binding and version, or the fallback's reason).
    io_engine_reason: str = ""
    # Degraded open (docs/operations.md, "Degraded open"): what this open found it
    # could not vouch for. All zero / empty for a healthy store.
    degraded: bool = False
    degraded_reasons: tuple[str, ...] = ()
    quarantined_segments: int = 0  # segments with a damaged header or file, never written
    quarantined_pages: int = 0  # pages the index named that failed verification: misses
    salvaged_pages: int = 0  # pages of quarantined segments that verified completely
    damaged_wal_headers: int = 0  # WAL files whose header was damaged (records replayed)
    salvaged_wal_records: int = 0  # records replayed from those files (own checksums)
    index_salvaged: bool = False  # the LMDB index was damaged and rebuilt from what verified
    index_check_seconds: float = 0.0  # the open-time structural check of the LMDB index

    def as_dict(self) -> dict[str, object]:
        """A JSON-ready dict of every field."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass(frozen=True, slots=True)
class GCReport:
    """What one ``KVStore.gc`` pass did."""

    segments_scanned: int = 0
    segments_freed: int = 0
    pages_moved: int = 0
    bytes_moved: int = 0
    pages_evicted: int = 0
    bytes_evicted: int = 0
    drift_segments: int = 0  # segments whose running accounting was wrong (and fixed)
    drift_bytes: int = 0
    seconds: float = 0.0

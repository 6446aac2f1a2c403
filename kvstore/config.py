"""Tunables of an open store. Sizes carry their unit in the name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvstore.format.constants import BLOCK_BYTES, MAX_PAGE_BYTES_LIMIT

__all__ = ["StoreConfig"]

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Options for ``KVStore.open``; the defaults suit 256 KiB - 1 MiB pages on NVMe.

    ``segment_bytes`` and ``max_page_bytes`` are fixed when the store is created
    (they are recorded in the superblock); the rest may change at every open.
    """

    segment_bytes: int = 256 * MIB
    max_page_bytes: int = 16 * MIB
    capacity_bytes: int | None = None
    flush_interval_ms: float = 20.0
    checkpoint_wal_bytes: int = 64 * MIB
    checkpoint_interval_s: float = 60.0
    # "auto" | "io_uring" | "threadpool"; $KVSTORE_IO_ENGINE overrides "auto".
    io_engine: str = "auto"
    # Which io_uring binding: "auto" (the importable liburing), "liburing-2024" or
    # "liburing-2026"; $KVSTORE_URING_BINDING overrides "auto". See docs/design.md.
    uring_binding: str = "auto"
    direct_io: bool | None = None  # None: O_DIRECT where the file system allows it
    io_depth: int = 64
    # A single-page get/get_into on io_uring polls its completion for up to this long
    # (releasing the GIL between polls) before sleeping: no idle wake-up on the latency
    # path, at the price of a busy core while the read runs. 0: always sleep.
    read_poll_us: int = 1000
    lsn_lease_step: int = 1 << 20
    eviction_policy: str = "fifo"  # a name registered in kvstore.space.policies
    low_watermark_segments: int = 2  # evict when fewer free segments remain
    gc_reserve_segments: int = 1  # segments only GC may fill (room to relocate)
    gc_live_ratio: float = 0.5  # compact sealed segments less live than this
    gc_interval_s: float = 1.0  # background GC period; 0 disables the GC thread
    # Telemetry (docs/operations.md, "Wear and performance"). Counters are persisted
    # at most every telemetry_flush_interval_s (and at each checkpoint and close):
    # a kill -9 loses at most that much counting.
    telemetry_flush_interval_s: float = 1.0
    telemetry_retention_hours: int = 35 * 24  # hourly buckets kept (>= 30 days)
    telemetry_clock: Callable[[], float] | None = None  # wall clock, seconds; tests inject
    # Wear model and DWPD budget. None: read from the device where possible, else assumed.
    drive_capacity_bytes: int | None = None
    rated_dwpd: float | None = None
    warranty_years: float | None = None
    max_dwpd: float | None = None  # set: puts beyond this many drive writes/day return False
    max_dwpd_burst_s: float = 10.0  # the budget's bucket holds this many seconds of writes

    def validate(self) -> None:
        if self.segment_bytes % BLOCK_BYTES or self.segment_bytes < 4 * BLOCK_BYTES:
            raise ValueError(
                f"segment_bytes must be a multiple of {BLOCK_BYTES} and at least "
                f"{4 * BLOCK_BYTES}, got {self.segment_bytes}"
            )
        if not 0 < self.max_page_bytes <= MAX_PAGE_BYTES_LIMIT:
            raise ValueError(f"max_page_bytes must be 1..{MAX_PAGE_BYTES_LIMIT}")
        if self.max_page_bytes + 2 * BLOCK_BYTES > self.segment_bytes:
            raise ValueError(
                f"max_page_bytes ({self.max_page_bytes}) must fit in a segment "
                f"({self.segment_bytes} bytes) with its header"
            )
        if self.capacity_bytes is not None:
            needed = (self.low_watermark_segments + self.gc_reserve_segments + 2) * (
                self.segment_bytes
            )
            if self.capacity_bytes < needed:
                raise ValueError(
                    f"capacity_bytes ({self.capacity_bytes}) must hold at least "
                    f"{needed // self.segment_bytes} segments of {self.segment_bytes} bytes "
                    "(watermark + GC reserve + 2); use smaller segments"
                )
        if not 0.0 <= self.gc_live_ratio <= 1.0:
            raise ValueError("gc_live_ratio must be between 0 and 1")
        if self.low_watermark_segments < 1 or self.gc_reserve_segments < 1:
            raise ValueError("low_watermark_segments and gc_reserve_segments must be >= 1")
        if self.flush_interval_ms <= 0 or self.io_depth < 1 or self.lsn_lease_step < 1:
            raise ValueError("flush_interval_ms, io_depth and lsn_lease_step must be positive")
        if self.read_poll_us < 0:
            raise ValueError(f"read_poll_us must be >= 0, got {self.read_poll_us}")
        if self.telemetry_flush_interval_s <= 0 or self.telemetry_retention_hours < 30 * 24:
            raise ValueError(
                "telemetry_flush_interval_s must be positive and telemetry_retention_hours "
                "at least 720 (30 days)"
            )
        for name in ("drive_capacity_bytes", "rated_dwpd", "warranty_years", "max_dwpd"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive (or None), got {value}")
        if self.max_dwpd_burst_s <= 0:
            raise ValueError("max_dwpd_burst_s must be positive")

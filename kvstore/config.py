"""Tunables of an open store. Sizes carry their unit in the name."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.format.constants import BLOCK_BYTES, MAX_PAGE_BYTES_LIMIT, MAX_SEGMENT_BYTES

__all__ = ["StoreConfig"]

MIB = 1 << 20
MAX_IO_DEPTH = 32768  # the kernel's limit on io_uring submission queue entries
MAX_LSN_LEASE_STEP = 1 << 32  # leases stay far below SEQUENCE_LIMIT (2**62)
MAX_PIPELINE_DEPTH = 64  # pipeline threads at most


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
    # Batches of put_many_async / get_many_async / get_many_into_async in flight at
    # once, each on its own pipeline thread and ring: the next batch is prepared and
    # submitted while the previous one's I/O and group commit run (docs/design.md,
    # "Pipelined batches"). More wait their turn.
    pipeline_depth: int = 2
    lsn_lease_step: int = 1 << 20
    eviction_policy: str = "fifo"  # a name registered in kvstore.runtime.policies
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
        """Check every field; TypeError or ValueError naming the field and its value.

        The names of the I/O engine, the io_uring binding and the eviction policy
        are checked by ``KVStore.open`` (they live in higher layers), before
        anything is created on disk.
        """
        _integer("segment_bytes", self.segment_bytes, low=4 * BLOCK_BYTES, high=MAX_SEGMENT_BYTES)
        if self.segment_bytes % BLOCK_BYTES:
            raise ValueError(
                f"segment_bytes must be a multiple of {BLOCK_BYTES}, got {self.segment_bytes!r}"
            )
        _integer("max_page_bytes", self.max_page_bytes, low=1, high=MAX_PAGE_BYTES_LIMIT)
        if self.max_page_bytes + 2 * BLOCK_BYTES > self.segment_bytes:
            raise ValueError(
                f"max_page_bytes ({self.max_page_bytes}) must fit in a segment "
                f"({self.segment_bytes} bytes) with its header"
            )
        _integer("low_watermark_segments", self.low_watermark_segments, low=1)
        _integer("gc_reserve_segments", self.gc_reserve_segments, low=1)
        _integer("capacity_bytes", self.capacity_bytes, low=1, optional=True)
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
        _number("flush_interval_ms", self.flush_interval_ms, above=0.0)
        _integer("checkpoint_wal_bytes", self.checkpoint_wal_bytes, low=1)
        _number("checkpoint_interval_s", self.checkpoint_interval_s, above=0.0)
        _text("io_engine", self.io_engine)
        _text("uring_binding", self.uring_binding)
        if self.direct_io is not None and not isinstance(self.direct_io, bool):
            raise TypeError(f"direct_io must be True, False or None, got {self.direct_io!r}")
        _integer("io_depth", self.io_depth, low=1, high=MAX_IO_DEPTH)
        _integer("read_poll_us", self.read_poll_us, low=0)
        _integer("pipeline_depth", self.pipeline_depth, low=1, high=MAX_PIPELINE_DEPTH)
        _integer("lsn_lease_step", self.lsn_lease_step, low=1, high=MAX_LSN_LEASE_STEP)
        _text("eviction_policy", self.eviction_policy)
        _number("gc_live_ratio", self.gc_live_ratio, low=0.0, high=1.0)
        _number("gc_interval_s", self.gc_interval_s, low=0.0)
        _number("telemetry_flush_interval_s", self.telemetry_flush_interval_s, above=0.0)
        _integer("telemetry_retention_hours", self.telemetry_retention_hours, low=30 * 24)
        if self.telemetry_clock is not None and not callable(self.telemetry_clock):
            raise TypeError(
                f"telemetry_clock must be a callable or None, got {self.telemetry_clock!r}"
            )
        _integer("drive_capacity_bytes", self.drive_capacity_bytes, low=1, optional=True)
        for name in ("rated_dwpd", "warranty_years", "max_dwpd"):
            _number(name, getattr(self, name), above=0.0, optional=True)
        _number("max_dwpd_burst_s", self.max_dwpd_burst_s, above=0.0)


def _integer(
    name: str, value: object, *, low: int, high: int | None = None, optional: bool = False
) -> None:
    """An int (never a bool or a float, even an integral one) in ``low..high``."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        kind = "an int or None" if optional else "an int"
        raise TypeError(f"{name} must be {kind}, got {value!r} ({type(value).__name__})")
    if value < low or (high is not None and value > high):
        bounds = f"at least {low}" if high is None else f"{low}..{high}"
        raise ValueError(f"{name} must be {bounds}, got {value!r}")


def _number(
    name: str,
    value: object,
    *,
    low: float | None = None,
    above: float | None = None,
    high: float | None = None,
    optional: bool = False,
) -> None:
    """A finite int or float (never a bool, NaN or an infinity) within the bounds."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        kind = "a number or None" if optional else "a number"
        raise TypeError(f"{name} must be {kind}, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if (
        (low is not None and value < low)
        or (above is not None and value <= above)
        or (high is not None and value > high)
    ):
        parts = []
        if low is not None:
            parts.append(f">= {low:g}")
        if above is not None:
            parts.append(f"> {above:g}")
        if high is not None:
            parts.append(f"<= {high:g}")
        raise ValueError(f"{name} must be {' and '.join(parts)}, got {value!r}")


def _text(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {value!r} ({type(value).__name__})")

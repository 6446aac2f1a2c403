"""Persistent telemetry counters: lifetime totals, hourly buckets, latency histograms.

What this module owns:
- the counter vector (``COUNTER_NAMES`` then one latency histogram per operation in
  ``LATENCY_OPS``), in an order fixed by telemetry format version 1 (docs/format.md,
  "Telemetry");
- ``Telemetry``: the in-memory totals the store increments (plain list items, under
  the store's own lock), the hourly history derived from them, and their encoding in
  the LMDB ``telemetry`` database.

Invariants:
- ``values`` only grows; every byte the store writes is counted in exactly one
  write kind (``WRITE_KINDS``) and ``store bytes`` is their sum.
- An hour bucket is the difference of two snapshots of ``values`` taken at most one
  sample interval apart from the hour boundary, so buckets add up to the totals.
- Loading never fails the store: an unreadable or unknown-version state starts the
  counters over and says so in ``notes``.
"""

from __future__ import annotations

import math
import struct
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvstore.format.checksum import checksum

__all__ = [
    "COUNTER_NAMES",
    "GAUGE_NAMES",
    "LATENCY_BOUNDS_S",
    "LATENCY_OPS",
    "TELEMETRY_DB",
    "TELEMETRY_VERSION",
    "VECTOR_LEN",
    "WRITE_KINDS",
    "HourBucket",
    "Telemetry",
    "read_io_wchar",
]

TELEMETRY_VERSION = 1
TELEMETRY_DB = b"telemetry"

# Version 1 order. Never reorder; a change bumps TELEMETRY_VERSION (docs/format.md).
WRITE_KINDS = (
    "host",  # payload bytes of admitted puts: what the callers asked to store
    "record_overhead",  # each put's 4 KiB record header block and zero padding
    "segment_header",  # header blocks of segment files made or recycled
    "gc_copy",  # whole records copied forward by GC or eviction relocation
    "wal",  # WAL records and WAL file headers
    "index",  # LMDB pages written by checkpoints
    "telemetry",  # LMDB pages written persisting these counters
)
COUNTER_NAMES = (
    *(f"{kind}_bytes" for kind in WRITE_KINDS),
    "read_bytes",  # payload bytes returned to callers
    "puts",
    "gets",
    "hits",
    "misses",
    "deletes",
    "evicted_pages",
    "evicted_bytes",
    "declined_puts",  # puts the DWPD budget did not admit
    "declined_bytes",
    "gc_moved_pages",
    "gc_passes",
    "segments_freed",
    "commits",
    "checkpoints",
)
LATENCY_OPS = ("put", "get", "flush", "gc")
LATENCY_BOUNDS_S = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
_BOUNDS_NS = tuple(round(bound * 1e9) for bound in LATENCY_BOUNDS_S)
HISTOGRAM_SLOTS = len(LATENCY_BOUNDS_S) + 2  # buckets (last is +Inf), then sum_ns
VECTOR_LEN = len(COUNTER_NAMES) + len(LATENCY_OPS) * HISTOGRAM_SLOTS

_INDEX = {name: position for position, name in enumerate(COUNTER_NAMES)}
HOST = _INDEX["host_bytes"]
RECORD_OVERHEAD = _INDEX["record_overhead_bytes"]
SEGMENT_HEADER = _INDEX["segment_header_bytes"]
GC_COPY = _INDEX["gc_copy_bytes"]
WAL = _INDEX["wal_bytes"]
INDEX = _INDEX["index_bytes"]
TELEMETRY = _INDEX["telemetry_bytes"]
READ_BYTES = _INDEX["read_bytes"]
PUTS = _INDEX["puts"]
GETS = _INDEX["gets"]
HITS = _INDEX["hits"]
MISSES = _INDEX["misses"]
DELETES = _INDEX["deletes"]
EVICTED_PAGES = _INDEX["evicted_pages"]
EVICTED_BYTES = _INDEX["evicted_bytes"]
DECLINED_PUTS = _INDEX["declined_puts"]
DECLINED_BYTES = _INDEX["declined_bytes"]
GC_MOVED_PAGES = _INDEX["gc_moved_pages"]
GC_PASSES = _INDEX["gc_passes"]
SEGMENTS_FREED = _INDEX["segments_freed"]
COMMITS = _INDEX["commits"]
CHECKPOINTS = _INDEX["checkpoints"]
OP_PUT, OP_GET, OP_FLUSH, OP_GC = range(len(LATENCY_OPS))
_WRITE_SLICE = slice(0, len(WRITE_KINDS))
_LATENCY_BASE = len(COUNTER_NAMES)

_HEAD = struct.Struct("<HHI")  # version, counter count, zero
_STATE_EXTRA = struct.Struct("<QQQ")  # created_unix_ns, saved_unix_ns, current hour
_WEAR = struct.Struct("<HHIQddd")  # version, zero, zero, capacity, rated, warranty, max
_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")

# The writer's gauges at its last save (the "gauges" key: docs/format.md), for readers
# beside it (``kvstore metrics PATH``). Only ever appended to: a reader takes the
# names it knows from the front; NaN = none (a store without a capacity has no
# capacity_bytes or free_bytes).
GAUGE_NAMES = (
    "pages",
    "segments",
    "live_bytes",
    "free_bytes",
    "capacity_bytes",
    "degraded",
    "quarantined_segments",
    "quarantined_pages",
    "salvaged_pages",
    "damaged_wal_headers",
    "index_salvaged",
)
STATE_KEY = b"state"
WEAR_KEY = b"wear"
GAUGES_KEY = b"gauges"
HOUR_PREFIX = b"hour"
SECONDS_PER_HOUR = 3600


def hour_key(hour: int) -> bytes:
    """``hour`` + the hour since the epoch as big-endian u64 (keys sort by time)."""
    return HOUR_PREFIX + hour.to_bytes(8, "big")


def histogram_base(op: int) -> int:
    return _LATENCY_BASE + op * HISTOGRAM_SLOTS


def observe(values: list[int], op: int, nanoseconds: int) -> None:
    """Count one latency sample. Caller holds the lock that guards ``values``."""
    base = _LATENCY_BASE + op * HISTOGRAM_SLOTS
    values[base + bisect_left(_BOUNDS_NS, nanoseconds)] += 1
    values[base + HISTOGRAM_SLOTS - 1] += nanoseconds


def observe_many(values: list[int], op: int, nanoseconds: int, count: int) -> None:
    """Count ``count`` samples of the same latency (pages published together)."""
    base = _LATENCY_BASE + op * HISTOGRAM_SLOTS
    values[base + bisect_left(_BOUNDS_NS, nanoseconds)] += count
    values[base + HISTOGRAM_SLOTS - 1] += nanoseconds * count


def store_bytes(values: list[int]) -> int:
    """Every byte the store wrote: the sum of the write kinds."""
    return sum(values[_WRITE_SLICE])


def read_io_wchar() -> int | None:
    """Bytes this thread passed to write(2)-family calls (``/proc/thread-self/io``).

    Measures what LMDB writes during a commit on the calling thread; None where the
    kernel does not account per-thread I/O.
    """
    try:
        with open("/proc/thread-self/io", "rb") as handle:
            for line in handle:
                if line.startswith(b"wchar:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


@dataclass(frozen=True, slots=True)
class HourBucket:
    """What happened in one clock hour (``hour`` = unix seconds // 3600)."""

    hour: int
    values: tuple[int, ...]

    def get(self, name: str) -> int:
        return self.values[_INDEX[name]]

    @property
    def store_bytes(self) -> int:
        return sum(self.values[_WRITE_SLICE])

    def latency(self, op: str) -> tuple[tuple[int, ...], int]:
        """(bucket counts with +Inf last, sum in ns) of one operation's histogram."""
        base = histogram_base(LATENCY_OPS.index(op))
        return self.values[base : base + HISTOGRAM_SLOTS - 1], self.values[
            base + HISTOGRAM_SLOTS - 1
        ]


@dataclass(frozen=True, slots=True)
class WearSettings:
    """The writer's wear configuration, persisted so read-only tools use the same numbers.

    0 means "not configured" for every field.
    """

    drive_capacity_bytes: int = 0
    rated_dwpd: float = 0.0
    warranty_years: float = 0.0
    max_dwpd: float = 0.0


def _pack_vector(key: bytes, head: bytes, values: Iterable[int]) -> bytes:
    body = head + b"".join(_U64.pack(value) for value in values)
    return body + _U64.pack(checksum(key + body))


def _unpack_checked(key: bytes, raw: bytes) -> bytes:
    if len(raw) < _HEAD.size + 8:
        raise ValueError(f"telemetry {key!r}: {len(raw)} bytes is too short")
    body, stored = raw[:-8], _U64.unpack(raw[-8:])[0]
    if checksum(key + body) != stored:
        raise ValueError(f"telemetry {key!r}: checksum mismatch")
    version, count, _ = _HEAD.unpack_from(body)
    if version != TELEMETRY_VERSION:
        raise ValueError(f"telemetry {key!r}: unknown version {version}")
    if count != VECTOR_LEN:
        raise ValueError(f"telemetry {key!r}: {count} counters, expected {VECTOR_LEN}")
    return body


def encode_state(created_unix_ns: int, saved_unix_ns: int, hour: int, values: list[int]) -> bytes:
    head = _HEAD.pack(TELEMETRY_VERSION, VECTOR_LEN, 0) + _STATE_EXTRA.pack(
        created_unix_ns, saved_unix_ns, hour
    )
    return _pack_vector(STATE_KEY, head, values)


def decode_state(raw: bytes) -> tuple[int, int, int, list[int]]:
    """(created_unix_ns, saved_unix_ns, hour, values); ValueError when unreadable."""
    body = _unpack_checked(STATE_KEY, raw)
    offset = _HEAD.size
    created, saved, hour = _STATE_EXTRA.unpack_from(body, offset)
    offset += _STATE_EXTRA.size
    return created, saved, hour, _values(body, offset)


def encode_hour(hour: int, values: Iterable[int]) -> bytes:
    return _pack_vector(hour_key(hour), _HEAD.pack(TELEMETRY_VERSION, VECTOR_LEN, 0), values)


def decode_hour(hour: int, raw: bytes) -> list[int]:
    return _values(_unpack_checked(hour_key(hour), raw), _HEAD.size)


def _values(body: bytes, offset: int) -> list[int]:
    if len(body) - offset != VECTOR_LEN * 8:
        raise ValueError("telemetry vector has the wrong length")
    return [value for (value,) in _U64.iter_unpack(body[offset:])]


def encode_wear(settings: WearSettings) -> bytes:
    body = _WEAR.pack(
        TELEMETRY_VERSION,
        0,
        0,
        settings.drive_capacity_bytes,
        settings.rated_dwpd,
        settings.warranty_years,
        settings.max_dwpd,
    )
    return body + _U64.pack(checksum(WEAR_KEY + body))


def encode_gauges(gauges: Mapping[str, float]) -> bytes:
    """The "gauges" value: ``GAUGE_NAMES`` in order, f64 each, NaN where absent."""
    body = _HEAD.pack(TELEMETRY_VERSION, len(GAUGE_NAMES), 0) + b"".join(
        _F64.pack(float(gauges.get(name, math.nan))) for name in GAUGE_NAMES
    )
    return body + _U64.pack(checksum(GAUGES_KEY + body))


def decode_gauges(raw: bytes) -> dict[str, float]:
    """The gauges a writer saved (those this version knows); ValueError when unreadable."""
    if len(raw) < _HEAD.size + 8:
        raise ValueError(f"telemetry gauges: {len(raw)} bytes is too short")
    body = raw[:-8]
    if checksum(GAUGES_KEY + body) != _U64.unpack(raw[-8:])[0]:
        raise ValueError("telemetry gauges: checksum mismatch")
    version, count, _ = _HEAD.unpack_from(body)
    if version != TELEMETRY_VERSION:
        raise ValueError(f"telemetry gauges: unknown version {version}")
    if len(body) != _HEAD.size + count * _F64.size:
        raise ValueError(f"telemetry gauges: {len(body)} bytes for {count} gauges")
    values = [value for (value,) in _F64.iter_unpack(body[_HEAD.size :])]
    return {
        name: value
        for name, value in zip(GAUGE_NAMES, values, strict=False)
        if not math.isnan(value)
    }


def decode_wear(raw: bytes) -> WearSettings:
    if len(raw) != _WEAR.size + 8:
        raise ValueError("telemetry wear settings have the wrong length")
    body = raw[:-8]
    if checksum(WEAR_KEY + body) != _U64.unpack(raw[-8:])[0]:
        raise ValueError("telemetry wear settings: checksum mismatch")
    version, _, _, capacity, rated, warranty, max_dwpd = _WEAR.unpack(body)
    if version != TELEMETRY_VERSION:
        raise ValueError(f"telemetry wear settings: unknown version {version}")
    return WearSettings(capacity, rated, warranty, max_dwpd)


class Telemetry:
    """Lifetime counters and their hourly history for one store.

    ``values`` is incremented in place by the store under its own lock (the hot
    path: list item increments, no syscalls). Everything else — sampling into
    hours, encoding, persisting — runs on the telemetry thread, at checkpoints
    and at close, with a copy of ``values`` taken under that lock.
    """

    def __init__(self, clock: Callable[[], float], retention_hours: int) -> None:
        self.clock = clock
        self.retention_hours = retention_hours
        self.values: list[int] = [0] * VECTOR_LEN
        now = clock()
        self.created_unix_ns = int(now * 1e9)
        self.saved_unix_ns = 0
        self.hour = int(now // SECONDS_PER_HOUR)
        self._hour_start: list[int] = [0] * VECTOR_LEN
        self.hours: dict[int, tuple[int, ...]] = {}  # closed hours (and the loaded current)
        self._dirty_hours: set[int] = set()
        self.wear = WearSettings()
        self.gauges: dict[str, float] = {}  # as loaded: the last writer's at its last save
        self.notes: list[str] = []
        self.loaded = False
        # Guards the hour state (hour, _hour_start, hours, _dirty_hours): the telemetry
        # thread saves while callers take snapshots. Never held with the store's lock.
        self._hours_lock = threading.Lock()

    # -- sampling ------------------------------------------------------------

    def sample(self, snapshot: list[int], now: float | None = None) -> None:
        """Close the current hour if the clock has left it. ``snapshot`` is a copy of
        ``values``; what changed since the previous sample counts in the old hour."""
        now = self.clock() if now is None else now
        with self._hours_lock:
            self._sample_locked(snapshot, now)

    def _sample_locked(self, snapshot: list[int], now: float) -> None:
        hour = int(now // SECONDS_PER_HOUR)
        if hour <= self.hour:
            return
        closed = tuple(a - b for a, b in zip(snapshot, self._hour_start, strict=True))
        if any(closed):
            self.hours[self.hour] = closed
            self._dirty_hours.add(self.hour)
        self.hours.pop(hour, None)
        self.hour = hour
        self._hour_start = list(snapshot)

    def current_hour(self, snapshot: list[int]) -> HourBucket:
        return HourBucket(
            self.hour, tuple(a - b for a, b in zip(snapshot, self._hour_start, strict=True))
        )

    def series(self, snapshot: list[int], now: float | None = None) -> list[HourBucket]:
        """Every kept hour, oldest first, the current (partial) hour last; samples
        ``now`` first when given."""
        with self._hours_lock:
            if now is not None:
                self._sample_locked(snapshot, now)
            buckets = [HourBucket(hour, values) for hour, values in sorted(self.hours.items())]
            buckets = [bucket for bucket in buckets if bucket.hour < self.hour]
            buckets.append(self.current_hour(snapshot))
            return buckets

    # -- persistence (LMDB ``telemetry`` database) -----------------------------

    def load(self, env: Any, db: Any) -> None:
        """Read the persisted state. Never raises for bad content: notes say what was lost."""
        self.loaded = True
        with env.begin(write=False, buffers=False) as txn:
            raw_state = txn.get(STATE_KEY, db=db)
            raw_wear = txn.get(WEAR_KEY, db=db)
            raw_gauges = txn.get(GAUGES_KEY, db=db)
            raw_hours = [
                (bytes(key), bytes(value))
                for key, value in txn.cursor(db=db)
                if bytes(key).startswith(HOUR_PREFIX) and len(key) == len(HOUR_PREFIX) + 8
            ]
        if raw_wear is not None:
            try:
                self.wear = decode_wear(bytes(raw_wear))
            except ValueError as e:
                self.notes.append(f"{e}; wear settings ignored")
        if raw_gauges is not None:
            try:
                self.gauges = decode_gauges(bytes(raw_gauges))
            except ValueError as e:
                self.notes.append(f"{e}; gauges ignored")
        hours: dict[int, tuple[int, ...]] = {}
        for key, value in raw_hours:
            hour = int.from_bytes(key[len(HOUR_PREFIX) :], "big")
            try:
                hours[hour] = tuple(decode_hour(hour, value))
            except ValueError as e:
                self.notes.append(f"{e}; that hour is dropped")
        if raw_state is None:
            self.hours = hours
            return
        try:
            created, saved, hour, values = decode_state(bytes(raw_state))
        except ValueError as e:
            self.notes.append(f"{e}; counters start over from zero")
            self.hours = hours
            return
        self.values = values
        self.created_unix_ns = created
        self.saved_unix_ns = saved
        current = hours.pop(hour, None)
        self.hours = hours
        self.hour = hour
        if current is not None and len(current) == VECTOR_LEN:
            self._hour_start = [a - b for a, b in zip(values, current, strict=True)]
        else:
            self._hour_start = list(values)

    def save(
        self,
        write: Callable[[Callable[[Any], None]], None],
        db: Any,
        snapshot: list[int],
        now: float,
        gauges: Mapping[str, float] | None = None,
    ) -> None:
        """One LMDB write transaction through ``write`` (the store's ``IndexEnv.write``,
        which grows the map and is the path the fault injector sees): the totals, the
        current hour, hours closed since the last save, the writer's ``gauges`` when
        given; hours past the retention are deleted."""
        with self._hours_lock:
            self._sample_locked(snapshot, now)
            self.saved_unix_ns = int(now * 1e9)
            current = self.current_hour(snapshot)
            dirty = {hour: self.hours[hour] for hour in self._dirty_hours if hour in self.hours}
            self._dirty_hours.clear()
            cutoff = self.hour - self.retention_hours
            expired = [hour for hour in self.hours if hour < cutoff]
            for hour in expired:
                del self.hours[hour]
            state = encode_state(self.created_unix_ns, self.saved_unix_ns, self.hour, snapshot)
        wear = self.wear

        def body(txn: Any) -> None:
            txn.put(STATE_KEY, state, db=db)
            txn.put(WEAR_KEY, encode_wear(wear), db=db)
            if gauges is not None:
                txn.put(GAUGES_KEY, encode_gauges(gauges), db=db)
            txn.put(hour_key(current.hour), encode_hour(current.hour, current.values), db=db)
            for hour, values in dirty.items():
                txn.put(hour_key(hour), encode_hour(hour, values), db=db)
            for hour in expired:
                txn.delete(hour_key(hour), db=db)

        try:
            write(body)
        except BaseException:
            with self._hours_lock:  # not written: write them next time
                self._dirty_hours.update(dirty)
            raise

    def as_mapping(self, snapshot: list[int]) -> Mapping[str, int]:
        return {name: snapshot[position] for position, name in enumerate(COUNTER_NAMES)}

"""The store's shared state: what ``KVStore`` and its components (the collector, the
checkpointer, fsck's view) read and change under the one state lock.

LevelDB's ``DBImpl`` sorts its fields into "constant after construction", "own
synchronization" and "guarded by mutex_"; this is the third group, kept in one object
so that today's critical sections (reserve + LSN + head bump; publish; lookup + pin;
the segment-free predicate) stay single sections under one lock, and so that a
component gets the state it works on without reaching into the facade.

Lock order (docs/design.md, "Locks"): {checkpoint lock | GC lock} -> commit lock ->
``lock``. ``lock`` is always innermost: no file I/O and no other lock is taken while
it is held, but for the few places docs/design.md lists.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from kvstore.format.entries import PageEntry
from kvstore.index.table import PageTable, SegmentState
from kvstore.log.journal import JournalState
from kvstore.log.segments import Segment
from kvstore.runtime.policies import EvictionPolicy

__all__ = ["StoreState"]


class StoreState(JournalState):
    """Everything here is guarded by ``lock`` (``cond`` waits on it), except where a
    field says otherwise. The journal's fields (the open segments, the pending WAL
    records, the LSNs, the failure) come from ``log.journal.JournalState``."""

    __slots__ = (  # noqa: RUF023 (grouped by owner, not sorted)
        # the index
        "table",
        "checkpoint_lsn",
        # the segment set (VersionSet's role)
        "segment_states",
        "active",
        "spare",
        "preparing",
        "spare_wanted",
        "next_segment_id",
        "capacity_bytes",
        "capacity_segments",
        "gc_reserve_segments",
        "dropped_segments",
        "gone_segments",
        "segment_readers",
        "segment_writers",
        # protection
        "pins",
        "segment_pins",
        "retains",
        # the writer barrier
        "inflight",
        "freezing",
        # eviction and counting
        "policy",
        "evictions",
        "tv",
        "stale_reads",
    )

    def __init__(
        self,
        *,
        lock: threading.Lock,
        table: PageTable,
        segment_states: dict[int, SegmentState],
        next_segment_id: int,
        checkpoint_lsn: int,
        lsn_lease: int,
        retains: set[bytes],
        dropped_segments: list[int],
        capacity_bytes: int | None,
        segment_bytes: int,
        gc_reserve_segments: int,
        policy: EvictionPolicy,
        tv: list[int],
    ) -> None:
        super().__init__(lock, lsn_lease)
        self.table = table
        self.checkpoint_lsn = checkpoint_lsn
        self.segment_states = segment_states
        self.active: Segment | None = None
        self.spare: Segment | None = None  # made ahead by the prepare thread
        self.preparing = False
        self.spare_wanted = threading.Event()  # own synchronization
        self.next_segment_id = next_segment_id
        # Constant after open.
        self.capacity_bytes = capacity_bytes
        self.capacity_segments = capacity_bytes // segment_bytes if capacity_bytes else None
        self.gc_reserve_segments = gc_reserve_segments
        self.dropped_segments = dropped_segments  # freed since the last checkpoint
        # Read-only: segments of this view the live writer freed before they could
        # be opened. Their pages are misses (docs/operations.md, "Readers").
        self.gone_segments: set[int] = set()
        self.segment_readers: Counter[int] = Counter()
        self.segment_writers: Counter[int] = Counter()  # reserved, not yet published
        self.pins: dict[bytes, list[PageEntry]] = {}
        self.segment_pins: Counter[int] = Counter()
        self.retains = retains
        self.inflight = 0  # writes reserved and not yet finished
        self.freezing = 0  # writer barriers held (checkpoint, mark-and-sweep, fsck)
        self.policy = policy
        self.evictions: Counter[str] = Counter()
        self.tv = tv  # the telemetry recorder's counter vector
        # A read-only view's reads of records the writer freed since the view (misses).
        self.stale_reads = 0

    # -- small steps every component takes under the lock ---------------------

    def spare_allowed_locked(self) -> bool:
        """A spare segment may exist (it counts against capacity)."""
        if self.capacity_segments is None:
            return True
        return len(self.segments) + 1 < self.capacity_segments

    def may_roll_locked(self, for_gc: bool) -> bool:
        """Whether a new segment fits the capacity (GC may use the reserve)."""
        if self.capacity_segments is None:
            return True
        limit = self.capacity_segments
        if not for_gc:
            limit -= self.gc_reserve_segments
        return len(self.segments) < limit

    def finish_inflight_locked(self, segment_id: int) -> None:
        """A reserved write into ``segment_id`` is done (or abandoned)."""
        self.segment_writers[segment_id] -= 1
        if not self.segment_writers[segment_id]:
            del self.segment_writers[segment_id]
        self.inflight -= 1
        if self.inflight == 0 and self.freezing:
            self.cond.notify_all()

    def release_reader_locked(self, segment_id: int) -> None:
        """A read of ``segment_id`` (counted in ``segment_readers``) is done."""
        self.segment_readers[segment_id] -= 1
        if not self.segment_readers[segment_id]:
            del self.segment_readers[segment_id]

    def count_stale_read(self) -> None:
        """A read-only view read a record the live writer freed since the view. Takes the lock."""
        with self.lock:
            self.stale_reads += 1

    @contextmanager
    def writers_frozen(self) -> Iterator[None]:
        """The writer barrier, the one copy: no reservation is in flight inside, and
        none starts until the block ends (writers wait in the store's reserve step).
        Checkpoint, mark-and-sweep and fsck's repairs hold it; a writer holding
        reservations must drain them before it waits here, or the freeze would wait
        for it. Takes the lock: the caller must not hold it."""
        with self.cond:
            self.freezing += 1
            while self.inflight:
                self.cond.wait()
        try:
            yield
        finally:
            with self.cond:
                self.freezing -= 1
                self.cond.notify_all()

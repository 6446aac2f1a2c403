"""What fsck and the test harnesses may see of a store's internals (``KVStore.internals``).

A typed view over the store's shared state and components, built by
``lifecycle.internals_of`` (nothing here reaches into ``KVStore`` itself,
tests/unit/test_layering.py). Not a stable API.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from kvstore.format.entries import PageEntry
from kvstore.index.lmdb_env import IndexEnv
from kvstore.index.table import SegmentState, Tombstone
from kvstore.io.buffers import BufferPool
from kvstore.io.engine import IOEngine
from kvstore.log.journal import Journal
from kvstore.log.segment_reader import SegmentReader
from kvstore.log.segments import Segment
from kvstore.runtime.gc import Collector
from kvstore.runtime.report import Degraded
from kvstore.runtime.rolling import SegmentSet
from kvstore.runtime.state import StoreState
from kvstore.runtime.writer import SegmentWriter

__all__ = ["StoreInternals"]


class StoreInternals:
    """What fsck and kvstore.testing may see of a ``KVStore``'s internals, typed, each
    read under the store's lock (``KVStore.internals``). It grows as the private
    accesses it replaces go (tests/unit/test_layering.py counts those)."""

    def __init__(
        self,
        *,
        state: StoreState,
        env: IndexEnv,
        engine: IOEngine,
        buffers: BufferPool,
        reader: SegmentReader,
        writer: SegmentWriter,
        journal: Journal,
        segment_set: SegmentSet,
        collector: Collector,
        checkpoint_lock: threading.Lock,
        degraded: Degraded,
        flusher: threading.Thread | None,
        readonly: bool,
        closed: bool,
        writer_lock_held: bool,
        check_open: Callable[[], None],
        view_moved: Callable[[], bool],
        abandon: Callable[[], None],
    ) -> None:
        self.state = state  # the shared state: read or change it under state.lock
        self.env = env  # the store's LMDB environment (write through IndexEnv.write only)
        self.engine = engine
        self.buffers = buffers
        self.reader = reader
        self.writer = writer
        self.journal = journal
        self.segment_set = segment_set
        self.collector = collector
        self.checkpoint_lock = checkpoint_lock  # held by fsck's WAL check: no checkpoint meanwhile
        self.degraded = degraded  # what the open could not vouch for
        self.flusher = flusher  # the group-commit thread (None: read-only)
        self._readonly = readonly
        self.closed = closed
        self.writer_lock_held = writer_lock_held  # the LOCK file's flock (writers only)
        self.check_open = check_open  # raises ClosedError after close
        self._view_moved = view_moved
        self._abandon = abandon

    def abandon(self) -> None:
        """Leave the store as a crash would: stop its threads (each finishes what it
        is doing; none is left to make a spare segment after the next open), then
        release every file and lock without a checkpoint or a commit (the WAL keeps
        what was committed). The store counts as closed afterwards."""
        self._abandon()

    @contextlib.contextmanager
    def writers_frozen(self) -> Iterator[None]:
        """GC and new writes held still (as ``gc(full=True)`` holds them), on a
        writable store; nothing to hold on a read-only one."""
        if self._readonly:
            yield
            return
        with self.collector.lock, self.state.writers_frozen():
            yield

    def recycled_since_view(self, entry: PageEntry) -> bool:
        """Read-only: whether ``entry``'s segment file has been reused by the writer."""
        return self.reader.recycled_since_view(entry)

    def view_moved(self) -> bool:
        """Read-only: whether the writer has checkpointed since this view was taken."""
        return self._view_moved()

    def overlay(self) -> dict[bytes, PageEntry | Tombstone]:
        """The page-table changes not yet checkpointed (frozen ones included), a copy."""
        state = self.state
        table = state.table
        with state.lock:
            merged: dict[bytes, PageEntry | Tombstone] = dict(table.frozen or {})
            merged.update(table.active)
        return merged

    def entry(self, key: bytes) -> PageEntry | None:
        """The page table's live entry for ``key`` (overlay, then LMDB)."""
        return self.state.table.get(key)

    def forget_index_value(self, key: bytes) -> None:
        """fsck removed ``key``'s undecodable LMDB value: count the page gone."""
        state = self.state
        with state.lock:
            state.table.page_count -= 1
            state.retains.discard(key)

    def segments(self) -> list[tuple[int, Segment, SegmentState | None]]:
        """The open segment files with their accounting (None: not in the table)."""
        state = self.state
        with state.lock:
            return [
                (segment_id, segment, state.segment_states.get(segment_id))
                for segment_id, segment in state.segments.items()
            ]

    def hold_segment(self, segment_id: int, segment: Segment) -> bool:
        """Register a read of ``segment`` if it is still the store's, as a get does:
        GC may not close or reuse its file meanwhile. Pair with ``release_segment``."""
        state = self.state
        with state.lock:
            if state.segments.get(segment_id) is not segment:
                return False
            state.segment_readers[segment_id] += 1
        return True

    def segment_reads(self) -> dict[int, int]:
        """Reads registered per segment right now (none left after every call ends)."""
        state = self.state
        with state.lock:
            return {sid: n for sid, n in state.segment_readers.items() if n}

    def gone_segments(self) -> frozenset[int]:
        """A read-only view: segments the live writer freed since the view was taken."""
        return frozenset(self.state.gone_segments)

    def release_segment(self, segment_id: int) -> None:
        state = self.state
        with state.lock:
            state.release_reader_locked(segment_id)

    def spare_segment(self) -> tuple[int, Path] | None:
        """The segment the prepare thread made ahead (id, file), or None."""
        state = self.state
        with state.cond:
            spare = state.spare
            return None if spare is None else (spare.segment_id, spare.path)

    def wait_for_spare(self, timeout_s: float) -> tuple[int, Path] | None:
        """Wait until a spare segment is ready and none is being made; None at the
        timeout. A test that wants the next segment to be a spare waits here."""
        state = self.state
        deadline = time.monotonic() + timeout_s
        with state.cond:
            while state.spare is None or state.preparing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                state.cond.wait(min(left, 0.05))
            return state.spare.segment_id, state.spare.path

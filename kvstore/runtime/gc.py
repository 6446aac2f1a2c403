"""The collector: GC, compaction, eviction and mark-and-sweep (docs/design.md, "GC").

It frees sealed segments with no live page (SEGMENT_FREE committed before the file
is unlinked or reused as the spare), copies the live pages of sparse segments
forward (a MOVE applies only where the page still is), evicts by the store's policy
down to the low watermark (a DELETE at the evicted version's own LSN), and with a
full pass recomputes live bytes per segment from the page table.

Locks: ``lock`` (the GC lock) -> the journal's commit lock -> the state lock, as
everywhere (docs/design.md, "Locks"). A writer that finds no room calls
``make_room`` from its own thread, holding no lock.

What the collector needs from the rest of the store comes in at construction: the
shared ``StoreState``, the ``Journal`` (a SEGMENT_FREE is committed before the file
goes), the ``SegmentWriter`` (its ``reserve``: room in the active segment for a
moved page), ``wait_writable`` (the store's check, under the state lock), and the
``SegmentSet`` (a freed file becomes the spare).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvstore.config import StoreConfig
from kvstore.errors import (
    ClosedError,
    CorruptionError,
    KVStoreError,
    StoreFullError,
    WriterFailedError,
)
from kvstore.format.constants import BLOCK_BYTES, RECORD_PAGE
from kvstore.format.entries import SEGMENT_SEALED, PageEntry
from kvstore.format.records import RecordHeader, encode_record_header_into
from kvstore.format.wal import MoveBody, PutBody, encode_delete, encode_move, encode_segment_free
from kvstore.index.recovery import apply_delete, apply_move
from kvstore.io.buffers import BufferPool
from kvstore.io.engine import IOEngine, run_all
from kvstore.log.journal import Journal, sync_segment
from kvstore.log.segment_reader import SegmentReader, verify_record
from kvstore.log.segments import Segment, recycle_segment
from kvstore.runtime.policies import SegmentView
from kvstore.runtime.rolling import SegmentSet
from kvstore.runtime.state import StoreState
from kvstore.runtime.tally import GCTally
from kvstore.runtime.writer import SegmentWriter
from kvstore.telemetry import counters as tc

__all__ = ["Collector"]


class Collector:
    def __init__(
        self,
        state: StoreState,
        config: StoreConfig,
        *,
        root: Path,
        store_uuid: bytes,
        engine: IOEngine,
        buffers: BufferPool,
        reader: SegmentReader,
        journal: Journal,
        writer: SegmentWriter,
        wait_writable: Callable[[], None],
        segment_set: SegmentSet,
    ) -> None:
        self._state = state
        self._config = config
        self._root = root
        self._store_uuid = store_uuid
        self._engine = engine
        self._buffers = buffers
        self._reader = reader
        self._journal = journal
        self._writer = writer
        self._wait_writable_locked = wait_writable
        self._segment_set = segment_set
        self.lock = threading.Lock()  # the GC lock: one pass at a time
        self.last_pass = time.monotonic()

    def close(self) -> None:
        """Drop the store's callbacks (they refer back to the store: a closed store is
        then freed at once, its buffers with it, not at the next cyclic collection)."""

        def closed(*_: object) -> Any:
            raise ClosedError("the store is closed")

        self._wait_writable_locked = closed

    def run_pass(self, tally: GCTally, *, full: bool = False, background: bool = False) -> None:
        """One pass: (with ``full``, mark-and-sweep,) free empty segments, compact
        sparse ones, evict down to the low watermark when the store has a capacity.

        A ``background`` pass (the GC thread's) that found nothing to do is not
        counted: counting it would change the telemetry every second and make an idle
        writer save its counters every second (``gc_passes`` would be a clock)."""
        started_ns = time.perf_counter_ns()
        with self.lock:
            if full:
                self.mark_and_sweep(tally)
            self._free_empty_segments(tally)
            self._compact_sparse(tally)
            if self._state.capacity_segments is not None:
                self._evict_until_watermark(tally)
        self.last_pass = time.monotonic()
        if background and not tally.did_work():
            return
        self.count_pass(started_ns)

    def count_pass(self, started_ns: int) -> None:
        elapsed_ns = time.perf_counter_ns() - started_ns
        with self._state.lock:
            self._state.tv[tc.GC_PASSES] += 1
            tc.observe(self._state.tv, tc.OP_GC, elapsed_ns)

    def _free_segment_count(self) -> int:
        assert self._state.capacity_segments is not None
        return self._state.capacity_segments - len(self._state.segments)

    def make_room(self) -> None:
        """Called by a writer that found no room: evict until the watermark is met."""
        with self.lock:
            with self._state.lock:
                if self._state.may_roll_locked(False):
                    return
            tally = GCTally()
            self._free_empty_segments(tally)
            self._evict_until_watermark(tally)

    def _sealed_ids(self) -> list[int]:
        with self._state.lock:
            active = self._state.active.segment_id if self._state.active is not None else None
            return [
                segment_id
                for segment_id, state in self._state.segment_states.items()
                if segment_id != active and state.state == SEGMENT_SEALED
            ]

    def _free_empty_segments(self, tally: GCTally) -> None:
        for segment_id in self._sealed_ids():
            with self._state.lock:
                state = self._state.segment_states.get(segment_id)
                empty = state is not None and state.live_pages == 0
            if empty:
                self._free_segment(segment_id, tally)

    def _free_segment(self, segment_id: int, tally: GCTally) -> bool:
        """Free a sealed segment with no live, pinned or in-read page: WAL first, then unlink.

        Runs under the commit lock: PUT records naming this segment may still be
        pending, and the commit that makes them durable must fdatasync the
        segment first (it is no longer in ``_segments`` once popped).
        """
        with self._journal.commit_lock:
            segment = self._free_segment_locked(segment_id)
        if segment is None:
            return False
        if not self._recycle(segment):
            segment.close()
            try:
                segment.path.unlink(missing_ok=True)
            except OSError:
                pass  # its SEGMENT_FREE is durable: the next open removes the orphan file
        with self._state.lock:
            self._state.tv[tc.SEGMENTS_FREED] += 1
        tally.segments_freed += 1
        return True

    def _free_segment_locked(self, segment_id: int) -> Segment | None:
        """Drop the segment from the index and commit that; None if it may not go yet."""
        st = self._state
        with st.lock:
            state = st.segment_states.get(segment_id)
            if (
                state is None
                or state.live_pages != 0
                or st.segment_pins.get(segment_id)
                or st.segment_readers.get(segment_id)
                or st.segment_writers.get(segment_id)
                or (st.active is not None and st.active.segment_id == segment_id)
            ):
                return None
            segment = st.segments.pop(segment_id)
            del st.segment_states[segment_id]
            st.dropped_segments.append(segment_id)
            st.pending.append(
                encode_segment_free(st.take_lsn_locked(), segment_id, state.generation)
            )
        try:
            if segment.dirty:  # its records may be in this very commit
                sync_segment(self._state, segment)
            # not flush(): close() may have begun, and the free must still land
            self._journal.commit_locked()  # durable before the file goes or is reused
        except BaseException:
            segment.close()
            raise
        return segment

    def _recycle(self, segment: Segment) -> bool:
        """Turn a freed segment's file into the spare (written extents are cheaper)."""
        with self._state.cond:
            claimed = self._segment_set.claim_spare_locked()
        if claimed is None:
            return False
        segment_id, generation = claimed
        spare: Segment | None = None
        try:
            spare = recycle_segment(
                self._root, segment, segment_id, generation, store_uuid=self._store_uuid
            )
        except KVStoreError:
            return False
        finally:
            with self._state.cond:
                self._state.spare = spare
                self._state.preparing = False
                if spare is not None:
                    self._state.tv[tc.SEGMENT_HEADER] += BLOCK_BYTES
                self._state.cond.notify_all()
        return True

    def _compact_sparse(self, tally: GCTally) -> None:
        if self._state.capacity_segments is not None and not self._state.policy.page_granular:
            # Segment-granular eviction reclaims the oldest segments whole; copying
            # sparse ones forward first would only add write amplification.
            return
        threshold = self._config.gc_live_ratio * self._config.segment_bytes
        with self._state.lock:
            sparse = sorted(
                (state.live_bytes, segment_id)
                for segment_id, state in self._state.segment_states.items()
                if state.state == SEGMENT_SEALED
                and (self._state.active is None or segment_id != self._state.active.segment_id)
                and state.live_bytes < threshold
                and not self._state.segment_pins.get(segment_id)
            )
        for live_bytes, segment_id in sparse:
            if not self._room_for_gc(live_bytes):
                return  # no room to copy into; eviction must run first
            if self._empty_segment(segment_id, tally, evict=lambda key: False):
                self._free_segment(segment_id, tally)

    def _room_for_gc(self, live_bytes: int) -> bool:
        """Whether ``live_bytes`` of relocated pages fit without exceeding capacity."""
        with self._state.lock:
            room = self._state.active.remaining() if self._state.active is not None else 0
            if self._state.may_roll_locked(True):
                room += self._config.segment_bytes
            return live_bytes + BLOCK_BYTES <= room

    def _evict_until_watermark(self, tally: GCTally) -> None:
        watermark = self._config.low_watermark_segments + self._config.gc_reserve_segments
        stalled = 0
        while True:
            with self._state.lock:
                free_before = self._free_segment_count()
                if free_before >= watermark:
                    return
                patience = len(self._state.segments) + 1
            if self._state.policy.page_granular:
                self._evict_pages(tally)
            else:
                self._evict_one_segment(tally)
            with self._state.lock:
                progressed = self._free_segment_count() > free_before
            # A pass can free a segment yet fill another with relocated pages
            # (retained, or hot pages on their second chance). Give up only after
            # a whole round of passes made no net room.
            stalled = 0 if progressed else stalled + 1
            if stalled >= patience:
                return

    def _segment_views(self) -> list[SegmentView]:
        sealed = set(self._sealed_ids())
        with self._state.lock:
            return [
                SegmentView(
                    segment_id,
                    state.live_bytes,
                    state.live_pages,
                    state.created_unix_ns,
                    bool(self._state.segment_pins.get(segment_id)),
                )
                for segment_id, state in self._state.segment_states.items()
                if segment_id in sealed
            ]

    def _evict_one_segment(self, tally: GCTally) -> None:
        tried: set[int] = set()
        while True:
            views = [view for view in self._segment_views() if view.segment_id not in tried]
            with self._state.lock:  # policy calls are serialised by the store lock (but victims)
                victim = self._state.policy.choose_segment(views)
            if victim is None:
                return
            tried.add(victim)

            def evict(key: bytes) -> bool:
                # A pinned key's current version may live here while the pin holds an
                # older one elsewhere: relocate it too, so a pinned reader never misses.
                with self._state.lock:  # keep() updates the state on_read() updates
                    if key in self._state.retains or key in self._state.pins:
                        return False
                    return not self._state.policy.keep(key)

            if self._empty_segment(victim, tally, evict=evict) and self._free_segment(
                victim, tally
            ):
                return

    def _evict_pages(self, tally: GCTally) -> None:
        with self._state.lock:
            protected = set(self._state.pins) | self._state.retains
        candidates = [key for key in self._state.table.keys() if key not in protected]  # noqa: SIM118
        freed_before = tally.segments_freed
        per_segment = max(1, len(candidates) // max(1, len(self._state.segments)))
        for key in self._state.policy.victims(candidates, per_segment):
            entry = self._state.table.get(key)
            if entry is not None:
                self._evict_entry(key, entry, tally)
        self._free_empty_segments(tally)
        if tally.segments_freed > freed_before:
            return
        # Evictions left holes: compact the sparsest sealed segment.
        views = sorted(self._segment_views(), key=lambda view: view.live_bytes)
        for view in views:
            if view.has_pins or not self._room_for_gc(view.live_bytes):
                continue
            if self._empty_segment(view.segment_id, tally, evict=lambda key: False):
                self._free_segment(view.segment_id, tally)
                return

    def _evict_entry(self, key: bytes, entry: PageEntry, tally: GCTally) -> bool:
        """Evict a page if it is still ``entry`` and unprotected; logged like a delete.

        The DELETE carries the evicted version's own LSN, not a new one: a put of
        the same key that was already in flight (an older reservation, so a lower
        LSN than a fresh one) is newer than what was evicted and must win.
        """
        st = self._state
        with st.cond:
            self._wait_writable_locked()
            if st.table.get(key) != entry or key in st.pins or key in st.retains:
                return False
            apply_delete(st.table, st.segment_states, key, entry.lsn)
            st.pending.append(encode_delete(entry.lsn, key))
            st.policy.on_delete(key)
            st.evictions[st.policy.name] += 1
            st.tv[tc.EVICTED_PAGES] += 1
            st.tv[tc.EVICTED_BYTES] += entry.payload_bytes
        tally.pages_evicted += 1
        tally.bytes_evicted += entry.payload_bytes
        return True

    def _scan_segment(self, segment_id: int) -> Iterator[tuple[int, RecordHeader, memoryview]]:
        """Every well-formed record of a sealed segment, held for the scan's length."""
        with self._state.lock:
            segment = self._state.segments.get(segment_id)
            state = self._state.segment_states.get(segment_id)
            if segment is None or state is None:
                return
            self._state.segment_readers[segment_id] += 1
            end = state.head_bytes
        try:
            yield from self._reader.scan(segment, end)
        finally:
            with self._state.lock:
                self._state.release_reader_locked(segment_id)

    def _empty_segment(
        self, segment_id: int, tally: GCTally, *, evict: Callable[[bytes], bool]
    ) -> bool:
        """Move (or evict, where ``evict(key)``) every live page out of a segment.

        Returns False if a page could not leave (pinned, or corrupt).
        """
        tally.segments_scanned += 1
        complete = True
        for offset, header, record in self._scan_segment(segment_id):
            entry = self._state.table.get(header.key)
            if (
                entry is None
                or entry.segment_id != segment_id
                or entry.offset != offset
                or entry.lsn != header.lsn
            ):
                continue  # dead: overwritten, deleted or evicted
            with self._state.lock:
                if self._state.segment_pins.get(segment_id):
                    return False
            if evict(header.key):
                if not self._evict_entry(header.key, entry, tally):
                    complete = complete and self._state.table.get(header.key) != entry
                continue
            try:
                verify_record(
                    header.key,
                    entry,
                    record,
                    entry.span_bytes,
                    max_page_bytes=self._config.max_page_bytes,
                )
            except CorruptionError:
                complete = False  # leave it for fsck; never copy bad bytes forward
                continue
            try:
                self._move(header.key, entry, record, tally)
            except StoreFullError:
                return False  # out of GC room; what moved so far stays valid
        return complete

    def _move(self, key: bytes, entry: PageEntry, record: memoryview, tally: GCTally) -> None:
        """Copy a verified record to the active segment; publish only if unchanged."""
        st = self._state
        span = entry.span_bytes
        segment, offset, _ = self._writer.reserve(span, for_gc=True)
        try:
            buffer = self._buffers.acquire(span)
        except BaseException:
            with st.lock:
                st.finish_inflight_locked(segment.segment_id)
            raise
        try:
            buffer.view[:span] = record
            encode_record_header_into(
                buffer.view,
                RecordHeader(
                    RECORD_PAGE,
                    key,
                    entry.meta,
                    entry.payload_bytes,
                    entry.lsn,
                    segment.segment_id,
                    offset,
                    segment.generation,
                    entry.payload_checksum,
                ),
            )
            result = run_all(
                self._engine.queue("gc"), [("w", segment.fd, offset, buffer.view[:span])]
            )
        except BaseException:
            with st.lock:
                st.finish_inflight_locked(segment.segment_id)
            raise
        finally:
            self._buffers.release(buffer)
        moved = dataclasses.replace(
            entry, segment_id=segment.segment_id, offset=offset, generation=segment.generation
        )
        with st.lock:
            st.finish_inflight_locked(segment.segment_id)
            if result[0] != span:
                error = WriterFailedError(f"GC write to segment {segment.segment_id} failed")
                if st.failed is None:
                    st.failed = error
                raise error
            segment.dirty = True
            st.tv[tc.GC_COPY] += span
            if st.table.get(key) != entry:
                return  # overwritten or deleted meanwhile: the copy is garbage
            old = (entry.segment_id, entry.generation, entry.offset)
            apply_move(
                st.table,
                st.segment_states,
                key,
                moved,
                old,
                checkpoint_lsn=st.checkpoint_lsn,
            )
            st.pending.append(
                encode_move(
                    entry.lsn,
                    MoveBody(
                        PutBody(
                            key,
                            moved.segment_id,
                            moved.generation,
                            moved.offset,
                            moved.payload_bytes,
                            moved.payload_checksum,
                            moved.meta,
                        ),
                        entry.segment_id,
                        entry.generation,
                        entry.offset,
                    ),
                )
            )
            st.tv[tc.GC_MOVED_PAGES] += 1
        tally.pages_moved += 1
        tally.bytes_moved += span

    def mark_and_sweep(self, tally: GCTally) -> None:
        """Recompute live bytes per segment from the page table; fix and count drift."""
        with self._state.writers_frozen():  # writers held still: the sweep sees one state
            live: Counter[int] = Counter()
            pages: Counter[int] = Counter()
            for _, entry in self._state.table.items():
                live[entry.segment_id] += entry.span_bytes
                pages[entry.segment_id] += 1
            with self._state.lock:
                for segment_id, state in self._state.segment_states.items():
                    if (
                        state.live_bytes != live[segment_id]
                        or state.live_pages != pages[segment_id]
                    ):
                        tally.drift_segments += 1
                        tally.drift_bytes += abs(state.live_bytes - live[segment_id])
                        state.live_bytes = live[segment_id]
                        state.live_pages = pages[segment_id]

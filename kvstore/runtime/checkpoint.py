"""The checkpointer: writes the page table's overlay to LMDB and drops the WAL files
it covers (docs/design.md, "Checkpoint").

The order, which recovery relies on: quiesce the writers (the barrier) and commit
what is pending; freeze the overlay, take the checkpoint's LSN and rotate the WAL
to a file starting there; thaw the writers; commit the frozen overlay, the segment
accounting, the freed segments and the retains to LMDB in one transaction; then
delete the WAL files below the new checkpoint. A failed rotation stops the writer;
a failed LMDB commit thaws the overlay back (the WAL still holds every change).
Afterwards the telemetry counters are saved (the only other LMDB writer).

Locks: ``lock`` (the checkpoint lock) -> the journal's commit lock -> the state lock.
The checkpointer lives with the shared state in runtime/ (not index/, where a first
sketch put it; docs/design.md, "Layers"): it works on the segment accounting and the
counters as much as on the index.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

from kvstore.errors import KVStoreError, WriterFailedError
from kvstore.format.wal import WAL_FILE_HEADER_BYTES
from kvstore.index.table import (
    META_CHECKPOINT_LSN,
    META_LSN_LEASE,
    META_NEXT_SEGMENT,
    META_PAGE_COUNT,
    SegmentState,
)
from kvstore.log.journal import Journal
from kvstore.log.wal import list_wal_files
from kvstore.runtime.state import StoreState
from kvstore.telemetry import counters as tc
from kvstore.telemetry.recorder import Recorder

__all__ = ["Checkpointer"]


class Checkpointer:
    def __init__(self, state: StoreState, journal: Journal, recorder: Recorder, root: Path) -> None:
        self._state = state
        self._journal = journal
        self._recorder = recorder
        self._root = root
        self.lock = threading.Lock()  # the checkpoint lock: one LMDB writer at a time
        self.last_run = time.monotonic()
        self._last_written: tuple[object, ...] | None = None  # what the last run wrote

    def _written_locked(
        self, segments: dict[int, SegmentState], meta: dict[Any, int], retains: set[bytes]
    ) -> tuple[object, ...]:
        """What a checkpoint writes besides the overlay and the dropped segments
        (the checkpoint LSN aside). Caller holds the state lock."""
        return (segments, {k: v for k, v in meta.items() if k != META_CHECKPOINT_LSN}, retains)

    def idle(self) -> bool:
        """Whether a checkpoint now would change nothing: no WAL record since the last
        one, an empty overlay, no dropped segment, the same segment states and meta.
        The flush thread's timed checkpoint is skipped then (an idle writer writes
        nothing), and the timer restarts. Conservative: False until a first run."""
        st = self._state
        wal = self._journal.wal
        if wal is None or self._last_written is None or wal.size_bytes > WAL_FILE_HEADER_BYTES:
            return False
        with st.lock:
            if st.table.active or st.table.frozen is not None or st.dropped_segments:
                return False
            written = self._written_locked(
                dict(st.segment_states),
                {
                    META_LSN_LEASE: max(st.lease_until, st.next_lsn),
                    META_PAGE_COUNT: st.table.page_count,
                    META_NEXT_SEGMENT: st.next_segment_id,
                },
                set(st.retains),
            )
        if written != self._last_written:
            return False
        self.last_run = time.monotonic()
        return True

    def run(self) -> None:
        """One checkpoint (the steps above). A failed WAL rotation stops the writer; a
        failed LMDB commit puts the overlay back and raises (the next one retries)."""
        st = self._state
        wal = self._journal.wal
        assert wal is not None, "a read-only store does not checkpoint"
        with self.lock:
            with self._journal.commit_lock, st.writers_frozen():
                self._journal.commit_locked()
                with st.lock:
                    frozen = st.table.freeze()
                    segments = {
                        segment_id: dataclasses.replace(state)
                        for segment_id, state in st.segment_states.items()
                    }
                    first_lsn = st.take_lsn_locked()
                    meta = {
                        META_CHECKPOINT_LSN: first_lsn,
                        META_LSN_LEASE: max(st.lease_until, st.next_lsn),
                        META_PAGE_COUNT: st.table.page_count,
                        META_NEXT_SEGMENT: st.next_segment_id,
                    }
                    dropped, st.dropped_segments = st.dropped_segments, []
                    retains = set(st.retains)
                    written = self._written_locked(
                        {k: dataclasses.replace(v) for k, v in segments.items()},
                        dict(meta),
                        set(retains),
                    )
                try:
                    wal.rotate(first_lsn)
                except KVStoreError as e:
                    with st.lock:
                        st.table.thaw(frozen)
                    raise st.fail(WriterFailedError(f"WAL rotation failed: {e}")) from e
                with st.lock:
                    st.tv[tc.WAL] += WAL_FILE_HEADER_BYTES
            wchar_before = tc.read_io_wchar()
            try:
                st.table.commit_frozen(frozen, segments, dropped, meta, retains)
            except BaseException:
                # LMDB keeps the previous checkpoint and the WAL still holds every
                # change (old files are deleted only after a commit): put the
                # overlay back so lookups, and the next checkpoint, still see it.
                with st.lock:
                    st.table.thaw(frozen)
                    st.dropped_segments = dropped + st.dropped_segments
                raise
            st.checkpoint_lsn = first_lsn
            for wal_first, path in list_wal_files(self._root):
                if wal_first < first_lsn:
                    try:
                        path.unlink(missing_ok=True)
                    except OSError:
                        break  # the checkpoint is durable; the next one (or open) retries
            self.last_run = time.monotonic()
            self._last_written = written
            wchar_after = tc.read_io_wchar()
            with st.lock:
                st.tv[tc.CHECKPOINTS] += 1
                if wchar_before is not None and wchar_after is not None:
                    st.tv[tc.INDEX] += wchar_after - wchar_before
            self._recorder.persist()

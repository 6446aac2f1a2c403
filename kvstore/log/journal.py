"""The journal: group commit of the store's WAL records and the LSN lease.

Writers publish a page (or a delete, move, retain, segment open or free) by
appending its WAL record to ``JournalState.pending`` under the state lock. A group
commit (``Journal.commit``: flush, sync puts, the flusher thread) swaps the list out,
fdatasyncs every segment written since the last commit, appends the records to the
WAL and fdatasyncs it, then advances ``durable_lsn``. LSNs below the durable lease
(an LSN_LEASE record) are never reissued, so a record a crash left in a segment
never shares an LSN with a later page. A failed write or fsync stops the writer for
good (``failed``); reopening replays the WAL.

Locks: the commit lock -> the state lock (``JournalState.lock``, innermost).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from kvstore.errors import ClosedError, WriterFailedError
from kvstore.format.wal import encode_lsn_lease
from kvstore.log.segments import Segment
from kvstore.log.wal import WalWriter

__all__ = ["Journal", "JournalState"]


class JournalState:
    """The journal's part of the store's shared state, guarded by ``lock`` (the
    store's one state lock; ``cond`` waits on it). ``runtime.state.StoreState`` extends
    it with the rest."""

    __slots__ = (  # noqa: RUF023 (grouped, not sorted)
        "lock",
        "cond",
        "segments",
        "pending",
        "next_lsn",
        "lease_until",
        "durable_lsn",
        "failed",
    )

    def __init__(self, lock: threading.Lock, lsn_lease: int) -> None:
        self.lock = lock
        self.cond = threading.Condition(lock)
        self.segments: dict[int, Segment] = {}  # the open segment files by id
        # WAL records published but not yet committed. A group commit swaps the
        # list for a new one: read it only under ``lock``.
        self.pending: list[bytes] = []
        # Never reissue an LSN that a crashed writer may have stamped on a record.
        self.next_lsn = lsn_lease
        self.lease_until = lsn_lease
        self.durable_lsn = lsn_lease - 1
        self.failed: WriterFailedError | None = None

    def take_lsn_locked(self) -> int:
        """The next LSN (or single-threaded during open)."""
        lsn = self.next_lsn
        self.next_lsn += 1
        return lsn

    def fail(self, error: WriterFailedError) -> WriterFailedError:
        """Stop the writer for good with ``error`` (the first failure wins). Takes the lock."""
        with self.lock:
            if self.failed is None:
                self.failed = error
        return error


def sync_segment(state: JournalState, segment: Segment) -> None:
    """fdatasync ``segment``; a failure stops the writer (its pages may not be durable)."""
    try:
        os.fdatasync(segment.fd)
    except OSError as e:
        raise state.fail(
            WriterFailedError(f"fdatasync of segment {segment.path.name} failed", e.errno)
        ) from e


class Journal:
    """Group commit over ``state`` into ``wal``. ``check_writable`` (called under the
    state lock) raises when the store may not write (closed, read-only, failed);
    ``on_commit(elapsed_ns, wal_bytes)`` counts a commit, under the state lock."""

    def __init__(
        self,
        state: JournalState,
        *,
        lease_step: int,
        check_writable: Callable[[], None],
        on_commit: Callable[[int, int], None],
    ) -> None:
        self._state = state
        self.wal: WalWriter | None = None  # a writer's open sets it; a read-only one has none
        self._lease_step = lease_step
        self._check_writable_locked = check_writable
        self._on_commit = on_commit
        self.commit_lock = threading.Lock()

    def close(self) -> None:
        """Drop the store's callback (it refers back to the store) and close the WAL."""

        def closed() -> None:
            raise ClosedError("the store is closed")

        self._check_writable_locked = closed
        if self.wal is not None:
            self.wal.close()

    def commit(self) -> None:
        """Return when every record published before this call is durable."""
        with self.commit_lock:
            self.commit_locked()

    def commit_locked(self) -> None:
        """One group commit. Caller holds ``commit_lock``.

        The records are swapped out under the state lock, so from then on they are
        this commit's alone: it writes all of them, puts them back (nothing reached
        the WAL), or stops the writer. It never returns having dropped one.
        """
        st = self._state
        wal = self.wal
        assert wal is not None, "a read-only store has no journal to commit"
        with st.lock:
            if st.failed is not None:
                raise WriterFailedError(
                    f"the writer stopped after an earlier failure ({st.failed}); reopen"
                )
            records, st.pending = st.pending, []
            dirty = [segment for segment in st.segments.values() if segment.dirty]
            for segment in dirty:
                segment.dirty = False
            lsn_mark = st.next_lsn - 1
        if not records and not dirty:
            return
        started_ns = time.perf_counter_ns()
        try:
            joined = b"".join(records)
            for segment in dirty:
                sync_segment(st, segment)
        except WriterFailedError:
            raise
        except BaseException:
            # Interrupted (KeyboardInterrupt, MemoryError) before the WAL saw any of
            # it: the next commit takes the records and the segments' syncs over.
            with st.lock:
                st.pending[:0] = records
                for segment in dirty:
                    segment.dirty = True
            raise
        if joined:
            try:
                wal.append(joined)
                wal.sync()
            except WriterFailedError as e:
                raise st.fail(e) from e
            except BaseException as e:
                # Part of the batch may be in the WAL file: nothing later may follow it.
                st.fail(
                    WriterFailedError(f"a WAL append was interrupted ({type(e).__name__}: {e})")
                )
                raise
        with st.lock:
            st.durable_lsn = max(st.durable_lsn, lsn_mark)
            self._on_commit(time.perf_counter_ns() - started_ns, len(joined))

    def extend_lease(self) -> None:
        """Make a new LSN lease durable before any LSN past the old one is used."""
        st = self._state
        with self.commit_lock:
            with st.lock:
                self._check_writable_locked()
                if st.next_lsn + 2 < st.lease_until:  # the margin reserve uses
                    return
                lsn = st.take_lsn_locked()
                new_lease = st.next_lsn + self._lease_step
                st.pending.append(encode_lsn_lease(lsn, new_lease))
            self.commit_locked()
            with st.lock:
                st.lease_until = new_lease

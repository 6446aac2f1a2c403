"""The segment writer: ``put_many``'s batching, coalescing and publish (docs/design.md,
"Write path").

Each page gets a reservation at the active segment's head (``reserve``: segment,
offset and LSN under the state lock, counted in flight; it waits out a writer
barrier, extends the LSN lease, rolls the segment or makes room first as needed), its record is
encoded into a write buffer, and records reserved back to back in one segment share
one write of up to ``COALESCE_BYTES``. Writes go to the I/O engine with up to
``io_depth`` in flight; a page is published (page table, policy, pending WAL PUT
record, counters, one state-lock round per completion batch) only after its write
completed whole. A short or failed write stops the writer for good. Reservations of
pages that were never written are given back.

It lives in runtime/ with the shared state it publishes into (a first sketch put it in
log/; docs/design.md, "Layers"; the publish needs the page table and the policy).
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable

from kvstore.errors import ClosedError, KVStoreError, StoreFullError, WriterFailedError
from kvstore.format.checksum import checksum
from kvstore.format.constants import BLOCK_BYTES, RECORD_PAGE, record_span
from kvstore.format.entries import PageEntry
from kvstore.format.records import encode_record_fields_into
from kvstore.format.wal import encode_put_fields
from kvstore.index.recovery import apply_put
from kvstore.inputs import decode_meta
from kvstore.io.buffers import AlignedBuffer, BufferPool
from kvstore.io.engine import IOEngine, IOQueue
from kvstore.log.journal import Journal
from kvstore.log.segments import Segment
from kvstore.runtime.rolling import SegmentSet
from kvstore.runtime.state import StoreState
from kvstore.telemetry import counters as tc

__all__ = [
    "COALESCE_BYTES",
    "SUBMIT_BYTES",
    "ZERO_COPY_MIN_BYTES",
    "SegmentWriter",
    "Turn",
    "in_place",
]

_ZERO_BLOCK = memoryview(bytes(BLOCK_BYTES))  # sliced without copying


@dataclasses.dataclass(slots=True)
class _PendingPut:
    key: bytes
    entry: PageEntry
    segment: Segment
    span: int


@dataclasses.dataclass(slots=True)
class _PendingWrite:
    """One write of consecutive records of one ``put_many`` call: one I/O.

    ``buffer`` holds what the write copies (header blocks, payloads that are not
    written in place, padding); ``pieces`` is the write's gather list in disk order:
    ``(start, end)`` ranges of ``buffer`` and the caller's own payload views
    (docs/design.md, "Write path": zero copy).
    """

    segment: Segment
    offset: int  # of the first record
    buffer: AlignedBuffer
    started_ns: int  # when put_many began: put latency is until the page is published
    length: int = 0  # bytes on disk
    used: int = 0  # bytes of ``buffer`` taken
    pieces: list[tuple[int, int] | memoryview] = dataclasses.field(default_factory=list)
    pages: list[_PendingPut] = dataclasses.field(default_factory=list)

    def take(self, size: int) -> memoryview:
        """The next ``size`` bytes of ``buffer`` (a multiple of 4096), in the gather list."""
        start = self.used
        self.used += size
        last = self.pieces[-1] if self.pieces else None
        if isinstance(last, tuple) and last[1] == start:
            self.pieces[-1] = (last[0], self.used)
        else:
            self.pieces.append((start, self.used))
        return self.buffer.view[start : self.used]

    def views(self) -> list[memoryview]:
        view = self.buffer.view
        return [p if isinstance(p, memoryview) else view[p[0] : p[1]] for p in self.pieces]


class Turn:
    """Submission order between batches on different threads (``put_many_async``).

    A batch ``wait``s for its turn before its first reservation and passes it on
    (``done``) once every page of it is reserved, so the batches of one submitter
    take LSNs, and so win over each other, in the order they were submitted, while
    each batch's I/O and group commit still overlap the next batch's.
    """

    __slots__ = ("_cond", "_next", "_taken")

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._taken = 0  # tickets handed out
        self._next = 0  # the ticket whose turn it is

    def ticket(self) -> int:
        with self._cond:
            ticket = self._taken
            self._taken += 1
            return ticket

    def wait(self, ticket: int) -> None:
        with self._cond:
            while self._next != ticket:
                self._cond.wait()

    def done(self, ticket: int) -> None:
        with self._cond:
            if self._next == ticket:
                self._next += 1
                self._cond.notify_all()


# put_many submits queued writes once this many bytes are waiting: a 1 MiB page
# goes at once, 16 KiB pages go sixteen to a syscall.
SUBMIT_BYTES = 256 << 10
# Records reserved back to back in one segment share a write of up to this many
# bytes: small pages cost one I/O per 256 KiB instead of one each.
COALESCE_BYTES = 256 << 10
# A write that gathers payloads from the caller's memory grows up to this many bytes:
# it copies only header blocks, so four 256 KiB pages share one I/O and one completion.
GATHER_BYTES = 1 << 20
# A payload at least this large in writable, 4 KiB-aligned memory is written
# straight from it (zero copy); smaller ones are cheaper to copy than to gather.
ZERO_COPY_MIN_BYTES = 16 << 10
# Gather list entries per write at most (IOV_MAX is 1024); fewer where the engine takes
# fewer (``IOEngine.max_iovecs``: the liburing 2024 binding's iovec takes 60).
_MAX_PIECES = 64


def in_place(view: memoryview) -> bool:
    """Whether ``put`` writes this payload straight from the caller's memory:
    writable, 4 KiB aligned and at least ``ZERO_COPY_MIN_BYTES`` (docs/design.md,
    "Write path"). Only the payload's last partial block, if any, is copied."""
    if view.readonly or view.nbytes < ZERO_COPY_MIN_BYTES:
        return False
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) % BLOCK_BYTES == 0


# Throughput windows reported by stats() and the exporter (seconds).
_THROUGHPUT_WINDOWS_S = {"10s": 10.0, "1m": 60.0, "5m": 300.0}


def _no_room() -> None:
    raise StoreFullError("store is full")


class SegmentWriter:
    def __init__(
        self,
        state: StoreState,
        engine: IOEngine,
        buffers: BufferPool,
        *,
        io_depth: int,
        segment_set: SegmentSet,
        journal: Journal,
        check_writable: Callable[[], None],
    ) -> None:
        self._state = state
        self._engine = engine
        self._max_pieces = min(_MAX_PIECES, engine.max_iovecs)
        self._buffers = buffers
        self._io_depth = io_depth
        self._segment_set = segment_set
        self._journal = journal
        self._check_writable_locked = check_writable  # under the state lock; the store's own check
        # Evict until a new segment fits: the collector's make_room (set by the open).
        self.make_room: Callable[[], None] = _no_room

    def close(self) -> None:
        """Drop the callbacks into the store and the collector (they refer back)."""

        def closed() -> None:
            raise ClosedError("the store is closed")

        self._check_writable_locked = self.make_room = closed

    def reserve(
        self,
        span: int,
        *,
        for_gc: bool = False,
        drain: Callable[[], None] | None = None,
    ) -> tuple[Segment, int, int]:
        """(segment, offset, lsn) for a record of ``span`` bytes; counts it in flight.

        ``drain`` completes the caller's own in-flight writes. It runs before any
        wait (a freeze, a lease extension, making room), because a checkpoint or
        sweep waits for every in-flight write, including the caller's.
        """
        st = self._state
        room_attempts = 0
        while True:
            must_drain = False
            spare_pending = False
            with st.cond:
                self._check_writable_locked()
                if drain is not None and st.freezing:
                    must_drain = True
                while st.freezing and not must_drain:
                    st.cond.wait()
                    self._check_writable_locked()
                needs_lease = st.next_lsn + 2 >= st.lease_until
                needs_room = False
                if not needs_lease and not must_drain:
                    segment = st.active
                    if segment is None or segment.remaining() < span:
                        if not st.may_roll_locked(for_gc):
                            if for_gc:
                                raise StoreFullError(
                                    "GC has no free segment to relocate pages into"
                                )
                            needs_room = True
                        elif st.preparing:
                            # Waiting releases the lock: a freeze, the lease or the
                            # capacity may change meanwhile, so wait outside and
                            # start over rather than roll on stale checks.
                            spare_pending = True
                        else:
                            segment = self._segment_set.roll_locked()
                    if not needs_room and not spare_pending:
                        assert segment is not None
                        offset = segment.head
                        segment.head += span
                        lsn = st.take_lsn_locked()
                        st.inflight += 1
                        st.segment_writers[segment.segment_id] += 1
                        return segment, offset, lsn
            if drain is not None and (must_drain or needs_lease or needs_room or spare_pending):
                drain()
                drain = None  # nothing of the caller's is in flight any more
            if spare_pending:
                with st.cond:
                    while st.preparing:
                        st.cond.wait()
                continue
            if must_drain:
                continue
            if needs_lease:
                self._journal.extend_lease()
            elif needs_room:
                if room_attempts >= 2:
                    raise StoreFullError(
                        f"store is full ({st.capacity_bytes} bytes) and nothing can be "
                        "evicted: every remaining page is pinned or retained"
                    )
                room_attempts += 1
                self.make_room()

    # -- writes --------------------------------------------------------------

    def write(
        self,
        prepared: list[tuple[bytes, memoryview, bytes]],
        started_ns: int,
        *,
        turn: Turn | None = None,
        ticket: int = 0,
    ) -> None:
        """Write and publish every (key, payload, meta) of one ``put_many`` call; raise the
        first error after every write in flight has completed (what completed whole is
        published).

        A payload ``in_place`` is written straight from the caller's memory (header
        block, payload, padding block gathered into one write); the others are copied
        into the write's buffer. With ``turn``, the batch reserves only in its
        ``ticket``'s turn and passes it on once every page is reserved.
        """
        # Checksums first, outside the turn: the next batch hashes while this one's
        # reservations are taken (xxhash releases the GIL).
        sums = [checksum(view) for _, view, _ in prepared]
        queue = self._engine.queue()
        max_pieces = self._max_pieces
        in_flight: dict[int, _PendingWrite] = {}
        error: KVStoreError | None = None
        run: _PendingWrite | None = None  # the write being filled, not yet queued
        tokens = itertools.count()
        unsubmitted = 0

        def queue_run() -> None:
            """Queue the open write; reap completions to keep io_depth in flight."""
            nonlocal run, unsubmitted, error
            if run is None:
                return
            write, run = run, None
            token = next(tokens)
            in_flight[token] = write
            queue.writev(write.segment.fd, write.offset, write.views(), token)
            unsubmitted += write.length
            if unsubmitted >= SUBMIT_BYTES:
                # Start these writes while the next pages are prepared; small
                # pages share one io_uring_submit (waiting submits the rest).
                queue.submit()
                unsubmitted = 0
            if queue.in_flight >= self._io_depth:
                error = self._complete(queue, in_flight, 1) or error  # submits
                unsubmitted = 0

        def drain() -> None:
            nonlocal error
            queue_run()
            while queue.in_flight:
                error = self._complete(queue, in_flight, queue.in_flight) or error

        if turn is not None:
            turn.wait(ticket)
        try:
            for (key, view, meta), payload_checksum in zip(prepared, sums, strict=True):
                size = view.nbytes
                span = record_span(size)
                direct = in_place(view)
                tail = size % BLOCK_BYTES
                # Buffer bytes this record takes: the header block (and the last
                # partial block) when written in place, else the whole record.
                need = BLOCK_BYTES + (BLOCK_BYTES if tail else 0) if direct else span
                segment, offset, lsn = self.reserve(
                    span, drain=drain if in_flight or run is not None else None
                )
                page = _PendingPut(
                    key,
                    PageEntry(
                        segment.segment_id,
                        segment.generation,
                        offset,
                        size,
                        payload_checksum,
                        lsn,
                        meta,
                    ),
                    segment,
                    span,
                )
                if run is not None and (
                    run.segment is not segment
                    or run.offset + run.length != offset
                    or run.used + need > run.buffer.capacity
                    or len(run.pieces) + 3 > max_pieces
                ):
                    try:
                        queue_run()
                    except BaseException:
                        self._abandon_reserved([page])
                        raise
                if run is None:
                    try:
                        buffer = self._buffers.acquire(max(need, COALESCE_BYTES))
                    except BaseException:
                        self._abandon_reserved([page])
                        raise
                    run = _PendingWrite(segment, offset, buffer, started_ns)
                # Registered before anything else can raise: the cleanup below
                # releases the reservation of a page that was never submitted.
                run.pages.append(page)
                block = run.take(BLOCK_BYTES if direct else span)
                encode_record_fields_into(
                    block,
                    RECORD_PAGE,
                    key,
                    meta,
                    size,
                    lsn,
                    segment.segment_id,
                    offset,
                    segment.generation,
                    payload_checksum,
                )
                if direct:
                    whole = size - tail
                    run.pieces.append(view[:whole])
                    if tail:
                        last = run.take(BLOCK_BYTES)
                        last[:tail] = view[whole:]
                        last[tail:] = _ZERO_BLOCK[tail:]
                else:
                    block[BLOCK_BYTES : BLOCK_BYTES + size] = view
                    block[BLOCK_BYTES + size : span] = _ZERO_BLOCK[: span - BLOCK_BYTES - size]
                run.length += span
                if run.length >= (GATHER_BYTES if direct else COALESCE_BYTES):
                    queue_run()
                if error is not None:
                    break
            if turn is not None:
                turn.done(ticket)  # every page is reserved: the next batch may go
            if error is None:
                queue_run()
        finally:
            if turn is not None:
                turn.done(ticket)  # no-op when already passed
            while queue.in_flight:
                error = self._complete(queue, in_flight, queue.in_flight) or error
            # Reserved but never submitted (an exception above): the open write,
            # and any write the queue refused.
            unsent = list(in_flight.values()) + ([run] if run is not None else [])
            for write in unsent:
                self._abandon_reserved(write.pages)
                self._buffers.release(write.buffer)
        if error is not None:
            raise error

    def _abandon_reserved(self, pages: list[_PendingPut]) -> None:
        """Release the reservations of pages that were never written."""
        with self._state.lock:
            for page in pages:
                self._state.finish_inflight_locked(page.segment.segment_id)

    def _complete(
        self, queue: IOQueue, in_flight: dict[int, _PendingWrite], wanted: int
    ) -> KVStoreError | None:
        """Reap write completions and publish the pages of writes that completed whole."""
        st = self._state
        completions = queue.wait(wanted)
        error: KVStoreError | None = None
        records: list[bytes | None] = []
        published: list[_PendingPut] = []
        writes: list[_PendingWrite] = []
        for token, result in completions:
            write = in_flight.pop(token)
            writes.append(write)
            if result != write.length:
                errno = -result if result < 0 else None
                error = st.fail(
                    WriterFailedError(
                        f"write of {write.length} bytes to segment {write.segment.segment_id} "
                        f"at offset {write.offset} returned {result}",
                        errno,
                    )
                )
                records.extend([None] * len(write.pages))
            else:
                for pending in write.pages:
                    entry = pending.entry
                    records.append(
                        encode_put_fields(
                            entry.lsn,
                            pending.key,
                            entry.segment_id,
                            entry.generation,
                            entry.offset,
                            entry.payload_bytes,
                            entry.payload_checksum,
                            entry.meta,
                        )
                    )
            published.extend(write.pages)
        done_ns = time.perf_counter_ns()
        tv = st.tv
        table, states, on_put = (
            st.table,
            st.segment_states,
            st.policy.on_put,
        )
        with st.lock:
            # Read under the same lock as the publish: a group commit swaps the
            # list out under this lock, and a record appended to a list taken
            # before it would be written by nobody while its page is readable
            # and the next flush() returns (docs/design.md, "Write path").
            pending_records = st.pending
            for pending in published:
                st.finish_inflight_locked(pending.segment.segment_id)
            puts = host = spans = 0
            for pending, record in zip(published, records, strict=True):
                if record is None:
                    continue
                entry = pending.entry
                apply_put(table, states, pending.key, entry)
                on_put(pending.key, entry.payload_bytes, decode_meta(entry.meta))
                pending_records.append(record)
                pending.segment.dirty = True
                puts += 1
                host += entry.payload_bytes
                spans += pending.span
            if puts:
                # Every page of one put_many call started together: one latency each.
                started_ns = writes[0].started_ns
                tv[tc.PUTS] += puts
                tv[tc.HOST] += host
                tv[tc.RECORD_OVERHEAD] += spans - host
                tc.observe_many(tv, tc.OP_PUT, done_ns - started_ns, puts)
        for write in writes:
            self._buffers.release(write.buffer)
        return error

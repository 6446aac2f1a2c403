"""Reading page records out of segments: where a read lands, and the one verifier.

Every read of a page (get, get_many, get_into, the GC copy, a read-only view's
reads) passes what it read through ``verify_record`` before a byte leaves the
store: the record's header must be byte for byte the one the writer sealed for the
index's entry (a fast compare), else it is decoded and every field that differs is
named (``format.records.entry_mismatches``); then the payload's xxh3-64.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

from kvstore.errors import CorruptionError, IOFailure, KVStoreError
from kvstore.format.checksum import checksum
from kvstore.format.constants import BLOCK_BYTES, RECORD_PAGE, record_span
from kvstore.format.entries import PageEntry
from kvstore.format.records import (
    RecordHeader,
    block_is_sealed,
    decode_record_header,
    entry_mismatches,
    record_header_prefix,
)
from kvstore.io.buffers import AlignedBuffer, BufferPool
from kvstore.io.engine import IOEngine, IOQueue, run_all
from kvstore.log.segments import Segment, read_segment_header

__all__ = [
    "SegmentReader",
    "Wanted",
    "check_header",
    "direct_target",
    "record_views",
    "verify_record",
]


def verify_record(
    key: bytes,
    entry: PageEntry,
    view: memoryview,
    result: int,
    payload: memoryview | None = None,
    *,
    max_page_bytes: int,
) -> memoryview:
    """Check a record read against the index's entry; return its payload
    (``payload`` if it was read there).

    ``view`` starts with the record's header block; the payload follows it in
    ``view`` unless it was read straight into ``payload`` (the caller's memory).
    """

    def where() -> str:  # only formatted on the error paths
        return f"page {key!r} in segment {entry.segment_id} at offset {entry.offset}"

    if result != entry.span_bytes:
        if result < 0:
            raise IOFailure(f"read of {where()} failed", -result)
        raise CorruptionError(f"{where()}: short read ({result} of {entry.span_bytes} bytes)")
    # Fast path: the header must be byte for byte what the writer sealed for
    # this entry. Anything else is decoded field by field for a precise error.
    expected = record_header_prefix(
        RECORD_PAGE,
        key,
        entry.meta,
        entry.payload_bytes,
        entry.lsn,
        entry.segment_id,
        entry.offset,
        entry.generation,
        entry.payload_checksum,
    )
    if payload is None:
        payload = view[BLOCK_BYTES : BLOCK_BYTES + entry.payload_bytes]
    if view[: len(expected)] == expected and block_is_sealed(view):
        if checksum(payload) != entry.payload_checksum:
            raise CorruptionError(f"{where()}: payload checksum mismatch")
        return payload
    check_header(key, entry, view, max_page_bytes=max_page_bytes, where=where())
    if checksum(payload) != entry.payload_checksum:
        raise CorruptionError(f"{where()}: payload checksum mismatch")
    return payload


def check_header(
    key: bytes, entry: PageEntry, block: memoryview, *, max_page_bytes: int, where: str
) -> None:
    """Decode a record's header block and check it against ``entry`` field by field;
    CorruptionError naming every field that differs (``where``: the page's location)."""
    try:
        header = decode_record_header(block, max_page_bytes=max_page_bytes)
    except CorruptionError as e:
        raise CorruptionError(f"{where}: {e}") from None
    mismatched = entry_mismatches(header, key, entry)
    if mismatched:
        raise CorruptionError(
            f"{where}: the record there is not this page ({', '.join(mismatched)}; "
            f"it says key {header.key!r}, segment {header.segment_id}, offset "
            f"{header.offset}, lsn {header.lsn})"
        )


def direct_target(entry: PageEntry, target: memoryview) -> memoryview | None:
    """The part of a caller's buffer the payload can be read straight into, or None.

    Zero-copy needs what O_DIRECT needs: the memory 4 KiB aligned, and a payload
    of whole 4 KiB blocks (so the record's zero padding is never written into
    the caller's buffer). Page-aligned memory (mmap, pinned host memory, most
    KV-cache pages) qualifies; anything else is read into the pool and copied.
    """
    size = entry.payload_bytes
    if size % BLOCK_BYTES or size > target.nbytes:
        return None
    view = target[:size]
    if ctypes.addressof(ctypes.c_char.from_buffer(view)) % BLOCK_BYTES:
        return None
    return view


def record_views(
    pool: BufferPool, entry: PageEntry, direct: memoryview | None
) -> tuple[AlignedBuffer, list[memoryview]]:
    """A pool buffer and the scatter list of one record read: the whole record into
    the buffer, or its header block there and the payload into ``direct``
    (``direct_target``). The caller releases the buffer."""
    if direct is not None:
        buffer = pool.acquire(BLOCK_BYTES)
        return buffer, [buffer.view[:BLOCK_BYTES], direct]
    span = entry.span_bytes
    buffer = pool.acquire(span)
    return buffer, [buffer.view[:span]]


_T = TypeVar("_T")
Wanted = list[tuple[bytes, PageEntry | None]]
"""(key, entry) per page asked for; entry None for a miss."""


class SegmentReader:
    """Reads page records out of a store's open segments and verifies them.

    It counts nothing and holds nothing: the caller registers its reads on the
    segments first (``StoreState.segment_readers``, so no segment it reads is freed
    meanwhile), and counts hits, misses and bytes after. ``segments`` is the store's
    own dict of open segments (read under its state lock by the caller's hold; a
    held segment stays in it). ``on_stale`` runs for a read-only view's read of a
    record the live writer freed and reused since the view (a miss, not damage).
    """

    def __init__(
        self,
        segments: Mapping[int, Segment],
        engine: IOEngine,
        buffers: BufferPool,
        *,
        max_page_bytes: int,
        poll_ns: int,
        readonly: bool,
        on_stale: Callable[[], None],
    ) -> None:
        self._segments = segments
        self._engine = engine
        self._buffers = buffers
        self._max_page_bytes = max_page_bytes
        self.poll_ns = poll_ns  # single reads poll io_uring this long (0: preadv); an A/B switch
        self._readonly = readonly
        self._on_stale = on_stale
        self._tokens = itertools.count()

    def checked(
        self,
        key: bytes,
        entry: PageEntry,
        view: memoryview,
        result: int,
        payload: memoryview | None = None,
    ) -> memoryview | None:
        """``verify_record``, but for a read-only view a record the live writer has freed
        and reused since the view was taken is a miss (None), not corruption."""
        try:
            return verify_record(
                key, entry, view, result, payload, max_page_bytes=self._max_page_bytes
            )
        except CorruptionError:
            if not self._readonly or not self.recycled_since_view(entry):
                raise
        self._on_stale()
        return None

    def recycled_since_view(self, entry: PageEntry) -> bool:
        """Read-only: whether ``entry``'s segment file now has another identity.

        A writer frees a segment and may reuse its file (``recycle_segment``):
        the new header block is written, and synced, before anything else in the
        file changes, so a record this view names can only have changed if the
        header no longer names the view's segment id and generation. A header
        that does not decode is read again once (a rewrite may be under way).
        """
        segment = self._segments.get(entry.segment_id)
        if segment is None:
            return False
        for attempt in range(2):
            try:
                header = read_segment_header(segment.fd, segment.path)
            except CorruptionError:
                if attempt == 0:
                    time.sleep(0.001)
                    continue
                return False
            except IOFailure:
                return False
            return (header.segment_id, header.generation) != (
                entry.segment_id,
                entry.generation,
            )
        return False

    def verify_header(self, key: bytes, entry: PageEntry) -> Segment:
        """Read the header block of a held page's record and check it against
        ``entry`` (every field but the payload's checksum, which the caller checks
        on what it reads); the segment it is in. CorruptionError or IOFailure."""
        segment = self._segment(entry)
        buffer = self._buffers.acquire(BLOCK_BYTES)
        try:
            try:
                got = os.preadv(segment.fd, [buffer.view[:BLOCK_BYTES]], entry.offset)
            except OSError as e:
                raise IOFailure(f"read of page {key!r}'s record header failed", e.errno) from e
            where = f"page {key!r} in segment {entry.segment_id} at offset {entry.offset}"
            if got != BLOCK_BYTES:
                raise CorruptionError(f"{where}: short read of its header ({got} bytes)")
            check_header(key, entry, buffer.view, max_page_bytes=self._max_page_bytes, where=where)
            return segment
        finally:
            self._buffers.release(buffer)

    def _segment(self, entry: PageEntry) -> Segment:
        segment = self._segments.get(entry.segment_id)
        if segment is None:
            raise CorruptionError(f"page in segment {entry.segment_id}, which is not open")
        return segment

    def read_held(
        self,
        wanted: Wanted,
        sink: Callable[[int, memoryview], None],
        targets: list[memoryview] | None,
    ) -> tuple[list[int | None], KVStoreError | None]:
        """Read and verify held pages; ``sink(index, payload_view)`` consumes each one.

        With ``targets``, a page whose ``targets[index]`` can take it directly
        (``direct_target``) is read there and not passed to ``sink``. Returns the
        payload bytes per page (None: a miss) and the first error met; the other
        pages are still read.
        """
        results: list[int | None] = [None] * len(wanted)
        buffers: dict[int, AlignedBuffer] = {}
        directs: dict[int, memoryview] = {}
        error: KVStoreError | None = None
        present = [index for index, (_, entry) in enumerate(wanted) if entry is not None]
        if targets is not None:
            for index in present:
                entry = wanted[index][1]
                assert entry is not None
                direct = direct_target(entry, targets[index])
                if direct is not None:
                    directs[index] = direct
        if len(present) == 1:
            # One page: a plain preadv (it releases the GIL) beats a ring round trip.
            index = present[0]
            key, entry = wanted[index]
            assert entry is not None
            direct = directs.get(index)
            buffer, views = record_views(self._buffers, entry, direct)
            try:
                try:
                    result = os.preadv(self._segment(entry).fd, views, entry.offset)
                except OSError as e:
                    result = -(e.errno or 5)
                payload = self.checked(key, entry, buffer.view, result, direct)
                if payload is not None:
                    if direct is None:
                        sink(index, payload)
                    results[index] = entry.payload_bytes
            finally:
                self._buffers.release(buffer)
            return results, None
        queue = self._engine.queue()
        try:
            for index in present:
                entry = wanted[index][1]
                assert entry is not None
                segment = self._segment(entry)
                buffer, views = record_views(self._buffers, entry, directs.get(index))
                buffers[index] = buffer
                queue.readv(segment.fd, entry.offset, views, index)
            queue.submit()
            while queue.in_flight:
                # Verify each page as it lands while the rest are still in flight.
                for index, result in queue.wait(1):
                    key, entry = wanted[index]
                    assert entry is not None
                    buffer = buffers.pop(index)
                    try:
                        direct = directs.get(index)
                        payload = self.checked(key, entry, buffer.view, result, direct)
                        if payload is not None:
                            if direct is None:
                                sink(index, payload)
                            results[index] = entry.payload_bytes
                    except KVStoreError as e:
                        error = error or e
                    finally:
                        self._buffers.release(buffer)
        finally:
            while queue.in_flight:
                for index, _ in queue.wait(queue.in_flight):
                    self._buffers.release(buffers.pop(index))
        return results, error

    def read_page(
        self,
        key: bytes,
        entry: PageEntry,
        consume: Callable[[memoryview, bool], _T],
        target: memoryview | None,
    ) -> _T | None:
        """One held page, the latency path: ``consume(verified payload, in_place)``.

        ``in_place``: the payload was read straight into ``target`` (zero-copy). On
        io_uring the completion is polled for up to ``poll_ns``; else one ``preadv``.
        An interrupted wait never hands back a buffer the kernel may still write.
        """
        segment = self._segments[entry.segment_id]
        direct = None if target is None else direct_target(entry, target)
        buffer: AlignedBuffer | None
        buffer, views = record_views(self._buffers, entry, direct)
        try:
            assert buffer is not None
            view = buffer.view
            if self.poll_ns:
                token = next(self._tokens)
                queue = self._engine.queue("get")
                queue.readv(segment.fd, entry.offset, views, token)
                try:
                    done = self._wait_for(queue, token)
                except BaseException:
                    if not self._settle(queue, token):
                        buffer = None  # still the kernel's to write into: never reuse
                    raise
            else:
                try:
                    done = os.preadv(segment.fd, views, entry.offset)
                except OSError as e:
                    done = -(e.errno or 5)
            payload = self.checked(key, entry, view, done, direct)
            return None if payload is None else consume(payload, direct is not None)
        finally:
            if buffer is not None:
                self._buffers.release(buffer)

    def _wait_for(self, queue: IOQueue, token: int) -> int:
        """The result of request ``token`` on this thread's ``get`` lane.

        Completions of other tokens are of reads an interrupted call abandoned
        (their buffers were never reused): dropped.
        """
        while True:
            for done_token, result in queue.wait(1, poll_ns=self.poll_ns):
                if done_token == token:
                    return result

    def _settle(self, queue: IOQueue, token: int) -> bool:
        """After an interrupted wait, let the abandoned read finish; True if it did.

        Neither the pool buffer nor the caller's memory should change after the
        call has returned. If this wait is interrupted too, the read stays
        abandoned: its pool buffer is dropped and ``_wait_for`` skips its token.
        """
        try:
            self._wait_for(queue, token)
        except BaseException:
            return False
        return True

    def scan(self, segment: Segment, end: int) -> Iterator[tuple[int, RecordHeader, memoryview]]:
        """Every well-formed record of a held, sealed segment up to ``end``, read in
        large chunks (GC). A record yielded is still to be verified against its entry."""
        segment_id = segment.segment_id
        chunk_bytes = max(8 << 20, record_span(self._max_page_bytes))
        queue = self._engine.queue("gc")
        offset = BLOCK_BYTES
        buffer = self._buffers.acquire(chunk_bytes)
        try:
            while offset < end:
                length = min(chunk_bytes, end - offset)
                result = run_all(queue, [("r", segment.fd, offset, buffer.view[:length])])[0]
                if result != length:
                    raise IOFailure(f"GC read of segment {segment_id} returned {result}")
                position = 0
                while position < length:
                    block = buffer.view[position : position + BLOCK_BYTES]
                    try:
                        header = decode_record_header(block, max_page_bytes=self._max_page_bytes)
                    except KVStoreError:
                        position += BLOCK_BYTES  # a hole left by a write that never landed
                        continue
                    span = record_span(header.payload_bytes)
                    if (
                        header.segment_id != segment_id
                        or header.generation != segment.generation
                        or header.offset != offset + position
                    ):
                        position += BLOCK_BYTES
                        continue
                    if position + span > length:
                        break
                    yield offset + position, header, buffer.view[position : position + span]
                    position += span
                if position == 0:
                    raise CorruptionError(f"segment {segment_id}: record larger than a chunk")
                offset += position
        finally:
            self._buffers.release(buffer)

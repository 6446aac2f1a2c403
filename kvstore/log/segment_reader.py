"""Reading page records out of segments: where a read lands, and the one verifier.

Every read of a page (get, get_many, get_into, the GC copy, a read-only view's
reads) passes what it read through ``verify_record`` before a byte leaves the
store: the record's header must be byte for byte the one the writer sealed for the
index's entry (a fast compare), else it is decoded and every field that differs is
named (``format.records.entry_mismatches``); then the payload's xxh3-64.
"""

from __future__ import annotations

import ctypes

from kvstore.errors import CorruptionError, IOFailure
from kvstore.format.checksum import checksum
from kvstore.format.constants import BLOCK_BYTES, RECORD_PAGE
from kvstore.format.entries import PageEntry
from kvstore.format.records import (
    block_is_sealed,
    decode_record_header,
    entry_mismatches,
    record_header_prefix,
)
from kvstore.io.buffers import AlignedBuffer, BufferPool

__all__ = ["direct_target", "record_views", "verify_record"]


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
    try:
        header = decode_record_header(view, max_page_bytes=max_page_bytes)
    except CorruptionError as e:
        raise CorruptionError(f"{where()}: {e}") from None
    mismatched = entry_mismatches(header, key, entry)
    if mismatched:
        raise CorruptionError(
            f"{where()}: the record there is not this page ({', '.join(mismatched)}; "
            f"it says key {header.key!r}, segment {header.segment_id}, offset "
            f"{header.offset}, lsn {header.lsn})"
        )
    if checksum(payload) != entry.payload_checksum:
        raise CorruptionError(f"{where()}: payload checksum mismatch")
    return payload


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

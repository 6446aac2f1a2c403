"""LMDB value encodings: page-table entries and segment-table entries. No I/O.

LMDB has no checksums of its own, so each value carries an xxh3-64 that also
covers its key: a value that was bit-flipped, or that landed under another key,
is caught when it is read.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvstore.errors import CorruptionError
from kvstore.format.checksum import checksum
from kvstore.format.constants import BLOCK_BYTES, MAX_META_BYTES, SEQUENCE_LIMIT, record_span

__all__ = [
    "EntryLimits",
    "PageEntry",
    "SegmentEntry",
    "decode_page_entry",
    "decode_segment_entry",
    "encode_page_entry",
    "encode_segment_entry",
    "segment_key",
    "validate_page_entry",
]

_PAGE = struct.Struct("<QQQQQQH")  # segment, generation, offset, payload_len, checksum, lsn, mlen
_SEGMENT = struct.Struct("<QQQQQB7x")  # generation, head, live_bytes, live_pages, created_ns, st
_SEGMENT_ID = struct.Struct(">Q")  # big-endian so LMDB keeps segments in id order


@dataclass(frozen=True, slots=True)
class PageEntry:
    """Where a page's record lives and how to verify it. Owned by the index."""

    segment_id: int
    generation: int
    offset: int
    payload_bytes: int
    payload_checksum: int
    lsn: int
    meta: bytes = b""

    @property
    def span_bytes(self) -> int:
        return record_span(self.payload_bytes)


def encode_page_entry(key: bytes, entry: PageEntry) -> bytes:
    body = (
        _PAGE.pack(
            entry.segment_id,
            entry.generation,
            entry.offset,
            entry.payload_bytes,
            entry.payload_checksum,
            entry.lsn,
            len(entry.meta),
        )
        + entry.meta
    )
    return body + struct.pack("<Q", checksum(key + body))


_PAGE_NO_META = struct.Struct("<QQQQQQHQ")  # an entry without meta, then its checksum


def decode_page_entry(key: bytes, value: bytes) -> PageEntry:
    if len(value) == _PAGE_NO_META.size:  # no meta (the common case): one unpack, no slices
        segment_id, generation, offset, payload, csum, lsn, meta_len, stored = _PAGE_NO_META.unpack(
            value
        )
        if meta_len == 0 and stored == checksum(key + value[:-8]):
            return PageEntry(segment_id, generation, offset, payload, csum, lsn)
    if len(value) < _PAGE.size + 8:
        raise CorruptionError(f"page table entry for {key!r}: {len(value)} bytes is too short")
    body = value[:-8]
    (stored,) = struct.unpack_from("<Q", value, len(value) - 8)
    if stored != checksum(key + body):
        raise CorruptionError(f"page table entry for {key!r}: checksum mismatch")
    segment_id, generation, offset, payload, csum, lsn, meta_len = _PAGE.unpack_from(body, 0)
    if meta_len > MAX_META_BYTES or len(body) != _PAGE.size + meta_len:
        raise CorruptionError(f"page table entry for {key!r}: bad meta length")
    return PageEntry(segment_id, generation, offset, payload, csum, lsn, bytes(body[_PAGE.size :]))


@dataclass(frozen=True, slots=True)
class EntryLimits:
    """The store's geometry (from its superblock) that every page entry must fit."""

    segment_bytes: int
    max_page_bytes: int


def validate_page_entry(key: bytes, entry: PageEntry, limits: EntryLimits) -> PageEntry:
    """Refuse an entry no writer makes, before a reader sizes a buffer or seeks by it.

    A checksum proves a value is what was written, not that it is sane: a
    hostile or buggy writer can seal any numbers. The record must sit on a
    block boundary after the segment header, fit the segment, and be no
    larger than ``max_page_bytes``; its LSN and ids must be plausible.
    """
    if (
        entry.payload_bytes > limits.max_page_bytes
        or entry.offset % BLOCK_BYTES
        or entry.offset < BLOCK_BYTES
        or entry.offset + record_span(entry.payload_bytes) > limits.segment_bytes
        or entry.lsn >= SEQUENCE_LIMIT
        or entry.segment_id >= SEQUENCE_LIMIT
        or entry.generation >= SEQUENCE_LIMIT
    ):
        raise CorruptionError(
            f"page table entry for {key!r}: implausible location (segment {entry.segment_id}, "
            f"offset {entry.offset}, {entry.payload_bytes} bytes, lsn {entry.lsn}); "
            "run `kvstore recover PATH`"
        )
    return entry


SEGMENT_ACTIVE = 1
SEGMENT_SEALED = 2


@dataclass(frozen=True, slots=True)
class SegmentEntry:
    """Per-segment state kept in the ``segments`` database."""

    generation: int
    head_bytes: int  # bytes from the file start through the end of the last record
    live_bytes: int
    live_pages: int
    created_unix_ns: int
    state: int = SEGMENT_ACTIVE


def segment_key(segment_id: int) -> bytes:
    return _SEGMENT_ID.pack(segment_id)


def encode_segment_entry(segment_id: int, entry: SegmentEntry) -> bytes:
    body = _SEGMENT.pack(
        entry.generation,
        entry.head_bytes,
        entry.live_bytes,
        entry.live_pages,
        entry.created_unix_ns,
        entry.state,
    )
    return body + struct.pack("<Q", checksum(segment_key(segment_id) + body))


def decode_segment_entry(segment_id: int, value: bytes) -> SegmentEntry:
    if not 0 <= segment_id < 1 << 64:  # from a damaged key: it has no entry to match
        raise CorruptionError(f"segment table entry {segment_id}: id out of range")
    if len(value) != _SEGMENT.size + 8:
        raise CorruptionError(f"segment table entry {segment_id}: bad length {len(value)}")
    body = value[:-8]
    (stored,) = struct.unpack_from("<Q", value, len(value) - 8)
    if stored != checksum(segment_key(segment_id) + body):
        raise CorruptionError(f"segment table entry {segment_id}: checksum mismatch")
    return SegmentEntry(*_SEGMENT.unpack(body))

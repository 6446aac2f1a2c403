"""Superblock, segment header and page record header: bytes <-> values. No I/O.

Every structure here is one 4 KiB block whose last 8 bytes are the xxh3-64 of
the 4088 bytes before them. Decoders raise ``CorruptionError`` for anything
malformed (bad magic, bad checksum, lengths out of range) and
``FormatVersionError`` for a version this build does not read; they never raise
``struct.error`` or read outside the block.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvstore.errors import CorruptionError, FormatVersionError
from kvstore.format.checksum import BytesLike, checksum
from kvstore.format.constants import (
    BLOCK_BYTES,
    FORMAT_VERSION,
    MAX_KEY_BYTES,
    MAX_META_BYTES,
    MAX_PAGE_BYTES_LIMIT,
    MAX_SEGMENT_BYTES,
    RECORD_MAGIC,
    RECORD_PAGE,
    RECORD_TOMBSTONE,
    SEGMENT_MAGIC,
    SUPERBLOCK_MAGIC,
)
from kvstore.format.entries import PageEntry

__all__ = [
    "RecordHeader",
    "SegmentHeader",
    "Superblock",
    "block_is_sealed",
    "decode_record_header",
    "decode_segment_header",
    "decode_superblock",
    "encode_record_header_into",
    "encode_segment_header",
    "encode_superblock",
    "entry_mismatches",
    "record_header_prefix",
    "record_mismatches",
]

_CHECKSUM_AT = BLOCK_BYTES - 8
_ZERO_BLOCK = bytes(BLOCK_BYTES)
_SEAL = struct.Struct("<Q")

# magic, version, block_bytes, flags, uuid, created_ns, segment_bytes, max_page_bytes,
# capacity_bytes
_SUPERBLOCK = struct.Struct("<8sHHI16sQQQQ")
# magic, version, reserved, reserved, uuid, segment_id, generation, segment_bytes, created_ns
_SEGMENT_HEADER = struct.Struct("<8sHHI16sQQQQ")
# magic, version, type, flags, key_len, meta_len, payload_len, lsn, segment_id, offset,
# generation, payload_checksum
_RECORD_HEADER = struct.Struct("<8sHBBHHQQQQQQ")
RECORD_FIXED_BYTES = _RECORD_HEADER.size  # 64; key then meta follow


def _seal(block: bytearray | memoryview) -> None:
    _SEAL.pack_into(block, _CHECKSUM_AT, checksum(block[:_CHECKSUM_AT]))


def _verify(block: BytesLike, what: str) -> None:
    if len(block) < BLOCK_BYTES:
        raise CorruptionError(f"{what}: block is {len(block)} bytes, expected {BLOCK_BYTES}")
    (stored,) = _SEAL.unpack_from(block, _CHECKSUM_AT)
    actual = checksum(memoryview(block)[:_CHECKSUM_AT])
    if stored != actual:
        raise CorruptionError(f"{what}: checksum mismatch (stored {stored:#x}, actual {actual:#x})")


def _check_version(version: int, what: str) -> None:
    if version != FORMAT_VERSION:
        raise FormatVersionError(
            f"{what}: format version {version}, this build reads version {FORMAT_VERSION}"
        )


@dataclass(frozen=True, slots=True)
class Superblock:
    """Contents of ``<root>/KVSTORE``: identity and creation-time configuration."""

    store_uuid: bytes
    created_unix_ns: int
    segment_bytes: int
    max_page_bytes: int
    capacity_bytes: int  # 0 = unbounded
    format_version: int = FORMAT_VERSION


def encode_superblock(superblock: Superblock) -> bytes:
    block = bytearray(BLOCK_BYTES)
    _SUPERBLOCK.pack_into(
        block,
        0,
        SUPERBLOCK_MAGIC,
        superblock.format_version,
        BLOCK_BYTES,
        0,
        superblock.store_uuid,
        superblock.created_unix_ns,
        superblock.segment_bytes,
        superblock.max_page_bytes,
        superblock.capacity_bytes,
    )
    _seal(block)
    return bytes(block)


def decode_superblock(block: BytesLike) -> Superblock:
    if len(block) < BLOCK_BYTES or bytes(block[:8]) != SUPERBLOCK_MAGIC:
        raise CorruptionError("superblock: bad magic; this is not a kvstore directory")
    _verify(block, "superblock")
    (_, version, block_bytes, _, uuid, created, segment_bytes, max_page, capacity) = (
        _SUPERBLOCK.unpack_from(block, 0)
    )
    _check_version(version, "superblock")
    # The reader allocates and seeks by these numbers: refuse what no writer makes
    # (StoreConfig.validate) before anything trusts them.
    if (
        block_bytes != BLOCK_BYTES
        or segment_bytes % BLOCK_BYTES
        or not 4 * BLOCK_BYTES <= segment_bytes <= MAX_SEGMENT_BYTES
        or not 0 < max_page < MAX_PAGE_BYTES_LIMIT + 1
        or max_page + 2 * BLOCK_BYTES > segment_bytes
    ):
        raise CorruptionError(
            f"superblock: implausible geometry (block {block_bytes}, segment {segment_bytes}, "
            f"max page {max_page})"
        )
    return Superblock(uuid, created, segment_bytes, max_page, capacity, version)


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    """Block 0 of every segment file: binds the file to its store, id and generation."""

    store_uuid: bytes
    segment_id: int
    generation: int
    segment_bytes: int
    created_unix_ns: int


def encode_segment_header(header: SegmentHeader) -> bytes:
    block = bytearray(BLOCK_BYTES)
    _SEGMENT_HEADER.pack_into(
        block,
        0,
        SEGMENT_MAGIC,
        FORMAT_VERSION,
        0,
        0,
        header.store_uuid,
        header.segment_id,
        header.generation,
        header.segment_bytes,
        header.created_unix_ns,
    )
    _seal(block)
    return bytes(block)


def decode_segment_header(block: BytesLike) -> SegmentHeader:
    if len(block) < BLOCK_BYTES or bytes(block[:8]) != SEGMENT_MAGIC:
        raise CorruptionError("segment header: bad magic")
    _verify(block, "segment header")
    (_, version, _, _, uuid, segment_id, generation, segment_bytes, created) = (
        _SEGMENT_HEADER.unpack_from(block, 0)
    )
    _check_version(version, "segment header")
    if segment_bytes % BLOCK_BYTES or not 2 * BLOCK_BYTES <= segment_bytes <= MAX_SEGMENT_BYTES:
        raise CorruptionError(f"segment header: implausible segment_bytes {segment_bytes}")
    return SegmentHeader(uuid, segment_id, generation, segment_bytes, created)


@dataclass(frozen=True, slots=True)
class RecordHeader:
    """The 4 KiB header block in front of every page payload in a segment.

    ``segment_id``, ``offset`` and ``generation`` are where the record was
    written, so a stale record in reused space or a misdirected write is caught.
    """

    record_type: int
    key: bytes
    meta: bytes
    payload_bytes: int
    lsn: int
    segment_id: int
    offset: int
    generation: int
    payload_checksum: int


def encode_record_header_into(block: memoryview, header: RecordHeader) -> None:
    """Write ``header`` as a sealed 4 KiB block at the start of ``block``."""
    encode_record_fields_into(
        block,
        header.record_type,
        header.key,
        header.meta,
        header.payload_bytes,
        header.lsn,
        header.segment_id,
        header.offset,
        header.generation,
        header.payload_checksum,
    )


def encode_record_fields_into(
    block: memoryview,
    record_type: int,
    key: bytes,
    meta: bytes,
    payload_bytes: int,
    lsn: int,
    segment_id: int,
    offset: int,
    generation: int,
    payload_checksum: int,
) -> None:
    """``encode_record_header_into`` from the fields (the put path builds no header object)."""
    key_len = len(key)
    meta_len = len(meta)
    if not 0 < key_len <= MAX_KEY_BYTES:
        raise ValueError(f"key must be 1..{MAX_KEY_BYTES} bytes, got {key_len}")
    if meta_len > MAX_META_BYTES:
        raise ValueError(f"meta must be at most {MAX_META_BYTES} bytes encoded, got {meta_len}")
    prefix = record_header_prefix(
        record_type,
        key,
        meta,
        payload_bytes,
        lsn,
        segment_id,
        offset,
        generation,
        payload_checksum,
    )
    end = len(prefix)
    block[:end] = prefix
    block[end:_CHECKSUM_AT] = _ZERO_BLOCK[end:_CHECKSUM_AT]
    _seal(block[:BLOCK_BYTES])


def record_header_prefix(
    record_type: int,
    key: bytes,
    meta: bytes,
    payload_bytes: int,
    lsn: int,
    segment_id: int,
    offset: int,
    generation: int,
    payload_checksum: int,
) -> bytes:
    """The bytes a record's header block starts with: fixed fields, key, meta.

    The encoder writes exactly these; a reader that knows what it expects (from
    the page table) compares them and checks the block's seal instead of
    decoding the header field by field.
    """
    return (
        _RECORD_HEADER.pack(
            RECORD_MAGIC,
            FORMAT_VERSION,
            record_type,
            0,
            len(key),
            len(meta),
            payload_bytes,
            lsn,
            segment_id,
            offset,
            generation,
            payload_checksum,
        )
        + key
        + meta
    )


def block_is_sealed(block: memoryview) -> bool:
    """Whether a 4 KiB block's last 8 bytes are the xxh3 of the rest."""
    return bool(_SEAL.unpack_from(block, _CHECKSUM_AT)[0] == checksum(block[:_CHECKSUM_AT]))


def decode_record_header(block: BytesLike, *, max_page_bytes: int) -> RecordHeader:
    """Decode and verify a record header block; lengths are range-checked."""
    if len(block) < BLOCK_BYTES or bytes(block[:8]) != RECORD_MAGIC:
        raise CorruptionError("page record: bad magic (no record at this location)")
    _verify(block, "page record header")
    (
        _,
        version,
        record_type,
        _,
        key_len,
        meta_len,
        payload_bytes,
        lsn,
        segment_id,
        offset,
        generation,
        payload_checksum,
    ) = _RECORD_HEADER.unpack_from(block, 0)
    _check_version(version, "page record header")
    if record_type not in (RECORD_PAGE, RECORD_TOMBSTONE):
        raise CorruptionError(f"page record: unknown record type {record_type}")
    if not 0 < key_len <= MAX_KEY_BYTES or meta_len > MAX_META_BYTES:
        raise CorruptionError(f"page record: bad key/meta length {key_len}/{meta_len}")
    if payload_bytes > max_page_bytes:
        raise CorruptionError(
            f"page record: payload of {payload_bytes} bytes exceeds max_page_bytes"
        )
    key = bytes(block[RECORD_FIXED_BYTES : RECORD_FIXED_BYTES + key_len])
    meta_at = RECORD_FIXED_BYTES + key_len
    meta = bytes(block[meta_at : meta_at + meta_len])
    return RecordHeader(
        record_type,
        key,
        meta,
        payload_bytes,
        lsn,
        segment_id,
        offset,
        generation,
        payload_checksum,
    )


def record_mismatches(
    header: RecordHeader,
    key: bytes,
    *,
    segment_id: int,
    offset: int,
    generation: int,
    lsn: int,
    payload_bytes: int,
    payload_checksum: int,
    meta: bytes | None,
    record_type: int = RECORD_PAGE,
) -> list[str]:
    """The fields in which a decoded record header differs from the index's entry for
    ``key`` (empty: it is that page's record). The one record-against-entry check:
    the store's reads, fsck and the GDS path use it. ``meta`` None: not compared (the
    caller holds only the decoded meta)."""
    fields = (
        ("record type", header.record_type, record_type),
        ("key", header.key, key),
        ("segment", header.segment_id, segment_id),
        ("offset", header.offset, offset),
        ("generation", header.generation, generation),
        ("lsn", header.lsn, lsn),
        ("length", header.payload_bytes, payload_bytes),
        ("payload checksum field", header.payload_checksum, payload_checksum),
        ("meta", header.meta, header.meta if meta is None else meta),
    )
    return [name for name, seen, expected in fields if seen != expected]


def entry_mismatches(header: RecordHeader, key: bytes, entry: PageEntry) -> list[str]:
    """``record_mismatches`` against an index entry (every field, meta included)."""
    return record_mismatches(
        header,
        key,
        segment_id=entry.segment_id,
        offset=entry.offset,
        generation=entry.generation,
        lsn=entry.lsn,
        payload_bytes=entry.payload_bytes,
        payload_checksum=entry.payload_checksum,
        meta=entry.meta,
    )

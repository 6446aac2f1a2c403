"""WAL file header and WAL record framing: bytes <-> values. No I/O.

A WAL file is a 64-byte file header followed by records. Each record is::

    magic u32 | body_len u32 | type u8 | 3 zero bytes | lsn u64 | body | xxh3 u64

where the trailing checksum covers the 20-byte record header and the body. The
reader (``iter_records``) stops at the first record that is incomplete or whose
checksum fails and reports where and why; the caller decides whether that is a
torn tail (end of log) or corruption in the middle.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvstore.errors import CorruptionError, FormatVersionError
from kvstore.format.checksum import BytesLike, checksum
from kvstore.format.constants import (
    FORMAT_VERSION,
    MAX_KEY_BYTES,
    MAX_META_BYTES,
    WAL_DELETE,
    WAL_FILE_MAGIC,
    WAL_LSN_LEASE,
    WAL_MOVE,
    WAL_PUT,
    WAL_RECORD_MAGIC,
    WAL_RELEASE,
    WAL_RETAIN,
    WAL_SEGMENT_FREE,
    WAL_SEGMENT_OPEN,
)
from kvstore.format.entries import PageEntry

__all__ = [
    "WAL_FILE_HEADER_BYTES",
    "DeleteBody",
    "LsnLeaseBody",
    "MoveBody",
    "PutBody",
    "RetainBody",
    "SegmentFreeBody",
    "SegmentOpenBody",
    "WalFileHeader",
    "WalRecord",
    "WalScan",
    "decode_body",
    "decode_wal_file_header",
    "encode_delete",
    "encode_lsn_lease",
    "encode_move",
    "encode_put",
    "encode_retain",
    "encode_segment_free",
    "encode_segment_open",
    "encode_wal_file_header",
    "encode_wal_record",
    "iter_records",
    "repair_record",
    "repair_wal_file_header",
]

# magic, version, reserved, reserved, uuid, first_lsn, prev_first_lsn, created_ns, checksum
_FILE_HEADER = struct.Struct("<8sHHI16sQQQQ")
WAL_FILE_HEADER_BYTES = _FILE_HEADER.size  # 64
_RECORD_HEADER = struct.Struct("<IIBxxxQ")  # magic, body_len, type, lsn
RECORD_OVERHEAD = _RECORD_HEADER.size + 8
MAX_BODY_BYTES = 96 + MAX_KEY_BYTES + MAX_META_BYTES
_PUT = struct.Struct("<QQQQQHH")  # segment, generation, offset, payload_len, checksum, klen, mlen
_DELETE = struct.Struct("<H")
_SEGMENT_OPEN = struct.Struct("<QQ")
_LEASE = struct.Struct("<Q")
_MOVE_FROM = struct.Struct("<QQQ")  # old segment, old generation, old offset
_KEY = struct.Struct("<H")


@dataclass(frozen=True, slots=True)
class WalFileHeader:
    """Names the file's first LSN and its predecessor's, so a missing file is seen."""

    store_uuid: bytes
    first_lsn: int
    prev_first_lsn: int  # 0: this is the first file of the chain
    created_unix_ns: int


def encode_wal_file_header(header: WalFileHeader) -> bytes:
    packed = _FILE_HEADER.pack(
        WAL_FILE_MAGIC,
        FORMAT_VERSION,
        0,
        0,
        header.store_uuid,
        header.first_lsn,
        header.prev_first_lsn,
        header.created_unix_ns,
        0,
    )
    body = packed[:-8]
    return body + struct.pack("<Q", checksum(body))


def decode_wal_file_header(data: BytesLike) -> WalFileHeader:
    if len(data) < WAL_FILE_HEADER_BYTES or bytes(data[:8]) != WAL_FILE_MAGIC:
        raise CorruptionError("WAL file header: bad magic or short file")
    fields = _FILE_HEADER.unpack_from(data, 0)
    if fields[-1] != checksum(memoryview(data)[: WAL_FILE_HEADER_BYTES - 8]):
        raise CorruptionError("WAL file header: checksum mismatch")
    if fields[1] != FORMAT_VERSION:
        raise FormatVersionError(f"WAL file header: format version {fields[1]}")
    return WalFileHeader(fields[4], fields[5], fields[6], fields[7])


@dataclass(frozen=True, slots=True)
class PutBody:
    key: bytes
    segment_id: int
    generation: int
    offset: int
    payload_bytes: int
    payload_checksum: int
    meta: bytes

    def entry(self, lsn: int) -> PageEntry:
        """The page-table entry this record sets; ``lsn`` is the record's."""
        return PageEntry(
            self.segment_id,
            self.generation,
            self.offset,
            self.payload_bytes,
            self.payload_checksum,
            lsn,
            self.meta,
        )


@dataclass(frozen=True, slots=True)
class DeleteBody:
    key: bytes


@dataclass(frozen=True, slots=True)
class SegmentOpenBody:
    segment_id: int
    generation: int


@dataclass(frozen=True, slots=True)
class LsnLeaseBody:
    lease_until: int


@dataclass(frozen=True, slots=True)
class MoveBody:
    """Compaction moved ``put.key`` from (old_segment_id, old_offset); same LSN.

    Applies only if the page is still at the old location with that LSN, so a
    concurrent overwrite or delete wins.
    """

    put: PutBody
    old_segment_id: int
    old_generation: int
    old_offset: int


@dataclass(frozen=True, slots=True)
class SegmentFreeBody:
    segment_id: int
    generation: int


@dataclass(frozen=True, slots=True)
class RetainBody:
    key: bytes
    retained: bool  # True: RETAIN, False: RELEASE


@dataclass(frozen=True, slots=True)
class WalRecord:
    record_type: int
    lsn: int
    body: bytes
    end_offset: int  # file offset just past this record


def encode_wal_record(record_type: int, lsn: int, body: bytes) -> bytes:
    header = _RECORD_HEADER.pack(WAL_RECORD_MAGIC, len(body), record_type, lsn)
    framed = header + body
    return framed + struct.pack("<Q", checksum(framed))


def encode_put(lsn: int, body: PutBody) -> bytes:
    return encode_put_fields(
        lsn,
        body.key,
        body.segment_id,
        body.generation,
        body.offset,
        body.payload_bytes,
        body.payload_checksum,
        body.meta,
    )


def encode_put_fields(
    lsn: int,
    key: bytes,
    segment_id: int,
    generation: int,
    offset: int,
    payload_bytes: int,
    payload_checksum: int,
    meta: bytes,
) -> bytes:
    """``encode_put`` from the fields (the put path builds no ``PutBody``)."""
    fixed = _PUT.pack(
        segment_id, generation, offset, payload_bytes, payload_checksum, len(key), len(meta)
    )
    return encode_wal_record(WAL_PUT, lsn, fixed + key + meta)


def encode_delete(lsn: int, key: bytes) -> bytes:
    return encode_wal_record(WAL_DELETE, lsn, _DELETE.pack(len(key)) + key)


def encode_segment_open(lsn: int, segment_id: int, generation: int) -> bytes:
    return encode_wal_record(WAL_SEGMENT_OPEN, lsn, _SEGMENT_OPEN.pack(segment_id, generation))


def encode_lsn_lease(lsn: int, lease_until: int) -> bytes:
    return encode_wal_record(WAL_LSN_LEASE, lsn, _LEASE.pack(lease_until))


def encode_move(lsn: int, body: MoveBody) -> bytes:
    put = encode_put(lsn, body.put)
    # Re-frame the PUT body with the old location appended, as a MOVE record.
    put_body = put[_RECORD_HEADER.size : -8]
    old = _MOVE_FROM.pack(body.old_segment_id, body.old_generation, body.old_offset)
    return encode_wal_record(WAL_MOVE, lsn, put_body + old)


def encode_segment_free(lsn: int, segment_id: int, generation: int) -> bytes:
    return encode_wal_record(WAL_SEGMENT_FREE, lsn, _SEGMENT_OPEN.pack(segment_id, generation))


def encode_retain(lsn: int, key: bytes, retained: bool) -> bytes:
    record_type = WAL_RETAIN if retained else WAL_RELEASE
    return encode_wal_record(record_type, lsn, _KEY.pack(len(key)) + key)


WalBody = (
    PutBody | DeleteBody | SegmentOpenBody | LsnLeaseBody | MoveBody | SegmentFreeBody | RetainBody
)


def _decode_put(body: bytes, lsn: int, what: str) -> PutBody:
    seg, gen, off, plen, csum, klen, mlen = _PUT.unpack_from(body, 0)
    start = _PUT.size
    if len(body) != start + klen + mlen or not 0 < klen <= MAX_KEY_BYTES:
        raise CorruptionError(f"WAL {what} at lsn {lsn}: bad lengths")
    return PutBody(body[start : start + klen], seg, gen, off, plen, csum, body[start + klen :])


def decode_body(record: WalRecord) -> WalBody:
    """Decode a record's body; raises CorruptionError if it does not parse."""
    body = record.body
    try:
        if record.record_type == WAL_PUT:
            return _decode_put(body, record.lsn, "PUT")
        if record.record_type == WAL_MOVE:
            if len(body) < _MOVE_FROM.size:
                raise CorruptionError(f"WAL MOVE at lsn {record.lsn}: too short")
            split = len(body) - _MOVE_FROM.size
            put = _decode_put(body[:split], record.lsn, "MOVE")
            old_seg, old_gen, old_off = _MOVE_FROM.unpack_from(body, split)
            return MoveBody(put, old_seg, old_gen, old_off)
        if record.record_type in (WAL_DELETE, WAL_RETAIN, WAL_RELEASE):
            (klen,) = _KEY.unpack_from(body, 0)
            if len(body) != _KEY.size + klen or not 0 < klen <= MAX_KEY_BYTES:
                raise CorruptionError(f"WAL record at lsn {record.lsn}: bad key length")
            key = body[_KEY.size :]
            if record.record_type == WAL_DELETE:
                return DeleteBody(key)
            return RetainBody(key, record.record_type == WAL_RETAIN)
        if record.record_type == WAL_SEGMENT_FREE:
            if len(body) != _SEGMENT_OPEN.size:
                raise CorruptionError(f"WAL SEGMENT_FREE at lsn {record.lsn}: bad length")
            seg, gen = _SEGMENT_OPEN.unpack(body)
            return SegmentFreeBody(seg, gen)
        if record.record_type == WAL_SEGMENT_OPEN:
            if len(body) != _SEGMENT_OPEN.size:
                raise CorruptionError(f"WAL SEGMENT_OPEN at lsn {record.lsn}: bad length")
            seg, gen = _SEGMENT_OPEN.unpack(body)
            return SegmentOpenBody(seg, gen)
        if record.record_type == WAL_LSN_LEASE:
            if len(body) != _LEASE.size:
                raise CorruptionError(f"WAL LSN_LEASE at lsn {record.lsn}: bad length")
            return LsnLeaseBody(_LEASE.unpack(body)[0])
    except struct.error as e:
        raise CorruptionError(f"WAL record at lsn {record.lsn}: {e}") from e
    raise CorruptionError(f"WAL record at lsn {record.lsn}: unknown type {record.record_type}")


@dataclass(slots=True)
class WalScan:
    """Result of scanning one WAL file's records.

    ``valid_end`` is the offset just past the last good record. If
    ``stop_reason`` is set, the bytes from ``valid_end`` on did not parse;
    ``later_valid_offset`` is where a well-formed record was found after that
    point (corruption in the middle), or None (a torn tail).
    """

    records: list[WalRecord]
    valid_end: int
    stop_reason: str | None = None
    later_valid_offset: int | None = None


def _parse_at(data: memoryview, offset: int) -> tuple[WalRecord | None, str | None]:
    size = len(data)
    if offset + _RECORD_HEADER.size > size:
        return None, "incomplete record header"
    magic, body_len, record_type, lsn = _RECORD_HEADER.unpack_from(data, offset)
    if magic != WAL_RECORD_MAGIC:
        return None, "bad record magic"
    if body_len > MAX_BODY_BYTES:
        return None, f"record body length {body_len} out of range"
    end = offset + _RECORD_HEADER.size + body_len + 8
    if end > size:
        return None, "incomplete record"
    (stored,) = struct.unpack_from("<Q", data, end - 8)
    if stored != checksum(data[offset : end - 8]):
        return None, "record checksum mismatch"
    body = bytes(data[offset + _RECORD_HEADER.size : end - 8])
    return WalRecord(record_type, lsn, body, end), None


def iter_records(data: BytesLike, start: int = WAL_FILE_HEADER_BYTES) -> WalScan:
    """Parse records from ``start``; never reads outside ``data``."""
    view = memoryview(data)
    records: list[WalRecord] = []
    offset = start
    size = len(view)
    while offset < size:
        record, reason = _parse_at(view, offset)
        if record is None:
            later = _find_later_record(view, offset + 1)
            return WalScan(records, offset, reason, later)
        records.append(record)
        offset = record.end_offset
    return WalScan(records, offset)


def _find_later_record(view: memoryview, start: int) -> int | None:
    """Offset of the next well-formed record after a bad one, if any (resync by magic)."""
    magic = struct.pack("<I", WAL_RECORD_MAGIC)
    raw = bytes(view)  # offsets are relative to the view, never to what it slices
    position = start
    while True:
        position = raw.find(magic, position)
        if position < 0:
            return None
        record, _ = _parse_at(view, position)
        if record is not None:
            return position
        position += 1


# -- repairing a single damaged byte ------------------------------------------------
#
# A WAL record or file header that fails its checksum is repaired when exactly one
# change of one byte makes it whole again: the checksum then proves the repair (a
# wrong candidate would have to collide in 64 bits; at most ~10^6 candidates are
# tried). A torn write (bytes missing or cut at a sector) is never one byte off, so
# it stays a torn tail; a bit flip or a one-byte overwrite is undone, and the
# record (a DELETE, say) is not lost.

MAX_REPAIR_BYTES = RECORD_OVERHEAD + MAX_BODY_BYTES
"""The longest damaged span (one record) a single-byte repair is tried on."""


_ANY_BYTE_BELOW = 512
"""Spans up to this long are tried with every byte value at every position; longer
ones with every single-bit flip (bit rot), which keeps the search under ~30k
checksums."""


def _one_byte_fixes(
    span: bytearray, valid: Callable[[bytearray], bool], positions: range | None = None
) -> list[bytes]:
    """Every variant of ``span`` that differs in one byte and passes ``valid`` (stops at 2)."""
    found: list[bytes] = []
    every_value = len(span) <= _ANY_BYTE_BELOW
    for position in positions if positions is not None else range(len(span)):
        original = span[position]
        values = range(256) if every_value else [original ^ (1 << bit) for bit in range(8)]
        for value in values:
            if value == original:
                continue
            span[position] = value
            if valid(span):
                found.append(bytes(span))
                if len(found) > 1:
                    span[position] = original
                    return found
        span[position] = original
    return found


def repair_record(data: BytesLike, offset: int, end: int) -> WalRecord | None:
    """The record at ``offset``, if one byte of ``data[offset:end]`` is all that is wrong.

    ``end`` is where the next well-formed record starts (or the end of the file):
    the damaged record fills ``[offset, end)`` exactly. None when no single-byte
    change, or more than one, makes a whole record of that length (a torn write:
    its length field does not match what is there, and no one byte can fix both).
    """
    length = end - offset
    if not RECORD_OVERHEAD <= length <= MAX_REPAIR_BYTES:
        return None
    magic = struct.pack("<I", WAL_RECORD_MAGIC)
    body_len = struct.pack("<I", length - RECORD_OVERHEAD)
    span = bytearray(data[offset:end])
    stored_at = length - 8

    def valid(candidate: bytearray) -> bool:
        return (
            candidate[:4] == magic
            and candidate[4:8] == body_len
            and int.from_bytes(candidate[stored_at:], "little")
            == checksum(memoryview(candidate)[:stored_at])
        )

    magic_ok, length_ok = span[:4] == magic, span[4:8] == body_len
    if not magic_ok and not length_ok:
        return None  # two fields wrong: not one byte
    if not magic_ok:
        positions = range(4)
    elif not length_ok:
        positions = range(4, 8)
    else:
        # The checksum itself damaged: one comparison, no search.
        actual = checksum(memoryview(span)[:stored_at]).to_bytes(8, "little")
        if sum(a != b for a, b in zip(actual, span[stored_at:], strict=True)) == 1:
            return _record_of(bytes(span[:stored_at]) + actual)
        positions = range(8, stored_at)
    fixes = _one_byte_fixes(span, valid, positions)
    if len(fixes) != 1:
        return None
    return _record_of(fixes[0])


def _record_of(raw: bytes) -> WalRecord:
    record, _ = _parse_at(memoryview(raw), 0)
    assert record is not None  # the caller checked framing and checksum
    return record


def repair_wal_file_header(
    data: BytesLike, store_uuid: bytes, first_lsn: int, prev_first_lsn: int | None
) -> tuple[WalFileHeader, str] | None:
    """A damaged file header rebuilt and proven by its own checksum, or None.

    First from what the reader knows (magic, version, the store's uuid, the file
    name's first LSN, the predecessor's first LSN if known) with the stored
    creation time; then by a single-byte repair of the stored header. Returns the
    header and how it was proven.
    """
    if len(data) < WAL_FILE_HEADER_BYTES:
        return None
    stored = bytes(data[:WAL_FILE_HEADER_BYTES])
    (_, _, _, _, _, _, stored_prev, created, _) = _FILE_HEADER.unpack(stored)
    for prev in dict.fromkeys(p for p in (prev_first_lsn, stored_prev) if p is not None):
        rebuilt = encode_wal_file_header(WalFileHeader(store_uuid, first_lsn, prev, created))
        if rebuilt[-8:] == stored[-8:]:
            return decode_wal_file_header(rebuilt), "rebuilt from the fields the store knows"

    def valid(candidate: bytearray) -> bool:
        return int.from_bytes(candidate[56:], "little") == checksum(memoryview(candidate)[:56])

    span = bytearray(stored)
    actual = checksum(memoryview(span)[:56]).to_bytes(8, "little")
    fixes = [stored[:56] + actual]
    if sum(a != b for a, b in zip(actual, stored[56:], strict=True)) != 1:
        fixes = _one_byte_fixes(span, valid)
    if len(fixes) != 1:
        return None
    try:
        header = decode_wal_file_header(fixes[0])
    except (CorruptionError, FormatVersionError):
        return None
    if header.store_uuid != store_uuid or header.first_lsn != first_lsn:
        return None
    return header, "one damaged byte undone (proven by the header checksum)"


def iter_file(data: BytesLike) -> Iterator[WalRecord]:
    """Convenience for tools: every record of a whole WAL file image."""
    decode_wal_file_header(data)
    yield from iter_records(data).records

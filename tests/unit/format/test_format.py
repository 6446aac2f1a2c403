"""format/: every on-disk structure round-trips, and every decoder fails closed.

Decoders must raise CorruptionError (never struct.error or IndexError) for
flipped bytes, truncation, bad magic and out-of-range lengths, and
FormatVersionError for another version. WAL framing must tell a torn tail
(no valid record after the bad one) from corruption in the middle.
"""

from __future__ import annotations

import random
import struct
import uuid

import pytest

from kvstore.errors import CorruptionError, FormatVersionError
from kvstore.format.checksum import checksum
from kvstore.format.constants import (
    BLOCK_BYTES,
    FORMAT_VERSION,
    MAX_KEY_BYTES,
    MAX_META_BYTES,
    RECORD_PAGE,
    RECORD_TOMBSTONE,
    WAL_DELETE,
    WAL_LSN_LEASE,
    WAL_PUT,
    WAL_SEGMENT_OPEN,
    align_up,
    record_span,
)
from kvstore.format.entries import (
    SEGMENT_SEALED,
    PageEntry,
    SegmentEntry,
    decode_page_entry,
    decode_segment_entry,
    encode_page_entry,
    encode_segment_entry,
    segment_key,
)
from kvstore.format.names import (
    parse_segment_name,
    parse_wal_name,
    segment_name,
    wal_name,
)
from kvstore.format.records import (
    RecordHeader,
    SegmentHeader,
    Superblock,
    block_is_sealed,
    decode_record_header,
    decode_segment_header,
    decode_superblock,
    encode_record_header_into,
    encode_segment_header,
    encode_superblock,
    entry_mismatches,
    record_header_prefix,
    record_mismatches,
)
from kvstore.format.wal import (
    WAL_FILE_HEADER_BYTES,
    DeleteBody,
    LsnLeaseBody,
    PutBody,
    SegmentOpenBody,
    WalFileHeader,
    WalRecord,
    decode_body,
    decode_wal_file_header,
    encode_delete,
    encode_lsn_lease,
    encode_put,
    encode_segment_open,
    encode_wal_file_header,
    encode_wal_record,
    iter_records,
)

STORE_UUID = uuid.UUID("12345678-1234-5678-1234-567812345678").bytes
MAX_PAGE = 1 << 20


def reseal(block: bytearray) -> bytes:
    """Recompute a 4 KiB block's trailing checksum after editing it on purpose."""
    struct.pack_into("<Q", block, BLOCK_BYTES - 8, checksum(bytes(block[: BLOCK_BYTES - 8])))
    return bytes(block)


def flipped(data: bytes, position: int, mask: int = 0x01) -> bytes:
    out = bytearray(data)
    out[position] ^= mask
    return bytes(out)


def make_superblock() -> Superblock:
    return Superblock(STORE_UUID, 1_700_000_000_123_456_789, 64 << 20, 4 << 20, 1 << 40)


def make_segment_header() -> SegmentHeader:
    return SegmentHeader(STORE_UUID, 17, 4242, 64 << 20, 1_700_000_000_000_000_001)


def make_record_header(**changes: object) -> RecordHeader:
    fields: dict[str, object] = {
        "record_type": RECORD_PAGE,
        "key": b"layer0/block17",
        "meta": b'{"dtype":"float16"}',
        "payload_bytes": 5000,
        "lsn": 99,
        "segment_id": 3,
        "offset": 8192,
        "generation": 41,
        "payload_checksum": 0xDEADBEEFCAFEF00D,
    }
    fields.update(changes)
    return RecordHeader(**fields)  # type: ignore[arg-type]


def encode_record_header(header: RecordHeader) -> bytes:
    block = bytearray(BLOCK_BYTES)
    encode_record_header_into(memoryview(block), header)
    return bytes(block)


# -- constants and names -------------------------------------------------------


def test_alignment_helpers() -> None:
    assert [align_up(n) for n in (0, 1, 4095, 4096, 4097)] == [0, 4096, 4096, 4096, 8192]
    assert record_span(1) == 8192
    assert record_span(4096) == 8192
    assert record_span(4097) == 12288


def test_file_names_round_trip() -> None:
    assert segment_name(0x1F) == "000000000000001f.seg"
    assert wal_name(2) == "0000000000000002.wal"
    assert parse_segment_name("000000000000001f.seg") == 0x1F
    assert parse_wal_name("0000000000100004.wal") == 0x100004
    for bad in ("1f.seg", "000000000000001F.seg", "000000000000001f.wal", ".x.seg"):
        assert parse_segment_name(bad) is None
    assert parse_wal_name("000000000000001f.seg") is None


# -- superblock ----------------------------------------------------------------


def test_superblock_round_trip() -> None:
    superblock = make_superblock()
    block = encode_superblock(superblock)
    assert len(block) == BLOCK_BYTES
    assert block[:8] == b"KVSTORE\x00"
    assert decode_superblock(block) == superblock
    assert decode_superblock(memoryview(bytearray(block))) == superblock


def test_superblock_every_flipped_byte_is_corruption() -> None:
    block = encode_superblock(make_superblock())
    for position in range(BLOCK_BYTES):
        with pytest.raises(CorruptionError):
            decode_superblock(flipped(block, position))


@pytest.mark.parametrize("length", [0, 1, 7, 8, 64, BLOCK_BYTES - 8, BLOCK_BYTES - 1])
def test_superblock_truncated_is_corruption(length: int) -> None:
    block = encode_superblock(make_superblock())
    with pytest.raises(CorruptionError):
        decode_superblock(block[:length])


def test_superblock_bad_magic_names_the_problem() -> None:
    block = bytearray(encode_superblock(make_superblock()))
    block[:8] = b"KVSEGMT\x00"
    with pytest.raises(CorruptionError, match="not a kvstore directory"):
        decode_superblock(reseal(block))


def test_superblock_other_version_is_format_version_error() -> None:
    block = encode_superblock(
        Superblock(STORE_UUID, 1, 64 << 20, 4 << 20, 0, format_version=FORMAT_VERSION + 1)
    )
    with pytest.raises(FormatVersionError, match=f"version {FORMAT_VERSION + 1}"):
        decode_superblock(block)


@pytest.mark.parametrize("segment_bytes", [0, 4097, (64 << 20) + 1])
def test_superblock_implausible_geometry_is_corruption(segment_bytes: int) -> None:
    block = encode_superblock(Superblock(STORE_UUID, 1, segment_bytes, 4 << 20, 0))
    with pytest.raises(CorruptionError, match="implausible geometry"):
        decode_superblock(block)


# -- segment header --------------------------------------------------------------


def test_segment_header_round_trip() -> None:
    header = make_segment_header()
    block = encode_segment_header(header)
    assert len(block) == BLOCK_BYTES
    assert block[:8] == b"KVSEGMT\x00"
    assert decode_segment_header(block) == header


def test_segment_header_every_flipped_byte_is_corruption() -> None:
    block = encode_segment_header(make_segment_header())
    for position in range(BLOCK_BYTES):
        with pytest.raises(CorruptionError):
            decode_segment_header(flipped(block, position, 0x80))


@pytest.mark.parametrize("length", [0, 5, 8, 100, BLOCK_BYTES - 1])
def test_segment_header_truncated_is_corruption(length: int) -> None:
    with pytest.raises(CorruptionError):
        decode_segment_header(encode_segment_header(make_segment_header())[:length])


def test_segment_header_bad_magic_is_corruption() -> None:
    block = bytearray(encode_segment_header(make_segment_header()))
    block[0] = ord("X")
    with pytest.raises(CorruptionError, match="bad magic"):
        decode_segment_header(reseal(block))


def test_segment_header_other_version_is_format_version_error() -> None:
    block = bytearray(encode_segment_header(make_segment_header()))
    struct.pack_into("<H", block, 8, 7)
    with pytest.raises(FormatVersionError, match="format version 7"):
        decode_segment_header(reseal(block))


# -- page record header ------------------------------------------------------------


def test_record_header_round_trip() -> None:
    header = make_record_header()
    block = encode_record_header(header)
    assert block[:8] == b"KVPAGE\x00\x01"
    assert decode_record_header(block, max_page_bytes=MAX_PAGE) == header


def test_record_header_round_trip_at_the_limits() -> None:
    header = make_record_header(
        record_type=RECORD_TOMBSTONE,
        key=b"k" * MAX_KEY_BYTES,
        meta=b"m" * MAX_META_BYTES,
        payload_bytes=MAX_PAGE,
        lsn=2**64 - 1,
    )
    assert decode_record_header(encode_record_header(header), max_page_bytes=MAX_PAGE) == header


@pytest.mark.parametrize("meta", [b"", b'{"dtype":"float16"}'])
def test_record_header_prefix_is_what_the_encoder_writes(meta: bytes) -> None:
    """Readers compare this prefix instead of decoding: it must match byte for byte."""
    header = make_record_header(meta=meta)
    block = encode_record_header(header)
    prefix = record_header_prefix(
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
    assert len(prefix) == 64 + len(header.key) + len(meta)
    assert block.startswith(prefix)
    assert block_is_sealed(memoryview(block))
    other = record_header_prefix(
        RECORD_PAGE, header.key, meta, header.payload_bytes, header.lsn + 1, 3, 8192, 41, 0
    )
    assert not block.startswith(other)


def test_block_is_sealed_catches_every_flipped_byte() -> None:
    block = encode_record_header(make_record_header())
    for position in range(0, BLOCK_BYTES, 7):
        assert not block_is_sealed(memoryview(flipped(block, position)))


def test_record_header_encode_clears_stale_bytes() -> None:
    """A reused buffer must not leak an earlier, longer key into the sealed block."""
    block = bytearray(b"\xff" * BLOCK_BYTES)
    encode_record_header_into(memoryview(block), make_record_header(key=b"k" * 900))
    short = make_record_header(key=b"x", meta=b"")
    encode_record_header_into(memoryview(block), short)
    assert bytes(block) == encode_record_header(short)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"key": b""}, "key must be"),
        ({"key": b"k" * 1025}, "key must be"),
        ({"meta": b"m" * (MAX_META_BYTES + 1)}, "meta must be"),
    ],
)
def test_record_header_encode_rejects_bad_lengths(changes: dict[str, bytes], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        encode_record_header(make_record_header(**changes))


def test_record_header_every_flipped_byte_is_corruption() -> None:
    block = encode_record_header(make_record_header())
    for position in range(BLOCK_BYTES):
        with pytest.raises(CorruptionError):
            decode_record_header(flipped(block, position, 0x10), max_page_bytes=MAX_PAGE)


@pytest.mark.parametrize("length", [0, 8, 63, 64, BLOCK_BYTES - 8, BLOCK_BYTES - 1])
def test_record_header_truncated_is_corruption(length: int) -> None:
    block = encode_record_header(make_record_header())
    with pytest.raises(CorruptionError):
        decode_record_header(block[:length], max_page_bytes=MAX_PAGE)


def test_record_header_zeroed_block_is_no_record() -> None:
    with pytest.raises(CorruptionError, match="no record at this location"):
        decode_record_header(bytes(BLOCK_BYTES), max_page_bytes=MAX_PAGE)


def test_record_header_other_version_is_format_version_error() -> None:
    block = bytearray(encode_record_header(make_record_header()))
    struct.pack_into("<H", block, 8, FORMAT_VERSION + 1)
    with pytest.raises(FormatVersionError):
        decode_record_header(reseal(block), max_page_bytes=MAX_PAGE)


@pytest.mark.parametrize(
    ("offset", "fmt", "value", "message"),
    [
        (10, "<B", 0, "unknown record type 0"),
        (10, "<B", 9, "unknown record type 9"),
        (12, "<H", 0, "bad key/meta length"),
        (12, "<H", MAX_KEY_BYTES + 1, "bad key/meta length"),
        (12, "<H", 0xFFFF, "bad key/meta length"),
        (14, "<H", MAX_META_BYTES + 1, "bad key/meta length"),
        (14, "<H", 0xFFFF, "bad key/meta length"),
        (16, "<Q", MAX_PAGE + 1, "exceeds max_page_bytes"),
        (16, "<Q", 2**64 - 1, "exceeds max_page_bytes"),
    ],
)
def test_record_header_out_of_range_fields_are_corruption(
    offset: int, fmt: str, value: int, message: str
) -> None:
    """Even with a valid checksum, an impossible field is refused, not used."""
    block = bytearray(encode_record_header(make_record_header()))
    struct.pack_into(fmt, block, offset, value)
    with pytest.raises(CorruptionError, match=message):
        decode_record_header(reseal(block), max_page_bytes=MAX_PAGE)


def test_decoders_fail_closed_on_random_blocks() -> None:
    rng = random.Random(1234)
    good = [
        encode_superblock(make_superblock()),
        encode_segment_header(make_segment_header()),
        encode_record_header(make_record_header()),
    ]
    decoders = [
        decode_superblock,
        decode_segment_header,
        lambda block: decode_record_header(block, max_page_bytes=MAX_PAGE),
    ]
    for _ in range(300):
        length = rng.choice([0, 1, 16, 100, 4095, 4096, 8192])
        noise = rng.randbytes(length)
        for template, decode in zip(good, decoders, strict=True):
            # Keep the magic so the decoder gets past its first check.
            data = template[:8] + noise[8:] if length > 8 else noise
            with pytest.raises(CorruptionError):
                decode(data)


# -- LMDB entries ------------------------------------------------------------------


def make_page_entry(meta: bytes = b'{"a":1}') -> PageEntry:
    return PageEntry(7, 41, 12288, 5000, 0x1234_5678_9ABC_DEF0, 1055, meta)


@pytest.mark.parametrize("meta", [b"", b'{"a":1}', b"x" * MAX_META_BYTES])
def test_page_entry_round_trip(meta: bytes) -> None:
    entry = make_page_entry(meta)
    raw = encode_page_entry(b"key", entry)
    assert decode_page_entry(b"key", raw) == entry
    assert entry.span_bytes == 12288


def test_page_entry_under_another_key_is_corruption() -> None:
    raw = encode_page_entry(b"key-a", make_page_entry())
    with pytest.raises(CorruptionError, match="checksum mismatch"):
        decode_page_entry(b"key-b", raw)


def test_page_entry_every_flipped_byte_and_truncation_is_corruption() -> None:
    raw = encode_page_entry(b"key", make_page_entry())
    for position in range(len(raw)):
        with pytest.raises(CorruptionError):
            decode_page_entry(b"key", flipped(raw, position))
    for length in range(len(raw)):
        with pytest.raises(CorruptionError):
            decode_page_entry(b"key", raw[:length])


def test_page_entry_with_inconsistent_meta_length_is_corruption() -> None:
    raw = bytearray(encode_page_entry(b"key", make_page_entry(b"")))
    body = raw[:-8]
    struct.pack_into("<H", body, 48, 0xFFFF)  # meta_len far past the value's end
    resealed = bytes(body) + struct.pack("<Q", checksum(b"key" + bytes(body)))
    with pytest.raises(CorruptionError, match="bad meta length"):
        decode_page_entry(b"key", resealed)


def test_segment_entry_round_trip_and_key_order() -> None:
    entry = SegmentEntry(41, 1 << 20, 12288, 1, 1_700_000_000, SEGMENT_SEALED)
    assert decode_segment_entry(9, encode_segment_entry(9, entry)) == entry
    assert segment_key(9) == b"\x00" * 7 + b"\x09"
    assert sorted([segment_key(256), segment_key(2), segment_key(1 << 40)]) == [
        segment_key(2),
        segment_key(256),
        segment_key(1 << 40),
    ]


def test_segment_entry_under_another_segment_id_is_corruption() -> None:
    raw = encode_segment_entry(9, SegmentEntry(41, 4096, 0, 0, 1))
    with pytest.raises(CorruptionError, match="checksum mismatch"):
        decode_segment_entry(10, raw)


def test_segment_entry_flips_and_bad_lengths_are_corruption() -> None:
    raw = encode_segment_entry(9, SegmentEntry(41, 4096, 0, 0, 1))
    for position in range(len(raw)):
        with pytest.raises(CorruptionError):
            decode_segment_entry(9, flipped(raw, position))
    for bad in (b"", raw[:-1], raw + b"\x00"):
        with pytest.raises(CorruptionError, match="bad length"):
            decode_segment_entry(9, bad)


# -- WAL file header -----------------------------------------------------------------


def make_wal_header() -> bytes:
    return encode_wal_file_header(WalFileHeader(STORE_UUID, 1000, 900, 1_700_000_000))


def test_wal_file_header_round_trip() -> None:
    data = make_wal_header()
    assert len(data) == WAL_FILE_HEADER_BYTES == 64
    assert decode_wal_file_header(data) == WalFileHeader(STORE_UUID, 1000, 900, 1_700_000_000)
    assert decode_wal_file_header(data + b"records follow") == decode_wal_file_header(data)


def test_wal_file_header_flips_and_truncation_are_corruption() -> None:
    data = make_wal_header()
    for position in range(len(data)):
        with pytest.raises(CorruptionError):
            decode_wal_file_header(flipped(data, position))
    for length in range(len(data)):
        with pytest.raises(CorruptionError):
            decode_wal_file_header(data[:length])


def test_wal_file_header_other_version_is_format_version_error() -> None:
    data = bytearray(make_wal_header())
    struct.pack_into("<H", data, 8, FORMAT_VERSION + 1)
    struct.pack_into("<Q", data, 56, checksum(bytes(data[:56])))
    with pytest.raises(FormatVersionError):
        decode_wal_file_header(bytes(data))


# -- WAL records -----------------------------------------------------------------------


def make_put(key: bytes = b"layer0/block7", meta: bytes = b'{"dtype":"float16"}') -> PutBody:
    return PutBody(key, 1, 4, 4096, 5000, 0xABCDEF, meta)


def test_wal_put_matches_the_worked_example_size() -> None:
    """docs/format.md: the worked example's PUT record is 104 bytes."""
    assert len(encode_put(5, make_put())) == 104
    assert len(encode_lsn_lease(3, 1048580)) == 36
    assert len(encode_segment_open(4, 1, 4)) == 44


def test_wal_records_round_trip_through_iter_records() -> None:
    records = [
        encode_lsn_lease(3, 1 << 20),
        encode_segment_open(4, 1, 4),
        encode_put(5, make_put()),
        encode_put(6, make_put(b"k" * MAX_KEY_BYTES, b"m" * MAX_META_BYTES)),
        encode_delete(7, b"layer0/block7"),
    ]
    image = make_wal_header() + b"".join(records)
    scan = iter_records(image)
    assert scan.stop_reason is None
    assert scan.later_valid_offset is None
    assert scan.valid_end == len(image)
    assert [(r.record_type, r.lsn) for r in scan.records] == [
        (WAL_LSN_LEASE, 3),
        (WAL_SEGMENT_OPEN, 4),
        (WAL_PUT, 5),
        (WAL_PUT, 6),
        (WAL_DELETE, 7),
    ]
    bodies = [decode_body(r) for r in scan.records]
    assert bodies == [
        LsnLeaseBody(1 << 20),
        SegmentOpenBody(1, 4),
        make_put(),
        make_put(b"k" * MAX_KEY_BYTES, b"m" * MAX_META_BYTES),
        DeleteBody(b"layer0/block7"),
    ]
    ends = [scan.records[i].end_offset for i in range(5)]
    assert ends == [64 + sum(len(r) for r in records[: i + 1]) for i in range(5)]


def wal_image(count: int = 4) -> tuple[bytes, list[int]]:
    """A WAL file image and the offset where each record starts."""
    data = bytearray(make_wal_header())
    starts = []
    for index in range(count):
        starts.append(len(data))
        data += encode_put(100 + index, make_put(b"key-%d" % index, b"m" * (index * 37)))
    return bytes(data), starts


def test_torn_tail_at_every_byte_of_the_last_record() -> None:
    image, starts = wal_image()
    last = starts[-1]
    clean = iter_records(image[:last])
    assert clean.stop_reason is None
    assert [r.lsn for r in clean.records] == [100, 101, 102]
    for cut in range(last + 1, len(image)):
        scan = iter_records(image[:cut])
        assert [r.lsn for r in scan.records] == [100, 101, 102], cut
        assert scan.valid_end == last, cut
        assert scan.stop_reason is not None, cut
        assert scan.later_valid_offset is None, cut


def test_torn_tail_followed_by_zeros_or_garbage_is_still_a_torn_tail() -> None:
    image, starts = wal_image()
    last = starts[-1]
    for cut in (last + 1, last + 20, len(image) - 1):
        for filler in (bytes(4096), b"\xab" * 333):
            scan = iter_records(image[:cut] + filler)
            assert [r.lsn for r in scan.records] == [100, 101, 102]
            assert scan.valid_end == last
            assert scan.stop_reason is not None
            assert scan.later_valid_offset is None
    scan = iter_records(image + bytes(100))
    assert [r.lsn for r in scan.records] == [100, 101, 102, 103]
    assert scan.valid_end == len(image)
    assert scan.stop_reason == "bad record magic"


def _xor_byte(at: int) -> object:
    def edit(record: bytearray) -> None:
        record[at] ^= 0x5A

    return edit


def _set_body_len(value: int) -> object:
    def edit(record: bytearray) -> None:
        struct.pack_into("<I", record, 4, value)

    return edit


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        pytest.param(_xor_byte(0), "bad record magic", id="magic"),
        pytest.param(_set_body_len(0x7FFFFFFF), "out of range", id="huge-length"),
        pytest.param(_set_body_len(0), "record checksum mismatch", id="zero-length"),
        pytest.param(_set_body_len(60), "record checksum mismatch", id="wrong-length"),
        pytest.param(_xor_byte(30), "record checksum mismatch", id="body-byte"),
        pytest.param(_xor_byte(-1), "record checksum mismatch", id="checksum-byte"),
    ],
)
def test_corrupt_middle_record_reports_the_later_valid_record(edit: object, reason: str) -> None:
    image, starts = wal_image()
    record = bytearray(image[starts[1] : starts[2]])
    edit(record)  # type: ignore[operator]
    scan = iter_records(image[: starts[1]] + bytes(record) + image[starts[2] :])
    assert [r.lsn for r in scan.records] == [100]
    assert scan.valid_end == starts[1]
    assert scan.stop_reason is not None
    assert reason in scan.stop_reason
    assert scan.later_valid_offset == starts[2]


def test_iter_records_never_raises_on_garbage() -> None:
    rng = random.Random(99)
    image, _ = wal_image()
    for _ in range(300):
        data = bytearray(image)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(64, len(data))] = rng.randrange(256)
        data = data[: rng.randint(WAL_FILE_HEADER_BYTES, len(data))]
        scan = iter_records(bytes(data))
        assert scan.valid_end <= len(data)
        assert all(r.end_offset <= len(data) for r in scan.records)
    scan = iter_records(b"")
    assert scan.records == [] and scan.stop_reason is None


def test_corrupt_middle_detected_through_a_memoryview_slice() -> None:
    image, starts = wal_image()
    bad = bytearray(image)
    bad[starts[1] + 30] ^= 0xFF
    framed = b"PREFIX" + bytes(bad)
    scan = iter_records(memoryview(framed)[len(b"PREFIX") :])
    assert scan.valid_end == starts[1]
    assert scan.later_valid_offset == starts[2]


_PUT_FIXED = struct.Struct("<QQQQQHH")


@pytest.mark.parametrize(
    ("record_type", "body"),
    [
        pytest.param(WAL_PUT, b"", id="put-empty"),
        pytest.param(WAL_PUT, b"\x00" * 43, id="put-short-fixed-part"),
        pytest.param(WAL_PUT, _PUT_FIXED.pack(1, 1, 1, 1, 1, 0, 0), id="put-empty-key"),
        pytest.param(WAL_PUT, _PUT_FIXED.pack(1, 1, 1, 1, 1, 0xFFFF, 0) + b"k", id="put-huge-key"),
        pytest.param(WAL_PUT, _PUT_FIXED.pack(1, 1, 1, 1, 1, 1, 9) + b"k", id="put-meta-missing"),
        pytest.param(
            WAL_PUT, _PUT_FIXED.pack(1, 1, 1, 1, 1, 1, 0) + b"k" + b"extra", id="put-trailing"
        ),
        pytest.param(WAL_DELETE, b"", id="delete-empty"),
        pytest.param(WAL_DELETE, b"\x01", id="delete-short"),
        pytest.param(WAL_DELETE, struct.pack("<H", 0), id="delete-empty-key"),
        pytest.param(WAL_DELETE, struct.pack("<H", 5) + b"abc", id="delete-key-cut"),
        pytest.param(WAL_DELETE, struct.pack("<H", 1025) + b"k" * 1025, id="delete-key-too-long"),
        pytest.param(WAL_SEGMENT_OPEN, b"\x00" * 15, id="segment-open-short"),
        pytest.param(WAL_SEGMENT_OPEN, b"\x00" * 17, id="segment-open-long"),
        pytest.param(WAL_LSN_LEASE, b"\x00" * 7, id="lease-short"),
        pytest.param(WAL_LSN_LEASE, b"\x00" * 9, id="lease-long"),
        pytest.param(0, b"", id="type-0-never-written"),
        pytest.param(255, b"\x00" * 16, id="type-255-unknown"),
    ],
)
def test_decode_body_rejects_malformed_bodies(record_type: int, body: bytes) -> None:
    """Only CorruptionError, naming the record's LSN: never struct.error or IndexError."""
    with pytest.raises(CorruptionError, match="lsn 5"):
        decode_body(WalRecord(record_type, 5, body, 0))


def test_encode_wal_record_frames_any_body() -> None:
    framed = encode_wal_record(WAL_DELETE, 77, b"\x02\x00hi")
    magic, body_len, record_type, lsn = struct.unpack_from("<IIBxxxQ", framed)
    assert (magic, body_len, record_type, lsn) == (0x4B56574C, 4, WAL_DELETE, 77)
    assert struct.unpack_from("<Q", framed, len(framed) - 8)[0] == checksum(framed[:-8])


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({}, []),
        ({"record_type": RECORD_TOMBSTONE}, ["record type"]),
        ({"key": b"other"}, ["key"]),
        ({"segment_id": 4}, ["segment"]),
        ({"offset": 12288}, ["offset"]),
        ({"generation": 42}, ["generation"]),
        ({"lsn": 100}, ["lsn"]),
        ({"payload_bytes": 4999}, ["length"]),
        ({"payload_checksum": 1}, ["payload checksum field"]),
        ({"meta": b"{}"}, ["meta"]),
        ({"lsn": 100, "offset": 0}, ["offset", "lsn"]),
    ],
)
def test_record_against_entry_names_every_field_that_differs(
    change: dict[str, object], named: list[str]
) -> None:
    """The one record-against-entry check (store reads, fsck, GDS): nine fields."""
    want = make_record_header()
    entry = PageEntry(
        want.segment_id,
        want.generation,
        want.offset,
        want.payload_bytes,
        want.payload_checksum,
        want.lsn,
        want.meta,
    )
    seen = make_record_header(**change)
    assert entry_mismatches(seen, want.key, entry) == named
    # Without the raw meta (GDS holds only the decoded meta), meta is not compared.
    loose = record_mismatches(
        seen,
        want.key,
        segment_id=want.segment_id,
        offset=want.offset,
        generation=want.generation,
        lsn=want.lsn,
        payload_bytes=want.payload_bytes,
        payload_checksum=want.payload_checksum,
        meta=None,
    )
    assert loose == [name for name in named if name != "meta"]

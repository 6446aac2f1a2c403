"""log/: the WAL writer and chain reader, and segment files.

A torn tail is allowed only in the newest WAL file; a missing file, a broken
chain, or damage anywhere else is CorruptionError that names `kvstore recover`.
"""

from __future__ import annotations

import os
import stat
import uuid
from pathlib import Path

import pytest

from kvstore.errors import CorruptionError, IOFailure
from kvstore.format.constants import BLOCK_BYTES, WAL_DELETE, WAL_PUT
from kvstore.format.names import SEGMENTS_DIR, WAL_DIR, segment_path, wal_path
from kvstore.format.records import decode_segment_header
from kvstore.format.wal import (
    WAL_FILE_HEADER_BYTES,
    PutBody,
    decode_body,
    decode_wal_file_header,
    encode_delete,
    encode_put,
    iter_records,
)
from kvstore.log.segments import (
    create_segment,
    list_segment_files,
    open_segment,
    recycle_segment,
)
from kvstore.log.wal import WalWriter, list_wal_files, read_wal_chain

STORE_UUID = uuid.UUID(int=0xA11CE).bytes
OTHER_UUID = uuid.UUID(int=0xB0B).bytes


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / WAL_DIR).mkdir()
    (tmp_path / SEGMENTS_DIR).mkdir()
    return tmp_path


def put_record(lsn: int, key: bytes) -> bytes:
    return encode_put(lsn, PutBody(key, 1, 7, 4096 * lsn, 100 + lsn, 0xC0FFEE + lsn, b""))


def write_chain(root: Path, files: list[tuple[int, list[int]]]) -> None:
    """WAL files named by their first LSN, each holding PUTs with the given LSNs."""
    writer: WalWriter | None = None
    for first_lsn, lsns in files:
        if writer is None:
            writer = WalWriter(root, STORE_UUID, first_lsn, 0)
        else:
            writer.rotate(first_lsn)
        writer.append(b"".join(put_record(lsn, b"key-%d" % lsn) for lsn in lsns))
        writer.sync()
    assert writer is not None
    writer.close()


def lsns_of(chain: list) -> list[list[int]]:  # type: ignore[type-arg]
    return [[record.lsn for record in wal_file.records] for wal_file in chain]


# -- writer ---------------------------------------------------------------------


def test_writer_creates_a_headed_file_and_appends(root: Path) -> None:
    writer = WalWriter(root, STORE_UUID, 5, 0)
    path = wal_path(root, 5)
    assert path.name == "0000000000000005.wal"
    assert writer.size_bytes == WAL_FILE_HEADER_BYTES
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    records = put_record(6, b"a") + encode_delete(7, b"a")
    writer.append(records)
    writer.sync()
    assert writer.size_bytes == WAL_FILE_HEADER_BYTES + len(records)
    assert writer.total_bytes_written == writer.size_bytes
    writer.close()
    writer.close()  # idempotent
    data = path.read_bytes()
    header = decode_wal_file_header(data)
    assert (header.store_uuid, header.first_lsn, header.prev_first_lsn) == (STORE_UUID, 5, 0)
    scan = iter_records(data)
    assert [(r.record_type, r.lsn) for r in scan.records] == [(WAL_PUT, 6), (WAL_DELETE, 7)]


def test_rotate_links_each_file_to_its_predecessor(root: Path) -> None:
    write_chain(root, [(1, [2, 3]), (10, [11]), (20, [])])
    assert [first for first, _ in list_wal_files(root)] == [1, 10, 20]
    headers = [decode_wal_file_header(path.read_bytes()) for _, path in list_wal_files(root)]
    assert [(h.first_lsn, h.prev_first_lsn) for h in headers] == [(1, 0), (10, 1), (20, 10)]


def test_writer_refuses_to_reuse_an_existing_file(root: Path) -> None:
    write_chain(root, [(1, [2])])
    before = wal_path(root, 1).read_bytes()
    with pytest.raises(IOFailure, match=r"0000000000000001\.wal"):
        WalWriter(root, STORE_UUID, 1, 0)
    assert wal_path(root, 1).read_bytes() == before


def test_list_wal_files_ignores_other_names(root: Path) -> None:
    write_chain(root, [(16, [])])
    for name in ("notes.txt", "10.wal", "0000000000000001.wal.tmp"):
        (root / WAL_DIR / name).write_bytes(b"x")
    assert [first for first, _ in list_wal_files(root)] == [16]


# -- chain reader -------------------------------------------------------------------


def test_read_chain_returns_every_record_in_order(root: Path) -> None:
    write_chain(root, [(1, [2, 3]), (10, [11, 12]), (20, [21])])
    chain = read_wal_chain(root, STORE_UUID, 1)
    assert [wal_file.first_lsn for wal_file in chain] == [1, 10, 20]
    assert lsns_of(chain) == [[2, 3], [11, 12], [21]]
    assert all(wal_file.torn_tail is None for wal_file in chain)
    assert all(wal_file.valid_end == wal_file.file_bytes for wal_file in chain)
    body = decode_body(chain[1].records[0])
    assert body == PutBody(b"key-11", 1, 7, 4096 * 11, 111, 0xC0FFEE + 11, b"")


def test_read_chain_starts_at_the_checkpoint_file(root: Path) -> None:
    write_chain(root, [(1, [2]), (10, [11]), (20, [21])])
    chain = read_wal_chain(root, STORE_UUID, 10)
    assert lsns_of(chain) == [[11], [21]]


def test_missing_middle_file_is_corruption_naming_recover(root: Path) -> None:
    write_chain(root, [(1, [2]), (10, [11]), (20, [21])])
    wal_path(root, 10).unlink()
    with pytest.raises(CorruptionError, match="kvstore recover") as caught:
        read_wal_chain(root, STORE_UUID, 1)
    assert "000000000000000a.wal" in str(caught.value)  # the missing predecessor


def test_missing_checkpoint_file_is_corruption_naming_recover(root: Path) -> None:
    write_chain(root, [(1, [2]), (10, [11])])
    wal_path(root, 1).unlink()
    with pytest.raises(CorruptionError, match="kvstore recover") as caught:
        read_wal_chain(root, STORE_UUID, 1)
    assert "0000000000000001.wal" in str(caught.value)


def test_empty_wal_directory_is_corruption(root: Path) -> None:
    with pytest.raises(CorruptionError, match="kvstore recover"):
        read_wal_chain(root, STORE_UUID, 1)


def test_torn_tail_of_the_last_file_is_tolerated(root: Path) -> None:
    write_chain(root, [(1, [2, 3]), (10, [11, 12, 13])])
    path = wal_path(root, 10)
    data = path.read_bytes()
    last_start = iter_records(data).records[1].end_offset
    path.write_bytes(data[: last_start + 17])
    chain = read_wal_chain(root, STORE_UUID, 1)
    assert lsns_of(chain) == [[2, 3], [11, 12]]
    assert chain[-1].torn_tail is not None
    assert chain[-1].valid_end == last_start
    assert chain[-1].file_bytes == last_start + 17
    assert chain[0].torn_tail is None


def test_garbage_after_the_last_record_is_a_torn_tail(root: Path) -> None:
    write_chain(root, [(1, [2, 3])])
    path = wal_path(root, 1)
    size = path.stat().st_size
    with open(path, "ab") as handle:
        handle.write(bytes(4096) + b"\x17" * 100)
    chain = read_wal_chain(root, STORE_UUID, 1)
    assert lsns_of(chain) == [[2, 3]]
    assert chain[0].torn_tail is not None
    assert chain[0].valid_end == size


def test_torn_tail_of_an_older_file_is_corruption(root: Path) -> None:
    write_chain(root, [(1, [2, 3]), (10, [11])])
    path = wal_path(root, 1)
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(CorruptionError, match="kvstore recover") as caught:
        read_wal_chain(root, STORE_UUID, 1)
    assert "0000000000000001.wal" in str(caught.value)


def test_corrupt_middle_record_of_the_last_file_is_corruption(root: Path) -> None:
    """Two damaged bytes in a record followed by good ones: the change logged there
    cannot be read (it may have been a delete), so the store cannot vouch for it."""
    write_chain(root, [(1, [2, 3, 4])])
    path = wal_path(root, 1)
    data = bytearray(path.read_bytes())
    second = iter_records(bytes(data)).records[0].end_offset
    data[second + 25] ^= 0xFF
    data[second + 30] ^= 0x0F
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptionError, match="kvstore recover") as caught:
        read_wal_chain(root, STORE_UUID, 1)
    assert f"byte {second}" in str(caught.value)


@pytest.mark.parametrize("where", ["magic", "length", "body", "checksum"])
def test_one_damaged_byte_in_a_record_is_undone(root: Path, where: str) -> None:
    """A single damaged byte (a bit flip, one byte overwritten) is repaired, proven by
    the record's own checksum, in the middle and in the newest file's last record
    alike: no logged change (a DELETE, say) is lost to it."""
    write_chain(root, [(1, [2, 3, 4])])
    path = wal_path(root, 1)
    pristine = path.read_bytes()
    records = iter_records(pristine).records
    for index in (1, 2):  # a record in the middle, the newest file's last record
        start, end = records[index - 1].end_offset, records[index].end_offset
        at = {"magic": start + 1, "length": start + 5, "body": start + 40, "checksum": end - 3}
        data = bytearray(pristine)
        data[at[where]] ^= 0x5A
        path.write_bytes(bytes(data))
        chain = read_wal_chain(root, STORE_UUID, 1)
        assert lsns_of(chain) == [[2, 3, 4]]
        assert [r.body for r in chain[0].records] == [r.body for r in records]
        assert chain[0].torn_tail is None
        assert any("one damaged byte, undone" in note for note in chain[0].repairs)


def test_a_torn_last_record_is_not_mistaken_for_a_damaged_byte(root: Path) -> None:
    write_chain(root, [(1, [2, 3, 4])])
    path = wal_path(root, 1)
    data = path.read_bytes()
    path.write_bytes(data[:-1])  # one byte short: torn, not damaged
    chain = read_wal_chain(root, STORE_UUID, 1)
    assert lsns_of(chain) == [[2, 3]]
    assert chain[0].torn_tail is not None and chain[0].repairs == []


def test_file_of_another_store_is_corruption(root: Path) -> None:
    write_chain(root, [(1, [2])])
    stranger = WalWriter(root, OTHER_UUID, 10, 1)
    stranger.close()
    with pytest.raises(CorruptionError, match="does not belong here"):
        read_wal_chain(root, STORE_UUID, 1)


def test_file_renamed_to_another_lsn_is_corruption(root: Path) -> None:
    write_chain(root, [(1, [2]), (10, [11])])
    wal_path(root, 10).rename(wal_path(root, 12))
    with pytest.raises(CorruptionError, match="does not belong here"):
        read_wal_chain(root, STORE_UUID, 1)


@pytest.mark.parametrize("offset", [0, 9, 20, 33, 41, 50, 60])
@pytest.mark.parametrize("position", [0, 1])
def test_a_damaged_header_is_repaired_and_its_records_used(
    root: Path, offset: int, position: int
) -> None:
    """One damaged byte anywhere in a file header (magic, uuid, first or previous
    LSN, creation time, checksum) is undone, proven by the header checksum; the
    chain link is still checked and every record is replayed."""
    write_chain(root, [(1, [2]), (10, [11])])
    path = wal_path(root, [1, 10][position])
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    path.write_bytes(bytes(data))
    chain = read_wal_chain(root, STORE_UUID, 1)
    assert lsns_of(chain) == [[2], [11]]
    damaged = chain[position]
    assert damaged.header_damaged and "damaged file header" in damaged.repairs[0]
    assert "unchecked" not in damaged.repairs[0]


def test_a_header_beyond_repair_still_gives_its_records(root: Path) -> None:
    """Creation time and checksum both damaged: the header cannot be proven, but its
    records carry their own checksums and the file's name its place in the chain."""
    write_chain(root, [(1, [2]), (10, [11, 12])])
    path = wal_path(root, 10)
    data = bytearray(path.read_bytes())
    data[50:62] = b"\xff" * 12
    path.write_bytes(bytes(data))
    chain = read_wal_chain(root, STORE_UUID, 1)
    assert lsns_of(chain) == [[2], [11, 12]]
    assert chain[1].header_damaged and "unchecked" in chain[1].repairs[0]


def test_a_damaged_header_does_not_hide_a_missing_predecessor(root: Path) -> None:
    """The link is checked once the header is repaired: a missing middle file is
    still a broken chain."""
    write_chain(root, [(1, [2]), (10, [11]), (20, [21])])
    wal_path(root, 10).unlink()
    path = wal_path(root, 20)
    data = bytearray(path.read_bytes())
    data[3] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptionError, match="chain broken"):
        read_wal_chain(root, STORE_UUID, 1)


@pytest.mark.parametrize("size", [0, 10, WAL_FILE_HEADER_BYTES, 4096])
def test_newest_file_whose_header_never_landed_is_a_torn_rotation(root: Path, size: int) -> None:
    write_chain(root, [(1, [2, 3])])
    wal_path(root, 10).write_bytes(bytes(size))
    chain = read_wal_chain(root, STORE_UUID, 1)
    assert lsns_of(chain) == [[2, 3], []]
    assert chain[-1].torn_tail == "header never written"


def test_only_file_with_a_zeroed_header_has_no_records_to_lose(root: Path) -> None:
    """The checkpoint's file with its header zeroed (and nothing after it): there is
    no record to replay, so nothing is lost; the damage is reported."""
    wal_path(root, 1).write_bytes(bytes(WAL_FILE_HEADER_BYTES))
    chain = read_wal_chain(root, STORE_UUID, 1)
    assert lsns_of(chain) == [[]]
    assert chain[0].header_damaged and chain[0].torn_tail is None


# -- segments -------------------------------------------------------------------------


SEGMENT_BYTES = 16 * BLOCK_BYTES


def test_create_segment_preallocates_and_stamps_the_header(root: Path) -> None:
    segment = create_segment(
        root, 3, 77, size_bytes=SEGMENT_BYTES, store_uuid=STORE_UUID, direct=False
    )
    try:
        assert (segment.segment_id, segment.generation) == (3, 77)
        assert segment.head == BLOCK_BYTES
        assert segment.remaining() == SEGMENT_BYTES - BLOCK_BYTES
        path = segment_path(root, 3)
        assert segment.path == path
        assert path.stat().st_size == SEGMENT_BYTES
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        header = decode_segment_header(path.read_bytes()[:BLOCK_BYTES])
        assert (header.store_uuid, header.segment_id, header.generation) == (STORE_UUID, 3, 77)
        assert header.segment_bytes == SEGMENT_BYTES
        assert list_segment_files(root) == {3: path}
    finally:
        segment.close()
    segment.close()  # idempotent
    assert segment.fd == -1


def test_open_segment_checks_identity(root: Path) -> None:
    create_segment(
        root, 3, 77, size_bytes=SEGMENT_BYTES, store_uuid=STORE_UUID, direct=False
    ).close()
    segment = open_segment(root, 3, 77, 8192, store_uuid=STORE_UUID, direct=False)
    assert (segment.head, segment.size_bytes) == (8192, SEGMENT_BYTES)
    segment.close()
    with pytest.raises(CorruptionError, match="another store"):
        open_segment(root, 3, 77, 8192, store_uuid=OTHER_UUID, direct=False)
    with pytest.raises(CorruptionError, match="generation"):
        open_segment(root, 3, 78, 8192, store_uuid=STORE_UUID, direct=False)
    with pytest.raises(CorruptionError, match="missing"):
        open_segment(root, 4, 77, 8192, store_uuid=STORE_UUID, direct=False)


def test_open_segment_refuses_a_truncated_or_damaged_file(root: Path) -> None:
    create_segment(
        root, 3, 77, size_bytes=SEGMENT_BYTES, store_uuid=STORE_UUID, direct=False
    ).close()
    path = segment_path(root, 3)
    os.truncate(path, SEGMENT_BYTES - BLOCK_BYTES)
    with pytest.raises(CorruptionError, match="truncated"):
        open_segment(root, 3, 77, 4096, store_uuid=STORE_UUID, direct=False)
    os.truncate(path, 100)
    with pytest.raises(CorruptionError, match="shorter than its header"):
        open_segment(root, 3, 77, 4096, store_uuid=STORE_UUID, direct=False)
    with open(path, "r+b") as handle:
        handle.truncate(SEGMENT_BYTES)
        handle.seek(50)
        handle.write(b"\xff")
    with pytest.raises(CorruptionError, match="segment header"):
        open_segment(root, 3, 77, 4096, store_uuid=STORE_UUID, direct=False)


def test_create_segment_never_overwrites(root: Path) -> None:
    create_segment(
        root, 3, 77, size_bytes=SEGMENT_BYTES, store_uuid=STORE_UUID, direct=False
    ).close()
    before = segment_path(root, 3).read_bytes()
    with pytest.raises(IOFailure, match=r"0000000000000003\.seg"):
        create_segment(root, 3, 99, size_bytes=SEGMENT_BYTES, store_uuid=STORE_UUID, direct=False)
    assert segment_path(root, 3).read_bytes() == before


def test_recycle_segment_never_replaces_a_file_of_the_new_id(root: Path) -> None:
    """rename(2) replaces its target: recycling a freed segment under an id that
    something in segments/ already has would destroy that file."""
    old = create_segment(root, 3, 77, size_bytes=SEGMENT_BYTES, store_uuid=STORE_UUID, direct=False)
    create_segment(
        root, 4, 78, size_bytes=SEGMENT_BYTES, store_uuid=STORE_UUID, direct=False
    ).close()
    before = segment_path(root, 4).read_bytes()
    try:
        with pytest.raises(IOFailure, match=r"EEXIST"):
            recycle_segment(root, old, 4, 99, store_uuid=STORE_UUID)
        assert old.path == segment_path(root, 3) and old.path.exists()  # the caller unlinks it
        assert segment_path(root, 4).read_bytes() == before
    finally:
        old.close()

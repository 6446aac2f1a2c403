"""index/: the page table (LMDB + overlays), "newer LSN wins", checkpoints, verification.

LMDB has no checksums of its own, so every value read back must be verified
against its key; a value under the wrong key or a flipped byte is corruption.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import kvstore.index.lmdb_env as lmdb_env_module
from kvstore.errors import CorruptionError
from kvstore.format.entries import (
    SEGMENT_ACTIVE,
    SEGMENT_SEALED,
    PageEntry,
    encode_page_entry,
    segment_key,
)
from kvstore.index.lmdb_env import IndexEnv, decode_meta_u64, encode_meta_u64
from kvstore.index.recovery import apply_delete, apply_put
from kvstore.index.table import (
    META_PAGE_COUNT,
    PageTable,
    SegmentState,
    Tombstone,
    load_segments,
)


@pytest.fixture
def env(tmp_path: Path) -> Iterator[IndexEnv]:
    (tmp_path / "index").mkdir()
    opened = IndexEnv(tmp_path / "index", readonly=False, create=True)
    yield opened
    opened.close()


def entry(lsn: int, *, segment_id: int = 1, offset: int = 4096, size: int = 5000) -> PageEntry:
    return PageEntry(segment_id, 11, offset, size, 0xFACE + lsn, lsn, b'{"n":%d}' % lsn)


def checkpoint(table: PageTable, segments: dict[int, SegmentState] | None = None) -> None:
    frozen = table.freeze()
    table.commit_frozen(frozen, segments or {}, [], {META_PAGE_COUNT: table.page_count})


# -- meta values ----------------------------------------------------------------


def test_meta_u64_round_trip_and_key_binding() -> None:
    raw = encode_meta_u64(b"checkpoint_lsn", 2**64 - 1)
    assert decode_meta_u64(b"checkpoint_lsn", raw) == 2**64 - 1
    with pytest.raises(CorruptionError, match="checksum mismatch"):
        decode_meta_u64(b"lsn_lease", raw)
    with pytest.raises(CorruptionError, match="bad length"):
        decode_meta_u64(b"checkpoint_lsn", raw[:-1])


# -- page table -------------------------------------------------------------------


def test_put_get_and_count(env: IndexEnv) -> None:
    table = PageTable(env)
    assert table.get(b"a") is None
    assert table.put(b"a", entry(5)) == (True, None)
    assert table.put(b"b", entry(6)) == (True, None)
    assert table.get(b"a") == entry(5)
    assert len(table) == 2
    assert sorted(table.keys()) == [b"a", b"b"]


def test_newer_lsn_wins_in_either_arrival_order(env: IndexEnv) -> None:
    table = PageTable(env)
    assert table.put(b"k", entry(10)) == (True, None)
    assert table.put(b"k", entry(7)) == (False, None)  # older: ignored
    assert table.get(b"k") == entry(10)
    assert table.put(b"k", entry(12)) == (True, entry(10))  # newer: replaces
    assert table.get(b"k") == entry(12)
    assert len(table) == 1


def test_delete_leaves_a_tombstone_that_hides_older_puts(env: IndexEnv) -> None:
    table = PageTable(env)
    table.put(b"k", entry(10))
    assert table.delete(b"k", 8) is None  # older than the page: ignored
    assert table.get(b"k") == entry(10)
    assert table.delete(b"k", 20) == entry(10)
    assert table.active[b"k"] == Tombstone(20)
    assert table.get(b"k") is None
    assert len(table) == 0
    assert table.put(b"k", entry(15)) == (False, None)  # a put the delete overtook
    assert table.get(b"k") is None
    assert table.delete(b"k", 30) is None  # already gone
    assert table.put(b"k", entry(31)) == (True, None)
    assert len(table) == 1
    assert list(table.keys()) == [b"k"]


def test_checkpoint_moves_the_overlay_into_lmdb(env: IndexEnv) -> None:
    table = PageTable(env)
    for index in range(5):
        table.put(b"key-%d" % index, entry(10 + index))
    table.delete(b"key-4", 20)
    checkpoint(table)
    assert table.active == {}
    assert table.frozen is None
    fresh = PageTable(env)  # sees only LMDB
    assert len(fresh) == 4
    assert sorted(fresh.keys()) == [b"key-0", b"key-1", b"key-2", b"key-3"]
    assert fresh.get(b"key-2") == entry(12)
    assert fresh.get(b"key-4") is None


def test_overlay_shadows_lmdb_in_lookups_and_keys(env: IndexEnv) -> None:
    table = PageTable(env)
    table.put(b"a", entry(1))
    table.put(b"b", entry(2))
    table.put(b"c", entry(3))
    checkpoint(table)
    table.put(b"a", entry(10))
    table.delete(b"b", 11)
    table.put(b"d", entry(12))
    assert table.get(b"a") == entry(10)
    assert table.get(b"b") is None
    assert sorted(table.keys()) == [b"a", b"c", b"d"]
    assert dict(table.items()) == {b"a": entry(10), b"c": entry(3), b"d": entry(12)}
    assert len(table) == 3
    checkpoint(table)
    fresh = PageTable(env)
    assert dict(fresh.items()) == {b"a": entry(10), b"c": entry(3), b"d": entry(12)}
    assert len(fresh) == 3


def test_lookups_during_a_checkpoint_see_the_frozen_overlay(env: IndexEnv) -> None:
    table = PageTable(env)
    table.put(b"a", entry(1))
    frozen = table.freeze()
    assert table.get(b"a") == entry(1)  # from the frozen overlay
    table.put(b"b", entry(2))  # lands in the new active overlay
    assert sorted(table.keys()) == [b"a", b"b"]
    with pytest.raises(AssertionError):
        table.freeze()  # one checkpoint at a time
    table.commit_frozen(frozen, {}, [], {})
    assert table.get(b"a") == entry(1)  # now from LMDB
    assert table.get(b"b") == entry(2)


def test_value_under_the_wrong_key_is_corruption(env: IndexEnv) -> None:
    def swap(txn: object) -> None:
        txn.put(b"victim", encode_page_entry(b"other", entry(3)), db=env.pages)  # type: ignore[attr-defined]

    env.write(swap)
    table = PageTable(env)
    with pytest.raises(CorruptionError, match="victim"):
        table.get(b"victim")


def test_flipped_byte_in_lmdb_value_is_corruption(env: IndexEnv) -> None:
    raw = bytearray(encode_page_entry(b"k", entry(3)))
    raw[17] ^= 0x04

    def store(txn: object) -> None:
        txn.put(b"k", bytes(raw), db=env.pages)  # type: ignore[attr-defined]

    env.write(store)
    with pytest.raises(CorruptionError, match="checksum mismatch"):
        PageTable(env).get(b"k")


def test_segments_round_trip_through_lmdb(env: IndexEnv) -> None:
    table = PageTable(env)
    segments = {
        1: SegmentState(4, 65536, 12288, 1, 123, SEGMENT_SEALED),
        300: SegmentState(9, 8192, 8192, 1, 456, SEGMENT_ACTIVE),
    }
    frozen = table.freeze()
    table.commit_frozen(frozen, segments, [], {})
    assert load_segments(env) == segments
    frozen = table.freeze()
    table.commit_frozen(frozen, {}, [1], {})
    assert load_segments(env) == {300: segments[300]}


def test_corrupt_segment_entry_is_corruption(env: IndexEnv) -> None:
    def store(txn: object) -> None:
        txn.put(segment_key(2), b"\x00" * 56, db=env.segments)  # type: ignore[attr-defined]

    env.write(store)
    with pytest.raises(CorruptionError, match="segment table entry 2"):
        load_segments(env)


def test_write_grows_the_map_when_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lmdb_env_module, "INITIAL_MAP_BYTES", 64 << 10)
    (tmp_path / "index").mkdir()
    env = IndexEnv(tmp_path / "index", readonly=False, create=True)
    try:
        before = env.env.info()["map_size"]

        def fill(txn: object) -> None:
            for index in range(400):
                txn.put(b"key-%04d" % index, b"v" * 1000, db=env.pages)  # type: ignore[attr-defined]

        env.write(fill)
        assert env.env.info()["map_size"] > before
        with env.read() as txn:
            assert txn.get(b"key-0399", db=env.pages) == b"v" * 1000
    finally:
        env.close()


# -- recovery helpers --------------------------------------------------------------------


def test_apply_put_and_delete_keep_segment_accounting(env: IndexEnv) -> None:
    table = PageTable(env)
    segments = {1: SegmentState(11, 4096, 0, 0, 0, SEGMENT_ACTIVE)}
    assert apply_put(table, segments, b"a", entry(5, offset=4096)) is True
    assert apply_put(table, segments, b"b", entry(6, offset=16384)) is True
    assert segments[1].head_bytes == 16384 + 12288
    assert (segments[1].live_bytes, segments[1].live_pages) == (2 * 12288, 2)
    # Overwrite: the old copy stops being live.
    assert apply_put(table, segments, b"a", entry(7, offset=28672, size=1)) is True
    assert (segments[1].live_bytes, segments[1].live_pages) == (2 * 12288 + 8192 - 12288, 2)
    # A stale put changes nothing but the head.
    assert apply_put(table, segments, b"a", entry(4, offset=36864)) is False
    assert (segments[1].live_bytes, segments[1].live_pages) == (12288 + 8192, 2)
    assert segments[1].head_bytes == 36864 + 12288
    assert apply_delete(table, segments, b"b", 8) == entry(6, offset=16384)
    assert (segments[1].live_bytes, segments[1].live_pages) == (8192, 1)
    assert apply_delete(table, segments, b"b", 9) is None


def test_apply_put_into_an_unknown_segment_is_corruption(env: IndexEnv) -> None:
    table = PageTable(env)
    with pytest.raises(CorruptionError, match="segment 1"):
        apply_put(table, {}, b"a", entry(5))
    wrong_generation = {1: SegmentState(12, 4096, 0, 0, 0, SEGMENT_ACTIVE)}
    with pytest.raises(CorruptionError, match="generation 11"):
        apply_put(table, wrong_generation, b"a", entry(5))
    assert table.get(b"a") is None


def test_a_segment_key_longer_than_8_bytes_is_corruption(tmp_path: Path) -> None:
    """A damaged B-tree can return a segment key of any length; its id (>= 2**64)
    once escaped as struct.error from open (found by the 100k corruption sweep)."""
    from kvstore.format.entries import decode_segment_entry
    from kvstore.index.table import load_segments

    with pytest.raises(CorruptionError, match="out of range"):
        decode_segment_entry(1 << 64, b"\x00" * 48)
    env = IndexEnv(tmp_path / "index", readonly=False, create=True)
    try:
        with env.env.begin(write=True) as txn:
            txn.put(b"\x01" * 9, b"\x00" * 48, db=env.segments)
        with pytest.raises(CorruptionError, match="malformed key"):
            load_segments(env)
    finally:
        env.close()


def test_sync_failure_is_an_io_failure_naming_the_index(env: IndexEnv) -> None:
    """``IndexEnv.sync`` (recover's and salvage's one explicit LMDB sync) turns LMDB's
    error into IOFailure, which the CLI reports, instead of a raw lmdb.Error."""
    import lmdb

    from kvstore.errors import IOFailure

    env.sync()  # a healthy environment syncs

    class Failing:
        def sync(self, force: bool) -> None:
            raise lmdb.DiskError("injected")

    real = env.env
    env.env = Failing()
    try:
        with pytest.raises(IOFailure, match=r"LMDB sync of .*index.* failed: injected"):
            env.sync()
    finally:
        env.env = real

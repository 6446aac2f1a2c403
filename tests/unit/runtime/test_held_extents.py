"""``KVStore.held_extents``: verified, held payload extents for readers outside the store
(the GDS path reads them with cuFile). While held, an overwrite, a delete or a GC pass
never makes an extent read anything but the page's own bytes."""

from __future__ import annotations

import os

import pytest

from kvstore import CorruptionError
from kvstore.format.constants import BLOCK_BYTES
from tests.conftest import OpenStore

PAGE = 64 << 10


def page(index: int, version: int = 0) -> bytes:
    return (bytes([index % 251, version]) * (PAGE // 2))[:PAGE]


def read_extent(path: str, offset: int, length: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


def test_extents_name_each_payload_and_none_for_a_miss(open_store: OpenStore) -> None:
    store = open_store(gc_interval_s=0)
    store.put_many([(f"k{i}", page(i), {"i": i}) for i in range(3)])
    with store.held_extents(["k0", "absent", "k2"]) as extents:
        first, missing, last = extents
        assert missing is None
        assert first is not None and last is not None
        for extent, index in ((first, 0), (last, 2)):
            assert extent.offset % BLOCK_BYTES == 0 and extent.length == PAGE
            data = read_extent(extent.path, extent.offset, extent.length)
            assert data == page(index) and extent.matches(data)
            assert extent.meta == {"i": index}
        assert not first.matches(page(9))


def test_an_overwrite_delete_and_gc_while_held_leave_the_old_bytes(
    open_store: OpenStore,
) -> None:
    # Small segments: the overwrites fill them, and GC would free the held one.
    store = open_store(gc_interval_s=0, segment_bytes=1 << 20, gc_live_ratio=0.99)
    store.put_many([(f"k{i}", page(i)) for i in range(12)])
    store.flush()
    with store.held_extents(["k0"]) as (extent,):
        assert extent is not None
        segment = extent.segment_id
        for version in (1, 2):
            store.put_many([(f"k{i}", page(i, version)) for i in range(12)])
        store.delete("k0")
        store.flush()
        store.gc()
        assert segment in store.segment_states()  # held: not freed, not reused
        data = read_extent(extent.path, extent.offset, extent.length)
        assert data == page(0) and extent.matches(data)
    store.gc()
    assert segment not in store.segment_states()  # the hold ended: GC frees it now


def test_a_record_that_is_not_the_page_is_refused(open_store: OpenStore) -> None:
    store = open_store(gc_interval_s=0)
    store.put("k", page(1))
    store.flush()
    with store.held_extents(["k"]) as (extent,):
        assert extent is not None
        path, header_at = extent.path, extent.offset - BLOCK_BYTES
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, b"\xff" * 16, header_at + 8)  # damage the record header
    finally:
        os.close(fd)
    with pytest.raises(CorruptionError, match="page b'k'"), store.held_extents(["k"]):
        pass
    assert store.internals.segment_reads() == {}  # nothing stays held after the refusal

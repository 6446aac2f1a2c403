"""Lookup fast paths: ``PageTable.contains`` (no decode), the short LMDB read, pin_many."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvstore import KVStore, PinError
from tests.conftest import open_small_store


def test_lookups_see_every_checkpoint(tmp_path: Path) -> None:
    with open_small_store(tmp_path / "s") as store:
        store.put(b"a", b"1")
        store.checkpoint()
        assert b"a" in store and store.info(b"a") is not None
        store.put(b"a", b"22")
        store.put(b"b", b"3")
        store.delete(b"a")
        store.checkpoint()
        assert b"a" not in store and store.info(b"a") is None
        assert b"b" in store and store.get(b"b") == b"3"


def test_lookups_from_other_threads_after_checkpoint(tmp_path: Path) -> None:
    with open_small_store(tmp_path / "s") as store:
        store.put_many([(b"k%d" % i, b"v") for i in range(100)])
        store.checkpoint()
        seen: list[bool] = []
        thread = threading.Thread(target=lambda: seen.append(b"k5" in store))
        thread.start()
        thread.join()
        store.delete(b"k5")
        store.checkpoint()
        thread = threading.Thread(target=lambda: seen.append(b"k5" in store))
        thread.start()
        thread.join()
        assert seen == [True, False]


def test_contains_agrees_with_get_for_overlay_tombstone_and_lmdb(tmp_path: Path) -> None:
    with open_small_store(tmp_path / "s") as store:
        store.put_many([(b"lmdb", b"x"), (b"gone", b"x")])
        store.checkpoint()
        store.put(b"overlay", b"y")
        store.delete(b"gone")  # tombstone over an LMDB entry
        for key in (b"lmdb", b"overlay", b"gone", b"never"):
            assert (key in store) == (store.get(key) is not None)


def test_pin_many_and_unpin_many(tmp_path: Path) -> None:
    with open_small_store(tmp_path / "s") as store:
        store.put_many([(b"a", b"1"), (b"b", b"2")])
        assert store.pin_many([b"a", b"missing", b"b", b"a"]) == [True, False, True, True]
        assert store.pin_count(b"a") == 2 and store.pin_count(b"b") == 1
        with pytest.raises(PinError):
            store.unpin_many([b"b", b"b"])  # b holds one pin: nothing is unpinned
        assert store.pin_count(b"b") == 1
        store.unpin_many([b"a", b"b", b"a"])
        assert store.pin_count(b"a") == 0 and store.pin_count(b"b") == 0
        with store.pinned([b"a", b"missing"]) as pinned:
            assert pinned == [True, False] and store.pin_count(b"a") == 1
        assert store.pin_count(b"a") == 0
        store.unpin_many([])


def test_reopen_after_cached_reads(tmp_path: Path) -> None:
    with open_small_store(tmp_path / "s") as store:
        store.put(b"a", b"1")
        store.checkpoint()
        assert b"a" in store
    with KVStore.open(tmp_path / "s") as store:
        assert store.get(b"a") == b"1"

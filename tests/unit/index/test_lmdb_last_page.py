"""An LMDB file may end before the last page its meta page names.

LMDB can count as used a page it never wrote (allocated and freed again within
one transaction); such a ``data.mdb`` is sound. The open-time size check took
it for a truncated index and refused the store ("the LMDB index ... is
truncated ... run `kvstore recover PATH`"): the multi-threaded kill -9 loop met
it every few dozen cycles. Only a page reachable from the roots past the end of
the file is damage (LMDB would SIGBUS on it). Each open runs in a forked child,
so a SIGBUS fails the test instead of killing pytest.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from kvstore import KVStore
from kvstore.index import lmdb_verify
from kvstore.index.lmdb_verify import verify_lmdb_file
from tests.conftest import open_small_store, run_in_child

PAGE = 4096
_LAST_PAGE_AT = 16 + 24 + 2 * 48  # page header, magic..mapsize, two database records


def _current_meta(data: bytes) -> int:
    """The page number (0 or 1) of the meta page with the higher txnid."""
    txnids = [struct.unpack_from("<Q", data, pgno * PAGE + _LAST_PAGE_AT + 8)[0] for pgno in (0, 1)]
    return 0 if txnids[0] >= txnids[1] else 1


def _name_pages_past_the_end(path: Path, extra: int) -> int:
    """Make the current meta page name ``extra`` pages past the end; its new last page."""
    data = bytearray(path.read_bytes())
    at = _current_meta(data) * PAGE + _LAST_PAGE_AT
    last = len(data) // PAGE - 1 + extra
    struct.pack_into("<Q", data, at, last)
    path.write_bytes(bytes(data))
    return last


def _reachable(path: Path) -> set[int]:
    """Every page reachable from the current meta page's roots (the free and main DBs)."""
    data = path.read_bytes()
    at = _current_meta(data) * PAGE + 16 + 24
    walker = lmdb_verify._Walker(data, PAGE, len(data) // PAGE - 1)  # type: ignore[arg-type]
    for index in (0, 1):
        root = lmdb_verify._DB.unpack_from(data, at + index * lmdb_verify._DB.size)[7]
        walker.visit(root, "meta")
    assert not walker.problems, walker.problems
    return walker.seen


def _pages(count: int) -> dict[str, bytes]:
    return {f"p{i}": bytes([i % 251]) * (3000 + i) for i in range(count)}


def test_an_index_naming_unwritten_pages_past_its_end_opens(store_path: Path) -> None:
    pages = _pages(40)
    with open_small_store(store_path) as store:
        for key, value in pages.items():
            store.put(key, value)
    data = store_path / "index" / "data.mdb"
    _name_pages_past_the_end(data, 3)
    assert verify_lmdb_file(data) == []

    def use_it() -> str:
        with KVStore.open(store_path) as store:
            assert store.get_many(list(pages)) == list(pages.values())
            store.put("after", b"a" * 5000)
            store.checkpoint()  # LMDB writes new pages past the unwritten ones
        with KVStore.open(store_path, readonly=True) as reader:
            assert reader.get("after") == b"a" * 5000
            assert reader.get_many(list(pages)) == list(pages.values())
        return "ok"

    assert run_in_child(use_it) == "ok"


def test_an_index_cut_before_a_reachable_page_opens_degraded(store_path: Path) -> None:
    """LMDB must not read such a file (SIGBUS); the open salvages what verifies
    instead: a read-only open into a private copy, a writer into the store."""
    pages = _pages(40)
    with open_small_store(store_path) as store:
        for key, value in pages.items():
            store.put(key, value)
    data = store_path / "index" / "data.mdb"
    highest = max(_reachable(data))
    os.truncate(data, highest * PAGE)  # the highest reachable page is gone
    assert verify_lmdb_file(data) != []

    def open_it(readonly: bool) -> str:
        with KVStore.open(store_path, readonly=readonly) as store:
            stats = store.stats()
            got = store.get_many(list(pages))
        wrong = [
            key for key, value in zip(pages, got, strict=True) if value not in (None, pages[key])
        ]
        misses = sum(value is None for value in got)
        assert not wrong, wrong
        assert stats.index_salvaged and stats.degraded, stats
        assert stats.quarantined_pages == misses, (stats.quarantined_pages, misses)
        return "opened"

    assert run_in_child(lambda: open_it(True)) == "opened"
    assert verify_lmdb_file(data) != []  # a read-only open changed nothing
    assert run_in_child(lambda: open_it(False)) == "opened"
    assert verify_lmdb_file(data) == []  # the writer swapped a rebuilt index in
    assert [p.name for p in store_path.glob("index.damaged-*")]

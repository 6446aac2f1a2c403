"""A store written by the old code opens and reads back bit for bit in the new code.

``fixtures/format_v1_store.tar.gz`` was written by kvstore before ``KVStore`` was taken
apart into the layers of docs/design.md (``fixtures/make_format_v1_store.py`` says how):
pages of several sizes and metas, retains, deletes, an overwrite, a GC pass that moved
pages and freed segments after the last checkpoint, and a live WAL tail (the writer died
without close). Whatever the store's code becomes, opening that store must replay
the tail and serve exactly the acknowledged pages; ``kvstore recover`` must rebuild
the same page set from the segments alone. Never regenerate the fixture to make
this test pass.
"""

from __future__ import annotations

import hashlib
import json
import tarfile
from pathlib import Path
from typing import Any

from kvstore import KVStore
from kvstore.check import check_store
from kvstore.recover import recover_store

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MANIFEST: dict[str, Any] = json.loads((FIXTURES / "format_v1_store.json").read_text())


def unpack(dest: Path) -> Path:
    root = dest / "store"
    with tarfile.open(FIXTURES / "format_v1_store.tar.gz") as tar:
        tar.extractall(root, filter="data")
    return root


def assert_reads_back(store: KVStore) -> None:
    pages = MANIFEST["pages"]
    assert sorted(map(bytes.decode, store.keys())) == sorted(pages)
    for name, want in pages.items():
        key = name.encode()
        data = store.get(key)
        assert data is not None, name
        assert len(data) == want["bytes"], name
        assert hashlib.sha256(data).hexdigest() == want["sha256"], name
        info = store.info(key)
        assert info is not None and info.meta == (want["meta"] or {}), name
        assert store.is_retained(key) == (name in MANIFEST["retained"]), name
    for name in MANIFEST["deleted"]:
        assert store.get(name.encode()) is None, name


def test_the_fixture_covers_what_it_claims() -> None:
    assert len(MANIFEST["pages"]) == 49 and len(MANIFEST["deleted"]) == 21
    assert MANIFEST["retained"] == ["page-003", "page-017", "page-055"]
    assert MANIFEST["gc"]["pages_moved"] > 0 and MANIFEST["gc"]["segments_freed"] > 0
    assert MANIFEST["pages"]["page-050"]["meta"] == {"overwritten": True}
    with tarfile.open(FIXTURES / "format_v1_store.tar.gz") as tar:
        names = tar.getnames()
    assert any(n.startswith("wal/") and n.endswith(".wal") for n in names)
    assert "KVSTORE" in names and "index/data.mdb" in names


def test_old_store_opens_replays_its_wal_and_reads_back(tmp_path: Path, engine_kind: str) -> None:
    engine = engine_kind
    root = unpack(tmp_path)
    store = KVStore.open(root, io_engine=engine, gc_interval_s=0)
    try:
        assert store.replayed_records > 0  # the tail was live: opening replayed it
        assert_reads_back(store)
        assert list(check_store(store, deep=True)) == []
    finally:
        store.close()
    # Closed by the new code (a checkpoint), reopened: the same pages.
    with KVStore.open(root, io_engine=engine, gc_interval_s=0) as again:
        assert again.replayed_records == 0
        assert_reads_back(again)


def test_old_store_read_only_view(tmp_path: Path) -> None:
    root = unpack(tmp_path)
    with KVStore.open(root, readonly=True) as view:
        assert_reads_back(view)


def test_recover_rebuilds_the_old_store_from_its_segments(tmp_path: Path) -> None:
    """``kvstore recover`` on the old store (its index and WAL tail vouching for the
    pages): the rebuilt index serves the same pages."""
    root = unpack(tmp_path)
    report = recover_store(root)
    assert not report.lost, report.dropped_by_reason()
    assert report.wal_records_used > 0
    with KVStore.open(root, gc_interval_s=0) as store:
        assert_reads_back(store)

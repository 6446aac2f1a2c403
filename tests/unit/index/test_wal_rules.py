"""The one set of WAL-apply rules (kvstore/index/rules.py), shared by the store's
replay and ``kvstore recover``, and the MOVE rule's decided cases."""

from __future__ import annotations

import hashlib
import json
import shutil
import tarfile
from pathlib import Path

import pytest

from kvstore import KVStore
from kvstore.format.entries import PageEntry
from kvstore.index.rules import delete_applies, move_applies, put_applies
from kvstore.index.table import Tombstone
from kvstore.recover import recover_store

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def page(lsn: int, segment: int = 3, generation: int = 7, offset: int = 4096) -> PageEntry:
    return PageEntry(segment, generation, offset, 100, 0xABC, lsn, b"")


OLD = (3, 7, 4096)


@pytest.mark.parametrize(
    ("now", "lsn", "applies", "why"),
    [
        (page(10), 10, True, "still where compaction found it, same LSN"),
        (page(10, offset=8192), 10, False, "moved elsewhere since (another MOVE won)"),
        (page(10, generation=8), 10, False, "the segment was reused: another page"),
        (page(12), 10, False, "overwritten after the copy: the overwrite wins"),
        (Tombstone(12), 10, False, "deleted after the copy: the delete wins"),
        (Tombstone(10), 10, False, "deleted at the page's own LSN"),
        (page(8), 10, True, "known state older than the moved page: the MOVE is newer news"),
        (Tombstone(8), 10, True, "deleted before the moved page was put"),
        (None, 10, True, "nothing known (recover without an index): the MOVE vouches"),
    ],
)
def test_move_rule(now: object, lsn: int, applies: bool, why: str) -> None:
    assert move_applies(now, lsn, OLD) is applies, why  # type: ignore[arg-type]


@pytest.mark.parametrize("rule", [put_applies, delete_applies])
def test_put_and_delete_rules_newer_or_equal_wins(rule: object) -> None:
    assert rule(None, 5)  # type: ignore[operator]
    assert rule(page(5), 5) and rule(page(4), 5)  # type: ignore[operator]
    assert rule(Tombstone(5), 5) and not rule(Tombstone(6), 5)  # type: ignore[operator]
    assert not rule(page(6), 5)  # type: ignore[operator]


def test_recover_without_an_index_keeps_what_the_wal_vouches_for(tmp_path: Path) -> None:
    """The golden store's GC moved four pages after its last checkpoint, whose PUTs
    were in WAL files the checkpoint dropped. With the index gone, those MOVE records
    are all that vouches for the pages: recover keeps them (nothing known: the MOVE
    applies), beside the tail's own PUTs, and drops the pages only the index knew."""
    root = tmp_path / "store"
    with tarfile.open(FIXTURES / "format_v1_store.tar.gz") as tar:
        tar.extractall(root, filter="data")
    shutil.rmtree(root / "index")
    manifest = json.loads((FIXTURES / "format_v1_store.json").read_text())
    report = recover_store(root)
    kept = sorted(k.key for k in report.kept)
    moved = [b"page-003", b"page-005", b"page-011", b"page-017"]
    tail = [b"page-050", *(b"page-%03d" % i for i in range(60, 70))]
    assert kept == sorted(moved + tail)
    assert report.kept_by_source == {"wal": len(kept)}
    assert set(report.dropped_by_reason) <= {"unvouched", "superseded", "deleted"}
    # What it kept is exactly what was acknowledged for those keys.
    with KVStore.open(root, gc_interval_s=0) as store:
        for key in kept:
            data = store.get(key)
            assert data is not None
            assert hashlib.sha256(data).hexdigest() == manifest["pages"][key.decode()]["sha256"]

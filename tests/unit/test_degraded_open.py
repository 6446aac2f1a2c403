"""Degrade, don't refuse (docs/operations.md, "Degraded open"): a damaged segment
header, WAL file header or LMDB index opens the store; only an unprovable superblock
refuses it, naming the fix.

Every test checks the three things the contract promises: the store opens,
every page it serves is exactly what was put (never an older version, never a
deleted key), and what it lost or worked around is visible in ``stats()``,
``kvstore stat --json``, the Prometheus metrics and ``kvstore fsck``.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kvstore import KVStore
from kvstore.cli import main
from kvstore.errors import CorruptionError
from kvstore.format.constants import BLOCK_BYTES
from kvstore.format.names import (
    INDEX_DIR,
    SEGMENTS_DIR,
    SUPERBLOCK_NAME,
    WAL_DIR,
    segment_path,
)
from kvstore.format.wal import iter_records
from kvstore.recover import recover_store
from kvstore.testing import corruption as sweep
from tests.conftest import SMALL_MAX_PAGE_BYTES, SMALL_SEGMENT_BYTES

OPTIONS: dict[str, Any] = {
    "segment_bytes": SMALL_SEGMENT_BYTES,
    "max_page_bytes": SMALL_MAX_PAGE_BYTES,
    "gc_interval_s": 0,  # nothing moves pages out of a quarantined segment meanwhile
    "checkpoint_interval_s": 3600,
}


class Oracle:
    """What was put and deleted: every page read back must be one of these."""

    def __init__(self) -> None:
        self.pages: dict[str, bytes] = {}
        self.deleted: set[str] = set()
        self.older: dict[str, bytes] = {}

    def check(self, store: KVStore) -> int:
        """Assert no wrong, older or resurrected page; return how many were missed."""
        missed = 0
        for key, value in self.pages.items():
            got = store.get(key)
            if got is None:
                missed += 1
                continue
            assert got == value, (key, "an older version" if got == self.older.get(key) else "")
        for key in self.deleted:
            assert store.get(key) is None, f"deleted {key} came back"
        return missed


def build(path: Path, *, crash_wal: bool = True) -> Oracle:
    """Pages over several segments, checkpointed ones and (``crash_wal``) WAL-only
    ones with an overwrite and deletes that only the WAL holds."""
    oracle = Oracle()
    store = KVStore.open(path, create=True, **OPTIONS)
    try:
        for index in range(60):
            key = f"k{index}"
            oracle.pages[key] = bytes([index]) * (20_000 + 37 * index)
            store.put(key, oracle.pages[key])
        for index in range(0, 60, 7):
            store.delete(f"k{index}")
            oracle.deleted.add(f"k{index}")
            del oracle.pages[f"k{index}"]
        store.checkpoint()
        for index in range(60, 75):
            key = f"k{index}"
            oracle.pages[key] = bytes([index]) * 9_000
            store.put(key, oracle.pages[key])
        oracle.older["k1"] = oracle.pages["k1"]
        oracle.pages["k1"] = b"newer" * 1000  # only the WAL knows this version
        store.put("k1", oracle.pages["k1"])
        for key in ("k2", "k61"):  # deletes only the WAL holds
            store.delete(key)
            oracle.deleted.add(key)
            del oracle.pages[key]
        store.flush()
    finally:
        if crash_wal:
            store.internals.abandon()  # a crash: no checkpoint, the WAL keeps the rest
        else:
            store.close()
    return oracle


def flip(path: Path, offset: int, mask: int = 0x10) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ mask]))


def segment_files(root: Path) -> list[Path]:
    return sorted((root / SEGMENTS_DIR).iterdir())


def wal_files(root: Path) -> list[Path]:
    return sorted((root / WAL_DIR).iterdir())


def stat_json(root: Path) -> dict[str, Any]:
    result = CliRunner().invoke(main, ["stat", str(root), "--json"])
    assert result.exit_code == 0, result.output
    data: dict[str, Any] = json.loads(result.output)
    return data


def metric(store: KVStore, name: str) -> float:
    from prometheus_client import generate_latest

    for line in generate_latest(store.metrics_registry()).decode().splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


# -- segment headers ------------------------------------------------------------------


@pytest.mark.parametrize(
    "offset",
    [0, 9, 20, 33, 41, 50, 60, 100, 2000, BLOCK_BYTES - 3],
    ids=lambda o: f"byte{o}",
)
def test_a_flipped_segment_header_byte_opens_and_serves_every_page(
    store_path: Path, offset: int
) -> None:
    oracle = build(store_path)
    damaged = segment_files(store_path)[1]
    flip(damaged, offset)
    before = damaged.read_bytes()
    with KVStore.open(store_path, **OPTIONS) as store:
        assert oracle.check(store) == 0  # every page verified and served
        stats = store.stats()
        assert stats.degraded and stats.quarantined_segments == 1
        assert stats.salvaged_pages > 0 and stats.quarantined_pages == 0
        assert metric(store, "kvstore_quarantined_segments") == 1
        assert metric(store, "kvstore_degraded") == 1
        store.put_many([(f"new{i}", b"n" * 30_000) for i in range(40)])  # rolls segments
        assert oracle.check(store) == 0
    assert damaged.read_bytes() == before  # a quarantined file is never written
    data = stat_json(store_path)  # and found again by the next open
    assert data["degraded"] and data["quarantined_segments"] == 1
    assert "quarantined" in data["degraded_reasons"][0]
    shown = CliRunner().invoke(main, ["stat", str(store_path)])
    assert shown.exit_code == 0 and "DEGRADED" in shown.output


def _kvstore_threads(other_than: set[threading.Thread]) -> list[str]:
    return [
        thread.name
        for thread in threading.enumerate()
        if thread not in other_than and thread.name.startswith("kvstore-") and thread.is_alive()
    ]


def test_an_abandoned_writer_leaves_no_thread_that_makes_a_segment(store_path: Path) -> None:
    """CI once failed the test above ([byte4093], under load) with EEXIST for
    0000000000000004.seg at the first roll. ``abandon()`` (build()'s crash) freed the
    store's files but left its threads running: the prepare thread, its spare removed,
    made another one (id 4) up to half a second later, after the next open's orphan
    sweep had run and given its writer that very id. No thread of a crashed store may
    outlive ``abandon()``."""
    before = set(threading.enumerate())
    oracle = build(store_path)
    assert _kvstore_threads(before) == []  # was: kvstore-flush, -telemetry, -prepare
    flip(segment_files(store_path)[1], BLOCK_BYTES - 3)  # the active segment: quarantined
    with KVStore.open(store_path, **OPTIONS) as store:
        store.put_many([(f"new{i}", b"n" * 30_000) for i in range(40)])  # rolls at once
        assert oracle.check(store) == 0
        assert store.stats().quarantined_segments == 1
    assert _kvstore_threads(before) == []  # close() joins them too


def test_an_open_gives_the_writer_no_segment_id_whose_name_is_taken(store_path: Path) -> None:
    """The orphan sweep leaves a directory named like a segment alone; the writer's
    next segment id must still be past it (and past every name in segments/), or
    its O_EXCL create fails (EEXIST) and the writer stops."""
    oracle = build(store_path)
    flip(segment_files(store_path)[1], BLOCK_BYTES - 3)  # the first put rolls
    top = max(int(path.name.split(".")[0], 16) for path in segment_files(store_path))
    taken = [segment_path(store_path, top + n) for n in range(1, 9)]
    for path in taken:
        path.mkdir()
    with KVStore.open(store_path, **OPTIONS) as store:
        assert store.internals.state.next_segment_id > top + 8
        store.put_many([(f"new{i}", b"n" * 30_000) for i in range(40)])
        assert oracle.check(store) == 0
    assert all(path.is_dir() for path in taken)
    with KVStore.open(store_path, **OPTIONS) as store:
        assert store.get("new39") == b"n" * 30_000


def test_fsck_repair_rewrites_a_quarantined_segment_header(store_path: Path) -> None:
    oracle = build(store_path)
    flip(segment_files(store_path)[0], 44)  # the generation
    runner = CliRunner()
    checked = runner.invoke(main, ["fsck", str(store_path), "--json"])
    assert checked.exit_code == 4, checked.output
    findings = json.loads(checked.output)
    header = [f for f in findings if f["kind"] == "segment-header"]
    assert header and "--repair" in header[0]["message"]
    repaired = runner.invoke(main, ["fsck", str(store_path), "--repair", "--json"])
    assert repaired.exit_code == 1, repaired.output
    with KVStore.open(store_path, **OPTIONS) as store:
        assert not store.stats().degraded  # healthy again
        assert oracle.check(store) == 0
        assert store.check(deep=True) == []


def test_gc_moves_a_quarantined_segments_pages_out_and_removes_its_file(
    store_path: Path,
) -> None:
    oracle = build(store_path, crash_wal=False)
    damaged = segment_files(store_path)[0]
    segment_id = int(damaged.name.split(".")[0], 16)
    flip(damaged, 30)
    with KVStore.open(store_path, **OPTIONS) as store:
        inside = [key for key in oracle.pages if store.info(key).segment_id == segment_id]
        for key in inside[:-2]:  # a sparse segment: GC compacts it
            store.delete(key)
            oracle.deleted.add(key)
            del oracle.pages[key]
        report = store.gc()
        assert report.segments_freed >= 1 and report.pages_moved == 2
        assert oracle.check(store) == 0
    assert not damaged.exists()  # never recycled: its read-only file is removed
    with KVStore.open(store_path, **OPTIONS) as store:
        assert not store.stats().degraded
        assert oracle.check(store) == 0


def test_a_truncated_segment_loses_only_what_is_gone(store_path: Path) -> None:
    oracle = build(store_path)
    damaged = segment_files(store_path)[0]
    os.truncate(damaged, damaged.stat().st_size // 2)
    with KVStore.open(store_path, **OPTIONS) as store:
        stats = store.stats()
        missed = oracle.check(store)
        assert stats.quarantined_segments == 1
        assert missed == stats.quarantined_pages > 0 and stats.salvaged_pages > 0
        assert metric(store, "kvstore_quarantined_pages") == missed


def test_a_missing_segment_file_loses_its_pages_and_heals_after_a_checkpoint(
    store_path: Path,
) -> None:
    oracle = build(store_path)
    segment_files(store_path)[1].unlink()
    with KVStore.open(store_path, **OPTIONS) as store:
        stats = store.stats()
        missed = oracle.check(store)
        assert missed == stats.quarantined_pages > 0
        assert stats.quarantined_segments == 1 and stats.salvaged_pages == 0
        assert len(store) == len(oracle.pages) - missed  # they are gone, not errors
    with KVStore.open(store_path, **OPTIONS) as store:  # the close checkpointed the loss
        assert not store.stats().degraded
        assert oracle.check(store) == missed
        assert store.check(deep=True) == []


# -- WAL file headers -------------------------------------------------------------------


@pytest.mark.parametrize("offset", [0, 12, 20, 36, 44, 52, 60], ids=lambda o: f"byte{o}")
def test_a_flipped_wal_header_byte_loses_no_change(store_path: Path, offset: int) -> None:
    """The WAL-only overwrite of k1 and the WAL-only deletes of k2 and k61 live in the
    damaged file: none may be lost (no older version, no resurrected delete)."""
    oracle = build(store_path)
    newest = wal_files(store_path)[-1]
    assert iter_records(newest.read_bytes()).records  # the WAL-only changes are here
    flip(newest, offset, 0x01)
    with KVStore.open(store_path, **OPTIONS) as store:
        assert oracle.check(store) == 0
        stats = store.stats()
        assert stats.degraded and stats.damaged_wal_headers == 1
        assert stats.salvaged_wal_records > 0 and stats.quarantined_pages == 0
        assert metric(store, "kvstore_damaged_wal_headers") == 1
    with KVStore.open(store_path, **OPTIONS) as store:  # the checkpoint retired the file
        assert not store.stats().degraded
        assert oracle.check(store) == 0


def test_a_wal_header_beyond_repair_still_replays_its_records(store_path: Path) -> None:
    oracle = build(store_path)
    newest = wal_files(store_path)[-1]
    with open(newest, "r+b") as handle:  # creation time and checksum: unprovable
        handle.seek(50)
        handle.write(b"\xa5" * 12)
    with KVStore.open(store_path, readonly=True) as store:
        assert oracle.check(store) == 0
        stats = store.stats()
        assert stats.damaged_wal_headers == 1
        assert any("unchecked" in reason for reason in stats.degraded_reasons)


# -- the LMDB index -------------------------------------------------------------------


def _damage_a_leaf(root: Path) -> None:
    """Flip the high byte of a leaf node's offset (LMDB would read outside the page)."""
    path = root / INDEX_DIR / "data.mdb"
    data = path.read_bytes()
    used = [r for r in sweep.map_regions(root) if r.kind == "lmdb-used-page"]
    at = next(
        offset
        for region in used
        for offset in range(region.start, region.end)
        if offset % 2 == 0 and sweep.lmdb_field(data, offset) == "leaf.node-offsets"
    )
    flip(path, at + 1, 0x40)


def test_a_damaged_index_is_salvaged_at_open_and_never_fails_close(store_path: Path) -> None:
    oracle = build(store_path, crash_wal=False)
    _damage_a_leaf(store_path)
    with KVStore.open(store_path, readonly=True) as reader:  # a private salvage
        assert reader.stats().index_salvaged
        assert oracle.check(reader) == reader.stats().quarantined_pages
    store = KVStore.open(store_path, **OPTIONS)
    stats = store.stats()
    assert stats.index_salvaged and stats.degraded and stats.index_check_seconds > 0
    missed = oracle.check(store)
    assert missed == stats.quarantined_pages
    store.put("after", b"a" * 5000)
    store.close()  # before: IOFailure (MDB_CORRUPTED) from the checkpoint here
    assert list(store_path.glob(f"{INDEX_DIR}.damaged-*"))
    with KVStore.open(store_path, **OPTIONS) as store:
        assert not store.stats().degraded
        assert store.get("after") == b"a" * 5000
        assert oracle.check(store) == missed
        assert store.check(deep=True) == []


def test_a_damaged_value_the_wal_replays_over_is_absent_not_a_refusal(
    store_path: Path,
) -> None:
    store = KVStore.open(store_path, create=True, **OPTIONS)
    store.put("victim-key", b"old" * 1000)
    store.put("other", b"o" * 1000)
    store.checkpoint()
    store.put("victim-key", b"new" * 1000)  # only the WAL has it
    store.flush()
    store.internals.abandon()
    data = (store_path / INDEX_DIR / "data.mdb").read_bytes()
    at = data.index(b"victim-key") + len(b"victim-key") + 5  # inside its LMDB value
    flip(store_path / INDEX_DIR / "data.mdb", at)
    with KVStore.open(store_path, **OPTIONS) as store:  # refused before (CorruptionError)
        assert store.get("victim-key") == b"new" * 1000
        assert store.get("other") == b"o" * 1000
        assert any("fail their checksum" in r for r in store.stats().degraded_reasons)


def test_an_interrupted_index_swap_is_finished_by_the_next_open(store_path: Path) -> None:
    oracle = build(store_path, crash_wal=False)
    # A crash after the damaged index was renamed aside, before the stage moved in.
    shutil.copytree(store_path / INDEX_DIR, store_path / "index.salvage")
    os.rename(store_path / INDEX_DIR, store_path / "index.damaged-1")
    with KVStore.open(store_path, **OPTIONS) as store:
        assert oracle.check(store) == 0
    assert not (store_path / "index.salvage").exists()


def test_an_index_above_the_old_4_mib_walk_limit_is_checked_too(store_path: Path) -> None:
    """Opens walked the B-tree only up to 4 MiB of data.mdb: above it a damaged leaf
    went unnoticed until close()'s checkpoint failed (IOFailure) or LMDB faulted."""
    keys = [(f"{index:08d}" + "k" * 470).encode() for index in range(7000)]
    with KVStore.open(store_path, create=True, **OPTIONS) as store:
        for start in range(0, len(keys), 500):
            store.put_many([(key, key[:8]) for key in keys[start : start + 500]])
    assert (store_path / INDEX_DIR / "data.mdb").stat().st_size > 4 << 20
    _damage_a_leaf(store_path)
    with KVStore.open(store_path, **OPTIONS) as store:
        stats = store.stats()
        assert stats.index_salvaged and stats.index_check_seconds > 0
        got = store.get_many(keys)
        assert all(value in (None, key[:8]) for key, value in zip(keys, got, strict=True))
        assert sum(value is None for value in got) == stats.quarantined_pages
        store.put("after", b"a")
    with KVStore.open(store_path, readonly=True) as store:  # the close checkpointed fine
        assert store.get("after") == b"a" and not store.stats().degraded


# -- the superblock -----------------------------------------------------------------------


def test_a_damaged_superblock_refuses_with_the_fix_and_recover_rebuilds_it(
    store_path: Path,
) -> None:
    oracle = build(store_path, crash_wal=False)
    pristine = (store_path / SUPERBLOCK_NAME).read_bytes()
    flip(store_path / SUPERBLOCK_NAME, 52)  # max_page_bytes: only the superblock holds it
    with pytest.raises(CorruptionError, match=r"kvstore recover .*rebuilds the superblock"):
        KVStore.open(store_path, readonly=True)
    report = recover_store(store_path)
    assert report.superblock_rebuilt and not report.lost
    assert (store_path / SUPERBLOCK_NAME).read_bytes() == pristine
    with KVStore.open(store_path, **OPTIONS) as store:
        assert oracle.check(store) == 0


def test_an_unprovable_superblock_names_backup_or_removal(store_path: Path) -> None:
    build(store_path, crash_wal=False)
    with open(store_path / SUPERBLOCK_NAME, "r+b") as handle:
        handle.seek(48)
        handle.write(b"\xff" * 16)  # page limit, capacity ...
        handle.seek(BLOCK_BYTES - 8)
        handle.write(b"\x00" * 8)  # ... and the checksum
    with pytest.raises(CorruptionError, match="identity cannot be established") as caught:
        KVStore.open(store_path)
    assert "backup" in str(caught.value) and f"remove {store_path}" in str(caught.value)


# -- kvstore recover ---------------------------------------------------------------------


def _crash_after_delete(path: Path) -> None:
    """k0..k4 checkpointed; then, only in the WAL: put a, delete k1, put b."""
    store = KVStore.open(path, create=True, **OPTIONS)
    for index in range(5):
        store.put(f"k{index}", bytes([index]) * 5000)
    store.checkpoint()
    store.put("a", b"a" * 5000)
    store.delete("k1")
    store.put("b", b"b" * 5000)
    store.flush()
    store.internals.abandon()


def _delete_record(path: Path) -> tuple[Path, int, int]:
    from kvstore.format.constants import WAL_DELETE

    newest = wal_files(path)[-1]
    records = iter_records(newest.read_bytes()).records
    for previous, record in itertools.pairwise(records):
        if record.record_type == WAL_DELETE:
            return newest, previous.end_offset, record.end_offset
    raise AssertionError("no DELETE record")


def test_recover_replays_a_wal_file_whose_header_is_damaged(store_path: Path) -> None:
    """It used to ignore such a file: the DELETE in it was lost and the checkpointed
    page came back (LMDB still vouched for it)."""
    _crash_after_delete(store_path)
    newest, _, _ = _delete_record(store_path)
    with open(newest, "r+b") as handle:
        handle.seek(48)
        handle.write(b"\x5a" * 16)  # beyond repair: creation time and checksum
    recover_store(store_path)
    with KVStore.open(store_path, **OPTIONS) as store:
        assert store.get("k1") is None
        assert store.get("a") == b"a" * 5000 and store.get("b") == b"b" * 5000


def test_recover_after_a_wal_gap_never_brings_a_delete_back(store_path: Path) -> None:
    """The DELETE of k1 cannot be read (two damaged bytes): the open refuses, and
    recover drops every page vouched for only by states older than the gap (k0..k4,
    a) instead of keeping k1; b, logged after the gap, is kept."""
    _crash_after_delete(store_path)
    newest, start, end = _delete_record(store_path)
    flip(newest, start + 22)
    flip(newest, end - 2)
    with pytest.raises(CorruptionError, match="kvstore recover"):
        KVStore.open(store_path, **OPTIONS)
    report = recover_store(store_path)
    assert report.lost and any("WAL gap" in note for note in report.notes)
    with KVStore.open(store_path, **OPTIONS) as store:
        assert store.get("k1") is None
        assert store.get("b") == b"b" * 5000
        for key in ("k0", "k2", "a"):
            assert store.get(key) is None  # unvouched: recomputed, never stale


def test_recover_keeps_the_pages_of_a_segment_whose_header_is_damaged(store_path: Path) -> None:
    """recover moved such a segment aside (its pages lost); the index names its
    generation and its records prove it, so they are kept and the header rewritten."""
    oracle = build(store_path)
    damaged = segment_files(store_path)[1]
    flip(damaged, 44)  # the generation
    report = recover_store(store_path)
    assert damaged.name not in report.damaged_segments
    assert any("header is rewritten" in note for note in report.notes)
    with KVStore.open(store_path, **OPTIONS) as store:
        assert not store.stats().degraded  # the header is sound again
        assert oracle.check(store) == 0

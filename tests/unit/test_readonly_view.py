"""Read-only opens beside a live writer see one point in time
(docs/reliability.md, failure mode 11).

The writer runs in a child process (``kvstore.testing.readers.WriterProcess``;
LMDB allows one open of an index per process) and is told exactly when to
checkpoint, free a segment or reuse a freed segment's file: between the
reader's open and its lookups, or in the middle of the open itself. Each of
these made today's reader raise a false ``CorruptionError`` naming
``kvstore recover``, or made a read-only check report damage that was not there.
"""

from __future__ import annotations

import json
import mmap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import kvstore.lifecycle as lifecycle_module
import kvstore.log.wal as wal_module
import kvstore.store as store_module
from kvstore import CorruptionError, KVStore
from kvstore.check import check_store
from kvstore.cli import main
from kvstore.format.constants import BLOCK_BYTES
from kvstore.format.names import segment_path
from kvstore.testing.readers import WriterProcess, payload

PAGE = 64 << 10  # 15 records of 68 KiB fill a 1 MiB segment
OPTIONS: dict[str, Any] = {
    "segment_bytes": 1 << 20,
    "max_page_bytes": 256 << 10,
    "gc_interval_s": 0,  # GC only when told: the test decides what is freed when
    "checkpoint_interval_s": 3600.0,
    "checkpoint_wal_bytes": 1 << 30,
}


def keys(prefix: str, count: int) -> list[str]:
    return [f"{prefix}{index:03d}" for index in range(count)]


def items(names: list[str], version: int = 1) -> list[list[Any]]:
    return [[name, version, PAGE] for name in names]


@pytest.fixture
def writer(store_path: Path) -> Any:
    with WriterProcess(store_path, OPTIONS) as process:
        yield process


def first_segment_keys(writer: WriterProcess, names: list[str]) -> list[str]:
    """The keys whose pages sit in the first of the segments ``names`` are in."""
    segments = writer.call("segments", keys=names)["segments"]
    return [name for name, segment in zip(names, segments, strict=True) if segment == segments[0]]


def test_pages_a_checkpoint_added_after_the_open_are_misses(
    writer: WriterProcess, store_path: Path
) -> None:
    old = keys("old", 20)
    writer.call("put", items=items(old))
    writer.call("checkpoint")
    with KVStore.open(store_path, readonly=True) as reader:
        new = keys("new", 40)  # three new segments, checkpointed into LMDB
        writer.call("put", items=items(new))
        writer.call("checkpoint")
        # Before: each lookup read the writer's newest LMDB, found pages in
        # segments this reader never opened, and raised CorruptionError.
        assert reader.get(new[-1]) is None
        assert new[-1] not in reader
        assert reader.get_many([*new[-3:], old[0]]) == [None, None, None, payload(old[0], 1, PAGE)]
        assert [reader.get(name) for name in old] == [payload(name, 1, PAGE) for name in old]
        assert sorted(reader.keys()) == sorted(name.encode() for name in old)
        assert len(reader) == len(old)
        findings = check_store(reader, deep=True)
        assert list(findings) == []


def test_a_reused_segment_file_makes_its_pages_misses_not_corruption(
    writer: WriterProcess, store_path: Path
) -> None:
    old = keys("old", 30)
    writer.call("put", items=items(old))
    writer.call("checkpoint")
    doomed = first_segment_keys(writer, old)
    kept = [name for name in old if name not in doomed]
    with KVStore.open(store_path, readonly=True) as reader:
        writer.call("no_spare")  # so GC reuses the freed file as its next segment
        writer.call("delete", keys=doomed)
        assert writer.call("gc")["freed"] >= 1
        # Fill the reused file: new records land at the offsets of the old ones.
        writer.call("put", items=items(keys("new", 45), version=2))
        # No checkpoint: LMDB still names the doomed pages in the freed segment.
        # Before: the reader read the new records there and raised CorruptionError
        # ("the record there is not this page").
        assert [reader.get(name) for name in doomed] == [None] * len(doomed)
        assert reader.get_many(doomed) == [None] * len(doomed)
        target = mmap.mmap(-1, PAGE)
        assert reader.get_into(doomed[0], target) is None
        assert [reader.get(name) for name in kept] == [payload(name, 1, PAGE) for name in kept]
        assert reader.stats().counters["stale_reads"] >= 2 * len(doomed) + 1
        # Before: record-mismatch findings for every doomed page, and a
        # segment-header finding for the reused file.
        findings = check_store(reader, deep=True)
        assert list(findings) == []
        assert findings.changed_while_checking >= len(doomed) + 1


def test_a_segment_freed_during_the_open_is_left_out_of_the_view(
    writer: WriterProcess, store_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = keys("old", 30)
    writer.call("put", items=items(old))
    writer.call("checkpoint")
    doomed = first_segment_keys(writer, old)
    doomed_segment = writer.call("segments", keys=doomed[:1])["segments"][0]
    real_open = lifecycle_module.open_segment

    def open_after_a_free(root: Path, segment_id: int, *args: Any, **kwargs: Any) -> Any:
        if segment_id == doomed_segment:  # the view has it; the writer frees it now
            writer.call("delete", keys=doomed)
            assert writer.call("gc")["freed"] >= 1
        return real_open(root, segment_id, *args, **kwargs)

    monkeypatch.setattr(lifecycle_module, "open_segment", open_after_a_free)
    # Before: CorruptionError "segment N is in the index but ... is missing".
    with KVStore.open(store_path, readonly=True) as reader:
        assert reader.get(doomed[0]) is None
        assert reader.get_many(doomed) == [None] * len(doomed)
        kept = [name for name in old if name not in doomed]
        assert reader.get_many(kept) == [payload(name, 1, PAGE) for name in kept]
        findings = check_store(reader, deep=True)
        assert list(findings) == []
        assert findings.changed_while_checking >= len(doomed)


def test_a_segment_missing_beside_a_live_writer_is_still_corruption(
    writer: WriterProcess, store_path: Path
) -> None:
    names = keys("old", 30)
    writer.call("put", items=items(names))
    writer.call("checkpoint")
    segment = writer.call("segments", keys=names[:1])["segments"][0]
    segment_path(store_path, segment).unlink()  # damage: the writer never freed it
    # Never taken for a segment the writer freed (those are left out silently): the
    # open refuses, or (a store that opens degraded) counts it as damage.
    try:
        reader = KVStore.open(store_path, readonly=True)
    except CorruptionError as e:
        assert "missing" in str(e)
        return
    with reader:
        assert segment not in reader.internals.gone_segments()
        assert reader.stats().counters["stale_reads"] == 0


def test_wal_files_deleted_under_the_open_again_and_again(
    writer: WriterProcess, store_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = keys("old", 10)
    writer.call("put", items=items(names))
    writer.call("checkpoint")
    real_list: Callable[[Path], list[tuple[int, Path]]] = wal_module.list_wal_files
    races = []

    def list_then_checkpoint(root: Path) -> list[tuple[int, Path]]:
        listing = real_list(root)
        if len(races) < 4:  # the writer's checkpoint deletes every file just listed
            races.append(writer.call("checkpoint"))
        return listing

    monkeypatch.setattr(wal_module, "list_wal_files", list_then_checkpoint)
    # Before: three attempts, then CorruptionError "a file ... vanished".
    with KVStore.open(store_path, readonly=True) as reader:
        assert len(races) == 4
        assert reader.get_many(names) == [payload(name, 1, PAGE) for name in names]


def test_a_missing_wal_file_without_a_writer_is_reported_at_once(
    store_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with WriterProcess(store_path, OPTIONS) as writer:
        writer.call("put", items=items(keys("old", 3)))
    for path in (store_path / "wal").iterdir():
        path.unlink()
    pins = []
    real_pin = store_module.IndexEnv.pin

    def counting_pin(self: Any) -> None:
        pins.append(1)
        real_pin(self)

    monkeypatch.setattr(store_module.IndexEnv, "pin", counting_pin)
    with pytest.raises(CorruptionError, match="kvstore recover"):
        KVStore.open(store_path, readonly=True)
    assert len(pins) == 1  # nothing moved: damage, not a view to take again


# -- read-only fsck beside the writer -------------------------------------------------


def fsck_json(path: Path) -> tuple[int, Any]:
    result = CliRunner().invoke(main, ["fsck", str(path), "--json"])
    return result.exit_code, json.loads(result.stdout) if result.stdout.strip() else None


def test_fsck_beside_a_writer_with_a_spare_segment_is_clean(
    writer: WriterProcess, store_path: Path
) -> None:
    writer.call("put", items=items(keys("old", 20)))
    assert writer.call("spare")["spare"] is not None
    # The checkpoint's next_segment_id counts the spare, which no WAL record names
    # until it is used. Before: fsck called the writer's spare an orphan (exit 4).
    writer.call("checkpoint")
    assert fsck_json(store_path) == (0, [])


def test_fsck_of_a_view_the_writer_checkpointed_past_is_clean(
    writer: WriterProcess, store_path: Path
) -> None:
    writer.call("put", items=items(keys("old", 20)))
    writer.call("checkpoint")
    with KVStore.open(store_path, readonly=True) as reader:
        writer.call("put", items=items(keys("new", 5)))
        writer.call("checkpoint")  # deletes the WAL file the view starts from
        # Before: wal-chain "WAL file ... named by the checkpoint is missing".
        findings = check_store(reader)
        assert list(findings) == []
        assert findings.changed_while_checking >= 1


def test_fsck_beside_a_writer_still_reports_real_damage(
    writer: WriterProcess, store_path: Path
) -> None:
    names = keys("old", 20)
    writer.call("put", items=items(names))
    writer.call("checkpoint")
    segment = writer.call("segments", keys=names[:1])["segments"][0]
    with open(segment_path(store_path, segment), "r+b") as handle:
        handle.seek(BLOCK_BYTES + 100)  # inside the first record's header block
        handle.write(b"\xff" * 8)
    code, findings = fsck_json(store_path)
    assert code == 4
    assert [finding["kind"] for finding in findings] == ["record-header"]
    assert findings[0]["key"] == names[0]

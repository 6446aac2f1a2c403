"""``kvstore recover``: rebuild from segments when the WAL or the LMDB index is lost.

A crash is simulated by copying the store directory while its writer is open
(after ``flush``): the copy is what a SIGKILL at that moment leaves behind.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import kvstore.recover as recover_module
from kvstore import KVStore
from kvstore.cli import main
from kvstore.errors import CorruptionError, IOFailure, LockedError, StoreNotFoundError
from kvstore.format.constants import BLOCK_BYTES
from kvstore.format.names import segment_path
from kvstore.recover import STAGE_DIR, recover_store
from tests.conftest import OpenStore, open_small_store


def page(name: str, version: int = 0, size: int = 6000) -> bytes:
    seed = f"{name}/{version}".encode()
    return (seed * (size // len(seed) + 1))[:size]


def crash_image(store: KVStore, to: Path) -> Path:
    """What a SIGKILL right now leaves on disk (the store was just flushed)."""
    store.flush()
    shutil.copytree(store.root, to, ignore=shutil.ignore_patterns("LOCK"))
    return to


def reopen_and_verify(path: Path, expected: dict[str, bytes]) -> None:
    """The store opens, holds exactly ``expected`` (verified reads) and fsck is clean."""
    with open_small_store(path, create=False, gc_interval_s=0) as store:
        assert sorted(store.keys()) == sorted(key.encode() for key in expected)
        for key, value in expected.items():
            assert store.get(key) == value, key
        errors = [f for f in store.check(deep=True) if f.severity == "error"]
        assert errors == []
        store.put("after-recover", b"x" * 5000, sync=True)  # the writer works too
        assert store.get("after-recover") == b"x" * 5000


def listing(root: Path) -> list[tuple[str, int, int]]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames + dirnames):
            full = Path(dirpath) / name
            stat = full.stat()
            out.append((str(full.relative_to(root)), stat.st_size, stat.st_mtime_ns))
    return out


@pytest.fixture
def wal_only(open_store: OpenStore, tmp_path: Path) -> tuple[Path, dict[str, bytes], set[str]]:
    """A crash image: a checkpoint holds ``base`` pages; later changes are only in the WAL.

    After the checkpoint: ``w0``/``w1`` are new, ``a1`` is overwritten and
    ``a2`` deleted. Returns (path, checkpointed state, keys only in the WAL).
    """
    store = open_store(gc_interval_s=0)
    base = {f"a{i}": page(f"a{i}") for i in range(6)}
    for key, value in base.items():
        store.put(key, value)
    store.put("gone", page("gone"))
    store.flush()
    store.delete("gone")
    store.checkpoint()
    store.put("w0", page("w0"))
    store.put("w1", page("w1"))
    store.put("a1", page("a1", 1))
    store.delete("a2")
    image = crash_image(store, tmp_path / "image")
    store.close()
    return image, base, {"w0", "w1"}


def test_lost_wal_keeps_the_checkpoint(
    wal_only: tuple[Path, dict[str, bytes], set[str]], tmp_path: Path
) -> None:
    path, base, wal_keys = wal_only
    salvage_copy = shutil.copytree(path, tmp_path / "salvage")
    for directory in (path, salvage_copy):
        for entry in (directory / "wal").iterdir():
            entry.unlink()
    report = recover_store(path)
    assert report.index_state == "ok"
    assert {page.key.decode() for page in report.kept} == set(base)
    assert report.kept_by_source == {"index": len(base)}
    unvouched = {r.key.decode() for r in report.dropped if r.reason == "unvouched"}
    assert unvouched == wal_keys | {"a1"}  # a1's overwrite was only in the WAL
    assert any(r.key == b"gone" and r.reason == "deleted" for r in report.dropped)
    assert report.lost
    assert any(name.startswith("index.damaged-") for name in report.moved_aside)
    reopen_and_verify(path, base)

    # --salvage keeps the newest version of each key newer than the checkpoint:
    # the WAL-only pages and a1's overwrite come back; so does a2 (its delete was
    # lost with the WAL, as documented); "gone" was deleted before the checkpoint.
    report = recover_store(salvage_copy, salvage=True)
    expected = dict(base) | {key: page(key) for key in wal_keys} | {"a1": page("a1", 1)}
    assert {p.key.decode() for p in report.kept} == set(expected)
    assert report.kept_by_source["salvage"] == 3
    reopen_and_verify(salvage_copy, expected)


def test_lost_index_keeps_what_the_wal_vouches_for(
    open_store: OpenStore, tmp_path: Path, store_path: Path
) -> None:
    store = open_store(gc_interval_s=0)
    store.put("old", page("old"))
    store.put("old-del", page("old-del"))
    store.checkpoint()  # these two are only in LMDB from here on
    store.put("new", page("new"))
    store.put("ow", page("ow", 0))
    store.put("ow", page("ow", 1))
    store.put("del", page("del"))
    store.delete("del")
    store.delete("old-del")
    images = [crash_image(store, tmp_path / f"image{i}") for i in range(3)]
    store.close()
    (images[0] / "index" / "data.mdb").unlink()
    with open(images[1] / "index" / "data.mdb", "r+b") as handle:
        handle.write(os.urandom(16384))
    wal_state = {"new": page("new"), "ow": page("ow", 1)}
    for image in images[:2]:
        report = recover_store(image)
        assert report.index_state == "missing"
        assert {p.key.decode() for p in report.kept} == set(wal_state)
        reasons = {(r.key.decode(), r.lsn): r.reason for r in report.dropped}
        assert sorted(k for (k, _), why in reasons.items() if why == "unvouched") == ["old"]
        assert sorted(k for (k, _), why in reasons.items() if why == "deleted") == [
            "del",
            "old-del",
        ]
        assert sorted(k for (k, _), why in reasons.items() if why == "superseded") == ["ow"]
        reopen_and_verify(image, wal_state)
    # --salvage: also the newest version of keys no surviving source names
    # ("old"); deletes in the surviving WAL still hold.
    (images[2] / "index" / "data.mdb").unlink()
    report = recover_store(images[2], salvage=True)
    reopen_and_verify(images[2], wal_state | {"old": page("old")})


def test_checkpointed_delete_does_not_come_back(open_store: OpenStore, store_path: Path) -> None:
    store = open_store(gc_interval_s=0)
    store.put("keep", page("keep"))
    store.put("drop", page("drop"))
    store.flush()
    store.delete("drop")
    store.flush()
    store.checkpoint()
    store.close()
    report = recover_store(store_path)
    assert {p.key for p in report.kept} == {b"keep"}
    assert [(r.key, r.reason) for r in report.dropped] == [(b"drop", "deleted")]
    assert not report.lost
    reopen_and_verify(store_path, {"keep": page("keep")})
    report = recover_store(store_path, salvage=True)  # the index still says deleted
    assert {p.key for p in report.kept} == {b"keep", b"after-recover"}


def test_overwrites_come_back_with_the_newest_bytes(
    open_store: OpenStore, store_path: Path
) -> None:
    store = open_store(gc_interval_s=0)
    for version in range(4):
        store.put("k", page("k", version, size=3000 + version * 5000))
        if version == 1:
            store.checkpoint()
    store.close()
    report = recover_store(store_path)
    [kept] = report.kept
    assert kept.key == b"k" and kept.payload_bytes == 18000
    assert report.dropped_by_reason == {"superseded": 3}
    reopen_and_verify(store_path, {"k": page("k", 3, size=18000)})


def test_flipped_payload_byte_is_dropped_as_corrupt(
    open_store: OpenStore, store_path: Path
) -> None:
    store = open_store(gc_interval_s=0)
    for key in ("p0", "p1", "p2"):
        store.put(key, page(key))
    info = store.info("p1")
    assert info is not None
    store.close()
    with open(segment_path(store_path, info.segment_id), "r+b") as handle:
        handle.seek(info.offset + BLOCK_BYTES + 100)
        byte = handle.read(1)
        handle.seek(info.offset + BLOCK_BYTES + 100)
        handle.write(bytes([byte[0] ^ 0x01]))
    report = recover_store(store_path, dry_run=True)
    assert [(r.key, r.reason) for r in report.dropped] == [(b"p1", "corrupt")]
    result = CliRunner().invoke(main, ["recover", str(store_path), "--json"])
    assert result.exit_code == 4, result.output
    data = json.loads(result.output)
    assert data["dropped_by_reason"] == {"corrupt": 1}
    assert data["dropped"][0]["key"] == "p1" and data["kept_pages"] == 2
    reopen_and_verify(store_path, {"p0": page("p0"), "p2": page("p2")})


def test_interrupted_recover_converges(
    wal_only: tuple[Path, dict[str, bytes], set[str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path, base, _ = wal_only
    second = shutil.copytree(path, tmp_path / "second")
    for directory in (path, second):
        shutil.rmtree(directory / "wal")
        (directory / "wal").mkdir()

    # 1. Fails right before the swap: the next run finishes it and converges.
    real_swap = recover_module._swap

    def fail_before(*args: object) -> list[str]:
        raise IOFailure("injected failure before the swap")

    monkeypatch.setattr(recover_module, "_swap", fail_before)
    with pytest.raises(IOFailure):
        recover_store(path)
    assert (path / STAGE_DIR / "COMPLETE").exists()
    monkeypatch.setattr(recover_module, "_swap", real_swap)
    report = recover_store(path)
    assert report.resumed_swap
    assert {p.key.decode() for p in report.kept} == set(base)
    reopen_and_verify(path, base)

    # 2. Fails halfway through the swap (old index moved aside, new one not in).
    calls = {"n": 0}
    real_rename = os.rename

    def rename_then_fail(src: object, dst: object) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(5, "injected")
        real_rename(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "rename", rename_then_fail)
    with pytest.raises(IOFailure):
        recover_store(second)
    monkeypatch.setattr(os, "rename", real_rename)
    assert not (second / "index").exists()
    report = recover_store(second)
    assert report.resumed_swap
    reopen_and_verify(second, base)

    # 3. An incomplete stage (no COMPLETE) is discarded and rebuilt.
    (second / STAGE_DIR / "index").mkdir(parents=True)
    report = recover_store(second)
    assert not report.resumed_swap and not (second / STAGE_DIR).exists()
    reopen_and_verify(second, base | {"after-recover": b"x" * 5000})


def test_dry_run_changes_nothing(
    wal_only: tuple[Path, dict[str, bytes], set[str]],
) -> None:
    path, _, _ = wal_only
    (path / "index" / "data.mdb").unlink()
    before = listing(path)
    report = recover_store(path, dry_run=True)
    assert report.dry_run and report.kept
    result = CliRunner().invoke(main, ["recover", str(path), "--dry-run"])
    assert result.exit_code in (0, 4), result.output
    assert "dry run" in result.output
    assert listing(path) == before


def test_cli_exit_codes(open_store: OpenStore, store_path: Path, tmp_path: Path) -> None:
    store = open_store(gc_interval_s=0)
    store.put("a", page("a"))
    store.put("a", page("a", 1))
    store.put("b", page("b"))
    store.delete("b")
    runner = CliRunner()
    locked = runner.invoke(main, ["recover", str(store_path)])
    assert locked.exit_code == 8 and "locked" in locked.output
    with pytest.raises(LockedError):
        recover_store(store_path, dry_run=True)
    store.close()
    result = runner.invoke(main, ["recover", str(store_path), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["kept_pages"] == 1 and data["dropped_by_reason"] == {
        "superseded": 1,
        "deleted": 1,
    }
    assert [kept["key"] for kept in data["kept"]] == ["a"]
    assert runner.invoke(main, ["recover", str(tmp_path / "nothing")]).exit_code == 8
    with pytest.raises(StoreNotFoundError):
        recover_store(tmp_path / "nothing")
    pristine = (store_path / "KVSTORE").read_bytes()
    with open(store_path / "KVSTORE", "r+b") as handle:
        handle.seek(100)
        handle.write(b"\xff")
    # One damaged byte: the segment and WAL headers and the stored checksum prove the
    # original, and recover writes it back.
    rebuilt = runner.invoke(main, ["recover", str(store_path), "--json"])
    assert rebuilt.exit_code == 0, rebuilt.output
    assert json.loads(rebuilt.output)["superblock_rebuilt"] is True
    assert (store_path / "KVSTORE").read_bytes() == pristine
    # Damage that nothing proves (a page limit only the superblock holds, and the
    # checksum): the identity cannot be established; recover refuses and says so.
    with open(store_path / "KVSTORE", "r+b") as handle:
        handle.seek(48)
        handle.write(b"\xff\xff")
        handle.seek(4090)
        handle.write(b"\xff\xff")
    with pytest.raises(CorruptionError, match="identity cannot be established"):
        recover_store(store_path)
    assert runner.invoke(main, ["recover", str(store_path)]).exit_code == 8

"""The fault-injection layer itself: the disk model and the Nth-I/O injector.

These pin down the semantics every power-loss case relies on, with plain
file-system calls and no store: if the model kept an unsynced write, or lost a
synced one, every store-level case built on it would be meaningless.
"""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import pytest

from kvstore.testing.faults import DiskModel, FaultInjector, Recorder, Tear


def _root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    for sub in ("wal", "segments", "index"):
        (root / sub).mkdir(parents=True)
    (root / "wal" / "old").write_bytes(b"old-bytes")
    return root


def _dirsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(fd)
    os.close(fd)


def _record(root: Path) -> Recorder:
    recorder = Recorder(root)
    with recorder.installed():
        fd = os.open(root / "wal" / "a", os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, b"synced")
        os.fdatasync(fd)
        _dirsync(root / "wal")
        recorder.mark("after-first-sync")
        os.write(fd, b"-unsynced")
        os.close(fd)
        os.rename(root / "wal" / "old", root / "wal" / "new")
        fd = os.open(root / "segments" / "s", os.O_RDWR | os.O_CREAT, 0o600)
        os.pwritev(fd, [b"x" * 10], 0)
        os.fsync(fd)  # file synced, its directory never is
        os.close(fd)
    return recorder


def test_drop_policy_keeps_synced_bytes_and_namespace_ops(tmp_path: Path) -> None:
    recorder = _record(_root(tmp_path))
    files, _ = DiskModel(recorder, len(recorder)).files("drop", random.Random(1))
    assert files == {"wal/a": b"synced", "wal/new": b"old-bytes", "segments/s": b"x" * 10}


def test_dirs_policy_undoes_entries_since_the_last_directory_fsync(tmp_path: Path) -> None:
    recorder = _record(_root(tmp_path))
    files, _ = DiskModel(recorder, len(recorder)).files("dirs", random.Random(1))
    # wal/a was linked by a directory fsync; the rename and segments/s never were.
    assert files == {"wal/a": b"synced", "wal/old": b"old-bytes"}


def test_prefix_policy_keeps_a_prefix_of_unsynced_bytes(tmp_path: Path) -> None:
    recorder = _record(_root(tmp_path))
    model = DiskModel(recorder, len(recorder))
    seen = set()
    for seed in range(40):
        files, _ = model.files("prefix", random.Random(seed))
        content = files["wal/a"]
        assert (b"synced" + b"-unsynced").startswith(content)
        assert content.startswith(b"synced")
        seen.add(content)
    assert len(seen) > 3  # it really varies the cut


def test_cut_before_a_sync_loses_the_write(tmp_path: Path) -> None:
    recorder = _record(_root(tmp_path))
    sync_index = next(i for i, op in enumerate(recorder.ops) if op.kind == "sync")
    files, _ = DiskModel(recorder, sync_index).files("drop", random.Random(1))
    assert files["wal/a"] == b""
    files, _ = DiskModel(recorder, sync_index + 1).files("drop", random.Random(1))
    assert files["wal/a"] == b"synced"


def test_unlink_without_directory_fsync_comes_back_under_dirs(tmp_path: Path) -> None:
    root = _root(tmp_path)
    recorder = Recorder(root)
    with recorder.installed():
        os.unlink(root / "wal" / "old")
    model = DiskModel(recorder, len(recorder))
    assert "wal/old" not in model.files("drop", random.Random(1))[0]
    assert model.files("dirs", random.Random(1))[0]["wal/old"] == b"old-bytes"


def test_tear_keeps_a_prefix_and_fills_the_tail(tmp_path: Path) -> None:
    root = _root(tmp_path)
    recorder = Recorder(root)
    with recorder.installed():
        fd = os.open(root / "wal" / "t", os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, b"A" * 100)
        os.close(fd)
    write = next(i for i, op in enumerate(recorder.ops) if op.kind == "write")
    model = DiskModel(recorder, len(recorder))
    files, _ = model.files("drop", random.Random(1), tear=Tear(write, 30, "zero"))
    assert files["wal/t"] == b"A" * 30 + bytes(70)
    files, _ = model.files("drop", random.Random(1), tear=Tear(write, 30, "garbage"))
    assert files["wal/t"][:30] == b"A" * 30 and len(files["wal/t"]) == 100


def test_calls_outside_the_root_are_neither_logged_nor_failed(tmp_path: Path) -> None:
    root = _root(tmp_path)
    outside = tmp_path / "outside"
    injector = FaultInjector(root, 1, persistent=True)
    with injector.installed():
        outside.write_bytes(b"fine")
        fd = os.open(outside, os.O_RDWR)
        os.fsync(fd)
        os.close(fd)
    assert injector.count == 0


@pytest.mark.parametrize("persistent", [False, True])
def test_injector_fails_the_nth_call(tmp_path: Path, persistent: bool) -> None:
    root = _root(tmp_path)
    injector = FaultInjector(root, 2, errno.ENOSPC, persistent=persistent)
    with injector.installed():
        fd = os.open(root / "wal" / "n", os.O_WRONLY | os.O_CREAT, 0o600)  # call 1
        with pytest.raises(OSError) as failed:
            os.write(fd, b"x")  # call 2
        assert failed.value.errno == errno.ENOSPC
        if persistent:
            with pytest.raises(OSError):
                os.fsync(fd)
        else:
            os.fsync(fd)
        os.close(fd)
    assert injector.failed[0] == ("write", "wal/n")
    assert os.write is not injector._os_write  # uninstalled

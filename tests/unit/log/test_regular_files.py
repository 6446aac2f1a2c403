"""Every file the store opens is checked to be a regular file first.

open(2) of a FIFO for reading blocks until a writer appears, which for a store
file is never: a FIFO in place of the superblock, ``index/data.mdb`` or a segment
made ``KVStore.open`` (read-only too), ``kvstore fsck`` and
``kvstore recover --dry-run`` hang forever. Each case runs beside a watchdog
process: if the case is still running after ``UNBLOCK_AFTER_S``, the watchdog
opens the FIFO itself (O_RDWR never blocks), which releases an open(2) blocked
on it (in Python or inside LMDB's C code, where no signal helps), and the case
fails.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvstore import KVStore
from kvstore.cli import main
from kvstore.errors import CorruptionError, NotRegularFileError
from kvstore.log.regular import file_kind, open_regular, read_regular, require_regular
from kvstore.telemetry import read_snapshot

OpenStore = Callable[..., KVStore]

TIMEOUT = pytest.mark.timeout(120, method="thread")  # a last resort
UNBLOCK_AFTER_S = 10


class Watchdog:
    """After ``UNBLOCK_AFTER_S``, opens ``fifo`` every 0.1 s until stopped.

    A separate process (a shell), because py-lmdb holds the GIL while LMDB opens
    its files: no thread of this process could run, and no signal handler either.
    """

    def __init__(self, fifo: Path) -> None:
        self.fifo = fifo
        self.marker = fifo.with_name(fifo.name + ".watchdog-fired")
        script = (
            f"sleep {UNBLOCK_AFTER_S}; "
            'while :; do : > "$2"; exec 3<>"$1"; exec 3>&-; sleep 0.1; done'
        )
        self._child = subprocess.Popen(["/bin/sh", "-c", script, "watchdog", fifo, self.marker])

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._child.kill()
        self._child.wait()
        fired = self.marker.exists()
        self.marker.unlink(missing_ok=True)
        assert not fired, f"blocked in open(2) of the FIFO {self.fifo}"


TARGETS = {
    "superblock": "KVSTORE",
    "lock": "LOCK",
    "lmdb-data": "index/data.mdb",
    "lmdb-lock": "index/lock.mdb",
    "segment": "segments/*.seg",
    "wal": "wal/*.wal",
}


def _store_with_fifo(open_store: OpenStore, store_path: Path, target: str) -> Path:
    store = open_store(io_engine="threadpool", gc_interval_s=0)
    store.put_many([(f"k{index}", bytes([index]) * 5000) for index in range(4)])
    store.close()
    [path] = sorted(store_path.glob(target))[:1] or [store_path / target]
    path.unlink()
    os.mkfifo(path)
    return path


def _cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


@TIMEOUT
@pytest.mark.parametrize("target", TARGETS.values(), ids=TARGETS.keys())
def test_store_open_refuses_a_fifo_naming_it(
    open_store: OpenStore, store_path: Path, target: str
) -> None:
    fifo = _store_with_fifo(open_store, store_path, target)
    for readonly in (True, False):  # read-only first: a writer may quarantine the file
        if readonly and target == "LOCK":
            continue  # a read-only open never opens LOCK
        with Watchdog(fifo):
            try:
                opened = KVStore.open(store_path, readonly=readonly, io_engine="threadpool")
            except CorruptionError as e:
                message = str(e)
            else:  # a segment may be quarantined instead: its pages become misses
                with opened:
                    assert target == "segments/*.seg", opened.recovery_notes
                    message = " ".join(opened.recovery_notes)
                    assert opened.get("k1") is None
        assert fifo.name in message and ("FIFO" in message or "not a regular file" in message)
    if target == "LOCK":  # read-only opens do not care
        with Watchdog(fifo), KVStore.open(store_path, readonly=True) as reader:
            assert reader.get("k1") == b"\x01" * 5000


# fsck's exit code and the finding that names the file, per target.
FSCK = {
    "KVSTORE": (4, "superblock"),
    "LOCK": (0, None),  # fsck reads LOCK only for the last writer's pid: it treats it as live
    "index/data.mdb": (4, "index-unreadable"),
    "index/lock.mdb": (4, "index-unreadable"),
    "segments/*.seg": (4, "*"),  # refused (open-failed) or quarantined (a recovery note)
    "wal/*.wal": (4, "open-failed"),
}


@TIMEOUT
@pytest.mark.parametrize("target", TARGETS.values(), ids=TARGETS.keys())
def test_fsck_reports_a_fifo_instead_of_hanging(
    open_store: OpenStore, store_path: Path, target: str
) -> None:
    fifo = _store_with_fifo(open_store, store_path, target)
    with Watchdog(fifo):
        code, stdout, stderr = _cli("fsck", str(store_path), "--json")
    expected_code, kind = FSCK[target]
    assert code == expected_code, (stdout, stderr)
    findings = json.loads(stdout)
    if kind is not None:
        named = [f for f in findings if kind in ("*", f["kind"]) and fifo.name in f["message"]]
        assert named, findings
        assert "FIFO" in named[0]["message"] or "not a regular file" in named[0]["message"]
    with Watchdog(fifo):
        code, stdout, stderr = _cli("fsck", str(store_path))  # the table, too
    assert code == expected_code, (stdout, stderr)


# recover --dry-run: the exit code and where it names the file.
RECOVER = {
    "KVSTORE": (8, "error"),
    "LOCK": (8, "error"),
    "index/data.mdb": (4, "notes"),  # the index is treated as missing: pages unvouched
    "index/lock.mdb": (0, None),  # read without LMDB's lock file
    "segments/*.seg": (4, "notes"),  # its pages are missing
    "wal/*.wal": (0, "notes"),
}


@TIMEOUT
@pytest.mark.parametrize("target", TARGETS.values(), ids=TARGETS.keys())
def test_recover_dry_run_reports_a_fifo_instead_of_hanging(
    open_store: OpenStore, store_path: Path, target: str
) -> None:
    fifo = _store_with_fifo(open_store, store_path, target)
    with Watchdog(fifo):
        code, stdout, stderr = _cli("recover", str(store_path), "--dry-run", "--json")
    expected_code, where = RECOVER[target]
    assert code == expected_code, (stdout, stderr)
    report = json.loads(stdout)
    assert report["exit_code" if where == "error" else "dry_run"] in (8, True)
    if where == "error":
        assert fifo.name in report["error"]["message"]
        assert "FIFO" in report["error"]["message"]
    elif where == "notes":
        assert any(fifo.name in note for note in report["notes"]), report["notes"]
    assert fifo.exists() and not fifo.is_file()  # a dry run moves nothing


@TIMEOUT
@pytest.mark.parametrize("target", ["index/data.mdb", "index/lock.mdb"])
def test_telemetry_readers_refuse_a_fifo(
    open_store: OpenStore, store_path: Path, target: str
) -> None:
    fifo = _store_with_fifo(open_store, store_path, target)
    with Watchdog(fifo), pytest.raises(NotRegularFileError, match="FIFO"):
        read_snapshot(store_path)
    with Watchdog(fifo):
        code, stdout, _ = _cli("wear", str(store_path), "--json")
    assert code == 4
    assert fifo.name in json.loads(stdout)["error"]["message"]


@TIMEOUT
def test_devices_sockets_and_directories_are_refused_too(tmp_path: Path) -> None:
    sock_path = tmp_path / "sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(sock_path))
    try:
        for path, kind in (
            (Path("/dev/null"), "a character device"),
            (sock_path, "a socket"),
            (tmp_path, "a directory"),
        ):
            with pytest.raises(NotRegularFileError, match=f"is {kind}, not a regular file"):
                require_regular(path)
            with pytest.raises(NotRegularFileError, match=kind):
                open_regular(path, os.O_RDONLY)
    finally:
        server.close()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with Watchdog(fifo), pytest.raises(NotRegularFileError, match="a FIFO"):
        read_regular(fifo)
    regular = tmp_path / "file"
    regular.write_bytes(b"x" * 10_000)
    assert read_regular(regular) == b"x" * 10_000
    assert read_regular(regular, 4096) == b"x" * 4096
    fd = open_regular(regular, os.O_RDONLY)
    try:
        assert os.get_blocking(fd)  # O_NONBLOCK is cleared again
    finally:
        os.close(fd)
    require_regular(tmp_path / "missing")  # a missing file is the open's to report
    assert file_kind(os.stat(regular).st_mode) == "a regular file"

"""Fault injection: simulated power loss, torn writes and the Nth-I/O error loop.

Power loss (ALICE / CrashMonkey style). ``Recorder`` patches the ``os``
functions kvstore calls (``open``, ``write``, ``pwritev``, ``fsync``,
``fdatasync``, ``ftruncate``, ``posix_fallocate``, ``rename``, ``unlink`` ...)
for files under one store root and logs each call, with the bytes written, in
the order the calls completed (syncs are logged when they begin, so a sync
covers exactly the writes logged before it). ``DiskModel`` replays a prefix
of that log onto the store as it was when recording began and writes out the
disk a power cut at that point could have left, under one of three policies:

``drop``      every write not covered by a later fsync/fdatasync of its file is
              lost; creates, renames and unlinks persist as issued.
``prefix``    a random prefix (in issue order) of the unsynced writes survives
              and the next one is cut at a random byte; the rest is lost.
``dirs``      as ``drop``, and every directory also reverts to its entries as
              of its last fsync: files created or renamed in since vanish (or
              reappear under their old name), files unlinked since come back.

LMDB writes happen inside the C library, so the index is modelled by snapshots
of ``index/data.mdb`` taken after every committed (LMDB syncs on commit) write
transaction; a cut during a commit restores either the snapshot before it or
the one after, both of which LMDB may legally leave.

The engine must be ``io_engine="threadpool"`` while recording: io_uring
writes never pass through Python.

Nth-I/O errors (SQLite style). ``FaultInjector`` counts the same calls (and
reads, and LMDB write transactions) and raises ``OSError(errno)`` at the
Nth, once (``persistent=False``) or for every call from the Nth on.

Both patch the ``os`` module itself (pathlib's ``unlink``/``rename`` go
through it too) and touch only calls on paths under the store root, so the
rest of the process is unaffected. Only one may be installed at a time.
"""

from __future__ import annotations

import errno as errno_module
import os
import random
import shutil
import stat
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "POLICIES",
    "DiskModel",
    "FaultInjector",
    "Op",
    "Recorder",
    "Tear",
]

POLICIES = ("drop", "prefix", "dirs")
"""The unsynced-data policies of a simulated power cut (see the module docstring)."""

_INDEX_DIR = "index"
_LMDB_DATA = "index/data.mdb"

_PATCHED = (
    "open",
    "close",
    "write",
    "pwrite",
    "pwritev",
    "fsync",
    "fdatasync",
    "ftruncate",
    "truncate",
    "posix_fallocate",
    "rename",
    "replace",
    "unlink",
    "remove",
    "pread",
    "preadv",
)


@dataclass(slots=True)
class Op:
    """One logged call. ``kind`` is one of:

    ``write`` (inode, offset, data), ``size`` (inode, size: ftruncate/truncate;
    ``grow`` True for fallocate, which only ever extends), ``sync`` (inode),
    ``dirsync`` (path = the directory), ``create`` (path, inode),
    ``rename`` (path -> path2), ``unlink`` (path), ``lmdb_begin``,
    ``lmdb_commit`` (snapshot = index into ``Recorder.lmdb_snapshots``),
    ``mark`` (note: whatever the workload logged, e.g. an acknowledgement).
    """

    kind: str
    inode: int = -1
    offset: int = 0
    data: bytes = b""
    size: int = 0
    grow: bool = False
    path: str = ""
    path2: str = ""
    snapshot: int = -1
    note: object = None


def _real_functions() -> dict[str, Callable[..., Any]]:
    return {name: getattr(os, name) for name in _PATCHED}


_install_lock = threading.Lock()
_installed: list[object] = []


class _Patcher:
    """Base of Recorder and FaultInjector: routes os calls under ``root`` to hooks."""

    def __init__(self, root: Path) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self._real = _real_functions()
        self._lock = threading.RLock()
        self._fds: dict[int, tuple[str, str]] = {}  # fd -> ("file"|"dir", relative path)
        self._saved_lmdb_write: Callable[..., Any] | None = None

    # -- paths ------------------------------------------------------------

    def rel(self, path: Any) -> str | None:
        """The path relative to the root, or None when it lies outside."""
        if isinstance(path, int):
            return None
        absolute = os.path.abspath(os.fsdecode(os.fspath(path)))
        if absolute == self.root:
            return ""
        if absolute.startswith(self.root + os.sep):
            return absolute[len(self.root) + 1 :]
        return None

    # -- install / uninstall ------------------------------------------------

    def install(self) -> None:
        with _install_lock:
            if _installed:
                raise RuntimeError("a fault patcher is already installed")
            _installed.append(self)
        for name in _PATCHED:
            setattr(os, name, getattr(self, "_os_" + name))
        from kvstore.index.lmdb_env import IndexEnv

        self._saved_lmdb_write = IndexEnv.write
        original = IndexEnv.write
        patcher = self

        def write(env_self: IndexEnv, body: Callable[[Any], Any]) -> Any:
            if env_self.path.absolute().as_posix().startswith(patcher.root):
                return patcher._lmdb_write(lambda: original(env_self, body))
            return original(env_self, body)

        IndexEnv.write = write  # type: ignore[method-assign,assignment]

    def uninstall(self) -> None:
        for name, function in self._real.items():
            setattr(os, name, function)
        if self._saved_lmdb_write is not None:
            from kvstore.index.lmdb_env import IndexEnv

            IndexEnv.write = self._saved_lmdb_write  # type: ignore[method-assign]
            self._saved_lmdb_write = None
        with _install_lock:
            if self in _installed:
                _installed.remove(self)

    @contextmanager
    def installed(self) -> Iterator[None]:
        self.install()
        try:
            yield
        finally:
            self.uninstall()

    # -- hooks subclasses override -----------------------------------------

    def _before(self, call: str, rel: str, fd: int) -> None:
        """Called before a mutating or reading call on a file under the root."""

    def _lmdb_write(self, run: Callable[[], Any]) -> Any:
        return run()

    def _on_open(self, rel: str, fd: int, flags: int, existed: bool, is_dir: bool) -> None:
        """After a successful open of a path under the root."""

    def _on_write(self, rel: str, fd: int, offset: int, data: bytes) -> None: ...

    def _on_size(self, rel: str, fd: int, size: int, grow: bool) -> None: ...

    def _on_sync(self, kind: str, rel: str, fd: int) -> None: ...

    def _on_rename(self, src: str, dst: str) -> None: ...

    def _on_unlink(self, rel: str) -> None: ...

    def _on_truncate_path(self, rel: str, size: int) -> None: ...

    # -- the patched functions ----------------------------------------------

    def _fd_rel(self, fd: int) -> tuple[str, str] | None:
        return self._fds.get(fd)

    def _foreign_rel(self, fd: int) -> str | None:
        """The path under the root of a file opened without ``os.open`` (``open()``)."""
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return None
        rel = self.rel(target)
        if rel is None or rel == "" or not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return rel

    def _on_foreign_sync(self, rel: str, fd: int) -> None:
        """A file opened through ``open()`` is synced: its writes were not seen.

        kvstore writes through ``open()`` only to truncate (a torn WAL tail),
        so the recorder logs the file's size at the sync.
        """

    def _os_open(self, path: Any, flags: int, mode: int = 0o777, *, dir_fd: Any = None) -> int:
        rel = None if dir_fd is not None else self.rel(path)
        if rel is None:
            return int(self._real["open"](path, flags, mode, dir_fd=dir_fd))
        absolute = os.path.join(self.root, rel)
        existed = os.path.lexists(absolute)
        if flags & (os.O_CREAT | os.O_TRUNC | os.O_WRONLY | os.O_RDWR):
            self._before("open", rel, -1)
        fd = int(self._real["open"](path, flags, mode))
        is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
        with self._lock:
            self._fds[fd] = ("dir" if is_dir else "file", rel)
            self._on_open(rel, fd, flags, existed, is_dir)
        return fd

    def _os_close(self, fd: int) -> None:
        with self._lock:
            self._fds.pop(fd, None)
        self._real["close"](fd)

    def _os_write(self, fd: int, data: Any) -> int:
        where = self._fd_rel(fd)
        if where is None:
            return int(self._real["write"](fd, data))
        self._before("write", where[1], fd)
        with self._lock:  # position and log entry must agree under concurrency
            written = int(self._real["write"](fd, data))
            end = os.lseek(fd, 0, os.SEEK_CUR)
            self._on_write(where[1], fd, end - written, bytes(memoryview(data)[:written]))
        return written

    def _os_pwrite(self, fd: int, data: Any, offset: int) -> int:
        where = self._fd_rel(fd)
        if where is None:
            return int(self._real["pwrite"](fd, data, offset))
        self._before("pwrite", where[1], fd)
        written = int(self._real["pwrite"](fd, data, offset))
        with self._lock:
            self._on_write(where[1], fd, offset, bytes(memoryview(data)[:written]))
        return written

    def _os_pwritev(self, fd: int, buffers: Any, offset: int, *flags: int) -> int:
        where = self._fd_rel(fd)
        if where is None:
            return int(self._real["pwritev"](fd, buffers, offset, *flags))
        self._before("pwritev", where[1], fd)
        written = int(self._real["pwritev"](fd, buffers, offset, *flags))
        with self._lock:
            joined = b"".join(bytes(memoryview(b)) for b in buffers)[:written]
            self._on_write(where[1], fd, offset, joined)
        return written

    def _sync(self, name: str, fd: int) -> None:
        where = self._fd_rel(fd)
        if where is None:
            rel = self._foreign_rel(fd)
            if rel is not None:
                self._before(name, rel, fd)
                with self._lock:
                    self._on_foreign_sync(rel, fd)
            self._real[name](fd)
            return
        self._before(name, where[1], fd)
        with self._lock:  # logged when it begins: it covers the writes logged before
            self._on_sync(where[0], where[1], fd)
        self._real[name](fd)

    def _os_fsync(self, fd: Any) -> None:
        self._sync("fsync", fd if isinstance(fd, int) else fd.fileno())

    def _os_fdatasync(self, fd: Any) -> None:
        self._sync("fdatasync", fd if isinstance(fd, int) else fd.fileno())

    def _os_ftruncate(self, fd: int, size: int) -> None:
        where = self._fd_rel(fd)
        if where is None:
            self._real["ftruncate"](fd, size)
            return
        self._before("ftruncate", where[1], fd)
        self._real["ftruncate"](fd, size)
        with self._lock:
            self._on_size(where[1], fd, size, False)

    def _os_truncate(self, path: Any, size: int) -> None:
        rel = self.rel(path) if not isinstance(path, int) else None
        if rel is None:
            self._real["truncate"](path, size)
            return
        self._before("truncate", rel, -1)
        self._real["truncate"](path, size)
        with self._lock:
            self._on_truncate_path(rel, size)

    def _os_posix_fallocate(self, fd: int, offset: int, length: int) -> None:
        where = self._fd_rel(fd)
        if where is None:
            self._real["posix_fallocate"](fd, offset, length)
            return
        self._before("posix_fallocate", where[1], fd)
        self._real["posix_fallocate"](fd, offset, length)
        with self._lock:
            self._on_size(where[1], fd, offset + length, True)

    def _rename(self, name: str, src: Any, dst: Any, **kwargs: Any) -> None:
        src_rel, dst_rel = self.rel(src), self.rel(dst)
        if src_rel is None or dst_rel is None or kwargs:
            self._real[name](src, dst, **kwargs)
            return
        self._before(name, src_rel, -1)
        with self._lock:
            self._real[name](src, dst)
            self._on_rename(src_rel, dst_rel)

    def _os_rename(self, src: Any, dst: Any, **kwargs: Any) -> None:
        self._rename("rename", src, dst, **kwargs)

    def _os_replace(self, src: Any, dst: Any, **kwargs: Any) -> None:
        self._rename("replace", src, dst, **kwargs)

    def _unlink(self, name: str, path: Any, **kwargs: Any) -> None:
        rel = self.rel(path)
        if rel is None or kwargs:
            self._real[name](path, **kwargs)
            return
        self._before(name, rel, -1)
        with self._lock:
            self._real[name](path)
            self._on_unlink(rel)

    def _os_unlink(self, path: Any, **kwargs: Any) -> None:
        self._unlink("unlink", path, **kwargs)

    def _os_remove(self, path: Any, **kwargs: Any) -> None:
        self._unlink("remove", path, **kwargs)

    def _os_pread(self, fd: int, length: int, offset: int) -> bytes:
        where = self._fd_rel(fd)
        if where is not None:
            self._before("pread", where[1], fd)
        return bytes(self._real["pread"](fd, length, offset))

    def _os_preadv(self, fd: int, buffers: Any, offset: int, *flags: int) -> int:
        where = self._fd_rel(fd)
        if where is not None:
            self._before("preadv", where[1], fd)
        return int(self._real["preadv"](fd, buffers, offset, *flags))


# -- power loss: the recorder ---------------------------------------------------


class Recorder(_Patcher):
    """Logs every durable-state-changing call under ``root`` (see module docstring).

    Create it while the store is closed: the files under ``root`` at that
    moment (``base``) are where replay starts.
    """

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.ops: list[Op] = []
        self.base: dict[str, int] = {}  # relative path -> inode
        self.base_bytes: dict[int, bytes] = {}
        self._names: dict[str, int] = {}
        self._next_inode = 1
        self._fd_inode: dict[int, int] = {}
        self.lmdb_snapshots: list[bytes] = []
        self._scan_base()

    def _scan_base(self) -> None:
        for directory, _dirs, files in os.walk(self.root):
            for name in files:
                absolute = os.path.join(directory, name)
                rel = os.path.relpath(absolute, self.root)
                if rel.startswith(_INDEX_DIR + os.sep):
                    continue
                inode = self._new_inode()
                self.base[rel] = inode
                with open(absolute, "rb") as handle:
                    self.base_bytes[inode] = handle.read()
        self._names = dict(self.base)
        data = Path(self.root, _LMDB_DATA)
        self.lmdb_snapshots.append(data.read_bytes() if data.exists() else b"")

    def _new_inode(self) -> int:
        inode = self._next_inode
        self._next_inode += 1
        return inode

    def mark(self, note: object) -> int:
        """Log a workload event (a call started, returned, was acknowledged); its index."""
        with self._lock:
            self.ops.append(Op("mark", note=note))
            return len(self.ops) - 1

    def __len__(self) -> int:
        return len(self.ops)

    def _lmdb_write(self, run: Callable[[], Any]) -> Any:
        with self._lock:
            self.ops.append(Op("lmdb_begin"))
        result = run()
        data = Path(self.root, _LMDB_DATA).read_bytes()
        with self._lock:
            self.lmdb_snapshots.append(data)
            self.ops.append(Op("lmdb_commit", snapshot=len(self.lmdb_snapshots) - 1))
        return result

    def _on_open(self, rel: str, fd: int, flags: int, existed: bool, is_dir: bool) -> None:
        if is_dir or rel.startswith(_INDEX_DIR + os.sep):
            return
        inode = self._names.get(rel)
        if not existed or inode is None:
            inode = self._new_inode()
            self._names[rel] = inode
            self.ops.append(Op("create", inode=inode, path=rel))
        self._fd_inode[fd] = inode
        if flags & os.O_TRUNC:
            self.ops.append(Op("size", inode=inode, size=0))

    def _os_close(self, fd: int) -> None:
        with self._lock:
            self._fd_inode.pop(fd, None)
        super()._os_close(fd)

    def _on_write(self, rel: str, fd: int, offset: int, data: bytes) -> None:
        inode = self._fd_inode.get(fd)
        if inode is not None and data:
            self.ops.append(Op("write", inode=inode, offset=offset, data=data))

    def _on_size(self, rel: str, fd: int, size: int, grow: bool) -> None:
        inode = self._fd_inode.get(fd)
        if inode is not None:
            self.ops.append(Op("size", inode=inode, size=size, grow=grow))

    def _on_truncate_path(self, rel: str, size: int) -> None:
        inode = self._names.get(rel)
        if inode is not None:
            self.ops.append(Op("size", inode=inode, size=size))

    def _on_foreign_sync(self, rel: str, fd: int) -> None:
        inode = self._names.get(rel)
        if inode is not None:
            self.ops.append(Op("size", inode=inode, size=os.fstat(fd).st_size))
            self.ops.append(Op("sync", inode=inode))

    def _on_sync(self, kind: str, rel: str, fd: int) -> None:
        if kind == "dir":
            self.ops.append(Op("dirsync", path=rel))
            return
        inode = self._fd_inode.get(fd)
        if inode is not None:
            self.ops.append(Op("sync", inode=inode))

    def _on_rename(self, src: str, dst: str) -> None:
        moved = False
        for name in [n for n in self._names if n == src or n.startswith(src + os.sep)]:
            self._names[dst + name[len(src) :]] = self._names.pop(name)
            moved = True
        if moved:
            self.ops.append(Op("rename", path=src, path2=dst))

    def _on_unlink(self, rel: str) -> None:
        if self._names.pop(rel, None) is not None:
            self.ops.append(Op("unlink", path=rel))


# -- power loss: replaying a prefix of the log --------------------------------


@dataclass(slots=True)
class Tear:
    """Cut one logged write: keep ``keep_bytes`` of it and fill the rest with ``tail``.

    ``tail`` is ``"zero"`` or ``"garbage"`` (random bytes); ``keep_bytes`` may
    equal the write's length (the write landed whole but was never synced).
    """

    op_index: int
    keep_bytes: int
    tail: str = "zero"


@dataclass(slots=True)
class _Inode:
    data: bytearray
    synced: bytearray
    pending: list[int] = field(default_factory=list)  # indexes into the op log


def _apply(buffer: bytearray, op: Op, data: bytes | None = None) -> None:
    if op.kind == "write":
        payload = op.data if data is None else data
        end = op.offset + len(payload)
        if len(buffer) < op.offset:
            buffer.extend(bytes(op.offset - len(buffer)))
        buffer[op.offset : end] = payload
    elif op.kind == "size":
        if op.grow:
            if len(buffer) < op.size:
                buffer.extend(bytes(op.size - len(buffer)))
        elif len(buffer) > op.size:
            del buffer[op.size :]
        else:
            buffer.extend(bytes(op.size - len(buffer)))


def _parent(rel: str) -> str:
    return os.path.dirname(rel)


class DiskModel:
    """The disk after a power cut at op ``cut`` of ``recorder``'s log."""

    def __init__(self, recorder: Recorder, cut: int) -> None:
        if not 0 <= cut <= len(recorder.ops):
            raise ValueError(f"cut {cut} outside the log (0..{len(recorder.ops)})")
        self.recorder = recorder
        self.cut = cut
        self.inodes: dict[int, _Inode] = {
            inode: _Inode(bytearray(data), bytearray(data))
            for inode, data in recorder.base_bytes.items()
        }
        self.names: dict[str, int] = dict(recorder.base)
        self.durable_names: dict[str, int] = dict(recorder.base)
        self.lmdb_snapshot = 0
        self.lmdb_in_commit = False
        for index in range(cut):
            self._step(index, recorder.ops[index])

    def _step(self, index: int, op: Op) -> None:
        kind = op.kind
        if kind in ("write", "size"):
            node = self.inodes[op.inode]
            _apply(node.data, op)
            node.pending.append(index)
        elif kind == "sync":
            node = self.inodes[op.inode]
            for pending in node.pending:
                _apply(node.synced, self.recorder.ops[pending])
            node.pending.clear()
        elif kind == "create":
            self.inodes[op.inode] = _Inode(bytearray(), bytearray())
            self.names[op.path] = op.inode
        elif kind == "rename":
            src, dst = op.path, op.path2
            for name in [n for n in self.names if n == src or n.startswith(src + os.sep)]:
                self.names[dst + name[len(src) :]] = self.names.pop(name)
        elif kind == "unlink":
            self.names.pop(op.path, None)
        elif kind == "dirsync":
            directory = op.path
            for name in [n for n in self.durable_names if _parent(n) == directory]:
                del self.durable_names[name]
            for name, inode in self.names.items():
                if _parent(name) == directory:
                    self.durable_names[name] = inode
        elif kind == "lmdb_begin":
            self.lmdb_in_commit = True
        elif kind == "lmdb_commit":
            self.lmdb_in_commit = False
            self.lmdb_snapshot = op.snapshot

    def unsynced_writes(self) -> list[int]:
        """Indexes of the logged writes and size changes not covered by a sync, in order."""
        return sorted(index for node in self.inodes.values() for index in node.pending)

    def files(
        self,
        policy: str,
        rng: random.Random,
        *,
        tear: Tear | None = None,
        drop: set[int] | None = None,
    ) -> tuple[dict[str, bytes], bytes]:
        """(relative path -> content, index/data.mdb content) after the cut.

        ``drop`` names op indexes to lose even if synced (only to prove that
        the oracle notices a lost synced write).
        """
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        ops = self.recorder.ops
        keep: set[int] = set()
        torn: tuple[int, int] | None = None
        if policy == "prefix":
            unsynced = self.unsynced_writes()
            count = rng.randint(0, len(unsynced))
            keep = set(unsynced[:count])
            if count < len(unsynced) and ops[unsynced[count]].kind == "write":
                length = len(ops[unsynced[count]].data)
                torn = (unsynced[count], rng.randint(0, length))
        contents: dict[int, bytes] = {}
        for inode, node in self.inodes.items():
            extra = [i for i in node.pending if i in keep or (torn and i == torn[0])]
            if tear is not None and tear.op_index in node.pending:
                extra.append(tear.op_index)
            buffer = self._rebuild_without(inode, drop) if drop else bytearray(node.synced)
            for index in sorted(set(extra)):
                op = ops[index]
                if tear is not None and index == tear.op_index:
                    _apply(buffer, op, _torn(op.data, tear.keep_bytes, tear.tail, rng))
                elif torn is not None and index == torn[0]:
                    _apply(buffer, op, op.data[: torn[1]])
                else:
                    _apply(buffer, op)
            contents[inode] = bytes(buffer)
        names = self.durable_names if policy == "dirs" else self.names
        files = {name: contents[inode] for name, inode in names.items()}
        snapshot = self.lmdb_snapshot
        if self.lmdb_in_commit and rng.random() < 0.5:
            snapshot = self._next_lmdb_snapshot()
        return files, self.recorder.lmdb_snapshots[snapshot]

    def _next_lmdb_snapshot(self) -> int:
        for op in self.recorder.ops[self.cut :]:
            if op.kind == "lmdb_commit":
                return op.snapshot
        return self.lmdb_snapshot

    def _rebuild_without(self, inode: int, drop: set[int]) -> bytearray:
        """The synced content of ``inode`` had the ops in ``drop`` never happened."""
        ops = self.recorder.ops
        buffer = bytearray(self.recorder.base_bytes.get(inode, b""))
        applied: list[int] = []
        for index in range(self.cut):
            op = ops[index]
            if op.inode != inode:
                continue
            if op.kind in ("write", "size"):
                applied.append(index)
            elif op.kind == "sync":
                for pending in applied:
                    if pending not in drop:
                        _apply(buffer, ops[pending])
                applied.clear()
        return buffer

    def materialize(
        self,
        target: Path,
        policy: str,
        rng: random.Random,
        *,
        tear: Tear | None = None,
        drop: set[int] | None = None,
    ) -> None:
        """Write the post-cut disk to ``target`` (which must not exist).

        ``index/lock.mdb`` is not written: it holds no durable state and LMDB
        recreates it.
        """
        files, lmdb_data = self.files(policy, rng, tear=tear, drop=drop)
        target.mkdir(parents=True, mode=0o700)
        for sub in ("segments", "wal", _INDEX_DIR):
            (target / sub).mkdir(mode=0o700, exist_ok=True)
        for rel, content in files.items():
            path = target / rel
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            path.write_bytes(content)
            path.chmod(0o600)
        data = target / _LMDB_DATA
        data.write_bytes(lmdb_data)
        data.chmod(0o600)


def _torn(data: bytes, keep: int, tail: str, rng: random.Random) -> bytes:
    rest = len(data) - keep
    if tail == "zero":
        return data[:keep] + bytes(rest)
    if tail == "garbage":
        return data[:keep] + rng.randbytes(rest)
    raise ValueError(f"tail must be 'zero' or 'garbage', got {tail!r}")


def copy_store(source: Path, target: Path) -> None:
    """Copy a closed (or quiescent) store directory, LMDB included."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("lock.mdb"))


# -- the Nth-I/O error loop -------------------------------------------------------


_MUTATING = frozenset(
    {
        "open",
        "write",
        "pwrite",
        "pwritev",
        "fsync",
        "fdatasync",
        "ftruncate",
        "truncate",
        "posix_fallocate",
        "rename",
        "replace",
        "unlink",
        "remove",
        "lmdb",
    }
)


class FaultInjector(_Patcher):
    """Fail the ``fail_at``-th I/O call under ``root`` with ``OSError(error)``.

    Counted calls: opens for writing, writes, syncs, size changes, renames,
    unlinks, reads (``pread``/``preadv``) and LMDB write transactions.
    ``persistent`` fails every call from the Nth on; otherwise only the Nth.
    ``fail_at = 0`` injects nothing and just counts. ``only(call, path)``, when
    given, restricts the counted calls (e.g. only unlinks in ``segments/``).
    ``failed`` lists the calls that were failed, as ``(call, relative path)``.
    """

    def __init__(
        self,
        root: Path,
        fail_at: int,
        error: int = errno_module.EIO,
        *,
        persistent: bool = False,
        only: Callable[[str, str], bool] | None = None,
    ) -> None:
        super().__init__(root)
        self.fail_at = fail_at
        self.error = error
        self.persistent = persistent
        self.only = only
        self.count = 0
        self.failed: list[tuple[str, str]] = []
        self.armed = True

    def _should_fail(self, call: str, rel: str) -> bool:
        with self._lock:
            if not self.armed or (call not in _MUTATING and call not in ("pread", "preadv")):
                return False
            if self.only is not None and not self.only(call, rel):
                return False
            self.count += 1
            hit = self.fail_at > 0 and (
                self.count == self.fail_at or (self.persistent and self.count > self.fail_at)
            )
            if hit:
                self.failed.append((call, rel))
            return hit

    def _before(self, call: str, rel: str, fd: int) -> None:
        if self._should_fail(call, rel):
            raise OSError(self.error, f"injected {errno_module.errorcode[self.error]}", rel)

    def _lmdb_write(self, run: Callable[[], Any]) -> Any:
        if self._should_fail("lmdb", _INDEX_DIR):
            import lmdb

            from kvstore.errors import IOFailure

            # What IndexEnv.write turns a failed commit (lmdb.Error) into.
            raise IOFailure(
                "LMDB write failed: injected",
                self.error,
            ) from lmdb.Error("injected")
        return run()

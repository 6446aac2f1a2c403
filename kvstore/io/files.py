"""Opening data files with O_DIRECT (or without, where refused) and durable renames.

Invariant: every file the store creates, and every rename, is followed by an
fsync of its parent directory before anything that depends on it is
acknowledged (a lost directory entry is failure mode 4 in docs/reliability.md).
Store files are created readable by their owner only (0o600).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from kvstore.errors import IOFailure
from kvstore.format.constants import BLOCK_BYTES

__all__ = [
    "acquire_writer_lock",
    "fsync_dir",
    "open_data_file",
    "probe_direct_io",
    "probe_direct_read",
    "system_iov_max",
    "write_file_durably",
]

FILE_MODE = 0o600


def fsync_dir(path: Path) -> None:
    """fsync a directory so the entries created or renamed in it are durable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise IOFailure(f"cannot open directory {path} to fsync it", e.errno) from e
    try:
        os.fsync(fd)
    except OSError as e:
        raise IOFailure(f"fsync of directory {path} failed", e.errno) from e
    finally:
        os.close(fd)


def open_data_file(path: Path, *, direct: bool, create: bool = False) -> int:
    """Open a segment file read-write; with O_DIRECT when ``direct``."""
    flags = os.O_RDWR | os.O_CLOEXEC
    if create:
        flags |= os.O_CREAT | os.O_EXCL
    if direct:
        flags |= os.O_DIRECT
    try:
        return os.open(path, flags, FILE_MODE)
    except OSError as e:
        raise IOFailure(f"cannot open {path}", e.errno) from e


def probe_direct_io(directory: Path) -> bool:
    """True when O_DIRECT reads and writes of aligned blocks work in ``directory``."""
    import mmap

    probe = directory / ".direct-probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, FILE_MODE)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise IOFailure(f"cannot create {probe}", e.errno) from e
    try:
        block = mmap.mmap(-1, BLOCK_BYTES)
        try:
            os.pwritev(fd, [block], 0)
            os.preadv(fd, [block], 0)
        except OSError:
            return False
        finally:
            block.close()
        return True
    finally:
        os.close(fd)
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass  # a leftover dot-file in segments/ is removed by the next writer's open


def write_file_durably(path: Path, data: bytes) -> None:
    """Write ``path`` atomically: tmp file, fsync, rename, fsync the directory."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        raise IOFailure(f"cannot write {path}", e.errno) from e
    fsync_dir(path.parent)


def probe_direct_read(path: Path) -> bool:
    """True when ``path`` (an existing file) can be read with O_DIRECT; writes nothing."""
    import mmap

    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError:
        return False
    block = mmap.mmap(-1, BLOCK_BYTES)
    try:
        os.preadv(fd, [block], 0)
        return True
    except OSError:
        return False
    finally:
        block.close()
        os.close(fd)


def acquire_writer_lock(root: Path, *, record_pid: bool = True) -> int:
    """Take the store's single-writer flock on ``root/LOCK``; the caller closes the fd.

    With ``record_pid`` the holder's pid is written into the file, so a second
    writer's LockedError can name it; without (a dry run) nothing is created
    or written.
    """
    import fcntl

    from kvstore.errors import LockedError
    from kvstore.format.names import LOCK_NAME

    path = root / LOCK_NAME
    try:
        if record_pid:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        else:
            fd = os.open(path if path.exists() else root, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise IOFailure(f"cannot open {path}", e.errno) from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        except OSError:  # the fd is the directory in a dry run
            holder = "unknown"
        os.close(fd)
        raise LockedError(f"store {root} is locked by another writer (pid {holder})") from None
    if record_pid:
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:
            os.close(fd)  # never keep the lock after a failed open
            raise IOFailure(f"cannot record the writer's pid in {path}", e.errno) from e
    return fd


def system_iov_max() -> int:
    """``IOV_MAX`` here: the most buffers one ``readv``/``writev`` may gather (1024 on
    Linux; 16 is the least POSIX allows)."""
    try:
        value = os.sysconf("SC_IOV_MAX")
    except (ValueError, OSError):
        return 1024
    return value if value >= 16 else 1024

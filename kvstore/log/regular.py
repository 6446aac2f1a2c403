"""Every file a store opens is a regular file, checked before open(2) can block.

open(2) of a FIFO for reading blocks until a writer appears, which for a store
file is never; a device or socket is no store file either. So every store file
(superblock, LOCK, segments, WAL files, the LMDB index's ``data.mdb`` and
``lock.mdb``) is checked with stat(2) before it is opened, and files this module
opens itself are opened with O_NONBLOCK and checked again with fstat(2) (no
window in which the name could be swapped for a FIFO). Symbolic links are
followed: a link to a regular file is a regular file.

The store's directories (the root, ``segments/``, ``wal/``, ``index/``) are checked
the same way by ``require_directory``: a symlink loop, or a file where a directory
belongs, is refused with ``IOFailure`` naming the path and what is wrong, before any
call that would fail on it with a bare ``OSError``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

from kvstore.errors import IOFailure, NotRegularFileError
from kvstore.format.names import INDEX_DIR, LOCK_NAME, SEGMENTS_DIR, SUPERBLOCK_NAME, WAL_DIR

__all__ = [
    "directory_error",
    "file_kind",
    "open_regular",
    "read_regular",
    "require_directory",
    "require_regular",
]


def file_kind(mode: int) -> str:
    """What ``st_mode`` describes, in words ("a FIFO", "a directory", ...)."""
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _refuse(path: Path, mode: int) -> NotRegularFileError:
    if path.name == SUPERBLOCK_NAME:
        fix = "restore the superblock from a backup of this store"
    elif path.name in (LOCK_NAME, "lock.mdb"):
        fix = "remove it (it is recreated as a regular file)"
    else:
        fix = "move it aside, then run `kvstore recover PATH`"
    return NotRegularFileError(f"{path} is {file_kind(mode)}, not a regular file: {fix}")


def require_regular(path: Path) -> None:
    """Raise ``NotRegularFileError`` if ``path`` exists and is not a regular file.

    A missing path passes (the caller's open reports it as it always did), and so
    does a stat(2) that fails for another reason (the open reports that too).
    """
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        raise _refuse(path, mode)


def _directory_fix(path: Path) -> str:
    if path.name == SEGMENTS_DIR:
        return "put the store's segments/ back: it holds the pages"
    if path.name in (WAL_DIR, INDEX_DIR):
        return (
            f"put the store's {path.name}/ back, or move this aside and run `kvstore recover PATH`"
        )
    return "fix the link, or pass the store directory's own path"


def directory_error(path: Path, error: OSError) -> IOFailure:
    """The ``IOFailure`` for a store directory ``path`` that stat(2) failed on: a symlink
    loop is named as one (and the fix given); any other errno is reported as it is."""
    if error.errno != errno.ELOOP:
        return IOFailure(f"cannot check the directory {path}", error.errno)
    if not os.path.islink(path):
        return IOFailure(
            f"{path} cannot be reached: a symlink on its path loops (kvstore changed "
            "nothing): fix that link",
            error.errno,
        )
    return IOFailure(
        f"{path} is a symlink loop, not a directory (kvstore changed nothing): "
        f"{_directory_fix(path)}",
        error.errno,
    )


def require_directory(path: Path) -> None:
    """Raise ``IOFailure`` if ``path`` exists and is no directory, or cannot be reached.

    A symlink loop (``errno`` ELOOP) or a regular file, FIFO, device or socket
    (ENOTDIR) where a store directory belongs: the message names the path, what is
    there and the fix. Nothing is changed. A missing path passes (the caller reports
    it as it always did), and so does a dangling link.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise directory_error(path, e) from e
    if not stat.S_ISDIR(mode):
        raise IOFailure(
            f"{path} is {file_kind(mode)}, not a directory (kvstore changed nothing): "
            f"{_directory_fix(path)}",
            errno.ENOTDIR,
        )


def open_regular(path: Path, flags: int) -> int:
    """``os.open(path, flags)``, refusing anything but a regular file without blocking.

    Checks the name with stat(2), opens with O_NONBLOCK, checks the descriptor
    again with fstat(2) (the name may have been swapped meanwhile), then clears
    O_NONBLOCK again (an I/O engine may honour it on regular files). OSError from
    the open passes through, so callers keep their own handling of ENOENT.
    """
    require_regular(path)  # also before flags (O_DIRECT) that a FIFO refuses with EINVAL
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _refuse(path, mode)
        if not flags & os.O_NONBLOCK:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_fd(fd: int, size: int) -> bytes:
    """Up to ``size`` bytes from ``fd``'s position, fewer if the file ends first."""
    chunks = []
    remaining = size
    while remaining > 0:
        chunk = os.read(fd, min(remaining, 1 << 24))
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def read_regular(path: Path, limit_bytes: int | None = None) -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit_bytes``).

    FileNotFoundError passes through; other OSErrors become ``IOFailure``.
    """
    try:
        fd = open_regular(path, os.O_RDONLY)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise IOFailure(f"cannot open {path}", e.errno) from e
    try:
        return read_fd(fd, os.fstat(fd).st_size if limit_bytes is None else limit_bytes)
    except OSError as e:
        raise IOFailure(f"cannot read {path}", e.errno) from e
    finally:
        os.close(fd)

"""Every file a store opens is a regular file, checked before open(2) can block.

open(2) of a FIFO for reading blocks until a writer appears, which for a store
file is never; a device or socket is no store file either. So every store file
(superblock, LOCK, segments, WAL files, the LMDB index's ``data.mdb`` and
``lock.mdb``) is checked with stat(2) before it is opened, and files this module
opens itself are opened with O_NONBLOCK and checked again with fstat(2) (no
window in which the name could be swapped for a FIFO). Symbolic links are
followed: a link to a regular file is a regular file.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

from kvstore.errors import IOFailure, NotRegularFileError
from kvstore.format.names import LOCK_NAME, SUPERBLOCK_NAME

__all__ = ["file_kind", "open_regular", "read_regular", "require_regular"]


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

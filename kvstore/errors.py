"""The one exception hierarchy of kvstore.

Every failure the library raises on purpose is a ``KVStoreError``. Each class
says what went wrong and how to fix it; ``IOFailure`` keeps the errno. Misuse of
the API with wrong types or values raises the built-in ``TypeError`` /
``ValueError``; a missing key is ``None``, never an error.
"""

from __future__ import annotations

import errno as errno_module

__all__ = [
    "AlreadyOpenError",
    "ClosedError",
    "CorruptionError",
    "FormatVersionError",
    "IOFailure",
    "KVStoreError",
    "LockedError",
    "NotRegularFileError",
    "PinError",
    "ReadOnlyError",
    "StoreFullError",
    "StoreNotFoundError",
    "WriterFailedError",
]


class KVStoreError(Exception):
    """Base class of every error kvstore raises on purpose."""

    hint: str = ""

    def __str__(self) -> str:
        message = super().__str__()
        if self.hint and self.hint not in message:
            return f"{message} (hint: {self.hint})"
        return message


class CorruptionError(KVStoreError):
    """Bytes on disk do not match their checksum, location or format.

    The page or file named in the message cannot be trusted. Run
    ``kvstore fsck PATH --deep`` to see the extent and ``kvstore recover PATH``
    to rebuild the index from the segments.
    """

    hint = "run `kvstore fsck PATH --deep`, then `kvstore recover PATH`"


class NotRegularFileError(CorruptionError):
    """A store file is a FIFO, device, socket or directory instead of a regular file.

    kvstore never opens such a file (opening a FIFO would block forever). The
    message says what to do: remove a lock file (it is recreated), move an
    index, WAL or segment file aside and run ``kvstore recover PATH``, restore a
    superblock from a backup of the same store.
    """

    hint = "kvstore opens only regular files"


class FormatVersionError(KVStoreError):
    """The store was written by a format version this build cannot read.

    Upgrade kvstore, or open the store with the version that created it.
    """

    hint = "open it with the kvstore release that created it"


class StoreNotFoundError(KVStoreError):
    """No store exists at the path. Pass ``create=True`` or run ``kvstore init``."""

    hint = "pass create=True or run `kvstore init PATH`"


class LockedError(KVStoreError):
    """Another process holds the store's writer lock.

    Close the other writer, or open with ``readonly=True``.
    """

    hint = "close the other writer or open with readonly=True"


class AlreadyOpenError(KVStoreError):
    """This process already has the store open; LMDB allows one environment per process.

    Reuse the open ``KVStore`` instance (it is thread-safe) instead of opening again.
    """

    hint = "reuse the KVStore instance this process already opened"


class ReadOnlyError(KVStoreError):
    """A write was attempted on a store opened with ``readonly=True``."""

    hint = "open the store without readonly=True to write"


class ClosedError(KVStoreError):
    """The store has been closed; open it again to use it."""

    hint = "open the store again with KVStore.open"


class StoreFullError(KVStoreError):
    """There is no room for the page and nothing can be evicted.

    Raise ``capacity_bytes``, free space on the device, delete or release pages.
    """

    hint = "raise capacity_bytes, or delete/release pages"


class PinError(KVStoreError):
    """A pin/unpin was unbalanced (unpin below zero, or of an unknown key)."""

    hint = "call unpin exactly once for each successful pin"


class IOFailure(KVStoreError):
    """An operating-system I/O call failed; ``errno`` keeps the cause."""

    hint = "check the device and file system (dmesg), then reopen the store"

    def __init__(self, message: str, errno: int | None = None) -> None:
        if errno is not None:
            name = errno_module.errorcode.get(errno, str(errno))
            message = f"{message}: [{name}] {_strerror(errno)}"
        super().__init__(message)
        self.errno = errno


class WriterFailedError(IOFailure):
    """A write or fsync failed, so the writer stopped accepting writes.

    After a failed fsync the kernel may have dropped the dirty pages, so a retry
    could "succeed" without the data (fsyncgate). Nothing acknowledged is lost:
    close the store and open it again; recovery replays the write-ahead log.
    """

    hint = "close and reopen the store; recovery replays the WAL"


def _strerror(code: int) -> str:
    import os

    try:
        return os.strerror(code)
    except ValueError:
        return "unknown error"

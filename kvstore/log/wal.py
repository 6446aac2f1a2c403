"""The write-ahead log: append with group commit, rotate, and read back.

Files are ``wal/<first_lsn>.wal``: a file header naming the predecessor file,
then framed records (see kvstore/format/wal.py). Writes are buffered appends
followed by ``fdatasync``; a new file is fsynced and its directory entry made
durable before any record is appended to it.

Invariants:
- A record is appended only after the segment data it names is durable
  (the store's group commit fdatasyncs segments first).
- A failed write or fdatasync poisons the writer: it is never retried
  (fsyncgate), the store stops accepting writes and recovery replays the log.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.errors import CorruptionError, IOFailure, WriterFailedError
from kvstore.format.names import WAL_DIR, parse_wal_name, wal_path
from kvstore.format.wal import (
    WAL_FILE_HEADER_BYTES,
    WalFileHeader,
    WalRecord,
    WalScan,
    decode_wal_file_header,
    encode_wal_file_header,
    encode_wal_record,
    iter_records,
    repair_record,
    repair_wal_file_header,
)
from kvstore.io.files import FILE_MODE, fsync_dir
from kvstore.log.regular import read_fd

__all__ = ["WalFile", "WalWriter", "list_wal_files", "read_wal_chain", "scan_repairing"]


class WalWriter:
    """Appends to the newest WAL file. Not thread-safe: the store serialises commits."""

    def __init__(self, root: Path, store_uuid: bytes, first_lsn: int, prev_first_lsn: int) -> None:
        self.root = root
        self.store_uuid = store_uuid
        self.first_lsn = first_lsn
        self.fd = -1
        self.size_bytes = 0
        self.total_bytes_written = 0
        self._open_new(first_lsn, prev_first_lsn)

    def _open_new(self, first_lsn: int, prev_first_lsn: int) -> None:
        path = wal_path(self.root, first_lsn)
        header = encode_wal_file_header(
            WalFileHeader(self.store_uuid, first_lsn, prev_first_lsn, time.time_ns())
        )
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        except OSError as e:
            raise IOFailure(f"cannot create WAL file {path}", e.errno) from e
        try:
            _write_all(fd, header, path)
            os.fdatasync(fd)
        except OSError as e:
            os.close(fd)
            raise WriterFailedError(f"cannot initialise WAL file {path}", e.errno) from e
        try:
            fsync_dir(self.root / WAL_DIR)
        except IOFailure:
            os.close(fd)
            raise
        if self.fd >= 0:
            os.close(self.fd)
        self.fd = fd
        self.first_lsn = first_lsn
        self.size_bytes = len(header)
        self.total_bytes_written += len(header)

    def append(self, data: bytes) -> None:
        """Append framed records (not yet durable)."""
        try:
            _write_all(self.fd, data, wal_path(self.root, self.first_lsn))
        except OSError as e:
            raise WriterFailedError("append to the WAL failed", e.errno) from e
        self.size_bytes += len(data)
        self.total_bytes_written += len(data)

    def sync(self) -> None:
        try:
            os.fdatasync(self.fd)
        except OSError as e:
            raise WriterFailedError("fdatasync of the WAL failed", e.errno) from e

    def rotate(self, first_lsn: int) -> None:
        """Start a new file whose records all have LSN-order after this one's."""
        self._open_new(first_lsn, self.first_lsn)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _write_all(fd: int, data: bytes, path: Path) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(5, f"short write to {path}")
        view = view[written:]


def list_wal_files(root: Path) -> list[tuple[int, Path]]:
    """(first_lsn, path) of every well-named WAL file, oldest first."""
    found = []
    for entry in os.scandir(root / WAL_DIR):
        first = parse_wal_name(entry.name)
        if first is not None:
            found.append((first, Path(entry.path)))
    return sorted(found)


@dataclass(slots=True)
class WalFile:
    """One WAL file as read at recovery."""

    first_lsn: int
    path: Path
    records: list[WalRecord]
    valid_end: int
    file_bytes: int
    torn_tail: str | None  # why the tail was cut, if it was
    # What was damaged and repaired or taken on trust in this file (a degraded open):
    repairs: list[str] = field(default_factory=list)
    header_damaged: bool = False  # its header failed its checksum; records were still used


def _open_wal_file(path: Path) -> int:
    """A descriptor of one WAL file (non-blocking: a FIFO in its place cannot hang).

    FileNotFoundError passes through as is: a read-only open retries it (the
    writer's checkpoint may have deleted the file since the listing).
    """
    try:
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise IOFailure(f"cannot open WAL file {path}", e.errno) from e


def _read_wal_file(path: Path, fd: int | None = None) -> bytes:
    """The bytes of one WAL file (from ``fd`` if given; closed either way);
    anything but a regular file is corruption."""
    if fd is None:
        fd = _open_wal_file(path)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CorruptionError(
                f"WAL file {path.name} is not a regular file; run `kvstore recover PATH`"
            )
        return read_fd(fd, info.st_size)
    except OSError as e:
        raise IOFailure(f"cannot read WAL file {path}", e.errno) from e
    finally:
        os.close(fd)


def read_wal_chain(root: Path, store_uuid: bytes, start_lsn: int) -> list[WalFile]:
    """Read every WAL file from the one named ``start_lsn`` on, checking the chain.

    A torn tail is allowed only in the newest file (``torn_tail`` says why).
    Corruption anywhere else, a missing file, a broken chain, or a file of
    another store raises CorruptionError that names ``kvstore recover``.
    """
    files = [(first, path) for first, path in list_wal_files(root) if first >= start_lsn]
    if not files or files[0][0] != start_lsn:
        raise CorruptionError(
            f"WAL file {wal_path(root, start_lsn).name} named by the checkpoint is missing; "
            "run `kvstore recover PATH`"
        )
    # Every file is opened before any is read: a live writer's checkpoint may
    # delete them while this replays, and an open file stays readable.
    fds: list[int] = []
    try:
        for _, path in files:
            fds.append(_open_wal_file(path))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    try:
        return _read_chain(files, fds, store_uuid)
    finally:
        for fd in fds:  # those not read (a damaged file stops the chain)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)


def _read_chain(files: list[tuple[int, Path]], fds: list[int], store_uuid: bytes) -> list[WalFile]:
    """Read and check each file of ``files`` in turn (``fds[i]`` is set to -1 once
    ``_read_wal_file`` has taken, and closed, it)."""
    chain: list[WalFile] = []
    for position, (first, path) in enumerate(files):
        is_last = position == len(files) - 1
        fd, fds[position] = fds[position], -1
        data = _read_wal_file(path, fd)
        repairs: list[str] = []
        link_known, header_damaged = True, False
        try:
            header = decode_wal_file_header(data)
        except CorruptionError:
            if is_last and position > 0 and _looks_unwritten(data):
                # Created but never got its header durably: a crash during rotation.
                chain.append(WalFile(first, path, [], 0, len(data), "header never written"))
                break
            header, link_known, how = _damaged_header(data, store_uuid, first, chain)
            header_damaged = True
            repairs.append(f"{path.name}: damaged file header; {how}")
        if header.store_uuid != store_uuid or header.first_lsn != first:
            raise CorruptionError(
                f"WAL file {path.name} does not belong here; run `kvstore recover PATH`"
            )
        if link_known and chain and header.prev_first_lsn != chain[-1].first_lsn:
            raise CorruptionError(
                f"WAL chain broken before {path.name}: it follows "
                f"{header.prev_first_lsn:016x}.wal, which is missing; run `kvstore recover PATH`"
            )
        scan = scan_repairing(data, path.name, repairs)
        if scan.stop_reason is not None and (not is_last or scan.later_valid_offset is not None):
            raise CorruptionError(
                f"WAL file {path.name} is corrupt at byte {scan.valid_end} "
                f"({scan.stop_reason}) with valid records after it: a change logged there "
                "cannot be read, so the pages it touched cannot be vouched for; run "
                "`kvstore recover PATH`"
            )
        chain.append(
            WalFile(
                first,
                path,
                scan.records,
                scan.valid_end,
                len(data),
                scan.stop_reason,
                repairs,
                header_damaged,
            )
        )
    return chain


_HEADER_TAKEN = "its records are used, each verified by its own checksum"
_MAX_RECORD_REPAIRS = 8  # per file; more damage than this is no stray flip


def _damaged_header(
    data: bytes, store_uuid: bytes, first: int, chain: list[WalFile]
) -> tuple[WalFileHeader, bool, str]:
    """A header that failed its checksum: (header, whether its chain link is known, how).

    Its records follow at a fixed offset and carry their own checksums, so they are
    used either way; what the header alone says (store, first LSN, predecessor) is
    the file's name, the store's uuid and, when a repair proves it, the stored link.
    """
    prev = chain[-1].first_lsn if chain else None
    repaired = repair_wal_file_header(data, store_uuid, first, prev)
    if repaired is not None:
        header, how = repaired
        return header, True, f"{how}; {_HEADER_TAKEN}"
    # More than one byte is damaged: the file's name still says where it belongs in
    # the chain (the next file's header names this one), but its own link to its
    # predecessor cannot be checked.
    header = WalFileHeader(store_uuid, first, prev or 0, 0)
    return (
        header,
        False,
        f"could not be repaired (link to its predecessor unchecked); {_HEADER_TAKEN}",
    )


def scan_repairing(data: bytes, name: str, repairs: list[str]) -> WalScan:
    """``iter_records`` that undoes a single damaged byte in a record (``repair_record``)."""
    records: list[WalRecord] = []
    start = WAL_FILE_HEADER_BYTES
    for _ in range(_MAX_RECORD_REPAIRS + 1):
        scan = iter_records(data, start)
        records.extend(scan.records)
        if scan.stop_reason is None or len(repairs) > _MAX_RECORD_REPAIRS:
            break
        end = scan.later_valid_offset if scan.later_valid_offset is not None else len(data)
        fixed = repair_record(data, scan.valid_end, end)
        if fixed is None:
            break
        raw = encode_wal_record(fixed.record_type, fixed.lsn, fixed.body)
        data = data[: scan.valid_end] + raw + data[end:]
        repairs.append(
            f"{name}: record at byte {scan.valid_end} ({scan.stop_reason}) had one damaged "
            "byte, undone (proven by its checksum)"
        )
        start = scan.valid_end
    scan.records = records
    return scan


def _looks_unwritten(data: bytes) -> bool:
    return len(data) < WAL_FILE_HEADER_BYTES or not any(data[:WAL_FILE_HEADER_BYTES])

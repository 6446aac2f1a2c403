"""Segment files: fixed-size, preallocated, append-only logs of page records.

Layout: block 0 is the segment header; records follow, each a 4 KiB header
block and a payload padded to 4 KiB. Space is handed out by ``reserve`` under
the store's lock; the bytes are written by the caller's I/O queue.

Invariant: a segment file exists and its directory entry is durable (file
fsync + segments/ fsync) before any WAL record names it.
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import CorruptionError, IOFailure, KVStoreError
from kvstore.format.constants import BLOCK_BYTES
from kvstore.format.names import SEGMENTS_DIR, parse_segment_name, segment_path
from kvstore.format.records import (
    SegmentHeader,
    decode_segment_header,
    encode_segment_header,
)
from kvstore.io.buffers import AlignedBuffer
from kvstore.io.files import fsync_dir, open_data_file
from kvstore.log.regular import open_regular, require_regular

__all__ = [
    "Segment",
    "create_segment",
    "list_segment_files",
    "open_segment",
    "open_untrusted_segment",
    "rewrite_segment_header",
]


@dataclass(slots=True)
class Segment:
    """An open segment file. ``head`` is the next free offset (4 KiB aligned)."""

    segment_id: int
    generation: int
    path: Path
    fd: int
    size_bytes: int
    head: int
    created_unix_ns: int
    dirty: bool = False  # written since its last fdatasync

    def remaining(self) -> int:
        return self.size_bytes - self.head

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def create_segment(
    root: Path,
    segment_id: int,
    generation: int,
    *,
    size_bytes: int,
    store_uuid: bytes,
    direct: bool,
) -> Segment:
    """Create, preallocate, stamp and durably link a new segment file."""
    path = segment_path(root, segment_id)
    fd = open_data_file(path, direct=direct, create=True)
    created = time.time_ns()
    try:
        try:
            os.posix_fallocate(fd, 0, size_bytes)
        except OSError as e:
            raise IOFailure(f"cannot preallocate {size_bytes} bytes for {path}", e.errno) from e
        header = encode_segment_header(
            SegmentHeader(store_uuid, segment_id, generation, size_bytes, created)
        )
        block = AlignedBuffer(BLOCK_BYTES)
        block.view[:] = header
        try:
            written = os.pwritev(fd, [block.view], 0)
            if written != BLOCK_BYTES:
                raise IOFailure(f"short write of segment header to {path}")
            os.fsync(fd)
        except OSError as e:
            raise IOFailure(f"cannot initialise segment {path}", e.errno) from e
    except BaseException:
        os.close(fd)
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass  # keep the first error; the next open removes the orphan file
        raise
    fsync_dir(root / SEGMENTS_DIR)
    return Segment(segment_id, generation, path, fd, size_bytes, BLOCK_BYTES, created)


def read_segment_header(fd: int, path: Path) -> SegmentHeader:
    block = AlignedBuffer(BLOCK_BYTES)
    try:
        count = os.preadv(fd, [block.view], 0)
    except OSError as e:
        raise IOFailure(f"cannot read segment header of {path}", e.errno) from e
    if count != BLOCK_BYTES:
        raise CorruptionError(f"segment {path}: file shorter than its header")
    return decode_segment_header(block.view)


def open_segment(
    root: Path,
    segment_id: int,
    generation: int,
    head: int,
    *,
    store_uuid: bytes,
    direct: bool,
    readonly: bool = False,
) -> Segment:
    """Open an existing segment and check that its header matches the index."""
    path = segment_path(root, segment_id)
    if not path.exists():
        raise CorruptionError(f"segment {segment_id} is in the index but {path} is missing")
    flags_direct = direct
    if readonly:
        try:
            fd = open_regular(path, os.O_RDONLY | (os.O_DIRECT if flags_direct else 0))
        except OSError as e:
            raise IOFailure(f"cannot open {path}", e.errno) from e
    else:
        require_regular(path)  # O_RDWR of a FIFO would not block, but it is no segment
        fd = open_data_file(path, direct=direct)
    try:
        header = read_segment_header(fd, path)
        if header.store_uuid != store_uuid:
            raise CorruptionError(f"segment {path} belongs to another store")
        if header.segment_id != segment_id or header.generation != generation:
            raise CorruptionError(
                f"segment {path}: header says id {header.segment_id} generation "
                f"{header.generation}, index says {segment_id}/{generation}"
            )
        size = os.fstat(fd).st_size
        if size < header.segment_bytes:
            raise CorruptionError(f"segment {path} is truncated ({size} < {header.segment_bytes})")
    except BaseException:
        os.close(fd)
        raise
    return Segment(
        segment_id, generation, path, fd, header.segment_bytes, head, header.created_unix_ns
    )


def open_untrusted_segment(
    root: Path,
    segment_id: int,
    generation: int,
    head: int,
    *,
    size_bytes: int,
    direct: bool,
    readonly: bool = False,
) -> Segment | None:
    """Open a segment whose header ``open_segment`` refused, for reading only.

    Its header is not trusted: the id and generation come from the index and the
    size from the superblock. Nothing may be written into it; every record read
    from it is still verified against its index entry (key, location, generation,
    LSN, length, checksums), which the record carries itself. None when there is
    no regular file to open.
    """
    path = segment_path(root, segment_id)
    try:
        require_regular(path)
        fd = open_regular(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    except (OSError, KVStoreError):
        return None
    return Segment(segment_id, generation, path, fd, size_bytes, head, 0)


def rewrite_segment_header(path: Path, header: SegmentHeader) -> None:
    """Write ``header`` over a damaged one, durably, extending a short file.

    Only for a segment whose identity is proven otherwise (records in it that
    verify against the index name its id and generation): ``fsck --repair`` and
    ``kvstore recover`` use it.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_size < header.segment_bytes:
            os.ftruncate(fd, header.segment_bytes)
        if os.pwrite(fd, encode_segment_header(header), 0) != BLOCK_BYTES:
            raise OSError(5, f"short write of the segment header of {path}")
        os.fsync(fd)
    finally:
        os.close(fd)


def list_segment_files(root: Path) -> dict[int, Path]:
    """Segment id -> path for every well-named file in segments/."""
    found: dict[int, Path] = {}
    for entry in os.scandir(root / SEGMENTS_DIR):
        segment_id = parse_segment_name(entry.name)
        if segment_id is not None:
            found[segment_id] = Path(entry.path)
    return found


def recycle_segment(
    root: Path, old: Segment, segment_id: int, generation: int, *, store_uuid: bytes
) -> Segment:
    """Reuse a freed segment's file under a new id and generation.

    The file keeps its written extents, so the next pass over it overwrites
    blocks instead of converting unwritten extents (cheaper writes and
    fdatasyncs on ext4/XFS). Records left from the old incarnation name the old
    id and generation and are rejected by every reader. The caller has already
    made the free durable in the WAL.
    """
    path = segment_path(root, segment_id)
    created = time.time_ns()
    header = encode_segment_header(
        SegmentHeader(store_uuid, segment_id, generation, old.size_bytes, created)
    )
    block = AlignedBuffer(BLOCK_BYTES)
    block.view[:] = header
    if os.path.lexists(path):  # rename(2) would replace it: an id is never reused
        raise IOFailure(f"cannot recycle segment {old.path} as {path}", errno.EEXIST)
    try:
        os.rename(old.path, path)
        old.path = path  # if the rest fails, the caller removes the file by its new name
        if os.pwritev(old.fd, [block.view], 0) != BLOCK_BYTES:
            raise IOFailure(f"short write of segment header to {path}")
        os.fdatasync(old.fd)
    except OSError as e:
        raise IOFailure(f"cannot recycle segment {old.path} as {path}", e.errno) from e
    fsync_dir(root / SEGMENTS_DIR)
    return Segment(segment_id, generation, path, old.fd, old.size_bytes, BLOCK_BYTES, created)

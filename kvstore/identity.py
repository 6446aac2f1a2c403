"""Establishing a store's identity when its superblock (``KVSTORE``) is damaged.

The superblock holds what every other structure is checked against: the store's
uuid and its geometry. Most of it is also written elsewhere: every segment
header and WAL file header carries the uuid, every segment header the segment
size. ``reconstruct_superblock`` rebuilds the damaged block from that evidence
and the bytes that survive, and accepts a result only when the superblock's own
stored checksum proves it (the rebuilt block must seal to exactly the checksum
that was written), or when only the checksum itself was damaged (every field
agrees with the evidence and one byte of the checksum differs). Anything else
leaves the identity unestablished: the store is refused, with the fix.

``kvstore recover PATH`` writes a proven reconstruction back (durably); a store
open only names that command (docs/operations.md, "Degraded open").
"""

from __future__ import annotations

import os
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import CorruptionError, FormatVersionError, KVStoreError
from kvstore.format.checksum import checksum
from kvstore.format.constants import BLOCK_BYTES, SUPERBLOCK_MAGIC
from kvstore.format.names import SEGMENTS_DIR, SUPERBLOCK_NAME, WAL_DIR
from kvstore.format.records import Superblock, decode_segment_header, decode_superblock
from kvstore.format.wal import WAL_FILE_HEADER_BYTES, decode_wal_file_header
from kvstore.log.regular import read_regular

__all__ = ["Reconstruction", "reconstruct_superblock", "superblock_error"]

_CHECKSUM_AT = BLOCK_BYTES - 8
_FIELDS = struct.Struct("<8sHHI16sQQQQ")  # as kvstore/format/records.py's superblock
_MAX_FILES = 4096  # headers read for evidence (enough to agree; bounded work)


@dataclass(frozen=True, slots=True)
class Reconstruction:
    """A proven superblock (``superblock`` set, ``block`` its bytes), or why there is none."""

    superblock: Superblock | None
    block: bytes
    how: str


def _evidence(root: Path) -> tuple[Counter[bytes], Counter[int]]:
    """Store uuids named by sound segment and WAL headers, and the segment sizes."""
    uuids: Counter[bytes] = Counter()
    sizes: Counter[int] = Counter()
    for directory, length in ((SEGMENTS_DIR, BLOCK_BYTES), (WAL_DIR, WAL_FILE_HEADER_BYTES)):
        try:
            names = sorted(os.listdir(root / directory))[:_MAX_FILES]
        except OSError:
            continue
        for name in names:
            try:
                raw = read_regular(root / directory / name, length)
                if directory == SEGMENTS_DIR:
                    segment = decode_segment_header(raw)
                    uuids[segment.store_uuid] += 1
                    sizes[segment.segment_bytes] += 1
                else:
                    uuids[decode_wal_file_header(raw).store_uuid] += 1
            except (KVStoreError, OSError):
                continue
    return uuids, sizes


def _seal(block: bytearray) -> bool:
    """Whether ``block`` matches the checksum stored in its last 8 bytes."""
    stored = int.from_bytes(block[_CHECKSUM_AT:], "little")
    return stored == checksum(memoryview(block)[:_CHECKSUM_AT])


def reconstruct_superblock(root: Path) -> Reconstruction:
    """Rebuild the damaged superblock of ``root``, proven, or say why it cannot be."""
    try:
        damaged = bytearray(read_regular(root / SUPERBLOCK_NAME, BLOCK_BYTES))
    except (KVStoreError, OSError) as e:
        return Reconstruction(None, b"", f"the superblock cannot be read ({e})")
    damaged.extend(bytes(BLOCK_BYTES - len(damaged)))
    uuids, sizes = _evidence(root)
    if not uuids:
        return Reconstruction(None, b"", "no segment or WAL header names the store")
    if len(uuids) > 1:
        return Reconstruction(None, b"", "segment and WAL headers name more than one store")
    store_uuid = next(iter(uuids))
    stored = _FIELDS.unpack_from(damaged, 0)
    segment_bytes = sizes.most_common(1)[0][0] if len(sizes) == 1 else stored[6]
    # The fields the store knows (magic, version, block size, flags, uuid, segment
    # size, the zero area); the creation time, page limit and capacity as stored.
    block = bytearray(BLOCK_BYTES)
    _FIELDS.pack_into(
        block,
        0,
        SUPERBLOCK_MAGIC,
        1,
        BLOCK_BYTES,
        0,
        store_uuid,
        stored[5],
        segment_bytes,
        stored[7],
        stored[8],
    )
    block[_CHECKSUM_AT:] = damaged[_CHECKSUM_AT:]
    candidates: list[tuple[bytes, str]] = []
    if _seal(block):
        candidates.append((bytes(block), "rebuilt from the segment and WAL headers"))
    else:
        # One damaged byte among the fields only the superblock holds.
        own = (*range(32, 40), *(range(40, 48) if len(sizes) != 1 else ()), *range(48, 64))
        for position in own:
            original = block[position]
            for value in range(256):
                if value == original:
                    continue
                block[position] = value
                if _seal(block):
                    candidates.append((bytes(block), "one damaged byte undone"))
            block[position] = original
        # Or the checksum itself: every field as the evidence says, one byte off.
        actual = checksum(memoryview(block)[:_CHECKSUM_AT]).to_bytes(8, "little")
        if sum(a != b for a, b in zip(actual, block[_CHECKSUM_AT:], strict=True)) == 1:
            candidates.append(
                (bytes(block[:_CHECKSUM_AT]) + actual, "its checksum had one damaged byte")
            )
    if len(candidates) != 1:
        return Reconstruction(
            None,
            b"",
            "the surviving bytes and the segment and WAL headers do not prove one superblock",
        )
    raw, how = candidates[0]
    try:
        superblock = decode_superblock(raw)
    except (CorruptionError, FormatVersionError) as e:
        return Reconstruction(None, b"", f"the rebuilt superblock is not sound ({e})")
    return Reconstruction(superblock, raw, how)


def superblock_error(root: Path, cause: KVStoreError) -> CorruptionError:
    """The refusal of a store whose superblock is damaged, naming the exact fix."""
    found = reconstruct_superblock(root)
    reason = cause.args[0] if cause.args else str(cause)
    if found.superblock is not None:
        fix = (
            f"run `kvstore recover {root}`: it rebuilds the superblock ({found.how}; "
            "proven by its own checksum) and checks the rest of the store"
        )
    else:
        fix = (
            f"the store's identity cannot be established ({found.how}): restore "
            f"{root / SUPERBLOCK_NAME} from a backup of this store, or remove {root} "
            "to start an empty cache there"
        )
    error = CorruptionError(f"{root / SUPERBLOCK_NAME} is damaged ({reason}); {fix}")
    error.hint = fix
    return error

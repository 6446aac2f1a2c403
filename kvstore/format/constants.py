"""On-disk constants. These numbers never change once released.

docs/format.md specifies every layout in prose with a grammar; this module is
the same thing as code. A retired value stays here as a comment.
"""

from __future__ import annotations

FORMAT_VERSION = 1
"""Version of every on-disk structure. Bumped on any incompatible change."""

BLOCK_BYTES = 4096
"""Alignment unit: every record and every payload starts on this boundary."""

SUPERBLOCK_MAGIC = b"KVSTORE\x00"
SEGMENT_MAGIC = b"KVSEGMT\x00"
RECORD_MAGIC = b"KVPAGE\x00\x01"
WAL_FILE_MAGIC = b"KVWALOG\x00"
WAL_RECORD_MAGIC = 0x4B56574C  # "KVWL" as little-endian u32 at each record start

MAX_KEY_BYTES = 1024
"""The longest key a page record or WAL record can carry (readers accept it)."""
MAX_INDEX_KEY_BYTES = 511
"""The longest key the store accepts: what the LMDB index holds (py-lmdb's
MDB_MAXKEYSIZE; checked against the LMDB build at every open). Earlier builds
accepted up to ``MAX_KEY_BYTES`` at put; such keys never reached the index (every
checkpoint failed) and the next open's WAL replay drops them with a note."""
MAX_META_BYTES = 2048
MAX_META_DEPTH = 64
"""Meta may nest dicts and lists this deep (the API's limit; JSON decoders recurse)."""
MAX_PAGE_BYTES_LIMIT = 1 << 32  # hard ceiling for max_page_bytes (u32 padding math)
MAX_SEGMENT_BYTES = 1 << 40  # readers refuse a larger segment_bytes as implausible
SEQUENCE_LIMIT = 1 << 62
"""LSNs, segment ids and generations at or past this are implausible (at 10^9 a
second a writer needs 146 years to reach it). Readers treat them as corruption,
so the arithmetic done on them (``+ 1``, leases) never overflows a u64 field."""

# Record types inside segments (u8). 0 is never written (zeroed space).
RECORD_PAGE = 1
RECORD_TOMBSTONE = 2  # reserved for index rebuild from segments

# WAL record types (u8). 0 is never written.
WAL_PUT = 1
WAL_DELETE = 2
WAL_SEGMENT_OPEN = 3
WAL_SEGMENT_FREE = 4
WAL_MOVE = 5
WAL_RETAIN = 6
WAL_RELEASE = 7


def align_up(size: int, alignment: int = BLOCK_BYTES) -> int:
    """Round ``size`` up to a multiple of ``alignment`` (a power of two)."""
    return (size + alignment - 1) & ~(alignment - 1)


def record_span(payload_bytes: int) -> int:
    """Bytes a page record occupies in a segment: header block + padded payload."""
    return BLOCK_BYTES + align_up(payload_bytes)


WAL_LSN_LEASE = 8  # LSNs below the leased bound may appear in segments; never reuse them

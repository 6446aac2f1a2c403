"""The one checksum used on disk: xxh3-64 (xxhash), as an unsigned integer."""

from __future__ import annotations

from typing import TypeAlias

import xxhash

BytesLike: TypeAlias = bytes | bytearray | memoryview


def checksum(data: BytesLike) -> int:
    """xxh3-64 of ``data``; the value stored in every on-disk checksum field."""
    return int(xxhash.xxh3_64_intdigest(data))

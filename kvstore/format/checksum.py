"""The one checksum used on disk: xxh3-64 (xxhash), as an unsigned integer."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias

import xxhash

BytesLike: TypeAlias = bytes | bytearray | memoryview

# xxh3-64 of ``data``; the value stored in every on-disk checksum field. The
# binding itself, not a wrapper: it runs several times per page on the hot paths.
checksum: Callable[[BytesLike], int] = xxhash.xxh3_64_intdigest

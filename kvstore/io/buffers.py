"""Page-aligned buffers for O_DIRECT and io_uring, pooled by size class.

Anonymous ``mmap`` memory is page aligned (4 KiB), which satisfies O_DIRECT's
buffer alignment on every file system we support. A buffer handed to the
kernel must stay alive until its I/O completes; the pool never frees a buffer
that is checked out.
"""

from __future__ import annotations

import mmap
import threading

from kvstore.format.constants import BLOCK_BYTES

__all__ = ["AlignedBuffer", "BufferPool"]


class AlignedBuffer:
    """One page-aligned buffer of ``capacity`` bytes; ``view`` is its memoryview."""

    __slots__ = ("_map", "capacity", "view")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._map = mmap.mmap(-1, capacity)
        self.view = memoryview(self._map)


def _size_class(size: int) -> int:
    size = max(size, 2 * BLOCK_BYTES)
    return 1 << (size - 1).bit_length()


class BufferPool:
    """Thread-safe free lists of aligned buffers, one list per power-of-two size."""

    def __init__(self, max_free_per_class: int = 64) -> None:
        self._free: dict[int, list[AlignedBuffer]] = {}
        self._lock = threading.Lock()
        self._max_free = max_free_per_class

    def acquire(self, size: int) -> AlignedBuffer:
        """A buffer of at least ``size`` bytes; contents are whatever was there."""
        capacity = _size_class(size)
        with self._lock:
            free = self._free.get(capacity)
            if free:
                return free.pop()
        return AlignedBuffer(capacity)

    def release(self, buffer: AlignedBuffer) -> None:
        with self._lock:
            free = self._free.setdefault(buffer.capacity, [])
            if len(free) < self._max_free:
                free.append(buffer)

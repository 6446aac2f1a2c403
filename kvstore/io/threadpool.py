"""Fallback engine: os.preadv / os.pwritev in a thread pool.

Used where io_uring is refused (seccomp in containers, io_uring_disabled).
The syscalls release the GIL, so the pool gives real parallelism.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from kvstore.io.files import system_iov_max

__all__ = ["ThreadPoolEngine", "ThreadPoolQueue"]


def _pwrite(fd: int, buffer: memoryview, offset: int) -> int:
    try:
        return os.pwritev(fd, [buffer], offset)
    except OSError as e:
        return -(e.errno or 5)


def _pwritev(fd: int, buffers: list[memoryview], offset: int) -> int:
    try:
        return os.pwritev(fd, buffers, offset)
    except OSError as e:
        return -(e.errno or 5)


def _pread(fd: int, buffer: memoryview, offset: int) -> int:
    try:
        return os.preadv(fd, [buffer], offset)
    except OSError as e:
        return -(e.errno or 5)


def _preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
    try:
        return os.preadv(fd, buffers, offset)
    except OSError as e:
        return -(e.errno or 5)


class ThreadPoolQueue:
    """A thread's view of the shared pool: its own futures, its own completions."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self._pool = pool
        self._pending: dict[Future[int], int] = {}

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def write(self, fd: int, offset: int, buffer: memoryview, token: int) -> None:
        self._pending[self._pool.submit(_pwrite, fd, buffer, offset)] = token

    def writev(self, fd: int, offset: int, buffers: list[memoryview], token: int) -> None:
        self._pending[self._pool.submit(_pwritev, fd, buffers, offset)] = token

    def read(self, fd: int, offset: int, buffer: memoryview, token: int) -> None:
        self._pending[self._pool.submit(_pread, fd, buffer, offset)] = token

    def readv(self, fd: int, offset: int, buffers: list[memoryview], token: int) -> None:
        self._pending[self._pool.submit(_preadv, fd, buffers, offset)] = token

    def submit(self) -> None:
        """Requests start as soon as they are queued; nothing to do."""

    def wait(self, min_complete: int = 1, *, poll_ns: int = 0) -> list[tuple[int, int]]:
        """``poll_ns`` is accepted for interface parity and ignored (futures wake us)."""
        completions: list[tuple[int, int]] = []
        wanted = min(min_complete, len(self._pending))
        while True:
            finished = [future for future in self._pending if future.done()]
            for future in finished:
                completions.append((self._pending.pop(future), future.result()))
            if len(completions) >= wanted:
                return completions
            wait(list(self._pending), return_when=FIRST_COMPLETED)


class ThreadPoolEngine:
    name = "threadpool"

    def __init__(self, depth: int = 64, why: str = "thread pool") -> None:
        self.depth = depth
        self.max_iovecs = system_iov_max()
        self.why = why
        self._pool = ThreadPoolExecutor(max_workers=min(depth, 32), thread_name_prefix="kvio")
        self._local = threading.local()

    def queue(self, lane: str = "main") -> ThreadPoolQueue:
        lanes: dict[str, ThreadPoolQueue] | None = getattr(self._local, "lanes", None)
        if lanes is None:
            lanes = self._local.lanes = {}
        queue = lanes.get(lane)
        if queue is None:
            queue = lanes[lane] = ThreadPoolQueue(self._pool)
        return queue

    def close(self) -> None:
        self._pool.shutdown(wait=True)

"""The IOEngine protocol and the engine chooser.

An engine hands each thread its own ``IOQueue``: the thread queues reads and
writes of aligned buffers at file offsets, submits them, and waits for
completions. Waiting never holds the GIL (see ``uring.py``), so an engine's
scheduler thread keeps running while the store does I/O.

A completion is ``(token, result)``: result is the byte count, or ``-errno``.
The caller keeps each buffer alive until its completion has been returned.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["IOEngine", "IOQueue", "make_engine"]


class IOQueue(Protocol):
    """Per-thread submission/completion queue. Not shared between threads."""

    @property
    def in_flight(self) -> int:
        """Requests queued or submitted whose completion was not yet returned."""
        ...

    def write(self, fd: int, offset: int, buffer: memoryview, token: int) -> None: ...

    def read(self, fd: int, offset: int, buffer: memoryview, token: int) -> None: ...

    def readv(self, fd: int, offset: int, buffers: list[memoryview], token: int) -> None:
        """One read scattered over ``buffers`` in order (header block, then payload)."""
        ...

    def submit(self) -> None:
        """Hand every queued request to the kernel (or the worker threads)."""
        ...

    def wait(self, min_complete: int = 1, *, poll_ns: int = 0) -> list[tuple[int, int]]:
        """Block until at least ``min_complete`` completions (or none in flight).

        ``poll_ns`` > 0 lets an engine poll for completions that long before it
        sleeps (io_uring does; the thread pool ignores it).
        """
        ...


class IOEngine(Protocol):
    name: str
    depth: int

    def queue(self, lane: str = "main") -> IOQueue:
        """This thread's queue for ``lane`` (created on first use).

        Lanes keep nested users on one thread apart: GC that runs inside a
        writer's ``put_many`` must not reap the writer's completions.
        """
        ...

    def close(self) -> None: ...


def make_engine(kind: str = "auto", depth: int = 64) -> IOEngine:
    """``"io_uring"``, ``"threadpool"``, or ``"auto"``: io_uring unless it is refused."""
    from kvstore.io.threadpool import ThreadPoolEngine
    from kvstore.io.uring import UringEngine, uring_available

    if kind == "threadpool":
        return ThreadPoolEngine(depth)
    if kind == "io_uring":
        return UringEngine(depth)
    if kind != "auto":
        raise ValueError(f"io_engine must be 'auto', 'io_uring' or 'threadpool', got {kind!r}")
    if uring_available():
        return UringEngine(depth)
    return ThreadPoolEngine(depth)


def run_all(queue: IOQueue, requests: list[tuple[str, int, int, memoryview]]) -> list[int]:
    """Run ``(op, fd, offset, buffer)`` requests with up to the queue depth in flight.

    Returns each request's result in order (bytes, or -errno).
    """
    results = [0] * len(requests)
    for token, (op, fd, offset, buffer) in enumerate(requests):
        if op == "w":
            queue.write(fd, offset, buffer, token)
        else:
            queue.read(fd, offset, buffer, token)
    queue.submit()
    while queue.in_flight:
        for token, result in queue.wait(queue.in_flight):
            results[token] = result
    return results

"""io_uring through the PyPI ``liburing`` binding, without ever blocking in it.

The binding holds the GIL inside ``io_uring_wait_cqe`` / ``submit_and_wait``,
which would freeze every other Python thread for the length of the I/O. So we
never call them: an eventfd is registered with the ring, the waiter blocks in
``os.read(eventfd)`` (which releases the GIL), then drains the completion queue
without blocking (``CqeIter`` + ``io_uring_cq_advance``).

Aligned memory only reaches the kernel through ``Iovec([memoryview(buf)])``
with ``io_uring_prep_readv/_writev`` (``prep_write`` copies into an unaligned
buffer). The ``Iovec`` and the buffer stay referenced in ``_keep`` until their
completion has been reaped.

The binding's ``Iovec`` takes a buffer export of each item and never releases
it: an item handed to it stays alive (and its mmap mapped) for the life of the
process, about 190 bytes and one mapping per I/O. So ``_iovec`` hands it a
ctypes array over the same memory instead, one per (address, length), and
caches the ``Iovec``: buffers can be unmapped, and only those small arrays stay
pinned (pool buffers reuse their addresses).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import Any

import liburing

from kvstore.errors import IOFailure

__all__ = ["UringEngine", "UringQueue", "uring_available"]

_IOVEC_CACHE_MAX = 4096
_iovecs: dict[tuple[tuple[int, int], ...], Any] = {}  # ((address, length), ...) -> Iovec
_iovecs_lock = threading.Lock()


def _iovec(buffers: list[memoryview]) -> Any:
    """An ``Iovec`` over ``buffers`` (in order) that does not pin them (see the
    module docstring). Read-only buffers (writes from ``bytes``) are handed over
    as they are."""
    if any(buffer.readonly for buffer in buffers):
        return liburing.Iovec(buffers)
    windows = [
        (ctypes.addressof(ctypes.c_char.from_buffer(buffer)), buffer.nbytes) for buffer in buffers
    ]
    key = tuple(windows)
    iovec = _iovecs.get(key)
    if iovec is None:
        iovec = liburing.Iovec(
            [
                memoryview((ctypes.c_char * length).from_address(address)).cast("B")
                for address, length in windows
            ]
        )
        with _iovecs_lock:
            if len(_iovecs) >= _IOVEC_CACHE_MAX:
                _iovecs.clear()
            _iovecs[key] = iovec
    return iovec


def uring_available() -> bool:
    """True if this process may create an io_uring and run a NOP through it."""
    try:
        queue = UringQueue(2)
    except (OSError, IOFailure):
        return False
    try:
        queue.nop(0)
        return queue.wait(1) == [(0, 0)]
    except (OSError, IOFailure):
        return False
    finally:
        queue.close()


class UringQueue:
    """One ring and its eventfd, used by one thread."""

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self.ring = liburing.Ring()
        try:
            liburing.io_uring_queue_init(entries, self.ring)
        except OSError as e:
            raise IOFailure("io_uring_queue_init refused", e.errno) from e
        self._eventfd = os.eventfd(0, os.EFD_CLOEXEC)
        try:
            liburing.io_uring_register_eventfd(self.ring, self._eventfd)
        except OSError as e:
            os.close(self._eventfd)
            liburing.io_uring_queue_exit(self.ring)
            raise IOFailure("io_uring_register_eventfd refused", e.errno) from e
        self._cqe = liburing.Cqe()
        self._keep: dict[int, Any] = {}
        self._in_flight = 0
        self._unsubmitted = 0
        self._ready: list[tuple[int, int]] = []
        self._closed = False

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def _sqe(self) -> Any:
        sqe = liburing.io_uring_get_sqe(self.ring)
        if sqe is None:
            self.submit()
            sqe = liburing.io_uring_get_sqe(self.ring)
            if sqe is None:
                raise IOFailure("io_uring submission queue is full")
        return sqe

    def _make_room(self) -> None:
        # Never have more requests outstanding than the completion queue can
        # hold without overflow: park early completions in ``_ready``.
        while self._in_flight - len(self._ready) >= self.entries:
            self.submit()
            self._ready.extend(self._drain(block=True))

    def write(self, fd: int, offset: int, buffer: memoryview, token: int) -> None:
        self._queue(liburing.io_uring_prep_writev, fd, offset, [buffer], token)

    def read(self, fd: int, offset: int, buffer: memoryview, token: int) -> None:
        self._queue(liburing.io_uring_prep_readv, fd, offset, [buffer], token)

    def readv(self, fd: int, offset: int, buffers: list[memoryview], token: int) -> None:
        """One read scattered over ``buffers`` (each writable), in order."""
        self._queue(liburing.io_uring_prep_readv, fd, offset, buffers, token)

    def _queue(
        self, prep: Any, fd: int, offset: int, buffers: list[memoryview], token: int
    ) -> None:
        self._make_room()
        iovec = _iovec(buffers)
        sqe = self._sqe()
        prep(sqe, fd, iovec, offset)
        liburing.io_uring_sqe_set_data64(sqe, token)
        self._keep[token] = (iovec, buffers)
        self._in_flight += 1
        self._unsubmitted += 1

    def nop(self, token: int) -> None:
        """A no-op request (used to probe that the ring works end to end)."""
        self._make_room()
        sqe = self._sqe()
        liburing.io_uring_prep_nop(sqe)
        liburing.io_uring_sqe_set_data64(sqe, token)
        self._in_flight += 1
        self._unsubmitted += 1

    def submit(self) -> None:
        if self._unsubmitted:
            try:
                liburing.io_uring_submit(self.ring)
            except OSError as e:
                raise IOFailure("io_uring_submit failed", e.errno) from e
            self._unsubmitted = 0

    def _drain(self, *, block: bool) -> list[tuple[int, int]]:
        completions: list[tuple[int, int]] = []
        while True:
            seen = 0
            cqe = self._cqe
            for _ in liburing.CqeIter(self.ring, cqe):
                entry = cqe[0]
                token = entry.user_data
                try:
                    result = entry.res
                except OSError as e:  # the binding raises for a negative res
                    result = -(e.errno or 5)
                completions.append((token, result))
                seen += 1
            if seen:
                liburing.io_uring_cq_advance(self.ring, seen)
            if completions or not block:
                return completions
            os.read(self._eventfd, 8)  # releases the GIL while the I/O runs

    def wait(self, min_complete: int = 1, *, poll_ns: int = 0) -> list[tuple[int, int]]:
        """At least ``min_complete`` completions (fewer only if fewer are in flight).

        ``poll_ns`` > 0: first poll the completion queue for up to that long,
        yielding the CPU and the GIL between polls, before sleeping on the eventfd.
        Polling skips the wake-up from idle that a sleeping wait pays (tens of
        microseconds on a virtual machine) at the price of a busy core.
        """
        self.submit()
        completions, self._ready = self._ready, []
        wanted = min(min_complete, self._in_flight)
        if poll_ns > 0 and len(completions) < wanted:
            deadline = time.perf_counter_ns() + poll_ns
            while True:
                completions.extend(self._drain(block=False))
                if len(completions) >= wanted or time.perf_counter_ns() >= deadline:
                    break
                os.sched_yield()  # releases the GIL: other threads run meanwhile
        while len(completions) < wanted:
            completions.extend(self._drain(block=True))
        if len(completions) < self._in_flight:
            completions.extend(self._drain(block=False))
        for token, _ in completions:
            self._keep.pop(token, None)
        self._in_flight -= len(completions)
        return completions

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        while self._in_flight:
            self.wait(self._in_flight)
        liburing.io_uring_queue_exit(self.ring)
        os.close(self._eventfd)


class UringEngine:
    """io_uring engine: one ``UringQueue`` per calling thread."""

    name = "io_uring"

    def __init__(self, depth: int = 64) -> None:
        self.depth = depth
        self._local = threading.local()
        self._queues: list[UringQueue] = []
        self._lock = threading.Lock()

    def queue(self, lane: str = "main") -> UringQueue:
        lanes: dict[str, UringQueue] | None = getattr(self._local, "lanes", None)
        if lanes is None:
            lanes = self._local.lanes = {}
        queue = lanes.get(lane)
        if queue is None:
            queue = lanes[lane] = UringQueue(self.depth)
            with self._lock:
                self._queues.append(queue)
        return queue

    def close(self) -> None:
        with self._lock:
            queues, self._queues = self._queues, []
        for queue in queues:
            queue.close()
        self._local = threading.local()

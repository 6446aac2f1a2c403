"""io_uring through a PyPI ``liburing`` binding, without ever blocking in it.

The bindings may hold the GIL inside ``io_uring_wait_cqe`` / ``submit_and_wait``,
which would freeze every other Python thread for the length of the I/O. So we
never call them: an eventfd is registered with the ring, the waiter blocks in
``os.read(eventfd)`` (which releases the GIL), then drains the completion queue
without blocking.

Aligned memory reaches the kernel through the binding's iovec with
``io_uring_prep_readv/_writev``. The iovec and the buffer stay referenced in
``_keep`` until their completion has been reaped. What differs between the two
bindings (``liburing`` 2024.x and 2026.x) lives in ``kvstore.io.bindings``;
whether a binding may run here at all is decided by ``kvstore.io.probe``, in a
child process, before a ring is made in this one.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from kvstore.errors import IOFailure
from kvstore.io.bindings import Binding, load_binding

__all__ = ["UringEngine", "UringQueue"]


class UringQueue:
    """One ring and its eventfd, used by one thread."""

    def __init__(self, entries: int, binding: Binding) -> None:
        self.entries = entries
        self._binding = binding
        self.ring = binding.new_ring(entries)
        self._eventfd = os.eventfd(0, os.EFD_CLOEXEC)
        try:
            binding.register_eventfd(self.ring, self._eventfd)
        except BaseException:
            os.close(self._eventfd)
            binding.exit_ring(self.ring)
            raise
        self._cqe = binding.new_cqe()
        self._keep: dict[int, Any] = {}
        self._in_flight = 0
        self._unsubmitted = 0
        self._ready: list[tuple[int, int]] = []
        self._closed = False

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def _sqe(self) -> Any:
        sqe = self._binding.get_sqe(self.ring)
        if sqe is None:
            self.submit()
            sqe = self._binding.get_sqe(self.ring)
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
        self._queue(self._binding.prep_writev, fd, offset, [buffer], token)

    def writev(self, fd: int, offset: int, buffers: list[memoryview], token: int) -> None:
        """One write gathered from ``buffers``, in order."""
        self._queue(self._binding.prep_writev, fd, offset, buffers, token)

    def read(self, fd: int, offset: int, buffer: memoryview, token: int) -> None:
        self._queue(self._binding.prep_readv, fd, offset, [buffer], token)

    def readv(self, fd: int, offset: int, buffers: list[memoryview], token: int) -> None:
        """One read scattered over ``buffers`` (each writable), in order."""
        self._queue(self._binding.prep_readv, fd, offset, buffers, token)

    def _queue(
        self, prep: Any, fd: int, offset: int, buffers: list[memoryview], token: int
    ) -> None:
        self._make_room()
        iovec = self._binding.iovec(buffers)
        sqe = self._sqe()
        prep(sqe, fd, iovec, len(buffers), offset)
        self._binding.set_token(sqe, token)
        self._keep[token] = (iovec, buffers)
        self._in_flight += 1
        self._unsubmitted += 1

    def nop(self, token: int) -> None:
        """A no-op request (used to probe that the ring works end to end)."""
        self._make_room()
        sqe = self._sqe()
        self._binding.prep_nop(sqe)
        self._binding.set_token(sqe, token)
        self._in_flight += 1
        self._unsubmitted += 1

    def submit(self) -> None:
        if self._unsubmitted:
            self._binding.submit(self.ring)
            self._unsubmitted = 0

    def _drain(self, *, block: bool) -> list[tuple[int, int]]:
        completions: list[tuple[int, int]] = []
        reap, ring, cqe = self._binding.reap, self.ring, self._cqe
        while True:
            reap(ring, cqe, completions)
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
        self._binding.exit_ring(self.ring)
        os.close(self._eventfd)


class UringEngine:
    """io_uring engine: one ``UringQueue`` per calling thread."""

    name = "io_uring"

    def __init__(self, depth: int = 64, binding: Binding | None = None, why: str = "") -> None:
        self.depth = depth
        self.binding = binding if binding is not None else load_binding()
        self.max_iovecs = self.binding.max_iovecs
        self.why = why or f"io_uring via {self.binding.name}"
        self._local = threading.local()
        self._queues: list[UringQueue] = []
        self._lock = threading.Lock()

    def queue(self, lane: str = "main") -> UringQueue:
        lanes: dict[str, UringQueue] | None = getattr(self._local, "lanes", None)
        if lanes is None:
            lanes = self._local.lanes = {}
        queue = lanes.get(lane)
        if queue is None:
            queue = lanes[lane] = UringQueue(self.depth, self.binding)
            with self._lock:
                self._queues.append(queue)
        return queue

    def close(self) -> None:
        with self._lock:
            queues, self._queues = self._queues, []
        for queue in queues:
            queue.close()
        self._local = threading.local()

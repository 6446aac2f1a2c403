"""The IOEngine protocol and the engine chooser.

An engine hands each thread its own ``IOQueue``: the thread queues reads and
writes of aligned buffers at file offsets, submits them, and waits for
completions. Waiting never holds the GIL (see ``uring.py``), so an engine's
scheduler thread keeps running while the store does I/O.

A completion is ``(token, result)``: result is the byte count, or ``-errno``.
The caller keeps each buffer alive until its completion has been returned.
"""

from __future__ import annotations

import os
from typing import Protocol

__all__ = ["ENGINE_KINDS", "IOEngine", "IOQueue", "make_engine", "resolve_choice"]


class IOQueue(Protocol):
    """Per-thread submission/completion queue. Not shared between threads."""

    @property
    def in_flight(self) -> int:
        """Requests queued or submitted whose completion was not yet returned."""
        ...

    def write(self, fd: int, offset: int, buffer: memoryview, token: int) -> None: ...

    def writev(self, fd: int, offset: int, buffers: list[memoryview], token: int) -> None:
        """One write gathered from ``buffers`` in order (header blocks, the caller's
        payloads, padding blocks: docs/design.md, "Write path")."""
        ...

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
    max_iovecs: int  # the most buffers one readv / writev may gather on this engine
    why: str  # which engine runs and why, in words (stats, `kvstore stat`, the demo)

    def queue(self, lane: str = "main") -> IOQueue:
        """This thread's queue for ``lane`` (created on first use).

        Lanes keep nested users on one thread apart: GC that runs inside a
        writer's ``put_many`` must not reap the writer's completions.
        """
        ...

    def close(self) -> None: ...


ENGINE_KINDS = ("auto", "io_uring", "threadpool")
ENGINE_ENV = "KVSTORE_IO_ENGINE"
BINDING_ENV = "KVSTORE_URING_BINDING"


def check_engine_kind(kind: object) -> str:
    if kind not in ENGINE_KINDS:
        raise ValueError(f"io_engine must be 'auto', 'io_uring' or 'threadpool', got {kind!r}")
    return str(kind)


def resolve_choice(kind: str = "auto", binding: str = "auto") -> tuple[str, str, str]:
    """``(kind, binding, source)`` after the environment overrides.

    ``KVSTORE_IO_ENGINE`` replaces ``"auto"`` (an operator or CI forcing one
    engine for every store a process opens); ``KVSTORE_URING_BINDING``
    replaces a binding of ``"auto"``. An explicit config value wins.
    """
    from kvstore.io.bindings import BINDING_NAMES

    check_engine_kind(kind)
    source = "config"
    if kind == "auto":
        forced = os.environ.get(ENGINE_ENV, "").strip()
        if forced:
            if forced not in ENGINE_KINDS:
                raise ValueError(
                    f"{ENGINE_ENV} must be 'auto', 'io_uring' or 'threadpool', got {forced!r}"
                )
            kind, source = forced, ENGINE_ENV
    if binding == "auto":
        binding = os.environ.get(BINDING_ENV, "").strip() or "auto"
    if binding != "auto" and binding not in BINDING_NAMES:
        raise ValueError(f"uring_binding must be 'auto' or one of {BINDING_NAMES}, got {binding!r}")
    return kind, binding, source


def make_engine(kind: str = "auto", depth: int = 64, binding: str = "auto") -> IOEngine:
    """``"io_uring"``, ``"threadpool"``, or ``"auto"``: io_uring unless it is refused.

    io_uring is used only after ``kvstore.io.probe`` has run the binding in a
    child process: a binding that dies (SIGILL on a CPU it was not built for),
    hangs or raises can never take this process down. ``"auto"`` then falls
    back to the thread pool with the reason in ``engine.why``; an explicit
    ``"io_uring"`` raises ``IOFailure`` with it.
    """
    from kvstore.errors import IOFailure
    from kvstore.io.bindings import load_binding
    from kvstore.io.probe import probe_uring
    from kvstore.io.threadpool import ThreadPoolEngine
    from kvstore.io.uring import UringEngine

    kind, binding, source = resolve_choice(kind, binding)
    if kind == "threadpool":
        how = "set by KVSTORE_IO_ENGINE" if source == ENGINE_ENV else "asked for"
        return ThreadPoolEngine(depth, why=f"thread pool ({how})")
    verdict = probe_uring(binding)
    reason = verdict.reason
    if verdict.ok:
        try:  # the child could import it; this process may still fail to (a file race)
            loaded = load_binding(binding)
        except IOFailure as e:
            reason = str(e)
        else:
            return UringEngine(depth, loaded, why=f"io_uring via {loaded.name} {loaded.version}")
    if kind == "io_uring":
        raise IOFailure(f"io_engine='io_uring' cannot run here: {reason}")
    return ThreadPoolEngine(depth, why=f"thread pool: io_uring unusable ({reason})")


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

"""The mover: asynchronous byte moves between tiers, reported as tickets.

The tier manager decides *what* moves; the mover moves it, off the caller's
thread, and reports each job as a ``Ticket`` that the manager's control thread
harvests with ``poll()`` (rule R6: completions are processed before any
eviction decision). Three implementations share one interface
(``mover_api.Mover``); the first two are here, on the threads, queues and
ticket completion they share (mover_threads.py):

``CPUMover``   two daemon threads, each with its own priority queue: a copy
               thread (``kvstore-tier-copy``) for tensor copies and an I/O thread
               (``kvstore-tier-io``) for NVMe reads and writes through the
               store. Within a queue, lower ``Priority`` first, then FIFO. The
               I/O thread hands each NVMe job to the store's pipeline
               (``put_many_async`` / ``get_many_into_async``, straight from and
               into the DRAM slots) and keeps up to ``nvme_depth`` of them in
               flight (default: the store's ``pipeline_depth``); the next job
               waits in the queue, in priority order, for one to land.
``CUDAMover``  copies on CUDA streams: D2H (and D2D) on one, H2D on another, and
               DEMAND H2D on an expedited high-priority stream, so a load the
               engine waits for does not queue behind prefetches. Every copy
               records a pooled event; ``done()`` is ``event.query()``. NVMe jobs
               (and host-to-host copies) run on the same threads as ``CPUMover``.
``FakeMover``  (fake_mover.py) moves nothing. Each path is a serial server with a latency and
               a bandwidth on a ``VirtualClock``; the simulator replays traces
               with it. Single-threaded by contract.

Ordering rules kept here (docs/tiering.md, "The mover and the ordering rules"):
- R1/R3: ``copy(..., wait_event=e)`` makes the copy wait for ``e`` first (CUDA:
  ``stream.wait_event``; CPU: ``e.synchronize()`` on the copy thread when ``e``
  has one), so a D2H never reads a block the producer is still writing and an
  H2D never overwrites engine blocks still being read.
- R2: ``ticket.event`` (CUDA) is recorded after the last copy of the job; a
  source block may be released once it has completed (``ticket.done()``).
- A job that fails leaves its error in ``ticket.error``; a failed NVMe read
  reports every page as missing (``results`` all None), never as read. A job
  never raises into the thread that runs it, and never kills it. A pipelined
  NVMe batch that fails is handled as a synchronous one would be: one page, its
  error in the ticket; several, each page again alone, on the I/O thread.

Tickets complete exactly once and ``poll()`` returns each exactly once. After a
``CUDAMover`` ticket has been returned by ``poll()`` its events go back to the
pool and ``ticket.event`` is None: an event still held elsewhere may then be
recorded again for a later copy, so waiting on it can only wait longer, never
less. ``done()`` stays True.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvstore.errors import ClosedError
from kvstore.tiering._torch import require_torch

if TYPE_CHECKING:
    import torch
from kvstore.tiering.mover_api import (
    COPY_PATHS,
    DONE,
    RUNNING,
    Mover,
    Path,
    Priority,
    Ticket,
    check_copy_path,
    copy_nbytes,
    real_pairs,
)
from kvstore.tiering.mover_threads import ThreadedMover

__all__ = [
    "COPY_PATHS",
    "CPUMover",
    "CUDAMover",
    "Mover",
    "Path",
    "Priority",
    "Ticket",
    "make_mover",
]


class CPUMover(ThreadedMover):
    """Copies on a copy thread, NVMe reads and writes on an I/O thread (see the module doc).

    Copies go straight into the destination view (``dst.copy_(src)``, which
    releases the GIL for large copies): no staging, no extra copy.
    """

    def copy(
        self,
        path: Path,
        pairs: Sequence[tuple[torch.Tensor, torch.Tensor]] | None,
        *,
        priority: Priority,
        tag: object = None,
        wait_event: object | None = None,
        nbytes: int | None = None,
    ) -> Ticket:
        check_copy_path(path)
        return self._submit_host_copy(path, real_pairs(pairs, nbytes), priority, tag, wait_event)


# -- CUDA -----------------------------------------------------------------------


def _new_timing_event() -> Any:
    import torch

    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


class CUDAMover(ThreadedMover):
    """Copies on CUDA streams with pooled events; NVMe jobs on the I/O thread.

    Streams: D2H and D2D share one, H2D has one, and H2D at DEMAND priority uses
    an expedited stream created at the highest stream priority. Work already
    queued on a stream is not reordered: priority picks the stream, nothing
    more. H2H copies run on the copy thread, as on ``CPUMover``.

    Copies are ``non_blocking`` (true DMA from the pinned arena); every CUDA
    tensor of a pair is ``record_stream``-ed onto the copy stream so the caching
    allocator never hands its memory out while the copy may still read or write it.
    ``seconds()`` is the device time between the job's start and end events.
    """

    def __init__(
        self, device: str | torch.device = "cuda", *, nvme_depth: int | None = None
    ) -> None:
        require_torch()
        import torch

        self._cuda = torch.cuda
        if not torch.cuda.is_available():
            raise ValueError("CUDA is not available; use CPUMover (or make_mover('auto', device))")
        resolved = torch.device(device)
        if resolved.type != "cuda":
            raise ValueError(f"CUDAMover needs a cuda device, got {resolved}")
        if resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
        self.device = resolved
        with torch.cuda.device(resolved):
            self._d2h_stream: Any = torch.cuda.Stream(device=resolved)  # type: ignore[no-untyped-call]
            self._h2d_stream: Any = torch.cuda.Stream(device=resolved)  # type: ignore[no-untyped-call]
            # Lower numbers are higher priorities; out-of-range values clamp to the highest.
            self._expedited_stream: Any = torch.cuda.Stream(  # type: ignore[no-untyped-call]
                device=resolved, priority=-1
            )
        # One FIFO of tickets per stream: events on a stream complete in order, so
        # poll stops at the first one not done.
        self._lanes: dict[int, deque[Ticket]] = {
            id(self._d2h_stream): deque(),
            id(self._h2d_stream): deque(),
            id(self._expedited_stream): deque(),
        }
        self._event_pool: list[Any] = []
        super().__init__(nvme_depth=nvme_depth)

    def _stream_for(self, path: Path, priority: Priority) -> Any:
        if path is Path.H2D:
            return self._expedited_stream if priority == Priority.DEMAND else self._h2d_stream
        return self._d2h_stream  # D2H and D2D

    def _take_event(self) -> Any:
        return self._event_pool.pop() if self._event_pool else _new_timing_event()

    def copy(
        self,
        path: Path,
        pairs: Sequence[tuple[torch.Tensor, torch.Tensor]] | None,
        *,
        priority: Priority,
        tag: object = None,
        wait_event: object | None = None,
        nbytes: int | None = None,
    ) -> Ticket:
        check_copy_path(path)
        pairs = real_pairs(pairs, nbytes)
        if path is Path.H2H:
            return self._submit_host_copy(path, pairs, priority, tag, wait_event)
        nbytes = copy_nbytes(pairs)
        stream = self._stream_for(path, priority)
        ticket = Ticket(self, path, nbytes, priority, tag, time.monotonic())
        ticket.started_s = ticket.submitted_s
        ticket._state = RUNNING
        # Enqueueing under the lock keeps each lane in the order of its stream's events.
        with self._lock:
            if self._closed:
                raise ClosedError("the mover is closed")
            # If enqueueing raises, the two events are dropped, not pooled: they may
            # be half recorded. The pairs were checked above, so that is a CUDA error.
            start = self._take_event()
            end = self._take_event()
            with self._cuda.stream(stream):
                if wait_event is not None:
                    stream.wait_event(wait_event)  # R1 / R3
                start.record(stream)
                for src, dst in pairs:
                    dst[: src.numel()].copy_(src, non_blocking=True)
                    if src.is_cuda:
                        src.record_stream(stream)
                    if dst.is_cuda:
                        dst.record_stream(stream)
                end.record(stream)
            ticket._start_event = start
            ticket.event = end
            self._in_flight[path] += nbytes
            self._lanes[id(stream)].append(ticket)
        return ticket

    def _finish_cuda_locked(self, ticket: Ticket) -> None:
        """Mark a CUDA ticket whose end event has completed as done (lock held)."""
        ticket.finished_s = time.monotonic()
        try:
            ticket._elapsed_s = ticket._start_event.elapsed_time(ticket.event) / 1000.0
        except RuntimeError:
            ticket._elapsed_s = None  # no timing available: seconds() falls back to host time
        ticket.moved_bytes = ticket.nbytes
        self._complete_locked(ticket)

    def _settle_lanes_locked(self) -> None:
        for lane in self._lanes.values():
            while lane:
                ticket = lane[0]
                if ticket._state != DONE:
                    if not ticket.event.query():
                        break
                    self._finish_cuda_locked(ticket)
                lane.popleft()

    def poll(self) -> list[Ticket]:
        with self._lock:
            self._settle_lanes_locked()
            done = list(self._completed)
            self._completed.clear()
            for ticket in done:
                if ticket._start_event is not None:
                    self._event_pool.append(ticket._start_event)
                    self._event_pool.append(ticket.event)
                    ticket._start_event = None
                    ticket.event = None
        return done

    def wait_completed(self, timeout_s: float, since: int | None = None) -> bool:
        """As ``Mover.wait_completed``; CUDA events notify nobody, so the lanes are
        queried every 0.2 ms between waits for the host jobs' completions."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                self._settle_lanes_locked()
                if self._completed_since(since):
                    return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if super().wait_completed(min(remaining, 0.0002), since):
                return True

    def _ticket_done(self, ticket: Ticket) -> bool:
        if ticket._state == DONE:
            return True
        with self._lock:
            if ticket._state == DONE:
                return True
            if ticket._start_event is None:
                return False  # a job on a worker thread, not finished yet
            if not ticket.event.query():
                return False
            self._finish_cuda_locked(ticket)
            return True

    def _ticket_wait(self, ticket: Ticket, timeout: float | None) -> bool:
        with self._lock:
            event = ticket.event if ticket._state != DONE else None
            is_cuda = ticket._start_event is not None
        if not is_cuda:
            return super()._ticket_wait(ticket, timeout)
        if timeout is None:
            if event is not None:
                event.synchronize()
            return self._ticket_done(ticket)
        deadline = time.monotonic() + timeout
        while not self._ticket_done(ticket):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(remaining, 0.0002))
        return True

    def _after_close(self) -> None:
        for stream in (self._d2h_stream, self._h2d_stream, self._expedited_stream):
            stream.synchronize()
        with self._lock:
            self._settle_lanes_locked()


def make_mover(kind: str, device: str | torch.device, *, nvme_depth: int | None = None) -> Mover:
    """The mover for ``kind``: "cpu", "cuda", or "auto" (CUDA when ``device`` is a CUDA
    device and CUDA is available, else CPU); ``nvme_depth``: NVMe batches in flight
    (None: the store's ``pipeline_depth``). The fake mover needs a clock: build
    ``FakeMover`` directly."""
    require_torch()  # one line naming what to install, before any tensor
    import torch

    if kind == "auto":
        is_cuda = str(device).startswith("cuda")
        kind = "cuda" if is_cuda and torch.cuda.is_available() else "cpu"
    if kind == "cpu":
        return CPUMover(nvme_depth=nvme_depth)
    if kind == "cuda":
        return CUDAMover(device, nvme_depth=nvme_depth)
    raise ValueError(f"mover kind must be 'auto', 'cpu' or 'cuda', got {kind!r}")

"""The mover: asynchronous byte moves between tiers, reported as tickets.

The tier manager decides *what* moves; the mover moves it, off the caller's
thread, and reports each job as a ``Ticket`` that the manager's control thread
harvests with ``poll()`` (rule R6: completions are processed before any
eviction decision). Three implementations share one interface:

``CPUMover``   two daemon threads, each with its own priority queue: a copy
               thread (``kvstore-tier-copy``) for tensor copies and an I/O thread
               (``kvstore-tier-io``) for NVMe reads and writes through the
               store. Within a queue, lower ``Priority`` first, then FIFO.
``CUDAMover``  copies on CUDA streams: D2H (and D2D) on one, H2D on another, and
               DEMAND H2D on an expedited high-priority stream, so a load the
               engine waits for does not queue behind prefetches. Every copy
               records a pooled event; ``done()`` is ``event.query()``. NVMe jobs
               (and host-to-host copies) run on the same threads as ``CPUMover``.
``FakeMover``  moves nothing. Each path is a serial server with a latency and
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
  never raises into the thread that runs it, and never kills it.

Tickets complete exactly once and ``poll()`` returns each exactly once. After a
``CUDAMover`` ticket has been returned by ``poll()`` its events go back to the
pool and ``ticket.event`` is None: an event still held elsewhere may then be
recorded again for a later copy, so waiting on it can only wait longer, never
less. ``done()`` stays True.
"""

from __future__ import annotations

import abc
import enum
import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Self

from kvstore.errors import ClosedError
from kvstore.tiering._torch import require_torch

if TYPE_CHECKING:
    from types import TracebackType

    import torch

    from kvstore.store import KVStore

__all__ = [
    "COPY_PATHS",
    "CPUMover",
    "CUDAMover",
    "FakeMover",
    "Mover",
    "Path",
    "Priority",
    "Ticket",
    "VirtualClock",
    "make_mover",
]


class Path(enum.Enum):
    """Where bytes move: between HBM (device) and DRAM (host), or to and from NVMe."""

    D2H = "d2h"
    H2D = "h2d"
    D2D = "d2d"
    H2H = "h2h"
    NVME_READ = "nvme_read"
    NVME_WRITE = "nvme_write"

    # Members are singletons, so identity is equality; the C-level identity hash makes
    # the per-path dict lookups on the hot path (millions in a simulation) cheap,
    # where Enum's own __hash__ is a Python call.
    __hash__ = object.__hash__


COPY_PATHS = frozenset({Path.D2H, Path.H2D, Path.D2D, Path.H2H})


class Priority(enum.IntEnum):
    """Job priority; lower runs first (docs/tiering.md, "The mover and the ordering rules")."""

    DEMAND = 0
    PREFETCH = 1
    WRITEBACK = 2
    BACKGROUND = 3


_QUEUED = 0
_RUNNING = 1
_DONE = 2


class Ticket:
    """One submitted job; created by a mover, owned by whoever submitted it.

    Times are on the mover's clock (``mover.now()``). ``results`` is per page for
    NVMe jobs (bytes read or stored, None for a miss or a failure) and None for
    copies. ``moved_bytes`` is what actually moved (a read's misses move
    nothing; a failed job moved nothing usable): the figure a bandwidth fit
    wants, where ``nbytes`` is what was asked for. ``event`` is the CUDA event
    recorded after a ``CUDAMover`` copy, None otherwise.

    For a ``FakeMover`` ticket ``started_s`` and ``finished_s`` are the
    scheduled times, known at submit; ``done()`` tells whether the virtual clock
    has reached ``finished_s``.
    """

    __slots__ = (
        "_elapsed_s",
        "_owner",
        "_start_event",
        "_state",
        "error",
        "event",
        "finished_s",
        "moved_bytes",
        "nbytes",
        "path",
        "priority",
        "results",
        "started_s",
        "submitted_s",
        "tag",
    )

    def __init__(
        self,
        owner: Mover,
        path: Path,
        nbytes: int,
        priority: Priority,
        tag: object,
        submitted_s: float,
        started_s: float | None = None,
        finished_s: float | None = None,
        results: list[int | None] | None = None,
    ) -> None:
        self._owner = owner
        self.path = path
        self.nbytes = nbytes
        self.priority = priority
        self.tag = tag
        self.submitted_s = submitted_s
        self.started_s = started_s
        self.finished_s = finished_s
        self.error: BaseException | None = None
        self.results = results
        self.event: Any = None
        self.moved_bytes = 0
        self._state = _QUEUED
        self._elapsed_s: float | None = None
        self._start_event: Any = None

    def done(self) -> bool:
        """Whether the job has finished (successfully or not)."""
        return self._owner._ticket_done(self)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done or ``timeout`` seconds passed; True when done.

        Never raises the job's error: that is in ``error``. A ``FakeMover``
        ticket does not block (its clock is virtual): this is ``done()``.
        """
        return self._owner._ticket_wait(self, timeout)

    def seconds(self) -> float | None:
        """How long the move took: the device's own timing where there is one, else
        ``finished_s - started_s``; None until known."""
        if self._elapsed_s is not None:
            return self._elapsed_s
        if self.started_s is None or self.finished_s is None:
            return None
        return self.finished_s - self.started_s

    def __repr__(self) -> str:
        state = ("queued", "running", "done")[self._state]
        return (
            f"Ticket({self.path.value}, {self.nbytes} B, {self.priority.name}, {state}"
            f"{', error' if self.error is not None else ''})"
        )


def _copy_nbytes(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """The bytes a list of ``(src, dst)`` copies moves; ValueError on a pair that cannot copy.

    Runs on the caller's thread for every pair of every copy (a load of 64 pages
    checks 64), so the common case reads three attributes per tensor; the
    checks that name the problem run only once a pair has failed.
    """
    total = 0
    for src, dst in pairs:
        nbytes = src.nbytes
        if src.dtype is not dst.dtype or src.dim() != 1 or dst.dim() != 1 or dst.nbytes < nbytes:
            _refuse_pair(src, dst)
        total += nbytes
    return total


def _refuse_pair(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Raise the ValueError that says why ``(src, dst)`` cannot copy."""
    if src.dim() != 1 or dst.dim() != 1:
        raise ValueError(
            "copy pairs must be 1-D byte views (e.g. kvstore.gpu._tensors.byte_view), "
            f"got shapes {tuple(src.shape)} and {tuple(dst.shape)}"
        )
    if src.dtype != dst.dtype:
        raise ValueError(f"copy pair dtypes differ: {src.dtype} -> {dst.dtype}")
    raise ValueError(f"copy destination holds {dst.numel()} elements; the source has {src.numel()}")


def _check_copy_path(path: Path) -> None:
    if path not in COPY_PATHS:
        raise ValueError(f"{path} is not a copy path; NVMe moves are nvme_read / nvme_write")


def _tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _real_store(store: KVStore | None) -> KVStore:
    if store is None:
        raise ValueError(
            "a real mover needs the store to read from or write to (None is FakeMover's)"
        )
    return store


def _real_pairs(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]] | None, nbytes: int | None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The pairs a real mover copies, as a snapshot list (the caller may reuse its own)."""
    if nbytes is not None:
        raise ValueError("a real mover copies the pairs' bytes; nbytes= is FakeMover's")
    return [] if pairs is None else list(pairs)


class Mover(abc.ABC):
    """The interface the tier manager programs against, and the in-flight bookkeeping.

    ``in_flight_bytes`` counts bytes of jobs submitted and not yet complete (for
    ``FakeMover``: whose finish the virtual clock has not reached).
    """

    def __init__(self) -> None:
        self._in_flight: dict[Path, int] = dict.fromkeys(Path, 0)
        self._closed = False
        self._completion_count = 0

    @abc.abstractmethod
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
        """Copy ``src`` into ``dst[: src.numel()]`` for every ``(src, dst)`` pair (byte views).

        ``nbytes`` is for ``FakeMover`` (which takes no tensors); a real mover
        moves the pairs' bytes and refuses it.
        """

    @abc.abstractmethod
    def nvme_read(
        self,
        store: KVStore | None,
        keys: Sequence[bytes],
        dsts: Sequence[torch.Tensor] | None,
        *,
        priority: Priority,
        tag: object = None,
        sizes: Sequence[int | None] | None = None,
    ) -> Ticket:
        """Read ``keys[i]`` into the CPU byte view ``dsts[i]`` (``store.get_many_into``).

        ``results[i]``: the bytes read, None for a miss. A failed read sets
        ``error`` and leaves every result None. ``store=None``, ``dsts=None`` and
        ``sizes`` are for ``FakeMover``; a real mover refuses them.
        """

    @abc.abstractmethod
    def nvme_write(
        self,
        store: KVStore | None,
        items: Sequence[tuple[bytes, torch.Tensor | None, Mapping[str, Any] | None]],
        *,
        priority: Priority,
        tag: object = None,
        sizes: Sequence[int | None] | None = None,
    ) -> Ticket:
        """Store ``(key, CPU byte view, meta)`` items (``store.put_many``).

        ``results[i]``: the bytes stored, None when not stored (declined or
        failed). After an I/O error some pages of the batch may be in the store
        all the same; their results are None (not known to be stored), and the
        store's index stays the authority. The tensors' bytes must not change
        until the ticket is done. ``store=None``, tensors of None and ``sizes``
        are for ``FakeMover``; a real mover refuses them.
        """

    @abc.abstractmethod
    def poll(self) -> list[Ticket]:
        """Tickets completed since the last poll, in completion order; never blocks."""

    @abc.abstractmethod
    def now(self) -> float:
        """The mover's clock, in seconds."""

    def completions(self) -> int:
        """How many tickets have completed so far: the ``since`` of ``wait_completed``."""
        return self._completion_count

    def idle(self) -> None:
        """A caller with nothing to do until a ticket lands waits a moment."""
        time.sleep(0.0002)

    @abc.abstractmethod
    def wait_completed(self, timeout_s: float, since: int | None = None) -> bool:
        """Block until a ticket completes, or ``timeout_s`` passed; True when one did.

        With ``since`` (a ``completions()`` count read earlier): until the count
        has moved past it, so a completion that another thread has already
        polled in between still wakes the caller. Without: until ``poll()`` has
        a ticket to return. A caller waiting for a load sleeps here rather than
        in ``time.sleep``: it wakes when the copy lands, not up to one sleep
        later, and does not wake at all while nothing lands. ``FakeMover`` never
        blocks (its clock is virtual).
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Finish or cancel queued work and stop the mover's threads; idempotent."""

    @abc.abstractmethod
    def _ticket_done(self, ticket: Ticket) -> bool: ...

    @abc.abstractmethod
    def _ticket_wait(self, ticket: Ticket, timeout: float | None) -> bool: ...

    def in_flight_bytes(self, path: Path | None = None) -> int:
        """Bytes submitted and not yet complete, on ``path`` or on all paths."""
        if path is None:
            return sum(self._in_flight.values())
        return self._in_flight[path]

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


# -- threaded movers ---------------------------------------------------------

_Job = Callable[[Ticket], None]


class _WorkQueue:
    """One daemon thread serving a priority queue of jobs (priority first, then FIFO)."""

    def __init__(self, name: str, run: Callable[[Ticket, _Job], None]) -> None:
        self._run_job = run
        self._cond = threading.Condition()
        self._heap: list[tuple[int, int, Ticket, _Job]] = []
        self._seq = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def put(self, ticket: Ticket, job: _Job) -> None:
        with self._cond:
            if self._closed:
                raise ClosedError("the mover is closed")
            heapq.heappush(self._heap, (int(ticket.priority), next(self._seq), ticket, job))
            self._cond.notify()

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._heap and not self._closed:
                    self._cond.wait()
                if not self._heap:
                    return  # closed and drained
                _, _, ticket, job = heapq.heappop(self._heap)
            self._run_job(ticket, job)

    def close(self, *, cancel: bool) -> list[Ticket]:
        """Stop taking jobs; with ``cancel`` drop the queued ones (returned); join the thread."""
        with self._cond:
            self._closed = True
            cancelled = [entry[2] for entry in self._heap] if cancel else []
            if cancel:
                self._heap.clear()
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()
        return cancelled


def _one_by_one(run: Callable[[int], object], count: int) -> list[Any]:
    """``run(i)`` for each i in ``range(count)``; None where it raised."""
    results: list[Any] = []
    for i in range(count):
        try:
            results.append(run(i))
        except Exception:
            results.append(None)
    return results


class _ThreadedMover(Mover):
    """Ticket bookkeeping shared by the real movers: the lock, completions, the two queues."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._done_cond = threading.Condition(self._lock)
        self._completed: deque[Ticket] = deque()
        self._close_lock = threading.Lock()
        self._copy_queue = _WorkQueue("kvstore-tier-copy", self._run_job)
        self._io_queue = _WorkQueue("kvstore-tier-io", self._run_job)

    def now(self) -> float:
        return time.monotonic()

    # -- submission -----------------------------------------------------------

    def _submit(
        self,
        queue: _WorkQueue,
        path: Path,
        nbytes: int,
        priority: Priority,
        tag: object,
        job: _Job,
        pages: int | None = None,
    ) -> Ticket:
        ticket = Ticket(self, path, nbytes, priority, tag, time.monotonic())
        if pages is not None:
            ticket.results = [None] * pages  # until the job says otherwise, every page is missing
        with self._lock:
            if self._closed:
                raise ClosedError("the mover is closed")
            self._in_flight[path] += nbytes
        try:
            queue.put(ticket, job)
        except ClosedError:
            with self._lock:
                self._in_flight[path] -= nbytes
            raise
        return ticket

    def _submit_host_copy(
        self,
        path: Path,
        pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
        priority: Priority,
        tag: object,
        wait_event: object | None,
    ) -> Ticket:
        nbytes = _copy_nbytes(pairs)

        def job(ticket: Ticket) -> None:
            if wait_event is not None:
                synchronize = getattr(wait_event, "synchronize", None)
                if synchronize is not None:
                    synchronize()
            for src, dst in pairs:
                (dst if dst.numel() == src.numel() else dst[: src.numel()]).copy_(src)
            ticket.moved_bytes = ticket.nbytes

        return self._submit(self._copy_queue, path, nbytes, priority, tag, job)

    def nvme_read(
        self,
        store: KVStore | None,
        keys: Sequence[bytes],
        dsts: Sequence[torch.Tensor] | None,
        *,
        priority: Priority,
        tag: object = None,
        sizes: Sequence[int | None] | None = None,
    ) -> Ticket:
        store = _real_store(store)
        if dsts is None or sizes is not None:
            raise ValueError("a real mover reads into dsts (CPU byte views); sizes= is FakeMover's")
        keys = list(keys)
        if len(keys) != len(dsts):
            raise ValueError(f"{len(keys)} keys but {len(dsts)} destinations")
        # numpy views share the tensors' memory: the store reads straight into the slots.
        arrays = [dst.numpy() for dst in dsts]
        nbytes = sum(_tensor_nbytes(dst) for dst in dsts)
        count = len(keys)

        def job(ticket: Ticket) -> None:
            try:
                results = store.get_many_into(keys, arrays)
            except Exception as e:
                if len(keys) == 1:  # the page is missing, never wrong
                    ticket.error = e
                    return
                # One bad page (a checksum, an I/O error) raised for the whole batch:
                # read each page alone, so only the bad one is reported missing.
                results = _one_by_one(
                    lambda i: store.get_many_into([keys[i]], [arrays[i]])[0], count
                )
            ticket.results = results
            ticket.moved_bytes = sum(size for size in results if size is not None)

        return self._submit(self._io_queue, Path.NVME_READ, nbytes, priority, tag, job, count)

    def nvme_write(
        self,
        store: KVStore | None,
        items: Sequence[tuple[bytes, torch.Tensor | None, Mapping[str, Any] | None]],
        *,
        priority: Priority,
        tag: object = None,
        sizes: Sequence[int | None] | None = None,
    ) -> Ticket:
        store = _real_store(store)
        if sizes is not None:
            raise ValueError("a real mover writes the items' tensors; sizes= is FakeMover's")
        prepared = []
        for key, tensor, meta in items:
            if tensor is None:
                raise ValueError(f"item {key!r} has no tensor; a real mover writes bytes")
            prepared.append((key, tensor.numpy(), meta))
        page_sizes = [int(array.nbytes) for _, array, _ in prepared]
        nbytes = sum(page_sizes)

        def job(ticket: Ticket) -> None:
            try:
                stored = store.put_many(prepared)
            except Exception as e:
                if len(prepared) == 1:
                    ticket.error = e
                    return
                # The store refused the batch for one page (its key, its size, an I/O
                # error): write each page alone, so the others are not lost with it.
                stored = [
                    bool(ok)
                    for ok in _one_by_one(lambda i: store.put_many([prepared[i]])[0], len(prepared))
                ]
            results: list[int | None] = [
                size if ok else None for size, ok in zip(page_sizes, stored, strict=True)
            ]
            ticket.results = results
            ticket.moved_bytes = sum(size for size in results if size is not None)

        return self._submit(
            self._io_queue, Path.NVME_WRITE, nbytes, priority, tag, job, len(prepared)
        )

    # -- completion -----------------------------------------------------------

    def _run_job(self, ticket: Ticket, job: _Job) -> None:
        """Run one job on a worker thread; whatever it raises ends up in the ticket."""
        ticket._state = _RUNNING
        ticket.started_s = time.monotonic()
        try:
            job(ticket)
        except Exception as e:
            ticket.error = e
            ticket.moved_bytes = 0
        ticket.finished_s = time.monotonic()
        with self._lock:
            self._complete_locked(ticket)

    def _complete_locked(self, ticket: Ticket) -> None:
        ticket._state = _DONE
        self._in_flight[ticket.path] -= ticket.nbytes
        self._completed.append(ticket)
        self._completion_count += 1
        self._done_cond.notify_all()

    def poll(self) -> list[Ticket]:
        with self._lock:
            done = list(self._completed)
            self._completed.clear()
        return done

    def wait_completed(self, timeout_s: float, since: int | None = None) -> bool:
        if self._completed_since(since):
            return True
        with self._done_cond:
            return self._done_cond.wait_for(lambda: self._completed_since(since), timeout_s)

    def _completed_since(self, since: int | None) -> bool:
        if since is None:
            return bool(self._completed)
        return self._completion_count != since

    def _ticket_done(self, ticket: Ticket) -> bool:
        return ticket._state == _DONE

    def _ticket_wait(self, ticket: Ticket, timeout: float | None) -> bool:
        if ticket._state == _DONE:
            return True
        with self._done_cond:
            return self._done_cond.wait_for(lambda: ticket._state == _DONE, timeout)

    # -- close ----------------------------------------------------------------

    def close(self, *, cancel: bool = False) -> None:
        """Stop the mover; idempotent.

        Queued jobs run to completion, or with ``cancel=True`` those not yet
        started complete at once with ``error = ClosedError`` (NVMe pages all
        missing). Their tickets are still returned by ``poll()``. Then the
        threads are joined. Submitting afterwards raises ``ClosedError``.
        """
        with self._close_lock:
            with self._lock:
                if self._closed:
                    return
                self._closed = True
            for queue in (self._copy_queue, self._io_queue):
                for ticket in queue.close(cancel=cancel):
                    ticket.error = ClosedError("the mover was closed before this job started")
                    now = time.monotonic()
                    ticket.started_s = ticket.finished_s = now
                    with self._lock:
                        self._complete_locked(ticket)
            self._after_close()

    def _after_close(self) -> None:
        """Subclass hook: settle work the worker threads do not own."""


class CPUMover(_ThreadedMover):
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
        _check_copy_path(path)
        return self._submit_host_copy(path, _real_pairs(pairs, nbytes), priority, tag, wait_event)


# -- CUDA -----------------------------------------------------------------------


def _new_timing_event() -> Any:
    import torch

    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


class CUDAMover(_ThreadedMover):
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

    def __init__(self, device: str | torch.device = "cuda") -> None:
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
        super().__init__()

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
        _check_copy_path(path)
        pairs = _real_pairs(pairs, nbytes)
        if path is Path.H2H:
            return self._submit_host_copy(path, pairs, priority, tag, wait_event)
        nbytes = _copy_nbytes(pairs)
        stream = self._stream_for(path, priority)
        ticket = Ticket(self, path, nbytes, priority, tag, time.monotonic())
        ticket.started_s = ticket.submitted_s
        ticket._state = _RUNNING
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
                if ticket._state != _DONE:
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
        if ticket._state == _DONE:
            return True
        with self._lock:
            if ticket._state == _DONE:
                return True
            if ticket._start_event is None:
                return False  # a job on a worker thread, not finished yet
            if not ticket.event.query():
                return False
            self._finish_cuda_locked(ticket)
            return True

    def _ticket_wait(self, ticket: Ticket, timeout: float | None) -> bool:
        with self._lock:
            event = ticket.event if ticket._state != _DONE else None
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


# -- the fake mover ---------------------------------------------------------------


class VirtualClock:
    """A settable, monotone clock for simulation: ``now()``, ``advance(dt)``, ``set(t)``."""

    __slots__ = ("_now",)

    def __init__(self, start_s: float = 0.0) -> None:
        self._now = float(start_s)

    def now(self) -> float:
        return self._now

    def advance(self, dt: float) -> None:
        """Move the clock forward by ``dt`` seconds (ValueError if ``dt`` < 0)."""
        if dt < 0:
            raise ValueError(f"a virtual clock does not go backwards (advance by {dt})")
        self._now += dt

    def set(self, t: float) -> None:
        """Move the clock to ``t`` (ValueError if ``t`` is before now)."""
        if t < self._now:
            raise ValueError(f"a virtual clock does not go backwards ({t} < {self._now})")
        self._now = float(t)


class _Server:
    """One path of the fake mover: a serial server with a latency and a bandwidth."""

    __slots__ = ("bandwidth", "busy_until_s", "latency_s")

    def __init__(self, bandwidth: float, latency_s: float) -> None:
        self.bandwidth = bandwidth
        self.latency_s = latency_s
        self.busy_until_s = float("-inf")


class FakeMover(Mover):
    """Moves no bytes; schedules every job on a per-path serial server in virtual time.

    A job on ``path`` starts at ``max(now, busy_until[path])`` and finishes
    ``latency_s[path] + nbytes / bandwidth_bytes_per_s[path]`` later; jobs on one
    path run one after another in submission order (priority does not reorder
    them), jobs on different paths overlap. A path with no bandwidth cannot be
    used (ValueError at submit); a missing latency is 0.

    Sizes come from the tensors when given, else from ``nbytes=`` (copy) and
    ``sizes=`` (NVMe; a None size is a page that is missing: 0 bytes moved,
    result None). ``results`` are the sizes.

    Single-threaded by contract: the simulator drives the clock and calls the
    mover from one thread, so there are no locks here.
    """

    def __init__(
        self,
        bandwidth_bytes_per_s: Mapping[Path, float],
        latency_s: Mapping[Path, float],
        clock: VirtualClock,
    ) -> None:
        super().__init__()
        unknown = set(latency_s) - set(bandwidth_bytes_per_s)
        if unknown:
            raise ValueError(
                f"latency given for paths without a bandwidth: {sorted(p.value for p in unknown)}"
            )
        self._clock = clock
        self._servers: dict[Path, _Server] = {}
        for path, bandwidth in bandwidth_bytes_per_s.items():
            self.set_path(path, bandwidth, latency_s.get(path, 0.0))
        self._heap: list[tuple[float, int, Ticket]] = []
        self._ready: deque[Ticket] = deque()
        self._seq = 0

    def set_path(self, path: Path, bandwidth_bytes_per_s: float, latency_s: float = 0.0) -> None:
        """Set (or change, from now on) a path's bandwidth and latency."""
        if not bandwidth_bytes_per_s > 0:
            raise ValueError(f"bandwidth of {path} must be > 0, got {bandwidth_bytes_per_s}")
        if not latency_s >= 0:
            raise ValueError(f"latency of {path} must be >= 0, got {latency_s}")
        server = self._servers.get(path)
        if server is None:
            self._servers[path] = _Server(float(bandwidth_bytes_per_s), float(latency_s))
        else:  # the job in service keeps its schedule
            server.bandwidth = float(bandwidth_bytes_per_s)
            server.latency_s = float(latency_s)

    @property
    def clock(self) -> VirtualClock:
        return self._clock

    def now(self) -> float:
        return self._clock._now

    def _schedule(
        self,
        path: Path,
        nbytes: int,
        priority: Priority,
        tag: object,
        results: list[int | None] | None,
    ) -> Ticket:
        if self._closed:
            raise ClosedError("the mover is closed")
        server = self._servers.get(path)
        if server is None:
            raise ValueError(f"FakeMover has no bandwidth for {path}")
        now = self._clock._now
        busy = server.busy_until_s
        start = now if now > busy else busy
        finish = start + server.latency_s + nbytes / server.bandwidth
        server.busy_until_s = finish
        ticket = Ticket(self, path, nbytes, priority, tag, now, start, finish, results)
        ticket.moved_bytes = nbytes
        self._in_flight[path] += nbytes
        heapq.heappush(self._heap, (finish, self._seq, ticket))
        self._seq += 1
        return ticket

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
        """Schedule a copy of ``nbytes`` (default: the pairs' sizes); ``wait_event`` is ignored."""
        _check_copy_path(path)
        if nbytes is None:
            nbytes = _copy_nbytes(pairs) if pairs else 0
        elif nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        return self._schedule(path, nbytes, priority, tag, None)

    def nvme_read(
        self,
        store: KVStore | None,
        keys: Sequence[bytes],
        dsts: Sequence[torch.Tensor] | None,
        *,
        priority: Priority,
        tag: object = None,
        sizes: Sequence[int | None] | None = None,
    ) -> Ticket:
        """Schedule a read of ``sizes`` (default: the destinations' sizes); nothing is read."""
        results = self._sizes(len(keys), dsts, sizes)
        return self._schedule(Path.NVME_READ, _present_total(results), priority, tag, results)

    def nvme_write(
        self,
        store: KVStore | None,
        items: Sequence[tuple[bytes, torch.Tensor | None, Mapping[str, Any] | None]],
        *,
        priority: Priority,
        tag: object = None,
        sizes: Sequence[int | None] | None = None,
    ) -> Ticket:
        """Schedule a write of ``sizes`` (default: the items' tensors' sizes); nothing is stored."""
        if sizes is None:
            tensors = [item[1] for item in items]
            if any(tensor is None for tensor in tensors):
                raise ValueError("FakeMover.nvme_write needs sizes= when items carry no tensors")
            results: list[int | None] = [
                _tensor_nbytes(tensor) for tensor in tensors if tensor is not None
            ]
        else:
            results = self._sizes(len(items), None, sizes)
        return self._schedule(Path.NVME_WRITE, _present_total(results), priority, tag, results)

    @staticmethod
    def _sizes(
        count: int,
        tensors: Sequence[torch.Tensor] | None,
        sizes: Sequence[int | None] | None,
    ) -> list[int | None]:
        if sizes is None:
            if tensors is None or len(tensors) != count:
                raise ValueError(f"FakeMover needs sizes= or one tensor per key ({count} keys)")
            return [_tensor_nbytes(tensor) for tensor in tensors]
        if len(sizes) != count:
            raise ValueError(f"{count} keys but {len(sizes)} sizes")
        return list(sizes)

    def _settle(self) -> None:
        """Move the jobs whose finish the clock has reached from the heap to the ready list."""
        heap = self._heap
        now = self._clock._now
        while heap and heap[0][0] <= now:
            ticket = heapq.heappop(heap)[2]
            ticket._state = _DONE
            self._in_flight[ticket.path] -= ticket.nbytes
            self._ready.append(ticket)
            self._completion_count += 1

    def completions(self) -> int:
        self._settle()
        return self._completion_count

    def wait_completed(self, timeout_s: float, since: int | None = None) -> bool:
        """Whether a ticket has completed (since ``since``); never blocks (virtual clock)."""
        self._settle()
        return bool(self._ready) if since is None else self._completion_count != since

    def poll(self) -> list[Ticket]:
        """Tickets whose finish is at or before now, not returned before, in finish order."""
        self._settle()
        done = list(self._ready)
        self._ready.clear()
        return done

    def in_flight_bytes(self, path: Path | None = None) -> int:
        self._settle()
        return super().in_flight_bytes(path)

    def idle(self) -> None:
        """Nothing to do until a ticket lands: the virtual clock jumps to it."""
        next_s = self.next_completion_s()
        if next_s is not None and next_s > self._clock.now():
            self._clock.set(next_s)

    def next_completion_s(self) -> float | None:
        """The finish time of the earliest ticket ``poll()`` has not returned, or None.

        It may be at or before now (a completion is waiting to be polled); a
        simulator with nothing else to do sets the clock to it and polls.
        """
        if self._ready:
            return self._ready[0].finished_s
        return self._heap[0][0] if self._heap else None

    def pending(self) -> Iterator[Ticket]:
        """Tickets not yet returned by ``poll()`` (for checks; no order promised)."""
        yield from self._ready
        for entry in self._heap:
            yield entry[2]

    def close(self) -> None:
        """Refuse further jobs; scheduled ones still complete as the clock reaches them."""
        self._closed = True

    def _ticket_done(self, ticket: Ticket) -> bool:
        finished = ticket.finished_s
        return finished is not None and self._clock._now >= finished

    def _ticket_wait(self, ticket: Ticket, timeout: float | None) -> bool:
        return self._ticket_done(ticket)


def _present_total(sizes: list[int | None]) -> int:
    """The bytes of the pages that are there (a None size is a missing page)."""
    try:
        return sum(sizes)  # type: ignore[arg-type]  # the common case: no page missing
    except TypeError:
        pass
    total = 0
    for size in sizes:
        if size is not None:
            total += size
    return total


def make_mover(kind: str, device: str | torch.device) -> Mover:
    """The mover for ``kind``: "cpu", "cuda", or "auto" (CUDA when ``device`` is a CUDA
    device and CUDA is available, else CPU). The fake mover needs a clock: build
    ``FakeMover`` directly."""
    require_torch()  # one line naming what to install, before any tensor
    import torch

    if kind == "auto":
        is_cuda = str(device).startswith("cuda")
        kind = "cuda" if is_cuda and torch.cuda.is_available() else "cpu"
    if kind == "cpu":
        return CPUMover()
    if kind == "cuda":
        return CUDAMover(device)
    raise ValueError(f"mover kind must be 'auto', 'cpu' or 'cuda', got {kind!r}")

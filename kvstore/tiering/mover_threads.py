"""The threaded movers' shared machinery: work queues, NVMe jobs, ticket completion.

``ThreadedMover`` is the base of ``CPUMover`` and ``CUDAMover`` (mover.py, which
says what each does and the ordering rules they keep; docs/tiering.md, "The mover
and the ordering rules"). It holds what both run on their two daemon threads:

- ``WorkQueue``: one thread serving a priority queue of jobs (lower ``Priority``
  first, then FIFO), with a cap on the jobs held in flight. The copy thread
  (``kvstore-tier-copy``) runs host copies; the I/O thread (``kvstore-tier-io``)
  runs NVMe reads and writes through the store.
- NVMe jobs on the store's pipeline: each batch is handed to ``put_many_async`` /
  ``get_many_into_async`` (straight from and into the DRAM slots), up to
  ``nvme_depth`` in flight (default: the store's ``pipeline_depth``); a batch that
  fails is retried page by page on the I/O thread, as a synchronous one would be.
- Completion: each ticket completes exactly once; pipelined NVMe tickets complete
  in the order the I/O thread started them, and an NVMe ticket's ``seconds()`` is
  its share of the disk's busy time; ``poll``, ``wait_completed`` and ``close``.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from kvstore.errors import ClosedError

if TYPE_CHECKING:
    import torch

    from kvstore.store import KVStore
from kvstore.tiering.mover_api import (
    DONE,
    RUNNING,
    Mover,
    Path,
    Priority,
    Ticket,
    copy_nbytes,
    real_store,
    tensor_nbytes,
)

__all__ = ["NVME_PATHS", "PENDING", "Job", "ThreadedMover", "WorkQueue"]

# A job returns None when it is done (the worker completes its ticket) or ``PENDING``
# when it handed its work on (a store's pipeline): whoever finishes it completes it.
Job = Callable[[Ticket], object]
PENDING = object()
NVME_PATHS = (Path.NVME_READ, Path.NVME_WRITE)


class WorkQueue:
    """One daemon thread serving a priority queue of jobs (priority first, then FIFO).

    ``limit`` caps the jobs held in flight (``hold`` / ``release``: work a job handed
    on and that has not landed yet): while that many are, the next job waits in the
    queue, so a DEMAND job queued meanwhile still goes first. The thread exits once
    closed with nothing queued and nothing held.
    """

    def __init__(self, name: str, run: Callable[[Ticket, Job], None]) -> None:
        self._run_job = run
        self._cond = threading.Condition()
        self._heap: list[tuple[int, int, Ticket, Job]] = []
        self._seq = itertools.count()
        self._closed = False
        self.limit = 1
        self._held = 0
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def put(self, ticket: Ticket, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise ClosedError("the mover is closed")
            heapq.heappush(self._heap, (int(ticket.priority), next(self._seq), ticket, job))
            self._cond.notify()

    def hold(self) -> None:
        """A job of this queue handed its work on: one more in flight (worker thread)."""
        with self._cond:
            self._held += 1

    def release(self, follow_up: tuple[Ticket, Job] | None = None) -> None:
        """Held work landed; ``follow_up`` is queued first (even after ``close``: the
        thread stays until it ran), at its ticket's priority."""
        with self._cond:
            if follow_up is not None:
                ticket, job = follow_up
                heapq.heappush(self._heap, (int(ticket.priority), next(self._seq), ticket, job))
            self._held -= 1
            self._cond.notify_all()

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not (self._heap and self._held < self.limit):
                    if self._closed and not self._heap and not self._held:
                        return  # closed and drained
                    self._cond.wait()
                _, _, ticket, job = heapq.heappop(self._heap)
            self._run_job(ticket, job)

    def close(self, *, cancel: bool) -> list[Ticket]:
        """Stop taking jobs; with ``cancel`` drop the queued ones (returned); join the
        thread (after the work held in flight has landed)."""
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


class ThreadedMover(Mover):
    """Ticket bookkeeping shared by the real movers: the lock, completions, the two queues."""

    def __init__(self, *, nvme_depth: int | None = None) -> None:
        if nvme_depth is not None and (
            isinstance(nvme_depth, bool) or not isinstance(nvme_depth, int) or nvme_depth < 1
        ):
            raise ValueError(f"nvme_depth must be an int >= 1 or None, got {nvme_depth!r}")
        super().__init__()
        # NVMe batches in flight at once on the store's pipeline; None: its pipeline_depth.
        self.nvme_depth = nvme_depth
        self._lock = threading.Lock()
        self._nvme_landed_s = 0.0  # when the last NVMe job finished (monotonic)
        # Pipelined NVMe tickets in the order the I/O thread started them; one that
        # lands before those ahead of it waits in _landed (see _finish).
        self._started_order: deque[Ticket] = deque()
        self._landed: set[Ticket] = set()
        self._done_cond = threading.Condition(self._lock)
        self._completed: deque[Ticket] = deque()
        self._close_lock = threading.Lock()
        self._copy_queue = WorkQueue("kvstore-tier-copy", self._run_job)
        self._io_queue = WorkQueue("kvstore-tier-io", self._run_job)

    def now(self) -> float:
        return time.monotonic()

    # -- submission -----------------------------------------------------------

    def _submit(
        self,
        queue: WorkQueue,
        path: Path,
        nbytes: int,
        priority: Priority,
        tag: object,
        job: Job,
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
        nbytes = copy_nbytes(pairs)

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
        store = real_store(store)
        if dsts is None or sizes is not None:
            raise ValueError("a real mover reads into dsts (CPU byte views); sizes= is FakeMover's")
        keys = list(keys)
        if len(keys) != len(dsts):
            raise ValueError(f"{len(keys)} keys but {len(dsts)} destinations")
        # numpy views share the tensors' memory: the store reads straight into the slots.
        arrays = [dst.numpy() for dst in dsts]
        nbytes = sum(tensor_nbytes(dst) for dst in dsts)
        count = len(keys)

        def landed(ticket: Ticket, results: list[int | None]) -> None:
            ticket.results = results
            ticket.moved_bytes = sum(size for size in results if size is not None)

        def failed(ticket: Ticket, error: Exception) -> None:
            if count == 1:  # the page is missing, never wrong
                ticket.error = error
                return
            # One bad page (a checksum, an I/O error) raised for the whole batch:
            # read each page alone, so only the bad one is reported missing.
            landed(
                ticket,
                _one_by_one(lambda i: store.get_many_into([keys[i]], [arrays[i]])[0], count),
            )

        def job(ticket: Ticket) -> object:
            if not pipelined:
                try:
                    results = store.get_many_into(keys, arrays)
                except Exception as e:
                    failed(ticket, e)
                    return None
                landed(ticket, results)
                return None
            return self._hand_on(
                ticket, lambda: store.get_many_into_async(keys, arrays), landed, failed
            )

        pipelined = self._pipelines(store, "get_many_into_async")
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
        store = real_store(store)
        if sizes is not None:
            raise ValueError("a real mover writes the items' tensors; sizes= is FakeMover's")
        prepared = []
        for key, tensor, meta in items:
            if tensor is None:
                raise ValueError(f"item {key!r} has no tensor; a real mover writes bytes")
            prepared.append((key, tensor.numpy(), meta))
        page_sizes = [int(array.nbytes) for _, array, _ in prepared]
        nbytes = sum(page_sizes)

        def landed(ticket: Ticket, stored: list[bool]) -> None:
            results: list[int | None] = [
                size if ok else None for size, ok in zip(page_sizes, stored, strict=True)
            ]
            ticket.results = results
            ticket.moved_bytes = sum(size for size in results if size is not None)

        def failed(ticket: Ticket, error: Exception) -> None:
            if len(prepared) == 1:
                ticket.error = error
                return
            # The store refused the batch for one page (its key, its size, an I/O
            # error): write each page alone, so the others are not lost with it.
            landed(
                ticket,
                [
                    bool(ok)
                    for ok in _one_by_one(lambda i: store.put_many([prepared[i]])[0], len(prepared))
                ],
            )

        def job(ticket: Ticket) -> object:
            if not pipelined:
                try:
                    stored = store.put_many(prepared)
                except Exception as e:
                    failed(ticket, e)
                    return None
                landed(ticket, stored)
                return None
            # Durable as put_many's pages are (sync=False: readable when the future is
            # done, durable at the store's next group commit), written from the slots.
            return self._hand_on(ticket, lambda: store.put_many_async(prepared), landed, failed)

        pipelined = self._pipelines(store, "put_many_async")
        return self._submit(
            self._io_queue, Path.NVME_WRITE, nbytes, priority, tag, job, len(prepared)
        )

    # -- the store's pipeline ----------------------------------------------------

    def _pipelines(self, store: KVStore, call: str) -> bool:
        """Whether NVMe jobs on ``store`` go through its pipeline (``call``, a
        ``KVStore``'s async call; a stand-in without it is called synchronously, one
        job at a time, on the I/O thread); sets how many may be in flight."""
        if not callable(getattr(store, call, None)):
            return False
        depth = self.nvme_depth
        if depth is None:
            depth = getattr(getattr(store, "config", None), "pipeline_depth", 1)
        self._io_queue.limit = max(1, int(depth))
        return True

    def _hand_on(
        self,
        ticket: Ticket,
        start: Callable[[], Future[Any]],
        landed: Callable[[Ticket, Any], None],
        failed: Callable[[Ticket, Exception], None],
    ) -> object:
        """Run on the I/O thread: start one batch on the store's pipeline and return
        ``PENDING`` (the ticket completes when the batch lands), or, when the store
        refuses it at once (a bad item, a closed store), ``failed`` here as a
        synchronous call's failure would be, and None."""
        queue = self._io_queue
        queue.hold()
        with self._lock:
            self._started_order.append(ticket)
        try:
            future = start()
        except Exception as e:
            with self._lock:
                self._started_order.remove(ticket)
                self._complete_landed_locked()
            queue.release()
            failed(ticket, e)
            return None
        future.add_done_callback(lambda done: self._batch_landed(ticket, done, landed, failed))
        return PENDING

    def _batch_landed(
        self,
        ticket: Ticket,
        future: Future[Any],
        landed: Callable[[Ticket, Any], None],
        failed: Callable[[Ticket, Exception], None],
    ) -> None:
        """A pipelined batch is done (on the thread that finished it): its ticket
        completes here, or a batch that raised goes back to the I/O thread for
        ``failed`` (several pages: each again alone, synchronously, as today)."""
        follow_up: tuple[Ticket, Job] | None = None
        try:
            try:
                result = future.result()
            except Exception as e:
                error = e
            else:
                landed(ticket, result)
                self._finish(ticket)
                return
            if ticket.results is not None and len(ticket.results) > 1:

                def retry(t: Ticket) -> None:
                    failed(t, error)

                follow_up = (ticket, retry)
                return
            failed(ticket, error)
            self._finish(ticket)
        except BaseException as e:  # never into the store's thread; the ticket completes
            ticket.error = e if isinstance(e, Exception) else RuntimeError(repr(e))
            ticket.moved_bytes = 0
            ticket.results = [None] * len(ticket.results or ())
            self._finish(ticket)
        finally:
            self._io_queue.release(follow_up)

    # -- completion -----------------------------------------------------------

    def _run_job(self, ticket: Ticket, job: Job) -> None:
        """Run one job on a worker thread; whatever it raises ends up in the ticket."""
        ticket._state = RUNNING
        if ticket.started_s is None:  # a pipelined batch's retry keeps the batch's start
            ticket.started_s = time.monotonic()
        try:
            if job(ticket) is PENDING:
                return  # completes when the store's pipeline has done it
        except Exception as e:
            ticket.error = e
            ticket.moved_bytes = 0
        self._finish(ticket)

    def _finish(self, ticket: Ticket) -> None:
        """The job of ``ticket`` is over: time it, complete it (exactly once).

        An NVMe ticket's ``seconds()`` is its share of the disk's busy time: from its
        start, or from the last NVMe landing if that came later (batches in flight
        together share the disk; each counting its whole wall time would make the
        bandwidth fit read the disk as that many times slower). A batch that ran
        alone, as every one did before batches overlapped, keeps its wall time.

        Pipelined NVMe tickets complete in the order they started, as they did when
        the I/O thread ran one at a time: one that lands early waits for those
        started before it (its ``finished_s`` is still when it landed).
        """
        finished = ticket.finished_s = time.monotonic()
        with self._lock:
            if ticket.path in NVME_PATHS and ticket.started_s is not None:
                began = max(ticket.started_s, self._nvme_landed_s)
                self._nvme_landed_s = max(self._nvme_landed_s, finished)
                ticket._elapsed_s = max(0.0, finished - began)
            if self._started_order and ticket in self._started_order:
                self._landed.add(ticket)
                self._complete_landed_locked()
                return
            self._complete_locked(ticket)

    def _complete_landed_locked(self) -> None:
        """Complete the landed tickets at the head of the start order (lock held); a
        ticket completed elsewhere (cancelled at close) leaves the order here too."""
        order, landed = self._started_order, self._landed
        while order:
            ticket = order[0]
            if ticket in landed:
                landed.discard(ticket)
                order.popleft()
                self._complete_locked(ticket)
            elif ticket._state == DONE:
                order.popleft()
            else:
                return

    def _complete_locked(self, ticket: Ticket) -> None:
        ticket._state = DONE
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
        return ticket._state == DONE

    def _ticket_wait(self, ticket: Ticket, timeout: float | None) -> bool:
        if ticket._state == DONE:
            return True
        with self._done_cond:
            return self._done_cond.wait_for(lambda: ticket._state == DONE, timeout)

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
                        self._complete_landed_locked()
            self._after_close()

    def _after_close(self) -> None:
        """Subclass hook: settle work the worker threads do not own."""

"""``FakeMover``: the simulator's mover, on a ``VirtualClock``.

It moves nothing. Each path is a serial server with a latency and a bandwidth in
virtual time; ``kvstore sim`` replays traces with it (docs/tiering.md, "The
simulator"). Single-threaded by contract.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvstore.errors import ClosedError

if TYPE_CHECKING:
    import torch

    from kvstore.store import KVStore
from kvstore.tiering.mover_api import (
    DONE,
    Mover,
    Path,
    Priority,
    Ticket,
    check_copy_path,
    copy_nbytes,
    tensor_nbytes,
)

__all__ = ["FakeMover", "VirtualClock"]


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
        check_copy_path(path)
        if nbytes is None:
            nbytes = copy_nbytes(pairs) if pairs else 0
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
                tensor_nbytes(tensor) for tensor in tensors if tensor is not None
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
            return [tensor_nbytes(tensor) for tensor in tensors]
        if len(sizes) != count:
            raise ValueError(f"{count} keys but {len(sizes)} sizes")
        return list(sizes)

    def _settle(self) -> None:
        """Move the jobs whose finish the clock has reached from the heap to the ready list."""
        heap = self._heap
        now = self._clock._now
        while heap and heap[0][0] <= now:
            ticket = heapq.heappop(heap)[2]
            ticket._state = DONE
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

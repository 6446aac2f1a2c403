"""The mover's interface: paths, priorities, tickets, and the abstract ``Mover``.

Every mover (``mover.CPUMover``, ``mover.CUDAMover``, ``fake_mover.FakeMover``)
takes jobs on a ``Path`` at a ``Priority`` and reports each as a ``Ticket`` (see
``kvstore/tiering/mover.py`` for the ordering rules they keep).
"""

from __future__ import annotations

import abc
import enum
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Self

if TYPE_CHECKING:
    from types import TracebackType

    import torch

    from kvstore.store import KVStore

__all__ = [
    "COPY_PATHS",
    "DONE",
    "QUEUED",
    "RUNNING",
    "Mover",
    "Path",
    "Priority",
    "Ticket",
    "check_copy_path",
    "copy_nbytes",
    "real_pairs",
    "real_store",
    "refuse_pair",
    "tensor_nbytes",
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


QUEUED = 0
RUNNING = 1
DONE = 2


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
        self._state = QUEUED
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


def copy_nbytes(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """The bytes a list of ``(src, dst)`` copies moves; ValueError on a pair that cannot copy.

    Runs on the caller's thread for every pair of every copy (a load of 64 pages
    checks 64), so the common case reads three attributes per tensor; the
    checks that name the problem run only once a pair has failed.
    """
    total = 0
    for src, dst in pairs:
        nbytes = src.nbytes
        if src.dtype is not dst.dtype or src.dim() != 1 or dst.dim() != 1 or dst.nbytes < nbytes:
            refuse_pair(src, dst)
        total += nbytes
    return total


def refuse_pair(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Raise the ValueError that says why ``(src, dst)`` cannot copy."""
    if src.dim() != 1 or dst.dim() != 1:
        raise ValueError(
            "copy pairs must be 1-D byte views (e.g. kvstore.gpu._tensors.byte_view), "
            f"got shapes {tuple(src.shape)} and {tuple(dst.shape)}"
        )
    if src.dtype != dst.dtype:
        raise ValueError(f"copy pair dtypes differ: {src.dtype} -> {dst.dtype}")
    raise ValueError(f"copy destination holds {dst.numel()} elements; the source has {src.numel()}")


def check_copy_path(path: Path) -> None:
    if path not in COPY_PATHS:
        raise ValueError(f"{path} is not a copy path; NVMe moves are nvme_read / nvme_write")


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def real_store(store: KVStore | None) -> KVStore:
    if store is None:
        raise ValueError(
            "a real mover needs the store to read from or write to (None is FakeMover's)"
        )
    return store


def real_pairs(
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
        """Read ``keys[i]`` into the CPU byte view ``dsts[i]`` (``store.get_many_into``;
        a real mover starts it with ``get_many_into_async`` where the store has it).

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
        """Store ``(key, CPU byte view, meta)`` items (``store.put_many``; a real
        mover starts it with ``put_many_async`` where the store has it).

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

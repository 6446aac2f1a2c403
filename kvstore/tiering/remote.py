"""The remote tier's interface: a cluster store the tier manager shares pages through.

docs/tiering.md, "The remote tier". A ``RemoteBackend`` is a client of one cluster
key-value store (Mooncake Store: ``remote_mooncake.py``; ``MemoryBackend`` below, an
in-process twin for tests and for checking that the interface stays honest). Its calls
block, so they never run on a caller's thread: ``RemoteLink`` runs them on worker
threads of its own and hands each back as a finished ``RemoteJob``, which the manager
harvests under its lock the way it harvests mover tickets; a job past its deadline is
given up on (``RemoteTier`` in remote_tier.py counts its pages as late misses) while
its buffers stay owned by it until the call really returns.

Backends are registered by name (``register_remote_backend``) and looked up by
``TierConfig.remote_backend``; a module named in ``BUILTIN_BACKENDS`` is imported only
when its backend is asked for (Mooncake's client is an optional install).
"""

from __future__ import annotations

import abc
import ctypes
import importlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "BUILTIN_BACKENDS",
    "MemoryBackend",
    "MemoryCluster",
    "RemoteBackend",
    "RemoteError",
    "RemoteJob",
    "RemoteLink",
    "cut_parts",
    "memory_cluster",
    "open_remote_backend",
    "register_remote_backend",
]

# name -> "module:Class" (imported on first use)
BUILTIN_BACKENDS = {
    "mooncake": "kvstore.tiering.remote_mooncake:MooncakeBackend",
    "memory": "kvstore.tiering.remote:MemoryBackend",
}
_REGISTRY: dict[str, type[RemoteBackend]] = {}

# A part of a value: (address, bytes) in memory registered with the backend.
Part = tuple[int, int]


class RemoteError(Exception):
    """The cluster store cannot be reached or refused a call; the words say why."""


class RemoteBackend(abc.ABC):
    """One client of a cluster store. Every call may block (network, a hung peer) and
    is made on a ``RemoteLink`` worker thread, never under the manager's lock.

    Results per key are ``(nbytes, reason)``: ``reason`` is "" when the call did what
    was asked, else one word the tier counts (``absent``, ``transfer``, ``master``,
    ``too_large``, ``error``)."""

    name = "?"

    def __init__(self, options: Mapping[str, Any]) -> None:
        self.options = dict(options)

    @abc.abstractmethod
    def connect(self) -> None:
        """Join the cluster (RemoteError when it cannot); called again after a failure."""

    @abc.abstractmethod
    def register(self, address: int, nbytes: int) -> None:
        """Make memory usable as a source or destination of transfers (once, at open)."""

    @abc.abstractmethod
    def sizes(self, keys: Sequence[str]) -> list[int | None]:
        """Each value's size in bytes, None where the cluster holds none. RemoteError
        when the cluster cannot answer."""

    @abc.abstractmethod
    def get_into(self, keys: Sequence[str], parts: Sequence[list[Part]]) -> list[tuple[int, str]]:
        """Read each value scattered into its parts (their sizes add up to the value's)."""

    def read_into(
        self,
        keys: Sequence[str],
        parts: Sequence[list[Part]],
        landed: Callable[[int, int], None] | None = None,
    ) -> list[tuple[int, str]]:
        """Read each value into its parts without knowing its size first: the parts
        may hold more than the value (a page's whole DRAM slot), which fills them in
        order; ``nbytes`` is the value's size. ``absent`` where the cluster holds
        none, ``too_large`` where it does not fit. This default asks the sizes and
        then reads exactly (two round trips); a backend whose read takes a larger
        destination at once overrides it. ``landed(i, nbytes)``: a backend that sees
        values arrive one by one may say so for each value wholly in its parts (and
        never written again by this call), so the caller can check it while the
        rest are on their way; the result stays the word."""
        sizes = self.sizes(keys)
        out: list[tuple[int, str]] = [(0, "absent")] * len(keys)
        asked: list[int] = []
        cut: list[list[Part]] = []
        for i, (size, value_parts) in enumerate(zip(sizes, parts, strict=True)):
            if size is None:
                continue
            if size > sum(n for _, n in value_parts):
                out[i] = (0, "too_large")
            elif size == 0:
                out[i] = (0, "")
            else:
                asked.append(i)
                cut.append(cut_parts(value_parts, size))
        if asked:
            got = self.get_into([keys[i] for i in asked], cut)
            for i, result in zip(asked, got, strict=True):
                out[i] = result
        return out

    @abc.abstractmethod
    def put_from(self, keys: Sequence[str], parts: Sequence[list[Part]]) -> list[tuple[int, str]]:
        """Publish each value gathered from its parts; a key already held is no error."""

    @abc.abstractmethod
    def health(self) -> str | None:
        """None while the cluster answers, else why not."""

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """What an operator needs to find this client (master, own address)."""

    def close(self) -> None:  # noqa: B027 (a backend with nothing to leave)
        """Leave the cluster; never called while a call of this backend still runs."""


def cut_parts(parts: Sequence[Part], nbytes: int) -> list[Part]:
    """The leading ``nbytes`` of ``parts`` (parts past them dropped, the last cut)."""
    out: list[Part] = []
    for address, n in parts:
        if nbytes <= 0:
            break
        out.append((address, min(n, nbytes)))
        nbytes -= n
    return out


def _scatter(value: bytes, parts: Sequence[Part]) -> None:
    """Copy ``value`` into ``parts`` in order (their sizes add up to its length)."""
    at = 0
    for address, nbytes in parts:
        ctypes.memmove(address, value[at : at + nbytes], nbytes)
        at += nbytes


def register_remote_backend(name: str) -> Callable[[type[RemoteBackend]], type[RemoteBackend]]:
    """Class decorator: ``TierConfig(remote_backend=name)`` opens this backend."""

    def add(cls: type[RemoteBackend]) -> type[RemoteBackend]:
        _REGISTRY[name] = cls
        cls.name = name
        return cls

    return add


def open_remote_backend(name: str, options: Mapping[str, Any]) -> RemoteBackend:
    """A new, unconnected backend ``name`` (ValueError names the known ones)."""
    if name not in _REGISTRY and name in BUILTIN_BACKENDS:
        module = BUILTIN_BACKENDS[name].partition(":")[0]
        importlib.import_module(module)  # registers itself
    cls = _REGISTRY.get(name)
    if cls is None:
        known = ", ".join(sorted({*BUILTIN_BACKENDS, *_REGISTRY}))
        raise ValueError(f"unknown remote_backend {name!r}; known: {known}")
    return cls(options)


# -- jobs on worker threads ------------------------------------------------------


@dataclass(eq=False)
class RemoteJob:
    """One blocking call made on a worker thread. ``result`` / ``error`` are set when
    it returns (``finished_s``); ``expired`` once the manager gave up on it (its
    deadline passed first): its buffers stay the job's until it has returned."""

    kind: str
    call: Callable[[], Any]
    deadline_s: float
    context: Any = None
    submitted_s: float = field(default_factory=time.monotonic)
    started_s: float | None = None
    finished_s: float | None = None
    result: Any = None
    error: str | None = None
    expired: bool = False
    nbytes: int = 0

    def seconds(self) -> float | None:
        if self.started_s is None or self.finished_s is None:
            return None
        return self.finished_s - self.started_s


class RemoteLink:
    """Worker threads for one backend's blocking calls; completions are polled."""

    def __init__(self, workers: int, name: str) -> None:
        self._queue: queue.Queue[RemoteJob | None] = queue.Queue()
        self._done: deque[RemoteJob] = deque()
        self.in_flight: set[RemoteJob] = set()  # submitted, not yet polled back
        self._lock = threading.Lock()
        # Every returned call bumps ``finished`` and wakes ``wait_finished``.
        self._finished = threading.Condition(self._lock)
        self.finished = 0
        self._threads = [
            threading.Thread(target=self._run, name=f"kvstore-remote-{name}-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(
        self, kind: str, call: Callable[[], Any], deadline_s: float, context: Any = None
    ) -> RemoteJob:
        job = RemoteJob(kind, call, time.monotonic() + deadline_s, context)
        with self._lock:
            self.in_flight.add(job)
        self._queue.put(job)
        return job

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            job.started_s = time.monotonic()
            try:
                job.result = job.call()
            except Exception as e:  # a job never kills its worker
                job.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            job.finished_s = time.monotonic()
            with self._lock:
                self._done.append(job)
                self.finished += 1
                self._finished.notify_all()

    def wait_finished(self, seen: int, timeout_s: float) -> bool:
        """Block until a call returns after ``finished`` was ``seen`` (True), or
        ``timeout_s`` passes (False)."""
        with self._lock:
            return self._finished.wait_for(lambda: self.finished != seen, timeout_s)

    def poll(self) -> list[RemoteJob]:
        """The jobs that returned since the last poll; never blocks."""
        if not self._done:
            return []
        with self._lock:
            jobs = list(self._done)
            self._done.clear()
            self.in_flight.difference_update(jobs)
        return jobs

    def overdue(self, now: float) -> list[RemoteJob]:
        """Jobs still running (or queued) past their deadline, not given up on yet."""
        with self._lock:
            return [
                j
                for j in self.in_flight
                if not j.expired and j.finished_s is None and now > j.deadline_s
            ]

    def stuck(self) -> int:
        """Jobs given up on that have not returned yet."""
        with self._lock:
            return sum(1 for j in self.in_flight if j.expired and j.finished_s is None)

    def close(self, timeout_s: float) -> bool:
        """Stop the workers; False when a call still runs after ``timeout_s``."""
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)


# -- the in-process twin ------------------------------------------------------------


@dataclass
class MemoryCluster:
    """What ``MemoryBackend`` clients of one name share: the values, and switches a
    test flips: ``down`` (the master is unreachable), ``hang`` (set: calls block until
    it is cleared), ``empty_gets`` (a read of a held key returns 0 bytes)."""

    values: dict[str, bytes] = field(default_factory=dict)
    down: bool = False
    hang: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    empty_gets: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def wait_if_hung(self) -> None:
        if self.hang.is_set():
            self.release.wait(60.0)


_CLUSTERS: dict[str, MemoryCluster] = {}


def memory_cluster(name: str) -> MemoryCluster:
    """The shared state of the in-process cluster ``name`` (made on first use)."""
    cluster = _CLUSTERS.get(name)
    if cluster is None:
        cluster = _CLUSTERS[name] = MemoryCluster()
    return cluster


@register_remote_backend("memory")
class MemoryBackend(RemoteBackend):
    """A cluster store inside this process (``remote_options={"cluster": name}``):
    the same calls as a real one over a dict, with the faults of ``MemoryCluster``."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.cluster = memory_cluster(str(self.options.get("cluster", "default")))

    def _reachable(self) -> None:
        self.cluster.wait_if_hung()
        if self.cluster.down:
            raise RemoteError("master unreachable (memory cluster is down)")

    def connect(self) -> None:
        self._reachable()

    def register(self, address: int, nbytes: int) -> None:
        pass

    def sizes(self, keys: Sequence[str]) -> list[int | None]:
        self._reachable()
        with self.cluster.lock:
            return [len(v) if (v := self.cluster.values.get(k)) is not None else None for k in keys]

    def get_into(self, keys: Sequence[str], parts: Sequence[list[Part]]) -> list[tuple[int, str]]:
        self._reachable()
        out: list[tuple[int, str]] = []
        for key, value_parts in zip(keys, parts, strict=True):
            with self.cluster.lock:
                value = self.cluster.values.get(key)
            if value is None:
                out.append((0, "absent"))
                continue
            if self.cluster.empty_gets:
                out.append((0, ""))
                continue
            if sum(n for _, n in value_parts) != len(value):
                out.append((0, "transfer"))
                continue
            _scatter(value, value_parts)
            out.append((len(value), ""))
        return out

    def read_into(
        self,
        keys: Sequence[str],
        parts: Sequence[list[Part]],
        landed: Callable[[int, int], None] | None = None,
    ) -> list[tuple[int, str]]:
        self._reachable()
        out: list[tuple[int, str]] = []
        for key, value_parts in zip(keys, parts, strict=True):
            with self.cluster.lock:
                value = self.cluster.values.get(key)
            if value is None:
                out.append((0, "absent"))
            elif self.cluster.empty_gets:
                out.append((0, ""))
            elif len(value) > sum(n for _, n in value_parts):
                out.append((0, "too_large"))
            else:
                _scatter(value, cut_parts(value_parts, len(value)))
                out.append((len(value), ""))
        return out

    def put_from(self, keys: Sequence[str], parts: Sequence[list[Part]]) -> list[tuple[int, str]]:
        self._reachable()
        out: list[tuple[int, str]] = []
        for key, value_parts in zip(keys, parts, strict=True):
            value = b"".join(ctypes.string_at(address, n) for address, n in value_parts)
            with self.cluster.lock:
                self.cluster.values.setdefault(key, value)
            out.append((len(value), ""))
        return out

    def health(self) -> str | None:
        try:
            self._reachable()
        except RemoteError as e:
            return str(e)
        return None

    def describe(self) -> dict[str, Any]:
        return {"backend": "memory", "cluster": str(self.options.get("cluster", "default"))}

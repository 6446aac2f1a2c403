"""``RemoteTier``: the tier manager's component for a cluster store below NVMe.

docs/tiering.md, "The remote tier". Lookups go local first: when a lookup's run of
resident pages stops short of its keys, the pages that follow are asked of the
cluster: read straight into whole DRAM slots (no size query: a page is at most
``page_bytes``; zero-copy where the backend allows: the arena is registered), or,
with no free slot to take and a cluster that lately lacked most pages asked, after a
size query into slots for the pages found; verified in place against the wire header
(docs/format.md, "Remote tier value") and then admitted as DRAM pages, as an NVMe read
would be; the engine's next lookup finds them there. Pages an offer lands in DRAM are
published when their value density with the remote tier's measured load time passes
``remote_tau`` (no wear counts: the cluster's memory is not a drive).

Nothing here blocks: calls are ``RemoteJob``s on ``RemoteLink`` workers, harvested
under the manager's lock. A call past ``remote_deadline_s`` is given up on: its
pages count as late misses and the tier reports itself degraded, while the call's
DRAM slots and header blocks stay its own until it returns (a late write can land
in no page). Degraded (the master unreachable, a call overdue, a failed join), the
tier starts no reads and no publishes; a health call every ``remote_health_s``
brings it back. Every read that is short, empty, late, of another key or namespace,
or fails its checksum is a miss counted by reason, never a page.

Here: ``RemoteTier`` (construction, publishing, the control cycle, statistics) and
``open_remote``; the read path and the bookkeeping both share are its base class,
``RemoteReads`` (remote_reads.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvstore.format.remote import REMOTE_HEADER_BYTES, encode_remote_header_into, remote_key
from kvstore.tiering.arena import SlotPool
from kvstore.tiering.config import TierConfig
from kvstore.tiering.cost import Bandwidth, CostModel
from kvstore.tiering.pages import PageRec, PageState
from kvstore.tiering.policy import ReuseEstimator
from kvstore.tiering.remote import RemoteBackend, RemoteJob, RemoteLink, open_remote_backend
from kvstore.tiering.remote_reads import REMOTE_READ, REMOTE_WRITE, RemoteReads
from kvstore.tiering.state import TierState

__all__ = ["REMOTE_READ", "REMOTE_WRITE", "RemoteTier", "open_remote"]

log = logging.getLogger("kvstore.tiering")

_HDR = REMOTE_HEADER_BYTES
_READY = PageState.READY
_PUBLISHABLE = (PageState.READY, PageState.EVICTING)


class RemoteTier(RemoteReads):
    """The remote tier of one manager (``TierConfig.remote_backend``)."""

    def __init__(
        self,
        config: TierConfig,
        state: TierState,
        *,
        backend: RemoteBackend,
        dram: SlotPool,
        alloc: Callable[[int], int | None],
        alloc_many: Callable[[int, int], list[int] | None],
        reuse: ReuseEstimator,
        cost: CostModel,
        h2d: Bandwidth,
    ) -> None:
        self.config = config
        self.namespace = config.remote_namespace
        self._state = state
        self._pages = state.pages
        self._backend = backend
        self._dram = dram
        self._alloc = alloc
        self._alloc_many = alloc_many
        self._reuse = reuse
        self._cost = cost
        self._h2d = h2d
        self._deadline_s = config.remote_deadline_s
        self._max_pages = config.remote_max_pages
        rates, lat = config.bandwidth_bytes_per_s, config.latency_s
        self.bandwidth = {
            REMOTE_READ: Bandwidth(rates.get(REMOTE_READ, 1.25e9), lat.get(REMOTE_READ, 2e-4)),
            REMOTE_WRITE: Bandwidth(rates.get(REMOTE_WRITE, 1.25e9), lat.get(REMOTE_WRITE, 2e-4)),
        }
        self.counters: dict[str, int] = {}
        headers = 4 * config.remote_max_pages
        self._headers = np.zeros(headers * _HDR, dtype=np.uint8)
        self._free_headers = list(range(headers - 1, -1, -1))
        self._headers_at = int(self._headers.ctypes.data)
        self._fetching: set[bytes] = set()
        self._timings = deque(maxlen=256)
        self._present = 0.0  # share of asked pages the cluster held, lately
        self._missed: dict[bytes, float] = {}  # key -> when it may be asked again
        self._published: OrderedDict[bytes, None] = OrderedDict()
        self._from_remote: OrderedDict[bytes, None] = OrderedDict()
        self.degraded: str | None = "connecting to the cluster"
        self._connected = False
        self._last_health = -math.inf
        self._last_explore = -math.inf
        self._now_hint = 0.0  # the manager's clock at the last harvest
        self._control_job: RemoteJob | None = None
        self._data = RemoteLink(config.remote_workers, "data")
        self._control = RemoteLink(1, "control")
        buffer = getattr(dram, "buffer", None)
        if buffer is not None:
            arena = buffer()
            backend.register(arena.data_ptr(), arena.numel())
        backend.register(self._headers.ctypes.data, self._headers.nbytes)
        self._control_job = self._control.submit("connect", backend.connect, self._deadline_s * 5)

    # -- publishing --------------------------------------------------------------------

    def _admits(self, rec: PageRec) -> bool:
        """Value density with the remote tier's load time (docs/tiering.md, "Admission"):
        ``p·(T_recompute − T_remote)/bytes`` (or the ``charged`` form) >= ``remote_tau``."""
        p = self._reuse.p(rec.depth, rec.reused, rec.tag)
        recompute = self._cost.recompute_s(rec.tokens, rec.depth * rec.tokens)
        load = self.bandwidth[REMOTE_READ].seconds(rec.nbytes + _HDR) + self._h2d.seconds(
            rec.nbytes
        )
        if self.config.value_formula == "expected":
            density = p * (recompute - load) / rec.nbytes
        else:
            density = (p * recompute - load) / rec.nbytes
        return density >= self.config.remote_tau

    def offered(self, recs: Sequence[PageRec]) -> None:
        """An offer's copy into DRAM landed: publish what the cluster should hold."""
        if not self.up:
            self._bump("publish:degraded", len(recs))
            return
        batch: list[tuple[PageRec, int]] = []
        for rec in recs:
            # READY, or EVICTING: a write-back (write-through placement writes every
            # offered page at once) only reads the slot, which stays valid until the
            # copy lands and, pinned by the put, after it.
            if rec.state not in _PUBLISHABLE or not rec.tiers & 2 or rec.dram_slot < 0:
                continue
            if rec.key in self._published or rec.key in self._from_remote:
                continue
            if not self._admits(rec):
                self._bump("publish:below_tau")
                continue
            if not self._free_headers:
                self._bump("publish:busy")
                break
            rec.pins += 1  # R4: its slot is read by the put; never a victim meanwhile
            batch.append((rec, self._free_headers.pop()))
        if not batch:
            return
        names = [remote_key(self.namespace, rec.key) for rec, _ in batch]
        views = [self._dram.view(rec.dram_slot, rec.nbytes) for rec, _ in batch]
        fields = [(rec.key, rec.parent, rec.depth, rec.tokens) for rec, _ in batch]
        headers = [self._header(h) for _, h in batch]
        parts = [
            [(self._header_address(h), _HDR), (int(view.data_ptr()), rec.nbytes)]
            for (rec, h), view in zip(batch, views, strict=True)
        ]
        backend, namespace = self._backend, self.namespace

        def publish() -> list[tuple[int, str]]:
            for (key, parent, depth, tokens), head, view in zip(
                fields, headers, views, strict=True
            ):
                encode_remote_header_into(
                    memoryview(head),
                    namespace=namespace,
                    key=key,
                    payload=view.numpy(),
                    parent=parent,
                    depth=depth,
                    tokens=tokens,
                )
            return backend.put_from(names, parts)

        job = self._data.submit("put", publish, self._deadline_s, batch)
        job.nbytes = sum(_HDR + rec.nbytes for rec, _ in batch)

    def _put_done(self, job: RemoteJob, now: float) -> None:
        batch: list[tuple[PageRec, int]] = job.context
        for rec, header in batch:
            self._free_headers.append(header)
            if rec.pins > 0:
                rec.pins -= 1
                self._state.forget_if_gone(rec)
        if job.expired:
            return
        if job.error is not None:
            self._failed(job.error)
            self._bump("publish:failed", len(batch))
            return
        moved = 0
        for (rec, _), (nbytes, reason) in zip(batch, job.result, strict=True):
            if reason:
                self._bump("publish:failed:" + reason)
                if reason == "master":
                    self._degrade("the master does not answer writes")
                continue
            self._remember(self._published, rec.key)
            self._bump("published")
            self._bump("bytes_written", rec.nbytes)
            moved += nbytes
        seconds = job.seconds()
        if moved and seconds:
            self.bandwidth[REMOTE_WRITE].observe(moved, seconds, now)

    # -- the control cycle -------------------------------------------------------------

    def harvest(self, now: float) -> int:
        """Process the calls that returned (under the manager's lock); how many."""
        self._now_hint = now
        jobs = self._data.poll()
        control = self._control.poll()
        for job in jobs:
            if job.kind == "query":
                if job.expired:
                    continue
                self._query_done(job)
            elif job.kind == "get":
                self._get_done(job, now)
            elif job.kind == "put":
                self._put_done(job, now)
        for job in control:
            self._control_job = None
            if job.expired:
                continue
            if job.error is not None:
                self._connected = job.kind == "health" and self._connected
                self._degrade(job.error.split(": ", 1)[-1])
            elif job.kind == "connect":
                self._connected = True
                self._heal()
            elif job.result is not None:
                self._degrade(str(job.result))
            elif self._data.stuck():
                self._degrade(f"{self._data.stuck()} remote calls still past their deadline")
            else:
                self._heal()
        return len(jobs) + len(control)

    def step(self) -> None:
        """Give up on overdue calls; a health call (or a new join) when due."""
        mono = time.monotonic()
        for job in self._data.overdue(mono):
            job.expired = True
            self._bump("late_calls")
            context = job.context
            if job.kind == "query":
                for key in context.keys:
                    self._fetching.discard(key)
            elif job.kind == "get":
                for key, _, _, _ in context.items:
                    self._fetching.discard(key)
                    self._miss("late")  # asked again once the tier is back up
                self._advance(context.fetch, self._now_hint)
            else:
                self._bump("publish:late", len(context))
            self._degrade(
                f"a remote {job.kind} outlived its deadline of {self._deadline_s:g} s "
                "(a hung peer or master)"
            )
        for job in self._control.overdue(mono):
            job.expired = True
            self._control_job = None
            self._degrade(f"the cluster did not answer a {job.kind} within its deadline")
        if self._control_job is None and mono - self._last_health >= self.config.remote_health_s:
            self._last_health = mono
            backend = self._backend
            if self._connected:
                self._control_job = self._control.submit("health", backend.health, self._deadline_s)
            elif not self._control.stuck():
                self._control_job = self._control.submit(
                    "connect", backend.connect, self._deadline_s * 5
                )

    def returned(self) -> int:
        """How many data calls have returned so far (``wait_returned``'s ``seen``)."""
        return self._data.finished

    def wait_returned(self, seen: int, timeout_s: float) -> bool:
        """Block (without the manager's lock) until a data call returns after
        ``returned()`` was ``seen``, or ``timeout_s`` passes: a caller waiting for its
        remote pages looks up again when one may have landed, not on a timer."""
        return self._data.wait_finished(seen, timeout_s)

    def busy(self) -> bool:
        """Calls in flight that have not been given up on (``TierManager.drain``)."""
        return any(not j.expired for j in list(self._data.in_flight))

    def close(self) -> None:
        """Stop the workers (a call still running after the deadline is left behind,
        and then the backend is not closed under it)."""
        done = self._data.close(self._deadline_s)
        done = self._control.close(self._deadline_s) and done
        if done:
            self._backend.close()
        else:
            log.warning("remote tier closed with calls still running; its client stays open")

    # -- statistics --------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """What ``stats()``, the statistics file and ``kvstore tier stat`` show."""
        c = self.counters
        return {
            "backend": self._backend.describe(),
            "namespace": self.namespace,
            "state": "up" if self.up else "degraded",
            "degraded_reason": self.degraded or "",
            "hits": c.get("hits", 0),
            "misses": c.get("misses", 0),
            "miss_reasons": {k[5:]: v for k, v in sorted(c.items()) if k.startswith("miss:")},
            "lookups": c.get("lookups", 0),
            "published": c.get("published", 0),
            "bytes_read": c.get("bytes_read", 0),
            "bytes_written": c.get("bytes_written", 0),
            "kappa": self.kappa(),
            "in_use": self.up and self.kappa() >= 1.0,
            "bandwidth": {
                name: {"bytes_per_s": b.rate, "latency_s": b.latency_s, "samples": b.samples}
                for name, b in self.bandwidth.items()
            },
            "in_flight": len(self._data.in_flight),
            "stuck_calls": self._data.stuck(),
            "counters": dict(sorted(c.items())),
        }


def open_remote(
    config: TierConfig, state: TierState, value: Any, backends: Any, cost: CostModel, eviction: Any
) -> RemoteTier | None:
    """The remote tier ``config`` asks for (None without ``remote_backend``); its
    client joins the cluster on a worker thread, so an unreachable master costs the
    open nothing (the tier starts degraded and reconnects)."""
    if config.remote_backend is None:
        return None
    backend = open_remote_backend(config.remote_backend, config.remote_options)
    return RemoteTier(
        config,
        state,
        backend=backend,
        dram=backends.dram,
        alloc=eviction.alloc,
        alloc_many=eviction.alloc_many,
        reuse=value.reuse,
        cost=cost,
        h2d=backends.bandwidth["h2d"],
    )

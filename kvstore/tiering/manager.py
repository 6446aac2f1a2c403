"""``TierManager``: places KV pages across HBM (0), DRAM (1) and NVMe (2).

The engine-facing API of docs/tiering.md ("API"; the rules R1-R7 cited here are its
"The mover and the ordering rules"), a facade over the components of docs/design.md
("The tier manager"): ``TierState`` (the pages, the orders, per-tier accounting),
``Valuation`` (reuse, value density, admission, τ), ``Placement`` (offers),
``Eviction`` (room, write-back, the emergency), ``Loads`` (lookups, plans, loads),
``Measurements`` (calibration, κ gates, probes) and the backends (mover, slot pools,
copies, the NVMe tier). No call waits for I/O on the caller's thread: copies and
NVMe reads/writes are tickets on the mover; their completions are harvested (rule
R6: before any eviction decision) by ``step``, which the control thread runs every
``control_interval_s`` (or the caller, with 0: the simulator).

Lock plan: one lock (``_lock``, reentrant) guards every ``PageRec``, the orders,
the arenas' slot ownership, the components' state and the counters. Mover threads
never take it; they only complete tickets. Store calls made under it are the
non-blocking ones (``delete``: a WAL append); reads and writes run on the mover's
I/O thread. Statistics are saved outside it, under ``_stats_write_lock``.

Page state machine (rule R4): a slot is written only while its page is WRITING or
LOADING and read only while READY or EVICTING; a pinned page (a load in progress,
or ``pin``) is never a victim and its slots are never reused. NVMe bytes are verified
by the store on every read (R5): a failed read drops the page, never serves it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvstore.errors import ClosedError
from kvstore.inputs import key_bytes as store_key
from kvstore.tiering.backends import open_backends
from kvstore.tiering.completions import Demotion, Load, OfferCopy, Probe, Read, WriteBack
from kvstore.tiering.config import TierConfig
from kvstore.tiering.cost import Compute, CostModel, class_priors
from kvstore.tiering.evict import Eviction
from kvstore.tiering.latency import OFFLOAD_BUCKETS_S, OffloadLatency
from kvstore.tiering.loads import Loads
from kvstore.tiering.measure import Measurements
from kvstore.tiering.mover_api import Path, Ticket
from kvstore.tiering.nvme import META_TAG
from kvstore.tiering.pages import DRAM, HBM, NVME, PageState, page_key
from kvstore.tiering.placement import Placement
from kvstore.tiering.remote_tier import open_remote
from kvstore.tiering.restart import Restart
from kvstore.tiering.results import (
    UNBOUNDED_BYTES,
    LoadHandle,
    LoadPlan,
    LookupResult,
    OfferResult,
    RequestContext,
    TierStats,
    check_count,
)
from kvstore.tiering.state import TierState
from kvstore.tiering.statsfile import (
    STATS_FILE,
    STATS_VERSION,
)
from kvstore.tiering.value import Valuation

__all__ = ["META_TAG", "OFFLOAD_BUCKETS_S", "STATS_FILE", "STATS_VERSION", "TierManager"]

_HEAT_PAGES = 100_000  # pages whose heat is persisted (the hottest)
# The control thread's wait while nothing happens: after _QUIET_STEPS cycles in a row
# with nothing in flight and no call into the manager, it doubles from
# control_interval_s up to _IDLE_MAX_S (an idle manager woke 500 times a second and
# used 5% of a core); a call that takes the manager's lock wakes it at once.
_IDLE_MAX_S = 0.05
_QUIET_STEPS = 10


class _WakingLock:
    """The manager's lock (reentrant). Taken by any thread but the control thread, it
    counts the call, and wakes the control thread if that idles."""

    __slots__ = ("_lock", "calls", "control", "idle", "wake")

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.calls = 0  # acquisitions by other threads than ``control``
        self.control: int | None = None  # the control thread's ident
        self.idle = False
        self.wake = threading.Event()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not self._lock.acquire(blocking, timeout):
            return False
        if threading.get_ident() != self.control:
            self.calls += 1
            if self.idle:
                self.idle = False
                self.wake.set()
        return True

    def release(self) -> None:
        self._lock.release()

    def own(self) -> threading.RLock:
        """The bare lock: the control thread's own checks count and wake nothing."""
        return self._lock


_NO_CONTEXT = RequestContext()
_READY = PageState.READY


def _slot_bytes(page_bytes: int) -> int:
    return (page_bytes + 4095) // 4096 * 4096


class TierManager:
    """The tier manager. Open with ``TierManager.open(TierConfig(...))``; a context manager."""

    # -- open / close --------------------------------------------------------

    @classmethod
    def open(cls, config: TierConfig | None = None) -> TierManager:
        return cls(config or TierConfig())

    def __init__(self, config: TierConfig) -> None:
        self.config = config
        self._lock = _WakingLock()
        self._closed = False
        slot = _slot_bytes(config.page_bytes)
        priors, flops_prior = class_priors(config.device_class)
        self._priors = priors
        owned_hbm = config.hbm == "owned" and config.hbm_bytes >= slot
        backends = open_backends(config, priors=priors, slot_bytes=slot, owned_hbm=owned_hbm)
        self._bandwidth = backends.bandwidth
        self._compute = Compute(
            config.compute_flops if config.compute_flops is not None else flops_prior
        )
        self.cost = CostModel(
            config.model,
            config.tokens_per_page,
            self._compute,
            self._bandwidth,
            layer_overlap=config.layer_overlap,
        )
        self._mover = backends.mover
        self.clock = backends.clock
        self._now = self._mover.now
        self._hbm, self._dram = backends.hbm, backends.dram
        self._nvme = backends.nvme
        self._slot_bytes = slot
        self._owned_hbm = owned_hbm
        self._stats_path = self._nvme.stats_path  # None: no statistics file
        nvme = self._nvme
        nvme_bytes = nvme.capacity if nvme.capacity is not None else UNBOUNDED_BYTES
        capacity = [
            self._hbm.capacity_bytes,
            self._dram.capacity_bytes,
            nvme_bytes if nvme.enabled else 0,
        ]
        if config.hbm == "engine":
            capacity[HBM] = config.hbm_bytes
        # The reuse horizon's default (value.ghost_entries_for): an NVMe tier without a
        # capacity counts none (its UNBOUNDED_BYTES is no number of pages).
        bounded = capacity[HBM] + capacity[DRAM] + (capacity[NVME] if nvme.capacity else 0)
        cache_pages = bounded // slot if slot else 0
        self._value = Valuation(config, self.cost, self._compute, slot, capacity[NVME], cache_pages)
        state = self._state = TierState(
            config,
            hbm=self._hbm,
            dram=self._dram,
            owned_hbm=owned_hbm,
            slot_bytes=slot,
            capacity=capacity,
            cost_ratio=self._value.cost_ratio,
            reuse_p=self._value.reuse.p_first,
        )
        # White-box names the tests and harnesses read (under the lock).
        self._pages, self._orders, self._counters = state.pages, state.orders, state.counters
        self._capacity, self._readable_mask = capacity, state.readable_mask
        self._reuse, self._tau = self._value.reuse, self._value.tau
        self._bump = state.bump
        self._latency = OffloadLatency()
        self._last_persist = self._now()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._measure = Measurements(
            config,
            bandwidth=self._bandwidth,
            compute=self._compute,
            cost=self.cost,
            mover=self._mover,
            store=nvme.store,
            nvme_order=state.orders[NVME],
            capacity=capacity,
            slot_bytes=slot,
            counters=state.counters,
            fake=backends.simulated,
        )
        self._evict = Eviction(
            config,
            state,
            self._value,
            nvme=nvme,
            copies=backends.copies,
            mover=self._mover,
            bandwidth=self._bandwidth,
            measure=self._measure,
            now=self._now,
        )
        self._loads = Loads(
            config,
            state,
            self._value,
            eviction=self._evict,
            nvme=nvme,
            copies=backends.copies,
            cost=self.cost,
            bandwidth=self._bandwidth,
            now=self._now,
            pump=self._pump,
        )
        self._evict.fire_waiters = self._loads.fire_waiters
        self._place = Placement(
            config,
            state,
            self._value,
            eviction=self._evict,
            loads=self._loads,
            copies=backends.copies,
            nvme_enabled=nvme.enabled,
            now=self._now,
            pump=self._pump,
        )
        self._copies = backends.copies
        self._restart = Restart(
            config,
            state,
            self._value,
            nvme=nvme,
            loads=self._loads,
            eviction=self._evict,
            cost=self.cost,
            bandwidth=self._bandwidth,
            compute=self._compute,
            now=self._now,
        )
        # The statistics file's save, under its name of old (tests and harnesses).
        self._stats_snapshot = self._snapshot
        self._write_stats = self._restart.write
        self._last_error: str | None = None
        # The remote tier (docs/tiering.md, "The remote tier"); None without one.
        self._remote = open_remote(config, state, self._value, backends, self.cost, self._evict)
        try:
            if nvme.store is not None:
                self._restart.rebuild()
                self._restart.load()
            if config.probe_at_open:
                self._measure.calibrate(r for r in self._pages.values() if r.tiers & 4)
                self._value.invalidate()
            self._update_gates()
        except BaseException:
            self._close_resources()
            raise
        # A virtual clock moves only by the caller's steps: no control thread then.
        if config.control_interval_s > 0 and self.clock is None:
            self._thread = threading.Thread(
                target=self._control_loop, name="kvstore-tier-control", daemon=True
            )
            self._thread.start()

    def __enter__(self) -> TierManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Finish in-flight writes, persist the statistics, close the store. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._lock.wake.set()  # an idling control thread sees the stop now
        if self._thread is not None:
            self._thread.join()
        # Completions may start copies (a waiting load, a write-through): let them run
        # while the mover is open, so the last harvest below starts nothing.
        self.drain()
        self._mover.close()
        with self._lock:
            self._harvest()
            self._loads.abandon()
            self._place.abandon_waiting()
            snapshot = self._stats_snapshot() if self._stats_path is not None else None
        if snapshot is not None:
            self._write_stats(snapshot)
        self._measure.close()
        self._close_resources()

    def _close_resources(self) -> None:
        with contextlib.suppress(Exception):
            self._mover.close()
        if self._remote is not None:
            self._remote.close()
        self._nvme.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the tier manager is closed")

    @property
    def store(self) -> Any:
        """The NVMe tier's ``KVStore`` (None without ``nvme_path``)."""
        return self._nvme.store

    # -- lookup and load ---------------------------------------------------

    def lookup(
        self,
        keys: Sequence[object],
        ctx: RequestContext | None = None,
        *,
        tokens: int | None = None,
    ) -> LookupResult:
        """The resident prefix of ``keys`` and the plan to load it (or not).

        ``tokens``: the prompt's length (default ``ctx.tokens``, else one page per
        key); the plan compares loading the hit with recomputing it. PENDING pages are
        fetched NVMe -> DRAM in the background at once.
        """
        ctx = _check_ctx(ctx)
        if tokens is not None:
            check_count("lookup: tokens", tokens, low=0)
        with self._lock:
            self._check_open()
            self._harvest()
            result = self._loads.lookup(keys, ctx, tokens)
            if self._remote is not None and result.hit_pages < len(keys):
                pending = self._remote.lookup(keys, result.hit_pages, self._now())
                return dataclasses.replace(result, remote_pending=pending)
            return result

    def prepare_load(
        self,
        plan: LoadPlan,
        dst: Sequence[Any] | None,
        *,
        wait_event: Any = None,
    ) -> LoadHandle:
        """Copy the plan's ``load_pages`` pages into ``dst`` (one byte-viewable tensor
        per page, on the device). Pins them until ``complete_load``. ``wait_event``
        (R3): a CUDA event the engine recorded after its last read of ``dst``."""
        if not isinstance(plan, LoadPlan):
            raise TypeError(
                f"plan must be a LoadPlan (lookup(...).plan), not {type(plan).__name__}"
            )
        views = self._copies.destinations(dst, plan.load_pages)
        with self._lock:
            self._check_open()
            self._harvest()
            return self._loads.prepare(plan, views, wait_event)

    def complete_load(self, handle: LoadHandle) -> int:
        """Release the pins of a finished load; returns ``loaded_pages``. ValueError
        while copies are still in flight (``wait`` first): their slots stay pinned."""
        with self._lock:
            return self._loads.complete(handle)

    # -- offer -----------------------------------------------------------------

    def offer(
        self,
        keys: Sequence[object],
        srcs: Sequence[Any] | None,
        ctx: RequestContext | None = None,
        *,
        parents: Sequence[object | None] | None = None,
        meta: Mapping[str, Any] | None = None,
        event: Any = None,
        sizes: Sequence[int] | None = None,
    ) -> OfferResult:
        """Offer freshly computed pages. ``parents[i]`` is keys[i]'s parent (default:
        the previous key, the first one a root; ``meta["parent"]`` gives the first
        key's parent). ``event`` (R1): a CUDA event recorded on the producer's stream
        after the pages were written. The copies run asynchronously;
        ``hbm_release`` says when ``srcs`` may be reused. Declines (everything
        pinned, below τ, an orphan) are in the result: nothing raises into the engine
        for a full tier. ``sizes``: page sizes when ``srcs`` is None (fake mover)."""
        ctx = _check_ctx(ctx)
        count = len(keys)
        key_bytes = [k if type(k) is bytes else page_key(k) for k in keys]
        for i, key in enumerate(key_bytes):
            try:
                store_key(key)  # what the NVMe store keeps: 1..511 bytes
            except ValueError as e:
                raise ValueError(f"keys[{i}]: {e}") from None
        if parents is not None and len(parents) != count:
            raise ValueError(f"{count} keys but {len(parents)} parents")
        first_parent: bytes | None = None
        if meta is not None and meta.get("parent") is not None:
            first_parent = page_key(meta["parent"])
        parent_keys: list[bytes | None] = (
            [None if p is None else page_key(p) for p in parents]
            if parents is not None
            else [first_parent, *key_bytes[:-1]]
        )
        views, nbytes = self._copies.sources(srcs, sizes, count, self.config.page_bytes)
        for i, size in enumerate(nbytes):
            if size <= 0 or size > self.config.page_bytes:
                raise ValueError(
                    f"page {i} is {size} bytes; pages are 1..page_bytes="
                    f"{self.config.page_bytes} bytes"
                )
        with self._lock:
            self._check_open()
            self._harvest()
            return self._place.offer(key_bytes, parent_keys, views, nbytes, ctx, event)

    def notify_hbm_evicted(self, keys: Iterable[object]) -> None:
        """``hbm="engine"``: the engine dropped these blocks from its GPU cache."""
        with self._lock:
            self._check_open()
            for raw in keys:
                rec = self._pages.get(page_key(raw))
                if rec is not None and rec.in_tier(HBM):
                    self._state.clear_tier(rec, HBM)
                    self._state.forget_if_gone(rec)

    def prefetch(self, keys: Sequence[object], ctx: RequestContext | None = None) -> int:
        """At enqueue time: start NVMe -> DRAM reads of the resident prefix's NVMe-only
        pages. Returns how many reads were started."""
        _check_ctx(ctx)
        with self._lock:
            self._check_open()
            self._harvest()
            return self._loads.prefetch(keys)

    def finish_request(self, ctx: RequestContext) -> None:
        """The request is done (counted). Its pages keep the SLO deficit they were
        stamped with at their last access: Φ's w4 term ranks late requests' pages
        first, and a later access restamps them."""
        ctx = _check_ctx(ctx)
        with self._lock:
            self._check_open()
            if not ctx.request_id:
                return
            self._bump("requests:finished")

    def observe_prefill(self, tokens: int, context: int, seconds: float) -> None:
        """The engine measured a prefill of ``tokens`` after ``context`` cached ones."""
        check_count("observe_prefill: tokens", tokens, low=1)
        check_count("observe_prefill: context", context, low=0)
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, int | float)
            or not (seconds > 0 and math.isfinite(seconds))
        ):
            raise ValueError(f"observe_prefill needs seconds finite and > 0, got {seconds!r}")
        flops = self.config.model.prefill_flops(tokens, context)
        if not (math.isfinite(flops) and math.isfinite(flops / seconds) and flops / seconds > 0):
            raise ValueError(
                f"observe_prefill: {tokens} tokens in {seconds!r} s is no finite compute rate"
            )
        with self._lock:
            self._check_open()
            self._compute.observe(flops, seconds)
            self._value.invalidate()

    # -- pins and retains ------------------------------------------------------

    def pin(self, keys: Iterable[object]) -> list[bool]:
        """Keep pages where they are (never victims); False for a page not resident."""
        with self._lock:
            self._check_open()
            out = []
            for raw in keys:
                rec = self._pages.get(page_key(raw))
                if rec is None or not rec.tiers:
                    out.append(False)
                    continue
                rec.pins += 1
                out.append(True)
            return out

    def unpin(self, keys: Iterable[object]) -> None:
        with self._lock:
            self._check_open()
            for raw in keys:
                rec = self._pages.get(page_key(raw))
                if rec is None or rec.pins == 0:
                    raise ValueError(f"page {raw!r} is not pinned")
                rec.pins -= 1
                self._state.forget_if_gone(rec)  # its last copy may have failed while pinned

    def retain(self, keys: Iterable[object]) -> list[bool]:
        """Freeze pages: admitted past τ, written to NVMe and retained there."""
        with self._lock:
            self._check_open()
            out = []
            for raw in keys:
                rec = self._pages.get(page_key(raw))
                if rec is None or not rec.tiers:
                    out.append(False)
                    continue
                rec.retained = True
                if rec.in_tier(NVME):
                    self._nvme.retain(rec.key)
                elif rec.in_tier(DRAM) and rec.state is _READY and self._nvme.enabled:
                    self._evict.write_back([rec], demote=False)
                out.append(True)
            return out

    def release(self, keys: Iterable[object]) -> None:
        with self._lock:
            self._check_open()
            for raw in keys:
                rec = self._pages.get(page_key(raw))
                if rec is None or not rec.retained:
                    continue
                rec.retained = False
                if rec.in_tier(NVME):
                    self._nvme.release(rec.key)

    # -- the control loop -----------------------------------------------------

    def step(self) -> None:
        """One control cycle: completions, τ, watermarks and batch eviction, the
        emergency check, DRAM warming, a statistics save when due."""
        snapshot = None
        with self._lock:
            if self._closed:
                return
            self._harvest()
            now = self._now()
            self._evict.check_emergency()
            usage = self._state.usage()
            if self._value.tau.update(
                now,
                usage,
                self.config.watermark_warn,
                self.config.watermark_low,
                self._evict.write_over_budget(now),
            ):
                self._value.admit_epoch += 1
            self._evict.cycle(now, usage)
            self._place.serve_waiting()
            if self._remote is not None:
                self._remote.step()
            self._loads.retry_fetches()
            self._loads.warm_step()
            self._update_gates()
            self._measure.explore(now)
            if (
                self._stats_path is not None
                and self.config.persist_stats_s > 0
                and now - self._last_persist >= self.config.persist_stats_s
            ):
                self._last_persist = now
                snapshot = self._stats_snapshot()
        if snapshot is not None:
            self._write_stats(snapshot)

    def _control_loop(self) -> None:
        lock = self._lock
        lock.control = threading.get_ident()
        base = self.config.control_interval_s
        ceiling = max(base, _IDLE_MAX_S)
        wait, quiet = base, 0
        while True:
            if wait > base:
                lock.wake.wait(wait)  # set by a call, or by close
                lock.wake.clear()
                if self._stop.is_set():
                    return
            elif self._stop.wait(base):
                return
            try:
                calls = lock.calls
                self.step()
                with lock.own():
                    if lock.calls == calls and self._nothing_in_flight():
                        quiet += 1
                        if quiet >= _QUIET_STEPS:
                            wait = min(2 * wait, ceiling)
                            lock.idle = True  # under the lock: a call after this wakes us
                    else:
                        quiet, wait = 0, base
                        lock.idle = False
            except Exception as e:  # the loop must outlive one bad cycle
                self._bump("control:errors")
                self._last_error = repr(e)
                quiet, wait = 0, base

    def _nothing_in_flight(self) -> bool:
        """No copy, read or write in flight in the mover, no remote call outstanding."""
        if self._mover.in_flight_bytes():
            return False
        return self._remote is None or not self._remote.busy()

    def _pump(self) -> None:
        """What a waiting caller does: run a cycle, or let the control thread run."""
        if self._thread is None:
            self.step()
            self._mover.idle()  # a virtual clock jumps to the next completion
        else:
            # Harvest here too: a copy that landed settles its handle now, not at the
            # control thread's next cycle (up to control_interval_s later).
            with self._lock:
                harvested = 0 if self._closed else self._harvest()
            if not harvested:
                # Woken by the next completion (a 0.2 ms backstop). Not the since= form:
                # a completion the control thread polled first would stall it 2 ms.
                self._mover.wait_completed(0.0002)

    def drain(self, timeout_s: float = 60.0) -> bool:
        """Wait until nothing is in flight, every completion is harvested and no offered
        page waits for a DRAM slot (tests, benchmarks, close)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                # In flight before the harvest: a ticket that lands between the harvest
                # and the check would otherwise be left unharvested.
                busy = self._mover.in_flight_bytes() > 0 or bool(
                    self._remote and self._remote.busy()
                )
                self._harvest()
                # Offered pages waiting for a DRAM slot: placed, or declined once
                # nothing is left in flight to free one.
                self._place.serve_waiting()
                busy = busy or self._mover.in_flight_bytes() > 0
            if not busy:
                return True
            if time.monotonic() > deadline:
                return False
            self._pump()

    # -- statistics, explain ------------------------------------------------------

    def stats(self) -> TierStats:
        with self._lock:
            kappa = tuple(self.cost.kappa(t, self.config.page_bytes) for t in range(3))
            gate = self._value.payoff
            rule = self._value.displacement
            return TierStats(
                pages=len(self._pages),
                used_bytes=(self._state.used[0], self._state.used[1], self._state.used[2]),
                capacity_bytes=(self._capacity[0], self._capacity[1], self._capacity[2]),
                pages_by_tier=(self._state.count[0], self._state.count[1], self._state.count[2]),
                hits_by_tier=(self._loads.hits[0], self._loads.hits[1], self._loads.hits[2]),
                misses=self._loads.misses,
                lookups=self._loads.lookups,
                admissions=self._state.prefixed("admission:"),
                evictions=self._state.prefixed("evict:"),
                demotions=self._counters.get("demotions", 0),
                promotions=self._counters.get("promotions", 0),
                hysteresis_blocks=self._counters.get("hysteresis", 0),
                thrash=self._counters.get("thrash", 0),
                recompute_decisions=self._state.prefixed("recompute:"),
                emergency_evictions=self._counters.get("emergency_evictions", 0),
                emergency=self._evict.emergency,
                tau=(self._tau.tau[0], self._tau.tau[1], self._tau.tau[2]),
                kappa=(kappa[0], kappa[1], kappa[2]),
                bandwidth_bytes_per_s={p: b.rate for p, b in self._bandwidth.items()},
                latency_s={p: b.latency_s for p, b in self._bandwidth.items()},
                compute_flops=self._compute.flops_per_s,
                in_flight_bytes={p.value: self._mover.in_flight_bytes(p) for p in Path},
                nvme_bytes_written=self._evict.nvme_written[1],
                nvme_pages_written=self._evict.nvme_written[0],
                load_failures=self._counters.get("load_failures", 0),
                load_failure_reasons=self._state.prefixed("load_failure:"),
                offload_latency_s=self._latency.snapshot(),
                page_table_bytes=self._state.page_table_bytes(),
                mover=type(self._mover).__name__,
                placement=self.config.placement,
                admission=self.config.admission,
                eviction=self.config.eviction,
                in_use=(
                    True,
                    bool(self._capacity[DRAM]) and kappa[DRAM] >= 1.0,
                    bool(self._capacity[NVME]) and kappa[NVME] >= 1.0,
                ),
                remote=self._remote.summary() if self._remote is not None else None,
                nvme_write_gate=None if gate is None else (gate.open[0], gate.open[1]),
                nvme_displacement=None if rule is None else rule.summary(),
            )

    def metrics_registry(self) -> Any:
        """A Prometheus registry with the tier metrics (docs/tiering.md)."""
        from kvstore.tiering.metrics import registry_for

        return registry_for(self.stats)

    def explain(self, key: object) -> str:
        """The numbers behind the manager's view of one page, in words."""
        with self._lock:
            raw = page_key(key)
            rec = self._pages.get(raw)
            if rec is None:
                seen = self._reuse.seen(raw)
                return f"page {raw!r}: not resident (seen {seen} time(s) recently)"
            return self._value.explain(rec, self._now(), self._capacity, self._bandwidth)

    # -- completions ---------------------------------------------------------------

    def _harvest(self) -> int:
        """Process completed tickets (R6: before any eviction decision); how many."""
        tickets = self._mover.poll()
        now = self._now() if tickets else 0.0
        done = 0 if self._remote is None else self._remote.harvest(self._now())
        for ticket in tickets:
            tag = ticket.tag
            if tag is None:
                continue  # not the manager's
            seconds = ticket.seconds()
            if seconds is not None and ticket.error is None and ticket.moved_bytes > 0:
                fit = self._bandwidth[ticket.path.value]
                before = (fit.rate, fit.latency_s)
                fit.observe(ticket.moved_bytes, seconds, now)
                moved = abs(fit.rate - before[0]) > 0.01 * before[0] or abs(
                    fit.latency_s - before[1]
                ) > 0.01 * max(before[1], 1e-9)
                if moved:
                    self._value.invalidate()
                self._latency.observe(ticket.path, seconds)
            try:
                self._complete(ticket, tag)
            except Exception as e:  # the other tickets of this poll must still land
                self._bump("completion:errors")
                self._last_error = f"completion of {type(tag).__name__}: {e!r}"
                if isinstance(tag, Probe):
                    self._measure.probe_failed(tag)
        return len(tickets) + done

    def _complete(self, ticket: Ticket, tag: object) -> None:
        if isinstance(tag, OfferCopy):
            self._place.offer_done(ticket, tag.recs, tag.tier)
            if self._remote is not None and tag.tier == DRAM and ticket.error is None:
                self._remote.offered(tag.recs)
        elif isinstance(tag, Demotion):
            self._evict.demote_done(ticket, tag.recs, tag.keep)
        elif isinstance(tag, WriteBack):
            self._evict.write_done(ticket, tag.recs, tag.demote)
        elif isinstance(tag, Read):
            self._loads.read_done(ticket, tag.recs)
        elif isinstance(tag, Load):
            self._loads.load_done(ticket, tag.handle, tag.items)
        elif isinstance(tag, Probe):
            self._measure.probe_done(ticket, tag.path, tag.rate_before)

    def _snapshot(self) -> dict[str, Any]:
        snapshot = self._restart.snapshot()
        if self._remote is not None:
            snapshot["summary"]["remote"] = self._remote.summary()
        if self._value.displacement is not None:
            # Shown by `kvstore tier stat`, never applied at open (the rule restarts off).
            snapshot["summary"]["nvme_displacement"] = self._value.displacement.summary()
        return snapshot

    def _update_gates(self) -> None:
        if self._measure.update_gates():
            self._value.admit_epoch += 1  # cached NVMe admissions were decided under the old κ


def _check_ctx(ctx: object) -> RequestContext:
    """``ctx`` or the empty context (its fields are checked when it is made)."""
    if ctx is None:
        return _NO_CONTEXT
    if not isinstance(ctx, RequestContext):
        raise TypeError(f"ctx must be a RequestContext, not {type(ctx).__name__}")
    return ctx

"""``TierManager``: places KV pages across HBM (0), DRAM (1) and NVMe (2).

The engine-facing API of docs/tiering.md ("API"; the rules R1-R7 cited here are its
"The mover and the ordering rules"). No call waits for I/O on the caller's thread:
copies and NVMe reads/writes are tickets on the mover; their completions
are harvested (rule R6: before any eviction decision) by ``step``, which the control
thread runs every ``control_interval_s`` (or the caller, with 0: the simulator).

Lock plan: one lock (``_lock``, reentrant) guards every ``PageRec``, the orders,
the arenas' slot ownership and the counters. Mover threads never take it; they only
complete tickets. Store calls made under it are the non-blocking ones (``delete``:
a WAL append); reads and writes run on the mover's I/O thread.

Page state machine (rule R4): a slot is written only while its page is WRITING or
LOADING and read only while READY or EVICTING; a pinned page (a load in progress,
or ``pin``) is never a victim and its slots are never reused. NVMe bytes are verified
by the store on every read (R5): a failed read drops the page, never serves it.
"""

from __future__ import annotations

import contextlib
import json
import math
import operator
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path as FsPath
from typing import Any, NamedTuple

from kvstore.errors import ClosedError, IOFailure, KVStoreError
from kvstore.inputs import key_bytes as store_key
from kvstore.log.regular import read_regular
from kvstore.tiering.arena import Arena, SlotPool, VirtualSlots
from kvstore.tiering.completions import Demotion, Load, OfferCopy, Probe, Read, WriteBack
from kvstore.tiering.config import TierConfig
from kvstore.tiering.cost import (
    LOAD_PATHS,
    Bandwidth,
    Compute,
    CostModel,
    class_priors,
    make_bandwidths,
)
from kvstore.tiering.measure import Measurements
from kvstore.tiering.mover import FakeMover, Mover, Path, Priority, Ticket, VirtualClock, make_mover
from kvstore.tiering.pages import BIT, DRAM, HBM, NVME, TIER_NAMES, PageRec, PageState, page_key
from kvstore.tiering.policy import (
    Admission,
    EvictionOrder,
    ReuseEstimator,
    TauController,
    make_order,
)
from kvstore.tiering.results import (
    UNBOUNDED_BYTES,
    LoadHandle,
    LoadPlan,
    LookupResult,
    LookupState,
    OfferResult,
    ReleaseHandle,
    RequestContext,
    TierStats,
    check_count,
)
from kvstore.tiering.state import TierState
from kvstore.tiering.statsfile import (
    STATS_FILE,
    STATS_VERSION,
    parse_for_manager,
    snapshot,
    write_stats_file,
)

__all__ = ["STATS_FILE", "STATS_VERSION", "TierManager"]


META_TAG = "kvt"  # marks an NVMe page written by the tier manager (value: format 1)
OFFLOAD_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5)
_HEAT_PAGES = 100_000  # pages whose heat is persisted (the hottest)
_BATCH = 64  # pages per eviction batch at most
# The DRAM clean reserve's growth per allocation that found none, its ceiling, and
# the time constant of its decay back to 1 - watermark_low (chosen by `kvstore sim`).
_RESERVE_STEP = 0.1
_RESERVE_MAX = 0.5
_RESERVE_DECAY_S = 1200.0
# The clean reserve covers twice the largest offer seen (each page of a burst may
# need a DRAM slot for itself and one for the HBM page it displaces), up to this
# share of DRAM: a DRAM of a few bursts is otherwise full of dirty pages when the
# next burst comes, and declines it.
_RESERVE_BURST_MAX = 0.75
_WARM_BATCH = 16
_WARMUP_SAMPLES = 2  # a real mover's first samples per path, discarded
_DEMAND_WAIT_S = 1.0  # a demand read waits this long for a DRAM slot, then fails
_NO_CONTEXT = RequestContext()
_TOP_TIER = (-1, 0, 1, 0, 2, 0, 1, 0)  # PageRec.top_tier(), indexed by the tier bits
# Enum members as module constants: in the hot paths an enum attribute read costs
# 0.1-0.2 us each (Python 3.11), as much as the rest of a line.
_READY, _WRITING, _LOADING, _EVICTING = (
    PageState.READY,
    PageState.WRITING,
    PageState.LOADING,
    PageState.EVICTING,
)
_D2D, _D2H, _H2D, _NVME_WRITE = Path.D2D, Path.D2H, Path.H2D, Path.NVME_WRITE
_DEMAND, _WRITEBACK, _PREFETCH, _BACKGROUND = (
    Priority.DEMAND,
    Priority.WRITEBACK,
    Priority.PREFETCH,
    Priority.BACKGROUND,
)


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
        self._lock = threading.RLock()
        self._closed = False
        self._fake = config.mover == "fake"
        slot = _slot_bytes(config.page_bytes)
        priors, flops_prior = class_priors(config.device_class)
        self._priors = priors
        # A real mover's first copies of each path are cold (page faults, thread
        # start): discarded. The fake mover's timings are exact.
        self._bandwidth: dict[str, Bandwidth] = make_bandwidths(
            config.bandwidth_bytes_per_s,
            config.latency_s,
            priors=priors,
            warmup=0 if self._fake else _WARMUP_SAMPLES,
        )
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
        self._mover: Mover
        self.clock: VirtualClock | None = None
        if self._fake:
            self.clock = VirtualClock()
            if config.clock is not None:
                self.clock.set(config.clock())
            self._mover = FakeMover(
                {Path(p): b.rate for p, b in self._bandwidth.items()},
                {Path(p): b.latency_s for p, b in self._bandwidth.items()},
                self.clock,
            )
        else:
            self._mover = make_mover(config.mover, config.device)
        self._now: Callable[[], float] = self._mover.now
        owned_hbm = config.hbm == "owned" and config.hbm_bytes >= slot
        self._owned_hbm = owned_hbm
        # The tiers the manager can read a page from: with hbm="engine" the HBM bit is
        # the engine's residency, not a copy the manager can load or keep as a backup.
        self._readable_mask = 7 if owned_hbm else 6
        self._above_nvme_mask = 5 if owned_hbm else 4  # a DRAM page's readable other copies
        # No owned HBM: a pool of no slots (every HBM call site runs only with owned HBM).
        self._hbm: SlotPool = VirtualSlots(0, slot)
        self._dram: SlotPool
        if self._fake:
            if owned_hbm:
                self._hbm = VirtualSlots(config.hbm_bytes // slot, slot)
            self._dram = VirtualSlots(config.dram_bytes // slot, slot)
        else:
            if owned_hbm:
                self._hbm = Arena(config.hbm_bytes, slot, config.device, name="hbm")
            pin = config.device.startswith("cuda")
            self._dram = Arena(config.dram_bytes, slot, "cpu", pin=pin, name="dram")
        self._slot_bytes = slot
        self._store: Any = None
        self._stats_path: FsPath | None = None
        nvme_capacity: int | None = config.nvme_bytes
        if config.nvme_path is not None:
            from kvstore.store import KVStore

            options: dict[str, Any] = {"create": True, "max_page_bytes": slot}
            options.update(config.nvme_options)
            self._store = KVStore.open(config.nvme_path, **options)
            store_max = self._store.config.max_page_bytes
            if store_max < config.page_bytes:
                self._store.close()
                raise ValueError(
                    f"the NVMe store at {config.nvme_path} takes pages of at most "
                    f"{store_max} bytes (max_page_bytes), less than page_bytes="
                    f"{config.page_bytes}: every write-back would fail"
                )
            self._stats_path = FsPath(config.nvme_path) / STATS_FILE
            if nvme_capacity is None:
                nvme_capacity = self._store.config.capacity_bytes
        self._nvme_enabled = self._store is not None or (self._fake and bool(config.nvme_bytes))
        self._capacity = [
            self._hbm.capacity_bytes,
            self._dram.capacity_bytes,
            (nvme_capacity if nvme_capacity is not None else UNBOUNDED_BYTES)
            if self._nvme_enabled
            else 0,
        ]
        if config.hbm == "engine":
            self._capacity[HBM] = config.hbm_bytes
        self._used = [0, 0, 0]  # bytes (slots x slot size for HBM/DRAM)
        self._leaving = [0, 0, 0]  # of which: demotions out of the tier in flight
        # The share of DRAM kept clean: 1 - watermark_low, more while allocations find
        # no clean page (write-heavy traffic), decaying back when they stop.
        self._dram_reserve = 1.0 - config.watermark_low
        self._burst_pages = 0  # the most pages one offer brought (the reserve's floor)
        self._reserve_at = 0.0
        # DRAM pages that also have their NVMe copy (free at once), ranked like DRAM's
        # order: an allocation under pressure takes the lowest (leaving DRAM makes no
        # hole in a prefix while the NVMe copy stays).
        self._clean_dram: EvictionOrder = make_order(
            config.eviction, config.phi_weights, config.recency_scale_s, self._cost_ratio
        )
        # HBM pages that also have their DRAM copy (owned HBM): the same idea one tier up.
        self._clean_hbm: EvictionOrder = make_order(
            config.eviction, config.phi_weights, config.recency_scale_s, self._cost_ratio
        )
        self._nvme_reserved = 0  # bytes of NVMe writes in flight (room taken)
        self._batch_write_bytes = 0  # write-back chosen in this eviction batch, not queued yet
        self._count = [0, 0, 0]
        self._pages: dict[bytes, PageRec] = {}
        weights = config.phi_weights
        self._orders: list[EvictionOrder] = [
            make_order(config.eviction, weights, config.recency_scale_s, self._cost_ratio)
            for _ in range(3)
        ]
        self._orders_track_touches = config.eviction == "arc"
        # The page state and its transitions (kvstore/tiering/state.py); its steps are
        # bound here once, as the hot paths call them by these names.
        self._tiers = TierState(
            pages=self._pages,
            orders=self._orders,
            clean_dram=self._clean_dram,
            clean_hbm=self._clean_hbm,
            count=self._count,
            used=self._used,
            leaving=self._leaving,
            hbm=self._hbm,
            dram=self._dram,
            owned_hbm=owned_hbm,
            slot_bytes=slot,
        )
        self._changed = self._tiers._changed
        self._set_tier = self._tiers._set_tier
        self._clear_tier = self._tiers._clear_tier
        self._child_created = self._tiers._child_created
        self._busy = self._tiers._busy
        self._settle = self._tiers._settle
        self._enter_order = self._tiers._enter_order
        self._leave = self._tiers._leave
        self._stay = self._tiers._stay
        self._tier_bytes = self._tiers._tier_bytes
        self._forget_if_gone = self._tiers._forget_if_gone
        mode, threshold = config.admission_mode
        self._reuse = ReuseEstimator(config.ghost_entries, config.reuse_prior)
        self._admission = Admission(mode, threshold, self._value_density)
        self._tau = TauController(config.tau_initial, pressure=config.tau_pressure)
        self._admit_epoch = 0  # bumped with every τ update: cached admissions expire
        self._cost_ratios: dict[int, float] = {}  # by depth; a ratio, so C_eff cancels
        self._base_recompute_per_byte = self.cost.recompute_s(config.tokens_per_page) / slot
        self._decay_per_s = math.log(2) / config.hit_half_life_s
        self._counters: dict[str, int] = {}
        # (compute rate, recompute s by depth, transfer s by tier); reset by the fits.
        self._vd_cache: tuple[float, dict[int, float], list[float]] | None = None
        self._latency: dict[str, list[float]] = {}
        self._hits = [0, 0, 0]
        self._misses = 0
        self._lookups = 0
        self._nvme_written = [0, 0]  # pages, bytes
        self._emergency = False
        self._emergency_offers = 0
        self._warm: deque[bytes] = deque()
        self._warm_in_flight = 0
        self._write_window: deque[tuple[float, int]] = deque()
        self._last_persist = self._now()
        self._loads: set[LoadHandle] = set()
        self._fetch_queue: deque[PageRec] = deque()  # demand reads waiting for a DRAM slot
        self._fetch_queue_since = 0.0  # when its head started waiting (or last moved)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._measure = Measurements(
            config,
            bandwidth=self._bandwidth,
            compute=self._compute,
            cost=self.cost,
            mover=self._mover,
            store=self._store,
            nvme_order=self._orders[NVME],
            capacity=self._capacity,
            slot_bytes=slot,
            counters=self._counters,
            fake=self._fake,
        )
        self._stats_error: str | None = None
        self._last_error: str | None = None
        # Saves run outside the state lock (step and close): one at a time, or two
        # writers would share the temporary file.
        self._stats_write_lock = threading.Lock()
        try:
            if self._store is not None:
                self._rebuild_from_nvme()
                self._load_stats()
            if config.probe_at_open and not self._fake:
                self._measure.calibrate(r for r in self._pages.values() if r.tiers & 4)
                self._vd_cache = None
            self._update_gates()
        except BaseException:
            self._close_resources()
            raise
        if config.control_interval_s > 0 and not self._fake:
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
        if self._thread is not None:
            self._thread.join()
        # Completions may start copies (a waiting load, a write-through): let them run
        # while the mover is open, so the last harvest below starts nothing.
        self.drain()
        self._mover.close()
        with self._lock:
            self._harvest()
            for handle in list(self._loads):
                for index, result in enumerate(handle.results):
                    if result is None:
                        handle.settle(index, 0)
            snapshot = self._stats_snapshot() if self._stats_path is not None else None
        if snapshot is not None:
            self._write_stats(snapshot)
        self._measure.close()
        self._close_resources()

    def _close_resources(self) -> None:
        with contextlib.suppress(Exception):
            self._mover.close()
        if self._store is not None:
            self._store.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the tier manager is closed")

    @property
    def store(self) -> Any:
        """The NVMe tier's ``KVStore`` (None without ``nvme_path``)."""
        return self._store

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
            get = self._pages.get
            tag = ctx.tag
            readable = self._readable_mask
            hit_recs: list[PageRec] = []
            hit_append = hit_recs.append
            walked: list[bytes] = []  # the hit keys and the first miss: the reuse count's
            walked_append = walked.append
            now = self._now()
            for raw in keys:
                key = raw if type(raw) is bytes else page_key(raw)
                rec = get(key)
                walked_append(key)
                if rec is None or not rec.tiers & readable:
                    break
                hit_append(rec)
            # Per hit page, in C-speed passes rather than in the walk: its top tier, its
            # size, whether it is in flight (its wait adds to the plan's load time).
            tiers = [_TOP_TIER[rec.tiers & readable] for rec in hit_recs]
            sizes = [rec.nbytes for rec in hit_recs]
            by_tier = [tiers.count(0), tiers.count(1), tiers.count(2)]
            busy = [
                i
                for i, rec in enumerate(hit_recs)
                if rec.state is not _READY and rec.state is not _EVICTING
            ]
            extra: list[float] | None = None
            if busy:
                extra = [0.0] * len(hit_recs)
                for i in busy:
                    extra[i] = self._wait_estimate(hit_recs[i])
            # a page on NVMe only or in flight: the fetch check below
            maybe_pending = bool(busy) or by_tier[NVME] > 0
            self._reuse.access_lookup(walked, tag)
            # Leaves older than their parents at the same instant: chains go from the
            # tail. _touch, inlined: this runs once per hit page.
            if self._orders_track_touches or ctx.deadline_s is not None:
                for rec in reversed(hit_recs):
                    self._touch(rec, now, ctx)
            else:
                decay = self._decay_per_s
                exp = math.exp
                last_age, factor = -1.0, 1.0  # a prefix's pages mostly share one age
                for rec in reversed(hit_recs):
                    age = now - rec.last_access_s
                    if age > 0:
                        if age != last_age:
                            last_age, factor = age, exp(-decay * age)
                        rec.hits = rec.hits * factor + 1.0
                    else:
                        rec.hits = rec.hits + 1.0
                    rec.last_access_s = now
                    rec.reused = True
            total = tokens if tokens is not None else ctx.tokens
            if total is None:
                total = len(keys) * self.config.tokens_per_page
            hit = len(hit_recs)
            self._lookups += 1
            self._misses += len(keys) - hit
            for tier in range(3):
                self._hits[tier] += by_tier[tier]
            cost = self.cost.plan(tiers, sizes, total, extra_s=extra)
            load = cost.load_pages
            if hit == 0:
                reason = "no hit"
            elif load == 0:
                reason = "recompute is faster"
            elif load < hit:
                reason = "partial: recomputing the rest is faster"
            else:
                reason = "load"
            if load < hit:
                self._bump("recompute:" + ("no_hit" if hit == 0 else "faster"))
            state = LookupState.MISS if load == 0 else LookupState.READY
            if load and maybe_pending and self._stage(hit_recs, load):
                state = LookupState.PENDING
            plan = LoadPlan(tuple(walked[:hit]), tuple(tiers), load, cost, reason)
            return LookupResult(state, hit, (by_tier[0], by_tier[1], by_tier[2]), plan)

    def _stage(self, hit_recs: list[PageRec], load: int) -> bool:
        """Start NVMe -> DRAM reads of the plan's first ``load`` pages where DRAM has a
        slot; whether any of them is still on its way up (PENDING).

        The whole hit is protected while its reads take DRAM slots: a prefix's own
        reads never evict the prefix's DRAM pages (which answered PENDING for ever,
        each lookup's reads evicting what the last one staged). A page that finds no
        slot stays on NVMe and does not make the plan PENDING: ``prepare_load`` streams
        it through slots as they come free (its own copies landing, write-backs
        finishing); one that finds none within ``_DEMAND_WAIT_S`` is reported missing."""
        fast = self._readable_mask & 3  # copies the manager can read without NVMe
        for rec in hit_recs:
            rec.pins += 1
        try:
            nvme_only = [r for r in hit_recs[:load] if r.state is _READY and not r.tiers & fast]
            if nvme_only:
                self._fetch(nvme_only, _DEMAND)
        finally:
            for rec in hit_recs:
                rec.pins -= 1
        return any(rec.state is _LOADING or rec.state is _WRITING for rec in hit_recs[:load])

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
        count = plan.load_pages
        views: list[Any] = [None] * count
        if not self._fake:
            if dst is None or len(dst) < count:
                got = 0 if dst is None else len(dst)
                raise ValueError(f"the plan loads {count} pages but {got} destinations were given")
            views = [_byte_view(t, f"dst[{i}]") for i, t in enumerate(dst[:count])]
        with self._lock:
            self._check_open()
            self._harvest()
            records: list[PageRec | None] = [self._pages.get(k) for k in plan.keys[:count]]
            for index, rec in enumerate(records):
                view = views[index]
                if rec is not None and view is not None and view.numel() < rec.nbytes:
                    raise ValueError(
                        f"dst[{index}] holds {view.numel()} bytes, less than page "
                        f"{plan.keys[index]!r}'s {rec.nbytes}"
                    )
            handle = LoadHandle(plan, records, self._pump)
            self._loads.add(handle)
            direct: dict[Path, list[tuple[int, Any, Any]]] = {}
            waiting: list[int] = []
            readable = self._readable_mask
            for index, rec in enumerate(records):
                if rec is None or not rec.tiers & readable:
                    handle.settle(index, 0)
                    continue
                rec.pins += 1
                handle.pinned.add(index)
                source = self._readable_source(rec)
                if source is None:
                    waiting.append(index)
                else:
                    path, view = source
                    direct.setdefault(path, []).append((index, view, views[index]))
            for path, items in direct.items():
                self._copy_to_destination(handle, path, items, wait_event)
            nvme: list[PageRec] = []
            for index in waiting:
                rec = records[index]
                assert rec is not None
                self._add_waiter(rec, handle, index, views[index], wait_event)
                if rec.state is _READY:
                    nvme.append(rec)
            if nvme:
                self._fetch(nvme, _DEMAND)
                # No DRAM slot for the rest yet: they read as slots come free.
                queued = [r for r in nvme if r.state is _READY]
                if queued and not self._fetch_queue:
                    self._fetch_queue_since = self._now()
                self._fetch_queue.extend(queued)
            return handle

    def _unpin_load(self, handle: LoadHandle, index: int) -> None:
        if index in handle.pinned:
            handle.pinned.discard(index)
            rec = handle.records[index]
            if rec is not None and rec.pins > 0:
                rec.pins -= 1
                self._forget_if_gone(rec)

    def complete_load(self, handle: LoadHandle) -> int:
        """Release the pins of a finished load; returns ``loaded_pages``. ValueError
        while copies are still in flight (``wait`` first): their slots stay pinned."""
        with self._lock:
            if handle not in self._loads:
                return handle.loaded_pages
            if not handle.done():
                raise ValueError("the load is still in flight; call handle.wait() first")
            self._loads.discard(handle)
            for index in list(handle.pinned):
                self._unpin_load(handle, index)
            loaded = handle.loaded_pages
            self._bump("loads:pages", loaded)
            return loaded

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
        views: list[Any] = [None] * count
        if srcs is None:
            if not self._fake:
                raise ValueError("srcs is required (only the fake mover takes sizes alone)")
            nbytes = list(sizes) if sizes is not None else [self.config.page_bytes] * count
            if len(nbytes) != count:
                raise ValueError(f"{count} keys but {len(nbytes)} sizes")
        else:
            if len(srcs) != count:
                raise ValueError(f"{count} keys but {len(srcs)} sources")
            views = [_byte_view(s, f"srcs[{i}]") for i, s in enumerate(srcs)]
            nbytes = [int(v.numel()) for v in views]
        for i, size in enumerate(nbytes):
            if size <= 0 or size > self.config.page_bytes:
                raise ValueError(
                    f"page {i} is {size} bytes; pages are 1..page_bytes="
                    f"{self.config.page_bytes} bytes"
                )
        tiers_out: list[int | None] = [None] * count
        reasons = ["declined"] * count
        with self._lock:
            self._check_open()
            self._harvest()
            if count > self._burst_pages:
                self._burst_pages = count
            now = self._now()
            pages = self._pages
            placed: set[bytes] = set()
            declined: set[bytes] = set()
            copies: dict[Path, list[tuple[PageRec, Any, Any, int]]] = {}
            engine_hbm = self.config.hbm == "engine"
            touched: list[PageRec] = []
            tag = ctx.tag
            reuse_access = self._reuse.access_offer
            tokens_per_page = self.config.tokens_per_page
            first_at: dict[bytes, int] = {}
            for i in range(count):
                key = key_bytes[i]
                first = first_at.setdefault(key, i)
                if first != i:
                    # A key repeated in one offer is one page: the first decides.
                    tiers_out[i] = tiers_out[first]
                    reasons[i] = f"duplicate of keys[{first}]"
                    continue
                parent = parent_keys[i]
                rec = pages.get(key)
                parent_rec = pages.get(parent) if parent is not None else None
                # _reuse_access, inlined: the depth the page has or would have
                if rec is not None:
                    seen, counted = reuse_access(key, rec.depth, tag)
                    if seen > 1:
                        rec.reused = True
                else:
                    depth = parent_rec.depth + 1 if parent_rec is not None else 0
                    seen, counted = reuse_access(key, depth, tag)
                if rec is not None and rec.tiers:
                    if counted:
                        touched.append(rec)
                    if engine_hbm and not rec.in_tier(HBM):
                        self._set_tier(rec, HBM)
                    elif (
                        self._owned_hbm
                        and not rec.tiers & 1
                        and rec.state is _READY
                        and nbytes[i] == rec.nbytes
                    ):
                        # The engine holds it in HBM again (it loaded or recomputed
                        # it): keep that copy too, as its GPU prefix cache would.
                        slot = self._alloc(HBM)
                        if slot is not None:
                            rec.hbm_slot = slot
                            copies.setdefault(_D2D, []).append((rec, views[i], None, HBM))
                            self._bump("promotions:hbm")
                    tiers_out[i] = rec.top_tier()
                    reasons[i] = "present"
                    placed.add(key)
                    continue
                if parent is not None and parent in declined:
                    reasons[i] = "parent declined"
                    declined.add(key)
                    continue
                if (
                    parent is not None
                    and parent not in placed
                    and (parent_rec is None or not parent_rec.tiers)
                ):
                    reasons[i] = "orphan: parent not resident"
                    declined.add(key)
                    self._bump("admission:orphan")
                    continue
                if self._emergency and self._ramp_drop():
                    reasons[i] = "emergency: NVMe write queue saturated"
                    declined.add(key)
                    continue
                depth = parent_rec.depth + 1 if parent_rec is not None else 0
                if rec is None:
                    rec = PageRec(key, parent, depth, tokens_per_page, nbytes[i], now)
                    rec.tag = tag
                    pages[key] = rec
                    if parent_rec is not None:
                        if parent_rec.children == 1:
                            self._child_created(parent_rec)
                        else:
                            parent_rec.children += 1  # _child_created: no branch yet
                else:
                    rec.nbytes = nbytes[i]
                    rec.cost_ratio = -1.0
                rec.deadline_s = ctx.deadline_s
                rec.last_access_s = now
                tier, reason = self._place_new(rec, seen)
                reasons[i] = reason
                if tier is None:
                    declined.add(key)
                    self._forget_if_gone(rec)
                    continue
                tiers_out[i] = HBM if engine_hbm else tier
                placed.add(key)
                if engine_hbm:
                    self._set_tier(rec, HBM)
                if tier == HBM:
                    copies.setdefault(_D2D, []).append((rec, views[i], None, HBM))
                elif tier == DRAM:
                    copies.setdefault(_D2H, []).append((rec, views[i], None, DRAM))
            tickets = [self._submit_offer_copy(p, items, event) for p, items in copies.items()]
            for rec in reversed(touched):  # the prefix after its new tail: newest of all
                self._touch(rec, now, ctx)
            release = self._release_handle(tickets)
            return OfferResult(tuple(tiers_out), tuple(reasons), release)

    def notify_hbm_evicted(self, keys: Iterable[object]) -> None:
        """``hbm="engine"``: the engine dropped these blocks from its GPU cache."""
        with self._lock:
            self._check_open()
            for raw in keys:
                rec = self._pages.get(page_key(raw))
                if rec is not None and rec.in_tier(HBM):
                    self._clear_tier(rec, HBM)
                    self._forget_if_gone(rec)

    def prefetch(self, keys: Sequence[object], ctx: RequestContext | None = None) -> int:
        """At enqueue time: start NVMe -> DRAM reads of the resident prefix's NVMe-only
        pages. Returns how many reads were started."""
        _check_ctx(ctx)
        with self._lock:
            self._check_open()
            self._harvest()
            wanted = []
            for raw in keys:
                rec = self._pages.get(page_key(raw))
                if rec is None or not rec.tiers & self._readable_mask:
                    break
                if _TOP_TIER[rec.tiers & self._readable_mask] == NVME and rec.state is _READY:
                    wanted.append(rec)
            return self._fetch(wanted, _PREFETCH)

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
            self._vd_cache = None

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
                self._forget_if_gone(rec)  # its last copy may have failed while pinned

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
                if self._store is not None and rec.in_tier(NVME):
                    self._store.retain(rec.key)
                elif rec.in_tier(DRAM) and rec.state is _READY and self._nvme_enabled:
                    self._write_back([rec], demote=False)
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
                if self._store is not None and rec.in_tier(NVME):
                    with contextlib.suppress(KVStoreError):
                        self._store.release(rec.key)

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
            self._check_emergency()
            usage = self._usage()
            if self._tau.update(
                now,
                usage,
                self.config.watermark_warn,
                self.config.watermark_low,
                self._write_over_budget(now),
            ):
                self._admit_epoch += 1
            # Batch eviction only where a slot cannot be freed at once: a tier with
            # clean pages (a copy below) frees one the moment it is wanted, and NVMe
            # frees on allocation (a delete). See docs/tiering.md, "Eviction".
            for tier, clean_list in ((HBM, self._clean_hbm), (DRAM, self._clean_dram)):
                if (tier == HBM and not self._owned_hbm) or len(clean_list):
                    continue
                if usage[tier] >= self.config.watermark_warn:
                    force = usage[tier] >= self.config.watermark_force
                    self._evict_to(tier, self.config.watermark_low, force=force)
            if self._owned_hbm and usage[HBM] >= self.config.watermark_low:
                self._predemote()
            base = 1.0 - self.config.watermark_low
            if self._dram_reserve > base:
                decay = math.exp(-max(now - self._reserve_at, 0.0) / _RESERVE_DECAY_S)
                self._dram_reserve = base + (self._dram_reserve - base) * decay
            if self._burst_pages and self._capacity[DRAM]:
                burst = 2 * self._burst_pages * self._slot_bytes / self._capacity[DRAM]
                self._dram_reserve = max(self._dram_reserve, min(burst, _RESERVE_BURST_MAX))
            self._reserve_at = now
            if usage[DRAM] >= 1.0 - self._dram_reserve:
                self._preclean()
            self._retry_fetches()
            self._warm_step()
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
        interval = self.config.control_interval_s
        while not self._stop.wait(interval):
            try:
                self.step()
            except Exception as e:  # the loop must outlive one bad cycle
                self._bump("control:errors")
                self._last_error = repr(e)

    def _pump(self) -> None:
        """What a waiting caller does: run a cycle, or let the control thread run."""
        if self._thread is None:
            self.step()
            if self._fake and self.clock is not None:
                next_s = self._mover.next_completion_s()  # type: ignore[attr-defined]
                if next_s is not None and next_s > self.clock.now():
                    self.clock.set(next_s)
            else:
                time.sleep(0.0002)
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
        """Wait until nothing is in flight and every completion is harvested (tests,
        benchmarks, close)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                # In flight before the harvest: a ticket that lands between the harvest
                # and the check would otherwise be left unharvested.
                busy = self._mover.in_flight_bytes() > 0
                self._harvest()
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
            return TierStats(
                pages=len(self._pages),
                used_bytes=(self._used[0], self._used[1], self._used[2]),
                capacity_bytes=(self._capacity[0], self._capacity[1], self._capacity[2]),
                pages_by_tier=(self._count[0], self._count[1], self._count[2]),
                hits_by_tier=(self._hits[0], self._hits[1], self._hits[2]),
                misses=self._misses,
                lookups=self._lookups,
                admissions=self._prefixed("admission:"),
                evictions=self._prefixed("evict:"),
                demotions=self._counters.get("demotions", 0),
                promotions=self._counters.get("promotions", 0),
                hysteresis_blocks=self._counters.get("hysteresis", 0),
                thrash=self._counters.get("thrash", 0),
                recompute_decisions=self._prefixed("recompute:"),
                emergency_evictions=self._counters.get("emergency_evictions", 0),
                emergency=self._emergency,
                tau=(self._tau.tau[0], self._tau.tau[1], self._tau.tau[2]),
                kappa=(kappa[0], kappa[1], kappa[2]),
                bandwidth_bytes_per_s={p: b.rate for p, b in self._bandwidth.items()},
                latency_s={p: b.latency_s for p, b in self._bandwidth.items()},
                compute_flops=self._compute.flops_per_s,
                in_flight_bytes={p.value: self._mover.in_flight_bytes(p) for p in Path},
                nvme_bytes_written=self._nvme_written[1],
                nvme_pages_written=self._nvme_written[0],
                load_failures=self._counters.get("load_failures", 0),
                load_failure_reasons=self._prefixed("load_failure:"),
                offload_latency_s={
                    k: (OFFLOAD_BUCKETS_S, tuple(int(c) for c in v[:-2]), v[-2], int(v[-1]))
                    for k, v in self._latency.items()
                },
                page_table_bytes=self._page_table_bytes(),
                mover=type(self._mover).__name__,
                placement=self.config.placement,
                admission=self.config.admission,
                eviction=self.config.eviction,
                in_use=(
                    True,
                    bool(self._capacity[DRAM]) and kappa[DRAM] >= 1.0,
                    bool(self._capacity[NVME]) and kappa[NVME] >= 1.0,
                ),
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
            now = self._now()
            lines = [repr(rec)]
            p = self._reuse.p(rec.depth, rec.reused, rec.tag)
            rec_s = self.cost.recompute_s(rec.tokens, rec.depth * rec.tokens)
            lines.append(
                f"  depth {rec.depth}, {rec.tokens} tokens, {rec.nbytes} bytes; "
                f"recompute {rec_s * 1e3:.3f} ms; p(reuse) {p:.3f} "
                f"(class depth~{rec.depth}, reused={rec.reused}, tag={rec.tag!r})"
            )
            for tier in range(3):
                xfer = self.cost.transfer_s(tier, rec.nbytes)
                vd = self._value_density(rec, tier)
                kappa = rec_s / xfer if xfer > 0 else math.inf
                admits = self._admission.admit(rec, tier, 0, self._tau.tau[tier])
                lines.append(
                    f"  {TIER_NAMES[tier]:>4}: load {xfer * 1e3:.3f} ms, kappa {kappa:.2f}, "
                    f"VD {vd:.3e} s/B vs tau {self._tau.tau[tier]:.3e} -> "
                    f"{'admit' if admits else 'decline'}"
                    f"{'  (resident)' if rec.in_tier(tier) else ''}"
                )
                tier_kappa = self.cost.kappa(tier, self.config.page_bytes)
                if tier and self._capacity[tier] and tier_kappa < 1.0:
                    paths = ", ".join(
                        f"{p} {self._bandwidth[p].rate / 1e6:.1f} MB/s" for p in LOAD_PATHS[tier]
                    )
                    lines.append(
                        f"        {TIER_NAMES[tier]} not in use: loading a page is measured "
                        f"slower than recomputing it (kappa {tier_kappa:.3g} < 1: {paths}, "
                        f"C_eff {self._compute.flops_per_s:.3g} FLOP/s); probes re-measure it"
                    )
            lines.append(
                f"  last access {now - rec.last_access_s:.3f} s ago, decayed hits "
                f"{rec.hits:.2f}, pins {rec.pins}, retained {rec.retained}, "
                f"demoted {max(now - rec.demoted_at_s, 0):.3f} s ago"
            )
            return "\n".join(lines)

    # -- internals: accounting ----------------------------------------------------

    def _bump(self, name: str, by: int = 1) -> None:
        self._counters[name] = self._counters.get(name, 0) + by

    def _prefixed(self, prefix: str) -> dict[str, int]:
        n = len(prefix)
        return {k[n:]: v for k, v in self._counters.items() if k.startswith(prefix)}

    def _usage(self) -> tuple[float, float, float]:
        """Per tier, the share of capacity held and not already on its way out."""
        cap, used, leaving = self._capacity, self._used, self._leaving
        return (
            (used[0] - leaving[0]) / cap[0] if cap[0] else 0.0,
            (used[1] - leaving[1]) / cap[1] if cap[1] else 0.0,
            (used[2] - leaving[2]) / cap[2] if cap[2] else 0.0,
        )

    def _page_table_bytes(self) -> int:
        # A PageRec with its slots, key and dict entry: ~ 360 bytes + the key.
        return sum(360 + len(k) for k in self._pages)

    def _cost_ratio(self, rec: PageRec) -> float:
        """Φ's cost term: recompute time per byte against a full root page's. A full
        page's ratio depends on its depth alone: it is kept on the record too, where
        the orders read it without calling here (``offer`` resets it with ``nbytes``)."""
        if rec.tokens == self.config.tokens_per_page and rec.nbytes == self.config.page_bytes:
            ratio = self._cost_ratios.get(rec.depth)
            if ratio is None:
                ratio = self._cost_ratios[rec.depth] = self._compute_cost_ratio(rec)
            rec.cost_ratio = ratio
            return ratio
        return self._compute_cost_ratio(rec)

    def _compute_cost_ratio(self, rec: PageRec) -> float:
        per_byte = self.cost.recompute_s(rec.tokens, rec.depth * rec.tokens) / max(rec.nbytes, 1)
        return per_byte / self._base_recompute_per_byte if self._base_recompute_per_byte else 1.0

    def _value_density(self, rec: PageRec, tier: int) -> float:
        """The value density (``value_formula``; docs/tiering.md, "Admission") with the
        recompute time per depth and the transfer time per tier cached (for full
        pages) until a fit or ``observe_prefill`` moves them."""
        p = self._reuse.p(rec.depth, rec.reused, rec.tag)
        nbytes = rec.nbytes
        formula = self.config.value_formula
        if nbytes != self.config.page_bytes or rec.tokens != self.config.tokens_per_page:
            return self.cost.value_density(p, rec.depth, nbytes, tier, formula)
        cache = self._vd_cache
        if cache is None or cache[0] != self._compute.flops_per_s:
            cache = self._vd_cache = (self._compute.flops_per_s, {}, [-1.0, -1.0, -1.0])
        transfer = cache[2]
        if transfer[tier] < 0:
            transfer[tier] = self.cost.transfer_s(tier, nbytes)
        recompute = cache[1].get(rec.depth)
        if recompute is None:
            tokens = rec.tokens
            recompute = cache[1][rec.depth] = self.cost.recompute_s(tokens, rec.depth * tokens)
        if formula == "expected":
            return p * (recompute - transfer[tier]) / nbytes
        return (p * recompute - transfer[tier]) / nbytes

    def _touch(self, rec: PageRec, now: float, ctx: RequestContext) -> None:
        age = now - rec.last_access_s
        rec.hits = rec.hits * math.exp(-self._decay_per_s * age) + 1.0 if age > 0 else rec.hits + 1
        rec.last_access_s = now
        rec.reused = True
        if ctx.deadline_s is not None:
            rec.deadline_s = ctx.deadline_s
        tiers = rec.tiers
        if self._orders_track_touches:  # ARC moves a page at its access; Φ/LRU re-rank lazily
            orders = self._orders
            for tier in (HBM, DRAM, NVME):
                if tiers & BIT[tier]:
                    orders[tier].touch(rec)
            if tiers & 6 == 6:
                self._clean_dram.touch(rec)
            if tiers & 3 == 3 and self._owned_hbm:
                self._clean_hbm.touch(rec)

    # -- internals: placement and eviction --------------------------------------

    def _place_new(self, rec: PageRec, seen: int) -> tuple[int | None, str]:
        """Where a newly offered page goes; allocates its slot. (tier, reason)."""
        admit = self._admission.admit
        tau = self._tau.tau
        counters = self._counters
        if self._owned_hbm:
            # Admission.admit takes every page into HBM (the engine just computed it)
            slot = self._alloc(HBM)
            if slot is not None:
                rec.hbm_slot = slot
                counters["admission:hbm:admitted"] = counters.get("admission:hbm:admitted", 0) + 1
                return HBM, "admitted"
        ok_dram = admit(rec, DRAM, seen, tau[DRAM])
        if not ok_dram and self.config.hbm == "engine":
            # The engine holds it in HBM; DRAM stages it for NVMe if NVMe wants it.
            ok_dram = self._nvme_enabled and admit(rec, NVME, seen, tau[NVME])
        if not ok_dram:
            self._bump("admission:dram:below_tau")
            return None, "declined: value density below tau"
        slot = self._alloc(DRAM)
        if slot is None:
            self._bump("admission:dram:full")
            return None, "declined: DRAM full (every page pinned or in flight)"
        rec.dram_slot = slot
        counters["admission:dram:admitted"] = counters.get("admission:dram:admitted", 0) + 1
        return DRAM, "admitted"

    def _alloc(self, tier: int) -> int | None:
        arena = self._hbm if tier == HBM else self._dram
        slot: int | None = arena.alloc()
        if slot is None:
            self._evict_now(tier)
            slot = arena.alloc()
        return slot

    def _eligible(self, tier: int, force: bool) -> Callable[[PageRec], bool]:
        now = self._now()
        hysteresis = self.config.hysteresis_s
        # Leaves first only where the victim's last copy goes: an HBM victim that DRAM
        # admits is demoted and leaves no hole. (DRAM keeps leaves first even where it
        # writes back: measured on the conversation trace, freeing parents there first
        # empties the chains' DRAM copies a request later finds.)
        below: Callable[[PageRec], bool] | None = None
        if tier == HBM:
            tau = self._tau.tau[DRAM]
            admit = self._admission.admit

            def below(rec: PageRec) -> bool:
                return admit(rec, DRAM, 0, tau)

        resident = _RESIDENT_CHILDREN[tier]

        def eligible(rec: PageRec) -> bool:
            if rec.pins or rec.waiters or rec.state is not _READY:
                return False
            if resident(rec) and (below is None or not below(rec)):
                return False
            return force or now - rec.promoted_at_s >= hysteresis

        return eligible

    def _evict_now(self, tier: int) -> None:
        """A slot is wanted at once: free a batch of pages that can go without a copy
        (HBM/DRAM pages with a copy below, or not worth keeping); demote the rest in
        the background."""
        # Two pages per allocation that finds the tier full: a bigger batch leaves
        # slots empty that an exclusive chain would fill (measured by `kvstore sim`).
        batch = 2
        clean_list = self._clean_hbm if tier == HBM else self._clean_dram
        # Pages with a copy below go at once (lowest rank first, as any victim); a
        # demotion would free nothing now. (An empty list answers none.)
        clean = clean_list.take(batch, _freeable, 64)  # each one is cleared below
        if clean:
            clear = self._clear_tier
            for rec in clean:
                clear(rec, tier)
            counter = _EVICT_CLEAN[tier]
            counters = self._counters
            counters[counter] = counters.get(counter, 0) + len(clean)
            return
        if tier == DRAM:
            # The clean reserve ran dry: grow it (it decays back in step()).
            ceiling = max(_RESERVE_MAX, 1.0 - self.config.watermark_low)
            self._dram_reserve = min(ceiling, self._dram_reserve + _RESERVE_STEP)
            self._bump("dram:reserve_dry")
        if tier == DRAM and self._nvme_enabled:
            # Next best: a leaf NVMe declines — dropping it frees the slot now, where
            # a page NVMe wants would only queue a write.
            eligible = self._eligible(DRAM, False)
            droppable = self._orders[DRAM].take(  # each one is cleared below
                batch, lambda r: eligible(r) and not self._admits_nvme(r), 256
            )
            if not droppable:
                # No such leaf near the head (chains NVMe declines, e.g. a disk slower
                # than recompute): drop the lowest page NVMe declines even with
                # children in DRAM. They become unreachable and go as leaves later;
                # stalling instead would decline every new page.
                droppable = self._orders[DRAM].take(
                    1, lambda r: _copyable(r) and not self._admits_nvme(r), 64
                )
                if droppable:
                    self._bump("evict:dram:not_leaf")
            for rec in droppable:
                self._clear_tier(rec, DRAM)
                self._bump("evict:dram:dropped")
                self._forget_if_gone(rec)
            if droppable:
                return
        self._evict_to(tier, None, force=False, batch=batch)

    def _evict_to(self, tier: int, low: float | None, *, force: bool, batch: int = _BATCH) -> int:
        """Evict from ``tier`` down to ``low`` x capacity (None: one batch, for an
        allocation that wants a slot now). Background eviction waits while the disk
        has a second of writes queued; an urgent one drops the victim instead."""
        urgent = force or low is None
        capacity = self._capacity[tier]
        if not capacity:
            return 0
        want = batch
        if low is not None:
            excess = self._used[tier] - self._leaving[tier] - low * capacity
            unit = self._slot_bytes
            want = min(batch, max(0, math.ceil(excess / unit)))
        if want <= 0:
            return 0
        now = self._now()
        order = self._orders[tier]
        # NVMe deletes every victim it is given; HBM and DRAM may stop part-way (blocked).
        choose = order.take if tier == NVME else order.victims
        done = 0
        for _ in range(4):  # a chain frees its tail first: a few rounds per batch
            victims = choose(want - done, self._eligible(tier, force), want * 8 + 64)
            if not victims and not force and done == 0:
                victims = choose(want, self._eligible(tier, True), want * 8 + 64)
                if victims:
                    self._bump("hysteresis_overridden", len(victims))
            if not victims:
                break
            writes: list[PageRec] = []
            demoted: list[PageRec] = []
            blocked = False
            for rec in victims:
                if tier == NVME:
                    self._evict_nvme(rec)
                elif tier == DRAM:
                    if not self._evict_dram(rec, now, writes, urgent):
                        blocked = True
                        break
                    self._batch_write_bytes += rec.nbytes if writes and writes[-1] is rec else 0
                elif not self._evict_hbm(rec, now, demoted):
                    blocked = True  # DRAM has no room yet: the rest waits a cycle
                    break
                done += 1
            self._batch_write_bytes = 0
            if writes:
                self._write_back(writes, demote=True)
            if demoted:
                self._submit_demotions(demoted)
            if blocked or done >= want:
                break
        return done

    def _evict_hbm(self, rec: PageRec, now: float, demoted: list[PageRec]) -> bool:
        """Demote or drop one HBM victim; False when DRAM had no slot for it."""
        ok = self._admission.admit(rec, DRAM, 0, self._tau.tau[DRAM])
        if rec.in_tier(DRAM):
            self._clear_tier(rec, HBM)
            self._bump("evict:hbm:clean")
            return True
        if not ok:
            self._clear_tier(rec, HBM)
            self._bump("evict:hbm:dropped")
            self._forget_if_gone(rec)
            return True
        slot = self._alloc(DRAM)
        if slot is None:
            # DRAM is busy writing back: the page waits in HBM for the next cycle.
            self._bump("evict:hbm:blocked")
            return False
        rec.dram_slot = slot
        self._busy(rec, _EVICTING)
        rec.demoted_at_s = now
        self._leave(rec, HBM)
        demoted.append(rec)
        return True

    def _submit_demotions(self, recs: list[PageRec], *, keep: bool = False) -> None:
        """One D2H copy for a batch of HBM pages (their DRAM slots are taken); with
        ``keep`` they stay in HBM too (a clean reserve), else they leave it."""
        tag = Demotion(recs, keep)
        if self._fake:
            nbytes = sum(r.nbytes for r in recs)
            self._mover.copy(_D2H, [], priority=_WRITEBACK, tag=tag, nbytes=nbytes)
        else:
            pairs = [
                (self._hbm.view(r.hbm_slot, r.nbytes), self._dram.view(r.dram_slot, r.nbytes))
                for r in recs
            ]
            self._mover.copy(_D2H, pairs, priority=_WRITEBACK, tag=tag)
        self._bump("demotions", len(recs))

    def _evict_dram(self, rec: PageRec, now: float, writes: list[PageRec], urgent: bool) -> bool:
        """Free, drop or queue for write-back one DRAM victim; False: paced, wait."""
        if rec.tiers & self._above_nvme_mask:  # NVMe or owned HBM holds a copy
            self._clear_tier(rec, DRAM)
            self._bump("evict:dram:clean")
            return True
        if not self._nvme_enabled:
            self._clear_tier(rec, DRAM)
            self._bump("evict:dram:dropped")
            self._forget_if_gone(rec)
            return True
        if self._emergency and not rec.retained:
            self._clear_tier(rec, DRAM)
            self._bump("evict:dram:emergency")
            self._bump("emergency_evictions")
            self._forget_if_gone(rec)
            return True
        if not self._admits_nvme(rec):
            self._clear_tier(rec, DRAM)
            self._bump("evict:dram:dropped")
            # Why: every page is below a κ < 1 (loading slower than recomputing), or
            # this one's value density is below τ.
            self._bump(
                "admission:nvme:kappa_below_1"
                if self._measure.gated[NVME]
                else "admission:nvme:below_tau"
            )
            self._forget_if_gone(rec)
            return True
        if self._write_paced():
            if rec.retained or not urgent or rec.tiers & 1:
                # The disk has a second of writes queued: wait a cycle. (A page the
                # engine's GPU also holds waits too: dropped here, it would be lost
                # with the engine's copy, its DRAM copy being the manager's only one.)
                return False
            # Writes already queue a second deep: dropping the least valuable page
            # beats stalling DRAM (a stall declines new pages, and orphans their chains).
            self._clear_tier(rec, DRAM)
            self._bump("evict:dram:paced")
            self._forget_if_gone(rec)
            return True
        self._bump("admission:nvme:admitted")
        rec.demoted_at_s = now
        writes.append(rec)
        return True

    def _predemote(self) -> None:
        """Owned HBM: copy the lowest-ranked HBM pages to DRAM while they stay in HBM,
        up to a reserve of (1 - low) of HBM, so an HBM allocation frees a slot at once."""
        cap = self._capacity[HBM]
        reserve = (1.0 - self.config.watermark_low) * cap
        want = int((reserve - len(self._clean_hbm) * self._slot_bytes) // self._slot_bytes)
        if want <= 0:
            return
        want = min(want, _BATCH)
        # Copying down makes no hole: any settled, unpinned page will do, leaves or not.
        picked = self._orders[HBM].victims(want, _copyable, 4 * want + 64)
        copies: list[PageRec] = []
        for rec in picked:
            if not self._admission.admit(rec, DRAM, 0, self._tau.tau[DRAM]):
                continue
            slot = self._alloc(DRAM)
            if slot is None:
                break
            rec.dram_slot = slot
            self._busy(rec, _EVICTING)  # readable from HBM while the copy runs
            copies.append(rec)
        if copies:
            self._bump("predemoted", len(copies))
            self._submit_demotions(copies, keep=True)

    def _preclean(self) -> None:
        """Keep a reserve of clean DRAM pages (the next victims, already on NVMe) so an
        allocation under pressure frees a slot at once instead of declining: write
        back, without evicting, the lowest-ranked dirty pages NVMe admits."""
        cap = self._capacity[DRAM]
        reserve = self._dram_reserve * cap
        want = int((reserve - len(self._clean_dram) * self._slot_bytes) // self._slot_bytes)
        if want <= 0 or not self._nvme_enabled or self._emergency or self._write_paced():
            return
        want = min(want, _BATCH)

        other_copy = self._above_nvme_mask

        def dirty(rec: PageRec) -> bool:
            return not rec.tiers & other_copy and _copyable(rec) and self._admits_nvme(rec)

        # take: _write_back marks every one busy, which removes it from the order.
        picked = self._orders[DRAM].take(want, dirty, 4 * want + 64)
        if picked:
            self._bump("precleaned", len(picked))
            self._write_back(picked, demote=False)

    def _write_paced(self) -> bool:
        """Write-back stops queueing at one second of measured write bandwidth."""
        queued = self._mover.in_flight_bytes(_NVME_WRITE) + self._batch_write_bytes
        return queued > self._bandwidth["nvme_write"].rate

    def _evict_nvme(self, rec: PageRec) -> None:
        self._tau.on_evict(NVME, self._value_density(rec, NVME))
        self._clear_tier(rec, NVME)
        if self._store is not None:
            with contextlib.suppress(KVStoreError):
                if rec.retained:
                    self._store.release(rec.key)
                self._store.delete(rec.key)
        self._bump("evict:nvme:deleted")
        if not rec.tiers:
            self._forget_if_gone(rec)

    def _write_back(self, recs: list[PageRec], *, demote: bool) -> None:
        """DRAM -> NVMe for pages in DRAM; with ``demote`` the DRAM slot goes after."""
        nvme_need = sum(r.nbytes for r in recs)
        over = self._used[NVME] + self._nvme_reserved + nvme_need - self._capacity[NVME]
        if over > 0:
            # NVMe frees on allocation (a delete): the bytes these writes need, counted
            # in bytes (victims smaller than a slot free less than one).
            over = self._make_nvme_room(over)
            while over > 0 and recs:
                # No more room (every NVMe page pinned or in flight): the rest stays in
                # DRAM, dirty, for a later cycle; capacity is never exceeded.
                rec = recs.pop()
                nvme_need -= rec.nbytes
                over -= rec.nbytes
                self._orders[DRAM].remove(rec)  # a victim or a take: filed again
                self._enter_order(rec, DRAM)
                self._bump("write:no_room")
            if not recs:
                return
        self._nvme_reserved += nvme_need
        items: list[tuple[bytes, Any, dict[str, Any] | None]] = []
        sizes = []
        fake = self._fake
        busy = self._busy
        for rec in recs:
            busy(rec, _EVICTING)
            if demote:
                self._leave(rec, DRAM)
            sizes.append(rec.nbytes)
            if fake:
                items.append((rec.key, None, None))  # the fake mover stores nothing
                continue
            meta = {
                META_TAG: 1,
                "parent": rec.parent.hex() if rec.parent is not None else None,
                "depth": rec.depth,
                "tokens": rec.tokens,
            }
            items.append((rec.key, self._dram.view(rec.dram_slot, rec.nbytes), meta))
        kwargs: dict[str, Any] = {"sizes": sizes} if self._fake else {}
        self._mover.nvme_write(
            self._store,
            items,
            priority=_WRITEBACK,
            tag=WriteBack(recs, demote),
            **kwargs,
        )

    def _make_nvme_room(self, over: int) -> int:
        """Delete NVMe victims until ``over`` bytes are free; the bytes still missing."""
        for _ in range(64):
            before = self._used[NVME]
            batch = max(1, math.ceil(over / self._slot_bytes))
            if not self._evict_to(NVME, None, force=True, batch=batch):
                break
            over -= before - self._used[NVME]
            if over <= 0:
                break
        return over

    def _check_emergency(self) -> None:
        in_flight = self._mover.in_flight_bytes(_NVME_WRITE)
        limit = self.config.emergency_write_s * self._bandwidth["nvme_write"].rate
        was = self._emergency
        self._emergency = in_flight > limit
        if self._emergency and not was:
            self._bump("emergency:entered")
            # Free clean DRAM in bulk: pages that already have their NVMe copy.
            low = self.config.watermark_low * self._capacity[DRAM]
            clean = [
                rec
                for rec in self._orders[DRAM].unordered()
                if rec.in_tier(NVME) and rec.pins == 0 and rec.state is _READY
            ]
            for rec in clean:
                if self._used[DRAM] <= low:
                    break
                self._clear_tier(rec, DRAM)
                self._bump("emergency_evictions")

    def _ramp_drop(self) -> bool:
        """In an emergency, decline a rising share of new offers (1 in 2, then more)."""
        self._emergency_offers += 1
        in_flight = self._mover.in_flight_bytes(_NVME_WRITE)
        limit = self.config.emergency_write_s * self._bandwidth["nvme_write"].rate
        over = min(in_flight / limit - 1.0, 1.0) if limit else 1.0
        keep_every = max(1, int(1 / max(1.0 - over, 1e-3)))
        return self._emergency_offers % keep_every != 0 or over >= 1.0

    def _write_over_budget(self, now: float) -> float:
        if self.config.max_dwpd is None or not self._capacity[NVME]:
            return 0.0
        window = self._write_window
        while window and now - window[0][0] > 60.0:
            window.popleft()
        written = sum(n for _, n in window)
        span = max(now - window[0][0], 1.0) if window else 1.0
        budget = self.config.max_dwpd * self._capacity[NVME] / 86400.0
        return (written / span) / budget if budget > 0 else 0.0

    # -- internals: reads, copies, completions --------------------------------------

    def _readable_source(self, rec: PageRec) -> tuple[Path, Any] | None:
        """(path, source view) when the page can be copied to a destination now."""
        if rec.state is _READY or rec.state is _EVICTING:
            if rec.in_tier(HBM) and rec.hbm_slot >= 0:
                return _D2D, self._hbm.view(rec.hbm_slot, rec.nbytes)
            if rec.in_tier(DRAM) and rec.dram_slot >= 0:
                return _H2D, self._dram.view(rec.dram_slot, rec.nbytes)
        return None

    def _wait_estimate(self, rec: PageRec) -> float:
        if rec.state is _LOADING:
            return self._bandwidth["nvme_read"].seconds(rec.nbytes) * 0.5
        if rec.state is _WRITING:
            return self._bandwidth["d2h"].seconds(rec.nbytes) * 0.5
        return 0.0

    def _fetch(self, recs: list[PageRec], priority: Priority) -> int:
        """NVMe -> DRAM reads for READY NVMe-only pages with a DRAM slot to land in."""
        batch: list[PageRec] = []
        now = self._now()
        for rec in recs:
            if rec.state is not _READY or not rec.in_tier(NVME) or rec.in_tier(DRAM):
                continue
            slot = self._alloc(DRAM)
            if slot is None:
                break
            rec.dram_slot = slot
            self._busy(rec, _LOADING)
            recently = now - rec.demoted_at_s < self.config.hysteresis_s
            if recently:
                self._bump("hysteresis")
            batch.append(rec)
        if not batch:
            return 0
        keys = [r.key for r in batch]
        if self._fake:
            self._mover.nvme_read(
                None,
                keys,
                (),
                priority=priority,
                tag=Read(batch),
                sizes=[r.nbytes for r in batch],
            )
        else:
            # Reads of a few pages each: the first pages' copies out of DRAM run while
            # the later pages are still being read (one read would serialise them).
            views = [self._dram.view(r.dram_slot, r.nbytes) for r in batch]
            step = _READ_CHUNK_PAGES
            for i in range(0, len(batch), step):
                self._mover.nvme_read(
                    self._store,
                    keys[i : i + step],
                    views[i : i + step],
                    priority=priority,
                    tag=Read(batch[i : i + step]),
                )
        return len(batch)

    def _add_waiter(
        self, rec: PageRec, handle: LoadHandle, index: int, dst: Any, wait_event: Any
    ) -> None:
        if rec.waiters is None:
            rec.waiters = []
        rec.waiters.append(_Waiter(handle, index, dst, wait_event))

    def _load_failed(self, reason: str) -> None:
        """One page of a load reported missing; ``reason`` labels it (nvme_read: the
        read failed or came back short; no_slot: no DRAM slot to stage it; copy: the
        copy to the destination failed; unreadable: no readable copy was left)."""
        self._bump("load_failures")
        self._bump("load_failure:" + reason)

    def _fire_waiters(
        self,
        rec: PageRec,
        *,
        ok: bool,
        batch: dict[tuple[int, Path, int], _Copy] | None = None,
        reason: str = "unreadable",
    ) -> None:
        """Copy the page to each waiting load's destination (or fail the load). With
        ``batch``, the copies are collected there per (load, path, event) for the
        caller to submit as one ticket each."""
        waiters, rec.waiters = rec.waiters, None
        if not waiters:
            return
        for waiter in waiters:
            assert isinstance(waiter, _Waiter)
            handle, index, dst, wait_event = waiter
            source = self._readable_source(rec) if ok else None
            if source is None:
                handle.settle(index, 0)
                self._unpin_load(handle, index)
                self._load_failed(reason)
                continue
            path, view = source
            if batch is None:
                self._copy_to_destination(handle, path, [(index, view, dst)], wait_event)
                continue
            group = (id(handle), path, id(wait_event))
            entry = batch.get(group)
            if entry is None:
                entry = batch[group] = _Copy(handle, path, [], wait_event)
            entry.items.append((index, view, dst))

    def _copy_to_destination(
        self,
        handle: LoadHandle,
        path: Path,
        items: list[tuple[int, Any, Any]],
        wait_event: Any,
    ) -> None:
        if self._fake:
            nbytes = sum(handle.records[i].nbytes for i, _, _ in items)
            self._mover.copy(
                path,
                [],
                priority=_DEMAND,
                tag=Load(handle, items),
                nbytes=nbytes,
            )
            return
        pairs = [
            (src, dst if dst.numel() == src.numel() else dst[: src.numel()])
            for _, src, dst in items
        ]
        ticket = self._mover.copy(
            path,
            pairs,
            priority=_DEMAND,
            tag=Load(handle, items),
            wait_event=wait_event,
        )
        if ticket.event is not None:
            handle.event = ticket.event

    def _submit_offer_copy(
        self, path: Path, items: list[tuple[PageRec, Any, Any, int]], event: Any
    ) -> Ticket:
        pairs = []
        recs = []
        nbytes = 0
        fake = self._fake
        set_tier = self._set_tier
        tier = items[0][3]  # one tier per path: D2D into HBM, D2H into DRAM
        for rec, src, _, item_tier in reversed(items):  # the chain's tail enters oldest
            assert item_tier == tier
            if rec.tiers and rec.state is _READY:
                self._busy(rec, _WRITING)
            else:
                rec.state = _WRITING  # _busy: in no order yet
            set_tier(rec, tier)
            recs.append(rec)
            nbytes += rec.nbytes
            if not fake:
                arena = self._hbm if tier == HBM else self._dram
                slot = rec.hbm_slot if tier == HBM else rec.dram_slot
                pairs.append((src, arena.view(slot, rec.nbytes)))
        if fake:
            return self._mover.copy(
                path,
                [],
                priority=_WRITEBACK,
                tag=OfferCopy(recs, tier),
                nbytes=nbytes,
            )
        return self._mover.copy(
            path, pairs, priority=_WRITEBACK, tag=OfferCopy(recs, tier), wait_event=event
        )

    def _release_handle(self, tickets: list[Ticket]) -> ReleaseHandle:
        event = tickets[-1].event if tickets else None
        return ReleaseHandle(lambda: all(t.done() for t in tickets), self._pump, event)

    def _harvest(self) -> int:
        """Process completed tickets (R6: before any eviction decision); how many."""
        tickets = self._mover.poll()
        now = self._now() if tickets else 0.0
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
                    self._vd_cache = None
                self._observe_latency(ticket.path, seconds)
            try:
                self._complete(ticket, tag)
            except Exception as e:  # the other tickets of this poll must still land
                self._bump("completion:errors")
                self._last_error = f"completion of {type(tag).__name__}: {e!r}"
                if isinstance(tag, Probe):
                    self._measure.probe_failed(tag)
        return len(tickets)

    def _complete(self, ticket: Ticket, tag: object) -> None:
        if isinstance(tag, OfferCopy):
            self._offer_done(ticket, tag.recs, tag.tier)
        elif isinstance(tag, Demotion):
            self._demote_done(ticket, tag.recs, tag.keep)
        elif isinstance(tag, WriteBack):
            self._write_done(ticket, tag.recs, tag.demote)
        elif isinstance(tag, Read):
            self._read_done(ticket, tag.recs)
        elif isinstance(tag, Load):
            self._load_done(ticket, tag.handle, tag.items)
        elif isinstance(tag, Probe):
            self._measure.probe_done(ticket, tag.path, tag.rate_before)

    def _observe_latency(self, path: Path, seconds: float) -> None:
        key = _LATENCY_KEYS.get(path)
        if key is None:
            return
        row = self._latency.get(key)
        if row is None:
            row = self._latency[key] = [0.0] * (len(OFFLOAD_BUCKETS_S) + 2)
        for i, bound in enumerate(OFFLOAD_BUCKETS_S):
            if seconds <= bound:
                row[i] += 1
        row[-2] += seconds
        row[-1] += 1

    def _offer_done(self, ticket: Ticket, recs: list[PageRec], tier: int) -> None:
        write_through = []
        for rec in recs:
            if rec.state is not _WRITING:
                continue
            if ticket.error is not None:
                self._settle(rec)
                self._clear_tier(rec, tier)
                self._bump("offer_failures")
                self._forget_if_gone(rec)
                continue
            self._settle(rec)
            if tier == HBM and rec.tiers & 2 and not rec.pins and not rec.waiters:
                # Back in HBM: HBM and DRAM hold a page exclusively (its NVMe copy,
                # if any, stays). The clean reserve makes its own DRAM copies.
                self._clear_tier(rec, DRAM)
            through = self.config.placement == "write_through" or rec.retained
            if self._nvme_enabled and tier == DRAM and through and self._admits_nvme(rec):
                write_through.append(rec)
            if rec.waiters:
                self._fire_waiters(rec, ok=True)
        if write_through:
            self._write_back(write_through, demote=False)

    def _admits_nvme(self, rec: PageRec) -> bool:
        """NVMe admission, decided once per admission epoch (τ's period) per page."""
        if rec.admit_epoch == self._admit_epoch:
            return rec.admit_nvme
        ok = self._admission.admit(rec, NVME, self._reuse.seen(rec.key), self._tau.tau[NVME])
        rec.admit_epoch = self._admit_epoch
        rec.admit_nvme = ok
        return ok

    def _demote_done(self, ticket: Ticket, recs: list[PageRec], keep: bool) -> None:
        for rec in recs:
            if ticket.error is not None:
                self._dram.free(rec.dram_slot)
                rec.dram_slot = -1
                self._settle(rec)
                self._stay(rec, HBM)
                self._enter_order(rec, HBM)
                continue
            # The new tier first, then settle: settling first would file the page in
            # HBM's order only for _set_tier to move it to the clean list (a stale
            # entry). The orders' ranks come out the same either way.
            self._set_tier(rec, DRAM)
            self._settle(rec)
            if keep:
                continue  # now clean in HBM: freed at once when a slot is wanted
            if rec.pins == 0 and not rec.waiters:
                self._clear_tier(rec, HBM)
            else:
                self._stay(rec, HBM)  # a load still reading the HBM slot keeps it
            if rec.waiters:
                self._fire_waiters(rec, ok=True)

    def _write_done(self, ticket: Ticket, recs: list[PageRec], demote: bool) -> None:
        results = ticket.results
        now = self._now()
        window_kept = self.config.max_dwpd is not None
        for index, rec in enumerate(recs):
            stored = ticket.error is None and results is not None and results[index]
            self._nvme_reserved -= rec.nbytes
            if stored:
                self._nvme_written[0] += 1
                self._nvme_written[1] += rec.nbytes
                if window_kept:  # read only against a DWPD budget
                    self._write_window.append((now, rec.nbytes))
                # Before settling, as in _demote_done: a page that turns clean goes
                # to the clean list without a stop in DRAM's order.
                self._set_tier(rec, NVME)
                if rec.retained and self._store is not None:
                    with contextlib.suppress(KVStoreError):
                        self._store.retain(rec.key)
            else:
                self._bump("write_failures")
            self._settle(rec)
            if demote and rec.pins == 0 and not rec.waiters and rec.in_tier(DRAM):
                self._clear_tier(rec, DRAM)
                if not stored:
                    self._bump("evict:dram:write_failed")
                    self._forget_if_gone(rec)
            elif demote:
                self._stay(rec, DRAM)
            if rec.waiters:
                self._fire_waiters(rec, ok=True)

    def _read_done(self, ticket: Ticket, recs: list[PageRec]) -> None:
        results = ticket.results
        now = self._now()
        exclusive = self.config.placement == "exclusive"
        # Real mover: one copy ticket per load for the whole read, not one per page
        # (fewer tickets and wake-ups). The fake mover keeps one per page: its
        # simulated timing, and so every simulated decision, stays as it was.
        copies: dict[tuple[int, Path, int], _Copy] | None = None if self._fake else {}
        for index, rec in enumerate(recs):
            got = None if ticket.error is not None or results is None else results[index]
            if rec.state is not _LOADING:
                continue
            self._settle(rec)
            if not got or got != rec.nbytes:
                # Missing or failed on NVMe: the page is gone there, never served.
                self._dram.free(rec.dram_slot)
                rec.dram_slot = -1
                self._clear_tier(rec, NVME)
                if rec.waiters:
                    self._bump("read_failures")
                else:
                    self._load_failed("nvme_read")
                self._fire_waiters(rec, ok=False, reason="nvme_read")
                self._forget_if_gone(rec)
                continue
            self._set_tier(rec, DRAM)
            recently = now - rec.demoted_at_s < self.config.hysteresis_s
            if recently and rec.demoted_at_s > 0:
                self._bump("thrash")
            rec.promoted_at_s = now
            self._bump("promotions")
            if exclusive and self._store is not None and not rec.retained:
                self._clear_tier(rec, NVME)
                with contextlib.suppress(KVStoreError):
                    self._store.delete(rec.key)
            elif exclusive and self._fake:
                self._clear_tier(rec, NVME)
            if rec.waiters:
                self._fire_waiters(rec, ok=True, batch=copies)
        if copies:
            for copy in copies.values():
                self._copy_to_destination(copy.handle, copy.path, copy.items, copy.wait_event)
        self._warm_in_flight = max(0, self._warm_in_flight - len(recs))

    def _load_done(
        self, ticket: Ticket, handle: LoadHandle, items: list[tuple[int, Any, Any]]
    ) -> None:
        for index, _, _ in items:
            rec = handle.records[index]
            ok = ticket.error is None and rec is not None
            handle.settle(index, rec.nbytes if ok and rec is not None else 0)
            self._unpin_load(handle, index)  # R4: the source slot is free to go now
            if not ok:
                self._load_failed("copy")

    # -- internals: restart ------------------------------------------------------------

    def _rebuild_from_nvme(self) -> None:
        """The prefix forest from the NVMe pages' parent links."""
        store = self._store
        now = self._now()
        tpp = self.config.tokens_per_page
        found: list[PageRec] = []
        for key in store.keys():  # noqa: SIM118 (KVStore is not a Mapping)
            info = store.info(key)
            if info is None:
                continue
            meta = info.meta
            if meta.get(META_TAG) != 1:
                continue
            parent_hex = meta.get("parent")
            parent = bytes.fromhex(parent_hex) if isinstance(parent_hex, str) else None
            depth = meta.get("depth")
            tokens = meta.get("tokens")
            rec = PageRec(
                key,
                parent,
                depth if isinstance(depth, int) else 0,
                tokens if isinstance(tokens, int) else tpp,
                info.payload_bytes,
                now,
            )
            rec.retained = store.is_retained(key)
            self._pages[key] = rec
            found.append(rec)
        for rec in found:
            self._set_tier(rec, NVME)
            parent_rec = self._pages.get(rec.parent) if rec.parent is not None else None
            if parent_rec is not None:
                self._child_created(parent_rec)
        self._bump("restart:pages_rebuilt", len(found))

    def _load_stats(self) -> None:
        """The persisted statistics, all or nothing. Statistics are a cache: a file that
        fails any check (torn, garbage, a rate of 0, a short list) is treated as absent
        and costs warm-up, never the open, a half-applied state or a later raise."""
        path = self._stats_path
        if path is None:
            return
        try:
            raw = read_regular(path)  # O_NONBLOCK, regular files only: a FIFO never blocks
        except FileNotFoundError:
            return
        except (OSError, KVStoreError) as e:
            self._bump("restart:stats_unreadable")
            self._stats_error = f"{path}: {e}"
            return
        try:
            parsed = parse_for_manager(json.loads(raw), str(path))
        except (OSError, ValueError, RecursionError, KVStoreError) as e:
            self._bump("restart:stats_unreadable")
            self._stats_error = f"{path}: {e}"
            return
        self._reuse.load_json(parsed.reuse)
        self._tau.load_json(parsed.tau)
        for name, (rate, latency_s) in parsed.bandwidth.items():
            # A path the configuration sets is the operator's number, not a seed.
            if name in self._bandwidth and name not in self.config.bandwidth_bytes_per_s:
                self._bandwidth[name].set(rate, latency_s)
        if self.config.compute_flops is None:  # a configured C_eff is the operator's
            self._compute.flops_per_s = parsed.compute_flops
        now = self._now()
        heat = []
        for key, hits, age_s in parsed.heat:
            rec = self._pages.get(key)
            if rec is None:
                continue
            rec.hits = hits
            rec.last_access_s = now - age_s
            rec.reused = rec.hits >= 1
            for tier in range(3):
                if rec.in_tier(tier):
                    self._orders[tier].touch(rec)
            heat.append(rec)
        if self.config.warm_dram_on_open:
            heat.sort(key=lambda r: -r.hits)
            self._warm.extend(r.key for r in heat)
        self._bump("restart:stats_loaded")

    def _stats_snapshot(self) -> dict[str, Any]:
        now = self._now()
        hottest = sorted(self._pages.values(), key=lambda r: -r.hits)[:_HEAT_PAGES]
        return snapshot(
            reuse=self._reuse.to_json(),
            tau=self._tau.to_json(),
            bandwidth={p: b.to_json() for p, b in self._bandwidth.items()},
            compute_flops=self._compute.flops_per_s,
            heat=[[r.key.hex(), r.hits, max(now - r.last_access_s, 0.0)] for r in hottest],
            summary={
                "pages_by_tier": list(self._count),
                "used_bytes": list(self._used),
                "capacity_bytes": list(self._capacity),
                "hits_by_tier": list(self._hits),
                "misses": self._misses,
                "lookups": self._lookups,
                "nvme_pages_written": self._nvme_written[0],
                "nvme_bytes_written": self._nvme_written[1],
                "counters": dict(self._counters),
                "kappa": [self.cost.kappa(t, self.config.page_bytes) for t in range(3)],
            },
        )

    def _write_stats(self, data: dict[str, Any]) -> None:
        path = self._stats_path
        if path is None:
            return
        try:
            with self._stats_write_lock:
                write_stats_file(path, data)
        except (OSError, IOFailure) as e:
            self._bump("stats:save_failures")
            self._stats_error = f"{path}: {e}"

    def _update_gates(self) -> None:
        if self._measure.update_gates():
            self._admit_epoch += 1  # cached NVMe admissions were decided under the old κ

    def _retry_fetches(self) -> None:
        """Demand reads that found DRAM full: start them as slots come free."""
        queue = self._fetch_queue
        while queue:
            rec = queue[0]
            if rec.state is not _READY or not rec.waiters or not rec.in_tier(NVME):
                queue.popleft()
                if rec.waiters and rec.state is _READY:
                    self._fire_waiters(rec, ok=rec.in_tier(DRAM) or rec.in_tier(HBM))
                continue
            if not self._fetch([rec], _DEMAND):
                if self._now() - self._fetch_queue_since < _DEMAND_WAIT_S:
                    return
                # No DRAM slot for a whole second (every page pinned or in flight):
                # the page is reported missing, the engine recomputes it.
                queue.popleft()
                self._bump("load:no_slot")
                self._fire_waiters(rec, ok=False, reason="no_slot")
                self._fetch_queue_since = self._now()
                continue
            queue.popleft()
            self._fetch_queue_since = self._now()

    def _warm_step(self) -> None:
        """Refill DRAM from NVMe, hottest first, while DRAM is below its low mark."""
        if not self._warm or self._warm_in_flight >= 2 * _WARM_BATCH:
            return
        room = self.config.watermark_low * self._capacity[DRAM] - self._used[DRAM]
        batch: list[PageRec] = []
        while self._warm and room > self._slot_bytes and len(batch) < _WARM_BATCH:
            rec = self._pages.get(self._warm.popleft())
            if rec is None or rec.top_tier() != NVME or rec.state is not _READY:
                continue
            batch.append(rec)
            room -= self._slot_bytes
        if batch:
            started = self._fetch(batch, _BACKGROUND)
            self._warm_in_flight += started
            self._bump("restart:warmed", started)


_EVICT_CLEAN = tuple(f"evict:{name}:clean" for name in TIER_NAMES)
# PageRec.resident_children[tier], one slot per tier
_RESIDENT_CHILDREN = tuple(operator.attrgetter(f"resident_{name}") for name in TIER_NAMES)


def _freeable(rec: PageRec) -> bool:
    """A clean copy that can go at once: no pin, no waiter, no copy in flight."""
    return not rec.pins and not rec.waiters and rec.state is _READY


def _copyable(rec: PageRec) -> bool:
    """A page whose bytes may be copied to a lower tier now (cleaning, not evicting)."""
    return not rec.pins and not rec.waiters and rec.state is _READY


class _Copy(NamedTuple):
    """Copies to one load's destinations from one source path, submitted together."""

    handle: LoadHandle
    path: Path
    items: list[tuple[int, Any, Any]]
    wait_event: Any


_READ_CHUNK_PAGES = 8  # pages per NVMe read of a fetch (copies out start per chunk)


class _Waiter(NamedTuple):
    """A load waiting for its page to land in DRAM (an NVMe read, an offer's copy)."""

    handle: LoadHandle
    position: int  # in the handle's plan
    dst: Any
    wait_event: Any


_LAYERS = {
    Path.D2H: ("0", "1"),
    Path.H2D: ("1", "0"),
    Path.D2D: ("0", "0"),
    Path.NVME_WRITE: ("1", "2"),
    Path.NVME_READ: ("2", "1"),
}
_LATENCY_KEYS = {path: f"{a}->{b}" for path, (a, b) in _LAYERS.items()}


def _check_ctx(ctx: object) -> RequestContext:
    """``ctx`` or the empty context (its fields are checked when it is made)."""
    if ctx is None:
        return _NO_CONTEXT
    if not isinstance(ctx, RequestContext):
        raise TypeError(f"ctx must be a RequestContext, not {type(ctx).__name__}")
    return ctx


def _byte_view(tensor: Any, what: str) -> Any:
    import torch

    if (
        type(tensor) is torch.Tensor
        and tensor.dtype is torch.uint8
        and tensor.dim() == 1
        and tensor.is_contiguous()
    ):
        return tensor  # already a byte view: a new view object costs ~5 us
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, not {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(f"{what} is not contiguous; pass tensor.contiguous()")
    return tensor.reshape(-1).view(torch.uint8)

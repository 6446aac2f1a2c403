"""Loads: finding a prefix, planning it, and bringing its pages to the engine.

``Loads`` walks a lookup's keys to the resident prefix and plans load against
recompute (docs/tiering.md, "Load or recompute"), stages NVMe-only pages into DRAM
(PENDING), and carries a ``prepare_load`` through: copies from HBM/DRAM slots to the
engine's destinations at once, NVMe pages read into DRAM first (a waiter per page,
fired when the page lands), demand reads that found DRAM full queued until a slot
comes free or ``_DEMAND_WAIT_S`` passes. It also warms DRAM from NVMe after a
restart. State under the manager's lock; pages are pinned while a load reads them.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from kvstore.tiering.config import TierConfig
from kvstore.tiering.copies import Copies
from kvstore.tiering.cost import Bandwidth, CostModel
from kvstore.tiering.evict import Eviction
from kvstore.tiering.mover_api import Path, Priority, Ticket
from kvstore.tiering.nvme import NvmeTier
from kvstore.tiering.pages import ABOVE_NVME, DRAM, HBM, NVME, PageRec, PageState, page_key
from kvstore.tiering.results import LoadHandle, LoadPlan, LookupResult, LookupState, RequestContext
from kvstore.tiering.state import TierState
from kvstore.tiering.value import Valuation

__all__ = ["Loads"]

_WARM_BATCH = 16
_DEMAND_WAIT_S = 1.0  # a demand read waits this long for a DRAM slot, then fails
_TOP_TIER = (-1, 0, 1, 0, 2, 0, 1, 0)  # PageRec.top_tier(), indexed by the tier bits
# Enum members as module constants: in the hot paths an enum attribute read costs
# 0.1-0.2 us each (Python 3.11), as much as the rest of a line.
_READY, _WRITING, _LOADING, _EVICTING = (
    PageState.READY,
    PageState.WRITING,
    PageState.LOADING,
    PageState.EVICTING,
)
_D2D, _H2D = Path.D2D, Path.H2D
_DEMAND, _PREFETCH, _BACKGROUND = Priority.DEMAND, Priority.PREFETCH, Priority.BACKGROUND


class Loads:
    """Lookups, load plans, staging, loads in flight and their waiters, DRAM warming."""

    def __init__(
        self,
        config: TierConfig,
        state: TierState,
        value: Valuation,
        *,
        eviction: Eviction,
        nvme: NvmeTier,
        copies: Copies,
        cost: CostModel,
        bandwidth: dict[str, Bandwidth],
        now: Callable[[], float],
        pump: Callable[[], None],
    ) -> None:
        self.config = config
        self._state = state
        self._pages = state.pages
        self._hbm = state.hbm
        self._dram = state.dram
        self._capacity = state.capacity
        self._used = state.used
        self._slot_bytes = state.slot_bytes
        self._readable_mask = state.readable_mask
        self._bump = state.bump
        self._set_tier = state.set_tier
        self._clear_tier = state.clear_tier
        self._busy = state.busy
        self._settle = state.settle
        self._forget_if_gone = state.forget_if_gone
        self._reuse = value.reuse
        self._payoff = value.payoff
        self._displacement = value.displacement
        self._alloc = eviction.alloc
        self._nvme = nvme
        self._copies = copies
        self.cost = cost
        self._bandwidth = bandwidth
        self._now = now
        self._pump = pump
        self.handles: set[LoadHandle] = set()
        self._fetch_queue: deque[PageRec] = deque()  # demand reads waiting for a DRAM slot
        self._fetch_queue_since = 0.0  # when its head started waiting (or last moved)
        self.warm: deque[bytes] = deque()  # keys to read into DRAM, hottest first
        self._warm_in_flight = 0
        self.hits = [0, 0, 0]
        self.misses = 0
        self.lookups = 0

    # -- lookup ------------------------------------------------------------------

    def _held_above_nvme(self, key: bytes) -> bool:
        """Whether HBM or DRAM holds ``key`` (a lookup of it is no NVMe read)."""
        rec = self._pages.get(key)
        return rec is not None and bool(rec.tiers & ABOVE_NVME)

    def lookup(
        self, keys: Sequence[object], ctx: RequestContext, tokens: int | None
    ) -> LookupResult:
        """The resident prefix of ``keys`` and its plan (``TierManager.lookup``)."""
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
        if self._displacement is not None:
            self._displacement.looked_up(walked, self._held_above_nvme)
        # Leaves older than their parents at the same instant: chains go from the
        # tail. TierState.touch, inlined: this runs once per hit page.
        # A hit counts toward the hits of the pages up to where the prefix branches:
        # the deepest hit page whose continuation differs from the one its previous
        # hit had. A shared prompt or document counts once per request; a chain re-read
        # by its own next turn does not (its first continuation is no branch), else
        # its pages would rank by how long its session has run.
        # One pass from the deepest page: once the branch is found, it and every page
        # above it count.
        n_keys = len(keys)
        count = 0.0
        # ARC moves a page at its access, and a deadline is stamped: TierState.touch.
        full_touch = self._state.orders_track_touches or ctx.deadline_s is not None
        touch = self._state.touch
        decay = self._state.decay_per_s
        exp = math.exp
        last_age, factor = -1.0, 1.0  # a prefix's pages mostly share one age
        for i in range(len(hit_recs) - 1, -1, -1):
            rec = hit_recs[i]
            following = keys[i + 1] if i + 1 < n_keys else None
            if not count and rec.next_key is not None and following != rec.next_key:
                count = 1.0
            rec.next_key = following
            if full_touch:
                touch(rec, now, ctx.deadline_s, count)
                continue
            age = now - rec.last_access_s
            if age > 0:
                if age != last_age:
                    last_age, factor = age, exp(-decay * age)
                rec.hits = rec.hits * factor + count
                rec.reads = rec.reads * factor + 1.0
            else:
                rec.hits = rec.hits + count
                rec.reads = rec.reads + 1.0
            rec.last_access_s = now
            rec.reused = True
        total = tokens if tokens is not None else ctx.tokens
        if total is None:
            total = len(keys) * self.config.tokens_per_page
        hit = len(hit_recs)
        payoff = self._payoff
        if payoff is not None and hit < len(keys) and payoff.has_ghosts():
            payoff.missed([k if type(k) is bytes else page_key(k) for k in keys[hit:]])
        self.lookups += 1
        self.misses += len(keys) - hit
        for tier in range(3):
            self.hits[tier] += by_tier[tier]
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
        slot stays on NVMe and does not make the plan PENDING: ``prepare`` streams
        it through slots as they come free (its own copies landing, write-backs
        finishing); one that finds none within ``_DEMAND_WAIT_S`` is reported missing."""
        fast = self._readable_mask & 3  # copies the manager can read without NVMe
        for rec in hit_recs:
            rec.pins += 1
        try:
            nvme_only = [r for r in hit_recs[:load] if r.state is _READY and not r.tiers & fast]
            if nvme_only:
                self.fetch(nvme_only, _DEMAND)
        finally:
            for rec in hit_recs:
                rec.pins -= 1
        return any(rec.state is _LOADING or rec.state is _WRITING for rec in hit_recs[:load])

    def prefetch(self, keys: Sequence[object]) -> int:
        """NVMe -> DRAM reads of the resident prefix's NVMe-only pages; how many."""
        wanted = []
        readable = self._readable_mask
        for raw in keys:
            rec = self._pages.get(page_key(raw))
            if rec is None or not rec.tiers & readable:
                break
            if _TOP_TIER[rec.tiers & readable] == NVME and rec.state is _READY:
                wanted.append(rec)
        return self.fetch(wanted, _PREFETCH)

    # -- loads ---------------------------------------------------------------------

    def prepare(self, plan: LoadPlan, views: list[Any], wait_event: Any) -> LoadHandle:
        """Start a load of the plan's pages into ``views`` (``TierManager.prepare_load``)."""
        count = plan.load_pages
        records: list[PageRec | None] = [self._pages.get(k) for k in plan.keys[:count]]
        for index, rec in enumerate(records):
            view = views[index]
            if rec is not None and view is not None and view.numel() < rec.nbytes:
                raise ValueError(
                    f"dst[{index}] holds {view.numel()} bytes, less than page "
                    f"{plan.keys[index]!r}'s {rec.nbytes}"
                )
        handle = LoadHandle(plan, records, self._pump)
        self.handles.add(handle)
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
            self._copies.load(handle, path, items, wait_event)
        nvme: list[PageRec] = []
        for index in waiting:
            rec = records[index]
            assert rec is not None
            if rec.waiters is None:
                rec.waiters = []
            rec.waiters.append(_Waiter(handle, index, views[index], wait_event))
            if rec.state is _READY:
                nvme.append(rec)
        if nvme:
            self.fetch(nvme, _DEMAND)
            # No DRAM slot for the rest yet: they read as slots come free.
            queued = [r for r in nvme if r.state is _READY]
            if queued and not self._fetch_queue:
                self._fetch_queue_since = self._now()
            self._fetch_queue.extend(queued)
        return handle

    def unpin(self, handle: LoadHandle, index: int) -> None:
        if index in handle.pinned:
            handle.pinned.discard(index)
            rec = handle.records[index]
            if rec is not None and rec.pins > 0:
                rec.pins -= 1
                self._forget_if_gone(rec)

    def complete(self, handle: LoadHandle) -> int:
        """Release the pins of a finished load (``TierManager.complete_load``)."""
        if handle not in self.handles:
            return handle.loaded_pages
        if not handle.done():
            raise ValueError("the load is still in flight; call handle.wait() first")
        self.handles.discard(handle)
        for index in list(handle.pinned):
            self.unpin(handle, index)
        loaded = handle.loaded_pages
        self._bump("loads:pages", loaded)
        return loaded

    def abandon(self) -> None:
        """At close: every load still in flight reports its missing pages as 0 bytes."""
        for handle in list(self.handles):
            for index, result in enumerate(handle.results):
                if result is None:
                    handle.settle(index, 0)

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

    def fetch(self, recs: list[PageRec], priority: Priority) -> int:
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
        self._nvme.read(batch, self._dram, priority)
        return len(batch)

    def _load_failed(self, reason: str) -> None:
        """One page of a load reported missing; ``reason`` labels it (nvme_read: the
        read failed or came back short; no_slot: no DRAM slot to stage it; copy: the
        copy to the destination failed; unreadable: no readable copy was left)."""
        self._bump("load_failures")
        self._bump("load_failure:" + reason)

    def fire_waiters(
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
                self.unpin(handle, index)
                self._load_failed(reason)
                continue
            path, view = source
            if batch is None:
                self._copies.load(handle, path, [(index, view, dst)], wait_event)
                continue
            group = (id(handle), path, id(wait_event))
            entry = batch.get(group)
            if entry is None:
                entry = batch[group] = _Copy(handle, path, [], wait_event)
            entry.items.append((index, view, dst))

    # -- completions -------------------------------------------------------------------

    def read_done(self, ticket: Ticket, recs: list[PageRec]) -> None:
        results = ticket.results
        now = self._now()
        exclusive = self.config.placement == "exclusive"
        # Real memory: one copy ticket per load for the whole read, not one per page
        # (fewer tickets and wake-ups). The simulator keeps one per page: its
        # simulated timing, and so every simulated decision, stays as it was.
        copies: dict[tuple[int, Path, int], _Copy] | None = (
            {} if self._copies.batches_loads else None
        )
        for index, rec in enumerate(recs):
            got = None if ticket.error is not None or results is None else results[index]
            if rec.state is not _LOADING:
                continue
            self._settle(rec)
            if not got or got != rec.nbytes:
                # Missing or failed on NVMe: the page is gone there, never served.
                self._dram.free(rec.dram_slot)
                rec.dram_slot = -1
                if self._payoff is not None:
                    self._payoff.deleted(rec.key)
                self._clear_tier(rec, NVME)
                if rec.waiters:
                    self._bump("read_failures")
                else:
                    self._load_failed("nvme_read")
                self.fire_waiters(rec, ok=False, reason="nvme_read")
                self._forget_if_gone(rec)
                continue
            self._set_tier(rec, DRAM)
            if self._payoff is not None:
                self._payoff.read_back(rec.key)
            recently = now - rec.demoted_at_s < self.config.hysteresis_s
            if recently and rec.demoted_at_s > 0:
                self._bump("thrash")
            rec.promoted_at_s = now
            self._bump("promotions")
            if exclusive and not rec.retained:
                self._clear_tier(rec, NVME)
                self._nvme.delete(rec.key)
            if rec.waiters:
                self.fire_waiters(rec, ok=True, batch=copies)
        if copies:
            for copy in copies.values():
                self._copies.load(copy.handle, copy.path, copy.items, copy.wait_event)
        self._warm_in_flight = max(0, self._warm_in_flight - len(recs))

    def load_done(
        self, ticket: Ticket, handle: LoadHandle, items: list[tuple[int, Any, Any]]
    ) -> None:
        for index, _, _ in items:
            rec = handle.records[index]
            ok = ticket.error is None and rec is not None
            handle.settle(index, rec.nbytes if ok and rec is not None else 0)
            self.unpin(handle, index)  # R4: the source slot is free to go now
            if not ok:
                self._load_failed("copy")

    # -- the control cycle ------------------------------------------------------------

    def retry_fetches(self) -> None:
        """Demand reads that found DRAM full: start them as slots come free."""
        queue = self._fetch_queue
        while queue:
            rec = queue[0]
            if rec.state is not _READY or not rec.waiters or not rec.in_tier(NVME):
                queue.popleft()
                if rec.waiters and rec.state is _READY:
                    self.fire_waiters(rec, ok=rec.in_tier(DRAM) or rec.in_tier(HBM))
                continue
            if not self.fetch([rec], _DEMAND):
                if self._now() - self._fetch_queue_since < _DEMAND_WAIT_S:
                    return
                # No DRAM slot for a whole second (every page pinned or in flight):
                # the page is reported missing, the engine recomputes it.
                queue.popleft()
                self._bump("load:no_slot")
                self.fire_waiters(rec, ok=False, reason="no_slot")
                self._fetch_queue_since = self._now()
                continue
            queue.popleft()
            self._fetch_queue_since = self._now()

    def warm_step(self) -> None:
        """Refill DRAM from NVMe, hottest first, while DRAM is below its low mark."""
        if not self.warm or self._warm_in_flight >= 2 * _WARM_BATCH:
            return
        room = self.config.watermark_low * self._capacity[DRAM] - self._used[DRAM]
        batch: list[PageRec] = []
        while self.warm and room > self._slot_bytes and len(batch) < _WARM_BATCH:
            rec = self._pages.get(self.warm.popleft())
            if rec is None or rec.top_tier() != NVME or rec.state is not _READY:
                continue
            batch.append(rec)
            room -= self._slot_bytes
        if batch:
            started = self.fetch(batch, _BACKGROUND)
            self._warm_in_flight += started
            self._bump("restart:warmed", started)


class _Copy(NamedTuple):
    """Copies to one load's destinations from one source path, submitted together."""

    handle: LoadHandle
    path: Path
    items: list[tuple[int, Any, Any]]
    wait_event: Any


class _Waiter(NamedTuple):
    """A load waiting for its page to land in DRAM (an NVMe read, an offer's copy)."""

    handle: LoadHandle
    position: int  # in the handle's plan
    dst: Any
    wait_event: Any

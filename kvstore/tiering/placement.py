"""Placement: where a freshly computed page goes, and its copy there.

``Placement`` runs an offer's pages in order (docs/tiering.md, "Placement" and
"Admission"): a page already resident is "present" (and, with owned HBM, kept in HBM
again); a child of a declined or absent parent is declined (no holes in a prefix);
the rest is admitted by value density into HBM (owned), else DRAM, else declined,
and copied there as one ticket per path. When the copy lands the page is readable;
with write-through (or retained) its DRAM copy is also written back at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from kvstore.tiering.config import TierConfig
from kvstore.tiering.copies import Copies
from kvstore.tiering.evict import Eviction
from kvstore.tiering.loads import Loads
from kvstore.tiering.mover_api import Path, Ticket
from kvstore.tiering.pages import DRAM, HBM, NVME, PageRec, PageState
from kvstore.tiering.results import OfferResult, ReleaseHandle, RequestContext
from kvstore.tiering.state import TierState
from kvstore.tiering.value import Valuation

__all__ = ["Placement"]

_READY, _WRITING, _WAITING = PageState.READY, PageState.WRITING, PageState.WAITING
_D2D, _D2H = Path.D2D, Path.D2H
_WAIT = -1  # _place_new: no slot now, wait for one (serve_waiting)


class _OfferCopies:
    """An offer's copies: its tickets, and how many of its pages still wait for a
    DRAM slot (its release handle fires when both are done)."""

    __slots__ = ("tickets", "waiting")

    def __init__(self) -> None:
        self.tickets: list[Ticket] = []
        self.waiting = 0

    def done(self) -> bool:
        return self.waiting == 0 and all(t.done() for t in self.tickets)


class _Waiting:
    """An offered page queued for a DRAM slot: its record, the engine's bytes (valid
    until the offer's release handle fires, rule R2), its offer, when it was queued."""

    __slots__ = ("event", "offer", "rec", "since", "view")

    def __init__(self, rec: PageRec, view: Any, offer: _OfferCopies, since: float, event: Any):
        self.rec = rec
        self.view = view
        self.offer = offer
        self.since = since
        self.event = event


class Placement:
    """Offers: admission, the new page's slot, its copy in, and what follows it."""

    def __init__(
        self,
        config: TierConfig,
        state: TierState,
        value: Valuation,
        *,
        eviction: Eviction,
        loads: Loads,
        copies: Copies,
        nvme_enabled: bool,
        now: Callable[[], float],
        pump: Callable[[], None],
    ) -> None:
        self.config = config
        self._state = state
        self._pages = state.pages
        self._owned_hbm = state.owned_hbm
        self._engine_hbm = config.hbm == "engine"
        self._counters = state.counters
        self._bump = state.bump
        self._set_tier = state.set_tier
        self._clear_tier = state.clear_tier
        self._child_created = state.child_created
        self._busy = state.busy
        self._settle = state.settle
        self._forget_if_gone = state.forget_if_gone
        self._touch = state.touch
        self._reuse = value.reuse
        self._displacement = value.displacement
        self._admission = value.admission
        self._tau = value.tau
        self._admits_nvme = value.admits_nvme
        self._eviction = eviction
        self._alloc = eviction.alloc
        self._loads = loads
        self._copies = copies
        self._nvme_enabled = nvme_enabled
        self._now = now
        self._pump = pump
        self._waiting: deque[_Waiting] = deque()  # offered pages waiting for a DRAM slot

    def offer(
        self,
        key_bytes: list[bytes],
        parent_keys: list[bytes | None],
        views: list[Any],
        nbytes: list[int],
        ctx: RequestContext,
        event: Any,
    ) -> OfferResult:
        """Place checked pages (``TierManager.offer`` checks and converts the inputs)."""
        count = len(key_bytes)
        tiers_out: list[int | None] = [None] * count
        reasons = ["declined"] * count
        eviction = self._eviction
        if count > eviction.burst_pages:
            eviction.burst_pages = count
        now = self._now()
        pages = self._pages
        placed: set[bytes] = set()
        declined: set[bytes] = set()
        copies: dict[Path, list[tuple[PageRec, Any, int]]] = {}
        engine_hbm = self._engine_hbm
        touched: list[PageRec] = []
        offer_copies = _OfferCopies()
        tag = ctx.tag
        reuse_access = self._reuse.access_offer
        displacement = self._displacement
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
            # ReuseEstimator.access_offer with the depth the page has or would have
            if rec is not None:
                seen, counted = reuse_access(key, rec.depth, tag)
                if seen > 1:
                    rec.reused = True
            else:
                depth = parent_rec.depth + 1 if parent_rec is not None else 0
                seen, counted = reuse_access(key, depth, tag)
            if counted and displacement is not None:
                displacement.counted(key)
            if rec is not None and rec.state is _WAITING:
                # An earlier offer's page waiting for a DRAM slot: that offer lands it.
                tiers_out[i] = DRAM
                reasons[i] = "waiting"
                placed.add(key)
                continue
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
                        # Busy from now on, not from the copy's submission: an
                        # allocation for a later page of this offer would otherwise
                        # evict its DRAM copy and forget it, and the copy would land
                        # in HBM on a page no longer in the page table (its slot and
                        # HBM's page count leaked; `TestTieringDisplacement` found it).
                        self._busy(rec, _WRITING)
                        copies.setdefault(_D2D, []).append((rec, views[i], HBM))
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
            if eviction.emergency and eviction.ramp_drop():
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
                        parent_rec.children += 1  # child_created: no branch yet
            else:
                rec.nbytes = nbytes[i]
                rec.cost_ratio = -1.0
            rec.deadline_s = ctx.deadline_s
            rec.last_access_s = now
            tier, reason = self._place_new(rec, seen)
            reasons[i] = reason
            if tier == _WAIT:
                rec.state = _WAITING  # in no tier, so in no order: nothing to leave
                offer_copies.waiting += 1
                self._waiting.append(_Waiting(rec, views[i], offer_copies, now, event))
                tiers_out[i] = DRAM
                placed.add(key)
                continue
            if tier is None:
                declined.add(key)
                self._forget_if_gone(rec)
                continue
            tiers_out[i] = HBM if engine_hbm else tier
            placed.add(key)
            if engine_hbm:
                self._set_tier(rec, HBM)
            if tier == HBM:
                copies.setdefault(_D2D, []).append((rec, views[i], HBM))
            elif tier == DRAM:
                copies.setdefault(_D2H, []).append((rec, views[i], DRAM))
        tickets = [self._copy_in(p, items, event) for p, items in copies.items()]
        offer_copies.tickets.extend(tickets)
        for rec in reversed(touched):  # the prefix after its new tail: newest of all
            self._touch(rec, now, ctx.deadline_s)
        event_out = tickets[-1].event if tickets else None
        release = ReleaseHandle(offer_copies.done, self._pump, event_out)
        return OfferResult(tuple(tiers_out), tuple(reasons), release)

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
            if self._may_wait():
                return _WAIT, "waiting"  # for a DRAM slot a write-back frees
            self._bump("admission:dram:full")
            if self._state.leaving[DRAM]:  # the allocation started their write-back
                return None, "declined: DRAM full (its pages are being written to NVMe)"
            return None, "declined: DRAM full (every page pinned or in flight)"
        rec.dram_slot = slot
        counters["admission:dram:admitted"] = counters.get("admission:dram:admitted", 0) + 1
        return DRAM, "admitted"

    def _may_wait(self) -> bool:
        """Whether an offered page DRAM has no slot for may wait for one: DRAM pages are
        being written back (each frees its slot when its write lands) and waiting is
        on. Not with ``hbm="engine"``: a page declined there stays in the engine's HBM."""
        return (
            self.config.offer_wait_s > 0 and not self._engine_hbm and self._state.leaving[DRAM] > 0
        )

    def serve_waiting(self) -> None:
        """Give offered pages waiting for DRAM a slot each, oldest first, as write-backs
        free them (one copy per offer); decline one that has waited ``offer_wait_s``,
        or has no write-back left to wait for."""
        queue = self._waiting
        if not queue:
            return
        now = self._now()
        limit = self.config.offer_wait_s
        served: dict[int, tuple[_OfferCopies, Any, list[tuple[PageRec, Any, int]]]] = {}
        while queue:
            item = queue[0]
            rec = item.rec
            if rec.state is not _WAITING or self._pages.get(rec.key) is not rec:
                queue.popleft()  # landed by other means meanwhile, or gone
                item.offer.waiting -= 1
                continue
            if self._orphaned(rec):
                # Its parent was declined after waiting (or left): the offer's prefix
                # rule, applied now. Placed, it could never be reached.
                self._decline_waiting(queue.popleft(), "admission:orphan")
                continue
            slot = self._alloc(DRAM)
            if slot is None:
                if now - item.since < limit and self._state.leaving[DRAM] > 0:
                    break  # a write-back in flight will free one
                self._decline_waiting(queue.popleft(), "admission:dram:full")
                continue
            queue.popleft()
            rec.dram_slot = slot
            group = served.setdefault(id(item.offer), (item.offer, item.event, []))
            group[2].append((rec, item.view, DRAM))
            self._bump("admission:dram:waited")
        for offer, event, items in served.values():
            offer.tickets.append(self._copy_in(_D2H, items, event))
            offer.waiting -= len(items)

    def _orphaned(self, rec: PageRec) -> bool:
        """Its parent is in no tier and not waiting for one."""
        if rec.parent is None:
            return False
        parent = self._pages.get(rec.parent)
        return parent is None or (not parent.tiers and parent.state is not _WAITING)

    def abandon_waiting(self) -> None:
        """Decline every waiting page (the manager is closing): their offers' release
        handles fire once their other copies are done."""
        while self._waiting:
            item = self._waiting.popleft()
            if item.rec.state is _WAITING:
                self._decline_waiting(item, "admission:dram:full")
            else:
                item.offer.waiting -= 1

    def _decline_waiting(self, item: _Waiting, counter: str) -> None:
        """A waiting page, taken off the queue, is declined (counted as ``counter``)."""
        item.offer.waiting -= 1
        item.rec.state = _READY
        self._bump(counter)
        self._forget_if_gone(item.rec)

    def _copy_in(self, path: Path, items: list[tuple[PageRec, Any, int]], event: Any) -> Ticket:
        """One ticket copying an offer's pages on ``path`` into their slots."""
        recs: list[PageRec] = []
        srcs: list[Any] = []
        set_tier = self._set_tier
        tier = items[0][2]  # one tier per path: D2D into HBM, D2H into DRAM
        for rec, src, item_tier in reversed(items):  # the chain's tail enters oldest
            assert item_tier == tier
            if rec.tiers and rec.state is _READY:
                self._busy(rec, _WRITING)
            else:
                rec.state = _WRITING  # busy: in no order yet
            set_tier(rec, tier)
            recs.append(rec)
            srcs.append(src)
        return self._copies.offer(path, tier, recs, srcs, event)

    def offer_done(self, ticket: Ticket, recs: list[PageRec], tier: int) -> None:
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
                self._loads.fire_waiters(rec, ok=True)
        if write_through:
            self._eviction.write_back(write_through, demote=False)

"""Eviction and write-back: making room in each tier, and NVMe's writes.

``Eviction`` frees slots (docs/tiering.md, "Eviction"): at once for an allocation
(clean pages first, then pages NVMe declines, then a batch), down to the low
watermark in the control cycle, and ahead of need (HBM's pre-demotion, DRAM's clean
reserve). Victims' last copies go down a tier or are dropped by admission; DRAM ->
NVMe writes are paced at one second of measured write bandwidth, an emergency sheds
load when the disk falls behind, and NVMe frees on allocation (a delete). The
completions of demotions and write-backs land here too. State under the manager's
lock; every change of a page's tiers goes through ``TierState``.

Here: ``Eviction`` (allocation, the control cycle, victims, work ahead of need,
demotion completions); the writes to NVMe (write-back, its pacing, NVMe room, the
emergency, the DWPD budget, write completions) are its base class,
``EvictionWrites`` (evict_writes.py).
"""

from __future__ import annotations

import math
import operator
from collections import deque
from collections.abc import Callable

from kvstore.tiering.config import TierConfig
from kvstore.tiering.copies import Copies
from kvstore.tiering.cost import Bandwidth
from kvstore.tiering.evict_writes import EvictionWrites, FireWaiters
from kvstore.tiering.measure import Measurements
from kvstore.tiering.mover_api import Mover, Ticket
from kvstore.tiering.nvme import NvmeTier
from kvstore.tiering.pages import ABOVE_NVME, DRAM, HBM, NVME, TIER_NAMES, PageRec, PageState
from kvstore.tiering.policy import EvictionOrder
from kvstore.tiering.state import TierState
from kvstore.tiering.value import Valuation

__all__ = ["Eviction", "copyable"]

BATCH = 64  # pages per eviction batch at most
# The DRAM clean reserve's growth per allocation that found none, its ceiling, and
# the time constant of its decay back to 1 - watermark_low (chosen by `kvstore sim`).
_RESERVE_STEP = 0.1
_RESERVE_MAX = 0.5
_RESERVE_DECAY_S = 1200.0
# The clean reserve covers twice the largest offer seen (each page of a burst may
# need a DRAM slot for itself and one for the HBM page it displaces), up to this
# share of DRAM: a DRAM of a few bursts is otherwise full of dirty pages when the
# next burst comes, and declines it. No more: every clean DRAM page is also a copy on
# NVMe, so the reserve takes its size out of NVMe's distinct pages (at 0.75 of a DRAM
# a fifth of NVMe's size, `multi-turn` at 0.005,0.02,0.1 ran NVMe 12% duplicates and
# had 6 pp fewer hits than an exclusive chain; `kvstore sim --suite`, docs/tiering.md).
_RESERVE_BURST_MAX = 0.25
# ... and up to this share while NVMe has room for the copies (below its low
# watermark): a small DRAM then takes a burst of nearly its size after the last one.
_RESERVE_ROOM_MAX = 0.75
# A clean-reserve scan that found no page NVMe would take waits 1, 2, 4, ... up to this
# many control cycles before the next (until the write gate or the displacement rule
# moves): `system-prompts` spent 90% of a replay scanning DRAM for nothing. (64: the
# tuning suite 48 of 75, 8: 49; `kvstore sim --suite`, docs/tiering.md.)
_PRECLEAN_BACKOFF_MAX = 8
_READY, _EVICTING = PageState.READY, PageState.EVICTING


class Eviction(EvictionWrites):
    """Room in every tier: victims, demotions, write-back, pacing and the emergency."""

    def __init__(
        self,
        config: TierConfig,
        state: TierState,
        value: Valuation,
        *,
        nvme: NvmeTier,
        copies: Copies,
        mover: Mover,
        bandwidth: dict[str, Bandwidth],
        measure: Measurements,
        now: Callable[[], float],
    ) -> None:
        self.config = config
        self._state = state
        self._nvme = nvme
        self._nvme_enabled = nvme.enabled
        self._copies = copies
        self._mover = mover
        self._bandwidth = bandwidth
        self._measure = measure
        self._now = now
        self._capacity = state.capacity
        self._used = state.used
        self._leaving = state.leaving
        self._slot_bytes = state.slot_bytes
        self._orders = state.orders
        self._clean_hbm = state.clean_hbm
        self._clean_dram = state.clean_dram
        self._hbm = state.hbm
        self._dram = state.dram
        self._owned_hbm = state.owned_hbm
        self._above_nvme_mask = state.above_nvme_mask
        self._counters = state.counters
        self._bump = state.bump
        self._set_tier = state.set_tier
        self._clear_tier = state.clear_tier
        self._busy = state.busy
        self._settle = state.settle
        self._leave = state.leave
        self._stay = state.stay
        self._enter_order = state.enter_order
        self._forget_if_gone = state.forget_if_gone
        self._admission = value.admission
        self._tau = value.tau
        self._value_admits_nvme = value.admits_nvme
        self._displacement = value.displacement
        self._nvme_victim_at: tuple[float, PageRec | None] = (-1.0, None)
        self._value_density = value.value_density
        self._payoff = value.payoff
        self._seen = value.reuse.seen
        # Loads' waiters on a page that landed (set by the manager: loads come after).
        self.fire_waiters: FireWaiters = _no_waiters
        # The share of DRAM kept clean: 1 - watermark_low, more while allocations find
        # no clean page (write-heavy traffic), decaying back when they stop.
        self.dram_reserve = 1.0 - config.watermark_low
        self.burst_pages = 0  # the most pages one offer brought (the reserve's floor)
        self._reserve_at = 0.0
        # The clean reserve's scans that found nothing: cycles to skip, the next wait,
        # and the admission state they found nothing under (see _preclean).
        self._preclean_skip = 0
        self._preclean_backoff = 0
        self._preclean_epoch: tuple[int, bool] = (0, False)
        # Whether the last empty scan saw all of DRAM's order, and DRAM's arrivals then.
        self._preclean_whole = False
        self._preclean_arrivals = 0
        self.emergency = False
        self._emergency_offers = 0
        self._nvme_reserved = 0  # bytes of NVMe writes in flight (room taken)
        self._batch_write_bytes = 0  # write-back chosen in this eviction batch, not queued yet
        self.nvme_written = [0, 0]  # pages, bytes
        self._write_window: deque[tuple[float, int]] = deque()

    # -- allocation --------------------------------------------------------------

    def alloc(self, tier: int) -> int | None:
        """A slot in HBM or DRAM, evicting at once if the tier is full; None: no room."""
        arena = self._hbm if tier == HBM else self._dram
        slot: int | None = arena.alloc()
        if slot is None:
            self._evict_now(tier)
            slot = arena.alloc()
        return slot

    def alloc_many(self, tier: int, n: int) -> list[int] | None:
        """``n`` slots in HBM or DRAM for one read (the remote tier's lookups), evicting
        for the whole shortfall at once where the tier lacks them instead of two pages
        per slot; None (and nothing taken): not ``n`` to be had. Victims by
        ``alloc``'s rules (clean copies first, then pages NVMe declines, then a batch;
        never a pinned page, one with waiters, or one in flight); a pass frees what it
        can, a chain tail first and then up it in the same scan (``_eligible``'s
        ``chains``), and the next asks for what is still short, until a pass frees
        nothing. The single-node paths allocate with ``alloc``:
        their decisions are unchanged."""
        arena = self._hbm if tier == HBM else self._dram
        free = arena.free_slots()
        while free < n:
            self._evict_now(tier, n - free, chains=True)
            freed = arena.free_slots()
            if freed <= free:  # nothing more can go now
                return None
            free = freed
        slots: list[int] = []
        for _ in range(n):
            slot = arena.alloc()
            if slot is None:  # taken meanwhile (another thread's pool)
                for taken in slots:
                    arena.free(taken)
                return None
            slots.append(slot)
        return slots

    def _eligible(self, tier: int, force: bool, chains: bool = False) -> Callable[[PageRec], bool]:
        """Whether a page may be a victim of ``tier`` now. ``chains`` (DRAM, for a
        caller that evicts every page it is given, in order): a page whose resident
        children in DRAM were all given out already in this scan is a leaf as well, so
        a chain goes tail first in one scan instead of one page per scan (a remote
        read's 64 slots in a DRAM of 64-page chains: ~60 scans of the whole order)."""
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
        if chains and tier == DRAM:
            given: dict[bytes, int] = {}  # parent key -> its children given out

            def eligible_in_chains(rec: PageRec) -> bool:
                if rec.pins or rec.waiters or rec.state is not _READY:
                    return False
                if resident(rec) > given.get(rec.key, 0):
                    return False
                if not force and now - rec.promoted_at_s < hysteresis:
                    return False
                # Counted in its parent's resident children (state.py's rule): in
                # DRAM, not leaving it, no NVMe copy. Gone, it leaves the parent a leaf.
                parent = rec.parent
                if parent is not None and not rec.leaving & 2 and not rec.tiers & 4:
                    given[parent] = given.get(parent, 0) + 1
                return True

            return eligible_in_chains

        def eligible(rec: PageRec) -> bool:
            if rec.pins or rec.waiters or rec.state is not _READY:
                return False
            if resident(rec) and (below is None or not below(rec)):
                return False
            return force or now - rec.promoted_at_s >= hysteresis

        return eligible

    def _evict_now(self, tier: int, batch: int = 2, *, chains: bool = False) -> None:
        """A slot is wanted at once: free a batch of pages that can go without a copy
        (HBM/DRAM pages with a copy below, or not worth keeping); for DRAM, demote the
        rest in the background (HBM starts no demotion here). ``batch``: 2 for one
        slot (a bigger batch leaves slots empty that an exclusive chain would fill,
        measured by `kvstore sim`); ``alloc_many`` asks for its whole shortfall."""
        scan = max(64, 2 * batch)  # 64 for one slot, as always
        payoff = self._payoff
        displacement = self._displacement
        # While NVMe declines some pages (a class of the payoff gate, or the
        # displacement rule), a page it declines frees a slot as cheaply as a clean one.
        closed = (payoff is not None and not all(payoff.open)) or (
            displacement is not None and displacement.on
        )
        if tier == DRAM and closed and self._evict_cheapest_dram(batch, scan):
            return
        clean_list = self._clean_hbm if tier == HBM else self._clean_dram
        # Pages with a copy below go at once (lowest rank first, as any victim); a
        # demotion would free nothing now. (An empty list answers none.)
        clean = clean_list.take(batch, _freeable, scan)  # each one is cleared below
        if clean:
            clear = self._clear_tier
            for rec in clean:
                clear(rec, tier)
            counter = _EVICT_CLEAN[tier]
            counters = self._counters
            counters[counter] = counters.get(counter, 0) + len(clean)
            return
        if tier == HBM:
            # No HBM page with a DRAM copy: the offer's page goes to DRAM instead. A
            # demotion started here would free its slot only when the copy lands,
            # after the offer, and the slot would stay empty until the next one
            # (`kvstore sim --generate agent` at 0.01: HBM ran a third empty). HBM is
            # renewed by the control cycle (pre-demotion, the watermarks).
            self._bump("alloc:hbm:no_clean")
            return
        if tier == DRAM:
            # The clean reserve ran dry: grow it (it decays back in the control cycle).
            ceiling = max(_RESERVE_MAX, 1.0 - self.config.watermark_low)
            self.dram_reserve = min(ceiling, self.dram_reserve + _RESERVE_STEP)
            self._bump("dram:reserve_dry")
        if tier == DRAM and self._nvme_enabled:
            # Next best: a leaf NVMe declines — dropping it frees the slot now, where
            # a page NVMe wants would only queue a write.
            eligible = self._eligible(DRAM, False, chains)
            droppable = self._orders[DRAM].take(  # each one is cleared below
                batch, lambda r: eligible(r) and self._droppable(r), 4 * scan
            )
            if not droppable:
                # No such leaf near the head (chains NVMe declines, e.g. a disk slower
                # than recompute): drop the lowest page NVMe declines even with
                # children in DRAM. They become unreachable and go as leaves later;
                # stalling instead would decline every new page.
                droppable = self._orders[DRAM].take(
                    1, lambda r: copyable(r) and self._droppable(r), 64
                )
                if droppable:
                    self._bump("evict:dram:not_leaf")
            for rec in droppable:
                self._clear_tier(rec, DRAM)
                self._bump("evict:dram:dropped")
                self._declined(rec)
                self._forget_if_gone(rec)
            if droppable:
                return
        self._evict_to(tier, None, force=False, batch=batch, chains=chains)

    def _evict_cheapest_dram(self, batch: int, scan: int = 64) -> bool:
        """While the payoff gate keeps a class of pages off NVMe, a dirty page NVMe
        declines frees its DRAM slot as cheaply as a clean one: free the lowest-ranked
        of both. (Clean first would free exactly the pages worth writing, the only
        clean ones, and serve them from NVMe.) False: no such dirty page near the head."""
        order = self._orders[DRAM]
        score = getattr(order, "score", None)
        if score is None:  # an order without a rank (ARC): clean first, as before
            return False
        eligible = self._eligible(DRAM, False)
        droppable = self._droppable
        drops = order.victims(batch, lambda r: eligible(r) and droppable(r), scan)
        if not drops:
            return False
        clean = self._clean_dram.victims(batch, _freeable, scan)
        ranked = sorted(
            [(score(r), True, r) for r in clean] + [(score(r), False, r) for r in drops],
            key=lambda entry: entry[0],
        )
        freed = 0
        for _, is_clean, rec in ranked:
            if freed >= batch:
                break
            if not rec.in_tier(DRAM):  # listed twice (clean and declined): freed already
                continue
            freed += 1
            self._clear_tier(rec, DRAM)
            if is_clean:
                self._bump("evict:dram:clean")
            else:
                self._bump("evict:dram:dropped")
                self._bump(self._declined_why(rec))
                self._declined(rec)
                self._forget_if_gone(rec)
        return True

    # -- the control cycle -------------------------------------------------------

    def cycle(self, now: float, usage: tuple[float, float, float]) -> None:
        """The control cycle's eviction: batches down to the low watermark where a
        slot cannot be freed at once, HBM's pre-demotion, DRAM's clean reserve."""
        config = self.config
        # Batch eviction only where a slot cannot be freed at once: a tier with
        # clean pages (a copy below) frees one the moment it is wanted, and NVMe
        # frees on allocation (a delete). See docs/tiering.md, "Eviction".
        for tier, clean_list in ((HBM, self._clean_hbm), (DRAM, self._clean_dram)):
            if (tier == HBM and not self._owned_hbm) or len(clean_list):
                continue
            if (
                tier == DRAM
                and usage[DRAM] >= config.watermark_warn
                and self._dram_leaves_unwritten()
                and self._droppable_at_head(1, 64)
            ):
                # Where DRAM's pages leave unwritten, a victim frees its slot the moment
                # an allocation wants one (it is dropped): evicted ahead, it would only
                # leave the slot empty until then (`kvstore sim --generate agent
                # --capacity 0.01,0.05,0`: DRAM ran 87% full, hit ratio 0.487; 0.798
                # kept full). Where NVMe takes some pages, the eviction ahead stays:
                # the suite's runs were measured with it (docs/tiering.md).
                continue
            if usage[tier] >= config.watermark_warn:
                force = usage[tier] >= config.watermark_force
                self._evict_to(tier, config.watermark_low, force=force)
        if self._owned_hbm and usage[HBM] >= config.watermark_low:
            self._predemote()
        base = 1.0 - config.watermark_low
        if self.dram_reserve > base:
            decay = math.exp(-max(now - self._reserve_at, 0.0) / _RESERVE_DECAY_S)
            self.dram_reserve = base + (self.dram_reserve - base) * decay
        reserve = self.dram_reserve
        dram = self._capacity[DRAM]
        if self.burst_pages and dram:
            burst = 2 * self.burst_pages * self._slot_bytes / dram
            self.dram_reserve = reserve = max(reserve, min(burst, _RESERVE_BURST_MAX))
            # While NVMe has room below its low watermark, the reserve's copies cost
            # it no distinct page: cover the burst further, up to the old 0.75 (not
            # kept: the room is gone once NVMe fills, and the reserve with it).
            room = config.watermark_low * self._capacity[NVME] - self._used[NVME]
            if room > 0 and burst > reserve:
                reserve = max(reserve, min(burst, _RESERVE_ROOM_MAX, reserve + room / dram))
        self._reserve_at = now
        if usage[DRAM] >= 1.0 - reserve:
            self._preclean(reserve)

    def _evict_to(
        self,
        tier: int,
        low: float | None,
        *,
        force: bool,
        batch: int = BATCH,
        chains: bool = False,
    ) -> int:
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
        if tier == NVME:
            return self._delete_nvme(order, want, force)
        choose = order.victims
        done = 0
        for _ in range(4):  # a chain frees its tail first: a few rounds per batch
            victims = choose(want - done, self._eligible(tier, force, chains), want * 8 + 64)
            if not victims and not force and done == 0:
                victims = choose(want, self._eligible(tier, True, chains), want * 8 + 64)
                if victims:
                    self._bump("hysteresis_overridden", len(victims))
            if not victims and urgent and done == 0:
                # A slot is wanted now and the head of the order held no page that may
                # go: look further (see _DEEP_SCAN).
                victims = choose(want, self._eligible(tier, force, chains), _DEEP_SCAN)
                if victims:
                    self._bump(f"alloc:{TIER_NAMES[tier]}:deep_scan")
            if not victims:
                break
            writes: list[PageRec] = []
            demoted: list[PageRec] = []
            blocked = False
            for rec in victims:
                if tier == DRAM:
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
                self.write_back(writes, demote=True)
            if demoted:
                self._submit_demotions(demoted)
            if blocked or done >= want:
                break
        return done

    def _dram_leaves_unwritten(self) -> bool:
        """DRAM's victims leave unwritten, as a rule: there is no NVMe, loading from it
        is slower than recomputing a page at context 0 (κ < 1: only deep pages may still
        pay), or the payoff gate has closed every class. (``_droppable_at_head`` asks
        page by page: retained pages and deep ones may still be written.)"""
        payoff = self._payoff
        return (
            not self._nvme_enabled
            or self._measure.gated[NVME]
            or (payoff is not None and not any(payoff.open))
        )

    def _droppable_at_head(self, n: int, scan: int) -> list[PageRec]:
        """Up to ``n`` of DRAM's lowest-ranked pages that would leave unwritten with no
        other copy (NVMe declines them, or there is no NVMe): an allocation frees their
        slots at once, as it does clean pages'."""
        other_copy = self._above_nvme_mask
        eligible = self._eligible(DRAM, False)
        droppable = self._droppable if self._nvme_enabled else _always
        return self._orders[DRAM].victims(
            n, lambda r: not r.tiers & other_copy and eligible(r) and droppable(r), scan
        )

    def _delete_nvme(self, order: EvictionOrder, want: int, force: bool) -> int:
        """Delete ``want`` NVMe victims, one at a time: NVMe's order holds leaves only,
        and a victim's parent becomes a leaf when the victim goes, ranked right after
        it (same access, one page shallower). Taken as a batch, the victims would be
        the leaves there now, a live chain's newest pages among them, while an older
        chain still had pages to give (`kvstore sim --generate agent` at the smallest
        capacity: 22 pp of hits). Pages NVMe alone holds go first: deleting the copy
        of a page HBM or DRAM still holds frees room but leaves that page to be
        written again (`--generate mixed`: 10,000 more writes for no hit)."""
        eligible = self._eligible(NVME, force)

        def nvme_only(rec: PageRec) -> bool:
            return not rec.tiers & ABOVE_NVME and eligible(rec)

        scan = want * 8 + 64
        done = 0
        while done < want:
            victims = order.take(1, nvme_only, scan) or order.take(1, eligible, scan)
            if not victims:
                break
            self._evict_nvme(victims[0])
            done += 1
        return done

    # -- victims -------------------------------------------------------------------

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
        slot = self.alloc(DRAM)
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
        self._copies.demote(recs, keep)
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
        if self.emergency and not rec.retained:
            self._clear_tier(rec, DRAM)
            self._bump("evict:dram:emergency")
            self._bump("emergency_evictions")
            self._forget_if_gone(rec)
            return True
        if not self._admits_nvme(rec) and not self._engine_keeps(rec):
            self._clear_tier(rec, DRAM)
            self._bump("evict:dram:dropped")
            self._declined(rec)
            # Why: every page is below a κ < 1 (loading slower than recomputing),
            # writes of this page's class are not read back (the payoff gate), or
            # this one's value density is below τ.
            self._bump(self._declined_why(rec))
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
        # (After the pacing check: making room deletes NVMe pages, for a write that
        # pacing would have dropped.)
        if urgent and not rec.retained and not rec.tiers & 1 and not self._nvme_room(rec):
            # NVMe is full of pages that cannot go now (pinned, being read or written):
            # the write could not start, and the slot would stay taken. A slot wanted
            # now (a demand read staging NVMe pages, an offer) drops the page instead,
            # as when the disk falls behind. (A load of NVMe pages into a DRAM full of
            # such pages failed every page for want of a slot: the tier state machine.)
            self._clear_tier(rec, DRAM)
            self._bump("evict:dram:no_room")
            self._forget_if_gone(rec)
            return True
        self._bump("admission:nvme:admitted")
        rec.demoted_at_s = now
        writes.append(rec)
        return True

    def _nvme_room(self, rec: PageRec) -> bool:
        """Whether NVMe has or can make room for ``rec``'s write beside the writes
        already taken (deleting its victims as the write would)."""
        need = self._used[NVME] + self._nvme_reserved + self._batch_write_bytes + rec.nbytes
        over = need - self._capacity[NVME]
        return over <= 0 or self._make_nvme_room(over) <= 0

    def _admits_nvme(self, rec: PageRec) -> bool:
        """NVMe admission: value density and the payoff gate (``Valuation``), then, into
        a full NVMe, the displacement rule against the page the write would delete."""
        if not self._value_admits_nvme(rec):
            return False
        displacement = self._displacement
        if displacement is None or not displacement.on or rec.retained:
            return True
        need = self._used[NVME] + self._nvme_reserved + rec.nbytes
        if need <= self._capacity[NVME]:
            return True  # room: the write displaces nothing
        victim = self._nvme_victim()
        return victim is None or displacement.admits(rec.key, victim.key)

    def _nvme_victim(self) -> PageRec | None:
        """The page NVMe would delete next (``_delete_nvme``'s choice), looked up once
        per ``_VICTIM_TTL_S`` while it is still on NVMe: a control cycle's clean reserve
        asks about dozens of candidates at once (each lookup is a scan of NVMe's order:
        2.8 us, against 0.4 us for the cached one)."""
        now = self._now()
        at, victim = self._nvme_victim_at
        if 0.0 <= now - at < _VICTIM_TTL_S and (victim is None or victim.in_tier(NVME)):
            return victim
        eligible = self._eligible(NVME, True)
        order = self._orders[NVME]
        found = order.victims(
            1, lambda r: not r.tiers & ABOVE_NVME and eligible(r), 64
        ) or order.victims(1, eligible, 64)
        victim = found[0] if found else None
        self._nvme_victim_at = (now, victim)
        return victim

    def _droppable(self, rec: PageRec) -> bool:
        """A dirty DRAM page that may leave unwritten: NVMe declines it."""
        return not self._admits_nvme(rec) and not self._engine_keeps(rec)

    def _engine_keeps(self, rec: PageRec) -> bool:
        """hbm="engine": a page the engine's GPU also holds is written when value
        density admits it, whatever the payoff gate. (Its GPU copy is no copy the
        manager can serve: dropped from DRAM, the page would be forgotten while the
        engine still holds it.)"""
        if self._owned_hbm or not rec.tiers & 1 or self._payoff is None:
            return False
        return self._admission.admit(rec, NVME, self._seen(rec.key), self._tau.tau[NVME])

    def _declined_why(self, rec: PageRec) -> str:
        """The counter of why NVMe declined ``rec``."""
        if self._measure.gated[NVME]:
            return "admission:nvme:kappa_below_1"
        if self._payoff is not None and not self._payoff.admits(self._seen(rec.key)):
            return "admission:nvme:no_payoff"
        if self._displacement is not None and self._value_admits_nvme(rec):
            return "admission:nvme:displaced"
        return "admission:nvme:below_tau"

    def _declined(self, rec: PageRec) -> None:
        """A dirty page left DRAM unwritten: its ghost measures what a write would pay;
        one the displacement rule kept out is a candidate of its models."""
        if self._payoff is not None and not rec.tiers & 4:
            self._payoff.declined(rec.key, self._seen(rec.key))
        if self._displacement is not None and not rec.tiers & 4 and self._value_admits_nvme(rec):
            self._displacement.candidate(rec.key)

    def _evict_nvme(self, rec: PageRec) -> None:
        self._tau.on_evict(NVME, self._value_density(rec, NVME))
        if self._payoff is not None:
            self._payoff.deleted(rec.key)
        self._clear_tier(rec, NVME)
        if rec.retained:
            self._nvme.release(rec.key)
        self._nvme.delete(rec.key)
        self._bump("evict:nvme:deleted")
        if not rec.tiers:
            self._forget_if_gone(rec)

    # -- ahead of need -------------------------------------------------------------

    def _predemote(self) -> None:
        """Owned HBM: copy the lowest-ranked HBM pages to DRAM while they stay in HBM,
        up to a reserve of (1 - low) of HBM, so an HBM allocation frees a slot at once."""
        cap = self._capacity[HBM]
        reserve = (1.0 - self.config.watermark_low) * cap
        want = int((reserve - len(self._clean_hbm) * self._slot_bytes) // self._slot_bytes)
        if want <= 0:
            return
        want = min(want, BATCH)
        # Copying down makes no hole: any settled, unpinned page will do, leaves or not.
        picked = self._orders[HBM].victims(want, copyable, 4 * want + 64)
        copies: list[PageRec] = []
        for rec in picked:
            if not self._admission.admit(rec, DRAM, 0, self._tau.tau[DRAM]):
                continue
            slot = self.alloc(DRAM)
            if slot is None:
                break
            rec.dram_slot = slot
            self._busy(rec, _EVICTING)  # readable from HBM while the copy runs
            copies.append(rec)
        if copies:
            self._bump("predemoted", len(copies))
            self._submit_demotions(copies, keep=True)

    def _preclean(self, share: float) -> None:
        """Keep a reserve of clean DRAM pages (``share`` of DRAM: the next victims,
        already on NVMe) so an allocation under pressure frees a slot at once instead
        of declining: write back, without evicting, the lowest-ranked dirty pages NVMe
        admits."""
        cap = self._capacity[DRAM]
        reserve = share * cap
        want = int((reserve - len(self._clean_dram) * self._slot_bytes) // self._slot_bytes)
        if want <= 0 or not self._nvme_enabled or self.emergency or self._write_paced():
            return
        want = min(want, BATCH)
        # A scan that found no dirty page NVMe would take waits before the next (1, 2,
        # 4, ... cycles, at most _PRECLEAN_BACKOFF_MAX) while admission stays as it
        # was: DRAM full of pages the write gate declines was scanned 4 x want + 64
        # deep at every cycle, for nothing (`kvstore sim --generate system-prompts`:
        # 16,500 -> 38,200 block accesses/s, the same hits and writes). The gate or
        # the displacement rule moving ends the wait; so does a page arriving in DRAM
        # after an empty scan that saw all of DRAM's order (it never saw the new page:
        # a 4-page DRAM offered a chain while the wait ran on left the chain's root
        # dirty, and the next offer's last page was declined for want of a clean slot).
        payoff, displacement = self._payoff, self._displacement
        epoch = (
            payoff.changes if payoff is not None else 0,
            displacement is not None and displacement.on,
        )
        if epoch != self._preclean_epoch or (
            self._preclean_whole and self._dram_arrivals() != self._preclean_arrivals
        ):
            self._preclean_epoch = epoch
            self._preclean_skip = self._preclean_backoff = 0
        if self._preclean_skip > 0:
            self._preclean_skip -= 1
            return

        other_copy = self._above_nvme_mask

        def dirty(rec: PageRec) -> bool:
            return not rec.tiers & other_copy and copyable(rec) and self._admits_nvme(rec)

        # take: write_back marks every one busy, which removes it from the order.
        order, scan = self._orders[DRAM], 4 * want + 64
        picked = order.take(want, dirty, scan)
        if not picked:
            backoff = min(2 * self._preclean_backoff or 1, _PRECLEAN_BACKOFF_MAX)
            self._preclean_backoff = self._preclean_skip = backoff
            self._preclean_whole = len(order) <= scan
            self._preclean_arrivals = self._dram_arrivals()
            return
        self._preclean_backoff = 0
        self._bump("precleaned", len(picked))
        self.write_back(picked, demote=False)

    def _dram_arrivals(self) -> int:
        """Dirty pages into DRAM so far: offered, placed after waiting, demoted."""
        counters = self._counters
        return (
            counters.get("admission:dram:admitted", 0)
            + counters.get("admission:dram:waited", 0)
            + counters.get("demotions", 0)
        )

    # -- completions ------------------------------------------------------------------

    def demote_done(self, ticket: Ticket, recs: list[PageRec], keep: bool) -> None:
        for rec in recs:
            if ticket.error is not None:
                self._dram.free(rec.dram_slot)
                rec.dram_slot = -1
                self._settle(rec)
                self._stay(rec, HBM)
                self._enter_order(rec, HBM)
                continue
            # The new tier first, then settle: settling first would file the page in
            # HBM's order only for set_tier to move it to the clean list (a stale
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
                self.fire_waiters(rec, ok=True)


def _no_waiters(rec: PageRec, **_: object) -> None:
    raise AssertionError("Eviction.fire_waiters is set by the manager")


_EVICT_CLEAN = tuple(f"evict:{name}:clean" for name in TIER_NAMES)
# How far an eviction that wants a slot now looks down a tier's order when its head held
# no page that may go (pinned, in flight, or a parent whose child is in the tier). Φ is
# not monotone along a chain (the probation term's p(reuse) is per depth class, and an
# entry filed when its class's p was higher stays where it was filed), so the head of
# DRAM's order can be the inner pages of old chains with their leaves further down: `kvstore
# sim --generate long-prompts` without NVMe had 80 non-leaves at the head, a leaf at rank 90,
# and declined 1,724 offered pages for want of a slot.
_DEEP_SCAN = 4096
# How long the displacement rule's NVMe victim is reused (while it stays on NVMe): less
# than any gap between two requests of a trace, so a replay's decisions are per request.
_VICTIM_TTL_S = 0.0005
# PageRec.resident_children[tier], one slot per tier
_RESIDENT_CHILDREN = tuple(operator.attrgetter(f"resident_{name}") for name in TIER_NAMES)


def _always(rec: PageRec) -> bool:
    return True


def _freeable(rec: PageRec) -> bool:
    """A clean copy that can go at once: no pin, no waiter, no copy in flight."""
    return not rec.pins and not rec.waiters and rec.state is _READY


def copyable(rec: PageRec) -> bool:
    """A page whose bytes may be copied to a lower tier now (cleaning, not evicting)."""
    return not rec.pins and not rec.waiters and rec.state is _READY

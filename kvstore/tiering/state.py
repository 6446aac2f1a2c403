"""The tier manager's page state: which tiers hold each page, and the orders over them.

``TierState`` holds what every component of the tier manager reads and changes under
the manager's one lock: the page records (``PageRec``) by key, each tier's eviction
order (leaves only), the clean lists (DRAM pages with their NVMe copy, owned-HBM pages
with their DRAM copy), and per tier the page count, the bytes held and the bytes on
their way out. Its methods are the only way a page's tiers, leaving bits or state
change (docs/tiering.md, "Data structures"): each keeps the orders, the clean lists
and the parents' resident-children counts true at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from kvstore.tiering.arena import SlotPool
from kvstore.tiering.config import TierConfig
from kvstore.tiering.pages import BIT, DRAM, HBM, NVME, PageRec, PageState
from kvstore.tiering.policy import EvictionOrder, make_order

__all__ = ["TierState"]

_READY = PageState.READY


class TierState:
    """Pages, orders and per-tier accounting; the caller holds the manager's lock.

    Grouped by owner (docs/design.md, "The tier manager"): the page table and the
    orders (``pages``, ``orders``, ``clean_dram``, ``clean_hbm``), per tier the pages,
    bytes held, bytes leaving and capacity (``count``, ``used``, ``leaving``,
    ``capacity``), the slot pools, and the counters every component bumps."""

    def __init__(
        self,
        config: TierConfig,
        *,
        hbm: SlotPool,
        dram: SlotPool,
        owned_hbm: bool,
        slot_bytes: int,
        capacity: list[int],
        cost_ratio: Callable[[PageRec], float],
        reuse_p: Callable[[PageRec], float] | None = None,
    ) -> None:
        def order() -> EvictionOrder:
            return make_order(
                config.eviction,
                config.phi_weights,
                config.recency_scale_s,
                cost_ratio,
                config.phi_reuse_weight,
                reuse_p,
            )

        self.pages: dict[bytes, PageRec] = {}
        # Told when a page loses its last copy, with the tier it left last (`kvstore
        # sim`'s miss reasons; None: nobody asks).
        self.on_gone: Callable[[PageRec, int], None] | None = None
        # DRAM pages that also have their NVMe copy (free at once), ranked like DRAM's
        # order: an allocation under pressure takes the lowest (leaving DRAM makes no
        # hole in a prefix while the NVMe copy stays).
        self.clean_dram = order()
        # HBM pages that also have their DRAM copy (owned HBM): the same idea one tier up.
        self.clean_hbm = order()
        self.orders: list[EvictionOrder] = [order() for _ in range(3)]
        self.orders_track_touches = config.eviction == "arc"
        self.count = [0, 0, 0]
        self.used = [0, 0, 0]  # bytes (slots x slot size for HBM/DRAM)
        self.leaving = [0, 0, 0]  # of which: demotions out of the tier in flight
        self.capacity = capacity
        self.hbm = hbm
        self.dram = dram
        self.owned_hbm = owned_hbm
        self.slot_bytes = slot_bytes
        # The tiers the manager can read a page from: with hbm="engine" the HBM bit is
        # the engine's residency, not a copy the manager can load or keep as a backup.
        self.readable_mask = 7 if owned_hbm else 6
        self.above_nvme_mask = 5 if owned_hbm else 4  # a DRAM page's readable other copies
        self.decay_per_s = math.log(2) / config.hit_half_life_s
        self.counters: dict[str, int] = {}

    def bump(self, name: str, by: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + by

    def prefixed(self, prefix: str) -> dict[str, int]:
        n = len(prefix)
        return {k[n:]: v for k, v in self.counters.items() if k.startswith(prefix)}

    def usage(self) -> tuple[float, float, float]:
        """Per tier, the share of capacity held and not already on its way out."""
        cap, used, leaving = self.capacity, self.used, self.leaving
        return (
            (used[0] - leaving[0]) / cap[0] if cap[0] else 0.0,
            (used[1] - leaving[1]) / cap[1] if cap[1] else 0.0,
            (used[2] - leaving[2]) / cap[2] if cap[2] else 0.0,
        )

    def touch(self, rec: PageRec, now: float, deadline_s: float | None, count: float = 1.0) -> None:
        """An access: the page's decayed hits (``count`` more) and reads (one more), its
        recency, and (ARC) its place."""
        age = now - rec.last_access_s
        factor = math.exp(-self.decay_per_s * age) if age > 0 else 1.0
        rec.hits = rec.hits * factor + count
        rec.reads = rec.reads * factor + 1.0
        rec.last_access_s = now
        rec.reused = True
        if deadline_s is not None:
            rec.deadline_s = deadline_s
        tiers = rec.tiers
        if self.orders_track_touches:  # ARC moves a page at its access; Φ/LRU re-rank lazily
            orders = self.orders
            for tier in (HBM, DRAM, NVME):
                if tiers & BIT[tier]:
                    orders[tier].touch(rec)
            if tiers & 6 == 6:
                self.clean_dram.touch(rec)
            if tiers & 3 == 3 and self.owned_hbm:
                self.clean_hbm.touch(rec)

    def page_table_bytes(self) -> int:
        # A PageRec with its slots, key and dict entry: ~ 360 bytes + the key.
        return sum(360 + len(k) for k in self.pages)

    # Only leaves of a tier (no resident child there) sit in its eviction order: the
    # order's head is then always a candidate, and "leaves first" costs nothing.

    # A page "holds" its parent in tier t (the parent's resident_children[t]) while it
    # is in t, not leaving t, and (for DRAM) dirty: a clean DRAM page can go without
    # making a hole, so it never keeps its parent out of DRAM's order. Every change
    # to a page's tiers or leaving bits goes through changed, which settles the
    # parent's counts, the orders and the clean list from the before/after masks.

    def changed(self, rec: PageRec, old_tiers: int, old_leaving: int) -> None:
        """Settle the clean lists and the parent's resident-children counts after
        ``rec``'s tiers or leaving bits changed from ``old_tiers``/``old_leaving``."""
        tiers = rec.tiers
        if self.owned_hbm and (tiers & 3 == 3) != rec.hbm_clean:
            if not rec.hbm_clean:
                rec.hbm_clean = True
                self.clean_hbm.add(rec)
                self.orders[HBM].remove(rec)
            else:
                rec.hbm_clean = False
                self.clean_hbm.remove(rec)
                if tiers & 1:  # still in HBM (enter_order's first test)
                    self.enter_order(rec, HBM)
        clean = tiers & 6 == 6
        if clean != (old_tiers & 6 == 6):
            if clean:
                self.clean_dram.add(rec)
                self.orders[DRAM].remove(rec)
            else:
                self.clean_dram.remove(rec)
                if tiers & 2:  # still in DRAM (enter_order's first test)
                    self.enter_order(rec, DRAM)
        parent_key = rec.parent
        if parent_key is None:
            return
        # _held before and after, inlined (this runs at every tier change)
        held = tiers & ~rec.leaving
        if held & 2 and tiers & 4:
            held &= ~2
        if held & 1 and tiers & 6:
            held &= ~1
        before = old_tiers & ~old_leaving
        if before & 2 and old_tiers & 4:
            before &= ~2
        if before & 1 and old_tiers & 6:
            before &= ~1
        diff = held ^ before
        if not diff:
            return
        parent = self.pages.get(parent_key)
        if parent is None:
            return
        # tier 0, then 1, then 2 (only NVMe's count moves an order: leaves only there)
        if diff & 1:
            if held & 1:
                parent.resident_hbm += 1
            elif parent.resident_hbm > 0:
                parent.resident_hbm -= 1
        if diff & 2:
            if held & 2:
                parent.resident_dram += 1
            elif parent.resident_dram > 0:
                parent.resident_dram -= 1
        if diff & 4:
            if held & 4:
                parent.resident_nvme += 1
                if parent.resident_nvme == 1:
                    # NVMe deletes: only leaves are victims, so a parent waits outside
                    # the order (scanning past it at every eviction would cost more).
                    self.orders[NVME].remove(parent)
            elif parent.resident_nvme > 0:
                parent.resident_nvme -= 1
                if not parent.resident_nvme:
                    self.enter_order(parent, NVME)

    def set_tier(self, rec: PageRec, tier: int) -> None:
        bit = 1 << tier
        tiers = rec.tiers
        if tiers & bit:
            return
        new = tiers | bit
        rec.tiers = new
        self.count[tier] += 1
        # tier_bytes, inlined
        owned = tier == 1 or (tier == 0 and self.owned_hbm)
        self.used[tier] += self.slot_bytes if owned else rec.nbytes
        leaving = rec.leaving
        # enter_order(rec, tier), inlined: a leaf there, settled, staying
        if not leaving & bit and rec.state is _READY:
            if tier == 1:
                enter = not new & 4  # clean: in the clean list
            elif tier == 0:
                enter = not new & 2  # a DRAM copy: in the HBM clean list
            else:
                enter = not rec.resident_nvme  # NVMe: leaves only
            if enter:
                self.orders[tier].add(rec)
        self.changed(rec, tiers, leaving)

    def clear_tier(self, rec: PageRec, tier: int) -> None:
        bit = 1 << tier
        tiers = rec.tiers
        if not tiers & bit:
            return
        rec.tiers = tiers & ~bit
        if not rec.tiers and self.on_gone is not None:
            self.on_gone(rec, tier)
        self.count[tier] -= 1
        owned = tier == 1 or (tier == 0 and self.owned_hbm)  # tier_bytes, inlined
        nbytes = self.slot_bytes if owned else rec.nbytes
        self.used[tier] -= nbytes
        # A page with a copy below is never in the order of DRAM (it is in the clean
        # list), nor of owned HBM: there is nothing to remove (most clears are these).
        if not (tiers & 4 if tier == 1 else tier == 0 and owned and tiers & 2):
            self.orders[tier].remove(rec)
        leaving = rec.leaving
        if leaving & bit:
            rec.leaving = leaving & ~bit
            self.leaving[tier] -= nbytes
        self.changed(rec, tiers, leaving)
        if tier == 0 and rec.hbm_slot >= 0:
            self.hbm.free(rec.hbm_slot)
            rec.hbm_slot = -1
        elif tier == 1 and rec.dram_slot >= 0:
            self.dram.free(rec.dram_slot)
            rec.dram_slot = -1

    def child_created(self, parent: PageRec) -> None:
        """A page got a child record. At its second, the prefix branches there: it and
        its ancestors are shared (Φ's frequency term counts only for shared pages)."""
        parent.children += 1
        if parent.children != 2:
            return
        pages = self.pages
        rec: PageRec | None = parent
        while rec is not None and not rec.shared:
            rec.shared = True
            rec = pages.get(rec.parent) if rec.parent is not None else None

    def busy(self, rec: PageRec, state: PageState) -> None:
        """A copy in or out of the page starts: it is no one's victim until it lands
        (so an order's head is always a candidate, never a page in flight)."""
        if rec.state is _READY:
            tiers = rec.tiers
            orders = self.orders
            if tiers & 1:
                orders[0].remove(rec)
            if tiers & 2:
                orders[1].remove(rec)
            if tiers & 4:
                orders[2].remove(rec)
        rec.state = state

    def settle(self, rec: PageRec) -> None:
        if rec.state is _READY:
            return
        rec.state = _READY
        # enter_order's tests, inlined: a settled page enters each order it belongs in
        all_tiers = rec.tiers
        tiers = all_tiers & ~rec.leaving
        orders = self.orders
        if tiers & 1 and not all_tiers & 2:
            orders[0].add(rec)
        if tiers & 2 and not all_tiers & 4:
            orders[1].add(rec)
        if tiers & 4 and not rec.resident_nvme:
            orders[2].add(rec)

    def enter_order(self, rec: PageRec, tier: int) -> None:
        """``rec`` may be a victim of ``tier`` again (a leaf there, settled, staying)."""
        tiers = rec.tiers
        bit = 1 << tier
        if not tiers & bit or rec.leaving & bit or rec.state is not _READY:
            return
        if tier == 1:
            if tiers & 4:
                return  # clean: in the clean list
        elif tier == 0:
            if tiers & 2:
                return  # a DRAM copy: in the HBM clean list
        elif rec.resident_nvme:
            return  # NVMe: leaves only
        self.orders[tier].add(rec)

    def leave(self, rec: PageRec, tier: int) -> None:
        """A demotion out of ``tier`` began: the parent may go in the same batch."""
        bit = BIT[tier]
        if rec.leaving & bit or not rec.tiers & bit:
            return
        tiers, leaving = rec.tiers, rec.leaving
        rec.leaving = leaving | bit
        self.leaving[tier] += self.tier_bytes(rec, tier)
        self.orders[tier].remove(rec)
        self.changed(rec, tiers, leaving)

    def stay(self, rec: PageRec, tier: int) -> None:
        """A demotion out of ``tier`` did not happen: the page counts as resident again."""
        bit = BIT[tier]
        if not rec.leaving & bit:
            return
        tiers, leaving = rec.tiers, rec.leaving
        rec.leaving = leaving & ~bit
        self.leaving[tier] -= self.tier_bytes(rec, tier)
        self.enter_order(rec, tier)
        self.changed(rec, tiers, leaving)

    def tier_bytes(self, rec: PageRec, tier: int) -> int:
        if tier == NVME or (tier == HBM and not self.owned_hbm):
            return rec.nbytes
        return self.slot_bytes

    def forget_if_gone(self, rec: PageRec) -> None:
        if rec.tiers == 1 and not self.owned_hbm:
            # hbm="engine": the engine's GPU copy alone is no copy the manager can
            # serve; forgotten, its next offer is admitted again (not "present").
            self.clear_tier(rec, HBM)
            self.bump("evict:hbm:forgotten")
        gone = rec.tiers == 0 and rec.pins == 0 and not rec.waiters
        if gone and self.pages.get(rec.key) is rec:
            del self.pages[rec.key]

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

from kvstore.tiering.arena import SlotPool
from kvstore.tiering.pages import BIT, DRAM, HBM, NVME, PageRec, PageState
from kvstore.tiering.policy import EvictionOrder

__all__ = ["TierState"]

_READY = PageState.READY


class TierState:
    """Pages, orders and per-tier accounting; the caller holds the manager's lock."""

    def __init__(
        self,
        *,
        pages: dict[bytes, PageRec],
        orders: list[EvictionOrder],
        clean_dram: EvictionOrder,
        clean_hbm: EvictionOrder,
        count: list[int],
        used: list[int],
        leaving: list[int],
        hbm: SlotPool,
        dram: SlotPool,
        owned_hbm: bool,
        slot_bytes: int,
    ) -> None:
        self._pages = pages
        self._orders = orders
        self._clean_dram = clean_dram
        self._clean_hbm = clean_hbm
        self._count = count
        self._used = used
        self._leaving = leaving
        self._hbm = hbm
        self._dram = dram
        self._owned_hbm = owned_hbm
        self._slot_bytes = slot_bytes

    # Only leaves of a tier (no resident child there) sit in its eviction order: the
    # order's head is then always a candidate, and "leaves first" costs nothing.

    # A page "holds" its parent in tier t (the parent's resident_children[t]) while it
    # is in t, not leaving t, and (for DRAM) dirty: a clean DRAM page can go without
    # making a hole, so it never keeps its parent out of DRAM's order. Every change
    # to a page's tiers or leaving bits goes through _changed, which settles the
    # parent's counts, the orders and the clean list from the before/after masks.

    def _changed(self, rec: PageRec, old_tiers: int, old_leaving: int) -> None:
        """Settle the clean lists and the parent's resident-children counts after
        ``rec``'s tiers or leaving bits changed from ``old_tiers``/``old_leaving``."""
        tiers = rec.tiers
        if self._owned_hbm and (tiers & 3 == 3) != rec.hbm_clean:
            if not rec.hbm_clean:
                rec.hbm_clean = True
                self._clean_hbm.add(rec)
                self._orders[HBM].remove(rec)
            else:
                rec.hbm_clean = False
                self._clean_hbm.remove(rec)
                if tiers & 1:  # still in HBM (_enter_order's first test)
                    self._enter_order(rec, HBM)
        clean = tiers & 6 == 6
        if clean != (old_tiers & 6 == 6):
            if clean:
                self._clean_dram.add(rec)
                self._orders[DRAM].remove(rec)
            else:
                self._clean_dram.remove(rec)
                if tiers & 2:  # still in DRAM (_enter_order's first test)
                    self._enter_order(rec, DRAM)
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
        parent = self._pages.get(parent_key)
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
                    self._orders[NVME].remove(parent)
            elif parent.resident_nvme > 0:
                parent.resident_nvme -= 1
                if not parent.resident_nvme:
                    self._enter_order(parent, NVME)

    def _set_tier(self, rec: PageRec, tier: int) -> None:
        bit = 1 << tier
        tiers = rec.tiers
        if tiers & bit:
            return
        new = tiers | bit
        rec.tiers = new
        self._count[tier] += 1
        # _tier_bytes, inlined
        owned = tier == 1 or (tier == 0 and self._owned_hbm)
        self._used[tier] += self._slot_bytes if owned else rec.nbytes
        leaving = rec.leaving
        # _enter_order(rec, tier), inlined: a leaf there, settled, staying
        if not leaving & bit and rec.state is _READY:
            if tier == 1:
                enter = not new & 4  # clean: in the clean list
            elif tier == 0:
                enter = not new & 2  # a DRAM copy: in the HBM clean list
            else:
                enter = not rec.resident_nvme  # NVMe: leaves only
            if enter:
                self._orders[tier].add(rec)
        self._changed(rec, tiers, leaving)

    def _clear_tier(self, rec: PageRec, tier: int) -> None:
        bit = 1 << tier
        tiers = rec.tiers
        if not tiers & bit:
            return
        rec.tiers = tiers & ~bit
        self._count[tier] -= 1
        owned = tier == 1 or (tier == 0 and self._owned_hbm)  # _tier_bytes, inlined
        nbytes = self._slot_bytes if owned else rec.nbytes
        self._used[tier] -= nbytes
        # A page with a copy below is never in the order of DRAM (it is in the clean
        # list), nor of owned HBM: there is nothing to remove (most clears are these).
        if not (tiers & 4 if tier == 1 else tier == 0 and owned and tiers & 2):
            self._orders[tier].remove(rec)
        leaving = rec.leaving
        if leaving & bit:
            rec.leaving = leaving & ~bit
            self._leaving[tier] -= nbytes
        self._changed(rec, tiers, leaving)
        if tier == 0 and rec.hbm_slot >= 0:
            self._hbm.free(rec.hbm_slot)
            rec.hbm_slot = -1
        elif tier == 1 and rec.dram_slot >= 0:
            self._dram.free(rec.dram_slot)
            rec.dram_slot = -1

    def _child_created(self, parent: PageRec) -> None:
        """A page got a child record. At its second, the prefix branches there: it and
        its ancestors are shared (Φ's frequency term counts only for shared pages)."""
        parent.children += 1
        if parent.children != 2:
            return
        pages = self._pages
        rec: PageRec | None = parent
        while rec is not None and not rec.shared:
            rec.shared = True
            rec = pages.get(rec.parent) if rec.parent is not None else None

    def _busy(self, rec: PageRec, state: PageState) -> None:
        """A copy in or out of the page starts: it is no one's victim until it lands
        (so an order's head is always a candidate, never a page in flight)."""
        if rec.state is _READY:
            tiers = rec.tiers
            orders = self._orders
            if tiers & 1:
                orders[0].remove(rec)
            if tiers & 2:
                orders[1].remove(rec)
            if tiers & 4:
                orders[2].remove(rec)
        rec.state = state

    def _settle(self, rec: PageRec) -> None:
        if rec.state is _READY:
            return
        rec.state = _READY
        # _enter_order's tests, inlined: a settled page enters each order it belongs in
        all_tiers = rec.tiers
        tiers = all_tiers & ~rec.leaving
        orders = self._orders
        if tiers & 1 and not all_tiers & 2:
            orders[0].add(rec)
        if tiers & 2 and not all_tiers & 4:
            orders[1].add(rec)
        if tiers & 4 and not rec.resident_nvme:
            orders[2].add(rec)

    def _enter_order(self, rec: PageRec, tier: int) -> None:
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
        self._orders[tier].add(rec)

    def _leave(self, rec: PageRec, tier: int) -> None:
        """A demotion out of ``tier`` began: the parent may go in the same batch."""
        bit = BIT[tier]
        if rec.leaving & bit or not rec.tiers & bit:
            return
        tiers, leaving = rec.tiers, rec.leaving
        rec.leaving = leaving | bit
        self._leaving[tier] += self._tier_bytes(rec, tier)
        self._orders[tier].remove(rec)
        self._changed(rec, tiers, leaving)

    def _stay(self, rec: PageRec, tier: int) -> None:
        """A demotion out of ``tier`` did not happen: the page counts as resident again."""
        bit = BIT[tier]
        if not rec.leaving & bit:
            return
        tiers, leaving = rec.tiers, rec.leaving
        rec.leaving = leaving & ~bit
        self._leaving[tier] -= self._tier_bytes(rec, tier)
        self._enter_order(rec, tier)
        self._changed(rec, tiers, leaving)

    def _tier_bytes(self, rec: PageRec, tier: int) -> int:
        if tier == NVME or (tier == HBM and not self._owned_hbm):
            return rec.nbytes
        return self._slot_bytes

    def _forget_if_gone(self, rec: PageRec) -> None:
        if rec.tiers == 1 and not self._owned_hbm:
            # hbm="engine": the engine's GPU copy alone is no copy the manager can
            # serve; forgotten, its next offer is admitted again (not "present").
            self._clear_tier(rec, HBM)
        gone = rec.tiers == 0 and rec.pins == 0 and not rec.waiters
        if gone and self._pages.get(rec.key) is rec:
            del self._pages[rec.key]

"""Eviction's writes to NVMe: write-back and its pacing, NVMe room, the emergency.

``EvictionWrites`` is the base class of ``Eviction`` (evict.py, which builds it and
chooses the victims; docs/tiering.md, "Eviction"). Here: DRAM -> NVMe write-back,
paced at one second of measured write bandwidth, with room made on NVMe by deleting
its victims first; the emergency that sheds load while the disk falls behind
(``emergency_write_s`` of writes queued) and the ramp that declines a rising share
of new offers meanwhile; the NVMe writes of the last minute against ``max_dwpd``'s
budget; and the completion of each write-back ticket. State under the manager's
lock; every change of a page's tiers goes through ``TierState``.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvstore.errors import KVStoreError
from kvstore.tiering.arena import SlotPool
from kvstore.tiering.completions import WriteBack
from kvstore.tiering.config import TierConfig
from kvstore.tiering.cost import Bandwidth
from kvstore.tiering.displace import Displacement
from kvstore.tiering.mover_api import Mover, Path, Priority, Ticket
from kvstore.tiering.nvme import NvmeTier
from kvstore.tiering.pages import DRAM, NVME, PageRec, PageState
from kvstore.tiering.payoff import WritePayoff
from kvstore.tiering.policy import EvictionOrder

__all__ = ["EvictionWrites", "FireWaiters"]

_READY, _EVICTING = PageState.READY, PageState.EVICTING
_WRITEBACK = Priority.WRITEBACK
_NVME_WRITE = Path.NVME_WRITE

FireWaiters = Callable[..., None]


class EvictionWrites:
    """NVMe's writes for ``Eviction`` (its base class): write-back, pacing, the
    emergency, the DWPD budget, write completions. The attributes below are set by
    ``Eviction.__init__``."""

    config: TierConfig
    emergency: bool
    nvme_written: list[int]  # pages, bytes
    fire_waiters: FireWaiters
    _mover: Mover
    _nvme: NvmeTier
    _dram: SlotPool
    _bandwidth: dict[str, Bandwidth]
    _now: Callable[[], float]
    _capacity: list[int]
    _used: list[int]
    _slot_bytes: int
    _orders: list[EvictionOrder]
    _clean_dram: EvictionOrder
    _payoff: WritePayoff | None
    _displacement: Displacement | None
    _seen: Callable[[bytes], int]
    _bump: Callable[..., None]
    _busy: Callable[[PageRec, PageState], None]
    _set_tier: Callable[[PageRec, int], None]
    _clear_tier: Callable[[PageRec, int], None]
    _leave: Callable[[PageRec, int], None]
    _stay: Callable[[PageRec, int], None]
    _enter_order: Callable[[PageRec, int], None]
    _settle: Callable[[PageRec], None]
    _forget_if_gone: Callable[[PageRec], None]
    _emergency_offers: int
    _nvme_reserved: int  # bytes of NVMe writes in flight (room taken)
    _batch_write_bytes: int  # write-back chosen in this eviction batch, not queued yet
    _write_window: deque[tuple[float, int]]

    if TYPE_CHECKING:

        def _evict_to(
            self, tier: int, low: float | None, *, force: bool, batch: int = ...
        ) -> int: ...  # Eviction's: victims of ``tier``

    # -- write-back -----------------------------------------------------------------

    def _write_paced(self) -> bool:
        """Write-back stops queueing at one second of measured write bandwidth."""
        queued = self._mover.in_flight_bytes(_NVME_WRITE) + self._batch_write_bytes
        return queued > self._bandwidth["nvme_write"].rate

    def write_back(self, recs: list[PageRec], *, demote: bool) -> None:
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
        busy = self._busy
        displacement = self._displacement
        for rec in recs:
            if displacement is not None:
                displacement.candidate(rec.key)
            busy(rec, _EVICTING)
            if demote:
                self._leave(rec, DRAM)
        self._nvme.write(recs, self._dram, _WRITEBACK, WriteBack(recs, demote))

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

    # -- the disk falling behind --------------------------------------------------------

    def check_emergency(self) -> None:
        in_flight = self._mover.in_flight_bytes(_NVME_WRITE)
        limit = self.config.emergency_write_s * self._bandwidth["nvme_write"].rate
        was = self.emergency
        self.emergency = in_flight > limit
        if self.emergency and not was:
            self._bump("emergency:entered")
            # Free clean DRAM in bulk: pages that already have their NVMe copy.
            low = self.config.watermark_low * self._capacity[DRAM]
            # (Pages with an NVMe copy are in the clean list, never in DRAM's order.)
            clean = [
                rec
                for rec in self._clean_dram.unordered()
                if rec.in_tier(NVME) and rec.pins == 0 and not rec.waiters and rec.state is _READY
            ]
            for rec in clean:
                if self._used[DRAM] <= low:
                    break
                self._clear_tier(rec, DRAM)
                self._bump("emergency_evictions")

    def ramp_drop(self) -> bool:
        """In an emergency, decline a rising share of new offers (1 in 2, then more)."""
        self._emergency_offers += 1
        in_flight = self._mover.in_flight_bytes(_NVME_WRITE)
        limit = self.config.emergency_write_s * self._bandwidth["nvme_write"].rate
        over = min(in_flight / limit - 1.0, 1.0) if limit else 1.0
        keep_every = max(1, int(1 / max(1.0 - over, 1e-3)))
        return self._emergency_offers % keep_every != 0 or over >= 1.0

    def write_over_budget(self, now: float) -> float:
        """NVMe writes of the last minute against ``max_dwpd``'s rate (1.0: at it)."""
        if self.config.max_dwpd is None or not self._capacity[NVME]:
            return 0.0
        window = self._write_window
        while window and now - window[0][0] > 60.0:
            window.popleft()
        written = sum(n for _, n in window)
        span = max(now - window[0][0], 1.0) if window else 1.0
        budget = self.config.max_dwpd * self._capacity[NVME] / 86400.0
        return (written / span) / budget if budget > 0 else 0.0

    def write_done(self, ticket: Ticket, recs: list[PageRec], demote: bool) -> None:
        results = ticket.results
        now = self._now()
        window_kept = self.config.max_dwpd is not None
        for index, rec in enumerate(recs):
            stored = ticket.error is None and results is not None and results[index]
            self._nvme_reserved -= rec.nbytes
            if stored:
                self.nvme_written[0] += 1
                self.nvme_written[1] += rec.nbytes
                if window_kept:  # read only against a DWPD budget
                    self._write_window.append((now, rec.nbytes))
                # Before settling, as in demote_done: a page that turns clean goes
                # to the clean list without a stop in DRAM's order.
                self._set_tier(rec, NVME)
                if self._payoff is not None:
                    self._payoff.written(rec.key, self._seen(rec.key))
                if rec.retained:
                    with contextlib.suppress(KVStoreError):
                        self._nvme.retain(rec.key)
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
                self.fire_waiters(rec, ok=True)

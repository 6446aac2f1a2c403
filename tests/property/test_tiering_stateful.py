"""The tier manager against a model, under random offer/lookup/load/pin/step/reopen.

A real NVMe store in a temporary directory, ``device="cpu"`` and tiny tiers (HBM 3
slots, DRAM 6 slots, 16 KiB pages, low watermarks) so pages flow down to NVMe and
back within a few steps. Keys form three chains of six pages; offers send a run of
a chain with its parent links, so prefix closure is exercised on every offer.

The model is ``key -> bytes``: the bytes the manager holds for a resident page.
Keys are content hashes to the manager (an offer of a present page may copy the
offered bytes into HBM beside the old copy), so while the model holds a key it is
offered again with the model's bytes; only a key gone from every tier is offered
with new bytes (and a new size). A key offered while resident is "present"; a key
offered while absent is admitted with the offered bytes or declined. Whether a key is
resident is asked of the manager (``pin`` answers False for a page in no tier,
and a successful pin is undone at once); a model key found absent was dropped
and leaves the model. Checked after every step:

- per tier, used bytes <= capacity bytes;
- a resident key is in the model (nothing resurrects, nothing appears unoffered);
- a page pinned with ``pin``, and a page an unfinished load still waits for, stays
  resident and loses no tier (white-box: ``tm._pages``);
- every completed load yields exactly the model's bytes, as of ``prepare_load``;
- no orphan is admitted: an admitted page's parent was resident before the offer
  or admitted / present earlier in the same batch;
- after ``drain``, the NVMe tier's page count is the store's key count (and the
  measurement's probe page, which a gated NVMe holds, is not one of its pages).

Close-and-reopen keeps exactly the pages the store holds (asked with
``store.info`` before the close) and nothing else.

With admission ``all`` nothing may drop a page but NVMe capacity, write pressure
or a failed copy (NVMe is unbounded here): a model key that stops being resident
must be matched by one of the manager's drop counters (``LOSSY``), so "admitted
pages stay resident somewhere" is checked, not assumed.

``hbm="engine"`` (the engine keeps its own GPU cache; the manager's HBM bit is the
engine's residency and an offer copies the page into DRAM): the machine plays the
engine's cache, ``engine``, the accepted keys of its offers, least recent first,
at most ``ENGINE_HBM_PAGES``; it reports what it drops with
``notify_hbm_evicted``, past its capacity and in a rule of its own. The manager
cannot read that copy, so "resident" there means a DRAM or NVMe copy, and also:

- the manager's HBM bit is set only for keys the engine holds, and for every one of
  them but those it forgot whole when NVMe declined their last copy it can read
  (docs/tiering.md, R7), each counted in ``evict:hbm:forgotten`` when it happened
  (``notify_hbm_evicted`` of a key it does not hold changes nothing);
- HBM's used bytes are the engine's pages' bytes, within ``hbm_bytes``;
- no page is in HBM alone: the manager keeps a copy it can serve of every page the
  engine holds, so after ``notify_hbm_evicted`` the page is still loadable from
  DRAM or NVMe (what owned HBM would keep by demoting it);
- pins and unfinished loads keep the manager's own copies (the engine's bit is the
  engine's to clear).

Machines: admission ``all`` and the default ``value_density``, each with
``hbm="owned"`` and ``hbm="engine"``; then, with ``value_density``, the displacement
rule held on over a bounded NVMe, NVMe held gated (owned and engine HBM), the store on
its thread-pool engine and without O_DIRECT: the fallbacks get the same invariants.
Set KVSTORE_TIER_EXAMPLES (default 20) for a longer soak.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.testing.tier_crash import ENGINE_DRAM_DROP_DEFECT, ENGINE_DRAM_DROPS, LOSSY
from kvstore.tiering import LoadHandle, ModelCost, TierConfig, TierManager
from kvstore.tiering.cost import Bandwidth
from kvstore.tiering.measure import PROBE_KEY
from kvstore.tiering.pages import PageState
from tests.unit.tiering.test_tiering_displace import hold_on

PAGE = 16 * 1024
CHAINS = 3
CHAIN_PAGES = 6
SMALL_MODEL = ModelCost(1e9, 8, 8, 64, PAGE // 16)
HBM_PAGES = 3
ENGINE_HBM_PAGES = HBM_PAGES  # the engine's own GPU cache, in pages of at most PAGE
# LOSSY: the manager's counters of drops of a page's last copy that admission ``all``
# allows (NVMe capacity, write pressure, failed copies; not admission drops, as every
# tier admits). ENGINE_DRAM_DROP_DEFECT: the known defect of hbm="engine" (the xfail
# test at the end): a DRAM eviction that drops a page the engine holds (counted in
# ENGINE_DRAM_DROPS) leaves it in HBM alone, where the manager cannot read it, yet its
# offers answer "present", and notify_hbm_evicted loses it. While the flag is True the
# machines accept such pages, at most one per counted drop (an event names them).


def chain_key(chain: int, position: int) -> bytes:
    return f"c{chain}p{position}".encode()


ALL_KEYS = [chain_key(c, p) for c in range(CHAINS) for p in range(CHAIN_PAGES)]
SIZES = st.sampled_from([PAGE, PAGE, 4096, 10_000, 1])

SETTINGS = settings(
    max_examples=int(os.environ.get("KVSTORE_TIER_EXAMPLES", "20")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def page_bytes(key: bytes, version: int, size: int) -> bytes:
    """Distinct bytes per (key, version): any bytes a load returns can be named."""
    return random.Random(f"{key!r}/{version}").randbytes(size)


Load = tuple[LoadHandle, list[bytes], list[torch.Tensor], list[bytes]]


class TierMachine(RuleBasedStateMachine):
    """The rules; subclasses choose the admission mode and who owns HBM."""

    admission: ClassVar[str] = "all"
    hbm: ClassVar[str] = "owned"

    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="kvstore-tier-stateful-"))
        self.model: dict[bytes, bytes] = {}
        # offered pages waiting for a DRAM slot (reason "waiting"): modelled once resident
        self.pending: dict[bytes, bytes] = {}
        self.pinned: dict[bytes, int] = {}  # key -> tier bits when first pinned
        # Unfinished loads: the handle, its keys, destinations and expected bytes.
        self.loads: list[Load] = []
        # Kept alive until the copies land (rule R2, docs/tiering.md).
        self.sources: list[torch.Tensor] = []
        self.version = 0
        # hbm="engine": the engine's GPU cache of the keys its offers placed, least
        # recently offered first (a dict as an ordered set).
        self.engine: dict[bytes, None] = {}
        self.losses = 0  # model keys found no longer resident since the open
        # hbm="engine": pages the engine holds that the manager forgot (R7), and the
        # manager's count of such forgettings, as of the last invariant check.
        self.forgotten: set[bytes] = set()
        self.forgotten_counted = 0
        self.tm = self.open()
        self.readable_mask = self.tm._readable_mask  # tiers a load may be served from
        assert self.readable_mask == (6 if self.hbm == "engine" else 7)

    def open(self) -> TierManager:
        return TierManager.open(self.config())

    def config(self) -> TierConfig:
        return TierConfig(
            device="cpu",
            hbm=self.hbm,
            hbm_bytes=HBM_PAGES * PAGE,
            dram_bytes=6 * PAGE,
            page_bytes=PAGE,
            tokens_per_page=16,
            nvme_path=str(self.directory / "nvme"),
            nvme_options={"segment_bytes": 1 << 20, "gc_interval_s": 0},
            model=SMALL_MODEL,
            compute_flops=1e11,  # slow: by the seeded bandwidths, loading wins everywhere
            admission=self.admission,
            hysteresis_s=0.0,
            watermark_low=0.3,
            watermark_warn=0.5,
            watermark_force=0.7,
            probe_at_open=False,
            control_interval_s=0,  # the rules drive step(): one thread of control
            warm_dram_on_open=False,
        )

    # -- helpers -------------------------------------------------------------

    def known(self, key: bytes) -> bool:
        """Ask the manager, without moving anything: a pin succeeds only for a page in
        some tier (the engine's HBM included, with hbm="engine")."""
        if self.tm.pin([key]) == [True]:
            self.tm.unpin([key])
            return True
        return False

    def resident(self, key: bytes) -> bool:
        """Known, and with a copy the manager can load (what a lookup serves). With
        hbm="engine" the HBM bit is the engine's copy: a DRAM or NVMe copy is needed."""
        if not self.known(key):
            return False
        return self.hbm != "engine" or bool(self.tier_bits(key) & self.readable_mask)

    def hbm_alone(self) -> set[bytes]:
        """hbm="engine": pages in the engine's HBM alone, which the manager cannot read."""
        return {k for k, rec in self.tm._pages.items() if rec.tiers & 7 == 1}

    def accept_hbm_alone(self, keys: set[bytes], where: str) -> None:
        """Pages in HBM alone are the known defect (``ENGINE_DRAM_DROP_DEFECT``): only
        while it stands, and no more of them than counted DRAM drops."""
        if not keys:
            return
        counters = self.tm._counters
        drops = sum(counters.get(name, 0) for name in ENGINE_DRAM_DROPS)
        assert ENGINE_DRAM_DROP_DEFECT and len(keys) <= drops, (
            f"{where}: {sorted(keys)} in the engine's HBM alone, which the manager cannot "
            f"read: lost when the engine drops them ({drops} counted DRAM drops; "
            f"counters {counters})"
        )
        event("known defect: a page in the engine's HBM alone after a DRAM drop")

    def quiesce(self) -> None:
        """Let the mover finish what is queued, without harvesting it: the rule that
        follows then sees every earlier completion, whatever the threads' timing, so
        an example replays the same way (hypothesis needs that to shrink)."""
        deadline = time.monotonic() + 10
        while self.tm._mover.in_flight_bytes() > 0:
            assert time.monotonic() < deadline, "the mover never went idle"
            time.sleep(0.0005)
        self.settle_pending()

    def settle_pending(self) -> None:
        """Offered pages that waited for a DRAM slot join the model once resident, and
        leave the wait once the manager stops waiting for them (declined after
        offer_wait_s, or at close; or landed and gone again since)."""
        for key, value in list(self.pending.items()):
            rec = self.tm._pages.get(key)
            if rec is not None and rec.state is PageState.WAITING:
                continue  # (state first: it leaves WAITING with its tier bit set)
            del self.pending[key]
            if self.resident(key):
                self.model[key] = value
                event("a page that waited for a DRAM slot landed")
            else:
                event("a page that waited for a DRAM slot was declined")

    def tier_bits(self, key: bytes) -> int:
        rec = self.tm._pages.get(key)
        return 0 if rec is None else rec.tiers

    def forget_absent(self) -> None:
        """Model keys the manager no longer holds were dropped (a cache may drop)."""
        for key in list(self.model):
            if not self.resident(key):
                assert key not in self.pinned, f"{key!r} dropped while pinned"
                self.lose(key)

    def lose(self, key: bytes) -> None:
        """A model key is no longer resident. Under admission ``all`` only a drop the
        manager counted in ``LOSSY`` may explain it (one counted drop per lost key)."""
        if self.model.pop(key, None) is None:
            return
        self.losses += 1
        event("a modelled page was dropped")
        if self.admission == "all":
            counters = self.tm._counters
            dropped = sum(counters.get(name, 0) for name in LOSSY)
            assert self.losses <= dropped, (
                f"{key!r} lost with nothing counted that drops a page under admission "
                f"all ({self.losses} lost, {dropped} counted drops; counters {counters})"
            )

    def engine_holds(self, keys: list[bytes]) -> None:
        """hbm="engine": the engine's GPU cache now holds ``keys`` (most recent last);
        past its capacity it drops the least recent and tells the manager."""
        for key in keys:
            self.engine.pop(key, None)
            self.engine[key] = None
        overflow = list(self.engine)[: max(0, len(self.engine) - ENGINE_HBM_PAGES)]
        if overflow:
            self.notify_evicted(overflow)

    def notify_evicted(self, keys: list[bytes]) -> None:
        """The engine dropped ``keys`` from its GPU cache. The manager keeps serving
        every page of them it served before, from DRAM or NVMe (owned HBM would have
        demoted it): the engine's HBM was never the page's only copy."""
        before = {k: self.tier_bits(k) for k in keys}
        served = {k for k in keys if self.resident(k)}
        self.tm.notify_hbm_evicted(keys)
        for key in keys:
            self.engine.pop(key, None)
            now = self.tier_bits(key)
            assert now == before[key] & ~1, (
                f"{key!r}: notify_hbm_evicted changed {before[key]:03b} to {now:03b}"
            )
        for key in served:
            assert self.resident(key), f"{key!r} lost with the engine's HBM copy"

    # -- rules ---------------------------------------------------------------

    @rule(
        chain=st.integers(0, CHAINS - 1),
        length=st.integers(1, 4),
        sizes=st.lists(SIZES, min_size=4, max_size=4),
    )
    def extend_chain(self, chain: int, length: int, sizes: list[int]) -> None:
        """What an engine does: offer the pages after the chain's resident prefix."""
        self.quiesce()
        start = 0
        while start < CHAIN_PAGES and self.resident(chain_key(chain, start)):
            start += 1
        if start < CHAIN_PAGES:
            self.offer(chain, start, length, sizes)

    @rule(
        chain=st.integers(0, CHAINS - 1),
        start=st.integers(0, CHAIN_PAGES - 1),
        length=st.integers(1, 4),
        sizes=st.lists(SIZES, min_size=4, max_size=4),
    )
    def offer(self, chain: int, start: int, length: int, sizes: list[int]) -> None:
        """Any run of a chain: its first page may be present, absent or an orphan."""
        self.quiesce()
        end = min(start + length, CHAIN_PAGES)
        keys = [chain_key(chain, p) for p in range(start, end)]
        parents: list[bytes | None] = [
            chain_key(chain, p - 1) if p else None for p in range(start, end)
        ]
        # The manager's orphan rule asks whether a parent is in any tier (with
        # hbm="engine", the engine's HBM alone will do).
        before = {p: self.known(p) for p in parents if p is not None and p not in keys}
        alone = self.hbm_alone() if self.hbm == "engine" else set()
        self.version += 1
        values = [
            self.model.get(k) or self.pending.get(k) or page_bytes(k, self.version, s)
            for k, s in zip(keys, sizes, strict=False)
        ]
        srcs = [torch.frombuffer(bytearray(v), dtype=torch.uint8) for v in values]
        self.sources.extend(srcs)
        out = self.tm.offer(keys, srcs, parents=parents)
        kept: set[bytes] = set()
        for key, parent, value, tier, reason in zip(
            keys, parents, values, out.tiers, out.reasons, strict=True
        ):
            if reason == "present":
                assert tier is not None
                self.settle_pending()  # a waiting page may have landed meanwhile
                kept.add(key)
                if key in alone and key not in self.model:
                    self.accept_hbm_alone({key}, "offer answered present")
                    continue
                assert key in self.model, f"{key!r} present but never admitted"
            elif reason == "waiting":
                # DRAM once a write-back frees a slot, or declined after offer_wait_s
                assert tier is not None
                if parent is not None and key not in self.pending:
                    # (an earlier offer's waiting page answers "waiting" again whatever
                    # became of its parent since: its slot's turn declines an orphan)
                    parent_ok = before.get(parent, False) or parent in kept
                    assert parent_ok, f"{key!r} waiting with a non-resident parent {parent!r}"
                if key not in self.pending:
                    # Not resident now: a model entry is stale (the page was dropped
                    # and is offered again), and the page rejoins once it lands.
                    self.lose(key)
                    self.pending[key] = value
                kept.add(key)
                event("an offered page waited for a DRAM slot")
            elif reason == "admitted":
                assert tier is not None
                if parent is not None:
                    parent_ok = before.get(parent, False) or parent in kept
                    assert parent_ok, f"{key!r} admitted with a non-resident parent {parent!r}"
                self.model[key] = value
                kept.add(key)
            else:
                event(f"offer declined: {reason}")
                assert tier is None, (key, reason)
                assert key not in self.pinned
                self.lose(key)
                if reason.startswith("orphan"):
                    assert parent is not None
                    assert not before.get(parent, False) and parent not in kept, (
                        f"{key!r} declined as an orphan of resident {parent!r}"
                    )
        if self.hbm == "engine":
            for key, tier in zip(keys, out.tiers, strict=True):
                if tier is not None:
                    assert tier == 0, f"{key!r} placed in tier {tier}, not the engine's HBM"
            self.engine_holds([k for k in keys if k in kept])

    @rule(chain=st.integers(0, CHAINS - 1), length=st.integers(1, CHAIN_PAGES))
    def lookup_and_load(self, chain: int, length: int) -> None:
        self.quiesce()
        if len(self.loads) >= 2:
            self.finish_load()
        keys = [chain_key(chain, p) for p in range(length)]
        result = self.tm.lookup(keys)
        hit = result.hit_pages
        assert list(result.plan.keys) == keys[:hit]
        self.settle_pending()  # a waiting page may have landed since the quiesce
        for key in keys[:hit]:
            assert key in self.model, f"{key!r} hit but never admitted"
        if hit < length:
            assert not self.resident(keys[hit])
            self.lose(keys[hit])
        event(f"lookup served from tiers {sorted(set(result.plan.tiers))}")
        plan = result.plan
        # The plan weighs measured bandwidths (tiny, noisy transfers here) against
        # recomputing: it may load fewer pages than hit, never more.
        assert plan.load_pages <= hit
        event(f"plan loads {'all' if plan.load_pages == hit else 'part'} of the hit")
        dst = [torch.zeros(PAGE, dtype=torch.uint8) for _ in range(plan.load_pages)]
        handle = self.tm.prepare_load(plan, dst)
        expected = [self.model[k] for k in keys[: plan.load_pages]]
        self.loads.append((handle, keys[: plan.load_pages], dst, expected))

    @rule()
    def finish_load(self) -> None:
        self.quiesce()
        if not self.loads:
            return
        handle, keys, dst, expected = self.loads.pop(0)
        assert handle.wait(10), "a load never finished"
        loaded = self.tm.complete_load(handle)
        assert loaded == len(keys), (loaded, handle.results)
        self.check_loaded(handle, keys, dst, expected)

    def check_loaded(
        self, handle: LoadHandle, keys: list[bytes], dst: list[torch.Tensor], expected: list[bytes]
    ) -> None:
        for i, key in enumerate(keys):
            nbytes = handle.results[i]
            if not nbytes:
                continue
            assert nbytes == len(expected[i]), (key, nbytes, len(expected[i]))
            got = bytes(dst[i][:nbytes].numpy())
            assert got == expected[i], f"{key!r}: wrong bytes"

    @rule(key=st.sampled_from(ALL_KEYS))
    def pin(self, key: bytes) -> None:
        self.quiesce()
        if key in self.pinned or len(self.pinned) >= 2:
            return
        if self.tm.pin([key]) == [True]:
            self.settle_pending()
            if not self.resident(key):  # in the engine's HBM alone: nothing to keep
                self.accept_hbm_alone({key}, "pin")
                self.tm.unpin([key])
                return
            assert key in self.model
            # The manager's own copies: the engine clears its HBM bit when it likes.
            self.pinned[key] = self.tier_bits(key) & self.readable_mask

    @rule(key=st.sampled_from(ALL_KEYS))
    def unpin(self, key: bytes) -> None:
        self.quiesce()
        # No precondition on the pins: which pins took depends on the mover's timing,
        # and hypothesis needs the rules it draws to depend on its data alone.
        if key not in self.pinned:
            return
        self.tm.unpin([key])
        del self.pinned[key]

    @precondition(lambda self: self.hbm == "engine")  # the class's, not the state's
    @rule(keys=st.lists(st.sampled_from(ALL_KEYS), min_size=1, max_size=3))
    def engine_evicts(self, keys: list[bytes]) -> None:
        """hbm="engine": the engine drops blocks from its GPU cache (held or not: a
        key it does not hold, or the manager never saw, changes nothing)."""
        self.quiesce()
        self.notify_evicted(keys)

    @rule(times=st.integers(1, 4))
    def step(self, times: int) -> None:
        self.quiesce()
        for _ in range(times):
            self.tm.step()

    @rule()
    def drain(self) -> None:
        self.quiesce()
        assert self.tm.drain(10)
        self.sources.clear()
        stats = self.tm.stats()
        event(f"pages by tier after drain: {min(stats.pages_by_tier[2], 3)}+ on NVMe")
        # The store holds the tier's pages, and while NVMe is gated the measurement's
        # probe page (no page of the manager's: it goes at close).
        stored = len(self.tm.store) - (self.tm.store.info(PROBE_KEY) is not None)
        assert stats.pages_by_tier[2] == stored, (stats.pages_by_tier, stored)

    @rule()
    def close_and_reopen(self) -> None:
        self.quiesce()
        assert self.tm.drain(10)
        self.settle_pending()
        self.forget_absent()
        store = self.tm.store
        on_nvme = {k for k in ALL_KEYS if store.info(k) is not None}
        assert on_nvme <= set(self.model), (
            f"the store holds dropped pages {on_nvme - set(self.model)}"
        )
        old, loads = self.tm, self.loads
        old.close()
        for handle, keys, dst, expected in loads:
            assert handle.done(), "close left a load unsettled"
            self.check_loaded(handle, keys, dst, expected)
            old.complete_load(handle)
        self.loads = []
        self.pending.clear()  # close declined whatever still waited
        self.pinned.clear()
        self.sources.clear()
        self.engine.clear()  # the engine restarts with the manager: its GPU cache is gone
        self.losses = 0  # the counters start again too
        self.forgotten, self.forgotten_counted = set(), 0
        self.model = {k: v for k, v in self.model.items() if k in on_nvme}
        self.tm = self.open()
        stats = self.tm.stats()
        assert stats.pages_by_tier == (0, 0, len(on_nvme))

    # -- invariants ----------------------------------------------------------

    @invariant()
    def within_capacity(self) -> None:
        stats = self.tm.stats()
        for tier in range(3):
            assert stats.used_bytes[tier] <= stats.capacity_bytes[tier], (tier, stats.used_bytes)
        pages = self.tm._pages
        counts = [sum(1 for rec in pages.values() if rec.tiers & bit) for bit in (1, 2, 4)]
        assert stats.pages_by_tier == tuple(counts), (stats.pages_by_tier, counts)
        assert stats.pages == len(pages)
        if self.hbm == "engine":
            # The engine's pages, at their own sizes (no slots: the manager owns none).
            held = [pages[k].nbytes for k in self.engine if k in pages]
            assert stats.used_bytes[0] == sum(held), (stats.used_bytes, held)
            assert stats.capacity_bytes[0] == HBM_PAGES * PAGE
        else:
            assert stats.used_bytes[0] == stats.pages_by_tier[0] * PAGE
        assert stats.used_bytes[1] == stats.pages_by_tier[1] * PAGE

    @invariant()
    def engine_hbm_is_the_engines(self) -> None:
        """hbm="engine": the HBM bit is set only for pages the engine holds, and for all
        of them but those forgotten whole (counted); none is in HBM alone."""
        if self.hbm != "engine":
            return
        in_hbm = {k for k, rec in self.tm._pages.items() if rec.tiers & 1}
        engine = set(self.engine)
        assert in_hbm <= engine, (sorted(in_hbm), list(self.engine))
        # A page NVMe declines leaves DRAM unwritten even while the engine holds it,
        # and the manager forgets it whole (docs/tiering.md, R7): its next offer is
        # admitted again. Only after counted DRAM drops (NVMe gated by a measurement,
        # an emergency), and never half-known.
        forgotten = engine - in_hbm
        known = sorted(k for k in forgotten if k in self.tm._pages)
        assert not known, f"{known}: held by the engine, known without its HBM bit"
        # Each page newly forgotten since the last check was counted as such.
        counted = self.tm._counters.get("evict:hbm:forgotten", 0)
        new = forgotten - self.forgotten
        assert len(new) <= counted - self.forgotten_counted, (
            f"{sorted(new)} forgotten while the engine holds them, "
            f"{counted - self.forgotten_counted} counted (counters {self.tm._counters})"
        )
        if new:
            event("a page the engine holds was dropped from DRAM and forgotten")
        self.forgotten, self.forgotten_counted = forgotten, counted
        self.accept_hbm_alone(self.hbm_alone(), "invariant")

    @invariant()
    def residents_are_modelled(self) -> None:
        self.settle_pending()
        for key in ALL_KEYS:
            if self.resident(key):
                assert key in self.model, f"{key!r} resident but not in the model"
        self.forget_absent()

    @invariant()
    def pinned_pages_stay(self) -> None:
        for key, bits in self.pinned.items():
            now = self.tier_bits(key) & self.readable_mask
            assert now & bits == bits, f"pinned {key!r} left a tier: {bits:03b} -> {now:03b}"
        for handle, keys, _, _ in self.loads:
            for i, key in enumerate(keys):
                if handle.results[i] is None:
                    assert self.resident(key), f"{key!r} dropped under an unfinished load"

    @invariant()
    def orders_hold_the_candidates(self) -> None:
        """White-box: each page's resident-children counts are at most its children that
        hold it (in the tier, not leaving it; for DRAM, with no NVMe copy), fewer only
        for a record made again while an orphaned child stayed (nobody counts those); a
        count above the truth would keep a page out of NVMe's order for good. DRAM's
        order holds exactly its dirty, settled, staying pages, the clean list its pages
        with an NVMe copy, and NVMe's order its settled, staying leaves by those counts:
        a page missing from its order is never evicted, and a page in the wrong one is
        freed as what it is not."""
        tm = self.tm
        with tm._lock:
            state = tm._state
            pages = state.pages
            held = {(key, tier): 0 for key in pages for tier in (1, 2)}
            for rec in pages.values():
                if rec.parent is None or rec.parent not in pages:
                    continue
                staying = rec.tiers & ~rec.leaving
                if staying & 2 and not rec.tiers & 4:
                    held[rec.parent, 1] += 1
                if staying & 4:
                    held[rec.parent, 2] += 1
            dram = {rec.key for rec in state.orders[1].unordered()}
            clean = {rec.key for rec in state.clean_dram.unordered()}
            nvme = {rec.key for rec in state.orders[2].unordered()}
            for key, rec in pages.items():
                counts = (rec.resident_dram, rec.resident_nvme)
                assert rec.resident_dram <= held[key, 1], (key, counts, held[key, 1])
                assert rec.resident_nvme <= held[key, 2], (key, counts, held[key, 2])
                ready = rec.state is PageState.READY
                staying = rec.tiers & ~rec.leaving
                dirty = bool(ready and staying & 2 and not rec.tiers & 4)
                assert (key in dram) == dirty, (key, rec.tiers, rec.leaving, rec.state)
                assert (key in clean) == (rec.tiers & 6 == 6), (key, rec.tiers)
                leaf = bool(ready and staying & 4 and not rec.resident_nvme)
                assert (key in nvme) == leaf, (key, rec.tiers, rec.leaving, counts)

    def teardown(self) -> None:
        try:
            self.tm.close()
        finally:
            with contextlib.suppress(OSError):
                shutil.rmtree(self.directory)


class ValueDensityMachine(TierMachine):
    admission = "value_density"


class EngineMachine(TierMachine):
    hbm = "engine"


class EngineValueDensityMachine(TierMachine):
    admission = "value_density"
    hbm = "engine"


class DisplacementMachine(TierMachine):
    """A bounded NVMe (four pages) with the displacement rule held on: writes into a
    full NVMe are declined unless the page beats NVMe's next victim, and DRAM frees
    declined pages beside clean ones (docs/tiering.md, "Admission against the
    displaced page"). The rule's fallback paths get the same invariants."""

    admission = "value_density"

    def config(self) -> TierConfig:
        return dataclasses.replace(super().config(), nvme_bytes=4 * PAGE)

    def open(self) -> TierManager:
        tm = super().open()
        hold_on(tm)
        return tm


class _Frozen(Bandwidth):
    """A bandwidth fit that ignores what transfers measure."""

    __slots__ = ()

    def observe(self, nbytes: int, seconds: float, now: float | None = None) -> None:
        pass


def hold_gated(tm: TierManager) -> None:
    """Hold NVMe gated, as a measurement on a loaded machine can (reads measured at
    a few KB/s: loading from NVMe slower than recomputing, κ < 1, so no loads from it
    and value density declines its writes): the read fit is frozen there and the
    probes that would re-measure it are off, so the same steps replay the same way."""
    fit = tm._bandwidth["nvme_read"]
    tm._bandwidth["nvme_read"] = _Frozen(4096.0, fit.latency_s)
    tm._value.invalidate()
    tm._measure.explore = lambda now: None
    tm._update_gates()  # as a measurement would: cached NVMe admissions expire too
    assert tm._measure.gated[2]


class GatedMachine(TierMachine):
    """Owned HBM, NVMe held gated: DRAM drops what NVMe declines (counted), a plan
    recomputes rather than load from NVMe; the same invariants."""

    admission = "value_density"

    def open(self) -> TierManager:
        tm = super().open()
        hold_gated(tm)
        return tm


class EngineGatedMachine(GatedMachine):
    """hbm="engine" with NVMe held gated: NVMe declines the engine's pages too, so they
    are dropped from DRAM and forgotten while the engine still holds them (the
    fallback the engine-HBM invariant names)."""

    hbm = "engine"


class StoreFallbackMachine(TierMachine):
    """The store under the manager on one of its fallbacks: ``store_option`` (a store
    option whose value its stats report under the same name) is set, and checked to be
    in force. The same invariants on that path."""

    admission = "value_density"
    store_option: ClassVar[tuple[str, object]]

    def config(self) -> TierConfig:
        config = super().config()
        name, value = self.store_option
        return dataclasses.replace(config, nvme_options={**config.nvme_options, name: value})

    def open(self) -> TierManager:
        tm = super().open()
        name, value = self.store_option
        assert getattr(tm.store.stats(), name) == value
        return tm


class ThreadPoolMachine(StoreFallbackMachine):
    """The thread-pool I/O engine (where io_uring is missing or refused)."""

    store_option = ("io_engine", "threadpool")


class BufferedMachine(StoreFallbackMachine):
    """No O_DIRECT (a file system that refuses it): I/O through the page cache."""

    store_option = ("direct_io", False)


def with_settings(machine: type[TierMachine]) -> Any:
    """``machine``'s hypothesis test case, with this file's settings."""
    case = machine.TestCase
    case.settings = SETTINGS
    return case


TestTieringAll = with_settings(TierMachine)
TestTieringDisplacement = with_settings(DisplacementMachine)
TestTieringValueDensity = with_settings(ValueDensityMachine)
TestTieringEngineAll = with_settings(EngineMachine)
TestTieringEngineValueDensity = with_settings(EngineValueDensityMachine)
TestTieringGated = with_settings(GatedMachine)
TestTieringThreadPool = with_settings(ThreadPoolMachine)
TestTieringBuffered = with_settings(BufferedMachine)
TestTieringEngineGated = with_settings(EngineGatedMachine)


# -- hbm="engine": the known defect, deterministic ---------------------------------------


def engine_config(path: Path, **overrides: Any) -> TierConfig:
    """hbm="engine" with room in the engine's HBM for 8 pages, DRAM for 4, no control
    thread: nothing runs between the calls the test makes."""
    options: dict[str, Any] = dict(
        device="cpu",
        hbm="engine",
        hbm_bytes=8 * PAGE,
        dram_bytes=4 * PAGE,
        page_bytes=PAGE,
        tokens_per_page=16,
        nvme_path=str(path),
        nvme_options={"segment_bytes": 1 << 20, "gc_interval_s": 0},
        model=SMALL_MODEL,
        compute_flops=1e11,
        admission="all",
        hysteresis_s=0.0,
        probe_at_open=False,
        control_interval_s=0,
        warm_dram_on_open=False,
    )
    options.update(overrides)
    return TierConfig(**options)


ENGINE_DROP_CASES: dict[str, dict[str, Any]] = {
    # Admission "all", NVMe unbounded; the disk measured slow (the machines' 1-byte
    # pages measure nvme_write at some 10 KB/s): the second victim of an urgent DRAM
    # eviction is dropped ("evict:dram:paced") behind the first one's queued write.
    "write pacing": {"bandwidth_bytes_per_s": {"nvme_write": 1000.0}},
    # Recomputing is nearly free, so NVMe declines every page: a DRAM eviction drops
    # it ("evict:dram:dropped"). Owned HBM would have kept the page (its DRAM copy
    # goes as clean, and HBM's eviction demotes it to DRAM again).
    "NVMe declines": {"admission": "value_density", "compute_flops": 1e18},
}


@pytest.mark.parametrize("case", sorted(ENGINE_DROP_CASES))
def test_engine_mode_keeps_a_readable_copy_of_every_page_the_engine_holds(
    tmp_path: Path, case: str
) -> None:
    """Five pages offered one at a time into a DRAM of four: the fifth offer evicts
    from DRAM. Every page the engine holds must keep a DRAM or NVMe copy (or be
    forgotten, so that its next offer admits it again: never "present" for a page the
    manager cannot load); after notify_hbm_evicted, every page the manager still
    knows loads with its bytes, and with admission "all" (NVMe unbounded) it still
    knows every page it placed."""
    keys = [b"a", b"b", b"c", b"d", b"e"]
    pages = [torch.full((PAGE,), i + 1, dtype=torch.uint8) for i in range(len(keys))]
    failures = []
    with TierManager.open(engine_config(tmp_path / "nvme", **ENGINE_DROP_CASES[case])) as tm:
        placed = []
        for key, src in zip(keys, pages, strict=True):
            if tm.offer([key], [src], parents=[None]).tiers[0] is not None:
                placed.append(key)
            deadline = time.monotonic() + 10
            while tm._mover.in_flight_bytes() > 0:  # settled at the next call's harvest
                assert time.monotonic() < deadline
                time.sleep(0.001)
        alone = sorted(k for k, rec in tm._pages.items() if rec.tiers & 7 == 1)
        if alone:
            failures.append(f"in the engine's HBM alone: {alone}")
        for key in alone:
            reason = tm.offer([key], [pages[keys.index(key)]], parents=[None]).reasons[0]
            if reason == "present":
                failures.append(f"{key!r} offered again: 'present', and no copy to load")
        counters = dict(tm._counters)
        tm.notify_hbm_evicted(keys)
        assert tm.drain(10)
        known = [k for k in placed if k in tm._pages]
        if case == "write pacing" and known != placed:
            failures.append(f"placed {placed}, known after notify_hbm_evicted {known}")
        for key in known:
            result = tm.lookup([key])
            if not result.hit_pages:
                failures.append(f"{key!r} known after notify_hbm_evicted, no hit")
            # With recomputing nearly free the plan may load nothing; what it loads
            # has the page's bytes, defect or not.
            dst = [torch.zeros(PAGE, dtype=torch.uint8) for _ in range(result.plan.load_pages)]
            handle = tm.prepare_load(result.plan, dst)
            assert handle.wait(10)
            if tm.complete_load(handle):
                assert torch.equal(dst[0], pages[keys.index(key)]), f"{key!r}: wrong bytes"
    assert not failures, f"{case}: " + "; ".join(failures) + f" (counters {counters})"


@contextlib.contextmanager
def replayed(machine: TierMachine, steps: list[tuple[str, dict[str, Any]]]) -> Iterator[None]:
    """Run ``steps`` (a rule's name, its arguments: what a shrunk hypothesis run
    printed) on ``machine`` outside a hypothesis run, checking the invariants after
    each; the block checks the end state, then the machine is torn down."""
    saved = globals()["event"]
    globals()["event"] = lambda *args, **kwargs: None  # outside a hypothesis run
    try:
        for name, arguments in steps:
            getattr(machine, name)(**arguments)
            machine.within_capacity()
            machine.residents_are_modelled()
            machine.pinned_pages_stay()
            machine.orders_hold_the_candidates()
        yield
    finally:
        globals()["event"] = saved
        machine.teardown()


# -- an offer's promotion and a later allocation of the same offer --------------------------


def test_an_offer_promoting_a_page_keeps_it_while_later_pages_of_the_offer_take_slots() -> None:
    """The steps `TestTieringDisplacement` shrank to (value density, owned HBM): chain 0's
    pages sit in DRAM while two pages of chain 1 are being demoted from HBM; an offer of
    chain 0 promotes its present pages into HBM, and the DRAM slot for its new fourth page
    is made by dropping the lowest-ranked page NVMe declines, which was one of the pages
    this offer was promoting. It was forgotten, and its copy then landed in HBM on a page
    no longer in the page table: HBM counted 3 pages where 2 were known, and its slot
    was never freed."""
    sizes = [PAGE] * 4
    steps: list[tuple[str, dict[str, Any]]] = [
        ("extend_chain", {"chain": 0, "length": 2, "sizes": sizes}),
        ("offer", {"chain": 0, "length": 1, "sizes": sizes, "start": 0}),
        ("finish_load", {}),
        ("extend_chain", {"chain": 0, "length": 2, "sizes": sizes}),
        ("extend_chain", {"chain": 2, "length": 2, "sizes": sizes}),
        ("lookup_and_load", {"chain": 2, "length": 1}),
        ("finish_load", {}),
        ("extend_chain", {"chain": 1, "length": 2, "sizes": sizes}),
        ("lookup_and_load", {"chain": 0, "length": 1}),
        ("finish_load", {}),
        ("offer", {"chain": 0, "length": 4, "sizes": sizes, "start": 0}),
    ]
    machine = ValueDensityMachine()
    with replayed(machine, steps):
        machine.drain()
        machine.within_capacity()
        assert machine.tm._hbm.free_slots() + machine.tm.stats().pages_by_tier[0] == HBM_PAGES


# -- a load of NVMe pages into a DRAM whose pages NVMe has no room for ----------------------


def test_a_load_of_nvme_pages_gets_its_slots_while_nvme_has_no_room_for_drams_pages() -> None:
    """The steps `TestTieringDisplacement` found (NVMe four pages, the displacement rule
    on): chain 0's four pages are on NVMe only and fill it; DRAM's six slots hold chain
    0's fifth page, three pages of chain 2 and two pinned ones. A load of chain 0 needs
    four DRAM slots to stage its NVMe pages, and chain 2's pages could leave DRAM only
    by a write that NVMe had no room for (its pages pinned by that same load): no slot
    came free, and the load failed every NVMe page (`load_failure:no_slot`). A slot
    wanted now drops such a page instead (`evict:dram:no_room`)."""
    sizes = [PAGE] * 4
    steps: list[tuple[str, dict[str, Any]]] = [
        ("extend_chain", {"chain": 2, "length": 4, "sizes": sizes}),
        ("extend_chain", {"chain": 2, "length": 4, "sizes": sizes}),
        ("pin", {"key": b"c2p5"}),
        ("pin", {"key": b"c2p4"}),
        ("offer", {"chain": 0, "length": 4, "sizes": sizes, "start": 0}),
        ("finish_load", {}),
        ("pin", {"key": b"c0p0"}),
        ("pin", {"key": b"c0p0"}),
        ("offer", {"chain": 0, "length": 3, "sizes": sizes, "start": 0}),
        ("lookup_and_load", {"chain": 0, "length": 5}),
        ("offer", {"chain": 0, "length": 3, "sizes": sizes, "start": 0}),
        ("finish_load", {}),
        ("extend_chain", {"chain": 0, "length": 4, "sizes": sizes}),
        ("lookup_and_load", {"chain": 2, "length": 1}),
        ("finish_load", {}),
        ("finish_load", {}),
        ("lookup_and_load", {"chain": 2, "length": 4}),
        ("lookup_and_load", {"chain": 0, "length": 5}),
        ("finish_load", {}),
        ("finish_load", {}),
    ]
    machine = DisplacementMachine()
    with replayed(machine, steps):  # finish_load asserts every page loaded
        stats = machine.tm.stats()
        assert stats.load_failures == 0, stats.load_failures

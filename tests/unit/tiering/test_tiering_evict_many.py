"""``Eviction.alloc_many``: the slots of one remote read, evicted for in one pass."""

from __future__ import annotations

from typing import Any

import torch

from kvstore.tiering import ModelCost, TierConfig, TierManager
from kvstore.tiering.pages import DRAM

PAGE = SLOT = 64 * 1024


def config(dram_slots: int) -> TierConfig:
    return TierConfig(
        device="cpu",
        hbm="owned",
        hbm_bytes=0,
        dram_bytes=dram_slots * SLOT,
        page_bytes=PAGE,
        tokens_per_page=16,
        nvme_path=None,  # a DRAM victim is dropped: freed at once
        model=ModelCost(1e9, 8, 8, 64, PAGE // 16),
        compute_flops=1e11,
        admission="all",
        hysteresis_s=0.0,
        probe_at_open=False,
        control_interval_s=0,  # no control thread: only alloc_many evicts
    )


def keys(n: int, prefix: str) -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(n)]


def page(i: int) -> torch.Tensor:
    return torch.full((PAGE,), i % 256, dtype=torch.uint8)


def _offer(tm: TierManager, n: int) -> list[bytes]:
    """``n`` roots offered (every page a leaf, each its own victim); the keys in DRAM."""
    ks = keys(n, "d")
    for i, k in enumerate(ks):
        tm.offer([k], [page(i)], parents=[None])
        tm.drain()
    return [k for k in ks if k in tm._state.pages and tm._state.pages[k].in_tier(DRAM)]


def _fill(tm: TierManager) -> None:
    """Take DRAM's free slots (an offer that finds DRAM full frees two, uses one)."""
    while tm._dram.alloc() is not None:
        pass


def _spy_evict_now(tm: TierManager) -> list[int]:
    calls: list[int] = []
    evict: Any = tm._evict
    inner = evict._evict_now

    def spy(tier: int, batch: int = 2, **kw: Any) -> None:
        calls.append(batch)
        inner(tier, batch, **kw)

    evict._evict_now = spy
    return calls


def test_alloc_many_frees_n_slots_in_one_pass_and_never_a_pinned_page() -> None:
    cfg = config(16)
    with TierManager.open(cfg) as tm:
        ks = _offer(tm, 20)
        _fill(tm)
        # 20 offered into 16 slots: DRAM stays full (without NVMe a victim is dropped
        # when a slot is wanted, never ahead), each offer that found it full freed two.
        assert len(ks) == 16
        pinned = ks[:6]  # the lowest ranked: the first victims but for the pins
        assert tm.pin(pinned) == [True] * 6
        calls = _spy_evict_now(tm)
        with tm._lock:
            slots = tm._evict.alloc_many(DRAM, 8)  # every unpinned page
        assert slots is not None and len(set(slots)) == 8
        assert calls == [8]  # one pass for the whole shortfall, not 2 pages a slot
        pages = tm._state.pages
        assert all(pages[k].in_tier(DRAM) for k in pinned)
        gone = [k for k in ks[6:] if k not in pages or not pages[k].in_tier(DRAM)]
        assert len(gone) == 8
        tm.unpin(pinned)


def test_alloc_many_takes_nothing_when_pins_leave_too_few() -> None:
    cfg = config(8)
    with TierManager.open(cfg) as tm:
        ks = _offer(tm, 8)
        _fill(tm)
        assert len(ks) == 8
        assert tm.pin(ks[:5]) == [True] * 5
        with tm._lock:
            assert tm._evict.alloc_many(DRAM, 4) is None  # 3 unpinned pages at most
        assert all(tm._state.pages[k].in_tier(DRAM) for k in ks[:5])
        assert tm._dram.free_slots() == 3  # what was freed stays free: nothing taken
        with tm._lock:
            slots = tm._evict.alloc_many(DRAM, 3)
        assert slots is not None and len(slots) == 3
        tm.unpin(ks[:5])


def test_alloc_many_with_room_evicts_nothing() -> None:
    cfg = config(8)
    with TierManager.open(cfg) as tm:
        _offer(tm, 4)
        calls = _spy_evict_now(tm)
        with tm._lock:
            slots = tm._evict.alloc_many(DRAM, 4)
        assert slots is not None and len(slots) == 4 and calls == []
        with tm._lock:
            assert tm._evict.alloc_many(DRAM, 1) is not None and calls == [1]


def test_alloc_many_takes_a_chain_tail_first_in_one_scan() -> None:
    # Three chains of 16 (each page the parent of the next) fill DRAM. Only a chain's
    # tail is a leaf, so a scan of the order used to yield one page per chain: 16 slots
    # took 6 scans of the whole order (64 slots in the remote bench's DRAM: ~60 scans,
    # 1.5 ms a read). A page whose children were all given out in the same scan is a
    # leaf too: the oldest chain goes whole, tail first, in one scan, and no page left
    # in DRAM is an orphan.
    cfg = config(64)  # 48 pages: below the watermarks, no eviction before the test's
    with TierManager.open(cfg) as tm:
        chains = [keys(16, f"c{c}/") for c in range(3)]
        for c, ks in enumerate(chains):
            tm.offer(ks, [page(16 * c + i) for i in range(16)])
            tm.drain()
        pages = tm._state.pages
        assert all(pages[k].in_tier(DRAM) for ks in chains for k in ks)
        _fill(tm)
        order: Any = tm._state.orders[DRAM]
        scans: list[int] = []
        inner = order.victims

        def spy(n: int, eligible: Any, scan: int) -> Any:
            out = inner(n, eligible, scan)
            scans.append(len(out))
            return out

        order.victims = spy
        with tm._lock:
            slots = tm._evict.alloc_many(DRAM, 16)
        assert slots is not None and len(set(slots)) == 16
        assert scans == [16], scans
        gone = {k for ks in chains for k in ks if k not in pages or not pages[k].in_tier(DRAM)}
        assert gone == set(chains[0])  # the oldest chain, whole
        for ks in chains[1:]:
            assert all(pages[k].in_tier(DRAM) for k in ks)

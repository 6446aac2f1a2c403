"""TierManager on the CPU: offer, lookup, load, eviction down the tiers, restart."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.tiering import (
    LookupState,
    ModelCost,
    RequestContext,
    TierConfig,
    TierManager,
)

PAGE = 64 * 1024
SLOT = PAGE
SMALL_MODEL = ModelCost(1e9, 8, 8, 64, PAGE // 16)


def config(tmp_path: Path | None, **overrides: Any) -> TierConfig:
    base: dict[str, Any] = dict(
        device="cpu",
        hbm="owned",
        hbm_bytes=4 * SLOT,
        dram_bytes=8 * SLOT,
        page_bytes=PAGE,
        tokens_per_page=16,
        nvme_path=str(tmp_path / "nvme") if tmp_path is not None else None,
        nvme_options={"segment_bytes": 4 << 20, "gc_interval_s": 0},
        model=SMALL_MODEL,
        # A fast disk: loading beats recomputing from every tier.
        compute_flops=1e11,
        admission="all",
        hysteresis_s=0.0,
        probe_at_open=False,
        control_interval_s=0.001,
    )
    base.update(overrides)
    return TierConfig(**base)


def page(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=g)


def keys(n: int, prefix: str = "k") -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(n)]


def load_all(tm: TierManager, ks: list[bytes]) -> list[torch.Tensor]:
    result = tm.lookup(ks)
    dst = [torch.zeros(PAGE, dtype=torch.uint8) for _ in range(result.plan.load_pages)]
    handle = tm.prepare_load(result.plan, dst)
    assert handle.wait(10)
    loaded = tm.complete_load(handle)
    return dst[:loaded]


def test_offer_then_load_returns_the_bytes(tmp_path: Path) -> None:
    with TierManager.open(config(tmp_path)) as tm:
        ks = keys(3)
        offered = tm.offer(ks, [page(i) for i in range(3)])
        assert offered.tiers == (0, 0, 0)
        assert offered.hbm_release.wait(10)
        result = tm.lookup([*ks, b"absent"])
        assert result.hit_pages == 3
        assert result.pages_by_tier == (3, 0, 0)
        assert result.state is LookupState.READY
        got = load_all(tm, ks)
        assert all(torch.equal(g, page(i)) for i, g in enumerate(got))
        assert len(got) == 3


def test_pages_flow_down_to_nvme_and_come_back_exact(tmp_path: Path) -> None:
    # Tiny tiers: low watermarks keep the headroom a real DRAM has in slots.
    cfg = config(tmp_path, dram_bytes=16 * SLOT, watermark_warn=0.5, watermark_low=0.4)
    with TierManager.open(cfg) as tm:
        ks = keys(30)
        for i in range(0, 30, 3):
            parents = [ks[i - 1] if i else None, ks[i], ks[i + 1]]
            out = tm.offer(ks[i : i + 3], [page(j) for j in range(i, i + 3)], parents=parents)
            assert out.admitted == 3, out.reasons
            for _ in range(3):  # the control cycles make room below, as between requests
                tm.drain()
                tm.step()
        assert tm.drain()
        stats = tm.stats()
        assert stats.pages_by_tier[2] > 0
        assert stats.used_bytes[0] <= stats.capacity_bytes[0]
        assert stats.used_bytes[1] <= stats.capacity_bytes[1]
        result = tm.lookup(ks)
        assert result.hit_pages == 30
        got = load_all(tm, ks)
        assert len(got) == 30
        for i, g in enumerate(got):
            assert torch.equal(g, page(i)), i


def test_restart_rebuilds_the_forest_from_nvme(tmp_path: Path) -> None:
    ks = keys(20)
    with TierManager.open(config(tmp_path, watermark_warn=0.5, watermark_low=0.1)) as tm:
        tm.offer(ks, [page(i) for i in range(20)])
        tm.drain()
        for _ in range(50):
            tm.step()
            tm.drain()
        on_nvme = tm.stats().pages_by_tier[2]
    assert on_nvme > 0
    # DRAM with room for every recomputed page: the re-offer below must not depend on
    # how fast the disk drains write-back (a slow fit of the NVMe write bandwidth
    # makes the manager decline or drop under write pressure: a flake on a loaded
    # machine, reproduced with bandwidth_bytes_per_s={"nvme_write": 1e4}).
    with TierManager.open(config(tmp_path, warm_dram_on_open=False, dram_bytes=32 * SLOT)) as tm:
        by_tier = tm.stats().pages_by_tier
        # HBM and DRAM are gone; NVMe has what was there (and what close finished).
        assert by_tier[:2] == (0, 0) and by_tier[2] >= on_nvme
        # What was only in HBM or DRAM is gone; recomputing
        # it reconnects the NVMe pages: the forest is whole.
        lost = [i for i, k in enumerate(ks) if tm.store.info(k) is None]
        assert len(lost) < len(ks)
        # Up to the first hole (none when cleaning ahead had written every page).
        assert tm.lookup(ks).hit_pages == (lost[0] if lost else len(ks))
        tm.offer(
            [ks[i] for i in lost],
            [page(i) for i in lost],
            parents=[ks[i - 1] if i else None for i in lost],
        )
        tm.drain()
        result = tm.lookup(ks)
        assert result.hit_pages == 20
        got = load_all(tm, ks)
        assert len(got) == 20
        for i, g in enumerate(got):
            assert torch.equal(g, page(i))
    assert (tmp_path / "nvme" / "tiering-stats.json").exists()


def test_slow_disk_recomputes_past_dram_fast_disk_loads_everything(tmp_path: Path) -> None:
    ks = keys(6)
    cases = (({"nvme_read": 1e6}, "partial"), ({"nvme_read": 1e13}, "load"))
    for rates, expected in cases:
        cfg = config(
            tmp_path / expected,
            hbm_bytes=0,
            dram_bytes=16 * SLOT,
            bandwidth_bytes_per_s=rates,
            compute_flops=1e12,
            watermark_warn=0.2,
            watermark_low=0.2,
        )
        with TierManager.open(cfg) as tm:
            tm.offer(ks, [page(i) for i in range(6)])
            for _ in range(5):
                tm.drain()
                tm.step()
            result = tm.lookup(ks)
            dram, nvme = result.pages_by_tier[1], result.pages_by_tier[2]
            assert dram > 0 and nvme > 0 and result.hit_pages == 6  # the tail went down
            if expected == "partial":
                # 1 MB/s: reading a page costs more than recomputing it; DRAM is cheaper.
                assert result.plan.load_pages == dram
                assert result.plan.reason.startswith("partial")
                assert result.state is LookupState.READY
            else:
                assert result.plan.load_pages == 6
                assert result.state is LookupState.PENDING
            got = load_all(tm, ks)
            for i, g in enumerate(got):
                assert torch.equal(g, page(i))


def test_miss_when_every_hit_is_on_a_slow_disk(tmp_path: Path) -> None:
    cfg = config(
        tmp_path,
        hbm_bytes=0,
        dram_bytes=16 * SLOT,
        bandwidth_bytes_per_s={"nvme_read": 1e6},
        compute_flops=1e12,
        watermark_warn=0.01,
        watermark_low=0.01,
        warm_dram_on_open=False,
    )
    with TierManager.open(cfg) as tm:
        tm.offer(keys(2), [page(0), page(1)])
        for _ in range(5):
            tm.drain()
            tm.step()
        result = tm.lookup(keys(2))
        assert result.pages_by_tier == (0, 0, 2)
        assert result.state is LookupState.MISS
        assert result.plan.reason == "recompute is faster"
        assert tm.stats().recompute_decisions == {"faster": 1}


def test_orphans_are_declined_and_descendants_with_them(tmp_path: Path) -> None:
    with TierManager.open(config(None)) as tm:
        out = tm.offer([b"c1", b"c2"], [page(1), page(2)], parents=[b"missing-parent", b"c1"])
        assert out.tiers == (None, None)
        assert out.reasons[0].startswith("orphan")
        assert out.reasons[1] == "parent declined"
        assert tm.lookup([b"c1"]).hit_pages == 0


def test_pinned_pages_are_never_evicted(tmp_path: Path) -> None:
    cfg = config(None, hbm_bytes=2 * SLOT, dram_bytes=2 * SLOT, control_interval_s=0)
    with TierManager.open(cfg) as tm:
        tm.offer([b"root"], [page(0)])
        tm.drain()
        assert tm.pin([b"root", b"absent"]) == [True, False]
        for i in range(20):
            tm.offer([f"x{i}".encode()], [page(i)], parents=[None])
            tm.drain()
            tm.step()
        assert tm.lookup([b"root"]).hit_pages == 1
        tm.unpin([b"root"])
        with pytest.raises(ValueError, match="not pinned"):
            tm.unpin([b"root"])


def test_everything_pinned_declines_without_raising() -> None:
    # No control thread: a full DRAM would otherwise lose a page before the pin.
    cfg = config(None, hbm_bytes=0, dram_bytes=2 * SLOT, control_interval_s=0)
    with TierManager.open(cfg) as tm:
        tm.offer([b"a", b"b"], [page(0), page(1)], parents=[None, None])
        tm.drain()
        assert tm.pin([b"a", b"b"]) == [True, True]
        out = tm.offer([b"c"], [page(2)], parents=[None])
        assert out.tiers == (None,)
        assert "full" in out.reasons[0]


def test_a_decline_while_dram_is_being_written_back_says_so(tmp_path: Path) -> None:
    """A full DRAM of pages not yet on NVMe: the allocation starts their write-back and
    the offer is declined; the reason says that, not "every page pinned or in flight"
    (none was). No control thread: nothing cleans DRAM ahead of the second offer.
    With ``offer_wait_s`` 0: by default such a page waits for a slot (the next test)."""
    cfg = config(tmp_path, hbm_bytes=0, dram_bytes=12 * SLOT, control_interval_s=0, offer_wait_s=0)
    with TierManager.open(cfg) as tm:
        first = tm.offer(keys(10, "a"), [page(i) for i in range(10)])
        assert first.reasons == ("admitted",) * 10
        tm.drain()
        second = tm.offer(keys(10, "b"), [page(10 + i) for i in range(10)])
        declined = [r for r in second.reasons if r.startswith("declined: DRAM full")]
        assert declined, second.reasons
        assert all("written to NVMe" in r for r in declined), declined
        assert tm.drain()
        assert tm.stats().pages_by_tier[2] > 0  # the write-back the decline started


def test_a_page_that_waited_for_a_write_back_lands_with_its_bytes(tmp_path: Path) -> None:
    """The same two offers with waiting on (the default): the second offer's pages wait
    for the first's write-backs to free DRAM slots, its release handle fires only once
    they are copied from the engine's tensors (rule R2), and each reads back exact."""
    cfg = config(tmp_path, hbm_bytes=0, dram_bytes=12 * SLOT, control_interval_s=0)
    with TierManager.open(cfg) as tm:
        first = tm.offer(keys(10, "a"), [page(i) for i in range(10)])
        tm.drain()
        sources = [page(10 + i) for i in range(10)]
        second = tm.offer(keys(10, "b"), sources)
        assert "waiting" in second.reasons, second.reasons
        assert second.declined == 0 and first.declined == 0
        assert second.hbm_release.wait(10)
        for source in sources:
            source.zero_()  # the engine reuses its blocks: the copies must be done
        assert tm.drain()
        assert tm.stats().admissions.get("dram:waited", 0) >= second.reasons.count("waiting")
        got = load_all(tm, keys(10, "b"))
        assert len(got) == 10
        assert all(torch.equal(g, page(10 + i)) for i, g in enumerate(got))


def test_bad_input_is_refused_before_anything_changes() -> None:
    with TierManager.open(config(None)) as tm:
        with pytest.raises(ValueError, match="sources"):
            tm.offer([b"a", b"b"], [page(0)])
        with pytest.raises(ValueError, match="bytes"):
            tm.offer([b"a"], [torch.zeros(PAGE + 1, dtype=torch.uint8)])
        with pytest.raises(TypeError, match=r"torch\.Tensor"):
            tm.offer([b"a"], [b"not a tensor"])
        with pytest.raises(ValueError, match="contiguous"):
            tm.offer([b"a"], [torch.zeros(2, PAGE // 2, dtype=torch.uint8).t()])
        with pytest.raises(TypeError, match="keys"):
            tm.offer([1.5], [page(0)])
        with pytest.raises(ValueError, match="observe_prefill"):
            tm.observe_prefill(0, 0, 1.0)
        assert tm.stats().pages == 0


def test_engine_mode_tracks_hbm_and_keeps_dram(tmp_path: Path) -> None:
    with TierManager.open(config(None, hbm="engine", hbm_bytes=1 << 30)) as tm:
        offered = tm.offer([b"e0", b"e1"], [page(0), page(1)])
        assert offered.tiers == (0, 0)  # the engine's HBM holds them
        tm.drain()
        # The manager cannot read the engine's GPU copy: it serves them from DRAM.
        assert tm.lookup([b"e0", b"e1"]).pages_by_tier == (0, 2, 0)
        tm.notify_hbm_evicted([b"e0", b"e1"])
        result = tm.lookup([b"e0", b"e1"])
        assert result.pages_by_tier == (0, 2, 0)
        got = load_all(tm, [b"e0", b"e1"])
        assert torch.equal(got[0], page(0)) and torch.equal(got[1], page(1))


def test_observe_prefill_moves_compute_and_explain_shows_numbers(tmp_path: Path) -> None:
    with TierManager.open(config(None)) as tm:
        tm.observe_prefill(1024, 0, 0.01)
        flops = tm.stats().compute_flops
        assert flops != 1e11
        tm.offer([b"a"], [page(0)], RequestContext(tag="tenant-a"))
        text = tm.explain(b"a")
        assert "kappa" in text and "p(reuse)" in text and "tenant-a" in text
        assert "not resident" in tm.explain(b"zz")


def test_closed_manager_refuses_calls() -> None:
    tm = TierManager.open(config(None))
    tm.close()
    tm.close()
    from kvstore.errors import ClosedError

    with pytest.raises(ClosedError):
        tm.lookup([b"a"])


def test_a_configured_bandwidth_wins_over_the_saved_statistics(tmp_path: Path) -> None:
    # The statistics file restores measured bandwidths, but a path the operator sets
    # in the configuration (a known slow disk) is not overwritten by a saved number.
    with TierManager.open(config(tmp_path, bandwidth_bytes_per_s={"nvme_read": 5e9})):
        pass  # close saves the statistics, nvme_read = 5e9 among them
    slow = {"nvme_read": 1e6}
    with TierManager.open(config(tmp_path, bandwidth_bytes_per_s=slow)) as tm:
        rates = tm.stats().bandwidth_bytes_per_s
        assert rates["nvme_read"] == 1e6
        assert rates["nvme_write"] != 1e6  # the others are restored as before


def test_fsck_accepts_the_tier_managers_statistics_file(tmp_path: Path) -> None:
    from kvstore import KVStore

    with TierManager.open(config(tmp_path)) as tm:
        tm.offer([b"a"], [page(0)])
        tm.drain()
    assert (tmp_path / "nvme" / "tiering-stats.json").exists()
    with KVStore.open(tmp_path / "nvme") as store:
        report = store.check()
    assert not [f for f in report if f.kind == "stray-file"], list(report)


def _count_steps(tm: TierManager) -> list[float]:
    """The times of the control thread's cycles from now on."""
    at: list[float] = []
    inner = tm.step

    def step() -> None:
        at.append(time.monotonic())
        inner()

    tm.step = step  # type: ignore[method-assign]
    return at


def test_an_idle_manager_backs_off_and_a_call_wakes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An idle manager's control thread cycled every control_interval_s (2 ms by
    # default: 500 wake-ups a second, 5% of a core). With nothing in flight and no
    # call it now backs off to _IDLE_MAX_S; a call that takes the lock wakes it.
    # The ceiling raised to 0.4 s here, so that "at once" and "at the next backoff
    # tick" stay far apart on a loaded 2-core CI machine (at 50 ms, a 20 ms bound on
    # the wake-up was a scheduling race); the control thread reads it when it starts.
    from kvstore.tiering import manager as manager_module

    monkeypatch.setattr(manager_module, "_IDLE_MAX_S", 0.4)
    with TierManager.open(config(tmp_path, control_interval_s=0.002)) as tm:
        tm.offer(keys(2), [page(0), page(1)])
        assert tm.drain(10)
        steps = _count_steps(tm)
        time.sleep(1.8)  # 2 ms doubling up to 0.4 s: settled within ~1 s
        idle = [t for t in steps if t > time.monotonic() - 0.8]
        assert len(idle) <= 0.8 / 0.4 + 2, len(idle)  # at 2 ms it would be ~400
        assert tm._lock.idle
        for _ in range(2):  # twice: a backoff tick that happened to fall just after
            before = len(steps)
            called = time.monotonic()
            tm.lookup(keys(2))  # a call: the thread cycles at once, not 0.4 s later
            deadline = time.monotonic() + 2.0
            while len(steps) == before and time.monotonic() < deadline:
                time.sleep(0.0005)
            assert len(steps) > before
            assert steps[before] - called < 0.15, steps[before] - called
            time.sleep(0.9)  # back into the backoff


def test_a_manager_with_work_in_flight_does_not_back_off(tmp_path: Path) -> None:
    with TierManager.open(config(tmp_path, control_interval_s=0.002)) as tm:
        steps = _count_steps(tm)
        deadline = time.monotonic() + 0.5
        i = 0
        while time.monotonic() < deadline:  # a call every few ms keeps it at the interval
            tm.offer([b"busy%d" % i], [page(i)])
            i += 1
            time.sleep(0.004)
        assert not tm._lock.idle
        assert len(steps) >= 0.5 / 0.002 / 4, len(steps)  # ~250 at 2 ms; never backed off


def test_close_of_an_idle_manager_is_prompt(tmp_path: Path) -> None:
    tm = TierManager.open(config(tmp_path, control_interval_s=0.002))
    time.sleep(0.6)
    assert tm._lock.idle
    started = time.monotonic()
    tm.close()
    assert time.monotonic() - started < 1.0


def test_dram_stays_full_where_its_pages_would_leave_unwritten() -> None:
    # Without NVMe a DRAM page leaves by being dropped, which frees its slot the moment
    # an allocation wants one. The control cycle evicted DRAM down to its low watermark
    # all the same, and the slots stayed empty until the next offer (`kvstore sim
    # --generate agent --capacity 0.01,0.05,0`: DRAM 87% full, hit ratio 0.487; kept
    # full, 0.798).
    with TierManager.open(config(None, dram_bytes=20 * SLOT)) as tm:
        for i, key in enumerate(keys(60)):
            assert tm.offer([key], [page(i)]).hbm_release.wait(10)
            tm.drain()
            tm.step()
        for _ in range(20):
            time.sleep(0.002)
            tm.step()
        stats = tm.stats()
        # (One slot may be empty: an allocation frees two pages for one slot.)
        assert stats.pages_by_tier[1] >= 19, stats.pages_by_tier
        assert stats.evictions.get("dram:dropped", 0) >= 60 - 20 - 4

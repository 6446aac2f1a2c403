"""NVMe admission by measured payoff: the gate per class of page, and in the manager."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.tiering import TierConfig, TierManager
from kvstore.tiering.pages import PageRec
from kvstore.tiering.payoff import ONCE, REUSED, WritePayoff
from tests.unit.tiering.test_tiering_manager import SLOT, keys, load_all, page
from tests.unit.tiering.test_tiering_manager import config as manager_config


def k(i: int) -> bytes:
    return f"p{i}".encode()


def test_the_prior_writes_pages_seen_again_and_not_pages_seen_once() -> None:
    gate = WritePayoff(0.1, horizon_pages=100)
    assert not gate.admits(1)
    assert gate.admits(2) and gate.admits(7)


def test_ghosts_asked_for_again_open_the_closed_class() -> None:
    gate = WritePayoff(0.1, horizon_pages=1000)
    for i in range(40):
        gate.declined(k(i), seen=1)
    assert not gate.admits(1) and gate.changes == 0
    # Half of them asked for again, in prefix order, while remembered, by two lookups:
    # they would have been NVMe hits, and 50% is far above the 10% bar.
    gate.missed([k(i) for i in range(10)])
    gate.missed([k(i) for i in range(10, 20)])
    assert gate.admits(1)
    assert gate.changes == 1
    assert gate.payoff(ONCE) == pytest.approx(1.0)  # only paid ghosts settled so far


def test_one_lookup_finding_many_ghosts_does_not_open_the_class_a_second_does() -> None:
    """One document re-read is one occasion, however many of its pages were ghosts
    (`kvstore sim --generate long-docs` seed 2 at 0.005: one lookup found four, the
    class opened, and it wrote 8,400 pages nobody read back)."""
    gate = WritePayoff(0.001, horizon_pages=1000)
    for i in range(40):
        gate.declined(k(i), seen=1)
    gate.missed([k(i) for i in range(16)])  # 16 read-backs: the share and _MIN_PAID met
    assert gate.payoff(ONCE) == pytest.approx(1.0)
    assert not gate.admits(1) and gate.changes == 0
    gate.declined(k(40), seen=1)  # the request's own pages, between the two lookups
    gate.missed([k(20)])
    assert gate.admits(1) and gate.changes == 1


def test_a_run_of_read_backs_is_one_occasion_and_any_other_event_ends_it() -> None:
    gate = WritePayoff(0.1, horizon_pages=1000)
    for i in range(40):
        gate.written(k(i), seen=2)
    for i in range(5):
        gate.read_back(k(i))  # one load of five pages
    assert gate.to_json()["occasions"][REUSED] == pytest.approx(1.0, abs=0.01)
    gate.written(k(40), seen=2)
    gate.read_back(k(5))
    assert gate.to_json()["occasions"][REUSED] == pytest.approx(2.0, abs=0.01)
    gate.missed([k(6)])  # no ghost of it: nothing settles, nothing counts
    assert gate.to_json()["occasions"][REUSED] == pytest.approx(2.0, abs=0.01)


def test_one_ghost_asked_again_does_not_open_the_class_three_do() -> None:
    """One read-back among hundreds meets a bar of 0.001 but is no evidence: the class
    opens only with a decayed count of three read-backs behind it (`kvstore sim --generate
    long-docs` at 0.005: one ghost asked again opened it, and it wrote 7,714 pages
    before the first unpaid write could settle)."""
    gate = WritePayoff(0.001, horizon_pages=10)
    for i in range(30):
        gate.declined(k(i), seen=1)  # 20 of them fall out unasked: unpaid
    gate.missed([k(25)])
    assert gate.payoff(ONCE) > 0.001
    assert not gate.admits(1) and gate.changes == 0
    gate.missed([k(26)])
    gate.missed([k(27)])  # three, less their decay: 2.998...
    assert not gate.admits(1)
    gate.missed([k(28)])
    assert gate.admits(1) and gate.changes == 1


def test_a_miss_settles_ghosts_only_up_to_the_first_key_that_is_not_one() -> None:
    gate = WritePayoff(0.1, horizon_pages=1000)
    gate.declined(k(1), seen=1)
    gate.declined(k(2), seen=1)
    gate.missed([k(0), k(1), k(2)])  # k0 was never dropped: the prefix stops there
    assert gate.has_ghosts()
    gate.missed([k(1), k(2)])
    assert not gate.has_ghosts()


def test_ghosts_that_fall_out_unasked_keep_the_class_closed() -> None:
    gate = WritePayoff(0.1, horizon_pages=10)
    for i in range(200):
        gate.declined(k(i), seen=1)
    assert not gate.admits(1)
    assert gate.payoff(ONCE) == 0.0


def test_written_pages_never_read_back_close_an_open_class_with_hysteresis() -> None:
    gate = WritePayoff(0.2, horizon_pages=10_000)
    assert gate.admits(2)
    # 15% of reused pages read back: below the bar (0.2) but above the close level
    # (0.1): the class stays open.
    for i in range(400):
        gate.written(k(i), seen=2)
        if i % 20 < 3:
            gate.read_back(k(i))
        else:
            gate.deleted(k(i))
    assert gate.admits(2)
    assert gate.payoff(REUSED) == pytest.approx(0.15, abs=0.03)
    # None read back any more: it closes once the decayed share falls below 0.1.
    for i in range(400, 1400):
        gate.written(k(i), seen=2)
        gate.deleted(k(i))
    assert not gate.admits(2)


def test_a_class_read_back_in_bursts_stays_open_between_them() -> None:
    """1% of the writes read back, ten at a time every thousand writes (a long prompt
    re-read): above the close level, so the class stays open through the gaps. (Counts
    decayed over ~500 pages closed it in every gap: `long-prompts`' seen-once class.)"""
    gate = WritePayoff(0.01, horizon_pages=100_000)
    i = 0
    for _ in range(10):
        for _ in range(10):
            gate.written(k(i), seen=2)
            gate.read_back(k(i))
            i += 1
        for _ in range(990):
            gate.written(k(i), seen=2)
            gate.deleted(k(i))
            i += 1
            assert gate.admits(2), i
    assert gate.changes == 0


def test_a_write_unread_after_capacity_later_writes_counts_as_unpaid() -> None:
    gate = WritePayoff(0.5, horizon_pages=4)
    for i in range(30):
        gate.written(k(i), seen=2)  # none read back, none deleted: they age out
    assert gate.payoff(REUSED) == 0.0
    assert not gate.admits(2)


def test_the_state_round_trips_through_json() -> None:
    gate = WritePayoff(0.1, horizon_pages=100)
    for i in range(40):
        gate.declined(k(i), seen=1)
    gate.missed([k(i) for i in range(20)])
    again = WritePayoff(0.1, horizon_pages=100)
    again.load_json(gate.to_json())
    assert again.open == gate.open
    assert again.payoff(ONCE) == gate.payoff(ONCE)
    assert again.to_json() == gate.to_json()


def test_a_saved_gate_without_occasions_loads_with_none() -> None:
    """A statistics file written before the gate counted occasions: the counts load,
    a closed class needs two new occasions to open."""
    gate = WritePayoff(0.1, horizon_pages=100)
    saved = {"open": [0.0, 1.0], "paid": [5.0, 1.0], "unpaid": [20.0, 3.0]}
    gate.load_json(saved)
    assert gate.to_json()["occasions"] == [0.0, 0.0]
    assert gate.payoff(ONCE) == pytest.approx(0.2)
    gate.declined(k(1), seen=1)
    gate.declined(k(2), seen=1)
    gate.missed([k(1)])
    assert not gate.admits(1)
    gate.declined(k(3), seen=1)
    gate.missed([k(2)])
    assert gate.admits(1)


@pytest.mark.parametrize("bar", [-0.1, 1.5, float("nan"), float("inf")])
def test_a_bar_outside_0_1_is_refused_with_its_name(bar: float) -> None:
    with pytest.raises(ValueError, match="nvme_write_payoff"):
        TierConfig(nvme_write_payoff=bar)


# -- in the manager, on a real store ------------------------------------------------


def _manager_config(tmp_path: Path, **overrides: Any) -> TierConfig:
    settings: dict[str, Any] = dict(
        dram_bytes=16 * SLOT,
        watermark_warn=0.5,
        watermark_low=0.4,
        admission="value_density",
        nvme_write_payoff=0.1,
    )
    settings.update(overrides)
    return manager_config(tmp_path, **settings)


def _offer_chain(tm: TierManager, ks: list[bytes], first: int) -> None:
    """Offer ``ks`` as prefixes of two pages each (a request's pages)."""
    for i in range(0, len(ks), 2):
        parents = [None, ks[i]]
        out = tm.offer(ks[i : i + 2], [page(first + j) for j in range(i, i + 2)], parents=parents)
        assert out.admitted == 2, out.reasons
        for _ in range(3):
            tm.drain()
            tm.step()
    assert tm.drain()


def test_pages_seen_once_leave_dram_unwritten_then_ghosts_open_the_gate(
    tmp_path: Path,
) -> None:
    with TierManager.open(_manager_config(tmp_path)) as tm:
        first = keys(40, "a")
        _offer_chain(tm, first, 0)
        stats = tm.stats()
        assert stats.nvme_pages_written == 0
        assert stats.admissions.get("nvme:no_payoff", 0) > 0
        # Asked for again: they are gone (nothing wrote them), but their ghosts show
        # that writing them would have paid.
        missed = [tm.lookup(first[i : i + 2]).hit_pages == 0 for i in range(0, 40, 2)]
        assert sum(missed) >= 8
        # The next pages seen once are written on their way out of DRAM.
        second = keys(40, "b")
        _offer_chain(tm, second, 100)
        assert tm.stats().nvme_pages_written > 0
        got = load_all(tm, second)
        assert len(got) == len(second)
        for i, g in enumerate(got):
            assert torch.equal(g, page(100 + i)), i


def test_the_gate_off_writes_pages_seen_once(tmp_path: Path) -> None:
    with TierManager.open(_manager_config(tmp_path, nvme_write_payoff=None)) as tm:
        _offer_chain(tm, keys(40, "a"), 0)
        stats = tm.stats()
        assert stats.nvme_pages_written > 0
        assert stats.admissions.get("nvme:no_payoff", 0) == 0
        assert stats.nvme_write_gate is None


def test_stats_show_the_gate(tmp_path: Path) -> None:
    with TierManager.open(_manager_config(tmp_path)) as tm:
        assert tm.stats().nvme_write_gate == (False, True)  # the prior
        first = keys(40, "a")
        _offer_chain(tm, first, 0)
        for i in range(0, 40, 2):
            tm.lookup(first[i : i + 2])
        assert tm.stats().nvme_write_gate == (True, True)


def test_the_gate_survives_a_restart(tmp_path: Path) -> None:
    with TierManager.open(_manager_config(tmp_path)) as tm:
        first = keys(40, "a")
        _offer_chain(tm, first, 0)
        assert tm.stats().nvme_pages_written == 0
        for i in range(0, 40, 2):
            tm.lookup(first[i : i + 2])  # the ghosts open the gate of pages seen once
    with TierManager.open(_manager_config(tmp_path, warm_dram_on_open=False)) as tm:
        # Without the saved gate, the prior would keep pages seen once off NVMe.
        _offer_chain(tm, keys(40, "c"), 200)
        assert tm.stats().nvme_pages_written > 0


@pytest.mark.parametrize(
    "payoff",
    [
        {"open": [1], "paid": [0, 0], "unpaid": [0, 0]},
        {"open": [1, 0], "paid": [-1, 0], "unpaid": [0, 0]},
        {"open": [1, 0], "paid": [0, 0]},
        {"open": [1, 0], "paid": [0, 0], "unpaid": [0, 0], "occasions": [0, -1]},
        {"open": [1, 0], "paid": [0, 0], "unpaid": [0, 0], "occasions": "2"},
        [1, 0],
    ],
)
def test_a_damaged_payoff_field_in_the_stats_file_is_refused(payoff: object) -> None:
    from kvstore.tiering.statsfile import parse_for_manager, snapshot

    data = snapshot(
        reuse=[],
        tau={"tau": [0, 0, 0], "gain": [0, 0, 0], "victim_vd": [0, 0, 0]},
        bandwidth={},
        compute_flops=1e12,
        heat=[],
        summary={
            "pages_by_tier": [0, 0, 0],
            "used_bytes": [0, 0, 0],
            "capacity_bytes": [0, 0, 0],
            "hits_by_tier": [0, 0, 0],
            "misses": 0,
            "lookups": 0,
            "nvme_pages_written": 0,
            "nvme_bytes_written": 0,
            "counters": {},
            "kappa": [1, 1, 1],
        },
    )
    assert parse_for_manager(data, "stats").payoff is None  # optional: absent is fine
    data["payoff"] = payoff
    with pytest.raises(ValueError, match="payoff"):
        parse_for_manager(data, "stats")


def test_while_a_class_is_closed_dram_keeps_the_pages_worth_writing() -> None:
    # System prompts (written: seen again) among user turns seen once (declined). An
    # allocation that freed clean pages first would free exactly the system prompts,
    # then serve them from NVMe: DRAM 0.21 / NVMe 0.34 of accesses, measured before.
    from kvstore.tiering.sim import replay
    from kvstore.tiering.sim.trace import generate

    # A bar at which pages seen once stay closed here (at the default 0.001 some of
    # their ghosts are asked for again and the class opens).
    requests = generate("system-prompts", seed=7, requests=1500, block_tokens=512)
    document = replay.run(
        requests,
        capacity_fractions=(0.005, 0.02, 0.1),
        policies=["kvstore:nvme_write_payoff=0.07"],
    )
    by_tier = document["results"][0]["hit_ratio_by_tier"]
    # (HBM and DRAM together: an offer into a full HBM places its page in DRAM, so
    # the split between the two moves with HBM's policy, not with this one.)
    assert by_tier["hbm"] + by_tier["dram"] > 0.7, by_tier
    assert by_tier["nvme"] < 0.1, by_tier


def test_a_sim_policy_turns_the_gate_off_with_none() -> None:
    from kvstore.tiering.sim import parse_overrides

    assert parse_overrides("kvstore:nvme_write_payoff=None") == {"nvme_write_payoff": None}
    assert parse_overrides("kvstore:nvme_write_payoff=0.02") == {"nvme_write_payoff": 0.02}
    with pytest.raises(ValueError):  # a field that takes no None keeps refusing it
        parse_overrides("kvstore:hysteresis_s=none")
    # An optional whole number stays one (TierConfig refuses a float there).
    assert parse_overrides("kvstore:ghost_entries=1000") == {"ghost_entries": 1000}
    assert parse_overrides("kvstore:ghost_entries=None") == {"ghost_entries": None}
    with pytest.raises(ValueError, match="whole number"):
        parse_overrides("kvstore:ghost_entries=1e3")


@pytest.mark.parametrize("weight", [1.0, 0.0])
def test_the_managers_orders_rank_pages_seen_once_by_the_reuse_estimators_class(
    tmp_path: Path, weight: float
) -> None:
    """Φ's probation term is wired to the manager's own reuse estimator (the classes the
    lookups and offers teach it), in every order; phi_reuse_weight=0 turns it off."""
    with TierManager.open(_manager_config(tmp_path, phi_reuse_weight=weight)) as tm:
        probe = PageRec(b"probe", None, 3, 256, SLOT, 120.0)
        probe.tag = "t"
        for _ in range(6):  # teach class (depth 3, tag t): seen once, then again
            key = os.urandom(8)
            tm._reuse.access(key, 3, "t", lookup=False)
            tm._reuse.access(key, 3, "t", lookup=True)
        p = tm._reuse.p_first(probe)
        assert p > 0.25  # moved off the prior
        for order in tm._orders:
            base = 120.0 / 60.0 - 3e-6 / 60.0  # recency, the depth tie
            assert order.score(probe) == pytest.approx(base + weight * math.log(p))  # type: ignore[attr-defined]
            probe.reused = True
            assert order.score(probe) == pytest.approx(base)  # type: ignore[attr-defined]
            probe.reused = False


@pytest.mark.parametrize("weight", [-0.5, float("nan"), float("inf")])
def test_a_negative_or_non_finite_probation_weight_is_refused(weight: float) -> None:
    with pytest.raises(ValueError, match="phi_reuse_weight"):
        TierConfig(phi_reuse_weight=weight)


def test_the_reuse_horizon_counts_a_bounded_nvme_and_not_an_unbounded_one(
    tmp_path: Path,
) -> None:
    """``ghost_entries=None``: half the pages HBM, DRAM and NVMe hold (at least 4,096);
    a store without a capacity adds none (its pages are no number: the cap, 256 Ki
    entries of ~200 bytes, would be taken for every unbounded store)."""
    from kvstore.tiering.value import GHOST_ENTRIES_MIN

    bounded = _manager_config(tmp_path / "a", nvme_bytes=20_000 * SLOT)
    with TierManager.open(bounded) as tm:
        assert tm._reuse._limit == (4 + 16 + 20_000) // 2
    with TierManager.open(_manager_config(tmp_path / "b", nvme_bytes=None)) as tm:
        assert tm._nvme.capacity is None
        assert tm._reuse._limit == GHOST_ENTRIES_MIN
    explicit = _manager_config(tmp_path / "c", ghost_entries=777)
    with TierManager.open(explicit) as tm:
        assert tm._reuse._limit == 777


def test_dram_stays_full_while_the_gate_closes_every_class(tmp_path: Path) -> None:
    # Every dirty page then leaves DRAM unwritten, freeing its slot the moment an
    # allocation wants it: the control cycle must not evict DRAM down to its low
    # watermark ahead of need (here 0.4: it kept 8 of 20 slots).
    with TierManager.open(_manager_config(tmp_path, dram_bytes=20 * SLOT)) as tm:
        gate = tm._value.payoff
        assert gate is not None
        gate.open = [False, False]
        gate.changes += 1  # cached admissions follow
        _offer_chain(tm, keys(60, "a"), 0)
        for _ in range(20):
            time.sleep(0.002)
            tm.step()
        stats = tm.stats()
        assert stats.nvme_pages_written == 0
        assert stats.admissions.get("nvme:no_payoff", 0) > 0
        # (One slot may be empty: an allocation frees two pages for one slot.)
        assert stats.pages_by_tier[1] >= 19, stats.pages_by_tier

"""Eviction orders (Φ, LRU, ARC), the reuse estimator, τ, admission modes."""

from __future__ import annotations

import math
import random

import pytest

from kvstore.tiering.pages import PageRec, PageState
from kvstore.tiering.policy import (
    Admission,
    ARCOrder,
    LRUOrder,
    PhiOrder,
    ReuseEstimator,
    TauController,
    depth_bucket,
)


def rec(
    name: str, *, last: float = 0.0, hits: float = 0.0, depth: int = 0, shared: bool = True
) -> PageRec:
    page = PageRec(name.encode(), None, depth, 256, 4096, last)
    page.hits = hits
    page.shared = shared  # Φ counts hits only where the prefix branches
    return page


def names(pages: list[PageRec]) -> list[str]:
    return [p.key.decode() for p in pages]


def take_all(order: object, eligible=lambda r: True) -> list[str]:  # type: ignore[no-untyped-def]
    picked = order.victims(100, eligible, 1000)  # type: ignore[attr-defined]
    return names(picked)


@pytest.mark.parametrize(
    ("weights", "pages", "expected"),
    [
        # Recency only: oldest first.
        ((1, 0, 0, 0), [("a", 30, 0), ("b", 10, 0), ("c", 20, 0)], ["b", "c", "a"]),
        # Hits only, log-dampened: fewest first; 100 hits beat 10 but not by 10x.
        ((0, 1, 0, 0), [("a", 0, 100), ("b", 0, 10), ("c", 0, 0)], ["c", "b", "a"]),
        # One unit of recency per 60 s: a page touched 2 min later outranks ln(1+5) hits.
        ((1, 1, 0, 0), [("old-hot", 0, 5), ("new-cold", 120, 0)], ["old-hot", "new-cold"]),
        ((1, 1, 0, 0), [("old-hot", 0, 20), ("new-cold", 120, 0)], ["new-cold", "old-hot"]),
    ],
)
def test_phi_order(
    weights: tuple[float, ...], pages: list[tuple[str, float, float]], expected: list[str]
) -> None:
    order = PhiOrder(weights, 60.0, lambda r: 1.0)  # type: ignore[arg-type]
    for name, last, hits in pages:
        order.add(rec(name, last=last, hits=hits))
    assert take_all(order) == expected
    assert [p.key.decode() for p in order] == expected


def test_phi_hits_count_only_for_shared_pages() -> None:
    """An unshared chain (one continuation) is ranked by recency alone."""
    order = PhiOrder((1, 1, 0, 0), 60.0, lambda r: 1.0)  # type: ignore[arg-type]
    order.add(rec("chain-hot", last=0, hits=20, shared=False))
    order.add(rec("shared-hot", last=0, hits=20, shared=True))
    order.add(rec("new-cold", last=120, hits=0, shared=False))
    assert take_all(order) == ["chain-hot", "new-cold", "shared-hot"]


@pytest.mark.parametrize("cost_term", [0.0, 1.0])  # 0: the fast closure; 1: score()
def test_phi_hits_count_by_the_share_of_reads_that_branched(cost_term: float) -> None:
    """A shared document's page with three hits, each read a branch, counts all three;
    one whose reads branched half the time (2 hits in 4 reads) counts 2 x 1/2. A
    session's page re-read by its own twenty turns and branched at three of them
    (backtracks: under half of its reads) counts none, and ranks as an unshared page
    of its age. Fewer reads than hits (a restart's heat, no reads yet) count the hits
    as they are."""
    order = PhiOrder((1, 1, cost_term, 0), 60.0, lambda r: 0.0)  # type: ignore[arg-type]
    session = rec("session", last=0, hits=3.0)
    session.reads = 20.0
    document = rec("document", last=0, hits=3.0)
    document.reads = 3.0
    half = rec("half", last=0, hits=2.0)
    half.reads = 4.0
    restored = rec("restored", last=0, hits=3.0)  # reads 0
    unshared = rec("unshared", last=0, hits=3.0, shared=False)
    newer = rec("newer", last=30, hits=0.0)  # 0.5 units of recency, no hits
    for page in (session, document, half, restored, unshared, newer):
        order.add(page)
    # session, unshared: 0 < newer's 0.5 < log1p(1) = 0.69 (half) < log1p(3) = 1.39
    assert take_all(order)[:3] == ["session", "unshared", "newer"]
    assert order.score(session) == pytest.approx(order.score(unshared))
    assert order.score(document) == pytest.approx(order.score(restored))
    assert order.score(half) - order.score(session) == pytest.approx(math.log1p(1.0))
    assert order.score(document) - order.score(session) == pytest.approx(math.log1p(3.0))


@pytest.mark.parametrize("cost_term", [0.0, 1.0])  # 0: the fast closure; 1: score()
def test_phi_probation_ranks_pages_not_yet_reused_by_their_class(cost_term: float) -> None:
    """w_p·ln p(reuse): a page seen once ranks by its class's chance to come back. At
    p = 0.05 and 60 s of recency per unit, ln 0.05 ≈ -3 is three minutes older; a
    reused page (or weight 0, or no estimator) takes no penalty."""
    p_of = {"scan": 0.05, "turn": 0.9}

    def reuse_p(page: PageRec) -> float:
        return p_of[page.tag]

    def pages() -> list[PageRec]:
        out = []
        for name, last, tag, reused in (
            ("scan-new", 150.0, "scan", False),  # seen once, 150 s newer than the rest
            ("turn-new", 100.0, "turn", False),
            ("scan-reused", 0.0, "scan", True),
        ):
            page = rec(name, last=last, shared=False)
            page.tag, page.reused = tag, reused
            out.append(page)
        return out

    weights = (1.0, 0.0, cost_term, 0.0)
    order = PhiOrder(weights, 60.0, lambda r: 0.0, 1.0, reuse_p)
    for page in pages():
        order.add(page)
    # scan-new: 2.5 - 3.0 = -0.5; scan-reused: 0; turn-new: 1.67 - 0.11
    assert take_all(order) == ["scan-new", "scan-reused", "turn-new"]
    for off in (
        PhiOrder(weights, 60.0, lambda r: 0.0, 0.0, reuse_p),
        PhiOrder(weights, 60.0, lambda r: 0.0),
    ):
        for page in pages():
            off.add(page)
        assert take_all(off) == ["scan-reused", "turn-new", "scan-new"]


def test_phi_probation_takes_a_class_never_seen_back_at_a_floor() -> None:
    order = PhiOrder((1, 0, 0, 0), 60.0, lambda r: 0.0, 1.0, lambda r: 0.0)
    page = rec("never", last=60.0, shared=False)
    order.add(page)
    assert order.score(page) == pytest.approx(1.0 + math.log(1e-6))


def test_reuse_estimator_p_first_is_the_class_of_a_page_seen_once() -> None:
    est = ReuseEstimator(64, (1.0, 3.0))
    page = rec("x", depth=5)
    page.tag = "t"
    assert est.p_first(page) == pytest.approx(0.25)  # the prior
    for i in range(8):  # depth 5's class, tag t: seen once, then seen again
        key = f"k{i}".encode()
        est.access(key, 5, "t", lookup=False)
        est.access(key, 5, "t", lookup=True)
    assert est.p_first(page) == pytest.approx(est.p(5, False, "t"))
    assert est.p_first(page) > 0.25


def test_phi_cost_and_slo_terms() -> None:
    order = PhiOrder((0, 0, 1, 1), 60.0, lambda r: 1.0 + r.depth / 10)
    deep, shallow, late = (
        rec("deep", depth=20),
        rec("shallow", depth=0),
        rec("late", last=100.0, depth=20),
    )
    late.deadline_s = -80.0  # three minutes past its SLO: its pages go first
    for page in (deep, shallow, late):
        order.add(page)
    assert take_all(order) == ["late", "shallow", "deep"]


def test_phi_touch_and_remove_are_lazy_but_exact() -> None:
    order = PhiOrder((1, 0, 0, 0), 60.0, lambda r: 1.0)
    pages = [rec(f"p{i}", last=float(i)) for i in range(5)]
    for page in pages:
        order.add(page)
    pages[0].last_access_s = 99.0
    order.touch(pages[0])
    order.remove(pages[2])
    assert len(order) == 4
    assert take_all(order) == ["p1", "p3", "p4", "p0"]
    # victims only chooses: nothing left the order.
    assert len(order) == 4


def test_victims_skip_ineligible_and_keep_them() -> None:
    for order in (LRUOrder(), PhiOrder((1, 0, 0, 0), 60.0, lambda r: 1.0), ARCOrder()):
        for i in range(6):
            order.add(rec(f"p{i}", last=float(i)))
        pinned = {"p0", "p2"}
        got = order.victims(3, lambda r, pinned=pinned: r.key.decode() not in pinned, 100)
        assert names(got) == ["p1", "p3", "p4"], order.name
        assert len(order) == 6


def test_equal_phi_goes_in_filing_order() -> None:
    """Ties (one request's pages at one instant and depth) leave in the order they
    were filed, before and after re-filing: the float heap moves a taken Φ to the
    next free float."""
    order = PhiOrder((1, 0, 0, 0), 60.0, lambda r: 1.0)
    pages = [rec(f"t{i}", last=7.0) for i in range(5)]
    for page in (pages[3], pages[0], pages[4], pages[1], pages[2]):
        order.add(page)
    assert take_all(order) == ["t3", "t0", "t4", "t1", "t2"]
    order.remove(pages[0])
    order.add(pages[0])  # filed again: after every equal page filed before it
    assert take_all(order) == ["t3", "t4", "t1", "t2", "t0"]


def test_a_busy_page_spends_the_scan_budget_at_every_scan() -> None:
    """Ineligible members stay in the scan and count against its budget each time:
    the manager's decisions depend on it (leaving busy pages out of the budget
    changed the conversation trace's TTFT p50 by 1.5%)."""
    order = PhiOrder((1, 0, 0, 0), 60.0, lambda r: 1.0)
    pages = [rec(f"p{i}", last=float(i)) for i in range(3)]
    for page in pages:
        order.add(page)
    pages[0].state = PageState.WRITING
    ready = lambda r: r.state is PageState.READY  # noqa: E731
    assert names(order.take(1, ready, 3)) == ["p1"]
    order.remove(pages[1])
    assert names(order.take(1, ready, 1)) == []  # p0 spends the budget again


def test_lru_touch_moves_to_the_back() -> None:
    order = LRUOrder()
    a, b, c = rec("a"), rec("b"), rec("c")
    for page in (a, b, c):
        order.add(page)
    a.last_access_s = 5.0  # the manager stamps the access, then touches
    order.touch(a)
    assert take_all(order) == ["b", "c", "a"]


def test_arc_protects_pages_seen_twice_from_a_scan() -> None:
    order = ARCOrder()
    hot = [rec(f"hot{i}") for i in range(4)]
    for page in hot:
        order.add(page)
        order.touch(page)  # second access: T2
    for i in range(8):
        order.add(rec(f"scan{i}"))
    victims = names(order.victims(4, lambda r: True, 100))
    assert all(v.startswith("scan") for v in victims)


def test_arc_ghost_hit_adapts() -> None:
    order = ARCOrder()
    pages = [rec(f"p{i}") for i in range(4)]
    for page in pages:
        order.add(page)
    order.remove(pages[0])  # left the tier: remembered in B1
    order.add(pages[0])  # a ghost hit in B1 grows T1's target and enters T2
    assert order._p >= 1.0
    assert b"p0" in order._t2


def test_reuse_estimator_converges_per_class() -> None:
    est = ReuseEstimator(entries=500, prior=(1.0, 3.0))
    rng = random.Random(3)
    # Depth-0 keys come back 80% of the time, deep keys 10%.
    for i in range(6000):
        est.access(b"root%d" % i, 0, "", lookup=False)
        if rng.random() < 0.8:
            est.access(b"root%d" % i, 0, "", lookup=False)
        est.access(b"deep%d" % i, 40, "", lookup=False)
        if rng.random() < 0.1:
            est.access(b"deep%d" % i, 40, "", lookup=False)
    assert est.p(0, False, "") == pytest.approx(0.8, abs=0.05)
    assert est.p(40, False, "") == pytest.approx(0.1, abs=0.05)
    assert est.p(5, False, "never-seen-tag") == pytest.approx(0.25)
    assert len(est) <= 500


def test_lookup_then_offer_counts_one_access() -> None:
    est = ReuseEstimator(entries=10, prior=(1.0, 1.0))
    assert est.access(b"k", 0, "", lookup=True) == 1
    assert est.access(b"k", 0, "", lookup=False) == 1  # the same request's offer
    assert est.access(b"k", 0, "", lookup=True) == 2
    assert est.seen(b"k") == 2


def test_depth_buckets() -> None:
    assert [depth_bucket(d) for d in (0, 1, 2, 3, 4, 7, 8, 1000)] == [0, 1, 2, 2, 3, 3, 4, 7]


def test_tau_tightens_under_pressure_and_relaxes_after() -> None:
    tau = TauController(0.0)
    for _ in range(20):
        tau.on_evict(2, 1e-9)
        tau.on_evict(1, 1e-9)
    for second in range(20):
        tau.update(float(second), (0.97, 0.97, 0.97), 0.90, 0.85, 0.0)
    assert tau.tau[2] == pytest.approx(2e-9, rel=0.2)  # gain saturates at 2 for NVMe
    assert tau.tau[0] == 0.0 and tau.tau[1] == 0.0  # the memory tiers keep τ0
    high = tau.tau[2]
    assert not tau.update(19.5, (0.0, 0.0, 0.97), 0.90, 0.85, 0.0)  # once per second
    for second in range(20, 60):
        tau.update(float(second), (0.0, 0.0, 0.5), 0.90, 0.85, 0.0)
    assert tau.tau[2] == 0.0 < high
    # Between the marks it holds: no oscillation.
    for second in range(60, 65):
        tau.update(float(second), (0.0, 0.0, 0.88), 0.90, 0.85, 0.0)
    assert tau.tau[2] == 0.0


def test_tau_nvme_follows_the_write_budget() -> None:
    tau = TauController(0.0)
    for _ in range(20):
        tau.on_evict(2, 2e-9)
    tau.update(0.0, (0.0, 0.0, 0.5), 0.90, 0.85, 3.0)
    assert tau.tau[2] > 0
    for second in range(1, 30):
        tau.update(float(second), (0.0, 0.0, 0.5), 0.90, 0.85, 0.5)
    assert tau.tau[2] == pytest.approx(2e-9 * 0.0 + tau._gain[2] * tau._victim_vd[2])


@pytest.mark.parametrize(
    ("mode", "threshold", "seen", "expected"),
    [
        ("all", 0, 1, (True, True, True)),
        ("freq2", 0, 1, (True, True, False)),
        ("freq2", 0, 2, (True, True, True)),
        ("store_threshold", 3, 2, (True, False, False)),
        ("store_threshold", 3, 3, (True, True, True)),
        ("value_density", 0, 1, (True, True, False)),  # VD 1.0 / 1.0 / -1.0 against τ 0
    ],
)
def test_admission_modes(mode: str, threshold: int, seen: int, expected: tuple[bool, ...]) -> None:
    vd = {0: 1.0, 1: 1.0, 2: -1.0}
    admission = Admission(mode, threshold, lambda r, t: vd[t])
    page = rec("a")
    assert tuple(admission.admit(page, t, seen, 0.0) for t in range(3)) == expected
    page.retained = True
    assert all(admission.admit(page, t, seen, math.inf) for t in range(3))


def test_access_lookup_counts_exactly_as_one_access_per_page() -> None:
    """The lookup's one-call walk against ``access(..., lookup=True)`` per page."""
    rng = random.Random(5)
    one, walk = ReuseEstimator(64, (1.0, 3.0)), ReuseEstimator(64, (1.0, 3.0))
    for _ in range(400):
        keys = [b"k%d" % rng.randrange(120) for _ in range(rng.randrange(1, 200))]
        tag = rng.choice(["a", "b"])
        if rng.random() < 0.3:  # offers in between, as a request's offer follows
            for depth, key in enumerate(keys):
                one.access(key, depth, tag, lookup=False)
                walk.access(key, depth, tag, lookup=False)
            continue
        for depth, key in enumerate(keys):
            one.access(key, depth, tag, lookup=True)
        walk.access_lookup(keys, tag)
    assert list(one._history.items()) == list(walk._history.items())
    assert one._classes == walk._classes


def test_ghost_entries_default_is_half_the_cache_within_bounds() -> None:
    from kvstore.tiering.value import GHOST_ENTRIES_MAX, GHOST_ENTRIES_MIN, ghost_entries_for

    assert ghost_entries_for(0) == GHOST_ENTRIES_MIN
    assert ghost_entries_for(100_000) == 50_000
    assert ghost_entries_for(1 << 40) == GHOST_ENTRIES_MAX


def test_the_reuse_estimator_learns_that_most_pages_seen_once_do_not_come_back() -> None:
    """`rag` at `0.02,0.1,0.5`: 20,000 documents with Zipf popularity, most read once.
    With the ghost map at twice the cache's pages (longer than the trace's distinct
    keys) no key ever fell out unseen, every class's p(reuse) stayed near 1, Φ's
    probation term ranked nothing and DRAM ran 82% full of pages seen once (TTFT p50
    242.5 ms against vLLM threshold 2's 220.8; 221.2 with the default map)."""
    from kvstore.tiering.config import MODEL_PRESETS
    from kvstore.tiering.manager import TierManager
    from kvstore.tiering.sim import replay
    from kvstore.tiering.sim.trace import generate

    requests = generate("rag", seed=1, requests=2500, block_tokens=512)
    unique = len({b for r in requests for b in r.blocks})
    capacity = (unique // 50, unique // 10, unique // 2)
    config = replay.kvstore_config(capacity, MODEL_PRESETS["llama-3.1-8b"], 512, replay.Machine())
    tm = TierManager.open(config)
    try:
        assert tm._reuse._limit == sum(capacity) // 2
        clock = tm.clock
        assert clock is not None
        for request in requests:
            clock.set(max(clock.now(), request.timestamp_s))
            tm.step()
            keys = [b"%d" % block for block in request.blocks]
            tm.lookup(keys)
            tm.offer(keys, None)
        # Documents' pages sit at depths 2-37 (after a 2-6 block system prompt).
        probe = PageRec(b"probe", None, 8, 512, 4096, 0.0)
        assert tm._reuse.p_first(probe) < 0.5
    finally:
        tm.close()


def test_the_cached_log_p_is_the_same_float_after_every_kind_of_count_change() -> None:
    """Φ's probation term reads ln p(reuse) of a page's class at every entry an eviction
    scan visits; the estimator caches it per class until its counts next change. After
    each change (an offer, a lookup's walk, a key falling out of the map, a load), the
    cached value and the fast score must be the very floats the uncached ones are:
    a replay's decisions may not move by a bit."""
    rng = random.Random(7)
    est = ReuseEstimator(entries=40, prior=(1.0, 3.0))
    order = PhiOrder((1, 1, 0, 1), 60.0, lambda r: 0.0, 1.0, est.p_first)
    probes = [rec(f"p{d}{t}", depth=d) for d in (0, 1, 3, 9, 70) for t in ("", "a")]
    for i, probe in enumerate(probes):
        probe.tag = "a" if i % 2 else ""
    fast = order._score

    def check() -> None:
        for probe in probes:
            want = math.log(max(est.p_first(probe), 1e-6))
            assert est.log_p_first(probe, 1e-6) == want
            assert fast(probe) == order.score(probe)

    for step in range(600):
        key = f"k{rng.randrange(120)}".encode()
        depth, tag = rng.randrange(80), rng.choice(["", "a"])
        kind = rng.randrange(3)
        if kind == 0:
            est.access_offer(key, depth, tag)
        elif kind == 1:
            est.access_lookup([f"k{rng.randrange(120)}".encode() for _ in range(5)], tag)
        else:
            est.access(key, depth, tag, lookup=False)
        check()
        if step == 300:
            est.load_json([[3, False, "a", 5.0, 1.0], [0, False, "", 0.5, 9.0]])
            check()


def test_a_deeper_class_measured_above_a_shallower_one_raises_it() -> None:
    """A page is reused only with its prefix: p(reuse) of pages seen once may not rise
    with depth. Depths 4-7 measured at 1/54, 16-31 at 21/29: the shallower class is
    raised to the deeper one's p; a deeper class without counts raises nothing."""
    est = ReuseEstimator(entries=100, prior=(1.0, 3.0))
    est.load_json([[3, False, "", 0.0, 50.0], [5, False, "", 20.0, 5.0]])
    high = 21.0 / 29.0
    assert est.p(5, False, "") == pytest.approx(1.0 / 54.0)  # the class itself
    assert est.p_first(rec("a", depth=5)) == high
    assert est.p_first(rec("b", depth=20)) == high
    assert est.p_first(rec("c", depth=1)) == high  # bucket 1: the prior, raised
    assert est.p_first(rec("d", depth=70)) == pytest.approx(0.25)  # no counts: the prior
    assert est.log_p_first(rec("a", depth=5), 1e-6) == math.log(high)


def test_a_chains_parent_never_ranks_below_its_child_by_the_probation_term() -> None:
    """Parent at depth 20, child at 40, touched at one instant, both seen once: the
    child's class (32-63) measured above the parent's (16-31). The child must still go
    first: a parent ranked below its child heads DRAM's order without being a victim,
    and every allocation scans past it (`long-docs`: 47 entries per block access)."""
    est = ReuseEstimator(entries=100, prior=(1.0, 3.0))
    est.load_json([[5, False, "", 1.0, 40.0], [6, False, "", 30.0, 10.0]])
    order = PhiOrder((1, 1, 0, 1), 60.0, lambda r: 0.0, 1.0, est.p_first)
    parent, child = rec("parent", depth=20), rec("child", depth=40)
    assert order.score(child) < order.score(parent)
    assert order._score(child) == order.score(child)

"""The tier manager's arithmetic: prefill FLOPs, κ, value density, the load plan
(against brute force), the bandwidth and compute fits."""

from __future__ import annotations

import dataclasses
import math
import random
import warnings

import pytest

from kvstore.tiering.config import MODEL_PRESETS, ModelCost, TierConfig, parse_admission
from kvstore.tiering.cost import LOAD_PATHS, Bandwidth, Compute, CostModel, make_bandwidths
from kvstore.tiering.sim import parse_overrides

LLAMA8 = MODEL_PRESETS["llama-3.1-8b"]


def model_with(nvme_gbps: float, *, h2d_gbps: float = 25.0, tpp: int = 512) -> CostModel:
    bandwidth = make_bandwidths(
        {"nvme_read": nvme_gbps * 1e9, "h2d": h2d_gbps * 1e9},
        {"nvme_read": 1e-4, "h2d": 1e-5, "d2d": 5e-6},
    )
    return CostModel(LLAMA8, tpp, Compute(4.0e14), bandwidth)


def test_prefill_flops_is_the_integral_of_the_per_token_cost() -> None:
    m = ModelCost(1e9, 4, 8, 64, 1024)
    per_token = sum(
        2 * m.n_params + m.attention_flops_per_token_context * (c + 0.5) for c in range(100, 300)
    )
    assert m.prefill_flops(200, 100) == pytest.approx(per_token, rel=1e-12)
    assert m.prefill_flops(0, 100) == 0


@pytest.mark.parametrize(
    ("gbps", "expected"),
    # The brief's worked numbers for Llama-3.1-8B bf16: a 7 GB/s NVMe gives κ ≈ 2,
    # this VM's 1.2 GB/s disk ≈ 0.4, Dynamo #6101's 60 MB/s ≈ 0.02.
    [(7.0, 2.0), (1.2, 0.4), (0.06, 0.02)],
)
def test_kappa_matches_the_worked_numbers(gbps: float, expected: float) -> None:
    cost = model_with(gbps, h2d_gbps=1e6)  # the NVMe read is the whole path
    page = 512 * LLAMA8.kv_bytes_per_token
    assert cost.kappa(2, page) == pytest.approx(expected, rel=0.25)


def test_kappa_orders_the_tiers() -> None:
    cost = model_with(3.0)
    page = 512 * LLAMA8.kv_bytes_per_token
    assert cost.kappa(0, page) > cost.kappa(1, page) > cost.kappa(2, page)


def brute_force(
    cost: CostModel, tiers: list[int], sizes: list[int], total: int, overlap: bool
) -> tuple[int, float]:
    best = (0, math.inf)
    tpp = cost.tokens_per_page
    for pages in range(len(tiers) + 1):
        load = 0.0
        for path in {p for t in tiers[:pages] for p in LOAD_PATHS[t]}:
            nbytes = sum(
                s
                for t, s in zip(tiers[:pages], sizes[:pages], strict=True)
                if path in LOAD_PATHS[t]
            )
            load += cost.bandwidth[path].seconds(nbytes)
        rec = cost.recompute_s(total - pages * tpp, pages * tpp)
        ttft = max(load, rec) if overlap else load + rec
        if ttft < best[1] - 1e-15:
            best = (pages, ttft)
    return best


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed", range(40))
def test_plan_matches_brute_force(seed: int, overlap: bool) -> None:
    rng = random.Random(seed)
    cost = model_with(
        rng.choice([0.06, 0.5, 1.2, 3.0, 7.0, 14.0]),
        h2d_gbps=rng.choice([5.0, 25.0, 50.0]),
        tpp=rng.choice([16, 256, 512]),
    )
    cost.layer_overlap = overlap
    hit = rng.randint(0, 12)
    tiers = sorted(rng.choice([0, 1, 2]) for _ in range(hit))  # prefixes are hotter near the root
    sizes = [cost.tokens_per_page * LLAMA8.kv_bytes_per_token] * hit
    total = hit * cost.tokens_per_page + rng.randint(0, 4000)
    plan = cost.plan(tiers, sizes, total)
    pages, ttft = brute_force(cost, tiers, sizes, total, overlap)
    assert plan.load_pages == pages
    assert plan.ttft_s == pytest.approx(ttft, rel=1e-9)
    assert plan.ttft_s <= plan.ttft_recompute_s + 1e-15
    assert plan.ttft_s <= plan.ttft_load_all_s + 1e-15


def test_plan_loads_from_a_fast_tier_and_recomputes_past_a_slow_one() -> None:
    cost = model_with(0.06)  # NVMe far slower than recompute
    size = 512 * LLAMA8.kv_bytes_per_token
    plan = cost.plan([1, 1, 1, 2, 2, 2], [size] * 6, 6 * 512)
    assert plan.load_pages == 3  # the DRAM pages, not the NVMe ones
    assert cost.plan([2, 2], [size] * 2, 1024).load_pages == 0
    assert model_with(14.0).plan([2, 2], [size] * 2, 1024).load_pages == 2


def test_a_read_still_in_flight_counts_in_the_plan() -> None:
    cost = model_with(7.0)
    size = 512 * LLAMA8.kv_bytes_per_token
    assert cost.plan([1, 1], [size] * 2, 1024).load_pages == 2
    # The second page waits 10 s for its read: recomputing it is faster.
    assert cost.plan([1, 1], [size] * 2, 1024, extra_s=[0.0, 10.0]).load_pages == 1


def test_value_density_signs() -> None:
    size = 512 * LLAMA8.kv_bytes_per_token
    fast, slow = model_with(7.0), model_with(0.06)
    assert fast.value_density(0.9, 3, size, 2) > 0  # p above 1/κ: worth a load
    assert slow.value_density(1.0, 3, size, 2) < 0  # a disk slower than recompute: never worth it
    assert fast.value_density(0.9, 3, size, 2) > fast.value_density(0.1, 3, size, 2)
    assert fast.value_density(0.5, 40, size, 2) > fast.value_density(0.5, 0, size, 2)  # attention
    assert fast.value_density(0.5, 0, size, 1) > fast.value_density(0.5, 0, size, 2)


def test_value_formula_charged_and_its_deprecated_alias_seed001() -> None:
    assert TierConfig().value_formula == "expected"
    assert TierConfig(value_formula="charged").value_formula == "charged"
    with pytest.warns(DeprecationWarning, match="'seed001' is deprecated; use 'charged'") as seen:
        old = TierConfig(value_formula="seed001")
    assert len(seen) == 1
    assert old == TierConfig(value_formula="charged")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the mapped value warns no more
        assert dataclasses.replace(old, hysteresis_s=2.0).value_formula == "charged"
    assert parse_overrides("kvstore:value_formula=charged") == {"value_formula": "charged"}
    with pytest.raises(ValueError, match="value_formula"):
        TierConfig(value_formula="seed002")
    # "charged" subtracts the whole transfer, "expected" only p of it.
    size = 512 * LLAMA8.kv_bytes_per_token
    fast = model_with(7.0)
    charged = fast.value_density(0.5, 3, size, 2, "charged")
    assert charged == fast.value_density(0.5, 3, size, 2)  # the cost model's default
    assert charged < fast.value_density(0.5, 3, size, 2, "expected")


def test_bandwidth_fit_converges_to_alpha_and_rate() -> None:
    fit = Bandwidth(1e9, 0.0)
    rng = random.Random(1)
    for _ in range(200):
        nbytes = rng.randint(1 << 16, 1 << 24)
        fit.observe(nbytes, 2e-4 + nbytes / 3e9)
    assert fit.rate == pytest.approx(3e9, rel=0.01)
    assert fit.latency_s == pytest.approx(2e-4, rel=0.05)


def test_bandwidth_fit_of_one_size_keeps_alpha_and_fits_the_rate() -> None:
    fit = Bandwidth(1e9, 1e-4)
    for _ in range(100):
        fit.observe(1 << 20, 1e-4 + (1 << 20) / 5e9)
    assert fit.rate == pytest.approx(5e9, rel=0.01)
    assert fit.latency_s == 1e-4
    fit.observe(0, 1.0)
    fit.observe(1 << 20, -1.0)
    assert fit.rate == pytest.approx(5e9, rel=0.01)


def test_bandwidth_follows_a_slowing_disk() -> None:
    fit = Bandwidth(6e9, 1e-4)
    for _ in range(50):
        fit.observe(1 << 20, 1e-4 + (1 << 20) / 6e9)
    for _ in range(60):
        fit.observe(1 << 20, 1e-4 + (1 << 20) / 0.5e9)
    assert fit.rate == pytest.approx(0.5e9, rel=0.05)


def test_compute_estimator_converges() -> None:
    compute = Compute(4e14)
    for _ in range(80):
        compute.observe(1e12, 1e12 / 1.5e14)
    assert compute.flops_per_s == pytest.approx(1.5e14, rel=0.01)


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("device", "tpu", "device"),
        ("hbm", "mine", "hbm"),
        ("page_bytes", 0, "page_bytes"),
        ("admission", "sometimes", "admission"),
        ("admission", "store_threshold:0", "admission"),
        ("eviction", "mru", "eviction"),
        ("placement", "everywhere", "placement"),
        ("watermark_low", 0.97, "watermarks"),
        ("phi_weights", (1.0, 2.0), "phi_weights"),
        ("hysteresis_s", -1.0, "hysteresis_s"),
        ("bandwidth_bytes_per_s", {"h2d": 0.0}, "bandwidth_bytes_per_s"),
        ("max_dwpd", 0.0, "max_dwpd"),
    ],
)
def test_bad_config_names_the_field(field: str, value: object, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        TierConfig(**{field: value})  # type: ignore[arg-type]


def test_admission_modes_parse() -> None:
    assert parse_admission("store_threshold:3") == ("store_threshold", 3)
    assert parse_admission("freq2") == ("freq2", 0)
    with pytest.raises(ValueError, match="unknown model preset"):
        ModelCost.preset("gpt-9")
    with pytest.raises(ValueError, match="unknown transfer paths"):
        make_bandwidths({"warp": 1.0}, {})

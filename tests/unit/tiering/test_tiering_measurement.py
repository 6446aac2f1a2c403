"""The tier manager's measurements: no bad sample, prior or file locks a tier out."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.testing.tier_soundness import (
    Case,
    config,
    poison_stats,
    run_case,
    slow_first_copies,
)
from kvstore.tiering import ModelCost, TierConfig, TierManager
from kvstore.tiering.cost import CPU_COMPUTE_FLOPS, GPU_COMPUTE_FLOPS, Bandwidth

PAGE = 64 << 10


def test_a_cold_sample_is_discarded_and_one_outlier_moves_nothing() -> None:
    fit = Bandwidth(5e9, 1e-5, warmup=2)
    fit.observe(PAGE, 1.0)  # cold: discarded
    fit.observe(PAGE, 1.0)
    assert fit.rate == 5e9
    fit.observe(PAGE, PAGE / 5e9 + 1e-5)
    before = fit.rate
    fit.observe(PAGE, 100 * PAGE / 5e9)  # one copy preempted: held, not folded in
    fit.observe(PAGE, PAGE / 5e9 + 1e-5)
    assert fit.rate == pytest.approx(before, rel=0.01)
    assert fit.outliers == 1


def test_three_outliers_in_a_row_are_a_new_path_speed() -> None:
    fit = Bandwidth(5e9, 0.0)
    for _ in range(3):
        fit.observe(PAGE, PAGE / 5e7)  # the disk really is 100x slower now
    assert fit.rate == pytest.approx(5e7, rel=0.01)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, 0.0])
def test_a_non_finite_sample_is_ignored(bad: float) -> None:
    fit = Bandwidth(5e9, 0.0)
    fit.observe(PAGE, bad)
    assert fit.rate == 5e9 and fit.samples == 0


def test_a_cpu_device_starts_from_a_cpu_prior_not_a_gpus() -> None:
    with TierManager.open(TierConfig(device="cpu", probe_at_open=False)) as tm:
        assert tm.stats().compute_flops == CPU_COMPUTE_FLOPS
    fake = TierConfig(mover="fake", control_interval_s=0, probe_at_open=False)
    with TierManager.open(fake) as tm:  # the simulator models a GPU node
        assert tm.stats().compute_flops == GPU_COMPUTE_FLOPS
    with TierManager.open(TierConfig(compute_flops=3e13, probe_at_open=False)) as tm:
        assert tm.stats().compute_flops == 3e13


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("compute_flops", math.inf),
        ("compute_flops", math.nan),
        ("latency_s", {"h2d": math.inf}),
        ("bandwidth_bytes_per_s", {"h2d": math.nan}),
        ("bandwidth_bytes_per_s", {"nvme_read": math.inf}),
    ],
)
def test_a_number_the_cost_model_cannot_use_is_refused_naming_it(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        TierConfig(**{field: value})


def test_an_infinite_model_is_refused() -> None:
    with pytest.raises(ValueError, match="n_params"):
        ModelCost(math.inf, 32, 32, 128, 1 << 14)


@pytest.mark.parametrize(
    "args",
    [(10**400, 0, 1.0), (16, 0, math.nan), (16, 0, math.inf), (-1, 0, 1.0), (16, -1, 1.0)],
)
def test_observe_prefill_refuses_what_would_poison_c_eff(args: tuple[Any, ...]) -> None:
    with TierManager.open(TierConfig(probe_at_open=False)) as tm:
        before = tm.stats().compute_flops
        with pytest.raises((ValueError, TypeError)):
            tm.observe_prefill(*args)
        tm.observe_prefill(1024, 0, 0.5)  # a valid one still moves it
        assert tm.stats().compute_flops != before
        assert math.isfinite(tm.stats().compute_flops)


def _gated_manager(tmp_path: Path, **overrides: Any) -> TierManager:
    """A manager whose persisted bandwidths are 1000x too low and that does not
    calibrate at open: only exploration can bring its tiers back."""
    store = str(tmp_path / "nvme")
    with TierManager.open(config(store, Case(page_bytes=PAGE))) as tm:
        tm.offer([b"a", b"b"], [torch.zeros(PAGE, dtype=torch.uint8)] * 2).hbm_release.wait(10)
        tm.drain()
    poison_stats(store)
    case = Case(page_bytes=PAGE, compute_flops=4e14, calibrate=False)
    return TierManager.open(config(store, case, **overrides))


def test_a_tier_locked_out_by_a_bad_estimate_is_probed_back_within_seconds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvstore.tiering"):
        tm = _gated_manager(tmp_path)
    with tm:
        at_open = tm.stats()
        assert not at_open.in_use[1]  # the poisoned h2d rate says DRAM loads are slower
        tm.offer([b"x"], [torch.zeros(PAGE, dtype=torch.uint8)]).hbm_release.wait(10)
        assert "dram not in use" in tm.explain(b"x")
        deadline = time.monotonic() + 10
        while not tm.stats().in_use[1] and time.monotonic() < deadline:
            time.sleep(0.02)
        stats = tm.stats()
        assert stats.in_use[1], stats.bandwidth_bytes_per_s
        assert stats.kappa[1] >= 1.0
    warnings = [r for r in caplog.records if "slower than recomputing" in r.getMessage()]
    assert len({r.getMessage().split(" is measured")[0] for r in warnings}) == len(warnings)
    assert warnings  # said once per tier, with the numbers


def test_a_persisted_rate_far_off_a_fresh_calibration_is_replaced(tmp_path: Path) -> None:
    store = str(tmp_path / "nvme")
    with TierManager.open(config(store, Case(page_bytes=PAGE))) as tm:
        tm.offer([b"a"], [torch.zeros(PAGE, dtype=torch.uint8)]).hbm_release.wait(10)
        tm.drain()
        saved = tm.stats().bandwidth_bytes_per_s["h2d"]
    poison_stats(store)
    with TierManager.open(config(store, Case(page_bytes=PAGE, compute_flops=4e14))) as tm:
        # Calibrated at open, not the file's 1000x too low rate (a factor of 20 of
        # slack: this machine may be busy).
        assert tm.stats().bandwidth_bytes_per_s["h2d"] > saved / 50


def test_the_first_copies_made_100x_slower_do_not_lock_a_tier_out(tmp_path: Path) -> None:
    with slow_first_copies(5):
        outcome = run_case(Case(page_bytes=PAGE), str(tmp_path), chains=8)
    assert outcome.in_use_after_s is not None
    assert all(outcome.in_use) and min(outcome.kappa) >= 1.0, outcome


# The bar for what stays resident in these unit tests is below the 90% that
# tools/tier_soundness.py measures (docs/tiering.md, "Measurements"): on a loaded CI
# machine a chain can be declined while write-back runs late. The defect kept 4%.
RESIDENT_FLOOR = 0.75


def test_the_issues_scenario_keeps_what_it_was_offered(tmp_path: Path) -> None:
    # The scenario that kept 6 of 160 pages: one slow early copy switched DRAM and
    # NVMe off for good on a CPU manager with a GPU's C_eff default.
    outcome = run_case(Case(page_bytes=256 << 10), str(tmp_path))
    assert outcome.resident_share >= RESIDENT_FLOOR, outcome
    assert all(outcome.in_use)


def test_small_latency_bound_samples_do_not_blow_the_rate_up() -> None:
    # 4 KiB transfers just above the latency: x / (t - α) would say 4e14 B/s.
    fit = Bandwidth(5e9, 1e-4)
    for _ in range(3):
        fit.observe(4096, 1e-4 + 1e-11)
    assert fit.rate <= 1e10


def test_a_confirmed_shift_restarts_the_fit_from_scratch() -> None:
    fit = Bandwidth(5e9, 0.0)
    for i in range(10):  # a settled least-squares fit
        fit.observe(PAGE * (1 + i % 3), PAGE * (1 + i % 3) / 5e9)
    for _ in range(3):
        fit.observe(PAGE, PAGE / 1e8)  # the path is 50x slower now
    assert fit.samples == 0  # the next samples refit from the new speed
    fit.observe(2 * PAGE, 2 * PAGE / 1e8 * 1.003)
    fit.observe(PAGE, PAGE / 1e8 * 0.997)
    assert fit.rate == pytest.approx(1e8, rel=0.05)


def test_outliers_that_alternate_are_counted_as_dropped() -> None:
    fit = Bandwidth(1e9, 0.0)
    for i in range(20):
        fit.observe(PAGE, PAGE / (1e11 if i % 2 else 1e7))
    assert fit.rate == 1e9 and fit.outliers >= 18

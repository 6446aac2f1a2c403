"""DWPD budget (``max_dwpd``): a write burst is held to the budget within 5% over a
10-minute simulated clock; every decline is counted; a decline is a False, never an
error or a wait."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvstore.format.constants import record_span
from kvstore.telemetry.budget import DwpdBudget
from tests.conftest import OpenStore

T0 = 500_000 * 3600.0


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_bucket_refills_at_the_rate_and_caps_at_the_burst() -> None:
    clock = FakeClock(0.0)
    # 86.4 DWPD of a 1000-byte drive = 1 byte/s; a burst of 100 s = 100 bytes.
    budget = DwpdBudget(max_dwpd=86.4, capacity_bytes=1000, burst_s=100, clock=clock)
    assert budget.rate_bytes_per_s == pytest.approx(1.0)
    assert budget.admit([60, 30, 20], written_bytes=0) == [True, True, False]
    clock.now = 10.0  # +10 tokens; the 90 admitted bytes were written meanwhile
    assert budget.admit([20, 20], written_bytes=90) == [True, False]  # 100 - 90 + 10 = 20
    clock.now = 1e6  # a long idle refills only up to the burst
    assert budget.admit([101], written_bytes=110) == [False]
    assert budget.admit([100], written_bytes=110) == [True]
    # The 100 admitted bytes were written, and 500 bytes nobody declines (GC,
    # checkpoints): those spend tokens too, a debt of 500 s at 1 byte/s.
    assert budget.admit([1], written_bytes=110 + 100 + 500) == [False]
    clock.now += 500
    assert budget.admit([1], written_bytes=710) == [False]  # back to exactly 0 tokens
    clock.now += 1
    assert budget.admit([1], written_bytes=710) == [True]


def test_a_burst_is_held_to_the_budget_over_ten_simulated_minutes(
    open_store: OpenStore, store_path: Path
) -> None:
    clock = FakeClock(T0)
    capacity = 1 << 30
    max_dwpd = 10.0
    store = open_store(
        telemetry_clock=clock,
        drive_capacity_bytes=capacity,
        max_dwpd=max_dwpd,
        max_dwpd_burst_s=10.0,
        gc_interval_s=0,
        checkpoint_interval_s=1e6,
        checkpoint_wal_bytes=1 << 30,
        telemetry_flush_interval_s=3600,
    )
    rate = max_dwpd * capacity / 86_400  # bytes per simulated second
    page = 16 << 10
    start = store.telemetry_snapshot()
    written_before = start.wear_report().store_bytes
    attempts = admitted = declined = 0
    slowest = 0.0
    admitted_keys: list[str] = []
    declined_keys: list[str] = []
    step_s = 0.1
    for step in range(6000):  # 600 simulated seconds, offering ~3.3x the budget
        clock.now = T0 + (step + 1) * step_s
        keys = [f"s{step}/a", f"s{step}/b"]
        began = time.perf_counter()
        results = store.put_many([(key, b"\x5a" * page) for key in keys])
        slowest = max(slowest, time.perf_counter() - began)
        attempts += len(results)
        for key, ok in zip(keys, results, strict=True):
            assert ok in (True, False)
            (admitted_keys if ok else declined_keys).append(key)
        admitted += sum(results)
        declined += len(results) - sum(results)
        if step % 10 == 9:
            store.flush()  # WAL bytes are charged as they are written
    store.flush()
    end = store.telemetry_snapshot()
    written = end.wear_report().store_bytes - written_before
    budget = rate * 600
    offered = attempts * record_span(page)
    assert offered > 3 * budget  # the burst really was over budget
    print(f"written {written} bytes, budget {budget:.0f}, ratio {written / budget:.4f}")
    assert abs(written - budget) <= 0.05 * budget, (written, budget)
    assert declined > 0 and admitted > 0
    assert end.counter("declined_puts") - start.counter("declined_puts") == declined
    assert end.counter("declined_bytes") - start.counter("declined_bytes") == declined * page
    assert end.counter("puts") - start.counter("puts") == admitted
    assert slowest < 2.0  # never a stall
    assert store.get(admitted_keys[-1]) == b"\x5a" * page
    assert store.get(declined_keys[-1]) is None
    assert store.stats().declined_puts == declined


def test_no_budget_admits_everything(open_store: OpenStore) -> None:
    store = open_store()
    assert store.put_many([(f"k{index}", b"x" * 1000) for index in range(50)]) == [True] * 50
    assert store.telemetry_snapshot().counter("declined_puts") == 0


def test_budget_needs_a_known_capacity_and_positive_values(open_store: OpenStore) -> None:
    with pytest.raises(ValueError, match=r"max_dwpd must be > 0, got 0\.0"):
        open_store(max_dwpd=0.0)
    with pytest.raises(ValueError, match="max_dwpd_burst_s"):
        open_store(max_dwpd=1.0, max_dwpd_burst_s=0)

"""kill -9 crash loop in space mode: capacity-bounded eviction, GC, retains and pins.

Each cycle the child (kvstore/testing/crashloop.py) writes far more than the capacity, so
eviction runs inside puts and in gc(); it also retains and releases keys (each
acknowledged after a flush), pins pages and deletes pinned pages. The parent
SIGKILLs it, reopens the store and checks: no wrong bytes, no resurrected
delete, no lost retain (an acknowledged, unreleased retain keeps its latest
acknowledged bytes), is_retained() as acknowledged, and every other page either
its latest acknowledged bytes or absent (evicted).
Set KVSTORE_CRASH_SEED / KVSTORE_CRASH_GC_CYCLES to vary or lengthen the run.

The oracle's own rules are checked first on synthetic protocol lines, so a
crash loop that passes is known to be able to fail.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvstore.testing import crashloop

# -- the oracle's rules, on synthetic lines ---------------------------------------


def _oracle(lines: list[str], *, bounded: bool) -> tuple[Any, Any]:
    oracle = crashloop.Oracle(["k1", "k2"], bounded=bounded)
    summary = crashloop.LoopSummary()
    oracle.start_cycle()
    for line in lines:
        oracle.apply(line, summary, 1)
    return oracle, summary


def _classify(oracle: Any, summary: Any, key: str, got: bytes | None) -> Any:
    meta = None
    if got is not None:
        version = next(v for v in oracle.history[key] if crashloop.page_bytes(key, v) == got)
        meta = crashloop.page_meta(key, version)
    return crashloop._classify(oracle, key, got, meta, summary, 1)


PUT_RETAIN = ["begin put k1 7", "ack put k1 7", "begin retain k1", "ack retain k1 1"]


def test_oracle_counts_an_absent_retained_page_as_a_lost_retain() -> None:
    oracle, summary = _oracle(PUT_RETAIN, bounded=True)
    assert oracle.must_keep("k1")
    _classify(oracle, summary, "k1", None)
    assert summary.lost_retains == 1 and summary.violations == 1


def test_oracle_allows_eviction_only_of_unretained_pages_under_a_capacity() -> None:
    lines = [*PUT_RETAIN, "begin release k1", "ack release k1"]
    oracle, summary = _oracle(lines, bounded=True)
    assert _classify(oracle, summary, "k1", None) == crashloop.ABSENT
    assert summary.evicted_seen == 1 and summary.violations == 0
    oracle, summary = _oracle(lines, bounded=False)
    _classify(oracle, summary, "k1", None)
    assert summary.lost_pages == 1


def test_oracle_a_begun_release_or_delete_lifts_the_retain() -> None:
    for begun in ("begin release k1", "begin del k1"):
        oracle, summary = _oracle([*PUT_RETAIN, begun], bounded=True)
        assert not oracle.must_keep("k1")
        assert oracle.retain_flags("k1") == {True, False}
        _classify(oracle, summary, "k1", None)
        assert summary.violations == 0


def test_oracle_rejects_old_bytes_and_resurrections_under_a_capacity() -> None:
    lines = ["begin put k1 1", "ack put k1 1", "begin put k1 2", "ack put k1 2"]
    oracle, summary = _oracle(lines, bounded=True)
    _classify(oracle, summary, "k1", crashloop.page_bytes("k1", 1))
    assert summary.wrong_bytes == 1
    oracle, summary = _oracle([*lines, "begin del k1", "ack del k1"], bounded=True)
    _classify(oracle, summary, "k1", crashloop.page_bytes("k1", 2))
    assert summary.resurrected_deletes == 1


def test_oracle_a_retain_that_found_the_key_absent_makes_the_absence_durable() -> None:
    lines = ["begin put k1 1", "ack put k1 1", "begin retain k1", "ack retain k1 0"]
    oracle, summary = _oracle(lines, bounded=True)
    assert oracle.acked["k1"] == crashloop.ABSENT
    _classify(oracle, summary, "k1", crashloop.page_bytes("k1", 1))
    assert summary.resurrected_deletes == 1
    oracle, summary = _oracle(lines, bounded=False)  # no capacity: the page was lost
    assert summary.lost_pages == 1


def test_oracle_a_churn_that_deletes_then_puts_drops_the_retain() -> None:
    churn = ["begin del k1", "begin put k1 8", "ack put k1 8"]  # only the last state is acked
    oracle, summary = _oracle([*PUT_RETAIN, *churn], bounded=True)
    assert oracle.retain_flags("k1") == {False}
    assert _classify(oracle, summary, "k1", None) == crashloop.ABSENT  # evictable again
    assert summary.violations == 0


def test_oracle_counts_child_check_failures() -> None:
    _, summary = _oracle(["bad pinned k1 v3: missing"], bounded=True)
    assert summary.child_check_failures == 1 and summary.violations == 1


# -- the crash loop ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_kill9_crashloop_with_capacity_retains_and_pins(tmp_path: Path) -> None:
    cycles = int(os.environ.get("KVSTORE_CRASH_GC_CYCLES", "24"))
    config = crashloop.LoopConfig(
        dir=tmp_path / "store",
        cycles=cycles,
        seed=int(os.environ.get("KVSTORE_CRASH_SEED", "4243")),
        segment_mib=2,
        capacity_mib=16,  # 8 segments: the child writes several times that per cycle
        retain=True,
        min_delay_s=0.02,
        max_delay_s=0.8,
        startup_kill_prob=0.1,
        ckpt_hunt_prob=0.15,
        gc_prob=0.05,
        verify_timeout_s=None,  # pytest-timeout guards against hangs here
    )
    summary = crashloop.run_crashloop(config)
    report = crashloop.format_summary(summary)
    print(report)
    assert summary.violations == 0, report
    assert summary.cycles == cycles, report
    assert summary.acks_put > 0 and summary.checked_acked_puts > 0, report
    assert summary.evicted_seen > 0, f"nothing was evicted: the capacity is too large\n{report}"
    assert summary.acks_retain > 0 and summary.checked_retained > 0, report

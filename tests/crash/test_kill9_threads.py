"""kill -9 crash loop with concurrent writer threads and a 1 ms flusher
(docs/reliability.md, "Concurrent writers: the kill -9 soak").

Each cycle the child (kvstore/testing/crashloop.py --threads 4) runs four writer threads
on disjoint shares of the keys: thread 0 the plain mix (sync puts, batches,
flushes, deletes, churn, checkpoints, GC), threads 1-3 put_many of 2-7 keys
(fresh keys half the time), put(sync=True), plain puts, deletes, flush() and
reads of their own keys. A put or delete is acknowledged once durable: a sync
put when it returned, anything else once a flush() that started after it
returned has returned, on whichever thread. The parent SIGKILLs the child,
reopens the store and checks every key: each acknowledged page present with
its bytes (or a newer version begun since), no acknowledged delete back, no
bytes that match no version allowed.

The old write path (the pending WAL list read outside the publish lock) lost
acknowledged pages or served older versions in this loop within a few cycles.
Which engine runs follows KVSTORE_IO_ENGINE (CI runs this once per engine); the
children inherit the environment. Set KVSTORE_CRASH_SEED /
KVSTORE_CRASH_THREAD_CYCLES to vary or lengthen the run.
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path
from typing import Any

import pytest

from kvstore.testing import crashloop

# -- the oracle's rules for concurrent acknowledgements, on synthetic lines -----------


def _oracle(lines: list[str], *, bounded: bool = False) -> tuple[Any, Any]:
    oracle = crashloop.Oracle(["k1", "k2"], bounded=bounded)
    summary = crashloop.LoopSummary()
    oracle.start_cycle()
    for line in lines:
        oracle.apply(line, summary, 1)
    return oracle, summary


def _check(oracle: Any, key: str, version: int | None) -> Any:
    summary = crashloop.LoopSummary()
    got = None if version is None else crashloop.page_bytes(key, version)
    meta = None if version is None else crashloop.page_meta(key, version)
    oracle.acked[key] = crashloop._classify(oracle, key, got, meta, summary, 1)
    return summary


def test_an_ack_settles_only_what_was_begun_up_to_it() -> None:
    """A worker acks v1 once a flush covered it, while v2 (begun later) is in flight."""
    lines = ["begin put k1 1", "begin put k1 2", "ack put k1 1"]
    oracle, _ = _oracle(lines)
    assert oracle.begun["k1"] == [("put", 2)]
    assert _check(oracle, "k1", 1).violations == 0
    assert _check(_oracle(lines)[0], "k1", 2).violations == 0
    assert _check(_oracle(lines)[0], "k1", None).lost_pages == 1


def test_a_delete_token_keeps_later_operations_in_flight() -> None:
    lines = ["begin put k1 1", "ack put k1 1", "begin del k1 5", "begin put k1 6", "ack del k1 5"]
    oracle, _ = _oracle(lines)
    assert oracle.acked["k1"] == crashloop.ABSENT and oracle.begun["k1"] == [("put", 6)]
    assert _check(oracle, "k1", None).violations == 0
    assert _check(_oracle(lines)[0], "k1", 6).violations == 0
    assert _check(_oracle(lines)[0], "k1", 1).violations == 1  # v1 came back


def test_an_older_version_after_a_newer_ack_is_wrong_bytes() -> None:
    """The symptom the race showed: an acknowledged overwrite read back as the old page."""
    lines = ["begin put k1 1", "ack put k1 1", "begin put k1 2", "ack put k1 2"]
    assert _check(_oracle(lines)[0], "k1", 1).wrong_bytes == 1


def test_fresh_keys_are_tracked_checked_and_forgotten() -> None:
    lines = ["begin put f1.1.0 7", "ack put f1.1.0 7", "begin put f1.1.1 8"]
    oracle, summary = _oracle(lines)
    assert oracle.fresh_keys == ["f1.1.0", "f1.1.1"] and summary.acks_put == 1
    assert _check(oracle, "f1.1.0", None).lost_pages == 1  # acknowledged, then gone
    assert _check(oracle, "f1.1.1", None).violations == 0  # never acknowledged
    oracle.forget_fresh_keys()
    assert oracle.fresh_keys == [] and "f1.1.0" not in oracle.acked
    assert set(oracle.acked) == {"k1", "k2"}


class _Durability:
    covered = 0


def _worker(lines: list[str]) -> Any:
    args = argparse.Namespace(cycle=1, fresh_prob=0.5, capacity_mib=None)
    durability = _Durability()
    return crashloop._Worker(
        1, None, ["k1"], random.Random(1), lines.append, durability, lambda: 0, args
    )


def test_a_worker_acks_only_what_a_flush_covered_in_begin_order() -> None:
    lines: list[str] = []
    worker = _worker(lines)
    Op = crashloop._Unacked
    worker.unacked = [
        Op("k1", "put", 1, 1, False),
        Op("k2", "put", 2, 2, False),
        Op("k1", "put", 3, 3, False),
        Op("k2", "del", 4, 4, False),
    ]
    worker.durability.covered = 3  # a flush that started after ops 1 and 2 returned
    worker.settle()
    assert lines == ["ack put k1 1", "ack put k2 2"]
    assert [op.token for op in worker.unacked] == [3, 4]
    worker.unacked.append(Op("k1", "put", 5, 5, True))  # a sync put of k1
    worker.settle()
    # v3 of k1 was superseded by the durable v5: never acknowledged after it.
    assert lines[2:] == ["ack put k1 5"]
    assert [op.token for op in worker.unacked] == [4]


# -- the crash loop ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kill9_crashloop_with_concurrent_writers(tmp_path: Path) -> None:
    cycles = int(os.environ.get("KVSTORE_CRASH_THREAD_CYCLES", "10"))
    forced = os.environ.get("KVSTORE_IO_ENGINE", "").strip() or None
    config = crashloop.LoopConfig(
        dir=tmp_path / "store",
        cycles=cycles,
        seed=int(os.environ.get("KVSTORE_CRASH_SEED", "4244")),
        keys=120,
        segment_mib=2,
        threads=4,
        flush_interval_ms=1.0,
        max_page_kib=64,
        min_delay_s=0.2,
        max_delay_s=1.0,
        startup_kill_prob=0.1,
        ckpt_hunt_prob=0.1,
        stall_s=20.0,  # four writers on a 2-core CI machine
        verify_timeout_s=None,  # pytest-timeout guards against hangs here
    )
    summary = crashloop.run_crashloop(config)
    report = crashloop.format_summary(summary)
    print(report)
    assert summary.violations == 0, report
    assert summary.cycles == cycles, report
    assert summary.acks_put > 0 and summary.checked_acked_puts > 0, report
    assert summary.checked_fresh_keys > 0, report
    assert summary.engines, report
    if forced in ("io_uring", "threadpool"):  # the children inherited the environment
        assert set(summary.engines) == {forced}, report

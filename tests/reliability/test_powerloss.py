"""Simulated power loss under the three unsynced-data policies (scaled down).

A recorded random workload is cut at random points; each cut is rebuilt under
``drop``, ``prefix`` and ``dirs`` and checked against the oracle (every
acknowledged page present with its bytes, unacknowledged puts whole or
absent, no resurrected delete, no lost retain, deep fsck clean, and the store
keeps working after recovery). tools/powerloss.py runs the long version.

The negative controls prove the harness can fail: a store that skips a sync
it needs, or a dropped synced write, must be caught.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

import kvstore.log.journal as journal_module
import kvstore.log.segments as segments_module
import kvstore.log.wal as wal_module
from kvstore.testing.faults import POLICIES
from kvstore.testing.powerloss import (
    Trace,
    record_trace,
    run_case,
    run_double_case,
    synced_put_writes,
)

CASES_PER_POLICY = 20


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Trace:
    return record_trace(tmp_path_factory.mktemp("powerloss") / "store", seed=20261129, steps=140)


def _cuts(trace: Trace, count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return sorted(rng.randint(0, len(trace.recorder.ops)) for _ in range(count))


def test_trace_covers_every_kind_of_operation(trace: Trace) -> None:
    names = {op.note[2] for op in trace.recorder.ops if op.kind == "mark" and op.note[0] == "begin"}
    assert {"put", "put_many", "delete", "flush", "retain", "gc", "checkpoint"} <= names
    kinds = {op.kind for op in trace.recorder.ops}
    assert {"write", "sync", "dirsync", "create", "unlink", "lmdb_commit"} <= kinds


def test_the_same_seed_records_the_same_calls(tmp_path: Path) -> None:
    """A case (trace seed, cut, policy) must name one state: the spare segment used to
    be made on the prepare thread, so its calls (and the LSN it took) landed in a
    different place of the log from run to run (7 of 8 recordings of this seed differed,
    and the CLI's repeat-by-seed test failed in CI)."""
    recordings = []
    for attempt in range(3):
        recorded = record_trace(tmp_path / f"store-{attempt}", seed=511025150, steps=25)
        recordings.append(recorded.recorder.ops)
    shapes = [
        [(op.kind, op.inode, op.offset, len(op.data), op.size, op.path, op.note) for op in ops]
        for ops in recordings  # (the bytes differ: each store has its own UUID)
    ]
    assert shapes[1] == shapes[0] and shapes[2] == shapes[0]
    # the spare is still made, between steps: a segment created outside any operation
    started = busy = False
    spare_creates = 0
    for op in recordings[0]:
        if op.kind == "mark" and op.note[0] in ("begin", "done"):
            started, busy = True, op.note[0] == "begin"
        elif op.kind == "create" and op.path.startswith("segments") and started and not busy:
            spare_creates += 1
    assert spare_creates >= 1


@pytest.mark.parametrize("policy", POLICIES)
def test_power_loss_loses_nothing_acknowledged(trace: Trace, policy: str, tmp_path: Path) -> None:
    rng = random.Random(policy)
    acknowledged = 0
    for cut in _cuts(trace, CASES_PER_POLICY, seed=len(policy)):
        result = run_case(trace, cut, policy, tmp_path, rng, reopen=cut % 3 == 0)
        assert result.violations == [], (policy, cut, result.violations)
        acknowledged += result.acknowledged_pages
    assert acknowledged > CASES_PER_POLICY  # the oracle had something to check


def test_cut_at_the_end_has_everything(trace: Trace, tmp_path: Path) -> None:
    result = run_case(trace, len(trace.recorder.ops), "dirs", tmp_path, random.Random(1))
    assert result.violations == []
    assert result.acknowledged_pages >= 5


def test_oracle_notices_a_dropped_synced_wal_write(trace: Trace, tmp_path: Path) -> None:
    pairs = synced_put_writes(trace)
    assert len(pairs) >= 5
    rng = random.Random(3)
    for cut, write in pairs[:8]:
        result = run_case(trace, cut, "drop", tmp_path, rng, drop={write}, reopen=False)
        assert result.violations, f"dropping synced write {write} at cut {cut} went unnoticed"


def _violating_cases(trace: Trace, policy: str, work: Path, count: int = 20) -> int:
    rng = random.Random(7)
    return sum(
        bool(run_case(trace, cut, policy, work, rng, reopen=False).violations)
        for cut in _cuts(trace, count, seed=11)
    )


def test_drop_policy_catches_a_store_that_skips_the_wal_sync(tmp_path: Path) -> None:
    with mock.patch.object(wal_module.WalWriter, "sync", lambda self: None):
        broken = record_trace(tmp_path / "store", seed=5, steps=100)
    assert _violating_cases(broken, "drop", tmp_path) > 0


def test_dirs_policy_catches_a_missing_directory_fsync(tmp_path: Path) -> None:
    with mock.patch.object(segments_module, "fsync_dir", lambda path: None):
        broken = record_trace(tmp_path / "store", seed=5, steps=100)
    assert _violating_cases(broken, "dirs", tmp_path) > 0
    assert _violating_cases(broken, "drop", tmp_path) == 0  # only the dirs policy sees it


class _NoSegmentSync:
    """``os`` as kvstore/log/journal.py sees it, minus the segment fdatasync before the WAL."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def fdatasync(self, fd: int) -> None:
        del fd


def test_prefix_policy_catches_wal_durable_before_its_data(tmp_path: Path) -> None:
    with mock.patch.object(journal_module, "os", _NoSegmentSync()):
        broken = record_trace(tmp_path / "store", seed=5, steps=100)
    assert _violating_cases(broken, "prefix", tmp_path) > 0


def test_crash_during_recovery_changes_nothing_recovery_showed(
    trace: Trace, tmp_path: Path
) -> None:
    """Cut, recover under a new recording with more work, cut again, recover again."""
    rng = random.Random(9)
    for index, cut in enumerate(_cuts(trace, 9, seed=13)):
        first, second = POLICIES[index % 3], POLICIES[index // 3]
        violations = run_double_case(trace, cut, first, second, tmp_path, rng, steps=20)
        assert violations == [], (first, second, cut, violations)


@pytest.fixture(scope="module")
def zero_copy_trace(tmp_path_factory: pytest.TempPathFactory) -> Trace:
    """The same workload with its values in 4 KiB-aligned memory (pages of 16 KiB and
    more written without a copy) and its batches through put_many_async."""
    return record_trace(
        tmp_path_factory.mktemp("powerloss-zero-copy") / "store",
        seed=20261204,
        steps=140,
        aligned=True,
        pipelined=True,
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_power_loss_on_the_zero_copy_pipelined_path(
    zero_copy_trace: Trace, policy: str, tmp_path: Path
) -> None:
    trace = zero_copy_trace
    names = {op.note[2] for op in trace.recorder.ops if op.kind == "mark" and op.note[0] == "begin"}
    assert "put_many" in names
    rng = random.Random(policy)
    acknowledged = 0
    for cut in _cuts(trace, CASES_PER_POLICY, seed=7 + len(policy)):
        result = run_case(trace, cut, policy, tmp_path, rng, reopen=cut % 3 == 0)
        assert result.violations == [], (policy, cut, result.violations)
        acknowledged += result.acknowledged_pages
    assert acknowledged > CASES_PER_POLICY

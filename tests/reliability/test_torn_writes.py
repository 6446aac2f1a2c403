"""Torn writes (scaled down): a 1 MiB page record and a WAL record cut mid-write.

The page record was written but never synced (its put was not acknowledged);
the WAL record's data was synced but the append itself was cut before its
fdatasync. Either way the store opens, the torn record is absent (a WAL
record that landed whole may stay), every other page is intact, fsck is
clean, and the store keeps working. tools/powerloss.py --mode tear-page /
tear-wal sweep every 4 KiB / every byte.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

from kvstore.testing.faults import DiskModel, Tear
from kvstore.testing.powerloss import (
    _check_tear,
    _record_tear,
    tear_page_cases,
    tear_wal_cases,
)


def test_page_record_torn_at_4k_boundaries(tmp_path: Path) -> None:
    results = tear_page_cases(tmp_path, seed=3, stride=17 * 4096)
    assert len(results) >= 30
    bad = [(point, tail, v) for point, tail, v in results if v]
    assert bad == []


def test_wal_record_torn_at_byte_boundaries(tmp_path: Path) -> None:
    results = tear_wal_cases(tmp_path, seed=3, stride=5)
    points = {point for point, _, _ in results}
    assert 0 in points and max(points) > 60  # from nothing to the whole record
    bad = [(point, tail, v) for point, tail, v in results if v]
    assert bad == []


def test_tear_check_notices_a_lost_page(tmp_path: Path) -> None:
    """The tear oracle can fail: drop the synced WAL write that named the base pages."""
    setup = _record_tear(tmp_path / "record", 3, "wal", 5000)
    ops = setup.trace.recorder.ops
    wal_writes = [
        index
        for index, op in enumerate(ops[: setup.op_index])
        if op.kind == "write" and op.data[:4] == (0x4B56574C).to_bytes(4, "little")
    ]
    assert wal_writes
    target = tmp_path / "dropped"
    model = DiskModel(setup.trace.recorder, setup.cut)
    model.materialize(
        target,
        "drop",
        random.Random(1),
        tear=Tear(setup.op_index, 0, "zero"),
        drop=set(wal_writes),
    )
    try:
        violations = _check_tear(target, setup, whole=False)
    finally:
        shutil.rmtree(target, ignore_errors=True)
    assert any(v.kind in ("lost", "open-failed") for v in violations)

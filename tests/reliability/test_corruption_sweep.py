"""Corruption sweep, scaled down (tools/corruption_sweep.py runs the full one).

Bit flips and byte runs go into every file kind of a realistic store (several
segments, checkpointed and WAL-only pages, deletes, overwrites, a two-file WAL
chain). Each must be caught by the read path, by ``check(deep=True)`` (with
the recovery notes ``kvstore fsck`` prints), or by the store refusing to open;
no ``get`` may return bytes that were never put, and nothing but
``KVStoreError`` may escape. A clean store has no finding at all.

The harness itself is tested too: with payload checksum verification switched
off, the same sweep must count wrong reads (a sweep that cannot see a wrong
read would prove nothing).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kvstore.check as check_module
import kvstore.log.segment_reader as reader_module
from kvstore.format.constants import BLOCK_BYTES
from kvstore.testing import corruption as sweep

# Structural LMDB bytes that no read depends on (LMDB keeps no checksums): see the
# classification in docs/reliability.md. Everything else must be detected.
LMDB_KINDS = {"lmdb-meta-page", "lmdb-used-page"}


class Pristine:
    def __init__(self, root: Path, expected: sweep.Expected) -> None:
        self.root = root
        self.expected = expected

    def __repr__(self) -> str:
        return f"Pristine({self.root})"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pristine]:
    root = tmp_path_factory.mktemp("sweep") / "pristine"
    yield Pristine(root, sweep.build_pristine(root, seed=11))


def test_clean_store_has_no_finding_and_reads_right(pristine: Pristine) -> None:
    baseline = sweep.clean_baseline(pristine.root, pristine.expected)
    assert baseline.crash is None
    assert baseline.finding_kinds == []
    assert (baseline.wrong_reads, baseline.misses, baseline.resurrected) == (0, 0, 0)
    assert not baseline.detected


def test_region_map_covers_every_byte_of_every_file(pristine: Pristine) -> None:
    regions = sweep.map_regions(pristine.root)
    by_path: dict[str, list[tuple[int, int]]] = {}
    for region in regions:
        by_path.setdefault(region.path, []).append((region.start, region.end))
    for path in pristine.root.rglob("*"):
        if not path.is_file():
            continue
        spans = sorted(by_path[str(path.relative_to(pristine.root))])
        cursor = 0
        for start, end in spans:
            assert start == cursor, (path, start, cursor)  # no gap, no overlap
            cursor = end
        assert cursor == path.stat().st_size, path
    kinds = {region.kind for region in regions}
    assert {"segment-header", "record-header", "payload", "wal-record", "lmdb-used-page"} <= kinds
    assert len({r.path for r in regions if r.kind == "wal-file-header"}) == 2  # a chain of two


def test_sweep_detects_every_flip_that_matters(pristine: Pristine, tmp_path: Path) -> None:
    regions = sweep.map_regions(pristine.root)
    injections = sweep.plan(regions, 300, seed=3, run_fraction=0.15)
    outcomes = sweep.run_sweep(
        pristine.root, pristine.expected, injections, workers=2, work_dir=tmp_path
    )
    summary = sweep.summarize(outcomes)
    assert len(outcomes) == 300
    assert summary["total"]["crashes"] == 0, summary["crashes"]
    assert summary["total"]["wrong-reads"] == 0
    assert summary["unused"]["wrong-reads"] == 0
    missed = [m for m in summary["missed"] if m["kind"] not in LMDB_KINDS]
    assert missed == [], missed
    row = summary["per-region"].get("superblock")
    if row:  # only the store's identity refuses the open, naming the fix
        assert row["refused-open"] == row["injections"] - row["no-op"]
    for kind in ("segment-header", "wal-file-header", "lmdb-meta-page", "lmdb-used-page"):
        row = summary["per-region"].get(kind)
        if row:  # degrade, don't refuse: the store opens
            assert row["refused-open"] == 0, (kind, row)
    for kind in ("segment-header", "wal-file-header"):
        row = summary["per-region"].get(kind)
        if row:  # ... and says what it found in stats()
            assert row["degraded-open"] == row["injections"] - row["no-op"], (kind, row)
    for kind in ("record-header", "payload"):
        row = summary["per-region"][kind]
        changed = row["injections"] - row["no-op"]
        assert row["detected-by-read"] == changed and row["detected-by-fsck"] == changed
    refusals = summary["refusals"]
    assert summary["refusals-naming-recover"] >= refusals * 0.9
    # The pristine copies were restored after every injection.
    baseline = sweep.clean_baseline(tmp_path / "copy-0", pristine.expected)
    assert baseline.finding_kinds == [] and baseline.wrong_reads == 0


def test_a_damaged_last_wal_record_is_undone_not_cut(pristine: Pristine, tmp_path: Path) -> None:
    """The newest WAL file's last record with a flipped bit used to be cut as a torn
    tail (a deleted page came back). One damaged byte is now undone, proven by the
    record's checksum: nothing is lost, and the repair is reported."""
    regions = sweep.map_regions(pristine.root)
    newest = max(r.path for r in regions if r.kind == "wal-record")
    end = max(r.end for r in regions if r.path == newest)
    injection = sweep.Injection(0, "wal-record", newest, end - 9, "bit", bit=3)
    copy = tmp_path / "copy"
    import shutil

    shutil.copytree(pristine.root, copy)
    outcome = sweep.run_one(copy, injection, pristine.expected)
    assert not outcome.refused_open and outcome.degraded_open
    assert outcome.detected_by_fsck
    assert any("one damaged byte, undone" in kind for kind in outcome.finding_kinds)
    assert (outcome.wrong_reads, outcome.resurrected, outcome.stale, outcome.misses) == (0, 0, 0, 0)


def _verify_without_checksums(
    key: bytes, entry: Any, view: Any, result: int, payload: Any = None, **_: Any
) -> Any:
    if payload is not None:  # read straight into the caller's memory
        return payload
    return view[BLOCK_BYTES : BLOCK_BYTES + entry.payload_bytes]


def test_harness_counts_wrong_reads_when_verification_is_off(
    pristine: Pristine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Switch off every payload and header check; payload flips must now be counted
    as wrong reads, and nothing detected. Proves the sweep can see a wrong read."""
    monkeypatch.setattr(reader_module, "verify_record", _verify_without_checksums)
    monkeypatch.setattr(check_module, "_record_problem", lambda *args: None)
    regions = sweep.map_regions(pristine.root)
    injections = sweep.plan(regions, 25, seed=9, run_fraction=0.0, only={"payload"})
    outcomes = sweep.run_sweep(
        pristine.root, pristine.expected, injections, workers=0, work_dir=tmp_path
    )
    summary = sweep.summarize(outcomes)
    assert summary["total"]["wrong-reads"] == 25
    assert summary["total"]["detected"] == 0
    assert summary["mattering"]["detected_percent"] == 0.0

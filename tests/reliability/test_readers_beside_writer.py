"""Read-only readers and read-only fsck beside a churning writer
(docs/reliability.md, failure mode 11).

A CI-sized run of kvstore/testing/readers.py (``tools/reader_soak.py`` runs the
same for minutes): one writer process puts, deletes, runs GC and checkpoints
with capacity eviction; beside it a reader process opens the store read-only
again and again and checks every page it reads against what the writer could
have written, and an fsck process runs read-only checks (some deep, and the
``kvstore fsck --json`` CLI). The writer never damages the store: any finding,
failed open or failed read is false, and any byte that is no page of the
writer's is wrong. Before the fix the same run saw hundreds of false
``CorruptionError``s and findings within seconds.
"""

from __future__ import annotations

from pathlib import Path

from kvstore.testing.readers import soak


def test_readers_and_fsck_beside_a_churning_writer(tmp_path: Path) -> None:
    result = soak(tmp_path / "store", seconds=12.0, readers=1, fsckers=1, cli_every=8, seed=7)
    summary = result.as_dict()
    assert result.ok, summary
    # The run did what it is for: the writer churned, readers and fsck ran.
    assert result.writer_ops["segments_freed"] >= 5, summary
    assert result.writer_ops["checkpoints_total"] >= 5, summary
    assert result.opens >= 3 and result.hits >= 100, summary
    assert result.fsck_runs >= 3 and result.fsck_cli_runs >= 1, summary

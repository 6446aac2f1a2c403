"""The kill -9 loop with fsck after every recovery (kvstore/testing/crashloop_fsck.py,
``tools/crashloop_fsck.py``), briefly: the loop's ``after_recovery`` hook runs once per
recovered store, and fsck there finds nothing in a store that recovered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore.testing import crashloop, crashloop_fsck


@pytest.mark.timeout(120)
def test_fsck_runs_on_every_recovered_store(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    argv = ["--dir", str(tmp_path / "store"), "--cycles", "3", "--seed", "5", "--json", "-q"]
    status = crashloop_fsck.main([*argv, "--fsck-deep", "--parent-engine", "threadpool"])
    summary = json.loads(capfd.readouterr().out)
    assert status == 0, summary
    assert summary["cycles"] == 3 and summary["violations"] == 0, summary
    # Every cycle whose reads all succeeded ran fsck on the recovered store.
    assert summary["fsck_runs"] == 3 - summary["read_errors"] > 0, summary
    assert summary["fsck_deep"] is True and summary["parent_engine"] == "threadpool"


@pytest.mark.timeout(120)
def test_after_recovery_sees_each_recovered_store_once(tmp_path: Path) -> None:
    """The hook is called with the reopened store of every cycle, in order."""
    seen: list[int] = []

    def after_recovery(store: object, cycle: int) -> None:
        seen.append(cycle)

    config = crashloop.LoopConfig(
        dir=tmp_path / "store",
        cycles=2,
        seed=6,
        verify_timeout_s=None,
        parent_engine="threadpool",
        after_recovery=after_recovery,
    )
    summary = crashloop.run_crashloop(config)
    assert summary.violations == 0, crashloop.format_summary(summary)
    assert seen == [1, 2]

"""kill -9 crash loop (kvstore/testing/crashloop.py) inside pytest: 30+ cycles, zero violations.

Each cycle a child process writes to the store (sync puts, batches, flushes,
deletes, checkpoints) and reports every acknowledged operation; the test
SIGKILLs it, reopens the store and checks every key against the oracle.
Set KVSTORE_CRASH_SEED / KVSTORE_CRASH_CYCLES to vary or lengthen the run.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvstore.testing import crashloop


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_kill9_crashloop_has_no_violations(tmp_path: Path) -> None:
    cycles = int(os.environ.get("KVSTORE_CRASH_CYCLES", "30"))
    config = crashloop.LoopConfig(
        dir=tmp_path / "store",
        cycles=cycles,
        seed=int(os.environ.get("KVSTORE_CRASH_SEED", "4242")),
        min_delay_s=0.02,
        max_delay_s=0.3,
        startup_kill_prob=0.2,
        ckpt_hunt_prob=0.25,
        verify_timeout_s=None,  # pytest-timeout guards against hangs here
    )
    summary = crashloop.run_crashloop(config)
    report = crashloop.format_summary(summary)
    print(report)
    assert summary.violations == 0, report
    assert summary.cycles == cycles, report
    assert summary.acks_put > 0 and summary.checked_acked_puts > 0, report

"""A real model's KV cache through the tier manager: bit-identical logits after a
restore in a fresh process, from NVMe.

The DynamicCache round trip of test_llama_roundtrip.py, with the pages going through
``TierManager`` instead of TensorIO: each layer's K and V as of the prefill are offered
as pages with chained keys, stepped down from DRAM to NVMe, and a fresh process
opens a manager on the same path (the forest rebuilt from the pages' meta), looks
the chain up, loads it into fresh tensors and decodes. Its logits must equal, bit for
bit, those of the uninterrupted run -- also when the saver was SIGKILLed once the
pages were on NVMe and the store flushed (no close, no statistics saved). The process
work is in llama_tiering.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs transformers (make integ env)")
torch = pytest.importorskip("torch")

# The logits check of the TensorIO round trip (same files: reference.pt, restored.pt).
from test_llama_roundtrip import ENV, assert_bit_identical, run_script  # noqa: E402

SCRIPT = Path(__file__).with_name("llama_tiering.py")
PAGES = 6  # 3 layers x (K, V)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return run_script(SCRIPT, *args)


def assert_restored_from_nvme_bit_identical(workdir: Path) -> None:
    seen = json.loads((workdir / "restored.json").read_text())
    # Every page came back from NVMe: HBM and DRAM of the saver are gone.
    assert seen["rebuilt_by_tier"] == [0, 0, PAGES], seen
    assert seen["hit_pages"] == seen["load_pages"] == seen["loaded"] == PAGES, seen
    assert seen["pages_by_tier"] == [0, 0, PAGES], seen
    assert seen["ready_or_pending"], seen
    assert_bit_identical(workdir)


def test_tiered_restore_in_a_fresh_process_gives_bit_identical_logits(tmp_path: Path) -> None:
    nvme = str(tmp_path / "nvme")
    assert run("save", nvme, str(tmp_path)).stdout.strip().endswith("on nvme")
    run("restore", nvme, str(tmp_path))
    assert_restored_from_nvme_bit_identical(tmp_path)


def test_tiered_restore_after_sigkill_gives_bit_identical_logits(tmp_path: Path) -> None:
    nvme = str(tmp_path / "nvme")
    saver = subprocess.Popen(
        [sys.executable, str(SCRIPT), "save", nvme, str(tmp_path), "--hold"],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert saver.stdout is not None
        line = saver.stdout.readline()  # blocks until the pages are on NVMe, flushed
        assert line.strip() == "on nvme", saver.stderr.read() if saver.stderr else ""
        saver.send_signal(signal.SIGKILL)  # no close(), no checkpoint, no statistics
        assert saver.wait(timeout=60) == -signal.SIGKILL
    finally:
        if saver.poll() is None:
            saver.kill()
            saver.wait()
    run("restore", nvme, str(tmp_path))
    assert_restored_from_nvme_bit_identical(tmp_path)

"""A real model's KV cache through the store: bit-identical logits after a restore.

A randomly initialised LlamaForCausalLM (transformers, no download) prefills a
prompt; each layer's K/V is saved as pages through TensorIO; a fresh process
restores them into a DynamicCache and decodes. Its logits must equal, bit for
bit, those of the uninterrupted run -- also when the saver was SIGKILLed right
after flush(). The process work is in llama_roundtrip.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs transformers (make integ env)")
torch = pytest.importorskip("torch")

SCRIPT = Path(__file__).with_name("llama_roundtrip.py")
REPO = Path(__file__).resolve().parents[2]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    "HF_HUB_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
}


def run_script(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run one of the Llama round trips' process scripts; it must exit 0."""
    done = subprocess.run(
        [sys.executable, str(script), *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return run_script(SCRIPT, *args)


def assert_bit_identical(workdir: Path) -> None:
    reference = torch.load(workdir / "reference.pt")["logits"]
    restored = torch.load(workdir / "restored.pt")
    assert reference.shape == restored["logits"].shape
    assert not reference.isnan().any()
    # Bit for bit: compare the raw bf16 words, not values within a tolerance.
    assert torch.equal(reference.view(torch.int16), restored["logits"].view(torch.int16))
    # The restored cache is what made them equal: without it the logits differ.
    assert not torch.equal(reference, restored["no_cache_logits"])


def test_restore_in_a_fresh_process_gives_bit_identical_logits(tmp_path: Path) -> None:
    store = str(tmp_path / "kv")
    assert run("save", store, str(tmp_path)).stdout.strip().endswith("flushed")
    run("restore", store, str(tmp_path))
    assert_bit_identical(tmp_path)


def test_restore_after_sigkill_following_flush_gives_bit_identical_logits(
    tmp_path: Path,
) -> None:
    store = str(tmp_path / "kv")
    saver = subprocess.Popen(
        [sys.executable, str(SCRIPT), "save", store, str(tmp_path), "--hold"],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert saver.stdout is not None
        line = saver.stdout.readline()  # blocks until the saver has flushed
        assert line.strip() == "flushed", saver.stderr.read() if saver.stderr else ""
        saver.send_signal(signal.SIGKILL)  # no close(), no checkpoint
        assert saver.wait(timeout=60) == -signal.SIGKILL
    finally:
        if saver.poll() is None:
            saver.kill()
            saver.wait()
    run("restore", store, str(tmp_path))
    assert_bit_identical(tmp_path)

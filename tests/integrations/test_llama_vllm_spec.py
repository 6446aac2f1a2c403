"""A real model's KV cache through the vLLM spec's manager: bit-identical logits
after a restore in a fresh process, from NVMe.

The DynamicCache round trip of test_llama_roundtrip.py, with the KV going the way
``KVStoreOffloadingSpec`` takes it under vLLM: staging chunks, ``complete_store``
into the tier manager (write-through to NVMe), and in a fresh process ``lookup``
(HIT_PENDING while NVMe reads land, then HIT), ``prepare_load`` into staging, and a
rebuilt DynamicCache. The process work is in llama_vllm_spec.py.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs transformers (make integ env)")
pytest.importorskip("vllm", reason="needs vllm (make integ env)")
torch = pytest.importorskip("torch")

from test_llama_roundtrip import assert_bit_identical, run_script  # noqa: E402

from kvstore.integrations.vllm_worker import staging_path  # noqa: E402

SCRIPT = Path(__file__).with_name("llama_vllm_spec.py")
LAYERS = 3


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return run_script(SCRIPT, *args)


def test_vllm_spec_restore_in_a_fresh_process_gives_bit_identical_logits(
    tmp_path: Path,
) -> None:
    nvme = str(tmp_path / "nvme")
    engine = f"llama-{uuid.uuid4().hex[:12]}"
    try:
        assert run("save", nvme, str(tmp_path), engine).stdout.strip().endswith("on nvme")
        run("restore", nvme, str(tmp_path), engine + "-b")
    finally:
        for name in (engine, engine + "-b"):
            staging_path(name).unlink(missing_ok=True)
    seen = json.loads((tmp_path / "restored.json").read_text())
    assert seen["first"] == ["HIT_PENDING"] * LAYERS  # on NVMe only: the reads start
    assert seen["second"] == ["HIT"] * LAYERS
    assert_bit_identical(tmp_path)

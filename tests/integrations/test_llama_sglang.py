"""A real model's KV cache through kvstore's SGLang HiCache backend: bit-identical
logits after a restore in a fresh process, from NVMe.

The DynamicCache round trip of test_llama_roundtrip.py, with the KV going the way
SGLang's HiCache takes it to an L3 backend: host pool pages (``page_first`` and
``layer_first``), ``batch_set_v1(keys, host_indices)`` on a backend built by
SGLang's ``StorageBackendFactory`` (write-through to NVMe), and in a fresh process a
fresh backend and NaN-filled host pool: ``batch_exists`` (every page worth loading),
``batch_get_v1`` into other host pages, a DynamicCache rebuilt from them. The process
work is in llama_sglang.py.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs transformers (make integ env)")
pytest.importorskip("sglang", reason="needs sglang (make integ env)")
pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory")
torch = pytest.importorskip("torch")

from test_llama_roundtrip import assert_bit_identical, run_script  # noqa: E402

SCRIPT = Path(__file__).with_name("llama_sglang.py")
PAGES, LAYERS = 5, 3


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return run_script(SCRIPT, *args)


def test_sglang_backend_restore_in_a_fresh_process_gives_bit_identical_logits(
    tmp_path: Path,
) -> None:
    nvme = str(tmp_path / "nvme")
    assert run("save", nvme, str(tmp_path)).stdout.strip().endswith("on nvme")
    run("restore", nvme, str(tmp_path))
    seen = json.loads((tmp_path / "restored.json").read_text())
    for layout, parts in (("page_first", 2), ("layer_first", 2 * LAYERS)):
        answers = seen[layout]
        assert answers["parts_per_page"] == parts
        # After the restart every part is on NVMe only: the load really reads NVMe.
        assert answers["pages_by_tier_at_open"] == [0, 0, PAGES * parts]
        assert answers["batch_exists"] == PAGES
        assert answers["batch_get_v1"] == [True] * PAGES
        assert answers["other_host_pages_untouched"]  # still NaN: written where told
        assert_bit_identical(tmp_path / layout)

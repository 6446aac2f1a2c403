"""``KVStoreOffloadingSpec`` under vLLM 0.33's real scheduler and offloading
connector (the CPU harness of vllm_harness.py): engine A stores a prompt, a fresh
engine B on the same NVMe path finds it and loads byte-identical KV blocks; on a
slow disk, engine B's scheduler is told MISS and recomputes.
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm (make integ env)")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_harness import VLLMHarness

from kvstore.integrations.vllm import KVStoreOffloadingManager

PROMPT = list(range(3, 3 + 100))  # 6 full blocks of 16 tokens: 3 chunks of 2 blocks
FULL_BLOCKS = len(PROMPT) // 16


def spec_config(path: Path, **tier_options: Any) -> dict[str, Any]:
    return {
        "spec_name": "KVStoreOffloadingSpec",
        "spec_module_path": "kvstore.integrations.vllm",
        "cpu_bytes_to_use": 1 << 20,  # staging: 64 chunks of 16 KiB
        "block_size": 32,  # 2 GPU blocks of 16 tokens per chunk
        "path": str(path),
        "dram_bytes": 1 << 21,
        # Cost the prefill as an 8B model's: the harness's tiny Llama recomputes
        # anything faster than any disk reads it.
        "model": {"n_params": 8e9, "layers": 32, "q_heads": 32, "head_dim": 128},
        "store_options": {"segment_bytes": 4 << 20, "gc_interval_s": 0},
        "tier_options": {"probe_at_open": False, **tier_options},
    }


def engine(config: dict[str, Any]) -> VLLMHarness:
    return VLLMHarness(config, engine_id=f"kvs-{uuid.uuid4().hex[:12]}")


def tier_manager(harness: VLLMHarness) -> Any:
    manager = harness.manager
    assert isinstance(manager, KVStoreOffloadingManager)
    return manager.tm


def store_prompt(path: Path) -> VLLMHarness:
    """Engine A: prefill the prompt; every chunk goes to NVMe as it is stored."""
    a = engine(spec_config(path, placement="write_through"))
    a.run([PROMPT])
    tm = tier_manager(a)
    assert tm.drain()
    assert tm.stats().pages_by_tier[2] == FULL_BLOCKS // 2  # 3 chunks on NVMe
    return a


def test_a_fresh_engine_loads_what_another_stored_byte_for_byte(tmp_path: Path) -> None:
    a = store_prompt(tmp_path / "nvme")
    expected = [a.pattern_block_bytes(PROMPT, i) for i in range(FULL_BLOCKS)]
    a.close()

    b = engine(spec_config(tmp_path / "nvme", warm_dram_on_open=False))
    try:
        assert tier_manager(b).stats().pages_by_tier == (0, 0, 3)  # NVMe only
        (req,) = b.run([PROMPT])
        matches = [m.num_matched_tokens for m in b.matches[req]]
        # First asked while the NVMe reads ran (deferred), then a hit of 6 blocks.
        assert matches[0] is None and b.num_matched_tokens(req) == FULL_BLOCKS * 16
        (load,) = b.jobs_for(req, "load")
        assert len(load.gpu_block_ids) == FULL_BLOCKS
        blocks = b.request_blocks[req]
        for i in range(FULL_BLOCKS):
            assert b.block_bytes(blocks[i]) == expected[i], f"block {i}"
        # B's own prefill writes other values (its seed): equal bytes mean loaded ones.
        assert b.pattern_block_bytes(PROMPT, 0) != expected[0]
        stats = tier_manager(b).stats()
        assert stats.hits_by_tier[2] >= 3 and not stats.recompute_decisions
        staging = b.manager._staging.path
        assert staging.exists()
    finally:
        b.close(unlink_staging=False)
    assert not staging.exists()  # the manager's shutdown removed it from /dev/shm


def test_on_a_slow_disk_the_fresh_engine_recomputes_instead_of_loading(tmp_path: Path) -> None:
    store_prompt(tmp_path / "nvme").close()

    # 1 MB/s: a 16 KiB chunk takes 16 ms to read; its 32 tokens prefill in 1.3 ms.
    slow = spec_config(
        tmp_path / "nvme", warm_dram_on_open=False, bandwidth_bytes_per_s={"nvme_read": 1e6}
    )
    b = engine(slow)
    try:
        (req,) = b.run([PROMPT])
        # The scheduler saw MISS for every chunk: nothing matched, nothing loaded.
        assert [m.num_matched_tokens for m in b.matches[req]] == [0]
        assert b.jobs_for(req, "load") == []
        stats = tier_manager(b).stats()
        assert stats.recompute_decisions == {"faster": 1}
        assert stats.hits_by_tier[2] == 3  # they were there: recomputing was faster
        assert stats.kappa[2] < 1 < stats.kappa[1]
    finally:
        b.close()


def test_a_repeated_prompt_in_one_engine_hits_dram(tmp_path: Path) -> None:
    a = engine(spec_config(tmp_path / "nvme"))
    try:
        (first,) = a.run([PROMPT])
        assert a.num_matched_tokens(first) == 0
        expected = [a.pattern_block_bytes(PROMPT, i) for i in range(FULL_BLOCKS)]
        assert a.reset_prefix_cache()  # the GPU cache forgets; kvstore's DRAM has it
        a.scrub_kv()
        (again,) = a.run([PROMPT])
        assert a.num_matched_tokens(again) == FULL_BLOCKS * 16
        blocks = a.request_blocks[again]
        for i in range(FULL_BLOCKS):
            assert a.block_bytes(blocks[i]) == expected[i], f"block {i}"
        assert tier_manager(a).stats().hits_by_tier[1] >= 3
    finally:
        a.close()


def test_many_requests_through_few_staging_chunks_finish_and_release_everything(
    tmp_path: Path,
) -> None:
    # Six prompts on two shared prefixes, run twice, with staging for 4 chunks: some
    # stores wait (prepare_store None) and some lookups miss for want of a chunk; every
    # request must still finish, every loaded block must be A's, and nothing stays held.
    config = spec_config(tmp_path / "nvme")
    config["cpu_bytes_to_use"] = 4 * 16384
    prompts = [
        [base + t for t in range(96)] + [200 + i] * 40 for base in (3, 500) for i in range(3)
    ]
    a = engine(config)
    try:
        a.run(prompts)
        # The run's last store is still being copied from staging into DRAM; until it
        # lands, lookups answer HIT_PENDING and the 4 staging chunks go to other
        # requests' stores, so every hit of the second run became a MISS (a CI flake:
        # the copy thread lost a race of a few ms with the next scheduling step).
        assert tier_manager(a).drain()
        expected = {
            (p, i): a.pattern_block_bytes(prompts[p], i) for p in range(6) for i in range(8)
        }
        assert a.reset_prefix_cache()
        a.scrub_kv()
        again = a.run(prompts)
        assert sum(a.num_matched_tokens(r) for r in again) > 0
        for p, req in enumerate(again):
            loaded_blocks = a.loaded_tokens(req) // 16
            blocks = a.request_blocks[req]
            for i in range(loaded_blocks):
                assert a.block_bytes(blocks[i]) == expected[(p, i)], (p, i)
        manager = a.manager
        assert isinstance(manager, KVStoreOffloadingManager)
        for handle, _ in manager._releasing:
            assert handle.wait(5)  # the last stores' copies into the arena
        manager._reclaim()
        assert sorted(manager._free) == list(range(4)) and not manager._held
        assert not manager.has_pending_work()
    finally:
        a.close()


def test_a_namespace_keeps_two_weight_revisions_apart(tmp_path: Path) -> None:
    store_prompt(tmp_path / "nvme").close()
    config = spec_config(tmp_path / "nvme", warm_dram_on_open=False)
    config["namespace"] = "weights-v2"  # same model name, new weights
    b = engine(config)
    try:
        (req,) = b.run([PROMPT])
        assert b.num_matched_tokens(req) == 0 and b.jobs_for(req, "load") == []
    finally:
        b.close()

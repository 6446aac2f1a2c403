"""The kvstore tier under vLLM's own TieringOffloadingManager (vLLM 0.33, on CPU).

Run with the integration environment: .venv-integ/bin/pytest tests/integrations
(tools/setup_integ_env.sh builds it). Without vLLM installed, this module skips.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.base", reason="needs vllm (make integ env)")

from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvstore import KVStore
from kvstore.format.constants import BLOCK_BYTES
from kvstore.format.names import segment_path
from kvstore.integrations.vllm import KVStoreTier
from tools.vllm_tier_bench import (
    chunk_bytes_for,
    chunk_key,
    kvstore_tier,
    offloading_config,
    open_manager,
    store_chunks,
)

REPO = Path(__file__).resolve().parents[2]
CHUNK_BYTES = 64 << 10
CONTEXT = ReqContext(req_id="test")

# A fresh process: a new manager (new engine, empty CPU tier) over the same store.
CHILD = """
import json, sys
from tools.vllm_tier_bench import chunk_key, kvstore_tier, load_chunks, offloading_config
from tools.vllm_tier_bench import open_manager
path, count = sys.argv[1], int(sys.argv[2])
config = offloading_config(kvstore_tier(path), chunk_bytes=64 << 10, primary_chunks=16, layers=2)
keys = [chunk_key(i) for i in range(count)]
with open_manager(config) as manager:
    tier = manager.secondary_tiers[0]
    primary_before = [manager.primary_tier.lookup(k, None).name for k in keys[:1]]
    hits = [tier.lookup(k, None).name for k in keys]
    seconds, mismatches = load_chunks(manager, keys, batch=8)
print(json.dumps({"tier": type(tier).__name__, "hits": hits, "mismatches": mismatches,
                  "primary_before": primary_before}))
"""


def small_config(path: Path, **options: Any) -> Any:
    return offloading_config(
        kvstore_tier(path, **options.pop("tier_options", {})),
        chunk_bytes=CHUNK_BYTES,
        primary_chunks=16,
        layers=2,
        **options,
    )


def direct_tier(path: Path, **tier_options: Any) -> tuple[KVStoreTier, np.ndarray]:
    """A tier over a plain numpy 'primary tier' of 8 chunks, as vLLM's own tier tests do."""
    primary = np.zeros((8, CHUNK_BYTES), dtype=np.uint8)
    spec = TieringOffloadingSpec(small_config(path))
    tier = KVStoreTier(spec, memoryview(primary), "KVStoreTier", path=str(path), **tier_options)
    return tier, primary


def job(job_id: int, keys: list[OffloadKey], chunk_ids: list[int], promotion: bool) -> Any:
    return TransferJob(
        job_id=job_id,
        keys=keys,
        chunk_ids=np.array(chunk_ids, dtype=np.int32),
        is_promotion=promotion,
        req_context=CONTEXT,
    )


def finished(tier: KVStoreTier) -> list[Any]:
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


def test_configuration_alone_selects_the_tier(tmp_path: Path) -> None:
    with open_manager(small_config(tmp_path / "kv")) as manager:
        (tier,) = manager.secondary_tiers
        assert isinstance(tier, KVStoreTier)
        assert tier.block_size_bytes == CHUNK_BYTES
        assert tier.fields["model"] == "kvstore-bench/llama-8b"
    assert (tmp_path / "kv").is_dir()


def test_real_manager_stores_and_a_fresh_process_promotes_identical_bytes(tmp_path: Path) -> None:
    path = tmp_path / "kv"
    keys = [chunk_key(i) for i in range(40)]
    with open_manager(small_config(path)) as manager:
        store_chunks(manager, keys, batch=8)  # 40 chunks through a 16-chunk CPU tier
        tier = manager.secondary_tiers[0]
        assert all(tier.lookup(key, CONTEXT) is LookupResult.HIT for key in keys)
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), str(len(keys))],
        cwd=REPO,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["tier"] == "KVStoreTier"
    assert report["primary_before"] == ["MISS"]  # the fresh CPU tier is empty
    assert report["hits"] == ["HIT"] * len(keys)
    assert report["mismatches"] == 0  # every promoted chunk has the stored bytes


def test_models_dtypes_and_layouts_never_share_pages(tmp_path: Path) -> None:
    path = tmp_path / "kv"
    keys = [chunk_key(i) for i in range(4)]
    with open_manager(small_config(path)) as manager:
        store_chunks(manager, keys, batch=4)
        namespace = manager.secondary_tiers[0].namespace
    others = [
        small_config(path, model="another/model"),
        small_config(path, dtype="float16"),
        small_config(path, tp_size=2),
        small_config(path, blocks_per_chunk=2),
    ]
    for config in others:
        with open_manager(config) as manager:
            tier = manager.secondary_tiers[0]
            assert tier.namespace != namespace
            assert [tier.lookup(key, CONTEXT) for key in keys] == [LookupResult.MISS] * 4
    with open_manager(small_config(path)) as manager:  # the same model and layout again
        tier = manager.secondary_tiers[0]
        assert tier.namespace == namespace
        assert [tier.lookup(key, CONTEXT) for key in keys] == [LookupResult.HIT] * 4


def test_submit_store_returns_before_the_write(tmp_path: Path) -> None:
    tier, primary = direct_tier(tmp_path / "kv", io_threads=2)
    release = threading.Event()
    real_put_many = tier.store.put_many

    def slow_put_many(*args: Any, **kwargs: Any) -> Any:
        release.wait(10)
        return real_put_many(*args, **kwargs)

    tier.store.put_many = slow_put_many  # type: ignore[method-assign]
    keys = [chunk_key(i) for i in range(4)]
    primary[:4] = 7
    began = time.monotonic()
    tier.submit_store(job(1, keys, [0, 1, 2, 3], promotion=False))
    assert time.monotonic() - began < 0.5  # queued, not written, on the scheduler thread
    assert list(tier.get_finished_jobs()) == []
    assert tier.has_pending_work()
    release.set()
    (result,) = finished(tier)
    assert result.job_id == 1 and result.success
    assert result.transfer_bytes == 4 * CHUNK_BYTES
    assert not tier.has_pending_work()
    tier.shutdown()


def test_load_pins_pages_until_they_are_read(tmp_path: Path) -> None:
    tier, primary = direct_tier(tmp_path / "kv")
    keys = [chunk_key(i) for i in range(3)]
    primary[:3] = np.arange(3, dtype=np.uint8)[:, None] + 1
    tier.submit_store(job(1, keys, [0, 1, 2], promotion=False))
    assert finished(tier)[0].success
    release = threading.Event()
    real_read = tier.store.get_many_into

    def slow_read(*args: Any) -> Any:
        release.wait(10)
        return real_read(*args)

    tier.store.get_many_into = slow_read  # type: ignore[method-assign]
    tier.submit_load(job(2, keys, [5, 6, 7], promotion=True))
    assert [tier.store.pin_count(tier.page_key(key)) for key in keys] == [1, 1, 1]
    release.set()
    (result,) = finished(tier)
    assert result.success and result.successful_keys is None
    assert [tier.store.pin_count(tier.page_key(key)) for key in keys] == [0, 0, 0]
    assert [int(primary[i, 0]) for i in (5, 6, 7)] == [1, 2, 3]
    assert np.array_equal(primary[5:8], primary[0:3])
    tier.shutdown()


def test_load_reports_per_key_and_drops_corrupt_pages(tmp_path: Path) -> None:
    tier, primary = direct_tier(tmp_path / "kv", io_threads=1)
    stored = [chunk_key(i) for i in range(3)]
    primary[:3] = 9
    tier.submit_store(job(1, stored, [0, 1, 2], promotion=False))
    assert finished(tier)[0].success
    corrupt = stored[1]
    tier.store.flush()
    info = tier.store.info(tier.page_key(corrupt))
    assert info is not None
    # Rot one payload byte on disk: the batched read fails its checksum, and the
    # tier reads the batch page by page to drop only this one.
    fd = os.open(segment_path(tier.store.root, info.segment_id), os.O_RDWR)
    try:
        at = info.offset + BLOCK_BYTES + 100
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x40]), at)
        os.fsync(fd)
    finally:
        os.close(fd)
    missing = chunk_key(99)
    wanted = [stored[0], missing, corrupt, stored[2]]
    tier.submit_load(job(2, wanted, [4, 5, 6, 7], promotion=True))
    (result,) = finished(tier)
    assert not result.success
    assert set(result.successful_keys) == {stored[0], stored[2]}
    assert result.transfer_bytes == 2 * CHUNK_BYTES
    # The corrupt page is gone, so vLLM will not be offered it again.
    assert tier.lookup(corrupt, CONTEXT) is LookupResult.MISS
    assert tier.lookup(stored[0], CONTEXT) is LookupResult.HIT
    tier.shutdown()


def test_store_skips_chunks_already_stored(tmp_path: Path) -> None:
    tier, _ = direct_tier(tmp_path / "kv")
    keys = [chunk_key(i) for i in range(2)]
    tier.submit_store(job(1, keys, [0, 1], promotion=False))
    assert finished(tier)[0].success
    puts_before = tier.store.stats().counters["puts"]
    tier.submit_store(job(2, keys, [0, 1], promotion=False))
    (result,) = finished(tier)
    assert result.success
    assert tier.store.stats().counters["puts"] == puts_before
    tier.shutdown()


def test_shutdown_makes_stored_chunks_durable(tmp_path: Path) -> None:
    path = tmp_path / "kv"
    tier, primary = direct_tier(path)
    keys = [chunk_key(i) for i in range(5)]
    for index, key in enumerate(keys):
        primary[index] = chunk_bytes_for(key, CHUNK_BYTES)
    tier.submit_store(job(1, keys, list(range(5)), promotion=False))
    assert finished(tier)[0].success
    prefix = tier.page_key(keys[0])[: -len(keys[0])]
    tier.shutdown()
    with KVStore.open(path, readonly=True) as store:
        for key in keys:
            assert store.get(prefix + key) == chunk_bytes_for(key, CHUNK_BYTES).tobytes()
        namespace = json.loads(store.get(prefix + b"namespace.json") or b"{}")
        assert namespace["model"] == "kvstore-bench/llama-8b"
        assert store.is_retained(prefix + b"namespace.json")


def test_chunk_larger_than_the_store_pages_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "kv"
    KVStore.open(path, create=True, segment_bytes=1 << 20, max_page_bytes=32 << 10).close()
    with pytest.raises(ValueError, match="max_page_bytes"):
        direct_tier(path)


def test_chunk_ids_outside_the_primary_tier_are_refused(tmp_path: Path) -> None:
    tier, _ = direct_tier(tmp_path / "kv")
    with pytest.raises(ValueError, match="outside the primary tier"):
        tier.submit_store(job(1, [chunk_key(0)], [8], promotion=False))
    with pytest.raises(ValueError, match="2 keys but 1 chunk ids"):
        tier.submit_load(job(2, [chunk_key(0), chunk_key(1)], [0], promotion=True))
    assert not tier.has_pending_work()
    tier.shutdown()


def test_layouts_share_pages_only_when_asked_and_certified(tmp_path: Path) -> None:
    from kvstore.integrations.vllm import namespace_fields

    def fields(share: bool, **options: Any) -> dict[str, Any]:
        spec = TieringOffloadingSpec(small_config(tmp_path / "kv", **options))
        return namespace_fields(spec, CHUNK_BYTES, share_across_layouts=share)

    # Not asked, or not certified parallelism-agnostic: the layout is in the namespace.
    assert "parallel" in fields(False, parallelism_agnostic=True)
    assert "parallel" in fields(True)
    assert fields(True, tp_size=1) != fields(True, tp_size=2)
    # Asked and certified: TP 1 and TP 2 read each other's (portable) chunks.
    assert "parallel" not in fields(True, parallelism_agnostic=True)
    assert fields(True, tp_size=1, parallelism_agnostic=True) == fields(
        True, tp_size=2, parallelism_agnostic=True
    )

"""kvstore's vLLM worker side (StagingRegion, KVStoreCPUWorker) and the CPU harness
that runs vLLM 0.33's real scheduler and OffloadingConnector around a spec.

The control test runs plain vLLM CPU offloading (vLLM's CPUOffloadingManager) with
kvstore's CPU worker: what one run stores, a later run loads, byte for byte.

Run with the integration environment: .venv-integ/bin/pytest tests/integrations
(tools/setup_integ_env.sh builds it). Without vLLM installed, this module skips.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vllm (make integ env)")

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvstore.errors import ClosedError
from kvstore.integrations import vllm_worker
from kvstore.integrations.vllm_worker import KVStoreCPUWorker, StagingRegion, staging_path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_harness import VLLMHarness

PAGE = 4096
CONTROL_SPEC = {
    "spec_name": "ControlCPUOffloadingSpec",
    "spec_module_path": "tests.integrations.vllm_control_spec",
    "cpu_bytes_to_use": 1 << 22,
    "block_size": 32,  # 2 GPU blocks of 16 tokens per chunk
}


@pytest.fixture
def engine_id() -> Iterator[str]:
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    staging_path(name).unlink(missing_ok=True)


# -- StagingRegion -------------------------------------------------------------------


def test_region_is_a_shared_file_of_num_chunks_chunks(engine_id: str) -> None:
    region = StagingRegion(engine_id, 3, 2 * PAGE)
    assert region.path == Path(f"/dev/shm/kvstore_vllm_{engine_id}.staging")
    assert (region.num_chunks, region.chunk_bytes) == (3, 2 * PAGE)
    assert region.path.stat().st_size == 3 * 2 * PAGE
    chunk = region.chunk(1)
    assert chunk.dtype == torch.uint8
    assert chunk.shape == (2 * PAGE,)
    chunk[:] = 7
    # No copy: a second view, and a second mapping of the file, see the write.
    assert int(region.chunk(1).sum()) == 7 * 2 * PAGE
    other = StagingRegion(engine_id, 3, 2 * PAGE)
    assert bytes(other.chunk(1)[:4].numpy()) == b"\x07" * 4
    assert int(other.chunk(0).sum()) == 0 and int(other.chunk(2).sum()) == 0
    data = region.path.read_bytes()
    assert data[2 * PAGE : 4 * PAGE] == b"\x07" * (2 * PAGE)
    assert data[: 2 * PAGE] == bytes(2 * PAGE)
    other.close()
    region.close()


def test_region_rejects_bad_sizes_and_names(engine_id: str) -> None:
    with pytest.raises(ValueError, match="multiple of 4096"):
        StagingRegion(engine_id, 2, PAGE + 1)
    with pytest.raises(ValueError, match="multiple of 4096"):
        StagingRegion(engine_id, 2, 0)
    with pytest.raises(ValueError, match="num_chunks"):
        StagingRegion(engine_id, 0, PAGE)
    with pytest.raises(ValueError, match="engine_id"):
        StagingRegion("a/b", 1, PAGE)
    region = StagingRegion(engine_id, 2, PAGE)
    for bad in (-1, 2):
        with pytest.raises(IndexError):
            region.chunk(bad)
    region.close()


def test_region_grows_a_smaller_file_and_never_shrinks_one(engine_id: str) -> None:
    small = StagingRegion(engine_id, 1, PAGE)
    small.chunk(0)[:] = 3
    big = StagingRegion(engine_id, 4, PAGE)
    assert big.path.stat().st_size == 4 * PAGE
    assert int(big.chunk(0)[0]) == 3  # the existing bytes are kept
    StagingRegion(engine_id, 2, PAGE).close()
    assert big.path.stat().st_size == 4 * PAGE
    small.close()
    big.close()


def test_region_close_keeps_live_views_valid_and_unlink_is_idempotent(engine_id: str) -> None:
    region = StagingRegion(engine_id, 2, PAGE)
    view = region.chunk(1)
    view[:] = 9
    region.close()
    region.close()
    with pytest.raises(ClosedError):
        region.chunk(0)
    assert int(view[-1]) == 9  # still mapped: the view holds the mapping
    assert region.path.exists()  # close() does not remove the file
    region.unlink()
    assert not region.path.exists()
    region.unlink()


def test_region_falls_back_to_the_temp_dir_without_dev_shm(
    engine_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_isdir = os.path.isdir
    monkeypatch.setattr(
        vllm_worker.os.path, "isdir", lambda p: False if p == "/dev/shm" else real_isdir(p)
    )
    monkeypatch.setattr(vllm_worker.tempfile, "tempdir", str(tmp_path))
    region = StagingRegion(engine_id, 2, PAGE)
    assert region.path == tmp_path / f"kvstore_vllm_{engine_id}.staging"
    assert region.path.stat().st_size == 2 * PAGE
    region.close()
    region.unlink()


def test_region_is_shared_with_another_process(engine_id: str) -> None:
    region = StagingRegion(engine_id, 4, PAGE)
    region.chunk(2)[:] = 0x5A
    # The other side maps the same file with nothing but the layout
    # (chunk i at i * chunk_bytes), the way a manager in another process would.
    child = (
        "import mmap, os, sys\n"
        "fd = os.open(sys.argv[1], os.O_RDWR)\n"
        "m = mmap.mmap(fd, 4 * 4096)\n"
        "assert m[2 * 4096] == 0x5A and m[3 * 4096 - 1] == 0x5A, 'parent write not seen'\n"
        "m[3 * 4096 : 4 * 4096] = bytes([0x3C]) * 4096\n"
        "m.close()\n"
    )
    subprocess.run([sys.executable, "-c", child, str(region.path)], check=True, timeout=60)
    assert bytes(region.chunk(3).numpy()) == b"\x3c" * PAGE
    assert int(region.chunk(1).sum()) == 0
    region.close()


def test_region_chunk_views_from_many_threads(engine_id: str) -> None:
    region = StagingRegion(engine_id, 16, PAGE)
    errors: list[BaseException] = []

    def fill(i: int) -> None:
        try:
            for _ in range(50):
                region.chunk(i)[:] = i
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=fill, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for i in range(16):
        assert torch.equal(region.chunk(i), torch.full((PAGE,), i, dtype=torch.uint8))
    region.close()


# -- KVStoreCPUWorker ----------------------------------------------------------------

NUM_BLOCKS = 10
PAGES = (1024, 2048)  # canonical tensor page sizes (bytes per GPU block)
BLOCKS_PER_CHUNK = 2
CHUNK_BYTES = 2 * PAGE  # >= (1024 + 2048) * 2 = 6144


def _kv_caches(unpadded: tuple[int, int] = PAGES, groups: int = 1) -> CanonicalKVCaches:
    """Two canonical tensors of random bytes; one group over both, or one group each."""
    generator = torch.Generator().manual_seed(1)
    tensors = [
        CanonicalKVCacheTensor(
            tensor=torch.randint(
                -128, 128, (NUM_BLOCKS, page), dtype=torch.int8, generator=generator
            ),
            page_size_bytes=page,
        )
        for page in PAGES
    ]
    refs = [CanonicalKVCacheRef(tensor_idx=t, page_size_bytes=unpadded[t]) for t in range(2)]
    group_refs = [refs] if groups == 1 else [[refs[0]], [refs[1]]]
    return CanonicalKVCaches(tensors=tensors, group_data_refs=group_refs)


def _page(kv: CanonicalKVCaches, tensor: int, block: int) -> bytes:
    return bytes(kv.tensors[tensor].tensor[block].view(torch.uint8).numpy())


def _slot(region: StagingRegion, chunk: int, tensor: int, sub: int) -> bytes:
    """Sub-block ``sub`` of tensor ``tensor``'s segment of ``chunk`` (the documented layout)."""
    start = sum(PAGES[:tensor]) * BLOCKS_PER_CHUNK + sub * PAGES[tensor]
    return bytes(region.chunk(chunk)[start : start + PAGES[tensor]].numpy())


def _gpu(blocks: list[int], first_index: int = 0) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(blocks, group_sizes=[len(blocks)], block_indices=[first_index])


@pytest.fixture
def region(engine_id: str) -> Iterator[StagingRegion]:
    staging = StagingRegion(engine_id, 6, CHUNK_BYTES)
    yield staging
    staging.close()


def test_worker_stores_in_the_documented_layout_and_loads_back(region: StagingRegion) -> None:
    kv = _kv_caches()
    worker = KVStoreCPUWorker(kv, BLOCKS_PER_CHUNK, region)
    assert worker.submit_store(11, _gpu([3, 5, 7, 2]), CPULoadStoreSpec([4, 1]))
    [result] = worker.get_finished()
    assert (result.job_id, result.success) == (11, True)
    assert result.transfer_size == 4 * sum(PAGES)
    assert result.transfer_time is not None and result.transfer_time >= 0
    assert worker.get_finished() == []
    for chunk, blocks in ((4, (3, 5)), (1, (7, 2))):
        for sub, block in enumerate(blocks):
            for tensor in range(2):
                assert _slot(region, chunk, tensor, sub) == _page(kv, tensor, block)
        assert int(region.chunk(chunk)[sum(PAGES) * BLOCKS_PER_CHUNK :].sum()) == 0  # padding
    assert int(region.chunk(0).sum()) == 0  # chunks the job did not name stay untouched

    before = {b: [_page(kv, t, b) for t in range(2)] for b in (3, 5, 7, 2)}
    assert worker.submit_load(12, CPULoadStoreSpec([4, 1]), _gpu([0, 1, 8, 9]), expedited=True)
    [result] = worker.get_finished()
    assert (result.job_id, result.success, result.transfer_size) == (12, True, 4 * sum(PAGES))
    for dst, src in zip((0, 1, 8, 9), (3, 5, 7, 2), strict=True):
        assert [_page(kv, t, dst) for t in range(2)] == before[src]
    worker.wait({11, 12})
    worker.shutdown()


def test_worker_load_result_fields(region: StagingRegion) -> None:
    worker = KVStoreCPUWorker(_kv_caches(), BLOCKS_PER_CHUNK, region)
    worker.submit_store(1, _gpu([1, 2]), CPULoadStoreSpec([0]))
    worker.submit_load(2, CPULoadStoreSpec([0]), _gpu([3, 4]))
    results = worker.get_finished()
    assert [(r.job_id, r.success, r.transfer_size) for r in results] == [
        (1, True, 2 * sum(PAGES)),
        (2, True, 2 * sum(PAGES)),
    ]
    worker.shutdown()


def test_worker_honours_the_first_block_offset_of_a_partial_chunk(region: StagingRegion) -> None:
    kv = _kv_caches()
    worker = KVStoreCPUWorker(kv, BLOCKS_PER_CHUNK, region)
    # Logical blocks 3, 4, 5 of a request: block 3 is sub-block 1 of the first chunk.
    worker.submit_store(1, _gpu([6, 7, 8], first_index=3), CPULoadStoreSpec([2, 5]))
    assert worker.get_finished()[0].success
    assert _slot(region, 2, 0, 0) == bytes(PAGES[0])  # sub-block 0 is skipped
    assert _slot(region, 2, 0, 1) == _page(kv, 0, 6)
    assert _slot(region, 5, 1, 0) == _page(kv, 1, 7)
    assert _slot(region, 5, 1, 1) == _page(kv, 1, 8)
    worker.submit_load(2, CPULoadStoreSpec([5]), _gpu([0, 1], first_index=4))
    assert worker.get_finished()[0].success
    assert [_page(kv, t, 0) for t in range(2)] == [_page(kv, t, 7) for t in range(2)]
    assert [_page(kv, t, 1) for t in range(2)] == [_page(kv, t, 8) for t in range(2)]
    worker.shutdown()


def test_worker_copies_only_the_unpadded_page(region: StagingRegion) -> None:
    kv = _kv_caches(unpadded=(1000, 2048))
    worker = KVStoreCPUWorker(kv, BLOCKS_PER_CHUNK, region)
    worker.submit_store(1, _gpu([2]), CPULoadStoreSpec([0]))
    assert worker.get_finished()[0].success
    slot = _slot(region, 0, 0, 0)
    assert slot[:1000] == _page(kv, 0, 2)[:1000]
    assert slot[1000:] == bytes(PAGES[0] - 1000)  # the layer's padding is not copied
    worker.shutdown()


def test_worker_maps_each_group_to_its_own_chunks(region: StagingRegion) -> None:
    kv = _kv_caches(groups=2)  # group 0: tensor 0; group 1: tensor 1
    worker = KVStoreCPUWorker(kv, BLOCKS_PER_CHUNK, region)
    spec = GPULoadStoreSpec([1, 2, 9], group_sizes=[2, 1], block_indices=[0, 1])
    worker.submit_store(1, spec, CPULoadStoreSpec([3, 4]))
    [result] = worker.get_finished()
    assert (result.success, result.transfer_size) == (True, 2 * PAGES[0] + PAGES[1])
    assert _slot(region, 3, 0, 0) == _page(kv, 0, 1)
    assert _slot(region, 3, 0, 1) == _page(kv, 0, 2)
    assert _slot(region, 3, 1, 0) == bytes(PAGES[1])  # group 0 has no tensor-1 ref
    assert _slot(region, 4, 1, 1) == _page(kv, 1, 9)
    assert _slot(region, 4, 0, 1) == bytes(PAGES[0])
    worker.shutdown()


@pytest.mark.parametrize(
    ("gpu", "chunks"),
    [
        (_gpu([1, 2]), [6]),  # chunk out of range
        (_gpu([1, 2]), [-1]),
        (_gpu([1, NUM_BLOCKS]), [0]),  # GPU block out of range
        (_gpu([1, 2, 3]), [0]),  # 3 blocks need 2 chunks
        (_gpu([1, 2]), [0, 1]),  # 2 blocks use 1 chunk
        (GPULoadStoreSpec([1, 2], group_sizes=[1, 1], block_indices=[0, 0]), [0, 1]),  # 2 groups
        (_gpu([1], first_index=-1), [0]),
    ],
)
def test_a_bad_job_fails_alone_and_moves_no_byte(
    region: StagingRegion, gpu: GPULoadStoreSpec, chunks: list[int]
) -> None:
    kv = _kv_caches()
    worker = KVStoreCPUWorker(kv, BLOCKS_PER_CHUNK, region)
    kv_before = [t.tensor.clone() for t in kv.tensors]
    region_before = bytes(region.path.read_bytes())
    assert worker.submit_store(1, gpu, CPULoadStoreSpec(chunks)) is True
    assert worker.submit_load(2, CPULoadStoreSpec(chunks), gpu) is True
    assert worker.submit_store(3, _gpu([4, 5]), CPULoadStoreSpec([1]))  # a good job still runs
    results = worker.get_finished()
    assert [(r.job_id, r.success) for r in results] == [(1, False), (2, False), (3, True)]
    assert results[0].transfer_size is None
    after = region.path.read_bytes()
    assert after[: 1 * CHUNK_BYTES] == region_before[:CHUNK_BYTES]
    assert after[2 * CHUNK_BYTES :] == region_before[2 * CHUNK_BYTES :]
    for before, entry in zip(kv_before, kv.tensors, strict=True):
        assert torch.equal(before, entry.tensor)
    worker.shutdown()


def test_wrong_spec_types_fail_the_job(region: StagingRegion) -> None:
    worker = KVStoreCPUWorker(_kv_caches(), BLOCKS_PER_CHUNK, region)
    worker.submit_store(1, CPULoadStoreSpec([1]), CPULoadStoreSpec([0]))  # type: ignore[arg-type]
    worker.submit_load(2, _gpu([1]), _gpu([1]))
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, False), (2, False)]
    worker.shutdown()


def test_worker_after_shutdown_fails_jobs_and_has_closed_the_region(
    region: StagingRegion,
) -> None:
    worker = KVStoreCPUWorker(_kv_caches(), BLOCKS_PER_CHUNK, region)
    worker.shutdown()
    with pytest.raises(ClosedError):
        region.chunk(0)
    worker.submit_store(1, _gpu([1]), CPULoadStoreSpec([0]))
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, False)]


def test_worker_rejects_a_chunk_too_small_for_its_blocks(engine_id: str) -> None:
    small = StagingRegion(engine_id, 2, PAGE)  # (1024 + 2048) * 2 > 4096
    with pytest.raises(ValueError, match="needs 6144 bytes"):
        KVStoreCPUWorker(_kv_caches(), BLOCKS_PER_CHUNK, small)
    with pytest.raises(ValueError, match="blocks_per_chunk"):
        KVStoreCPUWorker(_kv_caches(), 0, small)
    small.close()


def test_worker_writes_through_a_strided_kv_view(region: StagingRegion) -> None:
    # vLLM's canonical tensors are int8 (num_blocks, page) views whose rows may be
    # farther apart than a page (packed layouts): the worker must use the stride.
    backing = torch.zeros(NUM_BLOCKS, 2 * PAGES[0], dtype=torch.int8)
    rows = backing[:, : PAGES[0]]
    rows.copy_(torch.arange(NUM_BLOCKS, dtype=torch.int8).view(-1, 1).expand(-1, PAGES[0]))
    kv = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(rows, PAGES[0])],
        group_data_refs=[[CanonicalKVCacheRef(0, PAGES[0])]],
    )
    worker = KVStoreCPUWorker(kv, BLOCKS_PER_CHUNK, region)
    worker.submit_store(1, _gpu([4, 6]), CPULoadStoreSpec([0]))
    worker.submit_load(2, CPULoadStoreSpec([0]), _gpu([1, 2]))
    assert all(r.success for r in worker.get_finished())
    assert int(region.chunk(0)[0]) == 4 and int(region.chunk(0)[PAGES[0]]) == 6
    assert torch.equal(backing[1, : PAGES[0]], backing[4, : PAGES[0]])
    assert torch.equal(backing[2, : PAGES[0]], backing[6, : PAGES[0]])
    assert int(backing[:, PAGES[0] :].abs().sum()) == 0  # the gaps between rows stay zero
    worker.shutdown()


# -- the harness: vLLM's scheduler + OffloadingConnector with kvstore's worker -------

PROMPT = [3 + (i * 5) % 97 for i in range(100)]  # 6 full blocks of 16 + 4 tokens


@pytest.fixture
def harness(engine_id: str) -> Iterator[VLLMHarness]:
    engine = VLLMHarness(CONTROL_SPEC, engine_id=engine_id)
    yield engine
    engine.close()


def test_control_vllm_cpu_offloading_with_the_kvstore_worker(harness: VLLMHarness) -> None:
    assert type(harness.worker) is KVStoreCPUWorker
    assert type(harness.manager).__name__ == "CPUOffloadingManager"
    seed_a = harness.kv_seed
    [first] = harness.run([PROMPT], max_tokens=2)
    assert first in harness.finished
    assert harness.num_matched_tokens(first) == 0
    stores = harness.jobs_for(first, "store")
    stored_blocks = [b for job in stores for b in job.gpu_block_ids]
    assert len(stored_blocks) == 6  # the prompt's 3 full chunks of 2 blocks
    assert stored_blocks == harness.request_blocks[first][:6]
    completed = {j for step in harness.steps for j in step.completed_jobs}
    assert {job.job_id for job in stores} <= completed
    # What the worker read is the fake model's K/V, and the staging file holds it
    # in the documented layout (a second mapping of it, as a manager would open).
    expected = [harness.pattern_block_bytes(PROMPT, i) for i in range(6)]
    assert [b for job in stores for b in harness.stored_block_bytes[job.job_id]] == expected
    chunk_ids = [c for job in stores for c in (job.chunk_ids or ())]
    assert len(chunk_ids) == 3
    spec = harness.worker_connector.connector_worker.spec
    region = StagingRegion(harness.engine_id, spec.num_chunks, spec.kv_bytes_per_chunk)
    page = harness.page_bytes
    for n, chunk in enumerate(chunk_ids):
        data = bytes(region.chunk(chunk).numpy())
        for layer in range(2):  # the two layers are two canonical tensors
            for sub in range(2):
                start = layer * 2 * page + sub * page
                block = expected[2 * n + sub]
                assert data[start : start + page] == block[layer * page : (layer + 1) * page]
    region.close()

    # Drop the GPU prefix cache and scrub the GPU KV; recompute with another seed.
    assert harness.reset_prefix_cache()
    harness.scrub_kv()
    harness.kv_seed = seed_a + 1
    [second] = harness.run([PROMPT], max_tokens=2)
    assert harness.num_matched_tokens(second) == 96
    [load] = harness.jobs_for(second, "load")
    assert load.chunk_ids == tuple(chunk_ids)
    assert harness.loaded_tokens(second) == 96
    blocks = harness.request_blocks[second]
    assert list(load.gpu_block_ids) == blocks[:6]
    for i, block in enumerate(blocks[:6]):
        assert harness.block_bytes(block) == expected[i]  # loaded: engine A's bytes
        assert harness.block_bytes(block) != harness.pattern_block_bytes(PROMPT, i)
    # The tail block was computed by this run (the new seed), not loaded.
    tail = harness.kv_caches[harness.layer_names[0]][blocks[6], :, :4]
    recomputed = harness._kv_values(harness.kv_seed, 0, range(96, 100), PROMPT[96:100])
    assert torch.equal(tail.permute(1, 0, 2, 3), recomputed)


def test_two_engines_have_separate_staging_and_vllm_cpu_tiers(
    harness: VLLMHarness, engine_id: str
) -> None:
    other_id = f"{engine_id}-b"
    other = VLLMHarness(CONTROL_SPEC, engine_id=other_id)
    try:
        [a] = harness.run([PROMPT])
        [b] = other.run([PROMPT])
        assert harness.jobs_for(a, "store") and other.jobs_for(b, "store")
        # vLLM's CPU tier lives in each engine's scheduler: B finds nothing of A's.
        # (kvstore's spec is what should change this answer.)
        assert other.num_matched_tokens(b) == 0 and not other.jobs_for(b, "load")
        assert staging_path(engine_id).exists() and staging_path(other_id).exists()
        assert harness.kv_seed != other.kv_seed
        a_blocks = harness.request_blocks[a][:6]
        b_blocks = other.request_blocks[b][:6]
        assert [harness.block_bytes(x) for x in a_blocks] != [
            other.block_bytes(x) for x in b_blocks
        ]
    finally:
        other.close()
    assert not staging_path(other_id).exists()


def test_harness_records_every_step(harness: VLLMHarness) -> None:
    [req] = harness.run([PROMPT], max_tokens=3)
    scheduled = [s.num_scheduled_tokens.get(req, 0) for s in harness.steps]
    assert scheduled[:3] == [100, 1, 1]  # prefill, then two decodes
    assert sum(scheduled) == 102
    assert [m.num_matched_tokens for m in harness.matches[req]] == [0]
    assert req in set().union(*(s.finished_req_ids for s in harness.steps))
    assert not harness.scheduler.has_requests()
    # vLLM defers a store to the next step's start_kv_transfers: the prefill's
    # store job is in step 0's metadata and completes in step 1.
    [store] = harness.jobs_for(req, "store")
    assert store.step == 0
    assert store.job_id not in harness.steps[0].completed_jobs
    assert harness.steps[1].completed_jobs == {store.job_id: 1}

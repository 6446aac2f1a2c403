"""The vLLM offloading spec's scheduler-side manager on the tier manager, against
vLLM 0.33's ``OffloadingManager`` contract (``vllm.v1.kv_offload.base``).

The staging chunks here are a plain tensor (vLLM's worker would fill them); the
real scheduler and worker drive the spec in test_vllm_spec_scheduler.py.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    OffloadingManager,
    ReqContext,
)

from kvstore.integrations.vllm import KVStoreOffloadingManager  # noqa: E402
from kvstore.integrations.vllm_spec import check_single_worker, version_warning  # noqa: E402
from kvstore.tiering import ModelCost, TierConfig, TierManager  # noqa: E402
from kvstore.tiering.remote import memory_cluster  # noqa: E402

CHUNK = 64 << 10
TOKENS = 32  # tokens per chunk
CHUNKS = 6


class TensorStaging:
    """Staging chunks in one tensor: what the worker and the manager share."""

    def __init__(self, num_chunks: int, chunk_bytes: int) -> None:
        self.num_chunks = num_chunks
        self.chunk_bytes = chunk_bytes
        self.buffer = torch.zeros(num_chunks * chunk_bytes, dtype=torch.uint8)
        self.closed = False

    def chunk(self, index: int) -> Any:
        return self.buffer[index * self.chunk_bytes : (index + 1) * self.chunk_bytes]

    def close(self) -> None:
        self.closed = True


def tier_config(path: Path, **overrides: Any) -> TierConfig:
    options: dict[str, Any] = dict(
        device="cpu",
        hbm="owned",
        hbm_bytes=0,
        dram_bytes=16 * CHUNK,
        page_bytes=CHUNK,
        tokens_per_page=TOKENS,
        nvme_path=str(path),
        nvme_options={"segment_bytes": 4 << 20, "gc_interval_s": 0},
        model=ModelCost(8e9, 32, 32, 128, CHUNK // TOKENS),
        probe_at_open=False,
    )
    options.update(overrides)
    return TierConfig(**options)


def open_manager(path: Path, staging_chunks: int = 8, **overrides: Any) -> KVStoreOffloadingManager:
    return KVStoreOffloadingManager(
        TierManager.open(tier_config(path, **overrides)),
        TensorStaging(staging_chunks, CHUNK),
        prefix=b"test/",
        tokens_per_chunk=TOKENS,
    )


def chunk_keys(name: str, count: int = CHUNKS, group: int = 0) -> list[bytes]:
    return [f"{name}-{i:03d}".encode() + group.to_bytes(4, "big") for i in range(count)]


def request(req_id: str, keys: list[bytes]) -> ReqContext:
    """A request context as vLLM's scheduler fills it: every chunk key's end token."""
    ctx = ReqContext(req_id=req_id)
    for index, key in enumerate(keys):
        ctx.set_offload_key_position(key, (index + 1) * TOKENS)
    return ctx


def store(
    manager: KVStoreOffloadingManager, keys: list[bytes], req_id: str = "writer"
) -> dict[bytes, Any]:
    """What vLLM does for a computed prompt: prepare_store, the worker's copy into
    the staging chunks, complete_store. Returns the bytes written per key."""
    ctx = request(req_id, keys)
    manager.on_new_request(ctx)
    out = manager.prepare_store(keys, ctx)
    assert out is not None and out.keys_to_store == keys
    written = {}
    generator = torch.Generator().manual_seed(len(written) + len(keys))
    for key, chunk in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
        data = torch.randint(0, 256, (CHUNK,), dtype=torch.uint8, generator=generator)
        manager._staging.chunk(int(chunk)).copy_(data)
        written[key] = data
    manager.complete_store(keys, ctx)
    manager.on_request_finished(ctx)
    manager.on_schedule_end()
    assert manager.tm.drain()
    return written


def assert_loads(
    manager: KVStoreOffloadingManager, ctx: ReqContext, keys: list[bytes], written: dict
) -> None:
    spec = manager.prepare_load(keys, ctx)
    for key, chunk in zip(keys, spec.block_ids, strict=True):
        assert torch.equal(manager._staging.chunk(int(chunk)), written[key]), key
    manager.complete_load(keys, ctx)


def test_it_is_a_vllm_offloading_manager_with_a_real_lock(tmp_path: Path) -> None:
    manager = open_manager(tmp_path)
    try:
        assert isinstance(manager, OffloadingManager)
        with manager.lock:  # the scheduler holds it for a whole step; not reentrant
            assert not manager.lock.acquire(blocking=False)
    finally:
        manager.shutdown()


def test_vllm_records_the_key_positions_the_manager_reads() -> None:
    # The manager weighs a request's whole run at its first lookup, from the end
    # positions vLLM's scheduler records in the context. A vLLM that stops keeping
    # them would silently turn every plan into a one-chunk plan: fail here instead.
    ctx = ReqContext(req_id="r")
    ctx.set_offload_key_position(b"k", 64)
    assert ctx._offload_key_positions == {b"k": 64}


def test_a_stored_prompt_hits_and_loads_identical_bytes(tmp_path: Path) -> None:
    manager = open_manager(tmp_path)
    try:
        keys = chunk_keys("p")
        written = store(manager, keys)
        ctx = request("reader", keys)
        manager.on_new_request(ctx)
        assert [manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * CHUNKS
        assert_loads(manager, ctx, keys, written)
        manager.on_schedule_end()
        assert len(manager._free) == 8  # every staging chunk came back
    finally:
        manager.shutdown()


def test_a_fresh_manager_reads_nvme_pages_pending_then_hits(tmp_path: Path) -> None:
    manager = open_manager(tmp_path, placement="write_through")
    keys = chunk_keys("p")
    written = store(manager, keys)
    manager.shutdown()

    fresh = open_manager(tmp_path, warm_dram_on_open=False)  # no race with the warm-up
    try:
        assert fresh.tm.stats().pages_by_tier == (0, 0, CHUNKS)  # on NVMe only
        ctx = request("reader", keys)
        fresh.on_new_request(ctx)
        answers = [fresh.lookup(k, ctx) for k in keys]
        assert answers == [LookupResult.HIT_PENDING] * CHUNKS  # the read into DRAM runs
        assert fresh.has_pending_work()  # so the engine keeps stepping
        fresh.on_schedule_end()
        assert fresh.tm.drain()
        fresh.tm.step()
        assert [fresh.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * CHUNKS
        assert not fresh.has_pending_work()
        assert_loads(fresh, ctx, keys, written)
    finally:
        fresh.shutdown()


def _remote_up(manager: KVStoreOffloadingManager) -> None:
    deadline = time.monotonic() + 20  # a Mooncake client joins in the background
    while manager.tm.stats().remote["state"] != "up":
        assert time.monotonic() < deadline, manager.tm.stats().remote["degraded_reason"]
        manager.tm.step()
        time.sleep(0.01)


@pytest.fixture(params=["memory", "mooncake"])
def cluster_options(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The remote tier of two nodes: the in-process cluster, or a real Mooncake master
    on free loopback ports (started and stopped here; skips without the cluster extra)."""
    common = dict(
        remote_namespace="test-vllm-spec",
        remote_deadline_s=2.0,
        remote_health_s=0.05,
        compute_flops=1e9,  # recomputing is slow: the plan loads
    )
    if request.param == "memory":
        cluster = {"cluster": f"vllm-spec-{uuid.uuid4().hex}"}
        yield dict(common, remote_backend="memory", remote_options=cluster)
        return
    from kvstore.tiering.remote_mooncake import mooncake_available

    reason = mooncake_available()
    if reason is not None:
        pytest.skip(reason)
    from kvstore.testing.cluster import running_master

    with running_master(tmp_path / "master.log") as master:
        options = {"master": master.address, "segment_bytes": 16 << 20}
        yield dict(common, remote_backend="mooncake", remote_options=options)


def test_a_prefix_another_node_stored_is_retry_while_its_remote_read_runs_then_hit(
    tmp_path: Path, cluster_options: dict[str, Any]
) -> None:
    # Two nodes (each its own store root) share pages through the remote tier. B's
    # first lookup of A's prefix starts the remote reads: the answer must make vLLM
    # ask again (RETRY), not MISS -- a MISS is final for the step, so the first
    # request would recompute every chunk and a remote prefix would never hit on
    # first sight.
    remote = cluster_options
    a = open_manager(tmp_path / "a", **remote)
    b = open_manager(tmp_path / "b", **remote)
    try:
        _remote_up(a)
        _remote_up(b)
        keys = chunk_keys("shared")
        written = store(a, keys)
        deadline = time.monotonic() + 5
        while a.tm.stats().remote["published"] < CHUNKS:
            assert time.monotonic() < deadline, a.tm.stats().remote["counters"]
            a.tm.step()
            time.sleep(0.01)
        ctx = request("reader", keys)
        b.on_new_request(ctx)
        assert [b.lookup(k, ctx) for k in keys] == [LookupResult.RETRY] * CHUNKS
        assert b.has_pending_work()  # so the engine steps again and asks again
        b.on_schedule_end()
        assert b.tm.drain()
        b.tm.step()
        assert [b.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * CHUNKS
        assert not b.has_pending_work()
        assert_loads(b, ctx, keys, written)
        b.on_request_finished(ctx)
        b.on_schedule_end()
        assert b.tm.stats().remote["hits"] == CHUNKS

        # A prefix no node stored: asked once, then MISS -- the request is not held.
        cold = chunk_keys("cold")
        ctx = request("cold", cold)
        b.on_new_request(ctx)
        assert b.lookup(cold[0], ctx) is LookupResult.RETRY
        b.on_schedule_end()
        assert b.tm.drain()
        b.tm.step()
        assert [b.lookup(k, ctx) for k in cold] == [LookupResult.MISS] * CHUNKS
        assert not b.has_pending_work()
        b.on_request_finished(ctx)
        b.on_schedule_end()
        assert b.tm.stats().remote["misses"] == 0
    finally:
        b.shutdown()
        a.shutdown()


def test_a_request_waits_for_remote_reads_at_most_remote_wait_s(tmp_path: Path) -> None:
    # A hung cluster: the reads never land; past remote_wait_s the chunks are MISS
    # and the request goes on (recomputes) rather than waiting for the deadline.
    cluster = f"vllm-spec-{uuid.uuid4().hex}"
    options = dict(
        remote_backend="memory",
        remote_options={"cluster": cluster},
        remote_namespace="test-vllm-spec",
        remote_deadline_s=30.0,
        remote_health_s=0.05,
        compute_flops=1e9,
    )
    manager = KVStoreOffloadingManager(
        TierManager.open(tier_config(tmp_path, **options)),
        TensorStaging(8, CHUNK),
        prefix=b"test/",
        tokens_per_chunk=TOKENS,
        remote_wait_s=0.2,
    )
    c = memory_cluster(cluster)
    try:
        _remote_up(manager)
        c.hang.set()
        keys = chunk_keys("hung")
        ctx = request("r", keys)
        manager.on_new_request(ctx)
        assert manager.lookup(keys[0], ctx) is LookupResult.RETRY
        manager.on_schedule_end()
        time.sleep(0.3)
        assert manager.lookup(keys[0], ctx) is LookupResult.MISS
        assert not manager.has_pending_work()
        manager.on_request_finished(ctx)
        manager.on_schedule_end()
    finally:
        c.hang.clear()
        c.release.set()
        manager.shutdown()


def test_a_slow_disk_answers_miss_where_recomputing_is_faster(tmp_path: Path) -> None:
    manager = open_manager(tmp_path, placement="write_through")
    keys = chunk_keys("p")
    store(manager, keys)
    manager.shutdown()

    # 1 MB/s from NVMe: a 64 KiB chunk takes 65 ms to read, far more than its
    # 32 tokens of prefill at 1 PFLOP/s.
    slow = open_manager(
        tmp_path,
        warm_dram_on_open=False,
        bandwidth_bytes_per_s={"nvme_read": 1e6},
        compute_flops=1e15,
    )
    try:
        ctx = request("reader", keys)
        slow.on_new_request(ctx)
        assert [slow.lookup(k, ctx) for k in keys] == [LookupResult.MISS] * CHUNKS
        assert not slow.has_pending_work()  # no read was started for it
        stats = slow.tm.stats()
        assert stats.recompute_decisions.get("faster") == 1
        assert stats.in_flight_bytes.get("nvme_read", 0) == 0
    finally:
        slow.shutdown()


def test_hits_not_loaded_give_their_pins_and_chunks_back_at_the_step_end(
    tmp_path: Path,
) -> None:
    manager = open_manager(tmp_path)
    try:
        keys = chunk_keys("p")
        store(manager, keys)
        ctx = request("reader", keys)
        manager.on_new_request(ctx)
        assert [manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * CHUNKS
        assert len(manager._free) == 8 - CHUNKS  # a staging chunk held per HIT
        assert all(manager.tm.pin([manager.page_key(k)]) for k in keys)
        manager.tm.unpin([manager.page_key(k) for k in keys])  # the probe's own pins
        manager.on_schedule_end()  # vLLM did not schedule the request this step
        assert len(manager._free) == 8
        with pytest.raises(ValueError, match="not pinned"):
            manager.tm.unpin([manager.page_key(keys[0])])
    finally:
        manager.shutdown()


def test_prepare_load_refuses_chunks_lookup_did_not_answer_hit(tmp_path: Path) -> None:
    manager = open_manager(tmp_path)
    try:
        keys = chunk_keys("p")
        ctx = request("reader", keys)
        manager.on_new_request(ctx)
        with pytest.raises(RuntimeError, match="did not answer HIT"):
            manager.prepare_load(keys[:1], ctx)
    finally:
        manager.shutdown()


def test_a_store_without_room_for_all_its_chunks_is_refused_whole(tmp_path: Path) -> None:
    # vLLM marks every chunk of a store job handled: a partial answer would lose
    # the rest, so it is all or nothing (None: vLLM asks again next step).
    manager = open_manager(tmp_path, staging_chunks=4)
    try:
        keys = chunk_keys("p")
        ctx = request("writer", keys)
        manager.on_new_request(ctx)
        assert manager.prepare_store(keys, ctx) is None  # 6 chunks, 4 staging
        assert len(manager._free) == 4  # nothing held by the refusal
        first = manager.prepare_store(keys[:4], ctx)
        assert first is not None and first.keys_to_store == keys[:4]
        assert manager.prepare_store(keys[4:], ctx) is None  # none free now
        manager.complete_store(keys[:4], ctx, success=False)  # the copy failed
        assert len(manager._free) == 4
        assert [manager.lookup(k, ctx) for k in keys[:1]] == [LookupResult.MISS]
    finally:
        manager.shutdown()


def test_a_lookup_without_a_free_staging_chunk_is_a_miss(tmp_path: Path) -> None:
    manager = open_manager(tmp_path, staging_chunks=CHUNKS)
    try:
        keys = chunk_keys("p")
        written = store(manager, keys)
        holder = request("holder", keys)
        manager.on_new_request(holder)
        manager.lookup(keys[0], holder)  # holds one staging chunk this step
        ctx = request("reader", keys)
        manager.on_new_request(ctx)
        answers = [manager.lookup(k, ctx) for k in keys]
        assert answers == [LookupResult.HIT] * (CHUNKS - 1) + [LookupResult.MISS]
        assert_loads(manager, ctx, keys[: CHUNKS - 1], written)
    finally:
        manager.shutdown()


def test_stored_chunks_chain_to_their_parents(tmp_path: Path) -> None:
    manager = open_manager(tmp_path)
    try:
        keys = chunk_keys("p")
        store(manager, keys)
        for depth, key in enumerate(keys):  # each chunk's parent is the one before it
            assert f"depth {depth}," in manager.tm.explain(manager.page_key(key))
        # An orphan (its parent never stored) is declined by prefix closure.
        orphan = chunk_keys("q")
        ctx = request("w2", orphan)
        manager.on_new_request(ctx)
        out = manager.prepare_store(orphan[1:2], ctx)
        assert out is not None
        manager.complete_store(orphan[1:2], ctx)
        assert manager.tm.drain()
        probe = request("r2", orphan)
        manager.on_new_request(probe)
        assert manager.lookup(orphan[1], probe) is LookupResult.MISS
    finally:
        manager.shutdown()


def test_chunks_completed_out_of_prompt_order_are_all_kept(tmp_path: Path) -> None:
    # vLLM hands complete_store its keys in its own order (seen: tail first); offered
    # in that order, each chunk would come before its parent and be declined.
    manager = open_manager(tmp_path)
    try:
        keys = chunk_keys("p")
        ctx = request("writer", keys)
        manager.on_new_request(ctx)
        out = manager.prepare_store(keys, ctx)
        assert out is not None
        manager.complete_store(list(reversed(keys)), ctx)
        assert manager.tm.drain()
        assert manager.tm.stats().pages_by_tier[1] == CHUNKS
        assert "orphan" not in manager.tm.stats().admissions
    finally:
        manager.shutdown()


def test_reset_cache_forgets_every_chunk(tmp_path: Path) -> None:
    manager = open_manager(tmp_path)
    try:
        keys = chunk_keys("p")
        store(manager, keys)
        manager.reset_cache()
        ctx = request("reader", keys)
        manager.on_new_request(ctx)
        assert manager.lookup(keys[0], ctx) is LookupResult.MISS
    finally:
        manager.shutdown()


def test_reset_cache_with_jobs_in_flight_frees_them_once_flushed(tmp_path: Path) -> None:
    # vLLM drops the jobs in flight at a reset and never completes them: their pins
    # must go at once, their staging chunks once the workers reported them flushed.
    manager = open_manager(tmp_path)
    try:
        keys = chunk_keys("p")
        store(manager, keys[:3])
        loader = request("loader", keys[:3])
        manager.on_new_request(loader)
        assert [manager.lookup(k, loader) for k in keys[:3]] == [LookupResult.HIT] * 3
        manager.prepare_load(keys[:3], loader)  # a load job in flight
        writer = request("writer2", keys)
        manager.on_new_request(writer)
        assert manager.prepare_store(keys[3:], writer) is not None  # a store in flight
        assert len(manager._free) == 8 - 6
        manager.reset_cache()
        assert len(manager._free) == 2  # a late worker copy may still land in them
        for key in keys[:3]:
            with pytest.raises(ValueError, match="not pinned"):
                manager.tm.unpin([b"test/0/" + key])  # the load's pins are gone
        manager.on_reset_flushed()
        assert len(manager._free) == 8
        after = request("after", keys)
        manager.on_new_request(after)
        assert manager.lookup(keys[0], after) is LookupResult.MISS
    finally:
        manager.shutdown()


def test_shutdown_closes_the_tier_manager_and_the_staging(tmp_path: Path) -> None:
    manager = open_manager(tmp_path)
    keys = chunk_keys("p")
    store(manager, keys)
    ctx = request("reader", keys)
    manager.on_new_request(ctx)
    manager.lookup(keys[0], ctx)  # a pin still held
    manager.shutdown()
    manager.shutdown()  # idempotent
    assert manager._staging.closed
    with pytest.raises(Exception, match="closed"):
        manager.tm.lookup([b"x"])


def test_an_untested_vllm_release_is_named_in_a_warning() -> None:
    import vllm

    assert version_warning(vllm.__version__) is None  # CI's pinned release
    assert version_warning("0.33.1") is None
    warning = version_warning("0.34.0")
    assert warning is not None and "0.34.0" in warning and "0.33" in warning
    assert version_warning("0.3.3") is not None


def test_the_plan_pins_every_chunk_it_will_answer_hit_for(tmp_path: Path) -> None:
    # The plan is made at the request's first lookup; vLLM asks for the other chunks
    # afterwards. The manager's control thread may evict meanwhile, so the plan pins
    # the whole run it counts on at once, and the step's end lets go of what vLLM
    # did not load.
    manager = open_manager(tmp_path)
    try:
        keys = chunk_keys("p")
        store(manager, keys)
        ctx = request("reader", keys)
        manager.on_new_request(ctx)
        assert manager.lookup(keys[0], ctx) is LookupResult.HIT
        for key in keys:  # pinned before vLLM asked about any but the first
            assert "pins 1," in manager.tm.explain(manager.page_key(key)), key
        manager.on_schedule_end()
        for key in keys:
            assert "pins 0," in manager.tm.explain(manager.page_key(key)), key
    finally:
        manager.shutdown()


def test_prepare_store_leaves_out_chunks_the_manager_holds(tmp_path: Path) -> None:
    manager = open_manager(tmp_path)
    try:
        keys = chunk_keys("p")
        store(manager, keys[:4])
        ctx = request("again", keys)
        manager.on_new_request(ctx)
        out = manager.prepare_store(keys, ctx)  # a prompt whose first 4 chunks are kept
        assert out is not None and out.keys_to_store == keys[4:]
        manager._reclaim()  # the first store's staging chunks are back
        assert len(out.store_spec.block_ids) == 2 and len(manager._free) == 6
        for key in keys[:4]:  # the probe took no pin
            assert "pins 0," in manager.tm.explain(manager.page_key(key))
    finally:
        manager.shutdown()


def test_the_cpu_worker_refuses_more_than_one_rank() -> None:
    check_single_worker(1)
    with pytest.raises(ValueError, match="one worker, not 2"):
        check_single_worker(2)


def test_a_cache_reset_outlives_a_restart(tmp_path: Path) -> None:
    # reset_cache (new weights) must not be undone by a restart: chunks stored before
    # it stay unreachable, those stored after it are found.
    manager = open_manager(tmp_path, placement="write_through")
    old, new = chunk_keys("old"), chunk_keys("new")
    store(manager, old)
    manager.reset_cache()
    store(manager, new)
    manager.shutdown()
    fresh = open_manager(tmp_path, warm_dram_on_open=False)
    try:
        ctx = request("reader", old)
        fresh.on_new_request(ctx)
        assert fresh.lookup(old[0], ctx) is LookupResult.MISS
        ctx2 = request("reader2", new)
        fresh.on_new_request(ctx2)
        assert fresh.lookup(new[0], ctx2) is LookupResult.HIT_PENDING
    finally:
        fresh.shutdown()


def test_two_kv_groups_asked_in_turns_keep_one_plan_each(tmp_path: Path) -> None:
    # A hybrid model's groups (full attention, sliding window) are asked about in
    # turns; each keeps its plan and its pins, planned once per step.
    manager = open_manager(tmp_path, staging_chunks=8)
    try:
        full, window = chunk_keys("p", 3, group=0), chunk_keys("p", 3, group=1)
        ctx = request("writer", full)
        for index, key in enumerate(window):
            ctx.set_offload_key_position(key, (index + 1) * TOKENS)
        manager.on_new_request(ctx)
        out = manager.prepare_store(full + window, ctx)
        assert out is not None
        manager.complete_store(full + window, ctx)
        manager.on_request_finished(ctx)
        manager.on_schedule_end()
        assert manager.tm.drain()
        assert manager.tm.stats().pages_by_tier[1] == 6  # both chains kept, no orphans
        reader = request("reader", full)
        for index, key in enumerate(window):
            reader.set_offload_key_position(key, (index + 1) * TOKENS)
        manager.on_new_request(reader)
        lookups_before = manager.tm.stats().lookups
        answers = [
            manager.lookup(k, reader) for pair in zip(full, window, strict=True) for k in pair
        ]
        assert answers == [LookupResult.HIT] * 6
        assert manager.tm.stats().lookups - lookups_before == 2  # one plan per group
        manager.on_schedule_end()
        for key in full + window:  # every pin given back
            assert "pins 0," in manager.tm.explain(manager.page_key(key)), key
    finally:
        manager.shutdown()


def test_a_hit_on_nvme_with_dram_full_of_pins_is_a_miss_not_a_failed_load(
    tmp_path: Path,
) -> None:
    # DRAM holds two chunks, both pinned by another request's plan; the prompt's chunks
    # are on NVMe only, and no DRAM slot can come free to stage them this step. The
    # manager's plan is READY (its prepare_load would stream), but vLLM pins the plan:
    # answering HIT made prepare_load wait a second and raise. Now they are a MISS.
    manager = open_manager(tmp_path, placement="write_through")
    keys = chunk_keys("p")
    store(manager, keys)
    manager.shutdown()
    fresh = open_manager(
        tmp_path,
        warm_dram_on_open=False,
        dram_bytes=2 * CHUNK,
        # Nothing leaves DRAM in the background: it holds exactly the two pinned chunks.
        watermark_low=1.0,
        watermark_warn=1.0,
        watermark_force=1.0,
    )
    try:
        others = chunk_keys("q", 2)
        store(fresh, others)
        assert fresh.tm.stats().pages_by_tier[1] == 2
        assert fresh.tm.pin([fresh.page_key(k) for k in others]) == [True, True]
        ctx = request("reader", keys)
        fresh.on_new_request(ctx)
        answers = [fresh.lookup(k, ctx) for k in keys]
        assert LookupResult.HIT not in answers, answers
        assert answers[0] is LookupResult.MISS, answers
        fresh.on_schedule_end()
        fresh.tm.unpin([fresh.page_key(k) for k in others])
    finally:
        fresh.shutdown()

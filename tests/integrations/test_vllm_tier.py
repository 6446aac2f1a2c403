"""The kvstore tier under vLLM's own TieringOffloadingManager (vLLM 0.33, on CPU).

Run with the integration environment: .venv-integ/bin/pytest tests/integrations
(tools/setup_integ_env.sh builds it). Without vLLM installed, this module skips.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.base", reason="needs vllm (make integ env)")

from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvstore import KVStore
from kvstore.bench.vllm_tier import (
    chunk_bytes_for,
    chunk_key,
    kvstore_tier,
    offloading_config,
    open_manager,
    store_chunks,
)
from kvstore.errors import ClosedError, KVStoreError
from kvstore.format.constants import BLOCK_BYTES
from kvstore.format.names import SUPERBLOCK_NAME, segment_path
from kvstore.integrations.vllm import KVStoreTier

REPO = Path(__file__).resolve().parents[2]
CHUNK_BYTES = 64 << 10
CONTEXT = ReqContext(req_id="test")
STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
# The I/O-error tests inject EIO into os.preadv, which the thread-pool engine
# reads through (io_uring reads would bypass it); the tier's handling is the same.
THREADPOOL = {"store_options": {"io_engine": "threadpool"}}

# A fresh process: a new manager (new engine, empty CPU tier) over the same store.
CHILD = """
import json, sys
from kvstore.bench.vllm_tier import chunk_key, kvstore_tier, load_chunks, offloading_config
from kvstore.bench.vllm_tier import open_manager
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


def job(
    job_id: int,
    keys: list[OffloadKey],
    chunk_ids: list[int],
    promotion: bool,
    context: ReqContext = CONTEXT,
) -> Any:
    return TransferJob(
        job_id=job_id,
        keys=keys,
        chunk_ids=np.array(chunk_ids, dtype=np.int32),
        is_promotion=promotion,
        req_context=context,
    )


def finished(tier: KVStoreTier) -> list[Any]:
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


def locked(manager: Any) -> contextlib.AbstractContextManager[Any]:
    lock: contextlib.AbstractContextManager[Any] | None = getattr(manager, "lock", None)
    return lock if lock is not None else contextlib.nullcontext()


@contextlib.contextmanager
def unreadable(
    monkeypatch: pytest.MonkeyPatch, store: KVStore, page_key: bytes
) -> Iterator[list[int]]:
    """Reads that touch ``page_key``'s record fail with EIO, as a bad sector does.

    Yields a list that grows by one per failed read.
    """
    store.flush()
    info = store.info(page_key)
    assert info is not None
    status = os.stat(segment_path(store.root, info.segment_id))
    start, end = info.offset, info.offset + BLOCK_BYTES + info.payload_bytes
    failures: list[int] = []
    real_preadv = os.preadv

    def preadv(fd: int, buffers: Any, offset: int, *flags: int) -> int:
        length = sum(memoryview(buffer).nbytes for buffer in buffers)
        here = os.fstat(fd)
        if (here.st_dev, here.st_ino) == (status.st_dev, status.st_ino) and (
            offset < end and offset + length > start
        ):
            failures.append(offset)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_preadv(fd, buffers, offset, *flags)

    with monkeypatch.context() as patch:
        patch.setattr(os, "preadv", preadv)
        yield failures


def count_loads(tier: KVStoreTier) -> list[list[OffloadKey]]:
    """Record the keys of every promotion job vLLM submits to ``tier``."""
    jobs: list[list[OffloadKey]] = []
    real_submit_load = tier.submit_load

    def submit_load(job_metadata: Any) -> None:
        jobs.append(list(job_metadata.keys))
        real_submit_load(job_metadata)

    tier.submit_load = submit_load  # type: ignore[method-assign]
    return jobs


def request_prefix(
    manager: Any, keys: list[OffloadKey], context: ReqContext, max_steps: int = 300
) -> tuple[list[LookupResult], int]:
    """Drive engine steps for one request until every chunk is HIT or MISS.

    Each step looks the chunks up, ends the step, and waits for the tiers'
    I/O (an engine step takes longer than one chunk read). Returns the final
    results and the steps taken; ``max_steps`` steps without an answer is
    vLLM's livelock.
    """
    for step in range(1, max_steps + 1):
        with locked(manager):
            results = [manager.lookup(key, context) for key in keys]
            manager.on_schedule_end(STEP)
        if all(result in (LookupResult.HIT, LookupResult.MISS) for result in results):
            return results, step
        for tier in manager.secondary_tiers:
            tier.drain_jobs()
    return results, max_steps


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


def store_then_reopen(path: Path, keys: list[OffloadKey], **tier_options: Any) -> Any:
    """Store ``keys`` through one manager, then open a fresh one (empty CPU tier)."""
    with open_manager(small_config(path, tier_options=tier_options)) as manager:
        store_chunks(manager, keys, batch=len(keys))
    return open_manager(small_config(path, tier_options=tier_options))


def test_an_unreadable_page_is_a_miss_not_promoted_every_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # vLLM's own manager: a chunk that HITs the tier but cannot be read must
    # become a MISS (recomputed), not a promotion retried every engine step.
    keys = [chunk_key(i) for i in range(4)]
    bad = keys[2]
    with store_then_reopen(tmp_path / "kv", keys, **THREADPOOL) as manager:
        tier = manager.secondary_tiers[0]
        jobs = count_loads(tier)
        with unreadable(monkeypatch, tier.store, tier.page_key(bad)) as failures:
            first = ReqContext(req_id="first")
            with locked(manager):
                manager.on_new_request(first)
            results, steps = request_prefix(manager, keys, first)
            assert failures  # the read really failed with EIO
            assert [result.name for result in results] == ["HIT", "HIT", "MISS", "HIT"]
            assert steps <= 3
            assert sum(bad in job for job in jobs) == 1
            # An I/O error is not proof of damage: the page stays, but is not offered.
            assert tier.page_key(bad) in tier.store
            # Another request within failed_load_ttl_s (5 s): a MISS at once, no read.
            second = ReqContext(req_id="second")
            with locked(manager):
                manager.on_new_request(second)
            assert request_prefix(manager, [bad], second)[0] == [LookupResult.MISS]
            assert sum(bad in job for job in jobs) == 1
            for context in (first, second):
                with locked(manager):
                    manager.on_request_finished(context)


def test_after_the_negative_cache_expires_a_new_request_tries_once_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = [chunk_key(i) for i in range(2)]
    options = {**THREADPOOL, "failed_load_ttl_s": 0.3}
    with store_then_reopen(tmp_path / "kv", keys, **options) as manager:
        tier = manager.secondary_tiers[0]
        jobs = count_loads(tier)
        with unreadable(monkeypatch, tier.store, tier.page_key(keys[0])):
            first = ReqContext(req_id="first")
            with locked(manager):
                manager.on_new_request(first)
            assert request_prefix(manager, keys, first)[0] == [LookupResult.MISS, LookupResult.HIT]
            time.sleep(0.4)
            # A new request reads once more (and fails once more) ...
            again = ReqContext(req_id="again")
            with locked(manager):
                manager.on_new_request(again)
            assert request_prefix(manager, keys[:1], again)[0] == [LookupResult.MISS]
            assert [keys[0] in job for job in jobs] == [True, True]
            # ... while the request that saw the failure never reads it again.
            with locked(manager):
                assert tier.lookup(keys[0], first) is LookupResult.MISS
                for context in (first, again):
                    manager.on_request_finished(context)


def test_a_failed_read_is_forgotten_for_the_request_when_it_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier, _ = direct_tier(tmp_path / "kv", failed_load_ttl_s=0, **THREADPOOL)
    keys = [chunk_key(i) for i in range(2)]
    tier.submit_store(job(1, keys, [0, 1], promotion=False))
    assert finished(tier)[0].success
    request = ReqContext(req_id="r")
    with unreadable(monkeypatch, tier.store, tier.page_key(keys[0])):
        tier.submit_load(job(2, keys, [4, 5], promotion=True, context=request))
        (result,) = finished(tier)
    assert not result.success and list(result.successful_keys) == [keys[1]]
    # failed_load_ttl_s=0: no negative cache, but the request itself never retries.
    assert tier.lookup(keys[0], request) is LookupResult.MISS
    assert tier.lookup(keys[0], CONTEXT) is LookupResult.HIT
    tier.on_request_finished(request)
    assert tier.lookup(keys[0], request) is LookupResult.HIT
    tier.shutdown()


def test_an_io_error_in_a_batch_fails_only_that_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier, primary = direct_tier(tmp_path / "kv", io_threads=1, **THREADPOOL)
    keys = [chunk_key(i) for i in range(4)]
    for index, key in enumerate(keys):
        primary[index] = chunk_bytes_for(key, CHUNK_BYTES)
    tier.submit_store(job(1, keys, [0, 1, 2, 3], promotion=False))
    assert finished(tier)[0].success
    primary[4:8] = 0
    with unreadable(monkeypatch, tier.store, tier.page_key(keys[1])) as failures:
        tier.submit_load(job(2, keys, [4, 5, 6, 7], promotion=True))  # one batch
        (result,) = finished(tier)
    assert failures
    assert not result.success
    assert set(result.successful_keys) == {keys[0], keys[2], keys[3]}
    assert result.transfer_bytes == 3 * CHUNK_BYTES
    for slot, key in ((4, keys[0]), (6, keys[2]), (7, keys[3])):
        assert np.array_equal(primary[slot], chunk_bytes_for(key, CHUNK_BYTES))
    assert tier.lookup(keys[1], CONTEXT) is LookupResult.MISS  # negative cache
    assert [tier.store.pin_count(tier.page_key(key)) for key in keys] == [0, 0, 0, 0]
    tier.shutdown()


def test_a_chunk_stored_after_a_failed_read_replaces_the_unreadable_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier, primary = direct_tier(tmp_path / "kv", **THREADPOOL)
    key = chunk_key(0)
    primary[0] = chunk_bytes_for(key, CHUNK_BYTES)
    tier.submit_store(job(1, [key], [0], promotion=False))
    assert finished(tier)[0].success
    with unreadable(monkeypatch, tier.store, tier.page_key(key)):
        tier.submit_load(job(2, [key], [5], promotion=True))
        assert not finished(tier)[0].success
        # vLLM recomputes the chunk and cascades it again: it is written anew
        # (elsewhere in the log), not skipped as "already stored".
        tier.submit_store(job(3, [key], [0], promotion=False))
        (stored,) = finished(tier)
    assert stored.success and stored.transfer_bytes == CHUNK_BYTES
    later = ReqContext(req_id="later")  # the failed request itself keeps its MISS
    assert tier.lookup(key, later) is LookupResult.HIT
    tier.submit_load(job(4, [key], [6], promotion=True, context=later))
    assert finished(tier)[0].success
    assert np.array_equal(primary[6], chunk_bytes_for(key, CHUNK_BYTES))
    tier.shutdown()


def test_pages_the_dwpd_budget_declines_are_reported_as_not_stored(tmp_path: Path) -> None:
    # A budget of ~12 bytes/s whose bucket holds two 128 KiB pages' worth: after
    # the namespace page, one 64 KiB chunk fits and the rest are declined.
    budget = {
        "max_dwpd": 0.001,
        "drive_capacity_bytes": 1 << 30,
        "max_page_bytes": 2 * CHUNK_BYTES,
    }
    tier, _ = direct_tier(tmp_path / "kv", io_threads=1, store_options=budget)
    keys = [chunk_key(i) for i in range(3)]
    tier.submit_store(job(1, keys, [0, 1, 2], promotion=False))
    (result,) = finished(tier)
    stored = [key for key in keys if tier.lookup(key, CONTEXT) is LookupResult.HIT]
    assert tier.store.stats().declined_puts == len(keys) - len(stored) > 0
    assert 0 < len(stored) < len(keys)
    assert not result.success  # vLLM: False when some keys failed
    assert result.transfer_bytes == len(stored) * CHUNK_BYTES
    tier.shutdown()


def events_config(path: Path, **tier_options: Any) -> Any:
    config = small_config(path, tier_options={"enable_kv_events": True, **tier_options})
    return dataclasses.replace(config, enable_kv_cache_events=True)


def storage_events(manager: Any) -> list[Any]:
    with locked(manager):
        return [event for event in manager.take_events() if event.medium is Medium.STORAGE]


def test_kv_events_report_stored_and_removed_chunks(tmp_path: Path) -> None:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
        OffloadingEventsTracker,
    )
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    from vllm.v1.kv_offload.base import get_offload_block_hash

    keys = [chunk_key(i) for i in range(4)]
    config = events_config(tmp_path / "kv")
    with open_manager(config) as manager:  # the tier's constructor takes enable_kv_events
        tier = manager.secondary_tiers[0]
        store_chunks(manager, keys, batch=4)
        (stored,) = storage_events(manager)
        assert not stored.removed and set(stored.keys) == set(keys)
        assert stored.ownership == "KVStoreTier"
        # Stored again (the tier skips chunks it has): nothing new to announce.
        tier.submit_store(job(1000, keys, [0, 1, 2, 3], promotion=False))
        tier.drain_jobs()
        assert storage_events(manager) == []
        # vLLM's own translation into the published KV events.
        tracker = OffloadingEventsTracker(manager_events_config(tier))
        published = list(tracker.take_events([stored]))
        assert all(isinstance(event, BlockStored) for event in published)
        assert {event.medium for event in published} == {"STORAGE"}
        assert {event.block_hashes[0] for event in published} == {
            maybe_convert_block_hash(get_offload_block_hash(key)) for key in keys
        }
        # A page that fails its checksum is deleted: announced as removed.
        tier.store.flush()
        info = tier.store.info(tier.page_key(keys[0]))
        assert info is not None
        flip_payload_byte(tier.store, info)
        tier.submit_load(job(1001, [keys[0]], [15], promotion=True))
        tier.drain_jobs()
        (removed,) = storage_events(manager)
        assert removed.removed and removed.keys == [keys[0]]
        (published_removal,) = tracker.take_events([removed])
        assert isinstance(published_removal, BlockRemoved)
        assert published_removal.medium == "STORAGE"
        list(tier.get_finished_jobs())  # the hand-made jobs are not the manager's


def manager_events_config(tier: KVStoreTier) -> Any:
    return tier._offloading_spec.kv_events_config


def flip_payload_byte(store: KVStore, info: Any) -> None:
    fd = os.open(segment_path(store.root, info.segment_id), os.O_RDWR)
    try:
        at = info.offset + BLOCK_BYTES + 100
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x40]), at)
        os.fsync(fd)
    finally:
        os.close(fd)


def test_kv_events_report_evicted_chunks(tmp_path: Path) -> None:
    small = {"segment_bytes": 1 << 20, "capacity_bytes": 6 << 20, "max_page_bytes": CHUNK_BYTES}
    spec = TieringOffloadingSpec(events_config(tmp_path / "kv"))
    primary = np.zeros((8, CHUNK_BYTES), dtype=np.uint8)
    tier = KVStoreTier(
        spec,
        memoryview(primary),
        "KVStoreTier",
        path=str(tmp_path / "kv"),
        enable_kv_events=True,
        store_options=small,
    )
    tier._eviction_scan_s = 0.0
    keys = [chunk_key(i) for i in range(96)]  # 6 MiB of chunks into a 6 MiB store
    for start in range(0, len(keys), 8):
        tier.submit_store(job(start + 1, keys[start : start + 8], list(range(8)), False))
        tier.drain_jobs()
    list(tier.get_finished_jobs())
    deadline = time.monotonic() + 30
    while sum(tier.store.stats().evictions.values()) == 0:
        assert time.monotonic() < deadline, "the store never evicted"
        time.sleep(0.05)
    gone = {key for key in keys if tier.page_key(key) not in tier.store}
    assert gone
    events = list(tier.take_events())
    assert {key for event in events if not event.removed for key in event.keys} == set(keys)
    tier.on_schedule_end(STEP)
    deadline = time.monotonic() + 30
    removed: set[OffloadKey] = set()
    while not gone <= removed:
        assert time.monotonic() < deadline, f"{len(gone - removed)} evictions not announced"
        time.sleep(0.02)
        removed |= {key for event in tier.take_events() if event.removed for key in event.keys}
        tier.on_schedule_end(STEP)
    assert all(tier.page_key(key) not in tier.store for key in removed)
    tier.shutdown()


def test_kv_events_need_vllms_events_enabled(tmp_path: Path, caplog: Any) -> None:
    with caplog.at_level(logging.WARNING, logger="kvstore.integrations.vllm"):
        config = small_config(tmp_path / "kv", tier_options={"enable_kv_events": True})
        with open_manager(config) as manager:  # vLLM's events off: the tier still starts
            store_chunks(manager, [chunk_key(0)], batch=1)
            assert storage_events(manager) == []
    assert "events are disabled" in caplog.text


def test_every_entry_point_after_shutdown_raises_closed_error(tmp_path: Path) -> None:
    tier, _ = direct_tier(tmp_path / "kv")
    tier.shutdown()
    with pytest.raises(ClosedError, match="shut down"):
        tier.submit_store(job(1, [chunk_key(0)], [0], promotion=False))
    with pytest.raises(ClosedError, match="shut down"):
        tier.submit_load(job(2, [chunk_key(0)], [0], promotion=True))
    with pytest.raises(ClosedError, match="shut down"):
        tier.lookup(chunk_key(0), CONTEXT)
    with pytest.raises(ClosedError, match="shut down"):
        tier.on_new_request(CONTEXT)
    # What vLLM may still call while it winds down answers quietly.
    assert list(tier.get_finished_jobs()) == []
    assert not tier.has_pending_work()
    tier.drain_jobs()
    tier.on_request_finished(CONTEXT)
    tier.on_schedule_end(STEP)
    assert list(tier.take_events()) == []
    tier.shutdown()


def test_a_store_that_refuses_to_open_stops_the_engine_start(tmp_path: Path) -> None:
    path = tmp_path / "kv"
    KVStore.open(path, create=True).close()
    superblock = path / SUPERBLOCK_NAME
    data = bytearray(superblock.read_bytes())
    data[8] ^= 0xFF
    superblock.write_bytes(bytes(data))
    with pytest.raises(KVStoreError) as raised, open_manager(small_config(path)):
        pass
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "kvstore tier 'KVStoreTier'" in notes and str(path) in notes
    assert "kvstore recover" in notes


def test_a_degraded_store_is_reported_once_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    # Whichever quarantine counters KVStore.stats() carries, a nonzero one is
    # reported when the engine starts (stood in for here by a wrapped stats()).
    real_stats = KVStore.stats

    class Degraded:
        def __init__(self, stats: Any) -> None:
            self._stats = stats

        def __getattr__(self, name: str) -> Any:
            return getattr(self._stats, name)

        def as_dict(self) -> dict[str, Any]:
            return {
                **self._stats.as_dict(),
                "quarantined_segments": 1,
                "quarantined": {"wal_files": 2, "pages": 0},
            }

    monkeypatch.setattr(KVStore, "stats", lambda store: Degraded(real_stats(store)))
    with caplog.at_level(logging.WARNING, logger="kvstore.integrations.vllm"):
        tier, _ = direct_tier(tmp_path / "kv")
    warnings = [r for r in caplog.records if "opened degraded" in r.getMessage()]
    assert len(warnings) == 1
    assert "quarantined_segments=1" in warnings[0].getMessage()
    assert tier.degraded == {"quarantined_segments": 1, "quarantined.wal_files": 2}
    tier.shutdown()
    monkeypatch.setattr(KVStore, "stats", real_stats)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvstore.integrations.vllm"):
        healthy, _ = direct_tier(tmp_path / "kv")
    assert healthy.degraded == {}
    assert "opened degraded" not in caplog.text
    healthy.shutdown()


def test_a_backpressure_detector_gets_the_fs_tiers_store_failure_threshold(
    tmp_path: Path,
) -> None:
    """Issue 29 #12: vLLM defaults failure_threshold (3) only for its fs/obj tiers;
    this tier is storage too, so its detector gets the same default; an explicit
    threshold is kept."""
    from vllm.v1.kv_offload.tiering.backpressure import EMABackpressureDetector

    defaults = EMABackpressureDetector.default_config("KVStoreTier")
    assert "failure_threshold" not in defaults  # what vLLM's factory gives this tier
    detector = EMABackpressureDetector(**defaults)
    tier, _ = direct_tier(tmp_path / "a", backpressure_detector=detector)
    assert detector._failure_threshold == EMABackpressureDetector.DEFAULT_FAILURE_THRESHOLD
    for _ in range(EMABackpressureDetector.DEFAULT_FAILURE_THRESHOLD):
        detector.on_store_failed()
    assert detector._under_pressure
    tier.shutdown()
    explicit = EMABackpressureDetector(**defaults, failure_threshold=7)
    tier, _ = direct_tier(tmp_path / "b", backpressure_detector=explicit)
    assert explicit._failure_threshold == 7
    tier.shutdown()

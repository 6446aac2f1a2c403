"""kvstore's SGLang HiCache backend (``kvstore.integrations.sglang.KVStoreHiCache``).

Every backend is built the way SGLang's cache controller builds it: through
``StorageBackendFactory.create_backend`` (``"dynamic"`` + extra config for kvstore,
``"file"`` for SGLang's own ``HiCacheFile``), then ``register_mem_pool_host``.

- The contract suite runs against both backends: what SGLang's file backend passes,
  kvstore passes too (round trip, prefix count with a hole, batch set, namespacing,
  restart, clear).
- The zero-copy (``interface_v1``) path runs against ``FakeHostPool``
  (sglang_host_pool.py): SGLang's ``MHATokenToKVPoolHost`` cannot be imported on
  CPU here (``sglang.srt.configs`` needs torchvision), so the fake keeps its buffer
  shapes per layout and answers ``get_page_buffer_meta`` / ``get_data_page`` /
  ``set_from_flat_data_page`` as ``pool_host/mha.py`` does, from the tensor's own
  addresses.
- A slow disk: after a restart, pages on NVMe only whose load is slower than their
  recompute count as missing in ``batch_exists`` (while ``exists`` still sees them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory")

import torch
from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found]
    HiCacheFile,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.mem_cache.storage import (  # type: ignore[import-not-found]
    StorageBackendFactory,
)
from sglang_host_pool import LAYOUTS
from sglang_host_pool import FakeHostPool as SharedHostPool

import kvstore.integrations.sglang as sglang_backend
from kvstore.integrations.sglang import KVStoreHiCache

STORE_OPTIONS = {"segment_bytes": 4 << 20, "gc_interval_s": 0}
LAYERS, HEADS, HEAD_DIM, PAGE_TOKENS, HOST_PAGES = 2, 2, 4, 16, 16


class FakeHostPool(SharedHostPool):
    """sglang_host_pool's fake MHA host pool, in this module's geometry."""

    def __init__(self, layout: str, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(
            layout,
            dtype,
            layers=LAYERS,
            heads=HEADS,
            head_dim=HEAD_DIM,
            page_tokens=PAGE_TOKENS,
            pages=HOST_PAGES,
        )


def indices(first_page: int, pages: int) -> torch.Tensor:
    return torch.arange(first_page * PAGE_TOKENS, (first_page + pages) * PAGE_TOKENS)


def storage_config(
    extra: dict[str, Any], *, model: str = "org/model", tp_rank: int = 0, **fields: Any
) -> HiCacheStorageConfig:
    values: dict[str, Any] = {
        "tp_rank": tp_rank,
        "tp_size": 2,
        "pp_rank": 0,
        "pp_size": 1,
        "attn_cp_rank": 0,
        "attn_cp_size": 1,
        "is_mla_model": False,
        "enable_storage_metrics": False,
        "is_page_first_layout": True,
        "model_name": model,
        "extra_config": extra,
    }
    values.update(fields)
    return HiCacheStorageConfig(**values)


def kvstore_extra(path: Path, **options: Any) -> dict[str, Any]:
    tier_options = {"probe_at_open": False, **options.pop("tier_options", {})}
    return {
        "backend_name": "kvstore",
        "module_path": "kvstore.integrations.sglang",
        "class_name": "KVStoreHiCache",
        "interface_v1": 1,
        "path": str(path),
        "dram_bytes": 4 << 20,
        "page_bytes": 64 << 10,
        "store_options": STORE_OPTIONS,
        "tier_options": tier_options,
        **options,
    }


Factory = Callable[..., Any]


def make_kvstore(path: Path, pool: Any = None, **fields: Any) -> Any:
    options = fields.pop("options", {})
    backend = StorageBackendFactory.create_backend(
        "dynamic", storage_config(kvstore_extra(path, **options), **fields), pool
    )
    if pool is not None:
        backend.register_mem_pool_host(pool)  # as cache_controller.py does right after
    return backend


def make_file(path: Path, pool: Any = None, **fields: Any) -> Any:
    fields.pop("options", None)
    backend = StorageBackendFactory.create_backend(
        "file", storage_config({"file_storage_path": str(path)}, **fields), pool
    )
    if pool is not None:
        backend.register_mem_pool_host(pool)
    return backend


def close(backend: Any) -> None:
    if hasattr(backend, "close"):
        backend.close()


@pytest.fixture(params=["kvstore", "file"])
def factory(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Factory]:
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    opened: list[Any] = []
    make = make_kvstore if request.param == "kvstore" else make_file

    def build(path: Path, pool: Any = None, **fields: Any) -> Any:
        backend = make(path, pool, **fields)
        opened.append(backend)
        return backend

    yield build
    for backend in opened:
        close(backend)


def value(seed: int, elements: int = 256) -> torch.Tensor:
    return torch.randn(elements, generator=torch.Generator().manual_seed(seed))


# -- the contract both backends pass --------------------------------------------------


def test_the_factory_builds_each_backend(factory: Factory, tmp_path: Path) -> None:
    backend = factory(tmp_path)
    assert isinstance(backend, KVStoreHiCache | HiCacheFile)


def test_set_get_exists_round_trip(factory: Factory, tmp_path: Path) -> None:
    backend = factory(tmp_path)
    data = value(1)
    assert not backend.exists("k1")
    assert backend.set("k1", data)
    assert backend.exists("k1")
    assert not backend.exists("k2")
    got = backend.get("k1", torch.empty_like(data))
    assert got is not None and torch.equal(got, data)
    assert backend.set("k1", data)  # again: already there, still a success


def test_batch_exists_counts_the_prefix_up_to_the_first_hole(
    factory: Factory, tmp_path: Path
) -> None:
    backend = factory(tmp_path)
    for key in ("a", "b", "d"):
        assert backend.set(key, value(ord(key)))
    assert backend.batch_exists(["a", "b", "c", "d"]) == 2
    assert backend.batch_exists(["c", "d"]) == 0
    assert backend.batch_exists(["a", "b"]) == 2


def test_batch_set_then_batch_get(factory: Factory, tmp_path: Path) -> None:
    backend = factory(tmp_path)
    keys = [f"h{i}" for i in range(5)]
    values = [value(i) for i in range(5)]
    assert backend.batch_set(keys, values)
    assert backend.batch_exists(keys) == 5
    got = backend.batch_get(keys, [torch.empty_like(v) for v in values])
    assert all(g is not None and torch.equal(g, v) for g, v in zip(got, values, strict=True))


def test_batch_set_stops_at_the_first_bad_value(factory: Factory, tmp_path: Path) -> None:
    backend = factory(tmp_path)
    assert not backend.batch_set(["x0", "x1", "x2"], [value(0), "not a tensor", value(2)])
    assert backend.exists("x0")
    assert not backend.exists("x1")
    assert not backend.exists("x2")


def test_models_and_ranks_never_see_each_others_pages(factory: Factory, tmp_path: Path) -> None:
    first = factory(tmp_path, model="org/a", tp_rank=0)
    other_model = factory(tmp_path, model="org/b", tp_rank=0)
    other_rank = factory(tmp_path, model="org/a", tp_rank=1)
    assert first.set("k", value(1))
    assert first.exists("k")
    assert not other_model.exists("k")
    assert not other_rank.exists("k")
    assert other_model.set("k", value(2))
    got = first.get("k", torch.empty(256))
    assert got is not None and torch.equal(got, value(1))


def test_a_new_instance_on_the_same_path_finds_the_pages(factory: Factory, tmp_path: Path) -> None:
    first = factory(tmp_path)
    keys = [f"r{i}" for i in range(3)]
    assert first.batch_set(keys, [value(i) for i in range(3)])
    close(first)  # kvstore: write-through finished, the store closed
    second = factory(tmp_path)
    assert second.batch_exists(keys) == 3
    got = second.get("r2", torch.empty(256))
    assert got is not None and torch.equal(got, value(2))


def test_clear_drops_the_pages(factory: Factory, tmp_path: Path) -> None:
    backend = factory(tmp_path)
    assert backend.set("k", value(1))
    backend.clear()
    assert not backend.exists("k")
    assert backend.set("k", value(1))  # usable after a clear
    assert backend.exists("k")


# -- kvstore: the zero-copy path (interface_v1) ---------------------------------------


@pytest.fixture
def opened() -> Iterator[list[Any]]:
    backends: list[Any] = []
    yield backends
    for backend in backends:
        close(backend)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_v1_round_trip_into_the_host_pool(layout: str, tmp_path: Path, opened: list[Any]) -> None:
    pool = FakeHostPool(layout)
    backend = make_kvstore(tmp_path, pool)
    opened.append(backend)
    pool.fill(0, 4, seed=7)
    source = pool.pages(0, 4)
    keys = [f"p{i}" for i in range(4)]
    assert backend.batch_set_v1(keys, indices(0, 4)) == [True] * 4
    assert backend.batch_exists([*keys, "missing"]) == 4
    assert backend.batch_get_v1(keys, indices(8, 4)) == [True] * 4
    for loaded, expected in zip(pool.pages(8, 4), source, strict=True):
        assert torch.equal(loaded, expected)
    assert all(not page.any() for page in pool.pages(12, 4))  # nothing written elsewhere


def test_v1_views_are_the_host_buffer_itself(tmp_path: Path, opened: list[Any]) -> None:
    pool = FakeHostPool("layer_first")
    backend = make_kvstore(tmp_path, pool)
    opened.append(backend)
    pages = backend._host_views().pages(indices(3, 2), 2)
    assert [len(parts) for parts in pages] == [2 * LAYERS] * 2
    base = pool.kv_buffer.untyped_storage().data_ptr()
    for parts in pages:
        for view in parts:
            assert view.untyped_storage().data_ptr() == base  # a view, not a copy


def test_v1_and_legacy_calls_share_pages(tmp_path: Path, opened: list[Any]) -> None:
    for layout in ("page_first", "layer_first"):
        pool = FakeHostPool(layout)
        backend = make_kvstore(tmp_path / layout, pool)
        opened.append(backend)
        pool.fill(0, 2, seed=3)
        assert backend.batch_set_v1(["v0", "v1"], indices(0, 2)) == [True, True]
        got = backend.get("v1")  # SGLang's legacy read: into a dummy flat page
        assert got is not None and torch.equal(got, pool.get_data_page(PAGE_TOKENS))
        # SGLang's legacy write (get_data_page flat) read back through v1.
        assert backend.batch_set(["f0"], [pool.get_data_page(0)])
        assert backend.batch_get_v1(["f0"], indices(5, 1)) == [True]
        assert torch.equal(pool.get_data_page(5 * PAGE_TOKENS), pool.get_data_page(0))


def test_v1_chains_to_the_prefix_keys_and_reports_a_missing_page(
    tmp_path: Path, opened: list[Any]
) -> None:
    pool = FakeHostPool("page_first")
    backend = make_kvstore(tmp_path, pool)
    opened.append(backend)
    pool.fill(0, 4, seed=5)
    assert backend.batch_set_v1(["a0", "a1"], indices(0, 2)) == [True, True]
    extra = HiCacheStorageExtraInfo(prefix_keys=["a0", "a1"])
    assert backend.batch_set_v1(["a2", "a3"], indices(2, 2), extra) == [True, True]
    assert backend.batch_exists(["a0", "a1", "a2", "a3"]) == 4
    # A page kvstore does not hold fails alone; SGLang uses the leading run.
    assert backend.batch_get_v1(["a0", "zz", "a2"], indices(8, 3)) == [True, False, True]


def test_v1_namespaces_by_layout_and_dtype(tmp_path: Path, opened: list[Any]) -> None:
    # One live instance per rank and namespace (#11): each closes before the next.
    pool = FakeHostPool("page_first")
    writer = make_kvstore(tmp_path, pool)
    opened.append(writer)
    pool.fill(0, 1, seed=1)
    assert writer.batch_set_v1(["n0"], indices(0, 1)) == [True]
    writer.close()
    for other_pool in (FakeHostPool("layer_first"), FakeHostPool("page_first", torch.float16)):
        reader = make_kvstore(tmp_path, other_pool)
        opened.append(reader)
        assert not reader.exists("n0")
        assert reader.batch_exists(["n0"]) == 0
        reader.close()
    again = make_kvstore(tmp_path, FakeHostPool("page_first"))
    opened.append(again)
    assert again.exists("n0")


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_v1_pages_survive_a_restart(layout: str, tmp_path: Path) -> None:
    pool = FakeHostPool(layout)
    writer = make_kvstore(tmp_path, pool)
    pool.fill(0, 3, seed=11)
    source = pool.pages(0, 3)
    keys = ["s0", "s1", "s2"]
    assert writer.batch_set_v1(keys, indices(0, 3)) == [True] * 3
    writer.close()
    fresh_pool = FakeHostPool(layout)
    reader = make_kvstore(
        tmp_path, fresh_pool, options={"tier_options": {"warm_dram_on_open": False}}
    )
    try:
        assert reader.tier_stats().pages_by_tier == (
            0,
            0,
            3 * 2 * (LAYERS if layout == "layer_first" else 1),
        )
        assert reader.batch_exists(keys) == 3  # on NVMe only, and worth loading
        assert reader.batch_get_v1(keys, indices(4, 3)) == [True] * 3
        for loaded, expected in zip(fresh_pool.pages(4, 3), source, strict=True):
            assert torch.equal(loaded, expected)
    finally:
        reader.close()


def test_a_batch_larger_than_the_dram_arena_is_kept_whole(tmp_path: Path) -> None:
    pool = FakeHostPool("layer_first")  # 8 pages x 4 parts of 512 bytes
    small = {"dram_bytes": 8 << 12}
    writer = make_kvstore(tmp_path, pool, options=small)
    # 8 slots (a slot is a page rounded up to 4 KiB) for the batch's 32 parts.
    assert writer.tier_stats().capacity_bytes[1] // 4096 == 8
    pool.fill(0, 8, seed=6)
    source = pool.pages(0, 8)
    keys = [f"b{i}" for i in range(8)]
    # The rest waits for the write-through of what fits (SGLang sends up to 128 pages).
    assert writer.batch_set_v1(keys, indices(0, 8)) == [True] * 8
    writer.close()
    reader = make_kvstore(
        tmp_path, FakeHostPool("layer_first"), options={**small, "tier_options": NO_WARMUP}
    )
    try:
        assert reader.batch_exists(keys) == 8
        # NVMe reads take DRAM slots as earlier copies free them.
        assert reader.batch_get_v1(keys, indices(8, 8)) == [True] * 8
        loaded = reader.mem_pool_host.pages(8, 8)
        assert all(torch.equal(a, b) for a, b in zip(loaded, source, strict=True))
    finally:
        reader.close()


NO_WARMUP = {"warm_dram_on_open": False}  # the pages stay on NVMe only after the restart
# 1 MB/s from NVMe: a 2 KiB page (v1) takes 2 ms, a 16 KiB one (legacy) 16 ms; their
# 16 tokens of prefill at 1 PFLOP/s take 0.13 ms (llama-3.1-8b's 16 GFLOP per token,
# halved for tp_size=2). The default NVMe (6 GB/s, 0.1 ms) loads them in ~0.11 ms,
# faster than the default 400 TFLOP/s recompute (0.32 ms).
SLOW_DISK = {**NO_WARMUP, "bandwidth_bytes_per_s": {"nvme_read": 1e6}, "compute_flops": 1e15}
RAW = {"page_size": 16, "page_bytes": 16 << 10}  # legacy calls before a host pool


def _store_four(path: Path, via: str) -> list[str]:
    keys = [f"w{i}" for i in range(4)]
    if via == "v1":
        pool = FakeHostPool("page_first")
        writer = make_kvstore(path, pool)
        pool.fill(0, 4, seed=2)
        assert writer.batch_set_v1(keys, indices(0, 4)) == [True] * 4
    else:
        writer = make_kvstore(path, None, options=RAW)
        assert writer.batch_set(keys, [value(i, 4096) for i in range(4)])
    writer.close()
    return keys


def _reopen(path: Path, via: str, tier_options: dict[str, Any]) -> Any:
    if via == "v1":
        return make_kvstore(
            path, FakeHostPool("page_first"), options={"tier_options": tier_options}
        )
    return make_kvstore(path, None, options={**RAW, "tier_options": tier_options})


@pytest.mark.parametrize("via", ["v1", "legacy"])
def test_a_slow_disk_counts_nvme_pages_as_missing(via: str, tmp_path: Path) -> None:
    keys = _store_four(tmp_path, via)
    fast = _reopen(tmp_path, via, NO_WARMUP)
    try:
        assert fast.batch_exists(keys) == 4  # the default NVMe: loading wins
    finally:
        fast.close()
    # (First the fast disk: a manager saves its bandwidth fits at close and the next
    # one starts from them, except for the paths its configuration sets.)
    slow = _reopen(tmp_path, via, SLOW_DISK)
    try:
        assert all(slow.exists(k) for k in keys)  # stored ...
        assert slow.batch_exists(keys) == 0  # ... but recomputing them is faster
        stats = slow.tier_stats()
        assert stats.pages_by_tier[1] == 0 and stats.pages_by_tier[2] > 0
        assert stats.in_flight_bytes.get("nvme_read", 0) == 0  # and no read was started
    finally:
        slow.close()


def test_get_stats_follows_sglang_storage_metrics(
    tmp_path: Path, opened: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    class Metrics:  # StorageMetrics' fields; the real one needs SGLang's server config
        def __init__(self) -> None:
            self.prefetch_pgs: list[int] = []
            self.backup_pgs: list[int] = []
            self.prefetch_bandwidth: list[float] = []
            self.backup_bandwidth: list[float] = []

    monkeypatch.setattr(sglang_backend, "_new_storage_metrics", Metrics)
    pool = FakeHostPool("page_first")
    quiet = make_kvstore(tmp_path / "quiet", pool)
    opened.append(quiet)
    assert quiet.get_stats() is None  # metrics off: SGLang never asks
    backend = make_kvstore(tmp_path / "m", pool, enable_storage_metrics=True)
    opened.append(backend)
    pool.fill(0, 3, seed=4)
    assert backend.batch_set_v1(["m0", "m1", "m2"], indices(0, 3)) == [True] * 3
    assert backend.batch_get_v1(["m0", "m1"], indices(4, 2)) == [True, True]
    metrics = backend.get_stats()
    assert metrics.backup_pgs == [3] and metrics.prefetch_pgs == [2]
    assert all(bw > 0 for bw in metrics.backup_bandwidth + metrics.prefetch_bandwidth)
    assert backend.get_stats().backup_pgs == []  # since the last call
    assert backend.counters()["set:pages_kept"] == 3


def test_a_missing_path_is_refused(tmp_path: Path) -> None:
    extra = kvstore_extra(tmp_path)
    del extra["path"]
    with pytest.raises(ValueError, match="path"):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra), None)


def test_sglang_failure_injector_wraps_kvstore_and_never_gives_wrong_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.5")
    pool = FakeHostPool("page_first")
    backend = make_kvstore(tmp_path, pool)
    try:
        assert type(backend).__name__ == "HiCacheStorageFailureInjector"
        pool.fill(0, 4, seed=9)
        source = pool.pages(0, 4)
        keys = [f"i{i}" for i in range(4)]
        outcomes = [backend.batch_set_v1(keys, indices(0, 4)) for _ in range(20)]
        assert [True] * 4 in outcomes  # injected failures answer [False] * 4
        loads = 0
        for _ in range(20):
            pool.kv_buffer[:, 8 * PAGE_TOKENS :].zero_()
            result = backend.batch_get_v1(keys, indices(8, 4))
            assert result in ([True] * 4, [False] * 4)
            if result[0]:
                loads += 1
                assert all(torch.equal(a, b) for a, b in zip(pool.pages(8, 4), source, strict=True))
        assert loads > 0
    finally:
        backend.close()


def test_the_prefetch_and_backup_threads_can_call_at_once(tmp_path: Path) -> None:
    """SGLang calls batch_get_v1 (prefetch thread) while batch_set_v1 runs (backup)."""
    pool = FakeHostPool("page_first")
    backend = make_kvstore(tmp_path, pool)
    try:
        pool.fill(0, 8, seed=8)
        source = pool.pages(0, 8)
        base = [f"c{i}" for i in range(4)]
        assert backend.batch_set_v1(base, indices(0, 4)) == [True] * 4
        errors: list[str] = []

        def backup() -> None:
            for round_ in range(10):  # new keys each round, from pages 4..7
                keys = [f"n{round_}-{i}" for i in range(4)]
                if backend.batch_set_v1(keys, indices(4, 4)) != [True] * 4:
                    errors.append(f"set round {round_}")

        thread = threading.Thread(target=backup)
        thread.start()
        for round_ in range(10):  # into pages 8..11 (prefetch) while the backup runs
            if backend.batch_get_v1(base, indices(8, 4)) != [True] * 4:
                errors.append(f"get round {round_}")
            elif not all(
                torch.equal(a, b) for a, b in zip(pool.pages(8, 4), source[:4], strict=True)
            ):
                errors.append(f"bytes round {round_}")
        thread.join()
        assert errors == []
        assert backend.batch_exists([f"n9-{i}" for i in range(4)]) == 4
    finally:
        backend.close()


def test_an_mla_model_over_several_tp_ranks_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # SGLang backs MLA pages up from its writer rank only; per-rank stores cannot serve
    # the other ranks, so the backend says so at start.
    with caplog.at_level("WARNING", logger="kvstore.integrations.sglang"):
        make_kvstore(tmp_path / "mha").close()
        assert "MLA" not in caplog.text
        make_kvstore(tmp_path / "mla", is_mla_model=True).close()
    assert "MLA model with tp_size=2" in caplog.text


def test_a_second_live_instance_is_refused_at_creation(tmp_path: Path) -> None:
    """Issue 29 #11: a second live instance on the same store got LockedError on every
    call, first at use, so SGLang's start-up check never saw it. It is refused at
    creation, naming the holder's pid; another rank, or a successor after close, is not."""
    import os

    from kvstore.errors import LockedError

    first = make_kvstore(tmp_path)
    try:
        with pytest.raises(LockedError, match=rf"pid {os.getpid()}\b"):
            StorageBackendFactory.create_backend(
                "dynamic", storage_config(kvstore_extra(tmp_path)), None
            )
        other_rank = make_kvstore(tmp_path, tp_rank=1)
        assert first.set("k", value(1))
        close(other_rank)
    finally:
        close(first)
    successor = make_kvstore(tmp_path)
    try:
        got = successor.get("k", torch.empty(256))
        assert got is not None and torch.equal(got, value(1))
    finally:
        close(successor)


def _node_a_stores_node_b_hits(tmp_path: Path, tier_options: dict[str, Any]) -> None:
    """Node A stores a prefix through its backend; node B (its own store root)
    finds it through the cluster tier: its batch_exists asks the cluster, and once
    the pages landed they are hits with A's bytes."""
    import time

    remote = {"tier_options": {"remote_health_s": 0.05, **tier_options}}
    a = make_kvstore(tmp_path / "a", options=remote)
    b = make_kvstore(tmp_path / "b", options=remote)
    try:
        deadline = time.monotonic() + 20
        for node in (a, b):  # a Mooncake client joins the cluster in the background
            while node._manager().stats().remote["state"] != "up":
                assert time.monotonic() < deadline, node._manager().stats().remote
                time.sleep(0.02)
        keys = [f"prefix{i}" for i in range(5)]
        values = [value(i) for i in range(5)]
        assert a.batch_set(keys, values)
        while a._manager().stats().remote["published"] < 5:
            assert time.monotonic() < deadline, a._manager().stats().remote
            time.sleep(0.02)
        found = b.batch_exists(keys)  # local first: nothing yet; the cluster is asked
        while found < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
            found = b.batch_exists(keys)
        assert found == 5, b._manager().stats().remote
        got = b.batch_get(keys, [torch.empty_like(v) for v in values])
        assert all(g is not None and torch.equal(g, v) for g, v in zip(got, values, strict=True))
        assert b._manager().stats().remote["hits"] >= 5
    finally:
        close(a)
        close(b)


def test_a_prefix_stored_on_node_a_is_a_hit_on_node_b_through_the_cluster_tier(
    tmp_path: Path,
) -> None:
    """Two nodes, each its own store root, sharing the cluster tier (the in-process
    cluster here; a real Mooncake master below)."""
    memory = {"remote_backend": "memory", "remote_options": {"cluster": f"sglang-{tmp_path.name}"}}
    _node_a_stores_node_b_hits(tmp_path, memory)


def test_a_prefix_stored_on_node_a_is_a_hit_on_node_b_through_a_real_mooncake_master(
    tmp_path: Path,
) -> None:
    """The same over loopback on a real Mooncake Store: a mooncake_master on free ports
    (started and stopped here), each node's backend its own Mooncake client. Skips
    where the cluster extra (``mooncake-transfer-engine-non-cuda``) is not installed."""
    from kvstore.tiering.remote_mooncake import mooncake_available

    reason = mooncake_available()
    if reason is not None:
        pytest.skip(reason)
    from kvstore.testing.cluster import running_master

    with running_master(tmp_path / "master.log") as master:
        mooncake = {
            "remote_backend": "mooncake",
            "remote_options": {"master": master.address, "segment_bytes": 16 << 20},
            "remote_deadline_s": 2.0,
        }
        _node_a_stores_node_b_hits(tmp_path, mooncake)

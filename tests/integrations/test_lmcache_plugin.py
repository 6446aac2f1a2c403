"""The kvstore LMCache storage plugin, loaded by LMCache's own CreateStorageBackends (CPU).

Run with the integration environment: .venv-integ/bin/pytest tests/integrations
(tools/setup_integ_env.sh builds it). Without LMCache installed, this module skips.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache.v1.storage_backend", reason="needs lmcache (make integ env)")

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend import CreateStorageBackends

from kvstore import KVStore
from kvstore.integrations.lmcache import KVStoreBackend

REPO = Path(__file__).resolve().parents[2]
MODEL = "kvstore-test/llama"
CHUNK_TOKENS = 16
# [2 (K/V), layers, tokens, hidden]: LMCache's KV_2LTD chunk layout.
CHUNK_SHAPE = torch.Size((2, 4, CHUNK_TOKENS, 256))


def lmcache_config(path: Path) -> Any:
    """The configuration a user writes (LMCache YAML / LMCACHE_* env), as a config object."""
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK_TOKENS,
        local_cpu=True,
        max_local_cpu_size=0.05,
        storage_plugins=["kvstore"],
        extra_config={
            "storage_plugin.kvstore.module_path": "kvstore.integrations.lmcache",
            "storage_plugin.kvstore.class_name": "KVStoreBackend",
            "kvstore.path": str(path),
            "kvstore.segment_bytes": str(8 << 20),  # strings, as from the environment
        },
    )


def metadata(dtype: torch.dtype = torch.bfloat16) -> Any:
    return LMCacheMetadata(
        model_name=MODEL,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=dtype,
        kv_shape=(4, 2, CHUNK_TOKENS, 4, 64),
        chunk_size=CHUNK_TOKENS,
    )


def key(chunk_hash: int, *, model: str = MODEL, world_size: int = 1) -> Any:
    return CacheEngineKey(model, world_size, 0, chunk_hash, torch.bfloat16)


class Backends:
    """What LMCache's storage manager holds: the CPU backend and our plugin."""

    def __init__(self, path: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.all = CreateStorageBackends(lmcache_config(path), metadata(), self.loop)
        self.cpu = self.all["LocalCPUBackend"]
        self.plugin: KVStoreBackend = self.all["kvstore"]

    def chunk(self, seed: int) -> Any:
        obj = self.cpu.allocate(CHUNK_SHAPE, torch.bfloat16, MemoryFormat.KV_2LTD)
        generator = torch.Generator().manual_seed(seed)
        obj.tensor.copy_(torch.randn(CHUNK_SHAPE, generator=generator).to(torch.bfloat16))
        return obj

    def close(self) -> None:
        for backend in reversed(self.all.values()):
            backend.close()
        self.loop.close()


@pytest.fixture
def backends(tmp_path: Path) -> Iterator[Backends]:
    opened = Backends(tmp_path / "kv")
    yield opened
    opened.close()


def put(backends: Backends, keys: list[Any], objs: list[Any]) -> list[Any]:
    done: list[Any] = []
    futures = backends.plugin.batched_submit_put_task(keys, objs, on_complete_callback=done.append)
    for future in futures or []:
        future.result(timeout=60)
    return done


def test_create_storage_backends_loads_the_plugin_and_round_trips_a_chunk(
    backends: Backends,
) -> None:
    assert isinstance(backends.plugin, KVStoreBackend)
    chunk_key = key(0xC0FFEE)
    obj = backends.chunk(1)
    obj.metadata.cached_positions = torch.arange(100, 100 + CHUNK_TOKENS)
    assert not backends.plugin.contains(chunk_key)
    assert put(backends, [chunk_key], [obj]) == [chunk_key]
    assert backends.plugin.contains(chunk_key)
    got = backends.plugin.get_blocking(chunk_key)
    assert got is not None
    assert got.get_shapes() == [CHUNK_SHAPE]
    assert got.get_dtypes() == [torch.bfloat16]
    assert got.get_memory_format() is MemoryFormat.KV_2LTD
    assert torch.equal(got.tensor.view(torch.int16), obj.tensor.view(torch.int16))
    assert torch.equal(got.metadata.cached_positions, torch.arange(100, 100 + CHUNK_TOKENS))
    # Shapes, dtypes and format live in the page's meta.
    meta = backends.plugin.store.info(backends.plugin.page_key(chunk_key)).meta
    assert meta["shapes"] == [list(CHUNK_SHAPE)]
    assert meta["dtypes"] == ["bfloat16"]
    assert meta["fmt"] == "KV_2LTD"
    got.ref_count_down()
    obj.ref_count_down()


def test_chunks_survive_a_restart_in_a_fresh_process(tmp_path: Path) -> None:
    path = tmp_path / "kv"
    first = Backends(path)
    objs = [first.chunk(seed) for seed in range(3)]
    keys = [key(seed) for seed in range(3)]
    put(first, keys, objs)
    expected = [obj.tensor.view(torch.int16).clone() for obj in objs]
    for obj in objs:
        obj.ref_count_down()
    first.close()
    torch.save(expected, tmp_path / "expected.pt")
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), str(tmp_path / "expected.pt")],
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
    assert child.stdout.strip().splitlines()[-1] == "identical 3"


CHILD = """
import sys, torch
from pathlib import Path
from tests.integrations.test_lmcache_plugin import Backends, key
backends = Backends(Path(sys.argv[1]))
expected = torch.load(sys.argv[2])
same = 0
for seed, want in enumerate(expected):
    got = backends.plugin.get_blocking(key(seed))
    same += torch.equal(got.tensor.view(torch.int16), want)
    got.ref_count_down()
backends.close()
print("identical", same)
"""


def test_keys_are_namespaced_by_model_and_layout(backends: Backends) -> None:
    obj = backends.chunk(2)
    put(backends, [key(7)], [obj])
    obj.ref_count_down()
    assert backends.plugin.contains(key(7))
    assert not backends.plugin.contains(key(7, model="another/model"))
    assert not backends.plugin.contains(key(7, world_size=2))


def test_a_key_too_long_for_the_index_is_stored_under_its_hash(backends: Backends) -> None:
    """A model name long enough to push the chunk key past the index's 511 bytes
    used to raise ValueError from put (and, before the key limit, broke every
    checkpoint); it is stored under the SHA-256 of the key text instead."""
    long_model = "org/" + "m" * 600
    obj = backends.chunk(4)
    put(backends, [key(9, model=long_model)], [obj])
    obj.ref_count_down()
    page_key = backends.plugin.page_key(key(9, model=long_model))
    assert page_key.startswith(b"lmcache-sha256/") and len(page_key) <= 511
    assert backends.plugin.contains(key(9, model=long_model))
    assert not backends.plugin.contains(key(9, model=long_model + "x"))
    got = backends.plugin.get_blocking(key(9, model=long_model))
    assert got is not None
    expected = backends.chunk(4)  # the same seed: the same bytes
    assert torch.equal(got.tensor, expected.tensor)
    backends.plugin.store.checkpoint()  # the index takes the key


def test_pin_unpin_and_remove(backends: Backends) -> None:
    plugin = backends.plugin
    obj = backends.chunk(3)
    put(backends, [key(1)], [obj])
    obj.ref_count_down()
    page_key = plugin.page_key(key(1))
    assert plugin.contains(key(1), pin=True)
    assert plugin.store.pin_count(page_key) == 1
    assert not plugin.remove(key(1), force=False)  # pinned: kept
    assert plugin.unpin(key(1))
    assert not plugin.unpin(key(1))  # nothing left to unpin
    assert plugin.pin(key(1)) and plugin.unpin(key(1))
    assert plugin.remove(key(1), force=False)
    assert not plugin.contains(key(1))
    assert plugin.get_blocking(key(1)) is None
    assert not plugin.pin(key(1))


def test_put_is_asynchronous_and_skips_duplicates(backends: Backends) -> None:
    obj = backends.chunk(4)
    futures = backends.plugin.batched_submit_put_task([key(5)], [obj])
    assert futures is not None and len(futures) == 1
    futures[0].result(timeout=60)
    # Already stored: nothing is queued and no callback fires.
    assert backends.plugin.batched_submit_put_task([key(5)], [obj]) is None
    assert obj.get_ref_count() == 1  # the plugin released its reference
    obj.ref_count_down()


def test_batched_get_non_blocking_returns_the_stored_prefix(backends: Backends) -> None:
    objs = [backends.chunk(seed) for seed in (10, 11)]
    put(backends, [key(10), key(11)], objs)
    keys = [key(10), key(11), key(12), key(10)]
    got = backends.loop.run_until_complete(backends.plugin.batched_get_non_blocking("l", keys))
    assert len(got) == 2
    for mine, theirs in zip(got, objs, strict=True):
        assert torch.equal(mine.tensor.view(torch.int16), theirs.tensor.view(torch.int16))
        mine.ref_count_down()
    for obj in objs:
        obj.ref_count_down()
    hits = backends.loop.run_until_complete(backends.plugin.batched_async_contains("l", keys))
    assert hits == 2


def test_missing_path_is_refused(tmp_path: Path) -> None:
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK_TOKENS, extra_config={})
    with pytest.raises(ValueError, match=r"kvstore\.path"):
        KVStoreBackend(config=config, metadata=metadata())
    assert not any(tmp_path.iterdir())


def test_stored_page_is_readable_by_plain_kvstore(tmp_path: Path) -> None:
    path = tmp_path / "kv"
    opened = Backends(path)
    obj = opened.chunk(6)
    put(opened, [key(6)], [obj])
    expected = bytes(obj.byte_array)
    page_key = opened.plugin.page_key(key(6))
    obj.ref_count_down()
    opened.close()
    with KVStore.open(path, readonly=True) as store:
        assert store.get(page_key) == expected
        assert page_key.startswith(b"lmcache/" + MODEL.encode())


def test_a_refused_store_fails_lmcache_start(tmp_path: Path) -> None:
    """LMCache's launcher logs and swallows any Exception from a plugin: a store that
    refuses to open (here: a superblock no header can prove) must stop the start."""
    from kvstore.integrations.lmcache import KVStoreTierRefusedError

    path = tmp_path / "kv"
    Backends(path).close()
    with open(path / "KVSTORE", "r+b") as handle:  # fields and checksum: beyond proof
        handle.seek(48)
        handle.write(b"\xff\xff")
        handle.seek(4090)
        handle.write(b"\xff\xff")
    with pytest.raises(KVStoreTierRefusedError, match="does not start without this tier"):
        Backends(path)


def test_a_degraded_store_warns_and_exports_gauges(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from prometheus_client import REGISTRY, generate_latest

    path = tmp_path / "kv"
    opened = Backends(path)
    objs = [opened.chunk(seed) for seed in range(3)]
    put(opened, [key(seed) for seed in range(3)], objs)
    expected = {seed: bytes(obj.byte_array) for seed, obj in enumerate(objs)}
    for obj in objs:
        obj.ref_count_down()
    opened.close()
    segment = next((path / "segments").iterdir())
    with open(segment, "r+b") as handle:  # one flipped byte in a segment header
        handle.seek(20)
        byte = handle.read(1)
        handle.seek(20)
        handle.write(bytes([byte[0] ^ 0x10]))
    caplog.set_level("WARNING", logger="kvstore.integrations.lmcache")
    reopened = Backends(path)
    try:
        assert "DEGRADED" in caplog.text and str(path) in caplog.text
        assert reopened.plugin.degraded["degraded"] == 1
        assert reopened.plugin.degraded["quarantined_segments"] == 1
        exposition = generate_latest(REGISTRY).decode()
        assert f'kvstore_lmcache_degraded{{path="{path}"}} 1.0' in exposition
        for seed, want in expected.items():  # every chunk still served, verified
            got = reopened.plugin.get_blocking(key(seed))
            assert got is not None and bytes(got.byte_array) == want
            got.ref_count_down()
    finally:
        reopened.close()

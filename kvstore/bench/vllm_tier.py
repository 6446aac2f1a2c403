"""vLLM offloading-tier benchmark: the kvstore tier against vLLM's built-in ``fs`` tier.

Both tiers run under vLLM's own ``TieringOffloadingManager`` (built by
``TieringOffloadingSpec`` from the same ``kv_connector_extra_config`` a server
would get), on the same disk, in the same run:

1. store: ``--chunks`` chunks of random bytes go through the manager's GPU-facing
   path (``prepare_store``, bytes written into the CPU primary tier as the GPU
   worker would, ``complete_store``); the manager cascades each batch to the
   secondary tier. Timed from ``complete_store`` until the tier reports the
   batch done.
2. load: a fresh manager (new engine, empty CPU tier) over the same directory
   looks the chunks up; every lookup misses the CPU tier and promotes from the
   secondary tier. Timed from the lookups until every chunk is a primary HIT.
   Every promoted chunk is compared byte for byte with what was stored.

Both tiers use O_DIRECT where the file system allows it, so loads read the
disk; ``--drop-caches`` (root) also drops the page cache between the phases.

    .venv-integ/bin/python tools/vllm_tier_bench.py --dir /nvme/bench --chunks 2048

The driver functions (``offloading_config``, ``open_manager``, ``store_chunks``,
``load_chunks``) are also what tests/integrations/test_vllm_tier.py uses; ``main`` is
the command line of tools/vllm_tier_bench.py. vLLM is in the integration venv only
(tools/setup_integ_env.sh), so its types are unknown to the type check here.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found]
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (  # type: ignore[import-not-found]
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.manager import (  # type: ignore[import-not-found]
    TieringOffloadingManager,
)
from vllm.v1.kv_offload.tiering.spec import (  # type: ignore[import-not-found]
    TieringOffloadingSpec,
)

from kvstore.bench.common import MIB, drop_page_cache

_STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
Bytes = npt.NDArray[np.uint8]


def kvstore_tier(path: str | os.PathLike[str], **options: Any) -> dict[str, Any]:
    """The ``secondary_tiers`` entry that selects the kvstore tier."""
    return {
        "type": "KVStoreTier",
        "module_path": "kvstore.integrations.vllm",
        "path": str(path),
        **options,
    }


def fs_tier(path: str | os.PathLike[str], **options: Any) -> dict[str, Any]:
    """The ``secondary_tiers`` entry of vLLM's built-in file-system tier."""
    return {"type": "fs", "root_dir": str(path), **options}


def offloading_config(
    tier: dict[str, Any],
    *,
    chunk_bytes: int = MIB,
    primary_chunks: int = 128,
    blocks_per_chunk: int = 4,
    model: str = "kvstore-bench/llama-8b",
    dtype: str = "bfloat16",
    tp_size: int = 1,
    layers: int = 32,
    parallelism_agnostic: bool = False,
    engine_id: str | None = None,
) -> OffloadingConfig:
    """What vLLM's OffloadingConnector builds from ``kv_connector_extra_config``.

    One chunk is ``chunk_bytes`` (``blocks_per_chunk`` blocks, all ranks); the
    CPU primary tier holds ``primary_chunks`` of them.
    """
    if chunk_bytes % (blocks_per_chunk * tp_size * 4096):
        raise ValueError("chunk_bytes must split into page-aligned blocks per rank")
    extra = {
        "cpu_bytes_to_use": primary_chunks * chunk_bytes,
        "secondary_tiers": [tier],
    }
    return OffloadingConfig(
        groups=(
            OffloadingGroupConfig(
                tokens_per_block=16,
                layer_names=tuple(f"model.layers.{i}.self_attn" for i in range(layers)),
                group_id=0,
            ),
        ),
        worker_kv_bytes_per_block=chunk_bytes // blocks_per_chunk // tp_size,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id=engine_id or f"kvbench-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=tp_size,
            tp_size=tp_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=parallelism_agnostic,
        ),
    )


@contextlib.contextmanager
def open_manager(config: OffloadingConfig) -> Iterator[TieringOffloadingManager]:
    """vLLM's own spec builds the manager, the CPU tier and the secondary tier."""
    manager = TieringOffloadingSpec(config).get_manager()
    assert isinstance(manager, TieringOffloadingManager)
    try:
        yield manager
    finally:
        manager.shutdown()


def chunk_key(index: int, group: int = 0) -> OffloadKey:
    """A 32-byte block hash, as vLLM's sha256 prefix hashing makes, plus the KV group."""
    return make_offload_key(hashlib.sha256(index.to_bytes(8, "big")).digest(), group)


def chunk_bytes_for(key: OffloadKey, size: int) -> Bytes:
    """Deterministic random bytes for a chunk, derived from its key."""
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def _locked(manager: TieringOffloadingManager) -> contextlib.AbstractContextManager[Any]:
    """The manager's lock (vLLM 0.33 names it ``lock``; older managers had none)."""
    lock: contextlib.AbstractContextManager[Any] | None = getattr(manager, "lock", None)
    return lock if lock is not None else contextlib.nullcontext()


def _primary(manager: TieringOffloadingManager) -> Bytes:
    return np.asarray(manager.primary_tier.get_kv_memoryview()).view(np.uint8)


def _wait_idle(manager: TieringOffloadingManager, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with _locked(manager):
            manager.on_schedule_end(_STEP)
            if not manager.has_pending_work():
                return
        if time.monotonic() > deadline:
            raise TimeoutError("the secondary tier did not finish its jobs")
        time.sleep(0.0005)


def store_chunks(
    manager: TieringOffloadingManager,
    keys: Sequence[OffloadKey],
    *,
    batch: int = 32,
    fill: Callable[[OffloadKey, int], Bytes] = chunk_bytes_for,
    timeout_s: float = 300.0,
) -> float:
    """Offload ``keys`` through the manager, ``batch`` chunks per request; seconds in the tier.

    Each request: ``prepare_store`` (the CPU tier allocates slots), the chunk
    bytes are written into those slots (what the GPU worker does), then
    ``complete_store`` cascades them to the secondary tier; the clock runs from
    there until the manager has no job in flight.
    """
    primary = _primary(manager)
    row_bytes = primary.shape[1]
    seconds = 0.0
    for start in range(0, len(keys), batch):
        part = list(keys[start : start + batch])
        context = ReqContext(req_id=f"store-{start}")
        with _locked(manager):
            manager.on_new_request(context)
            prepared = manager.prepare_store(part, context)
            if prepared is None:
                raise RuntimeError("the CPU tier could not take the batch; raise primary_chunks")
            for key, chunk_id in zip(
                prepared.keys_to_store, prepared.store_spec.chunk_ids, strict=True
            ):
                primary[chunk_id, :] = fill(key, row_bytes)
            began = time.perf_counter()
            manager.complete_store(part, context)
            manager.on_request_finished(context)
        _wait_idle(manager, timeout_s)
        seconds += time.perf_counter() - began
    return seconds


def load_chunks(
    manager: TieringOffloadingManager,
    keys: Sequence[OffloadKey],
    *,
    batch: int = 32,
    check: Callable[[OffloadKey, int], Bytes] | None = chunk_bytes_for,
    timeout_s: float = 300.0,
) -> tuple[float, int]:
    """Promote ``keys`` into the CPU tier, ``batch`` per request; (seconds, chunks that differ).

    A chunk that the tier does not have raises ``KeyError``. With ``check``,
    every promoted chunk is compared with ``check(key, size)``.
    """
    primary = _primary(manager)
    row_bytes = primary.shape[1]
    seconds = 0.0
    mismatches = 0
    for start in range(0, len(keys), batch):
        part = list(keys[start : start + batch])
        context = ReqContext(req_id=f"load-{start}")
        began = time.perf_counter()
        with _locked(manager):
            manager.on_new_request(context)
        deadline = time.monotonic() + timeout_s
        while True:
            with _locked(manager):
                results = [manager.lookup(key, context) for key in part]
                manager.on_schedule_end(_STEP)
            if all(result is LookupResult.HIT for result in results):
                break
            missing = [key for key, r in zip(part, results, strict=True) if r is LookupResult.MISS]
            if missing:
                raise KeyError(f"{len(missing)} chunks missing, first {missing[0].hex()}")
            if time.monotonic() > deadline:
                raise TimeoutError("promotion did not finish")
            time.sleep(0.0005)
        seconds += time.perf_counter() - began
        with _locked(manager):
            spec = manager.prepare_load(part, context)
            if check is not None:
                for key, chunk_id in zip(part, spec.chunk_ids, strict=True):
                    if not np.array_equal(primary[chunk_id], check(key, row_bytes)):
                        mismatches += 1
            manager.complete_load(part, context)
            manager.on_request_finished(context)
    return seconds, mismatches


def bench_tier(
    name: str, tier: dict[str, Any], keys: Sequence[OffloadKey], args: argparse.Namespace
) -> dict[str, Any]:
    common = {"chunk_bytes": args.chunk_mib * MIB, "primary_chunks": 2 * args.batch}
    with open_manager(offloading_config(tier, **common)) as manager:
        store_s = store_chunks(manager, keys, batch=args.batch)
    dropped = drop_page_cache() if args.drop_caches else False
    with open_manager(offloading_config(tier, **common)) as manager:
        load_s, mismatches = load_chunks(manager, keys, batch=args.batch)
    total = len(keys) * args.chunk_mib * MIB
    return {
        "tier": name,
        "chunks": len(keys),
        "chunk_mib": args.chunk_mib,
        "store_s": round(store_s, 3),
        "store_gbps": round(total / store_s / 1e9, 3),
        "load_s": round(load_s, 3),
        "load_gbps": round(total / load_s / 1e9, 3),
        "mismatched_chunks": mismatches,
        "page_cache_dropped": dropped,
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, type=Path, help="scratch directory on the disk")
    parser.add_argument("--chunks", type=int, default=1024)
    parser.add_argument("--chunk-mib", type=int, default=1, help="bytes per chunk, in MiB")
    parser.add_argument("--batch", type=int, default=32, help="chunks per request")
    parser.add_argument("--threads", type=int, default=8, help="I/O threads of each tier")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--drop-caches", action="store_true", help="drop the page cache (root)")
    parser.add_argument("--json", action="store_true", help="print JSON lines only")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    keys = [chunk_key(index) for index in range(args.chunks)]
    tiers: dict[str, Callable[[Path], dict[str, Any]]] = {
        "kvstore": lambda d: kvstore_tier(d, io_threads=args.threads),
        "kvstore sync_stores": lambda d: kvstore_tier(d, io_threads=args.threads, sync_stores=True),
        "vllm fs": lambda d: fs_tier(d, n_read_threads=args.threads, n_write_threads=args.threads),
    }
    rows = []
    failed = False
    for repeat in range(args.repeats):
        for name, make in tiers.items():
            directory = args.dir / f"{name.replace(' ', '-')}-{repeat}"
            shutil.rmtree(directory, ignore_errors=True)
            row = bench_tier(name, make(directory), keys, args)
            row["repeat"] = repeat
            rows.append(row)
            failed = failed or row["mismatched_chunks"] > 0
            shutil.rmtree(directory, ignore_errors=True)
            if args.json:
                print(json.dumps(row), flush=True)
    if not args.json:
        print(
            f"{'tier':<22}{'chunks':>8}{'MiB':>5}{'store s':>10}{'store GB/s':>12}"
            f"{'load s':>9}{'load GB/s':>11}{'bad':>5}"
        )
        for row in rows:
            print(
                f"{row['tier']:<22}{row['chunks']:>8}{row['chunk_mib']:>5}{row['store_s']:>10}"
                f"{row['store_gbps']:>12}{row['load_s']:>9}{row['load_gbps']:>11}"
                f"{row['mismatched_chunks']:>5}"
            )
        print(f"page cache dropped between store and load: {rows[0]['page_cache_dropped']}")
    return 1 if failed else 0

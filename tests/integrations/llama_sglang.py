"""The real-model KV round trip through kvstore's SGLang HiCache backend, run as
separate processes by test_llama_sglang.py.

    python llama_sglang.py save NVME WORKDIR
        build the model of llama_roundtrip.py, prefill the first 40 tokens of its
        prompt and decode (the reference logits go to WORKDIR/LAYOUT/reference.pt,
        one copy per layout); then, per host pool layout (``page_first``,
        ``layer_first``), do what SGLang's HiCache does with a computed prompt: the
        device KV goes into host pool pages (here: each layer's K and V, written the
        way SGLang's host pool holds them), and the backup thread hands those pages
        to the L3 backend with ``batch_set_v1(keys, host_indices)``, keyed by
        SGLang's own page hash chain; wait until every part is on NVMe, close.
    python llama_sglang.py restore NVME WORKDIR
        a fresh process, per layout a fresh backend on the same path and a fresh
        NaN-filled host pool: ``batch_exists`` (SGLang's prefetch query),
        ``batch_get_v1`` into other host pages, then the KV is read back out of the
        host pool as a DynamicCache; decode the same tokens (WORKDIR/LAYOUT/restored.pt,
        with the no-cache control of llama_roundtrip.py) and record what the backend
        answered (WORKDIR/restored.json).

Pages: SGLang stores only full pages and the 41-token prompt is prime, so the
prompt here is its first 40 tokens, 5 pages of 8 tokens, every token restored (no
tail to recompute). Each backend is built as SGLang's cache controller builds an L3
backend: ``StorageBackendFactory.create_backend("dynamic", ...)``, then
``register_mem_pool_host``. The host pool is sglang_host_pool's ``FakeHostPool``
(SGLang's own needs a GPU build), in bf16 with the model's geometry.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found]
    HiCacheStorageConfig,
)
from sglang.srt.mem_cache.storage import (  # type: ignore[import-not-found]
    StorageBackendFactory,
)
from sglang.srt.mem_cache.utils import get_hash_str  # type: ignore[import-not-found]
from transformers import DynamicCache, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama_roundtrip import DTYPE, build_model, decode, prefill, prompt
from llama_tiering import model_cost
from sglang_host_pool import FakeHostPool

PAGE_TOKENS = 8
PAGES = 5
TOKENS = PAGE_TOKENS * PAGES  # the prompt's first 40 tokens
HOST_PAGES = 16
LAYOUTS = ("page_first", "layer_first")
# Host pages, not in order, as SGLang's host allocator hands them out; the restore
# loads into other ones.
SAVE_PAGES = (3, 7, 1, 12, 5)
RESTORE_PAGES = (10, 2, 14, 6, 0)


def host_indices(pages: tuple[int, ...]) -> torch.Tensor:
    """SGLang's host indices: page_size token slots per page."""
    return torch.cat([torch.arange(p * PAGE_TOKENS, (p + 1) * PAGE_TOKENS) for p in pages])


def page_keys(ids: torch.Tensor) -> list[str]:
    """SGLang's storage keys: its chained hash of each page's token ids."""
    keys = get_hash_str(ids[0].tolist(), None, PAGE_TOKENS)
    assert isinstance(keys, list) and len(keys) == PAGES
    return keys


def host_pool(model: LlamaForCausalLM, layout: str) -> FakeHostPool:
    config = model.config
    return FakeHostPool(
        layout,
        DTYPE,
        layers=config.num_hidden_layers,
        heads=config.num_key_value_heads or config.num_attention_heads,
        head_dim=config.hidden_size // config.num_attention_heads,
        page_tokens=PAGE_TOKENS,
        pages=HOST_PAGES,
    )


def open_backend(nvme: str, pool: FakeHostPool, model: LlamaForCausalLM) -> Any:
    """An L3 backend as SGLang's cache controller builds one (one TP rank)."""
    extra = {
        "backend_name": "kvstore",
        "module_path": "kvstore.integrations.sglang",
        "class_name": "KVStoreHiCache",
        "interface_v1": 1,
        "path": nvme,
        "dram_bytes": 1 << 20,
        "store_options": {"segment_bytes": 1 << 20, "gc_interval_s": 0},
        "model": dataclasses.asdict(model_cost(model)),
        "tier_options": {
            "probe_at_open": False,
            "compute_flops": 1e3,  # loading beats recomputing this tiny model
            "warm_dram_on_open": False,  # after the restart the pages are on NVMe only
        },
    }
    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=pool.layout == "page_first",
        model_name="llama-sglang-test",
        extra_config=extra,
    )
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)  # as cache_controller.py does right after
    return backend


def token_slots(pool: FakeHostPool, part: int, layer: int, indices: torch.Tensor) -> Any:
    """The (kv_buffer index) of K (part 0) or V (part 1) of a layer at token slots."""
    if pool.layout == "page_first":
        return (part, indices, layer)
    return (part, layer, indices)


def put_cache(pool: FakeHostPool, cache: DynamicCache, indices: torch.Tensor) -> None:
    """The device-to-host backup: each layer's K and V at the host token slots."""
    for layer, kv in enumerate(cache.layers):
        for part, states in enumerate((kv.keys, kv.values)):
            # (1, heads, tokens, head_dim) -> the host pool's (tokens, heads, head_dim)
            pool.kv_buffer[token_slots(pool, part, layer, indices)] = states[0].transpose(0, 1)


def take_cache(pool: FakeHostPool, model: LlamaForCausalLM, indices: torch.Tensor) -> DynamicCache:
    """The host-to-device load: a DynamicCache from the host token slots."""
    cache = DynamicCache(config=model.config)
    for layer in range(pool.layer_num):
        k, v = (
            pool.kv_buffer[token_slots(pool, part, layer, indices)]
            .transpose(0, 1)
            .unsqueeze(0)
            .contiguous()
            for part in (0, 1)
        )
        cache.update(k, v, layer)
    return cache


def parts_per_page(pool: FakeHostPool) -> int:
    """Tier manager pages per SGLang page: K and V, per layer for layer_first."""
    return 2 * (pool.layer_num if pool.layout == "layer_first" else 1)


def save(nvme: str, workdir: Path) -> None:
    model = build_model()
    ids = prompt()[:, :TOKENS]
    cache, first_token = prefill(model, ids)
    pools = [host_pool(model, layout) for layout in LAYOUTS]
    for pool in pools:
        put_cache(pool, cache, host_indices(SAVE_PAGES))
    reference = decode(model, cache, first_token)
    for layout in LAYOUTS:
        (workdir / layout).mkdir(exist_ok=True)
        torch.save(
            {"logits": reference, "first_token": first_token}, workdir / layout / "reference.pt"
        )
    keys = page_keys(ids)
    for pool in pools:
        backend = open_backend(nvme, pool, model)
        try:
            kept = backend.batch_set_v1(keys, host_indices(SAVE_PAGES))
            if kept != [True] * PAGES:
                raise RuntimeError(f"{pool.layout}: the backend kept {kept}")
            parts = PAGES * parts_per_page(pool)
            deadline = time.monotonic() + 30
            while backend.tier_stats().pages_by_tier[2] != parts:  # the write-through
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{pool.layout}: {backend.tier_stats().pages_by_tier}")
                time.sleep(0.01)
        finally:
            backend.close()
    print("on nvme", flush=True)


def restore(nvme: str, workdir: Path) -> None:
    model = build_model()
    keys = page_keys(prompt()[:, :TOKENS])
    indices = host_indices(RESTORE_PAGES)
    seen: dict[str, Any] = {}
    for layout in LAYOUTS:
        first_token = torch.load(workdir / layout / "reference.pt")["first_token"]
        pool = host_pool(model, layout)
        pool.kv_buffer.fill_(math.nan)
        backend = open_backend(nvme, pool, model)
        try:
            at_open = list(backend.tier_stats().pages_by_tier)
            exists = backend.batch_exists(keys)
            got = backend.batch_get_v1(keys, indices)
        finally:
            backend.close()
        others = [p for p in range(HOST_PAGES) if p not in RESTORE_PAGES]
        untouched = all(pool.get_data_page(p * PAGE_TOKENS).isnan().all() for p in others)
        cache = take_cache(pool, model, indices)
        restored = decode(model, cache, first_token)
        no_cache = decode(model, DynamicCache(config=model.config), first_token)
        torch.save(
            {"logits": restored, "no_cache_logits": no_cache}, workdir / layout / "restored.pt"
        )
        seen[layout] = {
            "parts_per_page": parts_per_page(pool),
            "pages_by_tier_at_open": at_open,
            "batch_exists": exists,
            "batch_get_v1": got,
            "other_host_pages_untouched": untouched,
        }
    (workdir / "restored.json").write_text(json.dumps(seen))


def main() -> int:
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "restore"])
    parser.add_argument("nvme")
    parser.add_argument("workdir", type=Path)
    args = parser.parse_args()
    if args.mode == "save":
        save(args.nvme, args.workdir)
    else:
        restore(args.nvme, args.workdir)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())

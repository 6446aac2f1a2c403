"""The real-model KV round trip through the vLLM spec's scheduler-side manager, run
as separate processes by test_llama_vllm_spec.py.

    python llama_vllm_spec.py save NVME WORKDIR ENGINE_ID
        build the model of llama_roundtrip.py, prefill its prompt and decode (the
        reference logits go to WORKDIR/reference.pt); then do what vLLM does with a
        computed prompt under ``KVStoreOffloadingSpec``: ``prepare_store`` gives
        staging chunks, the worker's copy fills them (here: each layer's K and V,
        one chunk per layer), ``complete_store`` hands them to the tier manager,
        which writes them through to NVMe; close.
    python llama_vllm_spec.py restore NVME WORKDIR ENGINE_ID
        a fresh process, a fresh manager on the same NVMe path: ``lookup`` answers
        HIT_PENDING while the NVMe reads land, HIT at the next step; ``prepare_load``
        copies the chunks into staging, from which the KV is rebuilt as a
        DynamicCache; decode the same tokens (WORKDIR/restored.pt) and record the
        answers (WORKDIR/restored.json).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import torch
from transformers import DynamicCache
from vllm.v1.kv_offload.base import ReqContext

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama_roundtrip import DTYPE, PROMPT_TOKENS, build_model, decode, prefill, prompt
from llama_tiering import model_cost

from kvstore.integrations.vllm import KVStoreOffloadingManager
from kvstore.integrations.vllm_worker import StagingRegion
from kvstore.tiering import ModelCost, TierConfig, TierManager

# One layer's K and V (2 x 2 KV heads x 41 tokens x 32 dims x 2 bytes = 10,496 bytes)
# in a 4 KiB-aligned chunk, as vLLM pads its chunks.
KV_BYTES = 10496
CHUNK_BYTES = 16384


def open_manager(
    nvme: str, engine_id: str, layers: int, cost: ModelCost
) -> KVStoreOffloadingManager:
    config = TierConfig(
        device="cpu",
        hbm="owned",
        hbm_bytes=0,
        dram_bytes=8 * CHUNK_BYTES,
        page_bytes=CHUNK_BYTES,
        tokens_per_page=PROMPT_TOKENS,
        nvme_path=nvme,
        nvme_options={"segment_bytes": 1 << 20, "gc_interval_s": 0},
        model=cost,
        compute_flops=1e3,  # loading beats recomputing
        admission="all",
        placement="write_through",
        warm_dram_on_open=False,
        probe_at_open=False,
    )
    return KVStoreOffloadingManager(
        TierManager.open(config),
        StagingRegion(engine_id, 2 * layers, CHUNK_BYTES),
        prefix=b"llama/",
        tokens_per_chunk=PROMPT_TOKENS,
    )


def chunk_keys(ids: torch.Tensor, layers: int) -> list[bytes]:
    """vLLM's OffloadKeys: a chained hash per chunk, then the KV group (0)."""
    keys = []
    parent = hashlib.sha256(b"llama-vllm/" + ids.numpy().tobytes()).digest()
    for layer in range(layers):
        parent = hashlib.sha256(parent + b"layer%d" % layer).digest()
        keys.append(parent + (0).to_bytes(4, "big"))
    return keys


def request(req_id: str, keys: list[bytes]) -> ReqContext:
    ctx = ReqContext(req_id=req_id)
    for index, key in enumerate(keys):
        ctx.set_offload_key_position(key, (index + 1) * PROMPT_TOKENS)
    return ctx


def save(nvme: str, workdir: Path, engine_id: str) -> None:
    model = build_model()
    ids = prompt()
    cache, first_token = prefill(model, ids)
    chunks = [
        torch.cat([layer.keys.contiguous().view(-1), layer.values.contiguous().view(-1)])
        .view(torch.uint8)
        .clone()
        for layer in cache.layers
    ]
    reference = decode(model, cache, first_token)
    torch.save({"logits": reference, "first_token": first_token}, workdir / "reference.pt")
    keys = chunk_keys(ids, len(chunks))
    manager = open_manager(nvme, engine_id, len(chunks), model_cost(model))
    ctx = request("save", keys)
    manager.on_new_request(ctx)
    out_spec = manager.prepare_store(keys, ctx)
    assert out_spec is not None and out_spec.keys_to_store == keys
    for data, chunk in zip(chunks, out_spec.store_spec.block_ids, strict=True):
        manager._staging.chunk(int(chunk))[: data.numel()].copy_(data)  # the worker's copy
    manager.complete_store(keys, ctx)
    manager.on_request_finished(ctx)
    manager.on_schedule_end()
    if not manager.tm.drain():
        raise RuntimeError("the write-through did not finish")
    on_nvme = manager.tm.stats().pages_by_tier[2]
    if on_nvme != len(keys):
        raise RuntimeError(f"{on_nvme} of {len(keys)} chunks reached NVMe")
    manager.shutdown()
    print("on nvme", flush=True)


def restore(nvme: str, workdir: Path, engine_id: str) -> None:
    model = build_model()
    saved = torch.load(workdir / "reference.pt")
    config = model.config
    layers = config.num_hidden_layers
    head_dim = config.hidden_size // config.num_attention_heads
    shape = (1, config.num_key_value_heads or config.num_attention_heads, PROMPT_TOKENS, head_dim)
    keys = chunk_keys(prompt(), layers)
    manager = open_manager(nvme, engine_id, layers, model_cost(model))
    try:
        ctx = request("restore", keys)
        manager.on_new_request(ctx)
        first = [manager.lookup(k, ctx).name for k in keys]
        manager.on_schedule_end()  # the step ends; the NVMe reads land meanwhile
        if not manager.tm.drain():
            raise RuntimeError("the NVMe reads did not finish")
        manager.tm.step()
        second = [manager.lookup(k, ctx).name for k in keys]
        spec = manager.prepare_load(keys, ctx)
        staged = [manager._staging.chunk(int(c)).clone() for c in spec.block_ids]
        manager.complete_load(keys, ctx)
        manager.on_schedule_end()
    finally:
        manager.shutdown()
    cache = DynamicCache(config=config)
    half = KV_BYTES // 2
    for layer, data in enumerate(staged):
        k = data[:half].view(DTYPE).view(shape)
        v = data[half:KV_BYTES].view(DTYPE).view(shape)
        cache.update(k, v, layer)
    restored = decode(model, cache, saved["first_token"])
    no_cache = decode(model, DynamicCache(config=config), saved["first_token"])
    torch.save({"logits": restored, "no_cache_logits": no_cache}, workdir / "restored.pt")
    (workdir / "restored.json").write_text(json.dumps({"first": first, "second": second}))


def main() -> int:
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "restore"])
    parser.add_argument("nvme")
    parser.add_argument("workdir", type=Path)
    parser.add_argument("engine_id")
    args = parser.parse_args()
    if args.mode == "save":
        save(args.nvme, args.workdir, args.engine_id)
    else:
        restore(args.nvme, args.workdir, args.engine_id)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())

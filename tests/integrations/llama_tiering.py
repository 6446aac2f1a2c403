"""The real-model KV round trip through the tier manager, run as separate processes
by test_llama_tiering.py.

    python llama_tiering.py save NVME WORKDIR [--hold]
        build the model of llama_roundtrip.py, prefill its prompt, decode greedily
        (the uninterrupted run; its logits go to WORKDIR/reference.pt), offer every
        layer's K and V as of the prefill to a TierManager as pages with chained keys,
        step it until every page is written back to NVMe, flush the store and print
        "on nvme". With --hold it then waits to be killed (SIGKILL by the test);
        without it, it closes the manager and exits.
    python llama_tiering.py restore NVME WORKDIR
        in a fresh process, open a TierManager on the same NVMe path (the forest comes
        back from the pages' meta), look the chain up, load it into fresh NaN-filled
        tensors, rebuild the DynamicCache, decode the same tokens and write the logits
        to WORKDIR/restored.pt (with the no-cache control of llama_roundtrip.py), and
        what the manager saw to WORKDIR/restored.json.

The model, prompt and decode are llama_roundtrip.py's: the same seed gives the same
weights in both processes, one intra-op thread keeps the float reductions in order.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama_roundtrip import DTYPE, PROMPT_TOKENS, build_model, decode, prefill, prompt

from kvstore.tiering import LookupState, ModelCost, TierConfig, TierManager

PAGE_BYTES = 8192  # one layer's K (or V): 2 KV heads x 41 tokens x 32 dims x 2 bytes


def tier_config(nvme: str, model: ModelCost) -> TierConfig:
    """No HBM, a DRAM of eight pages with low watermarks (step() pushes every page
    down to NVMe), and a compute rate so low that loading always beats recomputing."""
    return TierConfig(
        device="cpu",
        hbm="owned",
        hbm_bytes=0,
        dram_bytes=8 * PAGE_BYTES,
        page_bytes=PAGE_BYTES,
        tokens_per_page=PROMPT_TOKENS,
        nvme_path=nvme,
        nvme_options={"segment_bytes": 1 << 20, "gc_interval_s": 0},
        model=model,
        compute_flops=1e3,
        admission="all",
        hysteresis_s=0.0,
        watermark_low=0.01,
        watermark_warn=0.02,
        watermark_force=0.03,
        probe_at_open=False,
        control_interval_s=0.0,  # this script steps the manager
    )


def model_cost(model: LlamaForCausalLM) -> ModelCost:
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    layers = config.num_hidden_layers
    kv_heads = config.num_key_value_heads or config.num_attention_heads
    kv_bytes = 2 * layers * kv_heads * head_dim * torch.finfo(DTYPE).bits // 8
    n_params = sum(p.numel() for p in model.parameters())
    return ModelCost(float(n_params), layers, config.num_attention_heads, head_dim, kv_bytes)


def page_labels(layers: int) -> list[str]:
    return [f"layer{layer}/{part}" for layer in range(layers) for part in ("k", "v")]


def chained_keys(ids: torch.Tensor, layers: int) -> list[bytes]:
    """Each page's key hashes its parent's key with its own label, the first the
    prompt's tokens: the engine's chained block hashes, one chain per prompt."""
    keys = []
    parent = hashlib.sha256(b"llama-tiering/" + ids.numpy().tobytes()).digest()
    for label in page_labels(layers):
        parent = hashlib.sha256(parent + label.encode()).digest()
        keys.append(parent)
    return keys


def save(nvme: str, workdir: Path, hold: bool) -> None:
    model = build_model()
    ids = prompt()
    cache, first_token = prefill(model, ids)
    pages: list[torch.Tensor] = []
    for layer in cache.layers:
        pages += [layer.keys.clone().contiguous(), layer.values.clone().contiguous()]
    reference = decode(model, cache, first_token)
    torch.save({"logits": reference, "first_token": first_token}, workdir / "reference.pt")
    keys = chained_keys(ids, len(cache.layers))
    tm = TierManager.open(tier_config(nvme, model_cost(model)))
    offered = tm.offer(keys, pages)  # parents: each key's predecessor, the first a root
    if offered.admitted != len(keys):
        raise RuntimeError(f"the manager declined pages: {offered.reasons}")
    if not offered.hbm_release.wait(30):
        raise RuntimeError("the offer's copies did not finish")
    # Step until every page has been written back (DRAM may keep clean copies: this
    # process's DRAM is lost with it, and the restore reads NVMe).
    deadline = time.monotonic() + 60
    while tm.stats().pages_by_tier[2] != len(keys):
        if time.monotonic() > deadline:
            raise RuntimeError(f"pages did not reach NVMe: {tm.stats().pages_by_tier}")
        tm.step()
        tm.drain()
    missing = [k.hex() for k in keys if tm.store.info(k) is None]
    if missing:
        raise RuntimeError(f"the manager counts pages on NVMe the store lacks: {missing}")
    tm.store.flush()  # the write-backs' put_many are durable from here on
    print("on nvme", flush=True)
    if hold:
        while True:  # the test kills us here: no close(), no statistics saved
            time.sleep(1)
    tm.close()


def restore(nvme: str, workdir: Path) -> None:
    model = build_model()
    saved = torch.load(workdir / "reference.pt")
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    shape = (1, config.num_key_value_heads or config.num_attention_heads, PROMPT_TOKENS, head_dim)
    layers = config.num_hidden_layers
    keys = chained_keys(prompt(), layers)
    with TierManager.open(tier_config(nvme, model_cost(model))) as tm:
        rebuilt = tm.stats().pages_by_tier
        result = tm.lookup(keys, tokens=PROMPT_TOKENS)
        dst = [torch.full(shape, float("nan"), dtype=DTYPE) for _ in keys]
        handle = tm.prepare_load(result.plan, dst[: result.plan.load_pages])
        if not handle.wait(60):
            raise RuntimeError("the load did not finish")
        loaded = tm.complete_load(handle)
    cache = DynamicCache(config=config)
    for layer in range(layers):
        cache.update(dst[2 * layer], dst[2 * layer + 1], layer)
    restored = decode(model, cache, saved["first_token"])
    no_cache = decode(model, DynamicCache(config=config), saved["first_token"])
    torch.save({"logits": restored, "no_cache_logits": no_cache}, workdir / "restored.pt")
    seen = {
        "rebuilt_by_tier": list(rebuilt),
        "state": result.state.name,
        "hit_pages": result.hit_pages,
        "pages_by_tier": list(result.pages_by_tier),
        "load_pages": result.plan.load_pages,
        "reason": result.plan.reason,
        "loaded": loaded,
        "ready_or_pending": result.state in (LookupState.READY, LookupState.PENDING),
    }
    (workdir / "restored.json").write_text(json.dumps(seen))


def main() -> int:
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "restore"])
    parser.add_argument("nvme")
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--hold", action="store_true")
    args = parser.parse_args()
    if args.mode == "save":
        save(args.nvme, args.workdir, args.hold)
    else:
        restore(args.nvme, args.workdir)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())

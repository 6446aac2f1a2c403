"""The real-model KV round trip, run as separate processes by test_llama_roundtrip.py.

    python llama_roundtrip.py save STORE WORKDIR [--hold]
        build the model, prefill PROMPT, decode DECODE_TOKENS greedily (the
        uninterrupted run; its logits go to WORKDIR/reference.pt), save every
        layer's K/V as of the prefill through TensorIO, flush the store, print
        "flushed". With --hold it then waits to be killed (SIGKILL by the test);
        without it, it closes the store and exits.
    python llama_roundtrip.py restore STORE WORKDIR
        build the same model in a fresh process, load the K/V pages into a
        DynamicCache, decode the same tokens, write the logits to
        WORKDIR/restored.pt (with, as a control, the logits of the same decode
        without the restored cache).

The model is a randomly initialised LlamaForCausalLM from a LlamaConfig (no
download); the same seed gives the same weights in both processes. One
intra-op thread in both keeps the float reductions in the same order.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvstore import KVStore
from kvstore.gpu import TensorIO

SEED = 1234
PROMPT_TOKENS = 41
DECODE_TOKENS = 6
DTYPE = torch.bfloat16


def build_model() -> LlamaForCausalLM:
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(config).to(DTYPE).eval()
    return model


def prompt() -> torch.Tensor:
    generator = torch.Generator().manual_seed(SEED + 1)
    return torch.randint(0, 512, (1, PROMPT_TOKENS), generator=generator)


def page_keys(layer: int) -> tuple[str, str]:
    return f"llama-test/layer{layer}/k", f"llama-test/layer{layer}/v"


def decode(model: LlamaForCausalLM, cache: DynamicCache, first_token: torch.Tensor) -> torch.Tensor:
    """Greedy decode; returns the logits of every step, stacked."""
    token = first_token
    steps = []
    with torch.no_grad():
        for _ in range(DECODE_TOKENS):
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1, :]
            steps.append(logits.clone())
            token = logits.argmax(dim=-1, keepdim=True)
    return torch.stack(steps)


def prefill(model: LlamaForCausalLM, ids: torch.Tensor) -> tuple[DynamicCache, torch.Tensor]:
    """The prompt's KV cache and the first greedy token after it."""
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    return out.past_key_values, out.logits[:, -1, :].argmax(dim=-1, keepdim=True)


def save(store_path: str, workdir: Path, hold: bool) -> None:
    model = build_model()
    ids = prompt()
    cache, first_token = prefill(model, ids)
    keys: list[str] = []
    tensors: list[torch.Tensor] = []
    for index, layer in enumerate(cache.layers):
        key_name, value_name = page_keys(index)
        keys += [key_name, value_name]
        tensors += [layer.keys.clone().contiguous(), layer.values.clone().contiguous()]
    # The uninterrupted run, continuing from the very cache object of the prefill.
    reference = decode(model, cache, first_token)
    torch.save({"logits": reference, "first_token": first_token}, workdir / "reference.pt")
    store = KVStore.open(store_path, create=True)
    with TensorIO(store, "cpu") as tio:
        tio.save(keys, tensors).wait()
    store.flush()
    print("flushed", flush=True)
    if hold:
        while True:  # the test kills us here, after flush(), before close()
            time.sleep(1)
    store.close()


def restore(store_path: str, workdir: Path) -> None:
    model = build_model()
    saved = torch.load(workdir / "reference.pt")
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    shape = (1, config.num_key_value_heads, PROMPT_TOKENS, head_dim)
    cache = DynamicCache(config=config)
    with KVStore.open(store_path) as store, TensorIO(store, "cpu") as tio:
        for index in range(config.num_hidden_layers):
            key_states = torch.full(shape, float("nan"), dtype=DTYPE)
            value_states = torch.full(shape, float("nan"), dtype=DTYPE)
            tio.load(list(page_keys(index)), [key_states, value_states]).wait()
            cache.update(key_states, value_states, index)
    restored = decode(model, cache, saved["first_token"])
    # A control: the same decode with no prefix cache, which must not match.
    no_cache = decode(model, DynamicCache(config=config), saved["first_token"])
    torch.save({"logits": restored, "no_cache_logits": no_cache}, workdir / "restored.pt")


def main() -> int:
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "restore"])
    parser.add_argument("store")
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--hold", action="store_true")
    args = parser.parse_args()
    if args.mode == "save":
        save(args.store, args.workdir, args.hold)
    else:
        restore(args.store, args.workdir)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())

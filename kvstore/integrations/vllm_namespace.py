"""The namespace of a vLLM chunk: what its bytes depend on besides its token-prefix
hash, and the short hash of that.

Shared by the secondary tier (kvstore/integrations/vllm.py) and the offloading
spec (kvstore/integrations/vllm_spec.py); below both, so neither imports the
other for it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec  # type: ignore[import-not-found]

__all__ = ["namespace_fields", "namespace_of"]

_NAMESPACE_HEX = 16


def namespace_fields(
    offloading_spec: OffloadingSpec, chunk_bytes: int, *, share_across_layouts: bool = False
) -> dict[str, Any]:
    """What a chunk's bytes depend on, besides its token-prefix hash.

    The parallel layout (tp/pp/pcp/dcp and world size) is part of it unless
    ``share_across_layouts`` is set and vLLM certifies the bytes as
    parallelism-agnostic (``OffloadingParallelConfig.is_parallelism_agnostic``).
    """
    config = offloading_spec.config
    parallel = config.parallel
    fields: dict[str, Any] = {
        "engine": "vllm",
        "model": config.model.name,
        "dtype": str(config.model.dtype),
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "chunk_bytes": chunk_bytes,
        "kv_cache_groups": [
            {"tokens_per_block": group.tokens_per_block, "layer_names": list(group.layer_names)}
            for group in config.groups
        ],
        "kv_cache_layout": config.kv_cache_layout,
        "canonical_layout": bool(config.canonical_layout),
        "replicated_layout": bool(config.replicated_layout),
    }
    if not (share_across_layouts and parallel.is_parallelism_agnostic):
        fields["parallel"] = {
            "world_size": parallel.world_size,
            "tp_size": parallel.tp_size,
            "pp_size": parallel.pp_size,
            "pcp_size": parallel.pcp_size,
            "dcp_size": parallel.dcp_size,
        }
    return fields


def namespace_of(fields: Mapping[str, Any]) -> str:
    """The namespace's name: a short hash of ``fields``, canonical JSON."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:_NAMESPACE_HEX]

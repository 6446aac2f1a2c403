"""Adapters that let serving engines use a KVStore through their own configuration.

- ``kvstore.integrations.vllm``: ``KVStoreTier``, a vLLM (0.31 - 0.33) offloading
  secondary tier, selected by ``TieringOffloadingSpec`` configuration alone.
- ``kvstore.integrations.lmcache``: ``KVStoreBackend``, an LMCache (0.4.4 - 0.5.6)
  storage plugin, selected by ``storage_plugins`` + ``extra_config``.
- ``kvstore.integrations.sglang``: ``KVStoreHiCache``, an SGLang (0.5.23) HiCache
  storage backend (L3) on the tier manager, selected by ``--hicache-storage-backend
  dynamic`` + its extra config.

Each module imports its engine at import time, so import only the one you use;
``import kvstore`` and ``import kvstore.integrations`` import neither. See
docs/integrations.md.
"""

__all__: list[str] = []

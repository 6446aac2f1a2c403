"""The control spec of test_vllm_harness.py: vLLM's own CPU offloading (its
``CPUOffloadingManager``, its chunk sizing) with kvstore's CPU copy worker.

Loaded by vLLM's ``OffloadingSpecFactory`` from
``{"spec_name": "ControlCPUOffloadingSpec",
  "spec_module_path": "tests.integrations.vllm_control_spec", "cpu_bytes_to_use": ...}``.
vLLM's ``CPUOffloadingSpec.get_worker`` refuses to run without CUDA; this one
returns a ``KVStoreCPUWorker`` over a ``StagingRegion`` of the parent's
``num_chunks`` x ``kv_bytes_per_chunk``.
"""

from __future__ import annotations

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingWorker
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from kvstore.integrations.vllm_worker import KVStoreCPUWorker, StagingRegion


class ControlCPUOffloadingSpec(CPUOffloadingSpec):
    """CPUOffloadingSpec whose worker is kvstore's (get_manager is the parent's)."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            region = StagingRegion(self.config.engine_id, self.num_chunks, self.kv_bytes_per_chunk)
            self._worker = KVStoreCPUWorker(kv_caches, self.blocks_per_chunk, region)
        return self._worker

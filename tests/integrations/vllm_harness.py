"""vLLM 0.33's real scheduler and OffloadingConnector, stepped on CPU with a fake model.

``VLLMHarness(extra_config)`` builds what a vLLM engine runs around an offloading
spec, without a GPU, a model or a download:

- the EngineCore side: a real ``vllm.v1.core.sched.scheduler.Scheduler`` (prefix
  caching on) whose connector is ``OffloadingConnector`` with the given
  ``kv_connector_extra_config``, over a tiny Llama config saved to a temp dir
  once per process (``HF_HUB_OFFLINE=1``, ``DeviceConfig("cpu")``);
- the worker side: a WORKER-role ``OffloadingConnector`` over fake KV caches,
  registered with ``register_kv_caches`` as the GPU model runner does (so the
  spec's ``get_worker`` receives vLLM's own ``CanonicalKVCaches``);
- a fake forward pass: each token a step computes gets, in every layer, K/V
  values that are a function of (``kv_seed``, layer, position, token id) only.
  Loaded blocks are never written by it, so after a load a block carries the
  pattern of the engine that stored it (``pattern_block_bytes``).

A step is what vLLM's ``EngineCore.step`` + ``GPUModelRunner.execute_model`` do
with a KV connector: ``schedule()`` -> ``handle_preemptions`` ->
``bind_connector_metadata`` -> ``start_load_kv`` (before the forward when the
step has sync loads, after it otherwise) -> forward -> ``wait_for_save`` ->
``get_finished`` -> ``build_connector_worker_meta`` -> ``ModelRunnerOutput``
-> ``update_from_output``. Every step's jobs, every ``get_num_new_matched_tokens``
answer and the worker's store submissions (with the bytes they read) are
recorded for tests.

Two engines are two harnesses with different ``engine_id``. The first build in
a process costs ~15 s (vLLM's imports and the model-arch inspection); later
ones are fast. Importing this module needs the integration venv (vLLM 0.33)
and ``einops``.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
import uuid
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
    TransferJob,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.forward_context import ForwardContext
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.kv_offload.base import BlockIDsLoadStoreSpec, GPULoadStoreSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvstore.integrations.vllm_worker import staging_path

VOCAB_SIZE = 128
#: Never sampled by the fake model (its tokens are 3..102), so only max_tokens ends a request.
EOS_TOKEN_ID = VOCAB_SIZE - 1
_MODEL_DIRS: dict[int, Path] = {}
_NONE_HASH_READY = False


def tiny_model_dir(num_layers: int = 2, num_kv_heads: int = 2, head_size: int = 16) -> Path:
    """A saved tiny LlamaConfig (no weights), one per shape per process."""
    from transformers import LlamaConfig

    key = hash((num_layers, num_kv_heads, head_size))
    if key not in _MODEL_DIRS:
        directory = Path(tempfile.mkdtemp(prefix="kvstore_vllm_tiny_"))
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        num_heads = 2 * num_kv_heads
        LlamaConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=num_heads * head_size,
            intermediate_size=2 * num_heads * head_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_size,
            max_position_embeddings=4096,
            architectures=["LlamaForCausalLM"],
        ).save_pretrained(directory)
        _MODEL_DIRS[key] = directory
    return _MODEL_DIRS[key]


@dataclass(frozen=True)
class MatchRecord:
    """One ``get_num_new_matched_tokens`` call: the scheduler's local prefix-cache
    hit, the connector's answer (None = ask again next step) and whether the load
    is asynchronous."""

    step: int
    num_computed_tokens: int
    num_matched_tokens: int | None
    load_async: bool


@dataclass(frozen=True)
class JobRecord:
    """A load or store job as the scheduler put it in a step's metadata."""

    job_id: int
    step: int
    kind: str  # "load" or "store"
    req_id: str
    gpu_block_ids: tuple[int, ...]
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]
    #: The offload side's ``block_ids`` (chunk indices for CPU specs); None if
    #: the spec is not a BlockIDsLoadStoreSpec.
    chunk_ids: tuple[int, ...] | None
    sync: bool
    job: TransferJob


@dataclass
class StepRecord:
    """What one engine step did."""

    index: int
    num_scheduled_tokens: dict[str, int]
    load_jobs: dict[int, JobRecord]
    store_jobs: dict[int, JobRecord]
    jobs_to_flush: set[int]
    finished_recving: set[str]
    completed_jobs: dict[int, int]
    finished_req_ids: set[str] = field(default_factory=set)


def _job_record(job_id: int, step: int, kind: str, job: TransferJob) -> JobRecord:
    gpu_spec = job.src_spec if kind == "store" else job.dst_spec
    other = job.dst_spec if kind == "store" else job.src_spec
    assert isinstance(gpu_spec, GPULoadStoreSpec)
    chunk_ids = (
        tuple(int(i) for i in other.block_ids)
        if isinstance(other, BlockIDsLoadStoreSpec) and not isinstance(other, GPULoadStoreSpec)
        else None
    )
    return JobRecord(
        job_id=job_id,
        step=step,
        kind=kind,
        req_id=job.req_id,
        gpu_block_ids=tuple(int(b) for b in gpu_spec.block_ids),
        group_sizes=tuple(int(s) for s in gpu_spec.group_sizes),
        block_indices=tuple(int(i) for i in gpu_spec.block_indices),
        chunk_ids=chunk_ids,
        sync=job.sync,
        job=job,
    )


class VLLMHarness:
    """One vLLM engine (scheduler + one worker) around an OffloadingConnector.

    ``extra_config`` is the ``kv_connector_extra_config`` (``spec_name``,
    ``spec_module_path``, ``block_size`` or ``blocks_per_chunk``,
    ``cpu_bytes_to_use``, ...). The KV cache is one group of full attention,
    ``num_layers`` layers of ``(num_gpu_blocks, 2, block_size, num_kv_heads,
    head_size)`` float32 in one layer-outermost allocation (``kv_backing``), so
    a block's page is ``2 * block_size * num_kv_heads * head_size * 4`` bytes
    (4096 with the defaults) per layer.
    """

    def __init__(
        self,
        extra_config: Mapping[str, Any],
        *,
        engine_id: str | None = None,
        num_gpu_blocks: int = 64,
        block_size: int = 16,
        num_layers: int = 2,
        num_kv_heads: int = 2,
        head_size: int = 16,
        max_num_batched_tokens: int = 1024,
        max_num_seqs: int = 8,
        max_model_len: int = 1024,
        kv_seed: int | None = None,
    ) -> None:
        global _NONE_HASH_READY
        self.engine_id = engine_id or f"harness-{uuid.uuid4().hex[:12]}"
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
        #: Seed of the fake model's K/V values; change it to make recomputed
        #: blocks differ from stored ones.
        self.kv_seed = zlib.crc32(self.engine_id.encode()) if kv_seed is None else kv_seed

        model_config = ModelConfig(
            model=str(tiny_model_dir(num_layers, num_kv_heads, head_size)),
            skip_tokenizer_init=True,
            dtype="float32",
            max_model_len=max_model_len,
        )
        self.vllm_config = VllmConfig(
            model_config=model_config,
            cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                is_encoder_decoder=False,
            ),
            device_config=DeviceConfig("cpu"),
            kv_transfer_config=KVTransferConfig(
                kv_connector="OffloadingConnector",
                kv_role="kv_both",
                engine_id=self.engine_id,
                kv_connector_extra_config=dict(extra_config),
            ),
        )
        spec = FullAttentionSpec(
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            dtype=torch.float32,
        )
        self.page_bytes = spec.page_size_bytes
        layer_bytes = self.page_bytes * num_gpu_blocks
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_gpu_blocks,
            kv_cache_tensors=[
                KVCacheTensor(
                    size=layer_bytes * num_layers,
                    layers=list(self.layer_names),
                    layer_stride=layer_bytes,
                    block_stride=self.page_bytes,
                )
            ],
            kv_cache_groups=[KVCacheGroupSpec(list(self.layer_names), spec)],
        )
        self.vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks

        if not _NONE_HASH_READY:
            init_none_hash(sha256)
            _NONE_HASH_READY = True
        scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(
            self.kv_cache_config, self.vllm_config
        )
        self._block_hasher = get_request_block_hasher(hash_block_size, sha256)
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=scheduler_block_size,
            hash_block_size=hash_block_size,
        )
        connector = self.scheduler.connector
        assert isinstance(connector, OffloadingConnector)
        self.scheduler_connector: OffloadingConnector = connector

        #: The fake GPU KV cache: one uint8 allocation, layer-outermost.
        self.kv_backing = torch.zeros(layer_bytes * num_layers, dtype=torch.uint8)
        self.kv_caches: dict[str, torch.Tensor] = {
            name: self.kv_backing[i * layer_bytes : (i + 1) * layer_bytes]
            .view(torch.float32)
            .view(num_gpu_blocks, 2, block_size, num_kv_heads, head_size)
            for i, name in enumerate(self.layer_names)
        }
        self.worker_connector = OffloadingConnector(
            self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config
        )
        self.worker_connector.register_kv_caches(self.kv_caches)

        #: req_id -> every get_num_new_matched_tokens answer, in order.
        self.matches: dict[str, list[MatchRecord]] = {}
        self.steps: list[StepRecord] = []
        self.load_jobs: dict[int, JobRecord] = {}
        self.store_jobs: dict[int, JobRecord] = {}
        #: job_id -> the bytes of each GPU block (block_bytes) as the worker's
        #: submit_store received the job, i.e. what the store read.
        self.stored_block_bytes: dict[int, list[bytes]] = {}
        #: req_id -> its GPU block ids (group 0) as last seen while it ran.
        self.request_blocks: dict[str, list[int]] = {}
        self.prompts: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self._next_req = 0
        self._wrap_matching()
        self._wrap_worker_stores()

    # -- instrumentation -------------------------------------------------------------

    @property
    def worker(self) -> Any:
        """The spec's OffloadingWorker, as ``get_worker`` returned it."""
        connector_worker = self.worker_connector.connector_worker
        assert connector_worker is not None
        return connector_worker.worker

    @property
    def manager(self) -> Any:
        """The spec's OffloadingManager (scheduler side)."""
        connector_scheduler = self.scheduler_connector.connector_scheduler
        assert connector_scheduler is not None
        return connector_scheduler.manager

    def _wrap_matching(self) -> None:
        original = self.scheduler_connector.get_num_new_matched_tokens

        def recording(request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
            matched, load_async = original(request, num_computed_tokens)
            self.matches.setdefault(request.request_id, []).append(
                MatchRecord(len(self.steps), num_computed_tokens, matched, load_async)
            )
            return matched, load_async

        self.scheduler_connector.get_num_new_matched_tokens = recording  # type: ignore[method-assign]

    def _wrap_worker_stores(self) -> None:
        worker = self.worker
        original = worker.submit_store

        def recording(job_id: int, src_spec: GPULoadStoreSpec, dst_spec: Any) -> bool:
            self.stored_block_bytes[job_id] = [self.block_bytes(int(b)) for b in src_spec.block_ids]
            return bool(original(job_id, src_spec, dst_spec))

        worker.submit_store = recording

    # -- requests --------------------------------------------------------------------

    def add_request(
        self, prompt_token_ids: Sequence[int], *, max_tokens: int = 1, req_id: str | None = None
    ) -> str:
        """Queue a request (greedy fake sampling, ``max_tokens`` outputs); returns its id."""
        if req_id is None:
            req_id = f"{self.engine_id}-r{self._next_req}"
            self._next_req += 1
        params = SamplingParams(max_tokens=max_tokens)
        params.update_from_generation_config({}, EOS_TOKEN_ID)
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            pooling_params=None,
            block_hasher=self._block_hasher,
        )
        self.prompts[req_id] = list(prompt_token_ids)
        self.scheduler.add_request(request)
        return req_id

    def run(
        self, prompts: Iterable[Sequence[int]], *, max_tokens: int = 1, max_steps: int = 200
    ) -> list[str]:
        """Add the prompts (all at once), step until the engine is idle; their ids.

        Idle = no unfinished request and no connector job in flight
        (``Scheduler.has_requests``), so the last stores have completed too.
        """
        req_ids = [self.add_request(p, max_tokens=max_tokens) for p in prompts]
        self.run_until_idle(max_steps=max_steps)
        return req_ids

    def run_until_idle(self, *, max_steps: int = 200, idle_wait_s: float = 30.0) -> int:
        """Step while ``Scheduler.has_requests()``; the number of steps taken.

        A step that schedules nothing (every request waits for an NVMe read, a load
        or a store) does not count toward ``max_steps``: the harness sleeps a
        millisecond, as an engine waiting for its connector would, for up to
        ``idle_wait_s`` in all. (Counted, 200 such steps were 0.1 s of wall time, less
        than one read takes on a loaded CI machine.)"""
        taken = 0
        idle_deadline = time.monotonic() + idle_wait_s
        while taken < max_steps:
            if not self.scheduler.has_requests():
                return taken
            record = self.step()
            if record.num_scheduled_tokens or time.monotonic() > idle_deadline:
                taken += 1
            else:
                time.sleep(0.001)
        if self.scheduler.has_requests():
            raise AssertionError(f"engine {self.engine_id} still busy after {max_steps} steps")
        return max_steps

    # -- one engine step -------------------------------------------------------------

    def step(self) -> StepRecord:
        """One engine step; see the module docstring for the order of calls."""
        index = len(self.steps)
        output = self.scheduler.schedule()
        metadata = output.kv_connector_metadata
        assert isinstance(metadata, OffloadingConnectorMetadata)
        record = StepRecord(
            index=index,
            num_scheduled_tokens=dict(output.num_scheduled_tokens),
            load_jobs={
                job_id: _job_record(job_id, index, "load", job)
                for job_id, job in metadata.load_jobs.items()
            },
            store_jobs={
                job_id: _job_record(job_id, index, "store", job)
                for job_id, job in metadata.store_jobs.items()
            },
            jobs_to_flush=set(metadata.jobs_to_flush or ()),
            finished_recving=set(),
            completed_jobs={},
        )
        self.load_jobs.update(record.load_jobs)
        self.store_jobs.update(record.store_jobs)
        self.steps.append(record)
        for req_id in output.num_scheduled_tokens:
            self.request_blocks[req_id] = list(
                self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            )

        connector = self.worker_connector
        connector.handle_preemptions(metadata)
        connector.bind_connector_metadata(metadata)
        forward_context = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        if output.has_sync_kv_loads:
            connector.start_load_kv(forward_context)
        self._forward(output)
        if not output.has_sync_kv_loads:
            connector.start_load_kv(forward_context)
        connector.wait_for_save()
        finished_sending, finished_recving = connector.get_finished(output.finished_req_ids)
        worker_meta = connector.build_connector_worker_meta()
        connector.clear_connector_metadata()
        record.finished_recving = set(finished_recving or ())
        if isinstance(worker_meta, OffloadingWorkerMetadata):
            record.completed_jobs = dict(worker_meta.completed_jobs)

        model_output = self._model_output(output)
        model_output.kv_connector_output = KVConnectorOutput(
            finished_sending=set(finished_sending or ()),
            finished_recving=set(finished_recving or ()),
            kv_connector_worker_meta=worker_meta,
        )
        engine_outputs = self.scheduler.update_from_output(output, model_output)
        for client_outputs in engine_outputs.values():
            for request_output in client_outputs.outputs:
                if request_output.finish_reason is not None:
                    record.finished_req_ids.add(request_output.request_id)
        self.finished |= record.finished_req_ids
        return record

    def _forward(self, output: SchedulerOutput) -> None:
        """Write this step's computed tokens' K/V into their blocks, every layer."""
        for req_id, num_tokens in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            end = request.num_computed_tokens
            positions = list(range(end - num_tokens, end))
            tokens = [request.all_token_ids[p] for p in positions]
            block_ids = self.request_blocks[req_id]
            blocks = torch.tensor([block_ids[p // self.block_size] for p in positions])
            slots = torch.tensor([p % self.block_size for p in positions])
            for layer, name in enumerate(self.layer_names):
                values = self._kv_values(self.kv_seed, layer, positions, tokens)
                self.kv_caches[name][blocks, :, slots] = values

    def _kv_values(
        self, seed: int, layer: int, positions: Sequence[int], tokens: Sequence[int]
    ) -> torch.Tensor:
        """The fake model's K/V for these tokens: (len(positions), 2, heads, head_size)."""
        shape = self.kv_caches[self.layer_names[0]].shape
        heads, head_size = shape[3], shape[4]
        base = torch.tensor(
            [
                (seed * 1_000_003 + layer * 10_007 + p * 131 + t * 17) % 8191
                for p, t in zip(positions, tokens, strict=True)
            ],
            dtype=torch.float32,
        )
        offsets = torch.arange(2 * heads * head_size, dtype=torch.float32).view(
            2, heads, head_size
        ) / (2 * heads * head_size)
        return base.view(-1, 1, 1, 1) + offsets

    def _model_output(self, output: SchedulerOutput) -> ModelRunnerOutput:
        req_ids = list(output.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            if request.num_computed_tokens < request.num_tokens:
                sampled.append([])  # a partial prefill samples nothing
            else:
                sampled.append([3 + (request.num_tokens * 7) % 100])
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
        )

    # -- reading results -------------------------------------------------------------

    def num_matched_tokens(self, req_id: str) -> int:
        """The connector's last definite answer for the request (0 if none)."""
        answers = [m.num_matched_tokens for m in self.matches.get(req_id, ())]
        definite = [a for a in answers if a is not None]
        return definite[-1] if definite else 0

    def jobs_for(self, req_id: str, kind: str) -> list[JobRecord]:
        """The request's load or store jobs, in job-id order."""
        jobs = self.load_jobs if kind == "load" else self.store_jobs
        return [jobs[j] for j in sorted(jobs) if jobs[j].req_id == req_id]

    def loaded_tokens(self, req_id: str) -> int:
        """Tokens in the request's load jobs (GPU blocks x block_size)."""
        return self.block_size * sum(len(j.gpu_block_ids) for j in self.jobs_for(req_id, "load"))

    def block_bytes(self, block_id: int) -> bytes:
        """The GPU block's page in every layer, concatenated in layer order."""
        return b"".join(
            self.kv_caches[name][block_id].contiguous().view(torch.uint8).numpy().tobytes()
            for name in self.layer_names
        )

    def pattern_block_bytes(
        self, token_ids: Sequence[int], block_index: int, *, kv_seed: int | None = None
    ) -> bytes:
        """What the fake model (``kv_seed``, default this engine's) writes for full
        block ``block_index`` of a sequence starting with ``token_ids``, laid out
        as ``block_bytes`` returns it."""
        seed = self.kv_seed if kv_seed is None else kv_seed
        first = block_index * self.block_size
        positions = list(range(first, first + self.block_size))
        tokens = [token_ids[p] for p in positions]
        pages = []
        for layer in range(len(self.layer_names)):
            values = self._kv_values(seed, layer, positions, tokens)  # (bs, 2, heads, head)
            page = values.permute(1, 0, 2, 3).contiguous()  # as stored: (2, bs, heads, head)
            pages.append(page.view(torch.uint8).numpy().tobytes())
        return b"".join(pages)

    def scrub_kv(self, value: int = 0xA5) -> None:
        """Overwrite the whole fake GPU KV cache (after reset_prefix_cache, so a
        block that comes back must have come from the offload tier)."""
        self.kv_backing.fill_(value)

    def reset_prefix_cache(self) -> bool:
        """Drop vLLM's GPU prefix cache (not the connector's tiers)."""
        return bool(self.scheduler.reset_prefix_cache())

    # -- lifecycle -------------------------------------------------------------------

    def close(self, *, unlink_staging: bool = True) -> None:
        """Shut the worker connector and the scheduler (and its connector) down;
        remove this engine's kvstore staging file unless told not to."""
        self.worker_connector.shutdown()
        self.scheduler.shutdown()
        if unlink_staging:
            staging_path(self.engine_id).unlink(missing_ok=True)

    def __enter__(self) -> VLLMHarness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

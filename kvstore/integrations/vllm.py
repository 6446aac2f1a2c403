"""A vLLM offloading secondary tier backed by a KVStore (vLLM 0.31 - 0.33).

Selected by configuration alone (no vLLM patch, no registration call)::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{"type": "KVStoreTier",
                             "module_path": "kvstore.integrations.vllm",
                             "path": "/nvme/kv"}]}}'

vLLM's ``TieringOffloadingManager`` keeps a CPU primary tier; every chunk that
reaches it is cascaded to this tier (``submit_store``), and a chunk missing
from the primary tier but present here is promoted back (``submit_load``).
One chunk (``primary_kv_view.strides[0]`` bytes: every layer and every rank of
``blocks_per_chunk`` blocks) is one store page.

Invariants:
- ``submit_store`` / ``submit_load`` only queue work: the copies run on this
  tier's I/O threads (``put_many`` / ``get_many_into``), never on the scheduler.
- A page being loaded is pinned in the store from ``submit_load`` until its
  bytes are in the primary tier, so GC and eviction cannot move or free it
  mid-read. The primary slots of a store are pinned by vLLM (ref-count).
- Every page key starts with a namespace derived from the model, KV dtype,
  parallel layout, KV-cache groups, hash granularity and chunk size, so two
  models or two layouts never read each other's pages.
- A load reports per key which pages arrived (``JobResult.successful_keys``);
  a page that fails its checksum is deleted so it is not offered again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found]
    Locality,
    LookupResult,
    Medium,
    OffloadingSpec,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import (  # type: ignore[import-not-found]
    JobResult,
    SecondaryTierManager,
    TransferJob,
)

from kvstore.errors import CorruptionError, KVStoreError
from kvstore.store import KVStore

__all__ = ["SUPPORTED_VLLM", "KVStoreTier", "namespace_fields"]

#: The vLLM releases this tier is tested against: CI runs 0.33.0; 0.31.0 and
#: 0.32.0 passed the same tests. The SecondaryTierManager API is marked
#: experimental upstream and may change in a later release.
SUPPORTED_VLLM = ">=0.31.0,<0.34"

_KEY_PREFIX = b"vllm/"
_NAMESPACE_HEX = 16
_log = logging.getLogger(__name__)


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


def _namespace(fields: Mapping[str, Any]) -> str:
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:_NAMESPACE_HEX]


class KVStoreTier(SecondaryTierManager):  # type: ignore[misc]
    """A ``SecondaryTierManager`` whose chunks are pages of a ``KVStore`` at ``path``.

    Tier config keys (everything in the ``secondary_tiers`` entry besides
    ``type`` and ``module_path``):

    - ``path`` (required): the store directory; created if missing.
    - ``io_threads`` (4): threads that run stores and loads.
    - ``sync_stores`` (False): report a store done only once it is durable
      (``put_many(sync=True)``). Otherwise a stored chunk is durable within the
      store's ``flush_interval_ms`` (20 ms).
    - ``share_across_layouts`` (False): let layouts that vLLM certifies as
      parallelism-agnostic share pages.
    - ``store_options`` ({}): ``KVStore.open`` options, e.g. ``capacity_bytes``,
      ``segment_bytes``, ``eviction_policy``.
    - ``locality`` (None): "LOCAL" or "REMOTE", as for vLLM's ``fs`` tier.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        path: str,
        io_threads: int = 4,
        sync_stores: bool = False,
        share_across_layouts: bool = False,
        store_options: Mapping[str, Any] | None = None,
        locality: str | None = None,
        backpressure_detector: Any = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if io_threads < 1:
            raise ValueError(f"io_threads must be at least 1, got {io_threads}")
        self.locality = Locality(locality) if locality is not None else None
        chunk_bytes: int = self.block_size_bytes
        self._rows = primary_kv_view.cast("B")  # flat bytes: chunk c is one row of strides[0]
        self.fields = namespace_fields(
            offloading_spec, chunk_bytes, share_across_layouts=share_across_layouts
        )
        self.namespace = _namespace(self.fields)
        self._prefix = _KEY_PREFIX + self.namespace.encode("ascii") + b"/"
        self._sync_stores = sync_stores
        self.store = KVStore.open(path, create=True, **dict(store_options or {}))
        try:
            if self.store.config.max_page_bytes < chunk_bytes:
                raise ValueError(
                    f"a chunk is {chunk_bytes} bytes but the store at {path} takes pages of "
                    f"at most {self.store.config.max_page_bytes} bytes; create the store "
                    "with a larger max_page_bytes (store_options) or lower blocks_per_chunk"
                )
            self._write_namespace_page()
        except BaseException:
            self.store.close()
            raise
        self._executor = ThreadPoolExecutor(io_threads, thread_name_prefix="kvstore-vllm-tier")
        self._io_threads = io_threads
        self._finished: deque[JobResult] = deque()
        self._idle = threading.Condition()
        self._jobs_in_flight = 0
        self._closed = False
        _log.info(
            "kvstore tier %r at %s: namespace %s, %d-byte chunks",
            tier_type,
            path,
            self.namespace,
            chunk_bytes,
        )

    # -- keys ------------------------------------------------------------

    def page_key(self, key: OffloadKey) -> bytes:
        """The store key of a vLLM ``OffloadKey`` (block hash + KV group) in this namespace."""
        return self._prefix + bytes(key)

    def _write_namespace_page(self) -> None:
        """Record what the namespace stands for, retained, so operators can read it."""
        config_key = self._prefix + b"namespace.json"
        if config_key in self.store:
            return
        body = json.dumps(self.fields, sort_keys=True, indent=1).encode("utf-8")
        self.store.put(config_key, body, meta={"kind": "vllm-namespace"}, sync=True)
        self.store.retain(config_key)

    def _chunk(self, chunk_id: int) -> memoryview:
        start = chunk_id * self.block_size_bytes
        return self._rows[start : start + self.block_size_bytes]

    def _chunk_ids(self, job: TransferJob) -> list[int]:
        """The job's primary-tier slots, checked: a slice past the end would be short."""
        chunk_ids = [int(chunk_id) for chunk_id in job.chunk_ids]
        if len(chunk_ids) != len(job.keys):
            raise ValueError(f"{len(job.keys)} keys but {len(chunk_ids)} chunk ids")
        slots = self._rows.nbytes // self.block_size_bytes
        for chunk_id in chunk_ids:
            if not 0 <= chunk_id < slots:
                raise ValueError(
                    f"chunk id {chunk_id} is outside the primary tier (0..{slots - 1})"
                )
        return chunk_ids

    # -- SecondaryTierManager ----------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT when the page is in the store (an in-memory index lookup, no I/O)."""
        return LookupResult.HIT if self.page_key(key) in self.store else LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Queue the chunks' bytes for ``put_many``; chunks already stored are skipped."""
        keys = list(job_metadata.keys)
        chunk_ids = self._chunk_ids(job_metadata)
        page_keys = [self.page_key(key) for key in keys]
        work = [
            (page_key, chunk_id)
            for page_key, chunk_id in zip(page_keys, chunk_ids, strict=True)
            if page_key not in self.store
        ]
        job_id = job_metadata.job_id
        self._start_job()
        if not work:
            self._finish_job(JobResult(job_id=job_id, success=True, transfer_time=0.0))
            return
        parts = self._split(work)
        tracker = _JobTracker(len(parts))
        started = time.monotonic()

        def store_part(part: list[tuple[bytes, int]]) -> None:
            ok = True
            try:
                meta = {"ns": self.namespace}
                self.store.put_many(
                    [(page_key, self._chunk(chunk_id), meta) for page_key, chunk_id in part],
                    sync=self._sync_stores,
                )
            except Exception:
                _log.exception("kvstore tier: store job %d failed", job_id)
                ok = False
            if tracker.part_done(ok, []):
                self._finish_job(
                    JobResult(
                        job_id=job_id,
                        success=tracker.success,
                        transfer_time=time.monotonic() - started,
                        transfer_bytes=len(work) * self.block_size_bytes,
                    )
                )

        for part in parts:
            self._submit(store_part, part)

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Pin the pages, then queue batched reads into their primary-tier slots."""
        keys = list(job_metadata.keys)
        chunk_ids = self._chunk_ids(job_metadata)
        job_id = job_metadata.job_id
        self._start_job()
        # Pin on the scheduler thread (an in-memory operation): from here until
        # the read is done, GC and eviction leave the page where it is.
        pinned = [
            (key, chunk_id)
            for key, chunk_id in zip(keys, chunk_ids, strict=True)
            if self.store.pin(self.page_key(key))
        ]
        if not pinned:
            self._finish_job(self._load_result(job_id, keys, [], 0.0))
            return
        parts = self._split(pinned)
        tracker = _JobTracker(len(parts))
        started = time.monotonic()

        def load_part(part: list[tuple[OffloadKey, int]]) -> None:
            loaded: list[OffloadKey] = []
            page_keys = [self.page_key(key) for key, _ in part]
            try:
                loaded = self._load_batch(part, page_keys)
            except Exception:
                _log.exception("kvstore tier: batched load failed")
            finally:
                for page_key in page_keys:
                    self._unpin(page_key)
            if tracker.part_done(len(loaded) == len(part), loaded):
                self._finish_job(
                    self._load_result(job_id, keys, tracker.keys, time.monotonic() - started)
                )

        for part in parts:
            self._submit(load_part, part)

    def _load_batch(
        self, part: list[tuple[OffloadKey, int]], page_keys: list[bytes]
    ) -> list[OffloadKey]:
        """Read a part's pages with all reads in flight at once (``get_many_into``).

        If any page fails its checksum the batch raises; then each page is read
        on its own, so only the damaged ones are dropped (and deleted).
        """
        targets = [self._chunk(chunk_id) for _, chunk_id in part]
        try:
            sizes = self.store.get_many_into(page_keys, targets)
        except (CorruptionError, ValueError):  # a damaged or oversized page: one by one
            return [
                key
                for (key, chunk_id), page_key in zip(part, page_keys, strict=True)
                if self._load_one_quietly(page_key, chunk_id)
            ]
        loaded = []
        for (key, _), page_key, size in zip(part, page_keys, sizes, strict=True):
            if size == self.block_size_bytes:
                loaded.append(key)
            elif size is not None:
                self._wrong_size(page_key, size)
        return loaded

    def _load_one_quietly(self, page_key: bytes, chunk_id: int) -> bool:
        try:
            return self._load_one(page_key, chunk_id)
        except Exception:
            _log.exception("kvstore tier: load of page %r failed", page_key)
            return False

    def _wrong_size(self, page_key: bytes, size: int) -> None:
        _log.error(
            "kvstore tier: page %r is %d bytes, a chunk is %d; deleting it",
            page_key,
            size,
            self.block_size_bytes,
        )
        self._delete_quietly(page_key)

    def _load_one(self, page_key: bytes, chunk_id: int) -> bool:
        try:
            size = self.store.get_into(page_key, self._chunk(chunk_id))
        except CorruptionError:
            # Never offer a page that failed its checksum again: it is recomputed.
            _log.error("kvstore tier: page %r failed its checksum; deleting it", page_key)
            self._delete_quietly(page_key)
            return False
        if size is None:
            return False
        if size != self.block_size_bytes:
            self._wrong_size(page_key, size)
            return False
        return True

    def _delete_quietly(self, page_key: bytes) -> None:
        try:
            self.store.delete(page_key)
        except KVStoreError:
            _log.exception("kvstore tier: could not delete page %r", page_key)

    def _unpin(self, page_key: bytes) -> None:
        try:
            self.store.unpin(page_key)
        except KVStoreError:
            _log.exception("kvstore tier: could not unpin page %r", page_key)

    def _load_result(
        self,
        job_id: int,
        keys: list[OffloadKey],
        loaded: Collection[OffloadKey],
        seconds: float,
    ) -> JobResult:
        if len(loaded) == len(keys):
            success, successful_keys = True, None
        else:
            # Per-key outcome: vLLM keeps the loaded chunks and recomputes the rest.
            success, successful_keys = False, tuple(loaded) if loaded else None
        return JobResult(
            job_id=job_id,
            success=success,
            successful_keys=successful_keys,
            transfer_time=seconds,
            transfer_bytes=len(loaded) * self.block_size_bytes,
        )

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        while True:
            try:
                results.append(self._finished.popleft())
            except IndexError:
                return results

    def has_pending_work(self) -> bool:
        with self._idle:
            return self._jobs_in_flight > 0

    def drain_jobs(self) -> None:
        """Block until every submitted job has finished (its result is queued)."""
        with self._idle:
            self._idle.wait_for(lambda: self._jobs_in_flight == 0)

    def shutdown(self) -> None:
        """Finish the jobs in flight, make every stored chunk durable and close the store."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=True)
        self._rows.release()  # let vLLM unmap its primary region
        self.store.close()

    # -- job bookkeeping ---------------------------------------------------

    def _split(self, work: list[Any]) -> list[list[Any]]:
        """Cut a job into at most ``io_threads`` parts that run side by side."""
        size = -(-len(work) // self._io_threads)
        return [work[start : start + size] for start in range(0, len(work), size)]

    def _submit(self, function: Callable[[Any], None], part: Any) -> None:
        self._executor.submit(function, part)

    def _start_job(self) -> None:
        if self._closed:
            raise RuntimeError("the kvstore tier was shut down")
        with self._idle:
            self._jobs_in_flight += 1

    def _finish_job(self, result: JobResult) -> None:
        self._finished.append(result)
        with self._idle:
            self._jobs_in_flight -= 1
            if self._jobs_in_flight == 0:
                self._idle.notify_all()


class _JobTracker:
    """Joins the parts of one job, which finish on different I/O threads."""

    def __init__(self, parts: int) -> None:
        self._remaining = parts
        self._lock = threading.Lock()
        self.success = True
        self.keys: list[Any] = []

    def part_done(self, success: bool, keys: list[Any]) -> bool:
        """Record one part; True for the part that finishes the job."""
        with self._lock:
            self.success = self.success and success
            self.keys.extend(keys)
            self._remaining -= 1
            return self._remaining == 0

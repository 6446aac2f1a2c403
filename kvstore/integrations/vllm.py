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
- A page whose load failed (an I/O error, a checksum or size mismatch) answers
  MISS to that request for the rest of its life, and to every request for
  ``failed_load_ttl_s``: vLLM recomputes it instead of promoting it again every
  step. A recomputed chunk stored meanwhile replaces the unreadable page.
- A store reports only the pages it wrote: pages the store declines (its
  ``max_dwpd`` budget) fail the job and carry no bytes.
- Every entry point that touches the store or vLLM's memory checks first that
  the tier is open (``ClosedError`` after ``shutdown``).
- With ``enable_kv_events``, a chunk is announced stored only once its page is
  written, and removed when the tier deletes it or the store evicts it.
- A store that refuses to open fails the constructor (vLLM does not start); one
  that opens degraded is reported by one warning at start.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
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
    OffloadingEvent,
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

from kvstore.errors import ClosedError, CorruptionError, IOFailure, KVStoreError
from kvstore.integrations.vllm_namespace import namespace_fields, namespace_of

# The offloading spec on the tier manager lives beside this tier; vLLM loads it from
# this module (spec_module_path "kvstore.integrations.vllm").
from kvstore.integrations.vllm_spec import KVStoreOffloadingManager, KVStoreOffloadingSpec
from kvstore.store import KVStore

__all__ = [
    "SUPPORTED_VLLM",
    "KVStoreOffloadingManager",
    "KVStoreOffloadingSpec",
    "KVStoreTier",
    "namespace_fields",
]

#: The vLLM releases this tier is tested against: CI runs 0.33.0; 0.31.0 and
#: 0.32.0 passed the same tests. The SecondaryTierManager API is marked
#: experimental upstream and may change in a later release.
SUPPORTED_VLLM = ">=0.31.0,<0.34"

_KEY_PREFIX = b"vllm/"
_log = logging.getLogger(__name__)

#: How often, at most, the tier looks for evicted pages to report as removed
#: (only with ``enable_kv_events``; one ``stats()`` call when nothing was evicted).
_EVICTION_SCAN_S = 1.0


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
    - ``enable_kv_events`` (False): emit vLLM ``OffloadingEvent``s (stored and
      removed chunks, medium STORAGE), as vLLM's ``fs`` tier does; effective
      only when vLLM's KV cache events are enabled (``kv_events_config``).
    - ``failed_load_ttl_s`` (5.0): after a chunk failed to load, every request
      is told MISS for it for this long (the request that saw the failure, for
      the rest of its life), so vLLM recomputes it rather than retrying the read.
    - ``backpressure`` (vLLM's own key): a detector without a ``failure_threshold``
      gets vLLM's default for its ``fs`` tier (3 consecutive failed stores put the
      tier under pressure), which vLLM's factory gives only to its own tier types.
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
        enable_kv_events: bool = False,
        failed_load_ttl_s: float = 5.0,
        backpressure_detector: Any = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        _default_failure_threshold(backpressure_detector)
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads < 1:
            raise ValueError(f"io_threads must be an integer of at least 1, got {io_threads!r}")
        if (
            isinstance(failed_load_ttl_s, bool)
            or not isinstance(failed_load_ttl_s, (int, float))
            or not math.isfinite(failed_load_ttl_s)
            or failed_load_ttl_s < 0
        ):
            raise ValueError(
                f"failed_load_ttl_s must be a finite number of seconds >= 0, "
                f"got {failed_load_ttl_s!r}"
            )
        self.locality = Locality(locality) if locality is not None else None
        chunk_bytes: int = self.block_size_bytes
        self._rows = primary_kv_view.cast("B")  # flat bytes: chunk c is one row of strides[0]
        self.fields = namespace_fields(
            offloading_spec, chunk_bytes, share_across_layouts=share_across_layouts
        )
        self.namespace = namespace_of(self.fields)
        self._prefix = _KEY_PREFIX + self.namespace.encode("ascii") + b"/"
        self._sync_stores = sync_stores
        self._failed_load_ttl_s = float(failed_load_ttl_s)
        self._closed = False
        self.store = self._open_store(path, dict(store_options or {}))
        try:
            if self.store.config.max_page_bytes < chunk_bytes:
                raise ValueError(
                    f"a chunk is {chunk_bytes} bytes but the store at {path} takes pages of "
                    f"at most {self.store.config.max_page_bytes} bytes; create the store "
                    "with a larger max_page_bytes (store_options) or lower blocks_per_chunk"
                )
            self._write_namespace_page()
            #: What ``stats()`` says the store could not vouch for at open (quarantined
            #: segments or WAL files, pages lost); empty for a healthy store.
            self.degraded = self._warn_if_degraded(path)
        except BaseException:
            self.store.close()
            raise
        self._executor = ThreadPoolExecutor(io_threads, thread_name_prefix="kvstore-vllm-tier")
        self._io_threads = io_threads
        self._finished: deque[JobResult] = deque()
        self._idle = threading.Condition()
        self._jobs_in_flight = 0
        # Failed loads, written by I/O threads and read by lookup (scheduler).
        self._failures_lock = threading.Lock()
        self._failed_by_request: dict[str, set[OffloadKey]] = {}
        self._failed_until: dict[OffloadKey, float] = {}  # monotonic deadline, oldest first
        self._declines_logged = False
        self._events: deque[OffloadingEvent] | None = None
        if enable_kv_events:
            if _kv_events_enabled(offloading_spec):
                self._events = deque()
            else:
                _log.warning(
                    "enable_kv_events is set on the kvstore tier %r but vLLM's KV cache "
                    "events are disabled (kv_events_config); the tier emits no events",
                    tier_type,
                )
        # Chunks this process announced as stored, so evictions can be announced too.
        self._events_lock = threading.Lock()
        self._announced: set[OffloadKey] = set()
        self._evictions_seen = self._evictions() if self._events is not None else 0
        self._eviction_scan_s = _EVICTION_SCAN_S
        self._last_eviction_scan = time.monotonic()
        self._scanning = False
        _log.info(
            "kvstore tier %r at %s: namespace %s, %d-byte chunks",
            tier_type,
            path,
            self.namespace,
            chunk_bytes,
        )

    def _open_store(self, path: str, options: dict[str, Any]) -> KVStore:
        """Open the store, or fail the tier's construction (and so vLLM's start) saying why."""
        try:
            return KVStore.open(path, create=True, **options)
        except KVStoreError as e:
            e.add_note(
                f"the kvstore tier {self.tier_type!r} could not open its store at {path}, so "
                f"vLLM does not start with it: repair it (`kvstore fsck {path}`, then "
                f"`kvstore recover {path}`) or point the tier's `path` elsewhere"
            )
            raise

    def _warn_if_degraded(self, path: str) -> dict[str, int]:
        """Log once (here, at engine start) what the store opened without.

        Reads every ``quarantined*`` / ``degraded*`` count ``stats()`` offers (a
        number, or a mapping of numbers), so it follows whichever counters the
        store reports; a healthy store has none that is nonzero.
        """
        report: dict[str, int] = {}
        for name, value in self.store.stats().as_dict().items():
            if "quarantin" not in name and "degraded" not in name:
                continue
            counts = value.items() if isinstance(value, Mapping) else [("", value)]
            for part, count in counts:
                if isinstance(count, (int, float)) and count:
                    report[f"{name}.{part}" if part else name] = int(count)
        if report:
            details = ", ".join(f"{name}={value}" for name, value in sorted(report.items()))
            _log.warning(
                "kvstore tier %r: the store at %s opened degraded (%s); the chunks it could "
                "not vouch for are misses and will be recomputed. Run `kvstore fsck %s` for "
                "the details and `kvstore recover %s` to repair it",
                self.tier_type,
                path,
                details,
                path,
                path,
            )
        return report

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

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"the kvstore tier {self.tier_type!r} was shut down")

    # -- SecondaryTierManager ----------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT when the page is in the store (an in-memory index lookup, no I/O).

        MISS for a page whose load failed recently, or failed for this request.
        """
        self._check_open()
        if (self._failed_until or self._failed_by_request) and self._load_failed(
            key, _request_id(req_context)
        ):
            return LookupResult.MISS
        return LookupResult.HIT if self.page_key(key) in self.store else LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._check_open()
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Forget the request's failed loads (the negative cache keeps its own deadline)."""
        request_id = _request_id(req_context)
        if request_id is not None:
            with self._failures_lock:
                self._failed_by_request.pop(request_id, None)

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Queue the chunks' bytes for ``put_many``; chunks already stored are skipped.

        A chunk whose load failed recently is stored again: the new page
        replaces the unreadable one.
        """
        self._check_open()
        keys = list(job_metadata.keys)
        chunk_ids = self._chunk_ids(job_metadata)
        work = []
        for key, chunk_id in zip(keys, chunk_ids, strict=True):
            page_key = self.page_key(key)
            if page_key not in self.store or self._failed_recently(key):
                work.append((key, page_key, chunk_id))
        job_id = job_metadata.job_id
        self._start_job()
        if not work:
            self._finish_job(JobResult(job_id=job_id, success=True, transfer_time=0.0))
            return
        parts = self._split(work)
        tracker = _JobTracker(len(parts))
        started = time.monotonic()

        def store_part(part: list[tuple[OffloadKey, bytes, int]]) -> None:
            stored: list[OffloadKey] = []
            try:
                meta = {"ns": self.namespace}
                admitted = self.store.put_many(
                    [(page_key, self._chunk(chunk_id), meta) for _, page_key, chunk_id in part],
                    sync=self._sync_stores,
                )
                stored = [key for (key, _, _), ok in zip(part, admitted, strict=True) if ok]
                if len(stored) < len(part):
                    self._log_declined(len(part) - len(stored))
            except Exception:
                _log.exception("kvstore tier: store job %d failed", job_id)
            if tracker.part_done(len(stored) == len(part), stored):
                self._stored(tracker.keys)
                self._finish_job(
                    JobResult(
                        job_id=job_id,
                        success=tracker.success,
                        transfer_time=time.monotonic() - started,
                        transfer_bytes=len(tracker.keys) * self.block_size_bytes,
                    )
                )

        for part in parts:
            self._submit(store_part, part)

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Pin the pages, then queue batched reads into their primary-tier slots."""
        self._check_open()
        keys = list(job_metadata.keys)
        chunk_ids = self._chunk_ids(job_metadata)
        job_id = job_metadata.job_id
        request_id = _request_id(job_metadata.req_context)
        self._start_job()
        # Pin on the scheduler thread (an in-memory operation): from here until
        # the read is done, GC and eviction leave the page where it is.
        pinned = [
            (key, chunk_id)
            for key, chunk_id in zip(keys, chunk_ids, strict=True)
            if self.store.pin(self.page_key(key))
        ]
        if not pinned:
            self._finish_load(job_id, request_id, keys, [], 0.0)
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
                self._finish_load(
                    job_id, request_id, keys, tracker.keys, time.monotonic() - started
                )

        for part in parts:
            self._submit(load_part, part)

    def _load_batch(
        self, part: list[tuple[OffloadKey, int]], page_keys: list[bytes]
    ) -> list[OffloadKey]:
        """Read a part's pages with all reads in flight at once (``get_many_into``).

        If any page fails (its checksum, its size, or the read itself) the batch
        raises; then each page is read on its own, so only the failing ones are
        dropped (the damaged ones deleted).
        """
        targets = [self._chunk(chunk_id) for _, chunk_id in part]
        try:
            sizes = self.store.get_many_into(page_keys, targets)
        except (CorruptionError, IOFailure, ValueError) as e:
            _log.warning("kvstore tier: batched load failed (%s); reading page by page", e)
            return [
                key
                for (key, chunk_id), page_key in zip(part, page_keys, strict=True)
                if self._load_one_quietly(key, page_key, chunk_id)
            ]
        loaded = []
        for (key, _), page_key, size in zip(part, page_keys, sizes, strict=True):
            if size == self.block_size_bytes:
                loaded.append(key)
            elif size is not None:
                self._wrong_size(key, page_key, size)
        return loaded

    def _load_one_quietly(self, key: OffloadKey, page_key: bytes, chunk_id: int) -> bool:
        try:
            return self._load_one(key, page_key, chunk_id)
        except Exception:
            _log.exception("kvstore tier: load of page %r failed", page_key)
            return False

    def _wrong_size(self, key: OffloadKey, page_key: bytes, size: int) -> None:
        _log.error(
            "kvstore tier: page %r is %d bytes, a chunk is %d; deleting it",
            page_key,
            size,
            self.block_size_bytes,
        )
        self._delete_quietly(key, page_key)

    def _load_one(self, key: OffloadKey, page_key: bytes, chunk_id: int) -> bool:
        try:
            size = self.store.get_into(page_key, self._chunk(chunk_id))
        except CorruptionError:
            # Never offer a page that failed its checksum again: it is recomputed.
            _log.error("kvstore tier: page %r failed its checksum; deleting it", page_key)
            self._delete_quietly(key, page_key)
            return False
        if size is None:
            return False
        if size != self.block_size_bytes:
            self._wrong_size(key, page_key, size)
            return False
        return True

    def _delete_quietly(self, key: OffloadKey, page_key: bytes) -> None:
        try:
            deleted = self.store.delete(page_key)
        except KVStoreError:
            _log.exception("kvstore tier: could not delete page %r", page_key)
            return
        if deleted:
            self._removed([key])

    def _unpin(self, page_key: bytes) -> None:
        try:
            self.store.unpin(page_key)
        except KVStoreError:
            _log.exception("kvstore tier: could not unpin page %r", page_key)

    def _finish_load(
        self,
        job_id: int,
        request_id: str | None,
        keys: list[OffloadKey],
        loaded: Collection[OffloadKey],
        seconds: float,
    ) -> None:
        """Report a load; its failed keys answer MISS before vLLM can look them up again."""
        if len(loaded) == len(keys):
            success, successful_keys = True, None
        else:
            # Per-key outcome: vLLM keeps the loaded chunks and recomputes the rest.
            success, successful_keys = False, tuple(loaded) if loaded else None
            arrived = set(loaded)
            self._note_failed_loads(request_id, [key for key in keys if key not in arrived])
        self._finish_job(
            JobResult(
                job_id=job_id,
                success=success,
                successful_keys=successful_keys,
                transfer_time=seconds,
                transfer_bytes=len(loaded) * self.block_size_bytes,
            )
        )

    # -- failed loads --------------------------------------------------------

    def _note_failed_loads(self, request_id: str | None, keys: list[OffloadKey]) -> None:
        now = time.monotonic()
        with self._failures_lock:
            if request_id is not None:
                self._failed_by_request.setdefault(request_id, set()).update(keys)
            if self._failed_load_ttl_s > 0:
                until = now + self._failed_load_ttl_s
                failed_until = self._failed_until
                for key in keys:
                    failed_until.pop(key, None)  # re-inserted last: oldest deadline first
                    failed_until[key] = until
                self._expire_failures(now)

    def _expire_failures(self, now: float) -> None:
        """Drop expired deadlines (the dict is ordered by deadline). Holds _failures_lock."""
        failed_until = self._failed_until
        while failed_until:
            key = next(iter(failed_until))
            if failed_until[key] > now:
                return
            del failed_until[key]

    def _load_failed(self, key: OffloadKey, request_id: str | None) -> bool:
        with self._failures_lock:
            failed = self._failed_by_request.get(request_id) if request_id is not None else None
            if failed is not None and key in failed:
                return True
            until = self._failed_until.get(key)
            if until is None:
                return False
            if until > time.monotonic():
                return True
            self._expire_failures(time.monotonic())
            return False

    def _failed_recently(self, key: OffloadKey) -> bool:
        if not self._failed_until:
            return False
        with self._failures_lock:
            until = self._failed_until.get(key)
            return until is not None and until > time.monotonic()

    def _log_declined(self, count: int) -> None:
        if self._declines_logged:
            _log.debug("kvstore tier: the store declined %d chunks", count)
            return
        self._declines_logged = True
        _log.warning(
            "kvstore tier %r: the store declined %d chunks (its max_dwpd write budget); "
            "declined chunks are reported as not stored and stay only in the CPU tier",
            self.tier_type,
            count,
        )

    # -- KV events -----------------------------------------------------------

    def _stored(self, keys: list[OffloadKey]) -> None:
        """Chunks now in the store: readable again, and announced if events are on."""
        if not keys:
            return
        if self._failed_until:
            with self._failures_lock:
                for key in keys:
                    self._failed_until.pop(key, None)
        if self._events is None:
            return
        with self._events_lock:
            self._announced.update(keys)
            self._events.append(self._event(keys, removed=False))

    def _removed(self, keys: list[OffloadKey]) -> None:
        if self._events is None or not keys:
            return
        with self._events_lock:
            self._announced.difference_update(keys)
            self._events.append(self._event(keys, removed=True))

    def _event(self, keys: list[OffloadKey], *, removed: bool) -> OffloadingEvent:
        return _offloading_event(
            keys=list(keys),
            medium=self.medium,
            removed=removed,
            locality=self.locality,
            ownership=self.tier_type,
            removal_expected=True,  # this tier also announces the removal
        )

    def take_events(self) -> Iterable[OffloadingEvent]:
        """The stored and removed events since the last call (none unless enabled)."""
        events = self._events
        if events is None:
            return []
        taken = []
        while True:
            try:
                taken.append(events.popleft())
            except IndexError:
                return taken

    def on_schedule_end(self, context: Any) -> None:
        """With events on: look for evicted chunks (at most once a second, off this thread)."""
        if self._events is None or self._closed or self._scanning or not self._announced:
            return
        now = time.monotonic()
        if now - self._last_eviction_scan < self._eviction_scan_s:
            return
        self._last_eviction_scan = now
        self._scanning = True
        try:
            self._executor.submit(self._scan_evictions)
        except RuntimeError:  # the executor is shutting down
            self._scanning = False

    def _evictions(self) -> int:
        return sum(self.store.stats().evictions.values())

    def _scan_evictions(self) -> None:
        """Announce as removed the announced chunks the store has evicted since."""
        try:
            evictions = self._evictions()
            if evictions == self._evictions_seen:
                return
            self._evictions_seen = evictions
            with self._events_lock:
                announced = list(self._announced)
            gone = [key for key in announced if self.page_key(key) not in self.store]
            if gone:
                with self._events_lock:
                    gone = [key for key in gone if key in self._announced]
                self._removed(gone)
        except KVStoreError:
            _log.exception("kvstore tier: could not look for evicted chunks")
        finally:
            self._scanning = False

    # -- jobs ------------------------------------------------------------------

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
        self._check_open()
        with self._idle:
            self._jobs_in_flight += 1

    def _finish_job(self, result: JobResult) -> None:
        self._finished.append(result)
        with self._idle:
            self._jobs_in_flight -= 1
            if self._jobs_in_flight == 0:
                self._idle.notify_all()


def _default_failure_threshold(detector: Any) -> None:
    """Give a store-failure threshold to a backpressure detector that has none.

    vLLM's factory defaults ``failure_threshold`` (3 consecutive failed stores put
    the tier under pressure, e.g. a full filesystem) only for its own storage tier
    types (``fs``, ``obj``), not for a tier it loads from ``module_path``; this tier
    is storage too. An explicit ``failure_threshold`` in the tier's ``backpressure``
    config is kept."""
    default = getattr(type(detector), "DEFAULT_FAILURE_THRESHOLD", None)
    if default is not None and getattr(detector, "_failure_threshold", 0) is None:
        detector._failure_threshold = default


def _request_id(req_context: ReqContext | None) -> str | None:
    return getattr(req_context, "req_id", None)


def _kv_events_enabled(offloading_spec: OffloadingSpec) -> bool:
    """Whether vLLM publishes KV cache events (0.33: ``kv_events_config``)."""
    events_config = getattr(offloading_spec, "kv_events_config", None)
    if events_config is not None:
        return bool(events_config.enable_kv_cache_events)
    return bool(getattr(offloading_spec.config, "enable_kv_cache_events", False))


_EVENT_FIELDS = frozenset(field.name for field in dataclasses.fields(OffloadingEvent))


def _offloading_event(**fields: Any) -> OffloadingEvent:
    """An ``OffloadingEvent`` with the fields this vLLM release has (older ones lack some)."""
    return OffloadingEvent(
        **{name: value for name, value in fields.items() if name in _EVENT_FIELDS}
    )


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

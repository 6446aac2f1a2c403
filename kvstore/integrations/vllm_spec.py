"""A vLLM offloading spec on kvstore's tier manager: kvstore owns the CPU and NVMe tiers.

Loaded out of tree (vLLM 0.33, no patch)::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "KVStoreOffloadingSpec",
        "spec_module_path": "kvstore.integrations.vllm",
        "cpu_bytes_to_use": 1073741824, "path": "/nvme/kv",
        "dram_bytes": 68719476736, "model": "llama-3.1-8b"}}'

Where vLLM's own tiering spec keeps an LRU CPU tier and cascades every chunk to
every lower tier, here one ``TierManager`` decides: admission by value density,
Φ eviction, write-back to NVMe, and, at each lookup, whether loading the hit is
faster than recomputing it. ``lookup`` answers vLLM per chunk from the manager's
plan for the whole prefix:

- ``HIT``: the plan loads the chunk and it is in DRAM, pinned until the load ends;
- ``HIT_PENDING``: the plan loads it but it is on NVMe: the read into DRAM has
  started, the request waits (``has_pending_work``) and vLLM asks again;
- ``RETRY`` (vLLM 0.33; ``HIT_PENDING`` before it): not resident here, but the
  remote tier (``tier_options["remote_backend"]``) is reading it from the cluster
  (the lookup's ``remote_pending`` pages after its local run): whether it exists is
  not known yet, so the request waits (``has_pending_work``) and vLLM asks again;
  once the read lands the chunk is a DRAM page and answers ``HIT``. A request waits
  so at most ``remote_wait_s``; after that, and for pages the cluster turned out
  not to hold, ``MISS``;
- ``MISS``: not resident, or past the plan's ``load_pages`` (recomputing it is
  faster: a slow disk, a short prompt). vLLM recomputes it.

Data path: vLLM's worker copies GPU blocks to and from *staging* chunks
(``cpu_bytes_to_use``: the chunks in flight, not the cache); the manager moves
them between staging and its DRAM arena (``offer`` on ``complete_store``,
``prepare_load`` on ``prepare_load``). Jobs map to pins: a chunk answered HIT is
pinned from the lookup until ``complete_load`` (or the end of the step, if vLLM
did not schedule the request), so neither eviction nor the control thread can
take it while vLLM counts on it.

Known costs and limits (docs/integrations.md):
- one extra host copy per stored and loaded chunk (staging <-> arena); the
  arena over vLLM's shared region itself is the planned zero-copy step;
- ``prepare_load`` waits for the DRAM -> staging copy on the scheduler thread
  (a host memcpy of DRAM-resident chunks only: NVMe reads never run there);
- on CUDA the worker is vLLM's own ``CPUOffloadingWorker`` over its shared
  region, mapped here from the scheduler side; that path has not run on a GPU
  yet (the tests run on CPU with ``KVStoreCPUWorker``).

Extra config keys (besides vLLM's own ``cpu_bytes_to_use``, ``block_size``):

- ``path`` (required): the NVMe store directory (created if missing);
- ``dram_bytes`` (4 x ``cpu_bytes_to_use``): the tier manager's DRAM arena;
- ``nvme_bytes`` (None: unbounded, or the store's ``capacity_bytes``);
- ``model``: a ``MODEL_PRESETS`` name or a dict of ``ModelCost`` fields
  (``n_params``, ``layers``, ``q_heads``, ``head_dim``; ``kv_bytes_per_token``
  defaults to vLLM's own number); default: estimated from vLLM's model config;
- ``store_options`` ({}): ``KVStore.open`` options (the manager's ``nvme_options``);
- ``tier_options`` ({}): other ``TierConfig`` fields (``placement``,
  ``admission``, ``compute_flops``, ``bandwidth_bytes_per_s``, ...);
- ``load_timeout_s`` (10.0): the longest ``prepare_load`` waits for its copies;
- ``remote_wait_s`` (2.0): the longest a request waits for remote reads (``RETRY``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import torch
from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found]
    LookupResult,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # type: ignore[import-not-found]
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec  # type: ignore[import-not-found]

from kvstore.integrations.vllm_namespace import namespace_fields, namespace_of
from kvstore.integrations.vllm_worker import KVStoreCPUWorker, StagingRegion
from kvstore.tiering import LookupState, RequestContext, TierConfig, TierManager
from kvstore.tiering.config import MODEL_PRESETS, ModelCost
from kvstore.tiering.cost import GPU_COMPUTE_FLOPS
from kvstore.tiering.results import LoadPlan, ReleaseHandle

__all__ = ["SUPPORTED_VLLM_SPEC", "KVStoreOffloadingManager", "KVStoreOffloadingSpec"]

#: The vLLM releases the spec is tested against (the OffloadingManager API and the
#: request context's key positions it reads changed between releases).
SUPPORTED_VLLM_SPEC = ("0.33",)

_KEY_PREFIX = b"vllm-tier/"
_GROUP_BYTES = 4  # an OffloadKey ends with its KV-cache group index, big-endian
_STAGING_WAIT_S = 0.005  # the longest a step waits for a staging chunk to come free
# vLLM 0.33's answer for "not known yet, ask again" (its own tiering manager gives it
# while a secondary tier looks): RETRY; an older vLLM has only HIT_PENDING, which
# defers the request the same way.
_RETRY = getattr(LookupResult, "RETRY", LookupResult.HIT_PENDING)
_log = logging.getLogger(__name__)


def _loadable_now(result: Any) -> Any:
    """A READY plan cut before its first page still on NVMe only. The manager answers
    READY for such a page when DRAM has no slot to stage it: its ``prepare_load``
    would stream it through slots as the load's own DRAM pages are copied out and
    unpinned; but vLLM pins every page of its plan until the step ends, so none comes
    free, and the load would report the page missing after a second (a RuntimeError
    here). Cut there, the rest is a MISS (recomputed), and a later lookup may stage it."""
    tiers = result.plan.tiers
    load = result.plan.load_pages
    cut = next((i for i in range(load) if tiers[i] == 2), load)
    if cut == load:
        return result
    plan = dataclasses.replace(result.plan, load_pages=cut, reason="cut: no DRAM slot to stage")
    state = result.state if cut else LookupState.MISS
    return dataclasses.replace(result, state=state, plan=plan)


@dataclasses.dataclass(eq=False)
class _GroupPlan:
    """The tier manager's plan for one KV-cache group's run of a request's chunks."""

    step: int
    result: Any  # the tier manager's LookupResult for the run
    index: dict[OffloadKey, int]  # chunk key -> its place in the run
    remote_end: int = 0  # places [hit_pages, remote_end) are being read from the cluster


@dataclasses.dataclass(eq=False)
class _RequestState:
    """Per request, in ``ReqContext`` state: the step's plans (one per KV-cache group:
    a hybrid model's groups are asked about in turns) and what they hold."""

    plans: dict[bytes, _GroupPlan] = dataclasses.field(default_factory=dict)
    pending_groups: set[bytes] = dataclasses.field(default_factory=set)
    plan_pins: set[OffloadKey] = dataclasses.field(default_factory=set)  # pinned by the plan
    pinned: dict[OffloadKey, int] = dataclasses.field(default_factory=dict)  # key -> chunk
    loading: dict[OffloadKey, int] = dataclasses.field(default_factory=dict)  # key -> chunk
    storing: dict[OffloadKey, int] = dataclasses.field(default_factory=dict)  # key -> chunk
    remote_since: float | None = None  # when it began waiting for remote reads


class KVStoreOffloadingManager(OffloadingManager):  # type: ignore[misc]
    """vLLM's scheduler-side ``OffloadingManager`` answered by a ``TierManager``.

    Thread model: vLLM enters every method but ``shutdown`` holding ``lock``
    (one scheduler step is one region); the tier manager's own threads never touch
    this object's state, only the manager's (which has its own lock).
    """

    def __init__(
        self,
        tm: TierManager,
        staging: Any,
        *,
        prefix: bytes,
        tokens_per_chunk: int,
        load_timeout_s: float = 10.0,
        remote_wait_s: float = 2.0,
    ) -> None:
        self.tm = tm
        self._staging = staging
        self._prefix = prefix
        # The cache-reset epoch lives in the store (a retained page beside the chunks),
        # so a reset outlives a restart: chunks from before it are never found again.
        self._epoch_key = prefix + b"epoch"
        store = tm.store
        saved = store.get(self._epoch_key) if store is not None else None
        self._epoch = int(saved) if saved and saved.isdigit() else 0
        self._tokens_per_chunk = tokens_per_chunk
        self._load_timeout_s = load_timeout_s
        self._remote_wait_s = remote_wait_s
        self._lock = threading.Lock()
        self._free: list[int] = list(range(staging.num_chunks - 1, -1, -1))
        self._releasing: list[tuple[ReleaseHandle, list[int]]] = []
        self._fenced: list[int] = []  # in jobs a cache reset dropped; free once flushed
        self._warned_staging = False
        self._step = 0
        self._held: dict[str, _RequestState] = {}  # requests holding pins or chunks
        self._pending: set[str] = set()  # requests waiting for an NVMe -> DRAM read
        self._closed = False

    # -- keys ------------------------------------------------------------

    def page_key(self, key: OffloadKey) -> bytes:
        """The tier manager's key of a vLLM chunk key, in this namespace and epoch."""
        return self._prefix + b"%d/" % self._epoch + bytes(key)

    def _state(self, ctx: ReqContext) -> _RequestState:
        state: _RequestState | None = ctx.get_state(_RequestState)
        if state is None:
            state = _RequestState()
            ctx.set_state(state)
        return state

    @staticmethod
    def _request_keys(key: OffloadKey, ctx: ReqContext) -> tuple[list[OffloadKey], int]:
        """The request's chunk keys of ``key``'s KV group from ``key`` on, in prompt
        order, and the token position where the last one ends.

        vLLM records every chunk key's end position in the request context before it
        looks any up (``ReqContext.set_offload_key_position``); the manager needs the
        whole run at once to weigh loading it against recomputing it.
        """
        positions: Mapping[OffloadKey, int] = getattr(ctx, "_offload_key_positions", {})
        start = positions.get(key)
        if start is None:
            return [key], 0
        group = bytes(key)[-_GROUP_BYTES:]
        run = sorted((end, k) for k, end in positions.items() if bytes(k)[-_GROUP_BYTES:] == group)
        keys = [k for end, k in run if end >= start]
        return keys, run[-1][0]

    def _parent_keys(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[bytes | None]:
        """The page key of the chunk before each of ``keys`` in its request (same KV
        group), None for a first chunk: one pass over the request's positions."""
        positions: Mapping[OffloadKey, int] = getattr(ctx, "_offload_key_positions", {})
        by_end = {(end, bytes(k)[-_GROUP_BYTES:]): k for k, end in positions.items()}
        parents: list[bytes | None] = []
        for key in keys:
            end = positions.get(key)
            before = None
            if end is not None and end > self._tokens_per_chunk:
                before = by_end.get((end - self._tokens_per_chunk, bytes(key)[-_GROUP_BYTES:]))
            parents.append(None if before is None else self.page_key(before))
        return parents
        group = bytes(key)[-_GROUP_BYTES:]
        wanted = end - self._tokens_per_chunk
        for other, other_end in positions.items():
            if other_end == wanted and bytes(other)[-_GROUP_BYTES:] == group:
                return self.page_key(other)
        return None

    # -- staging chunks ----------------------------------------------------

    def _reclaim(self) -> None:
        """Free the staging chunks whose copy into the arena has finished."""
        if not self._releasing:
            return
        still = []
        for handle, chunks in self._releasing:
            if handle.done():
                self._free.extend(chunks)
            else:
                still.append((handle, chunks))
        self._releasing = still

    def _take_chunk(self) -> int | None:
        if not self._free:
            self._reclaim()
            if not self._free and self._releasing:
                # The oldest store's copy into the arena was submitted a step ago or
                # more: give it a moment rather than turn a hit or a store away.
                self._releasing[0][0].wait(_STAGING_WAIT_S)
                self._reclaim()
        return self._free.pop() if self._free else None

    def _release_held(self, req_id: str, state: _RequestState) -> None:
        """Drop the pins and chunks of lookups vLLM did not turn into a load."""
        if state.plan_pins:
            self.tm.unpin([self.page_key(k) for k in state.plan_pins])
            state.plan_pins.clear()
        if state.pinned:
            self.tm.unpin([self.page_key(k) for k in state.pinned])
            self._free.extend(state.pinned.values())
            state.pinned.clear()
        if not state.loading and not state.storing:
            self._held.pop(req_id, None)

    # -- OffloadingManager -----------------------------------------------

    @property
    def lock(self) -> threading.Lock:
        return self._lock

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        state = self._state(req_context)
        group = bytes(key)[-_GROUP_BYTES:]
        plan = state.plans.get(group)
        if plan is None or plan.step != self._step or key not in plan.index:
            plan = self._plan(key, req_context, state)
        result = plan.result
        index = plan.index[key]
        if index >= result.plan.load_pages:
            if result.hit_pages <= index < plan.remote_end:
                return _RETRY  # on its way from the cluster: ask again
            return LookupResult.MISS
        if result.state is LookupState.PENDING:
            return LookupResult.HIT_PENDING
        if key in state.pinned:
            return LookupResult.HIT
        if key not in state.plan_pins:
            return LookupResult.MISS  # it was not resident when the plan pinned the run
        # A HIT must still be there at prepare_load (the plan's pin) and have a staging
        # chunk to land in.
        chunk = self._take_chunk()
        if chunk is None:
            return LookupResult.MISS  # no staging chunk free this step: recompute it
        state.plan_pins.discard(key)
        state.pinned[key] = chunk
        self._held[req_context.req_id] = state
        return LookupResult.HIT

    def _plan(self, key: OffloadKey, ctx: ReqContext, state: _RequestState) -> _GroupPlan:
        keys, end_tokens = self._request_keys(key, ctx)
        group = bytes(key)[-_GROUP_BYTES:]
        start_tokens = max(end_tokens - len(keys) * self._tokens_per_chunk, 0)
        tokens = max(end_tokens - start_tokens, self._tokens_per_chunk)
        page_keys = [self.page_key(k) for k in keys]
        stale = [k for k in state.plan_pins if bytes(k)[-_GROUP_BYTES:] == group]
        if stale:  # this group's plan of an earlier step
            self.tm.unpin([self.page_key(k) for k in stale])
            state.plan_pins.difference_update(stale)
        # Pin first, then plan: a page the plan counts on cannot leave DRAM before
        # vLLM's prepare_load (the manager's control thread evicts on its own time).
        pinned = self.tm.pin(page_keys)
        result = self.tm.lookup(
            page_keys, RequestContext(request_id=ctx.req_id, tokens=tokens), tokens=tokens
        )
        if result.state is LookupState.READY:
            result = _loadable_now(result)
        load = result.plan.load_pages if result.state is LookupState.READY else 0
        release = [pk for i, pk in enumerate(page_keys) if pinned[i] and i >= load]
        if release:
            self.tm.unpin(release)
        state.plan_pins.update(keys[i] for i in range(load) if pinned[i])
        if state.plan_pins:
            self._held[ctx.req_id] = state
        plan = _GroupPlan(self._step, result, {k: i for i, k in enumerate(keys)})
        if result.remote_pending and result.plan.load_pages >= result.hit_pages:
            # The remote tier reads the pages after the local run (every local page is
            # loaded, or the remote ones could not follow): wait for them, a while.
            now = time.monotonic()
            if state.remote_since is None:
                state.remote_since = now
            if now - state.remote_since < self._remote_wait_s:
                plan.remote_end = result.hit_pages + result.remote_pending
        else:
            state.remote_since = None
        state.plans[group] = plan
        if result.state is LookupState.PENDING or plan.remote_end:
            state.pending_groups.add(group)
        else:
            state.pending_groups.discard(group)
        if state.pending_groups:
            self._pending.add(ctx.req_id)
        else:
            self._pending.discard(ctx.req_id)
        return plan

    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> CPULoadStoreSpec:
        """Copy the chunks vLLM was told HIT from DRAM into their staging chunks."""
        state = self._state(req_context)
        keys = list(keys)
        missing = [k for k in keys if k not in state.pinned]
        if missing:
            raise RuntimeError(
                f"prepare_load for {len(missing)} chunks that lookup did not answer HIT in "
                f"this step (request {req_context.req_id!r})"
            )
        chunks = [state.pinned.pop(k) for k in keys]
        state.loading.update(zip(keys, chunks, strict=True))
        page_keys = tuple(self.page_key(k) for k in keys)
        cost = next(iter(state.plans.values())).result.plan.cost  # for the record only
        plan = LoadPlan(page_keys, (1,) * len(keys), len(keys), cost, "vllm")
        handle = self.tm.prepare_load(plan, [self._staging.chunk(c) for c in chunks])
        finished = handle.wait(self._load_timeout_s)
        loaded = self.tm.complete_load(handle) if finished else 0
        if loaded != len(keys):
            # Never hand vLLM a chunk whose bytes did not arrive: fail the step loudly.
            raise RuntimeError(
                f"kvstore could not copy {len(keys) - loaded} of {len(keys)} pinned chunks "
                f"out of DRAM for request {req_context.req_id!r}"
                + ("" if finished else f" within {self._load_timeout_s} s")
            )
        return CPULoadStoreSpec(chunks)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Nothing: the tier manager's lookup already renewed the chunks it found."""

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        state = self._state(req_context)
        done = [k for k in keys if k in state.loading]
        if done:
            self.tm.unpin([self.page_key(k) for k in done])
            self._free.extend(state.loading.pop(k) for k in done)
        if not state.pinned and not state.loading and not state.storing:
            self._held.pop(req_context.req_id, None)

    def prepare_store(
        self, keys: Iterable[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        """Staging chunks for vLLM to copy the blocks into; admission comes at
        ``complete_store``, once the bytes are there.

        All or nothing: vLLM counts every chunk it asked about as handled once a
        store job is built, so a partial answer would lose the rest for good; None
        (no room now) makes it ask again at its next step."""
        state = self._state(req_context)
        candidates = [k for k in keys if k not in state.storing]
        # Leave out what the manager holds already (vLLM's own CPU manager does too): a
        # chunk vLLM found in its GPU prefix cache need not cross to staging again.
        page_keys = [self.page_key(k) for k in candidates]
        present = self.tm.pin(page_keys) if page_keys else []
        if any(present):
            self.tm.unpin([pk for pk, held in zip(page_keys, present, strict=True) if held])
        wanted = [k for k, held in zip(candidates, present, strict=True) if not held]
        chunks: list[int] = []
        for _ in wanted:
            chunk = self._take_chunk()
            if chunk is None:
                self._free.extend(chunks)
                if len(wanted) > self._staging.num_chunks and not self._warned_staging:
                    self._warned_staging = True
                    _log.warning(
                        "kvstore offloading: a store of %d chunks cannot fit the %d staging "
                        "chunks (cpu_bytes_to_use); raise cpu_bytes_to_use to at least "
                        "max_num_batched_tokens / tokens per chunk chunks",
                        len(wanted),
                        self._staging.num_chunks,
                    )
                return None
            chunks.append(chunk)
        state.storing.update(zip(wanted, chunks, strict=True))
        if wanted:
            self._held[req_context.req_id] = state
        return PrepareStoreOutput(
            keys_to_store=wanted, store_spec=CPULoadStoreSpec(chunks), evicted_keys=[]
        )

    def complete_store(
        self, keys: Iterable[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        """Offer the staged chunks to the tier manager (admission, DRAM, write-back)."""
        state = self._state(req_context)
        done = [k for k in keys if k in state.storing]
        chunks = [state.storing.pop(k) for k in done]
        if not done:
            return
        if not success:
            self._free.extend(chunks)
            return
        # Parents before children (prefix closure declines an orphan): vLLM's order
        # of the keys is not the prompt's.
        positions: Mapping[OffloadKey, int] = getattr(req_context, "_offload_key_positions", {})
        order = sorted(range(len(done)), key=lambda i: positions.get(done[i], 0))
        done = [done[i] for i in order]
        chunks = [chunks[i] for i in order]
        result = self.tm.offer(
            [self.page_key(k) for k in done],
            [self._staging.chunk(c) for c in chunks],
            RequestContext(request_id=req_context.req_id),
            parents=self._parent_keys(done, req_context),
        )
        self._releasing.append((result.hbm_release, chunks))
        if not state.pinned and not state.loading and not state.storing:
            self._held.pop(req_context.req_id, None)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._state(req_context)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        state = req_context.get_state(_RequestState)
        self._pending.discard(req_context.req_id)
        if state is not None:
            self._release_held(req_context.req_id, state)
        self.tm.finish_request(RequestContext(request_id=req_context.req_id))

    def on_schedule_end(self, ctx: Any = None) -> None:
        """The step is over: HITs vLLM did not load give their pins and chunks back."""
        for req_id, state in list(self._held.items()):
            self._release_held(req_id, state)
        self._step += 1
        self._reclaim()

    def has_pending_work(self) -> bool:
        return bool(self._pending)

    def take_events(self) -> Iterable[Any]:
        return ()

    def reset_cache(self) -> None:
        """Forget every cached chunk (new weights): later keys live in a new epoch;
        the old pages are never looked up again and age out of every tier.

        vLLM drops its in-flight jobs here and never completes them: their pins go
        now, their staging chunks once the workers have reported them flushed
        (``on_reset_flushed``: a late copy may still write a chunk until then)."""
        for req_id, state in list(self._held.items()):
            self._release_held(req_id, state)
            if state.loading:
                self.tm.unpin([self.page_key(k) for k in state.loading])
                self._fenced.extend(state.loading.values())
                state.loading.clear()
            self._fenced.extend(state.storing.values())
            state.storing.clear()
            state.plans.clear()
            state.pending_groups.clear()
        self._held.clear()
        self._pending.clear()
        self._epoch += 1
        store = self.tm.store
        if store is not None:
            store.put(self._epoch_key, b"%d" % self._epoch, sync=True)
            store.retain(self._epoch_key)
        _log.info("kvstore offloading: cache reset, now epoch %d", self._epoch)

    def on_reset_flushed(self) -> None:
        """Every job the reset dropped has been reported: its staging chunks are free."""
        self._free.extend(self._fenced)
        self._fenced.clear()

    def get_stats(self) -> Any:
        return None

    def config_info(self) -> Sequence[Mapping[str, Any]]:
        return ()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for req_id, state in list(self._held.items()):
            self._release_held(req_id, state)
        self.tm.close()
        self._staging.close()
        unlink = getattr(self._staging, "unlink", None)
        if unlink is not None:  # the scheduler side owns the staging file in /dev/shm
            unlink()


def check_single_worker(world_size: int) -> None:
    """The CPU worker writes a chunk from its first byte: with more than one worker
    the ranks would overwrite each other's shards in one staging file. Refuse."""
    if world_size > 1:
        raise ValueError(
            f"KVStoreOffloadingSpec's CPU worker supports one worker, not {world_size}: "
            "on this platform vLLM uses no shared offload region, and the ranks would "
            "overwrite each other's KV in the staging chunks. Run with tensor parallel 1 "
            "here, or on CUDA, where vLLM's own worker lays out every rank"
        )


def version_warning(version: str) -> str | None:
    """What to tell an operator running the spec on an untested vLLM, or None."""
    if any(version == v or version.startswith(v + ".") for v in SUPPORTED_VLLM_SPEC):
        return None
    return (
        f"KVStoreOffloadingSpec is tested on vLLM {', '.join(SUPPORTED_VLLM_SPEC)}.x, not "
        f"{version}: its offloading API may differ; run tests/integrations/"
        "test_vllm_spec_scheduler.py against this vLLM before relying on it"
    )


class KVStoreOffloadingSpec(CPUOffloadingSpec):  # type: ignore[misc]
    """``spec_name: "KVStoreOffloadingSpec"``: the tier manager as vLLM's offload tiers.

    vLLM's ``CPUOffloadingSpec`` sizes the staging chunks (``cpu_bytes_to_use``,
    4 KiB-aligned ``kv_bytes_per_chunk``); this spec adds the tier manager above them.
    """

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        import vllm  # type: ignore[import-not-found]

        warning = version_warning(str(vllm.__version__))
        if warning is not None:
            _log.warning(warning)
        extra = self.extra_config
        path = extra.get("path")
        if not path:
            raise ValueError(
                "KVStoreOffloadingSpec needs kv_connector_extra_config['path'], the NVMe "
                "store directory"
            )
        self.path = str(path)
        group = config.groups[0]
        self.tokens_per_chunk = int(group.tokens_per_block) * int(self.blocks_per_chunk)
        self.fields = namespace_fields(self, self.kv_bytes_per_chunk)
        if extra.get("namespace"):  # e.g. a weights revision: new weights, new chunks
            self.fields["namespace"] = str(extra["namespace"])
        self.namespace = namespace_of(self.fields)
        self._kvstore_manager: KVStoreOffloadingManager | None = None
        self._kvstore_worker: Any = None

    def tier_config(self) -> TierConfig:
        """The tier manager's configuration from the extra config."""
        extra = self.extra_config
        staging = max(int(self.num_chunks), 1) * self.kv_bytes_per_chunk
        options: dict[str, Any] = dict(extra.get("tier_options") or {})
        # The engine prefills on its GPU: the recompute side of the plan is a GPU's
        # (the manager's own device is its host memory); tier_options may say better.
        options.setdefault("compute_flops", GPU_COMPUTE_FLOPS)
        return TierConfig(
            device="cpu",
            hbm="owned",
            hbm_bytes=0,
            dram_bytes=int(extra.get("dram_bytes", 4 * staging)),
            page_bytes=self.kv_bytes_per_chunk,
            tokens_per_page=self.tokens_per_chunk,
            nvme_path=self.path,
            nvme_options=dict(extra.get("store_options") or {}),
            nvme_bytes=extra.get("nvme_bytes"),
            model=self._model_cost(),
            **options,
        )

    def _model_cost(self) -> ModelCost:
        kv_per_token = max(
            int(self.config.worker_kv_bytes_per_block)
            * max(int(self.config.parallel.world_size), 1)
            // max(int(self.config.groups[0].tokens_per_block), 1),
            1,
        )
        model = self.extra_config.get("model")
        if isinstance(model, str):
            if model not in MODEL_PRESETS:
                raise ValueError(f"model {model!r} is not one of {sorted(MODEL_PRESETS)}")
            return MODEL_PRESETS[model]
        if isinstance(model, Mapping):
            fields = {"kv_bytes_per_token": kv_per_token, **model}
            return ModelCost(**fields)
        return _estimate_model_cost(kv_per_token)

    def get_manager(self) -> KVStoreOffloadingManager:
        if self._kvstore_manager is None:
            staging = self._scheduler_staging()
            try:
                tm = TierManager.open(self.tier_config())
            except BaseException:
                staging.close()
                raise
            self._kvstore_manager = KVStoreOffloadingManager(
                tm,
                staging,
                prefix=_KEY_PREFIX + self.namespace.encode("ascii") + b"/",
                tokens_per_chunk=self.tokens_per_chunk,
                load_timeout_s=float(self.extra_config.get("load_timeout_s", 10.0)),
                remote_wait_s=float(self.extra_config.get("remote_wait_s", 2.0)),
            )
        return self._kvstore_manager

    def _scheduler_staging(self) -> Any:
        if self._uses_shared_region():  # CUDA: vLLM's worker and its shared region
            return _VllmRegionStaging(self)
        return StagingRegion(self.config.engine_id, self.num_chunks, self.kv_bytes_per_chunk)

    def get_worker(self, kv_caches: Any) -> Any:
        if self._kvstore_worker is None:
            if self._uses_shared_region():
                self._kvstore_worker = super().get_worker(kv_caches)
            else:
                check_single_worker(int(self.config.parallel.world_size))
                region = StagingRegion(
                    self.config.engine_id, self.num_chunks, self.kv_bytes_per_chunk
                )
                self._kvstore_worker = KVStoreCPUWorker(kv_caches, self.blocks_per_chunk, region)
        return self._kvstore_worker


class _VllmRegionStaging:
    """vLLM's shared offload region, mapped from the scheduler side (CUDA only)."""

    def __init__(self, spec: KVStoreOffloadingSpec) -> None:
        from vllm.v1.kv_offload.cpu.shared_offload_region import (  # type: ignore[import-not-found]
            SharedOffloadRegion,
        )

        self._region = SharedOffloadRegion(
            engine_id=spec.config.engine_id,
            num_chunks=spec.num_chunks,
            rank=None,
            kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
            cpu_page_size=spec.cpu_page_size_per_worker,
        )
        self.num_chunks = int(spec.num_chunks)
        self.chunk_bytes = int(spec.kv_bytes_per_chunk)
        self._rows = torch.frombuffer(self._region.create_kv_memoryview(), dtype=torch.uint8)

    def chunk(self, index: int) -> torch.Tensor:
        start = index * self.chunk_bytes
        return self._rows[start : start + self.chunk_bytes]

    def close(self) -> None:
        self._region.cleanup()


def _estimate_model_cost(kv_bytes_per_token: int) -> ModelCost:
    """The prefill cost model from vLLM's model config (the current one, which vLLM
    sets while it builds the connector); llama-3.1-8b's shape when there is none."""
    try:
        from vllm.config import get_current_vllm_config  # type: ignore[import-not-found]

        model_config = get_current_vllm_config().model_config
        hidden = int(model_config.get_hidden_size())
        layers = int(model_config.hf_config.num_hidden_layers)
        heads = int(model_config.hf_config.num_attention_heads)
        vocab = int(model_config.get_vocab_size())
        head_dim = int(model_config.get_head_size())
    except Exception as e:  # no config in this context, or an unusual model
        _log.warning(
            "kvstore offloading: no model shape from vLLM (%s); the recompute cost "
            "assumes llama-3.1-8b. Set kv_connector_extra_config['model']",
            e,
        )
        preset = MODEL_PRESETS["llama-3.1-8b"]
        return dataclasses.replace(preset, kv_bytes_per_token=kv_bytes_per_token)
    # Dense transformer: ~12 h^2 per layer (attention + a 4h MLP) and the embeddings.
    n_params = 12.0 * layers * hidden * hidden + 2.0 * vocab * hidden
    return ModelCost(n_params, layers, heads, head_dim, kv_bytes_per_token)

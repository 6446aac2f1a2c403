"""An SGLang HiCache storage backend (L3) on kvstore's tier manager.

Loaded out of tree (SGLang 0.5.23, no patch)::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
      "module_path": "kvstore.integrations.sglang", "class_name": "KVStoreHiCache",
      "interface_v1": 1, "path": "/nvme/kv-sglang", "dram_bytes": 4294967296,
      "model": "llama-3.1-8b"}'

SGLang keeps GPU memory (L1) and its host pool (L2); kvstore is L3: a
``TierManager`` per rank with no HBM tier, a modest DRAM arena and an NVMe store,
placement ``write_through`` so every admitted page reaches NVMe. What kvstore adds
over SGLang's other L3 backends: ``batch_exists`` answers the prefix *worth loading*
(the manager's load-vs-recompute plan), so a hit that a slow disk would deliver later
than the GPU recomputes it counts as missing and SGLang recomputes it.

Data path (``interface_v1: 1``, zero copy): a SGLang page is the bytes that
``mem_pool_host.get_page_buffer_meta`` points at, one or more contiguous runs of the
host pool's buffer ("parts": K and V for the ``page_first``, ``page_first_direct`` and
``page_head`` layouts, K and V per layer for ``layer_first``). Each part is one tier
manager page, keyed ``<sglang hash>/<part>``, whose parent is the same part of the
previous page, and the manager copies straight between those views of the host
buffer and its DRAM arena (no bounce buffer; one host memcpy each way). Parts are kept in address
order, which is the order of ``get_data_page(flat=True)``: the legacy calls
(``get``/``set``/``batch_get``/``batch_set``, SGLang's path without ``interface_v1``)
store the same bytes under the same keys, so either path reads what the other wrote.

Cost accounting: the manager values each part as its whole page (its tokens, at the
page's depth), charging the part's own bytes and one transfer latency: admission is
therefore more lenient than for one page per key when transfers are bandwidth-bound
(many parts per page). ``batch_exists`` does not inherit that: it plans at page
granularity (a page's slowest part, its total bytes, one latency per tier) with the
manager's live bandwidth and compute fits. The manager's own lookup, run over the
parts, may start NVMe reads for more parts than that plan loads; they land in DRAM.

Namespacing: every (model, tp/pp/attention-cp/dcp/dp rank, MLA flag, layout, dtype,
page size, part sizes, ``namespace``) gets its own store directory under ``path``
(``<model>-<hash>``, with a ``.json`` beside it naming its fields): two models or
two ranks never see each other's pages, and the store's one-writer-per-directory lock
holds per rank.

MLA with tp_size > 1 gets no L3 hits: SGLang backs up replicated (MLA) pages from
the writer rank only (``is_storage_writer``, ``backup_skip`` in its cache controller),
so the other ranks' stores stay empty, their ``batch_exists`` answers 0, and SGLang
takes the minimum over ranks. A store has one writer process and read-only opens see
it as of their open, so the ranks cannot share one directory live; such a rank logs
a warning at start. MLA with one TP rank per store, and every MHA layout, work.

Restart: pages that reached NVMe survive (the manager rebuilds its page forest from
the store at open); a new instance with the same configuration on the same ``path``
finds them. Lost: the DRAM arena, and pages whose write-through had not finished.

Extra config keys (besides SGLang's ``backend_name``, ``module_path``,
``class_name``, ``interface_v1``):

- ``path`` (required): the root directory of the per-namespace stores;
- ``dram_bytes`` (256 MiB): the tier manager's DRAM arena (staging for NVMe writes
  and reads; SGLang's host pool is the real DRAM cache). Its slots are parts rounded
  up to 4 KiB; a ``batch_set_v1`` larger than the free arena waits for the
  write-through of what fits before offering the rest, so size it to SGLang's batch
  (128 pages) for full speed;
- ``nvme_bytes`` (None: the store's ``capacity_bytes``, else unbounded);
- ``model`` ("llama-3.1-8b"): a ``MODEL_PRESETS`` name or a dict of ``ModelCost``
  fields, the whole model, for the recompute side of the plan; each rank counts
  1/tp_size of its parameters and query heads, and its own KV bytes per token;
- ``store_options`` ({}): ``KVStore.open`` options (the manager's ``nvme_options``);
- ``tier_options`` ({}): other ``TierConfig`` fields (``placement``, ``admission``,
  ``compute_flops``, ``bandwidth_bytes_per_s``, ``warm_dram_on_open``, ...);
- ``namespace`` (""): an extra namespace component (e.g. a weights revision);
- ``page_bytes`` (1 MiB) and ``page_size`` (64 tokens): only before a host pool is
  registered (legacy calls on raw tensors): the largest value and its tokens;
- ``load_timeout_s`` (30.0): a load still in flight after this long is logged (and
  waited for: its copies target host pages SGLang would otherwise reuse).

One live instance per rank and namespace under ``path``: a second one (another
server, or a leftover instance in this process) is refused at creation with
``LockedError`` naming the holder's pid (``<path>/.<model>-<hash>.instance.lock``,
released by ``close``), so SGLang's start-up fails rather than every call later.
The claim is taken before the host pool fixes the page geometry: two servers of
one model and rank with different KV dtypes or layouts sharing ``path`` need
different ``namespace`` values.

Not implemented: the v2 calls (``batch_exists_v2``/``batch_get_v2``/``batch_set_v2``,
hybrid Mamba/SWA pools), pointer-only legacy calls (``target_locations`` without
tensors), and an MLA copy shared across TP ranks (above).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found]
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvstore.errors import IOFailure, KVStoreError, LockedError
from kvstore.tiering import TierConfig, TierManager
from kvstore.tiering.config import MODEL_PRESETS, ModelCost
from kvstore.tiering.cost import GPU_COMPUTE_FLOPS, CostModel, PlanCost
from kvstore.tiering.results import LoadHandle, LoadPlan, LookupResult, TierStats

__all__ = ["SUPPORTED_SGLANG", "KVStoreHiCache"]

SUPPORTED_SGLANG = ("0.5.23",)
_NAMESPACE_HEX = 16
_RAW_PAGE_BYTES = 1 << 20
_RAW_PAGE_TOKENS = 64
_DEFAULT_DRAM_BYTES = 256 << 20
_NO_COST = PlanCost(0, 0.0, 0.0, 0.0, 0.0, 0.0)
_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class _Geometry:
    """How one SGLang page maps onto tier manager pages (its parts)."""

    layout: str  # the host pool's layout, or "raw" before one is registered
    dtype: str
    page_tokens: int
    part_bytes: tuple[int, ...]  # in address order = get_data_page(flat=True) order

    @property
    def parts(self) -> int:
        return len(self.part_bytes)

    @property
    def page_bytes(self) -> int:
        return sum(self.part_bytes)


class _HostViews:
    """Byte views of a host pool's buffer at the pointers ``get_page_buffer_meta``
    returns: what the tier manager copies from and into, without a bounce buffer."""

    def __init__(self, pool: Any) -> None:
        buffers = pool.kv_buffer if isinstance(pool.kv_buffer, list | tuple) else [pool.kv_buffer]
        self._spans: list[tuple[int, int, torch.Tensor]] = []
        for buffer in buffers:
            if not isinstance(buffer, torch.Tensor) or buffer.device.type != "cpu":
                raise ValueError("KVStoreHiCache needs a host pool whose kv_buffer is on CPU")
            if not buffer.is_contiguous():
                raise ValueError("KVStoreHiCache needs a contiguous host kv_buffer")
            flat = buffer.reshape(-1).view(torch.uint8)
            self._spans.append((buffer.data_ptr(), flat.numel(), flat))
        self._pool = pool
        self.page_tokens = int(pool.page_size)

    def pages(self, host_indices: torch.Tensor, count: int) -> list[list[torch.Tensor]]:
        """Per SGLang page, its parts' byte views in address order."""
        if host_indices.numel() < count * self.page_tokens:
            raise ValueError(
                f"{count} keys need {count * self.page_tokens} host indices, got "
                f"{host_indices.numel()}"
            )
        indices = host_indices[: count * self.page_tokens].to("cpu", torch.int64)
        pointers, sizes = self._pool.get_page_buffer_meta(indices)
        if len(pointers) % count or len(pointers) != len(sizes):
            raise ValueError(
                f"get_page_buffer_meta gave {len(pointers)} pointers for {count} pages"
            )
        per_page = len(pointers) // count
        out = []
        for page in range(count):
            window = slice(page * per_page, (page + 1) * per_page)
            runs = [
                self._locate(int(ptr), int(size))
                for ptr, size in zip(pointers[window], sizes[window], strict=True)
            ]
            # (buffer, offset) order: the flat page's order, and the same in every
            # process (raw addresses of two buffers are not).
            runs.sort(key=lambda run: run[:2])
            out.append([flat[offset : offset + size] for _, offset, size, flat in runs])
        return out

    def _locate(self, pointer: int, size: int) -> tuple[int, int, int, torch.Tensor]:
        """(buffer index, byte offset, size, the buffer's byte view) of a pointer."""
        for index, (base, nbytes, flat) in enumerate(self._spans):
            offset = pointer - base
            if offset >= 0 and offset + size <= nbytes:
                return index, offset, size, flat
        raise ValueError(f"host pointer {pointer:#x} (+{size}) is outside the host kv_buffer")


def _host_geometry(pool: Any, views: _HostViews) -> _Geometry:
    parts = views.pages(torch.arange(views.page_tokens, dtype=torch.int64), 1)[0]
    return _Geometry(
        layout=str(getattr(pool, "layout", "unknown")),
        dtype=str(getattr(pool, "dtype", "unknown")),
        page_tokens=views.page_tokens,
        part_bytes=tuple(int(p.numel()) for p in parts),
    )


def namespace_fields(config: HiCacheStorageConfig, geometry: _Geometry) -> dict[str, Any]:
    """What a page's bytes depend on besides its SGLang hash (the token prefix)."""
    extra = config.extra_config or {}
    return {
        "engine": "sglang",
        "model": config.model_name or "",
        "tp": [config.tp_rank, config.tp_size],
        "pp": [config.pp_rank, config.pp_size],
        "attn_cp": [config.attn_cp_rank, config.attn_cp_size],
        "dcp": [config.dcp_rank, config.dcp_size],
        "dp_rank": config.dp_rank,
        "mla": bool(config.is_mla_model),
        "split_heads": [config.tp_lcm_size, bool(config.should_split_heads)],
        "layout": geometry.layout,
        "dtype": geometry.dtype,
        "page_tokens": geometry.page_tokens,
        "part_bytes": list(geometry.part_bytes),
        "namespace": str(extra.get("namespace", "")),
    }


def namespace_dir(root: Path, fields: Mapping[str, Any]) -> Path:
    """The store directory of a namespace: readable model name plus a hash of all fields."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:_NAMESPACE_HEX]
    model = re.sub(r"[^A-Za-z0-9._-]+", "-", str(fields.get("model") or "model")).strip("-.")
    return root / f"{model[:64] or 'model'}-{digest}"


_GEOMETRY_FIELDS = ("layout", "dtype", "page_tokens", "part_bytes")


def claim_instance(root: Path, config: HiCacheStorageConfig) -> int:
    """Take the flock that makes this backend the one live instance of its rank and
    namespace under ``root`` (the store's own writer lock is only taken at first use,
    once the host pool fixes the geometry: too late for SGLang's start-up check).
    Returns the fd (closing it releases the claim); raises ``LockedError`` naming the
    holder's pid, as ``KVStore.open`` does."""
    import fcntl

    fields = namespace_fields(config, _Geometry("", "", 0, ()))
    for name in _GEOMETRY_FIELDS:
        fields.pop(name)
    path = namespace_dir(root, fields)
    path = path.with_name(f".{path.name}.instance.lock")
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise IOFailure(f"cannot open {path}", e.errno) from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise LockedError(
            f"another live KVStoreHiCache (pid {holder}) uses {root} for this rank and "
            f"namespace ({path.name})"
        ) from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as e:
        os.close(fd)
        raise IOFailure(f"cannot record the instance's pid in {path}", e.errno) from e
    return fd


def _new_storage_metrics() -> Any:
    """SGLang's ``StorageMetrics`` (its collector asserts the type); imported on use:
    the module pulls in SGLang's server configuration."""
    from sglang.srt.observability.metrics_collector import (  # type: ignore[import-not-found]
        StorageMetrics,
    )

    return StorageMetrics()


class KVStoreHiCache(HiCacheStorage):  # type: ignore[misc]
    """``HiCacheStorage`` on a ``TierManager``; see the module docstring for config.

    Thread model: SGLang calls from its prefetch and backup threads at once; the tier
    manager has its own lock, ``_lock`` here only guards opening, clearing, closing.
    """

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None
    ) -> None:
        extra = dict(storage_config.extra_config or {})
        path = extra.get("path")
        if not path:
            raise ValueError(
                "KVStoreHiCache needs hicache-storage-backend-extra-config['path'], the "
                "directory of its NVMe stores"
            )
        self.storage_config = storage_config
        self.root = Path(str(path))
        self._extra = extra
        self._kwargs = dict(kwargs or {})
        self._lock = threading.RLock()
        self._tm: TierManager | None = None
        self._views: _HostViews | None = None
        self._geometry = _Geometry(
            "raw",
            "raw",
            int(extra.get("page_size", _RAW_PAGE_TOKENS)),
            (int(extra.get("page_bytes", _RAW_PAGE_BYTES)),),
        )
        self._page_cost: CostModel | None = None
        self._load_timeout_s = float(extra.get("load_timeout_s", 30.0))
        self._metrics: dict[str, list[float]] = {
            "prefetch_pgs": [],
            "backup_pgs": [],
            "prefetch_bandwidth": [],
            "backup_bandwidth": [],
        }
        self._counters: dict[str, int] = {}
        self._counter_lock = threading.Lock()
        self.directory: Path | None = None
        self.mem_pool_host: Any = None
        # A second live instance on the same store is refused here, at creation.
        self._claim_fd = claim_instance(self.root, storage_config)
        self._release = weakref.finalize(self, os.close, self._claim_fd)
        if storage_config.is_mla_model and storage_config.tp_size > 1:
            _log.warning(
                "kvstore HiCache: an MLA model with tp_size=%d: SGLang writes L3 pages "
                "from its writer rank only and this backend keeps one store per rank, "
                "so L3 lookups will miss (see kvstore.integrations.sglang)",
                storage_config.tp_size,
            )

    # -- opening --------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The host pool: fixes the page geometry, the namespace, and opens the manager."""
        with self._lock:
            super().register_mem_pool_host(mem_pool_host)
            views = _HostViews(mem_pool_host)
            geometry = _host_geometry(mem_pool_host, views)
            if self._tm is not None:
                self._tm.close()
                self._tm = None
            self._views = views
            self._geometry = geometry

    def _manager(self) -> TierManager:
        tm = self._tm
        if tm is not None:
            return tm
        with self._lock:
            if self._tm is None:
                self._open()
            assert self._tm is not None
            return self._tm

    def _open(self) -> None:
        if not self._release.alive:  # used again after close(): claim again
            self._claim_fd = claim_instance(self.root, self.storage_config)
            self._release = weakref.finalize(self, os.close, self._claim_fd)
        geometry = self._geometry
        fields = namespace_fields(self.storage_config, geometry)
        directory = namespace_dir(self.root, fields)
        directory.mkdir(parents=True, exist_ok=True)
        _write_json(directory.with_name(directory.name + ".json"), fields)
        config = self.tier_config(directory)
        tm = TierManager.open(config)
        self._tm = tm
        self.directory = directory
        # The plan at SGLang page granularity (parts share a page's tokens); it shares
        # the manager's live bandwidth and compute fits.
        self._page_cost = CostModel(
            tm.cost.model,
            geometry.page_tokens,
            tm.cost.compute,
            tm.cost.bandwidth,
            layer_overlap=tm.cost.layer_overlap,
        )

    def tier_config(self, directory: Path) -> TierConfig:
        """The tier manager's configuration for one namespace directory."""
        extra = self._extra
        geometry = self._geometry
        options: dict[str, Any] = {"placement": "write_through"}
        options.update(extra.get("tier_options") or {})
        if options.get("remote_backend"):
            # The remote tier's namespace is the store's: model, ranks, layout, dtype,
            # page geometry and `namespace` (the directory's name is their digest).
            options.setdefault("remote_namespace", f"sglang/{directory.name}")
        # The engine prefills on its GPU: the recompute side of the plan is a GPU's
        # (the manager's own device is its host memory); tier_options may say better.
        options.setdefault("compute_flops", GPU_COMPUTE_FLOPS)
        return TierConfig(
            device="cpu",
            hbm="owned",
            hbm_bytes=0,
            dram_bytes=int(extra.get("dram_bytes", _DEFAULT_DRAM_BYTES)),
            page_bytes=max(geometry.part_bytes),
            # Each part is worth its page's tokens: a page's parts are loaded (and
            # lost) together. See "Cost accounting" in the module docstring.
            tokens_per_page=geometry.page_tokens,
            nvme_path=str(directory),
            nvme_options=dict(extra.get("store_options") or {}),
            nvme_bytes=extra.get("nvme_bytes"),
            model=self._model_cost(),
            **options,
        )

    def _model_cost(self) -> ModelCost:
        """The recompute side of the plan, per rank: a rank prefills its 1/tp_size
        share of the weights and query heads (``compute_flops`` is one GPU's), and
        its pages hold its share of the KV bytes."""
        geometry = self._geometry
        kv_per_token = max(geometry.page_bytes // max(geometry.page_tokens, 1), 1)
        model = self._extra.get("model")
        if isinstance(model, str):
            whole = ModelCost.preset(model)
        elif isinstance(model, Mapping):
            whole = ModelCost(**{"kv_bytes_per_token": kv_per_token, **model})
        else:
            whole = MODEL_PRESETS["llama-3.1-8b"]
        share = max(int(self.storage_config.tp_size), 1)
        return dataclasses.replace(
            whole,
            n_params=whole.n_params / share,
            q_heads=max(whole.q_heads // share, 1),
            kv_bytes_per_token=kv_per_token,
        )

    # -- keys -----------------------------------------------------------------

    def _sub_keys(self, key: str) -> list[bytes]:
        base = key.encode()
        return [base + b"/%d" % part for part in range(self._geometry.parts)]

    def _chain(
        self, keys: Sequence[str], extra_info: HiCacheStorageExtraInfo | None
    ) -> tuple[list[bytes], list[bytes | None]]:
        """The parts' keys, page by page, and each one's parent: the same part of the
        page before (of ``prefix_keys[-1]`` for the first page, when kvstore holds it).

        One chain per part index keeps the manager's depth equal to the page's index
        (its recompute context) and makes the last page's parts the leaves that
        eviction takes first, as with one page per key.
        """
        tm = self._manager()
        previous: list[bytes | None] = [None] * self._geometry.parts
        prefix = extra_info.prefix_keys if extra_info is not None else None
        if prefix:
            last = self._sub_keys(prefix[-1])
            # Only resident parents: SGLang's own tiers may hold the prefix, and the
            # manager declines a child of a page it does not hold.
            resident = tm.pin(last)
            tm.unpin([k for k, ok in zip(last, resident, strict=True) if ok])
            previous = [k if ok else None for k, ok in zip(last, resident, strict=True)]
        sub_keys: list[bytes] = []
        parents: list[bytes | None] = []
        for key in keys:
            page = self._sub_keys(key)
            sub_keys.extend(page)
            parents.extend(previous)
            previous = list(page)
        return sub_keys, parents

    # -- lookups ----------------------------------------------------------------

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """The leading pages worth loading: present, and faster to load than to recompute."""
        if not keys:
            return 0
        tm = self._manager()
        sub_keys = [k for key in keys for k in self._sub_keys(key)]
        tokens = len(keys) * self._geometry.page_tokens
        result = tm.lookup(sub_keys, tokens=tokens)
        count = self._worth_loading(result, len(keys))
        if count and self._geometry.parts > 1:
            tm.prefetch(sub_keys[: count * self._geometry.parts])
        self._bump("exists:pages_found", result.hit_pages // self._geometry.parts)
        self._bump("exists:pages_worth_loading", count)
        return count

    def _worth_loading(self, result: LookupResult, pages: int) -> int:
        parts = self._geometry.parts
        whole = result.hit_pages // parts
        if whole == 0:
            return 0
        if parts == 1:
            return int(result.plan.load_pages)  # the manager's own plan is per page
        assert self._page_cost is not None
        tiers = result.plan.tiers
        page_tiers = [max(tiers[i * parts : (i + 1) * parts]) for i in range(whole)]
        sizes = [self._geometry.page_bytes] * whole
        plan = self._page_cost.plan(page_tiers, sizes, pages * self._geometry.page_tokens)
        return int(plan.load_pages)

    def exists(self, key: str) -> bool:
        """Whether every part of the page is stored (present, worth loading or not)."""
        tm = self._manager()
        sub_keys = self._sub_keys(key)
        pinned = tm.pin(sub_keys)
        tm.unpin([k for k, ok in zip(sub_keys, pinned, strict=True) if ok])
        return all(pinned)

    # -- zero-copy path (interface_v1) ------------------------------------------

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Load pages straight into the host pool at ``host_indices`` (page_size per key)."""
        if not keys:
            return []
        return self._load(keys, self._host_views().pages(host_indices, len(keys)))

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Offer the host pool's pages at ``host_indices``; True per page kvstore keeps."""
        if not keys:
            return []
        return self._offer(keys, self._host_views().pages(host_indices, len(keys)), extra_info)

    def _host_views(self) -> _HostViews:
        if self._views is None:
            raise ValueError("the v1 calls need register_mem_pool_host first")
        return self._views

    # -- legacy path (tensors) ----------------------------------------------------

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Read each page into its target tensor (the host pool's flat page shape)."""
        if not keys:
            return []
        targets = list(target_locations or [None] * len(keys))
        if len(targets) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(targets)} targets")
        for i, target in enumerate(targets):
            if target is None:
                if self.mem_pool_host is None:
                    raise ValueError("get without a target tensor needs a registered host pool")
                targets[i] = self.mem_pool_host.get_dummy_flat_data_page()
        count = 0
        page_views: list[list[torch.Tensor]] = []
        for target in targets:  # the leading run of usable targets
            parts = self._split(target)
            if parts is None:
                break
            page_views.append(parts)
            count += 1
        loaded = self._load(keys[:count], page_views) if count else []
        loaded += [False] * (len(keys) - count)
        return [t if ok else None for t, ok in zip(targets, loaded, strict=True)]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store a chain of pages (each the previous one's child); True if all are kept."""
        if not keys:
            return True
        if values is None or len(values) != len(keys):
            return False  # pointer-only calls (target_locations) are not supported
        page_views: list[list[torch.Tensor]] = []
        for value in values:  # the leading run of well-formed values
            parts = self._split(value, copy_ok=True)
            if parts is None:
                break
            page_views.append(parts)
        if not page_views:
            return False
        kept = self._offer(keys[: len(page_views)], page_views, None)
        return len(page_views) == len(keys) and all(kept)

    def _split(self, tensor: Any, *, copy_ok: bool = False) -> list[torch.Tensor] | None:
        """A flat page tensor as its parts' byte views; None if it is not one. A
        non-contiguous source (``copy_ok``) is copied; a target must be written in place."""
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            return None
        if not tensor.is_contiguous():
            if not copy_ok:
                return None
            tensor = tensor.contiguous()
        flat = tensor.reshape(-1).view(torch.uint8)
        geometry = self._geometry
        if geometry.layout == "raw":
            size = int(flat.numel())
            return [flat] if 0 < size <= geometry.part_bytes[0] else None
        if flat.numel() != geometry.page_bytes:
            return None
        out, start = [], 0
        for size in geometry.part_bytes:
            out.append(flat[start : start + size])
            start += size
        return out

    # -- moving bytes ---------------------------------------------------------------

    def _offer(
        self,
        keys: Sequence[str],
        page_views: Sequence[Sequence[torch.Tensor]],
        extra_info: HiCacheStorageExtraInfo | None,
    ) -> list[bool]:
        tm = self._manager()
        started = time.perf_counter()
        sub_keys, parents = self._chain(keys, extra_info)
        srcs = [view for views in page_views for view in views]
        parts = [len(views) for views in page_views]
        if len(srcs) != len(sub_keys) or any(p != self._geometry.parts for p in parts):
            raise ValueError(f"pages of {parts} parts; this namespace has {self._geometry.parts}")
        step = self._geometry.parts
        kept: list[bool] = []
        stalled = False
        while len(kept) < len(keys):
            first = len(kept) * step  # re-offer from the first page not kept
            try:
                result = tm.offer(sub_keys[first:], srcs[first:], parents=parents[first:])
            except (KVStoreError, ValueError) as e:
                _log.warning("kvstore: offer of %d pages failed: %s", len(keys) - len(kept), e)
                break
            # The copies read SGLang's buffers: they must land before it may reuse them.
            result.hbm_release.wait()
            tiers, reasons = result.tiers, result.reasons
            pages = len(tiers) // step
            run = 0
            while run < pages and all(t is not None for t in tiers[run * step : (run + 1) * step]):
                run += 1
            kept.extend([True] * run)
            if run == pages:
                break
            # A batch larger than the free DRAM arena: its write-through must finish
            # before the rest fits. Wait for it once per stall, then give up.
            full = any(r.startswith("declined: DRAM full") for r in reasons[run * step :])
            if not full or (stalled and run == 0):
                break
            stalled = True
            tm.drain(self._load_timeout_s)
        kept.extend([False] * (len(keys) - len(kept)))
        self._bump("set:pages_kept", sum(kept))
        self._bump("set:pages_declined", len(kept) - sum(kept))
        self._record("backup", sum(kept), started)
        return kept

    def _load(
        self, keys: Sequence[str], page_views: Sequence[Sequence[torch.Tensor]]
    ) -> list[bool]:
        tm = self._manager()
        started = time.perf_counter()
        sub_keys = [k for key in keys for k in self._sub_keys(key)]
        dst = [view for views in page_views for view in views]
        if len(dst) != len(sub_keys):
            raise ValueError(f"{len(dst)} destinations for {len(sub_keys)} parts")
        plan = LoadPlan(tuple(sub_keys), (2,) * len(sub_keys), len(sub_keys), _NO_COST, "sglang")
        handle = tm.prepare_load(plan, dst)
        self._wait(handle, len(keys))
        tm.complete_load(handle)
        step = self._geometry.parts
        results = handle.results
        ok = []
        for i in range(len(keys)):
            window = range(i * step, (i + 1) * step)
            ok.append(all(results[j] == dst[j].numel() for j in window))
        self._bump("get:pages_loaded", sum(ok))
        self._bump("get:pages_failed", len(ok) - sum(ok))
        self._record("prefetch", sum(ok), started)
        return ok

    def _wait(self, handle: LoadHandle, pages: int) -> None:
        """Until every copy has landed: SGLang frees (and reuses) the host pages of a
        failed load, so returning with copies in flight would corrupt other pages."""
        while not handle.wait(self._load_timeout_s):
            _log.warning(
                "kvstore: a load of %d pages is still in flight after %.1f s",
                pages,
                self._load_timeout_s,
            )

    # -- housekeeping -----------------------------------------------------------------

    def _bump(self, name: str, by: int = 1) -> None:
        with self._counter_lock:
            self._counters[name] = self._counters.get(name, 0) + by

    def _record(self, kind: str, pages: int, started: float) -> None:
        if not self.storage_config.enable_storage_metrics or not pages:
            return
        seconds = max(time.perf_counter() - started, 1e-9)
        self._metrics[f"{kind}_pgs"].append(pages)
        self._metrics[f"{kind}_bandwidth"].append(pages * self._geometry.page_bytes / 1e9 / seconds)

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (pages and GB/s per batch),
        as its metrics collector expects; None unless storage metrics are enabled.
        kvstore's own numbers: ``tier_stats()`` and ``counters()``."""
        if not self.storage_config.enable_storage_metrics:
            return None
        metrics = _new_storage_metrics()
        for name, values in self._metrics.items():
            getattr(metrics, name).extend(values)
            values.clear()
        return metrics

    def tier_stats(self) -> TierStats:
        """The tier manager's snapshot (pages per tier, hits, admissions, bandwidth)."""
        return self._manager().stats()

    def counters(self) -> dict[str, int]:
        """This backend's counts: pages found / worth loading, loaded, kept, declined."""
        with self._counter_lock:
            return dict(self._counters)

    def clear(self) -> None:
        """Drop every page of this namespace (DRAM and NVMe); other namespaces stay."""
        with self._lock:
            if self._tm is not None:
                self._tm.close()
                self._tm = None
            directory = self.directory
            if directory is None:
                directory = namespace_dir(
                    self.root, namespace_fields(self.storage_config, self._geometry)
                )
            shutil.rmtree(directory, ignore_errors=True)
            self._counters.clear()

    def close(self) -> None:
        """Finish in-flight NVMe writes and close the store. Idempotent."""
        with self._lock:
            try:
                if self._tm is not None:
                    self._tm.close()
                    self._tm = None
            finally:
                self._release()


def _write_json(path: Path, fields: Mapping[str, Any]) -> None:
    """The namespace's fields beside its directory, for operators (written atomically)."""
    text = json.dumps(fields, sort_keys=True, indent=1) + "\n"
    if path.exists() and path.read_text() == text:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)

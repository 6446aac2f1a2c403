"""An LMCache storage plugin backed by a KVStore (LMCache 0.4.4 - 0.5.6).

Selected by configuration alone (LMCache config file or ``LMCACHE_*`` env)::

    chunk_size: 256
    local_cpu: true
    max_local_cpu_size: 5
    storage_plugins: ["kvstore"]
    extra_config:
      storage_plugin.kvstore.module_path: kvstore.integrations.lmcache
      storage_plugin.kvstore.class_name: KVStoreBackend
      kvstore.path: /nvme/kv

LMCache's ``CreateStorageBackends`` builds the plugin after its local CPU
backend and hands that backend over; retrieved chunks are allocated from it.

One LMCache chunk (``MemoryObj``) is one store page, under
``lmcache/<CacheEngineKey.to_string()>`` (model, world size, worker id, chunk
hash, dtype and tags, so two models or two TP layouts never share a page).
The page's meta keeps what is needed to rebuild the ``MemoryObj``: its shapes,
dtypes and memory format, and whether it has ``cached_positions`` (stored as a
second page, ``...#positions``).

Invariants:
- ``batched_submit_put_task`` returns at once: the writes run on this plugin's
  threads, each holding a reference on its ``MemoryObj`` until written.
- A page is pinned in the store while it is read, and ``contains(key,
  pin=True)`` / ``pin`` pin it until ``unpin``.
- A page whose bytes fail their checksum is deleted and reported as a miss.
- A store that refuses to open fails LMCache's start (``KVStoreTierRefusedError``,
  which LMCache's plugin launcher cannot swallow); one that opens degraded is
  reported by a warning at start and by ``kvstore_lmcache_degraded{path}`` (and the
  other ``kvstore_lmcache_*`` gauges) on prometheus_client's default registry.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from lmcache.utils import CacheEngineKey  # type: ignore[import-not-found]
from lmcache.v1.memory_management import (  # type: ignore[import-not-found]
    MemoryFormat,
    MemoryObj,
)
from lmcache.v1.storage_backend.abstract_backend import (  # type: ignore[import-not-found]
    StoragePluginInterface,
)

from kvstore.errors import CorruptionError, KVStoreError, PinError
from kvstore.format.constants import MAX_INDEX_KEY_BYTES
from kvstore.store import KVStore

__all__ = ["SUPPORTED_LMCACHE", "KVStoreBackend", "KVStoreTierRefusedError"]

#: The LMCache releases whose StoragePluginInterface this plugin implements.
SUPPORTED_LMCACHE = ">=0.4.4,<=0.5.6"

_KEY_PREFIX = b"lmcache/"
_POSITIONS_SUFFIX = b"#positions"
_LONG_KEY_PREFIX = b"lmcache-sha256/"
_CONFIG_PREFIX = "kvstore."
_log = logging.getLogger(__name__)


def _coerce(value: Any) -> Any:
    """Numbers given as strings (LMCACHE_EXTRA_CONFIG from the environment) become numbers."""
    if isinstance(value, str):
        for kind in (int, float):
            try:
                return kind(value)
            except ValueError:
                pass
    return value


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r} in page meta")
    return dtype


def _layout(
    page_key: bytes, meta: Mapping[str, Any]
) -> tuple[list[torch.Size], list[torch.dtype], MemoryFormat]:
    """The MemoryObj shapes, dtypes and format recorded in a chunk page's meta."""
    try:
        shapes = [torch.Size([int(dim) for dim in shape]) for shape in meta["shapes"]]
        dtypes = [_dtype(str(name)) for name in meta["dtypes"]]
        fmt = MemoryFormat[str(meta["fmt"])]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"page {page_key!r} has no LMCache chunk layout in its meta ({e}); "
            "it was not written by this plugin"
        ) from e
    if not shapes or len(shapes) != len(dtypes):
        raise ValueError(f"page {page_key!r} has {len(shapes)} shapes but {len(dtypes)} dtypes")
    return shapes, dtypes, fmt


class KVStoreTierRefusedError(BaseException):
    """The plugin's store refused to open: LMCache must not start without its tier.

    A ``BaseException`` on purpose: LMCache's plugin launcher catches every
    ``Exception`` a plugin's constructor raises, logs one line and runs on without
    the tier (every stored chunk silently unreachable). This one reaches the
    engine's start instead. The cause is the store's ``KVStoreError``; the message
    names the fix.
    """


def _open_store(path: str, options: dict[str, Any]) -> KVStore:
    try:
        return KVStore.open(path, create=True, **options)
    except KVStoreError as e:
        message = (
            f"the kvstore LMCache plugin cannot open its store at {path}: {e}. LMCache does "
            f"not start without this tier: repair the store (`kvstore fsck {path}`, then "
            f"`kvstore recover {path}`) or point kvstore.path elsewhere"
        )
        _log.critical("%s", message)
        raise KVStoreTierRefusedError(message) from e


_DEGRADED_GAUGES = (
    ("degraded", "1 when the plugin's store opened around damage (see kvstore fsck)"),
    ("quarantined_segments", "Segments the store quarantined at open"),
    ("quarantined_pages", "Pages the store could not vouch for at open (misses)"),
    ("salvaged_pages", "Pages of quarantined segments that verified and are served"),
    ("damaged_wal_headers", "WAL files whose damaged header the store worked around"),
    ("index_salvaged", "1 when the store's LMDB index was rebuilt at open"),
)
_open_backends: weakref.WeakSet[KVStoreBackend] = weakref.WeakSet()
_collector_registered = False
_collector_lock = threading.Lock()


class _DegradedCollector:
    """``kvstore_<name>{path}`` gauges of every open plugin store in this process."""

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        backends = [b for b in list(_open_backends) if not b._closed]
        for name, documentation in _DEGRADED_GAUGES:
            family = GaugeMetricFamily(f"kvstore_lmcache_{name}", documentation, labels=["path"])
            for backend in backends:
                family.add_metric([backend.path], float(backend.degraded.get(name, 0)))
            yield family


def _register_collector() -> None:
    global _collector_registered
    with _collector_lock:
        if _collector_registered:
            return
        try:
            from prometheus_client import REGISTRY
        except ImportError:  # pragma: no cover - prometheus_client is a dependency
            return
        REGISTRY.register(_DegradedCollector())
        _collector_registered = True


def _report_degraded(backend: KVStoreBackend) -> dict[str, int]:
    """Warn once (at engine start) if the store opened degraded; export the gauges."""
    stats = backend.store.stats()
    report = {name: int(getattr(stats, name)) for name, _ in _DEGRADED_GAUGES}
    _open_backends.add(backend)
    _register_collector()
    if stats.degraded:
        _log.warning(
            "kvstore LMCache plugin: the store at %s opened DEGRADED (%s): chunks it could "
            "not vouch for are misses and will be recomputed; run `kvstore fsck %s` for the "
            "repairs. %s",
            backend.path,
            ", ".join(f"{name}={value}" for name, value in report.items() if value),
            backend.path,
            " | ".join(stats.degraded_reasons),
        )
    return report


class KVStoreBackend(StoragePluginInterface):  # type: ignore[misc]
    """LMCache chunks as pages of a ``KVStore``.

    ``extra_config`` keys (all under ``kvstore.``):

    - ``kvstore.path`` (required): the store directory; created if missing.
    - ``kvstore.io_threads`` (4): threads that write and read chunks.
    - ``kvstore.sync_puts`` (false): a put completes (callback, future) only
      once durable; otherwise within the store's ``flush_interval_ms``.
    - ``kvstore.capacity_bytes``, ``kvstore.segment_bytes``,
      ``kvstore.max_page_bytes``, ``kvstore.eviction_policy``, and any other
      ``KVStore.open`` option, by name.
    """

    def __init__(
        self,
        dst_device: str = "cpu",
        config: Any = None,
        metadata: Any = None,
        local_cpu_backend: Any = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(
            dst_device=dst_device,
            config=config,
            metadata=metadata,
            local_cpu_backend=local_cpu_backend,
            loop=loop,
        )
        extra: dict[str, Any] = dict(getattr(config, "extra_config", None) or {})
        options = {
            name.removeprefix(_CONFIG_PREFIX): _coerce(value)
            for name, value in extra.items()
            if name.startswith(_CONFIG_PREFIX)
        }
        path = options.pop("path", None)
        if not path:
            raise ValueError(
                "the kvstore LMCache plugin needs extra_config['kvstore.path'] (the store "
                "directory)"
            )
        io_threads = int(options.pop("io_threads", 4))
        if io_threads < 1:
            raise ValueError(f"kvstore.io_threads must be at least 1, got {io_threads}")
        self._sync_puts = str(options.pop("sync_puts", "false")).lower() in ("1", "true", "yes")
        self.path = str(path)
        self.store = _open_store(self.path, options)
        self._executor = ThreadPoolExecutor(io_threads, thread_name_prefix="kvstore-lmcache")
        self._lock = threading.Lock()
        self._put_tasks: set[bytes] = set()
        self._closed = False
        #: What the store could not vouch for at open (all zero when healthy); also
        #: exported as ``kvstore_lmcache_degraded{path}`` and friends on
        #: prometheus_client's default registry (the one LMCache and vLLM serve).
        self.degraded: dict[str, int] = {}
        self.degraded = _report_degraded(self)

    def __str__(self) -> str:
        return "KVStoreBackend"

    # -- keys -----------------------------------------------------------

    @staticmethod
    def page_key(key: CacheEngineKey) -> bytes:
        """The store key of an LMCache chunk key.

        A key too long for the index (its ``#positions`` page included: a very
        long model name) is stored under the SHA-256 of its text instead.
        """
        text: str = key.to_string()
        raw = text.encode("utf-8")
        if len(_KEY_PREFIX) + len(raw) + len(_POSITIONS_SUFFIX) > MAX_INDEX_KEY_BYTES:
            return _LONG_KEY_PREFIX + hashlib.sha256(raw).hexdigest().encode("ascii")
        return _KEY_PREFIX + raw

    # -- lookups and pins -------------------------------------------------

    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        page_key = self.page_key(key)
        if pin:
            return self.store.pin(page_key)
        return page_key in self.store

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        with self._lock:
            return self.page_key(key) in self._put_tasks

    async def batched_async_contains(
        self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False
    ) -> int:
        """How many keys, from the first, are stored (an index lookup each, no I/O)."""
        hits: int = self.batched_contains(keys, pin)
        return hits

    def pin(self, key: CacheEngineKey) -> bool:
        return self.store.pin(self.page_key(key))

    def unpin(self, key: CacheEngineKey) -> bool:
        try:
            self.store.unpin(self.page_key(key))
        except PinError:
            return False
        return True

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        """Delete the chunk; a pinned chunk only when ``force``."""
        page_key = self.page_key(key)
        if not force and self.store.pin_count(page_key) > 0:
            return False
        self.store.delete(page_key + _POSITIONS_SUFFIX)
        return self.store.delete(page_key)

    def touch_cache(self) -> None:
        """Recency is tracked by the store's own eviction policy on every read."""

    # -- puts -------------------------------------------------------------

    def batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: list[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Callable[[CacheEngineKey], None] | None = None,
    ) -> list[Future[None]] | None:
        """Queue the chunks for writing; returns a future per queued chunk.

        Chunks already stored or being stored are skipped (no callback), as
        LMCache's own backends do.
        """
        if len(keys) != len(objs):
            raise ValueError(f"{len(keys)} keys but {len(objs)} memory objects")
        if self._closed:
            raise RuntimeError("the kvstore LMCache plugin is closed")
        futures: list[Future[None]] = []
        for key, obj in zip(keys, objs, strict=True):
            page_key = self.page_key(key)
            with self._lock:
                if page_key in self._put_tasks or page_key in self.store:
                    continue
                self._put_tasks.add(page_key)
            obj.ref_count_up()  # released by _put once written
            futures.append(
                self._executor.submit(self._put, key, page_key, obj, on_complete_callback)
            )
        return futures or None

    def _put(
        self,
        key: CacheEngineKey,
        page_key: bytes,
        obj: MemoryObj,
        on_complete_callback: Callable[[CacheEngineKey], None] | None,
    ) -> None:
        try:
            meta_obj = obj.metadata
            positions = meta_obj.cached_positions
            meta: dict[str, Any] = {
                "shapes": [list(shape) for shape in obj.get_shapes()],
                "dtypes": [_dtype_name(dtype) for dtype in obj.get_dtypes()],
                "fmt": obj.get_memory_format().name,
                "nbytes": obj.get_size(),
                "positions": positions is not None,
            }
            items: list[tuple[bytes, object, dict[str, Any] | None]] = []
            if positions is not None:
                array = positions.detach().to("cpu", torch.int64).contiguous().numpy()
                items.append((page_key + _POSITIONS_SUFFIX, array, None))
            # The chunk page goes last: once it is visible, its positions are too.
            items.append((page_key, obj.byte_array, meta))
            self.store.put_many(items, sync=self._sync_puts)
        except Exception:
            _log.exception("kvstore plugin: put of %r failed", page_key)
            raise
        finally:
            obj.ref_count_down()
            with self._lock:
                self._put_tasks.discard(page_key)
        if on_complete_callback is not None:
            try:
                on_complete_callback(key)
            except Exception:
                _log.exception("kvstore plugin: on_complete_callback failed for %r", page_key)

    # -- gets -------------------------------------------------------------

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        """Read the chunk into a ``MemoryObj`` from LMCache's CPU allocator; None on a miss."""
        page_key = self.page_key(key)
        if not self.store.pin(page_key):
            return None
        try:
            return self._read(page_key)
        finally:
            try:
                self.store.unpin(page_key)
            except KVStoreError:
                _log.exception("kvstore plugin: could not unpin %r", page_key)

    def _read(self, page_key: bytes) -> MemoryObj | None:
        info = self.store.info(page_key)
        if info is None:
            return None
        meta = info.meta
        shapes, dtypes, fmt = _layout(page_key, meta)
        allocator = self.get_allocator_backend()
        if len(shapes) == 1:
            obj = allocator.allocate(shapes[0], dtypes[0], fmt)
        else:
            obj = allocator.allocate(shapes, dtypes, fmt)
        if obj is None:
            _log.warning("kvstore plugin: no CPU memory for %r; treating it as a miss", page_key)
            return None
        try:
            size = self.store.get_into(page_key, obj.byte_array)
            if size != obj.get_size():
                _log.error(
                    "kvstore plugin: page %r is %s bytes, its MemoryObj %d; deleting it",
                    page_key,
                    size,
                    obj.get_size(),
                )
                self._delete_quietly(page_key)
                obj.ref_count_down()
                return None
            if meta.get("positions"):
                positions = self.store.get(page_key + _POSITIONS_SUFFIX)
                if positions is None:
                    obj.ref_count_down()
                    return None
                obj.metadata.cached_positions = torch.frombuffer(
                    bytearray(positions), dtype=torch.int64
                )
        except CorruptionError:
            _log.error("kvstore plugin: page %r failed its checksum; deleting it", page_key)
            self._delete_quietly(page_key)
            obj.ref_count_down()
            return None
        except BaseException:
            obj.ref_count_down()
            raise
        return obj

    def get_non_blocking(self, key: CacheEngineKey, location: str | None = None) -> Future[Any]:
        return self._executor.submit(self.get_blocking, key)

    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """Reads run side by side on the plugin's threads; results in key order."""
        futures = [self._executor.submit(self.get_blocking, key) for key in keys]
        return [future.result() for future in futures]

    async def batched_get_non_blocking(
        self, lookup_id: str, keys: list[CacheEngineKey], transfer_spec: Any = None
    ) -> list[MemoryObj]:
        """The chunks of the longest stored prefix of ``keys``."""
        futures = [
            asyncio.wrap_future(self._executor.submit(self.get_blocking, key)) for key in keys
        ]
        results = await asyncio.gather(*futures)
        prefix: list[MemoryObj] = []
        for obj in results:
            if obj is None:
                break
            prefix.append(obj)
        for obj in results[len(prefix) :]:
            if obj is not None:
                obj.ref_count_down()
        return prefix

    def get_allocator_backend(self) -> Any:
        if self.local_cpu_backend is None:
            raise RuntimeError(
                "the kvstore LMCache plugin reads chunks into LMCache's local CPU backend; "
                "enable it (local_cpu: true, max_local_cpu_size > 0)"
            )
        return self.local_cpu_backend

    def _delete_quietly(self, page_key: bytes) -> None:
        try:
            self.store.delete(page_key)
        except KVStoreError:
            _log.exception("kvstore plugin: could not delete %r", page_key)

    # -- lifecycle -------------------------------------------------------

    def close(self) -> None:
        """Finish queued puts, make them durable and close the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=True)
        self.store.close()

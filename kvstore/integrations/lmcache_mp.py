"""A KVStore as the L2 tier of LMCache's multiprocess server (LMCache 0.5.6).

Loaded by LMCache's own ``plugin`` L2 adapter type, from the JSON a user passes to
the server::

    --l2-adapter '{"type": "plugin",
                   "module_path": "kvstore.integrations.lmcache_mp",
                   "class_name": "KVStoreL2Adapter",
                   "adapter_params": {"path": "/nvme/kv-lmcache",
                                      "capacity_bytes": 500000000000}}'

The plugin loader finds ``KVStoreL2AdapterConfig`` by name (``class_name`` +
``"Config"``) and builds it from ``adapter_params``; see that class for the keys.
LMCache's own per-adapter options (``"eviction"``, ``"affinity_tag"``, ...) go at
the top level of the JSON, beside ``"type"``, as for every adapter.

One ``ObjectKey`` is one store page, under
``lmcache-mp/<model>@<kv_rank:#010x>@<object_group_id:x>@<chunk_hash hex>[@<cache_salt>]``
(the field order of LMCache's FS adapter file names; a key too long for the index
is stored under ``lmcache-mp-sha256/<sha256 of that text>``). The page's meta holds
the key's fields as JSON, so a restarted adapter rebuilds every ``ObjectKey`` from
the index alone. The prefix differs from the non-multiprocess plugin's
(``kvstore/integrations/lmcache.py``, ``lmcache/``): both may share one store.

One store per server: the store takes a writer lock on its directory, so two
servers never share one (each node has its own). Across nodes, LMCache 0.5.6's P2P
(``p2p_l2_adapter.py`` + ``modules/p2p_controller.py``) serves a peer only what
is resident in its L1 (the peer-side prefetch runs with ``skip_l2=True``), over a
transfer channel that is NIXL or Mooncake TE: pages that live only in this tier
are not visible to other nodes.

Invariants:
- Every ``submit_*`` returns at once; the work runs on this adapter's threads, and
  every submitted task publishes exactly one result (a failure included), popped
  or queried once, then signals its own event fd.
- A key that ``lookup_and_lock`` reported found is pinned in the store until
  ``submit_unlock``: neither ``delete`` nor the store's own eviction removes it.
- A load sets a key's bit only after the page's bytes passed their checksum in
  the caller's buffer and filled it exactly; a page that fails is deleted and is
  a miss.
- ``_entries`` (key -> size) is what was reported to LMCache as stored and not
  yet as deleted; the base class's usage counters follow it. Pages the store
  evicted on its own are reported deleted when next noticed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from lmcache.lmcache_native import Bitmap  # type: ignore[import-not-found]
from lmcache.v1.distributed.api import (  # type: ignore[import-not-found]
    KeyEntry,
    KeyListPage,
    ObjectKey,
)
from lmcache.v1.distributed.internal_api import L2StoreResult  # type: ignore[import-not-found]
from lmcache.v1.distributed.l2_adapters.base import (  # type: ignore[import-not-found]
    L2AdapterInterface,
)
from lmcache.v1.distributed.l2_adapters.config import (  # type: ignore[import-not-found]
    L2AdapterConfigBase,
)
from lmcache.v1.platform import create_event_notifier  # type: ignore[import-not-found]

from kvstore.config import StoreConfig
from kvstore.errors import CorruptionError, KVStoreError, PinError
from kvstore.format.constants import MAX_INDEX_KEY_BYTES
from kvstore.store import KVStore

__all__ = ["SUPPORTED_LMCACHE_MP", "KVStoreL2Adapter", "KVStoreL2AdapterConfig"]

#: The LMCache releases whose multiprocess ``L2AdapterInterface`` this adapter implements.
SUPPORTED_LMCACHE_MP = "==0.5.6"

_KEY_PREFIX = b"lmcache-mp/"
_LONG_KEY_PREFIX = b"lmcache-mp-sha256/"
_SEP = "@"
# A page's meta names the key format, so a later format can tell old pages apart.
_META_FORMAT = "lmcache-mp/1"
# Store options the adapter sets itself (or that make no sense for it).
_RESERVED_STORE_OPTIONS = frozenset({"capacity_bytes", "telemetry_clock"})
_STORE_OPTIONS = (
    frozenset(field.name for field in dataclasses.fields(StoreConfig)) - _RESERVED_STORE_OPTIONS
)
# How often, at most, pages the store evicted on its own are looked for.
_RECONCILE_INTERVAL_S = 1.0
# A store task waits at most this long for pages another task is writing.
_STORE_WAIT_S = 30.0
_log = logging.getLogger(__name__)


# -- keys --------------------------------------------------------------------


def page_key(key: ObjectKey) -> bytes:
    """The store key of an LMCache ``ObjectKey`` (model, rank, group, hash, salt)."""
    text = (
        f"{key.model_name}{_SEP}{key.kv_rank:#010x}{_SEP}{key.object_group_id:x}"
        f"{_SEP}{key.chunk_hash.hex()}"
    )
    if key.cache_salt:
        text += f"{_SEP}{key.cache_salt}"
    raw = text.encode("utf-8")
    if len(_KEY_PREFIX) + len(raw) > MAX_INDEX_KEY_BYTES:
        return _LONG_KEY_PREFIX + hashlib.sha256(raw).hexdigest().encode("ascii")
    return _KEY_PREFIX + raw


def _key_meta(key: ObjectKey) -> dict[str, Any]:
    return {
        "format": _META_FORMAT,
        "model_name": key.model_name,
        "kv_rank": key.kv_rank,
        "object_group_id": key.object_group_id,
        "chunk_hash": key.chunk_hash.hex(),
        "cache_salt": key.cache_salt,
    }


def _key_from_meta(meta: Mapping[str, Any]) -> ObjectKey | None:
    """The ``ObjectKey`` recorded in a page's meta; None for a page not written here."""
    if meta.get("format") != _META_FORMAT:
        return None
    try:
        return ObjectKey(
            chunk_hash=bytes.fromhex(str(meta["chunk_hash"])),
            model_name=str(meta["model_name"]),
            kv_rank=int(meta["kv_rank"]),
            object_group_id=int(meta["object_group_id"]),
            cache_salt=str(meta["cache_salt"]),
        )
    except (KeyError, TypeError, ValueError):
        return None


# -- configuration ---------------------------------------------------------------


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


class KVStoreL2AdapterConfig(L2AdapterConfigBase):  # type: ignore[misc]
    """The ``adapter_params`` of the kvstore L2 adapter.

    - ``path`` (required): the store directory, created if missing.
    - ``capacity_bytes``: the store's disk budget. Also declared to LMCache as the
      adapter's capacity, so its L2 eviction controller (the ``"eviction"`` key of
      the adapter JSON) evicts before the store has to.
    - ``io_threads`` (4): threads that run store, lookup and load tasks.
    - ``sync_puts`` (false): a store task completes only once its pages are
      durable; otherwise they are durable within the store's ``flush_interval_ms``
      (a crash before that loses them: they are misses after restart, never wrong).
    - any other ``KVStore.open`` option by name (``segment_bytes``,
      ``max_page_bytes``, ``eviction_policy``, ``flush_interval_ms``, ...).
    """

    def __init__(
        self,
        path: str,
        *,
        capacity_bytes: int | None = None,
        io_threads: int = 4,
        sync_puts: bool = False,
        store_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.path = path
        self.capacity_bytes = capacity_bytes
        self.io_threads = io_threads
        self.sync_puts = sync_puts
        self.store_options = dict(store_options or {})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVStoreL2AdapterConfig:
        """Parse ``adapter_params``; ValueError names the bad or unknown key."""
        params = {name: value for name, value in d.items() if name != "type"}
        path = params.pop("path", None)
        if not isinstance(path, str) or not path:
            raise ValueError("path must be a non-empty string (the store directory)")
        capacity = params.pop("capacity_bytes", None)
        if capacity is not None:
            capacity = _positive_int("capacity_bytes", capacity)
        io_threads = _positive_int("io_threads", params.pop("io_threads", 4))
        sync_puts = params.pop("sync_puts", False)
        if not isinstance(sync_puts, bool):
            raise ValueError(f"sync_puts must be a boolean, got {sync_puts!r}")
        unknown = sorted(set(params) - _STORE_OPTIONS)
        if unknown:
            raise ValueError(
                f"unknown kvstore L2 adapter option(s) {unknown}; see "
                "KVStoreL2AdapterConfig.help() for the accepted keys"
            )
        return cls(
            path,
            capacity_bytes=capacity,
            io_threads=io_threads,
            sync_puts=sync_puts,
            store_options=params,
        )

    @classmethod
    def help(cls) -> str:
        return (
            "kvstore L2 adapter (adapter_params of the 'plugin' type):\n"
            "- path (str): store directory (required; created if missing)\n"
            "- capacity_bytes (int): disk budget, also the capacity declared to LMCache\n"
            "- io_threads (int): worker threads (default 4)\n"
            "- sync_puts (bool): store tasks complete once durable (default false)\n"
            "- any KVStore.open option: " + ", ".join(sorted(_STORE_OPTIONS))
        )


@dataclass(frozen=True, slots=True)
class _Entry:
    """A page reported to LMCache as stored: its key and size (bytes)."""

    key: ObjectKey
    size_bytes: int


class KVStoreL2Adapter(L2AdapterInterface):  # type: ignore[misc]
    """LMCache's L2 tier on a crash-safe ``KVStore`` (see the module docstring).

    ``config`` is a ``KVStoreL2AdapterConfig`` or its ``adapter_params`` dict.
    ``l1_memory_desc`` (passed by LMCache's loader when it has one) is not needed:
    pages are copied through the caller's ``MemoryObj`` buffers.
    """

    config_class_name = "KVStoreL2AdapterConfig"

    def __init__(
        self,
        config: KVStoreL2AdapterConfig | Mapping[str, Any],
        l1_memory_desc: Any = None,
    ) -> None:
        if not isinstance(config, KVStoreL2AdapterConfig):
            config = KVStoreL2AdapterConfig.from_dict(dict(config))
        super().__init__(max_capacity_bytes=config.capacity_bytes or 0)
        self.config = config
        self.path = config.path
        self.store = _open_store(config)
        self._lock = threading.Lock()  # _entries, _storing, and pin-vs-delete decisions
        self._entries: dict[bytes, _Entry] = {}
        self._storing: set[bytes] = set()
        # Told whenever a store task's pages leave ``_storing`` (written or failed).
        self._stored = threading.Condition(self._lock)
        self._task_ids = itertools.count()
        self._stores_done: dict[int, L2StoreResult] = {}
        self._lookups_done: dict[int, Bitmap] = {}
        self._loads_done: dict[int, Bitmap] = {}
        self._evicted_seen = self._store_evictions()
        self._reconciled_at = time.monotonic()
        self._closed = False
        self._recover()
        self._store_event = create_event_notifier()
        self._lookup_event = create_event_notifier()
        self._load_event = create_event_notifier()
        self._executor = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kvstore-l2")

    # -- restart recovery ------------------------------------------------------

    def _recover(self) -> None:
        """Report every page of a previous run as stored (feeds ``get_usage``)."""
        keys: list[ObjectKey] = []
        sizes: list[int] = []
        for raw in self.store.keys():  # noqa: SIM118 (KVStore has no __iter__)
            if not raw.startswith((_KEY_PREFIX, _LONG_KEY_PREFIX)):
                continue
            info = self.store.info(raw)
            if info is None:
                continue
            key = _key_from_meta(info.meta)
            if key is None or page_key(key) != raw:
                _log.warning("kvstore L2 adapter: page %r has no ObjectKey meta; ignored", raw)
                continue
            self._entries[raw] = _Entry(key, info.payload_bytes)
            keys.append(key)
            sizes.append(info.payload_bytes)
        if keys:
            self._notify_keys_stored(keys, sizes)
            _log.info(
                "kvstore L2 adapter: %d pages (%d bytes) at %s from a previous run",
                len(keys),
                sum(sizes),
                self.path,
            )

    def register_listener(self, listener: Any) -> None:
        """Register, and tell the listener about the pages already stored.

        LMCache's eviction controller registers its listener after the adapter is
        built: without the replay it would never learn of (nor evict) the pages a
        previous run left.
        """
        with self._lock:
            entries = list(self._entries.values())
        super().register_listener(listener)
        if entries:
            listener.on_l2_keys_stored(
                [entry.key for entry in entries], [entry.size_bytes for entry in entries]
            )

    # -- event fds -------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        fd: int = self._store_event.fileno()
        return fd

    def get_lookup_and_lock_event_fd(self) -> int:
        fd: int = self._lookup_event.fileno()
        return fd

    def get_load_event_fd(self) -> int:
        fd: int = self._load_event.fileno()
        return fd

    # -- tasks -----------------------------------------------------------------

    def _submit(
        self,
        run: Callable[[], Any],
        failed: Callable[[], Any],
        done: dict[int, Any],
        event: Any,
    ) -> int:
        """Run ``run`` on a worker; publish its result (``failed()`` if it raised)
        in ``done``, then signal ``event``."""
        if self._closed:
            raise RuntimeError("the kvstore L2 adapter is closed")
        with self._lock:
            task_id = next(self._task_ids)

        def task() -> None:
            try:
                result = run()
            except Exception:
                _log.exception("kvstore L2 adapter: task %d failed", task_id)
                result = failed()
            with self._lock:
                done[task_id] = result
            event.notify()

        self._executor.submit(task)
        return task_id

    def submit_store_task(self, keys: list[ObjectKey], objects: list[Any]) -> int:
        if len(keys) != len(objects):
            raise ValueError(f"{len(keys)} keys but {len(objects)} memory objects")
        return self._submit(
            lambda: self._store_pages(keys, objects),
            lambda: L2StoreResult(False, 0),
            self._stores_done,
            self._store_event,
        )

    def pop_completed_store_tasks(self) -> dict[int, L2StoreResult]:
        with self._lock:  # the same dict stays: the tasks publish into it
            done = dict(self._stores_done)
            self._stores_done.clear()
        return done

    def submit_lookup_and_lock_task(
        self, keys: list[ObjectKey], group_layout_descs: Mapping[int, Any] | None = None
    ) -> int:
        """``group_layout_descs`` is advisory (LMCache's own adapters ignore it too)."""
        return self._submit(
            lambda: self._lookup_and_lock(keys),
            lambda: Bitmap(len(keys)),
            self._lookups_done,
            self._lookup_event,
        )

    def query_lookup_and_lock_result(self, task_id: int) -> Bitmap | None:
        with self._lock:
            return self._lookups_done.pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        """Drop one lock of each key at once (an in-memory step that cannot fail).

        A key that is not locked, or an adapter already closed, is ignored: LMCache
        never retries an unlock, and a close drops every lock anyway.
        """
        if self._closed:
            return
        for key in keys:
            try:
                self.store.unpin(page_key(key))
            except PinError:
                _log.debug("kvstore L2 adapter: unlock of %r, which is not locked", key)
            except KVStoreError:  # closed meanwhile: the lock went with the store
                _log.debug("kvstore L2 adapter: unlock of %r after close", key)

    def submit_load_task(self, keys: list[ObjectKey], objects: list[Any]) -> int:
        if len(keys) != len(objects):
            raise ValueError(f"{len(keys)} keys but {len(objects)} memory objects")
        return self._submit(
            lambda: self._load(keys, objects),
            lambda: Bitmap(len(keys)),
            self._loads_done,
            self._load_event,
        )

    def query_load_result(self, task_id: int) -> Bitmap | None:
        with self._lock:
            return self._loads_done.pop(task_id, None)

    # -- the work (on the worker threads) ------------------------------------------

    def _store_pages(self, keys: list[ObjectKey], objects: list[Any]) -> L2StoreResult:
        """Write the pages not stored yet; bytes written, 0 for keys already there.

        A key another task is writing is not written twice, but this task finishes
        only once that write has ended: a finished store means its keys can be found
        (unless that other write failed, or the store evicted them since)."""
        self._reconcile()
        max_page_bytes = self.store.config.max_page_bytes
        success = True
        todo: list[tuple[bytes, ObjectKey, memoryview]] = []
        vanished: list[_Entry] = []
        elsewhere: set[bytes] = set()  # keys another task is writing
        with self._lock:
            for key, obj in zip(keys, objects, strict=True):
                raw = page_key(key)
                if raw in self._storing:  # by another task, or earlier in this batch
                    elsewhere.add(raw)
                    continue
                entry = self._entries.get(raw)
                if entry is not None:
                    if raw in self.store:
                        continue
                    vanished.append(self._entries.pop(raw))  # evicted by the store
                view = memoryview(obj.byte_array).cast("B")
                if view.nbytes == 0 or view.nbytes > max_page_bytes:
                    _log.error(
                        "kvstore L2 adapter: %r is %d bytes; pages must be 1 to %d bytes "
                        "(max_page_bytes)",
                        key,
                        view.nbytes,
                        max_page_bytes,
                    )
                    success = False
                    continue
                self._storing.add(raw)
                todo.append((raw, key, view))
        self._report_deleted(vanished)
        stored: list[_Entry] = []
        try:
            if todo:
                written = self.store.put_many(
                    [(raw, view, _key_meta(key)) for raw, key, view in todo],
                    sync=self.config.sync_puts,
                )
                # False: the store's DWPD budget declined the page (not an error).
                stored = [
                    _Entry(key, view.nbytes)
                    for (_, key, view), ok in zip(todo, written, strict=True)
                    if ok
                ]
        except KVStoreError:
            _log.exception("kvstore L2 adapter: store of %d pages failed", len(todo))
            success = False
        finally:
            with self._lock:
                for raw, _, _ in todo:
                    self._storing.discard(raw)
                for entry in stored:
                    self._entries[page_key(entry.key)] = entry
                self._stored.notify_all()
                elsewhere.difference_update(raw for raw, _, _ in todo)  # this batch's own
                if elsewhere:  # its own pages are out of _storing: no two wait on each other
                    self._stored.wait_for(
                        lambda: self._closed or not (elsewhere & self._storing),
                        _STORE_WAIT_S,
                    )
        if stored:
            self._notify_keys_stored(
                [entry.key for entry in stored], [entry.size_bytes for entry in stored]
            )
        return L2StoreResult(success, sum(entry.size_bytes for entry in stored))

    def _lookup_and_lock(self, keys: list[ObjectKey]) -> Bitmap:
        """Pin every key the store has; the bitmap marks the pinned ones."""
        raws = [page_key(key) for key in keys]
        bitmap = Bitmap(len(keys))
        vanished: list[_Entry] = []
        with self._lock:  # so that no delete decides between our check and our pin
            pinned = self.store.pin_many(raws)
            for index, (raw, ok) in enumerate(zip(raws, pinned, strict=True)):
                if ok:
                    bitmap.set(index)
                elif raw in self._entries:
                    vanished.append(self._entries.pop(raw))
        self._report_deleted(vanished)
        return bitmap

    def _load(self, keys: list[ObjectKey], objects: list[Any]) -> Bitmap:
        """Fill each caller buffer with its verified page; a bit per filled buffer."""
        bitmap = Bitmap(len(keys))
        wanted: list[tuple[int, bytes, memoryview]] = []
        for index, (key, obj) in enumerate(zip(keys, objects, strict=True)):
            raw = page_key(key)
            info = self.store.info(raw)
            if info is None:
                continue
            target = memoryview(obj.byte_array).cast("B")
            if info.payload_bytes != target.nbytes:
                _log.warning(
                    "kvstore L2 adapter: page %r is %d bytes, its buffer %d; a miss",
                    raw,
                    info.payload_bytes,
                    target.nbytes,
                )
                continue
            wanted.append((index, raw, target))
        results = self._read_into(wanted)
        hits: list[ObjectKey] = []
        for (index, _, target), size in zip(wanted, results, strict=True):
            if size == target.nbytes:
                bitmap.set(index)
                hits.append(keys[index])
        if hits:
            self._notify_keys_accessed(hits)
        return bitmap

    def _read_into(self, wanted: list[tuple[int, bytes, memoryview]]) -> list[int | None]:
        """Bytes read per page. A batch with a bad page is redone page by page, so
        one corrupt page costs only its own bit; the bad page is deleted."""
        if not wanted:
            return []
        try:
            return self.store.get_many_into(
                [raw for _, raw, _ in wanted], [target for _, _, target in wanted]
            )
        except (KVStoreError, ValueError):  # ValueError: a page replaced meanwhile
            pass
        results: list[int | None] = []
        for _, raw, target in wanted:
            try:
                results.append(self.store.get_into(raw, target))
            except CorruptionError:
                _log.error("kvstore L2 adapter: page %r failed its checksum; deleting it", raw)
                self._drop_corrupt(raw)
                results.append(None)
            except (KVStoreError, ValueError):
                _log.exception("kvstore L2 adapter: read of %r failed; a miss", raw)
                results.append(None)
        return results

    def _drop_corrupt(self, raw: bytes) -> None:
        """Delete a page that cannot be read (locked or not: it can never be loaded)."""
        with self._lock:
            entry = self._entries.pop(raw, None)
            try:
                self.store.delete(raw)
            except KVStoreError:
                _log.exception("kvstore L2 adapter: could not delete %r", raw)
        if entry is not None:
            self._report_deleted([entry])

    # -- eviction and accounting -------------------------------------------------

    def delete(self, keys: list[ObjectKey]) -> None:
        """Delete the keys that are neither locked nor being stored; notify them."""
        if self._closed:
            return
        gone: list[_Entry] = []
        with self._lock:
            for key in keys:
                raw = page_key(key)
                if raw in self._storing or self.store.pin_count(raw) > 0:
                    continue
                entry = self._entries.pop(raw, None)
                self.store.delete(raw)
                if entry is not None:
                    gone.append(entry)
        self._report_deleted(gone)

    def _report_deleted(self, entries: list[_Entry]) -> None:
        if entries:
            self._notify_keys_deleted(
                [entry.key for entry in entries], [entry.size_bytes for entry in entries]
            )

    def _store_evictions(self) -> int:
        return self.store.telemetry_snapshot().counter("evicted_pages")

    def _reconcile(self, *, force: bool = False) -> None:
        """Report the pages the store evicted on its own (no more than once a second).

        The store evicts only when its disk budget runs out before LMCache's eviction
        controller acted (or when none is configured); this keeps ``get_usage`` and
        the controller's policy true to what is stored.
        """
        if self._closed:
            return
        now = time.monotonic()
        if not force and now - self._reconciled_at < _RECONCILE_INTERVAL_S:
            return
        self._reconciled_at = now
        evicted = self._store_evictions()
        if evicted == self._evicted_seen:
            return
        self._evicted_seen = evicted
        with self._lock:
            missing = [raw for raw in self._entries if raw not in self.store]
            gone = [self._entries.pop(raw) for raw in missing]
        self._report_deleted(gone)

    def get_usage(self) -> Any:
        self._reconcile()
        return super().get_usage()

    def list_l2_keys(
        self,
        model_name: str | None = None,
        page_size: int = 500,
        cursor: str | None = None,
    ) -> KeyListPage:
        """Stored keys in store-key order; the cursor is the last store key, in hex."""
        if page_size <= 0:
            raise ValueError(f"page_size must be positive (got {page_size})")
        after = b""
        if cursor is not None:
            try:
                after = bytes.fromhex(cursor)
            except ValueError:
                raise ValueError(f"malformed cursor {cursor!r}") from None
        self._reconcile()
        with self._lock:
            entries = sorted(
                (raw, entry)
                for raw, entry in self._entries.items()
                if raw > after and (model_name is None or entry.key.model_name == model_name)
            )
        page = entries[:page_size]
        next_token = page[-1][0].hex() if len(entries) > page_size else None
        return KeyListPage(
            entries=tuple(
                KeyEntry(key=entry.key.to_encoded_object_key(), size_bytes=entry.size_bytes)
                for _, entry in page
            ),
            next_page_token=next_token,
        )

    def report_status(self) -> dict[str, Any]:
        if self._closed:
            return {"is_healthy": False, "type": "KVStoreL2Adapter", "path": self.path}
        stats = self.store.stats()
        with self._lock:
            pages = len(self._entries)
            storing = len(self._storing)
        return {
            "is_healthy": not stats.degraded,
            "type": "KVStoreL2Adapter",
            "path": self.path,
            "pages": pages,
            "pages_being_stored": storing,
            "locked_pages": stats.pinned_pages,
            "live_bytes": stats.live_bytes,
            "capacity_bytes": stats.capacity_bytes,
            "evicted_by_store": stats.evictions,
            "degraded": stats.degraded,
            "degraded_reasons": list(stats.degraded_reasons),
            "io_threads": self.config.io_threads,
        }

    # -- lifecycle ---------------------------------------------------------------

    def close(self) -> None:
        """Finish submitted tasks, close the store (durable) and the event fds. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._stored.notify_all()  # a store waiting for another's pages: finish now
        self._executor.shutdown(wait=True)
        self.store.close()
        self._store_event.close()
        self._lookup_event.close()
        self._load_event.close()


def _open_store(config: KVStoreL2AdapterConfig) -> KVStore:
    try:
        return KVStore.open(
            config.path,
            create=True,
            capacity_bytes=config.capacity_bytes,
            **config.store_options,
        )
    except KVStoreError as e:
        _log.critical(
            "the kvstore L2 adapter cannot open its store at %s: %s. Repair it "
            "(`kvstore fsck %s`, then `kvstore recover %s`) or point path elsewhere",
            config.path,
            e,
            config.path,
            config.path,
        )
        raise

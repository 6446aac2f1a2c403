"""The NVMe tier: the tier manager's one way to the store, and its simulated twin.

``StoreTier`` owns the ``KVStore`` (opened with the manager, closed with it): page
writes and reads are tickets on the mover, retain/release/delete go to the store
under the manager's lock (non-blocking: WAL appends), and ``rebuild`` lists the
pages the manager wrote there (docs/tiering.md, "Restart"). ``SimulatedNvme`` is the
simulator's twin: the same calls, sized tickets on the fake mover, nothing stored.
``NoNvme`` is a manager without an NVMe tier. The manager holds one of the three and
never asks which.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path as FsPath
from typing import TYPE_CHECKING, Any

from kvstore.errors import KVStoreError
from kvstore.tiering.arena import SlotPool
from kvstore.tiering.completions import Read, WriteBack
from kvstore.tiering.config import TierConfig
from kvstore.tiering.mover_api import Mover, Priority
from kvstore.tiering.pages import PageRec
from kvstore.tiering.statsfile import STATS_FILE

if TYPE_CHECKING:
    from kvstore.store import KVStore

__all__ = ["META_TAG", "NoNvme", "NvmeTier", "SimulatedNvme", "StoreTier", "open_nvme"]

META_TAG = "kvt"  # marks an NVMe page written by the tier manager (value: format 1)
READ_CHUNK_PAGES = 8  # pages per NVMe read of a fetch (copies out start per chunk)


class NvmeTier:
    """The interface; also the tier of a manager without NVMe (every call a no-op)."""

    enabled = False
    capacity: int | None = None  # bytes; None: the store's capacity is unbounded
    store: KVStore | None = None
    stats_path: FsPath | None = None

    def write(
        self, recs: Sequence[PageRec], dram: SlotPool, priority: Priority, tag: WriteBack
    ) -> None:
        """Write the pages' DRAM copies (``rec.dram_slot``) as one ticket tagged ``tag``."""
        raise AssertionError("no NVMe tier: nothing is written back")

    def read(self, recs: Sequence[PageRec], dram: SlotPool, priority: Priority) -> None:
        """Read the pages into their DRAM slots: tickets tagged ``Read(chunk)``."""
        raise AssertionError("no NVMe tier: nothing is on NVMe")

    def retain(self, key: bytes) -> None:
        """Retain the page on the store (it survives the store's own eviction)."""

    def release(self, key: bytes) -> None:
        """Undo ``retain``; a page the store no longer has is no error."""

    def delete(self, key: bytes) -> None:
        """Delete the page (a WAL append); one the store no longer has is no error."""

    def rebuild(self, now: float, tokens_per_page: int) -> list[PageRec]:
        """The records of the pages the manager wrote to the store (at open)."""
        return []

    def close(self) -> None:
        pass


NoNvme = NvmeTier


class StoreTier(NvmeTier):
    """The NVMe tier on a ``KVStore`` it opens and closes."""

    enabled = True

    def __init__(self, config: TierConfig, mover: Mover, slot_bytes: int) -> None:
        from kvstore.store import KVStore

        assert config.nvme_path is not None
        options: dict[str, Any] = {"create": True, "max_page_bytes": slot_bytes}
        options.update(config.nvme_options)
        store = KVStore.open(config.nvme_path, **options)
        store_max = store.config.max_page_bytes
        if store_max < config.page_bytes:
            store.close()
            raise ValueError(
                f"the NVMe store at {config.nvme_path} takes pages of at most "
                f"{store_max} bytes (max_page_bytes), less than page_bytes="
                f"{config.page_bytes}: every write-back would fail"
            )
        self.store = store
        self._mover = mover
        self.stats_path = FsPath(config.nvme_path) / STATS_FILE
        self.capacity = (
            config.nvme_bytes if config.nvme_bytes is not None else store.config.capacity_bytes
        )

    def write(
        self, recs: Sequence[PageRec], dram: SlotPool, priority: Priority, tag: WriteBack
    ) -> None:
        items: list[tuple[bytes, Any, dict[str, Any] | None]] = []
        for rec in recs:
            meta = {
                META_TAG: 1,
                "parent": rec.parent.hex() if rec.parent is not None else None,
                "depth": rec.depth,
                "tokens": rec.tokens,
            }
            items.append((rec.key, dram.view(rec.dram_slot, rec.nbytes), meta))
        self._mover.nvme_write(self.store, items, priority=priority, tag=tag)

    def read(self, recs: Sequence[PageRec], dram: SlotPool, priority: Priority) -> None:
        # Reads of a few pages each: the first pages' copies out of DRAM run while
        # the later pages are still being read (one read would serialise them), and
        # the mover keeps several of them in flight on the store's pipeline.
        keys = [r.key for r in recs]
        views = [dram.view(r.dram_slot, r.nbytes) for r in recs]
        step = READ_CHUNK_PAGES
        for i in range(0, len(recs), step):
            self._mover.nvme_read(
                self.store,
                keys[i : i + step],
                views[i : i + step],
                priority=priority,
                tag=Read(list(recs[i : i + step])),
            )

    def retain(self, key: bytes) -> None:
        assert self.store is not None
        self.store.retain(key)

    def release(self, key: bytes) -> None:
        assert self.store is not None
        with contextlib.suppress(KVStoreError):
            self.store.release(key)

    def delete(self, key: bytes) -> None:
        assert self.store is not None
        with contextlib.suppress(KVStoreError):
            self.store.delete(key)

    def rebuild(self, now: float, tokens_per_page: int) -> list[PageRec]:
        store = self.store
        assert store is not None
        found: list[PageRec] = []
        for key in store.keys():  # noqa: SIM118 (KVStore is not a Mapping)
            info = store.info(key)
            if info is None:
                continue
            meta = info.meta
            if meta.get(META_TAG) != 1:
                continue
            parent_hex = meta.get("parent")
            parent = bytes.fromhex(parent_hex) if isinstance(parent_hex, str) else None
            depth = meta.get("depth")
            tokens = meta.get("tokens")
            rec = PageRec(
                key,
                parent,
                depth if isinstance(depth, int) else 0,
                tokens if isinstance(tokens, int) else tokens_per_page,
                info.payload_bytes,
                now,
            )
            rec.retained = store.is_retained(key)
            found.append(rec)
        return found

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


class SimulatedNvme(NvmeTier):
    """The simulator's NVMe tier: sized tickets on the fake mover, nothing stored."""

    enabled = True

    def __init__(self, mover: Mover, capacity: int) -> None:
        self._mover = mover
        self.capacity = capacity

    def write(
        self, recs: Sequence[PageRec], dram: SlotPool, priority: Priority, tag: WriteBack
    ) -> None:
        items: list[tuple[bytes, Any, dict[str, Any] | None]] = [(r.key, None, None) for r in recs]
        sizes = [r.nbytes for r in recs]
        self._mover.nvme_write(None, items, priority=priority, tag=tag, sizes=sizes)

    def read(self, recs: Sequence[PageRec], dram: SlotPool, priority: Priority) -> None:
        batch = list(recs)
        self._mover.nvme_read(
            None,
            [r.key for r in batch],
            (),
            priority=priority,
            tag=Read(batch),
            sizes=[r.nbytes for r in batch],
        )


def open_nvme(config: TierConfig, mover: Mover, slot_bytes: int, *, simulated: bool) -> NvmeTier:
    """The NVMe tier ``config`` asks for: a store at ``nvme_path``, the simulator's
    twin (``nvme_bytes`` with the fake mover), or none."""
    if config.nvme_path is not None:
        return StoreTier(config, mover, slot_bytes)
    if simulated and config.nvme_bytes:
        return SimulatedNvme(mover, config.nvme_bytes)
    return NoNvme()

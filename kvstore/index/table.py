"""The page table: LMDB as of the last checkpoint, plus in-memory overlays.

Lookups go: active overlay -> frozen overlay (being checkpointed) -> LMDB.
Every change lands in the active overlay first; a checkpoint freezes it,
writes it to LMDB in one transaction together with the new
``checkpoint_lsn``, then drops it.

Entries carry the LSN of the operation that made them, and a change only
applies if it is newer than what is there ("newer LSN wins"), so concurrent
puts of one key, and WAL replay, agree with the order LSNs were issued in.

Mutations are serialised by the store's lock; lookups may run on any thread.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from kvstore.errors import CorruptionError
from kvstore.format.entries import (
    EntryLimits,
    PageEntry,
    SegmentEntry,
    decode_page_entry,
    decode_segment_entry,
    encode_page_entry,
    encode_segment_entry,
    segment_key,
    validate_page_entry,
)
from kvstore.index.lmdb_env import IndexEnv, decode_meta_u64, encode_meta_u64, lmdb_read_errors
from kvstore.index.rules import delete_applies, put_applies

__all__ = ["META_CHECKPOINT_LSN", "PageTable", "SegmentState", "Tombstone"]

META_CHECKPOINT_LSN = b"checkpoint_lsn"  # first LSN of the WAL file replay starts from
META_LSN_LEASE = b"lsn_lease"  # LSNs below this may be in use on disk
META_PAGE_COUNT = b"page_count"
META_NEXT_SEGMENT = b"next_segment_id"


@dataclass(frozen=True, slots=True)
class Tombstone:
    """A delete not yet checkpointed; hides older entries of the key."""

    lsn: int


Slot = PageEntry | Tombstone


@dataclass(slots=True)
class SegmentState:
    """Running accounting for one segment (persisted at each checkpoint)."""

    generation: int
    head_bytes: int
    live_bytes: int
    live_pages: int
    created_unix_ns: int
    state: int

    def to_entry(self) -> SegmentEntry:
        return SegmentEntry(
            self.generation,
            self.head_bytes,
            self.live_bytes,
            self.live_pages,
            self.created_unix_ns,
            self.state,
        )

    @classmethod
    def from_entry(cls, entry: SegmentEntry) -> SegmentState:
        return cls(
            entry.generation,
            entry.head_bytes,
            entry.live_bytes,
            entry.live_pages,
            entry.created_unix_ns,
            entry.state,
        )


class PageTable:
    """The live page entries. With ``limits``, entries read from LMDB are checked
    against the store's geometry before anyone sizes a read by them."""

    def __init__(self, env: IndexEnv, limits: EntryLimits | None = None) -> None:
        self.env = env
        self.limits = limits
        self.active: dict[bytes, Slot] = {}
        self.frozen: dict[bytes, Slot] | None = None
        self._epoch = 0
        # Entries read ahead from LMDB for WAL replay (keys in sorted order, one
        # transaction): replay then never pays a random LMDB lookup per record.
        self._replay_base: dict[bytes, PageEntry | None] | None = None
        self.unreadable_on_replay: list[bytes] = []  # LMDB values replay could not decode
        with env.read() as txn:
            self.page_count = env.get_meta(txn, META_PAGE_COUNT, 0)

    # -- lookups -----------------------------------------------------------

    def _slot(self, key: bytes) -> Slot | None:
        while True:
            epoch = self._epoch
            active, frozen = self.active, self.frozen
            slot = active.get(key)
            if slot is None and frozen is not None:
                slot = frozen.get(key)
            if slot is None:
                base = self._replay_base
                if base is not None and key in base:
                    return base[key]
                raw = self._lmdb_get(key)
                slot = None if raw is None else self._decode(key, raw)
            if epoch == self._epoch:
                return slot

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` has a live entry; an LMDB entry is found, not decoded."""
        while True:
            epoch = self._epoch
            active, frozen = self.active, self.frozen
            slot = active.get(key)
            if slot is None and frozen is not None:
                slot = frozen.get(key)
            if slot is not None:
                found = isinstance(slot, PageEntry)
            else:
                base = self._replay_base
                if base is not None and key in base:
                    return base[key] is not None
                found = self._lmdb_get(key) is not None
            if epoch == self._epoch:
                return found

    def _lmdb_get(self, key: bytes) -> bytes | None:
        """The checkpointed value of ``key``: one short read transaction, no wrappers
        (a read-only view's pinned transaction, when it has one)."""
        if self.env.pinned:
            with lmdb_read_errors(self.env.path):
                return self.env.get_pinned(key, self.env.pages)
        try:
            txn = self.env.env.begin(write=False, buffers=False)
            try:
                raw: bytes | None = txn.get(key, db=self.env.pages)
            finally:
                txn.abort()
        except lmdb.Error:
            with lmdb_read_errors(self.env.path):
                raise
        return raw

    def prefetch_for_replay(self, keys: set[bytes]) -> None:
        """Read the checkpointed entries of ``keys`` in key order, in one transaction.

        For a long replay, first ask the kernel to read the LMDB file ahead
        (sequentially): on a cold page cache, one streaming read beats ~10^5
        random B-tree page faults.
        """
        if len(keys) >= 10_000:
            _read_ahead(self.env.path / "data.mdb")
        base: dict[bytes, PageEntry | None] = {}
        with self.env.read() as txn, lmdb_read_errors(self.env.path):
            cursor = txn.cursor(db=self.env.pages)
            for key in sorted(keys):
                raw = cursor.get(key)
                try:
                    base[key] = None if raw is None else self._decode(key, raw)
                except CorruptionError:
                    # Its checkpointed state is unknown: replay sees no entry (a WAL
                    # put newer than it still applies; a move of it does not), so the
                    # page is at worst a miss, never an older version.
                    base[key] = None
                    self.unreadable_on_replay.append(key)
        self._replay_base = base

    def _decode(self, key: bytes, raw: bytes) -> PageEntry:
        entry = decode_page_entry(key, raw)
        return entry if self.limits is None else validate_page_entry(key, entry, self.limits)

    def end_replay(self) -> None:
        self._replay_base = None

    def state(self, key: bytes) -> Slot | None:
        """The key's live entry, its delete not yet checkpointed, or None (absent)."""
        return self._slot(key)

    def get(self, key: bytes) -> PageEntry | None:
        slot = self._slot(key)
        return slot if isinstance(slot, PageEntry) else None

    def __len__(self) -> int:
        return self.page_count

    def keys(self) -> Iterator[bytes]:
        """Every live key: a snapshot of the overlays merged with an LMDB scan."""
        overlay: dict[bytes, Slot] = {}
        frozen = self.frozen
        if frozen is not None:
            overlay.update(frozen)
        overlay.update(self.active)
        for key, _ in self.env.iter_items(self.env.pages, values=False):
            if key not in overlay:
                yield key
        for key, slot in overlay.items():
            if isinstance(slot, PageEntry):
                yield key

    def items(self) -> Iterator[tuple[bytes, PageEntry]]:
        for key in self.keys():
            entry = self.get(key)
            if entry is not None:
                yield key, entry

    # -- mutations (caller holds the store lock) --------------------------

    def put(self, key: bytes, entry: PageEntry) -> tuple[bool, PageEntry | None]:
        """Apply a put if newer. Returns (applied, replaced live entry)."""
        old = self._slot(key)
        if not put_applies(old, entry.lsn):
            return False, None
        self.active[key] = entry
        if isinstance(old, PageEntry):
            return True, old
        self.page_count += 1
        return True, None

    def delete(self, key: bytes, lsn: int) -> PageEntry | None:
        """Apply a delete if newer; returns the entry it removed, if any."""
        old = self._slot(key)
        if not isinstance(old, PageEntry) or not delete_applies(old, lsn):
            return None
        self.active[key] = Tombstone(lsn)
        self.page_count -= 1
        return old

    # -- checkpoint --------------------------------------------------------

    def freeze(self) -> dict[bytes, Slot]:
        """Move the active overlay aside for checkpointing (caller holds the lock)."""
        assert self.frozen is None, "a checkpoint is already in progress"
        frozen = self.active
        self.frozen = frozen
        self.active = {}
        self._epoch += 1
        return frozen

    def thaw(self, frozen: dict[bytes, Slot]) -> None:
        """Undo ``freeze`` after a failed checkpoint: newer changes stay on top."""
        self.active = {**frozen, **self.active}
        self.frozen = None
        self._epoch += 1

    def commit_frozen(
        self,
        frozen: dict[bytes, Slot],
        segments: dict[int, SegmentState],
        dropped_segments: list[int],
        meta: dict[bytes, int],
        retains: set[bytes] | None = None,
    ) -> None:
        """Write the frozen overlay, segment states, meta and retains in one transaction."""

        def body(txn: Any) -> None:
            for key, slot in frozen.items():
                if isinstance(slot, PageEntry):
                    txn.put(key, encode_page_entry(key, slot), db=self.env.pages)
                else:
                    txn.delete(key, db=self.env.pages)
            for segment_id, state in segments.items():
                txn.put(
                    segment_key(segment_id),
                    encode_segment_entry(segment_id, state.to_entry()),
                    db=self.env.segments,
                )
            for segment_id in dropped_segments:
                txn.delete(segment_key(segment_id), db=self.env.segments)
            for key, value in meta.items():
                txn.put(key, encode_meta_u64(key, value), db=self.env.meta)
            if retains is not None:
                txn.drop(self.env.retains, delete=False)
                for key in retains:
                    txn.put(key, encode_meta_u64(key, 1), db=self.env.retains)

        self.env.write(body)
        self.frozen = None
        self._epoch += 1


def load_segments(env: IndexEnv) -> dict[int, SegmentState]:
    """Every segment in the ``segments`` database, verified."""
    found: dict[int, SegmentState] = {}
    with env.read() as txn, lmdb_read_errors(env.path):
        cursor = txn.cursor(db=env.segments)
        for raw_key, raw_value in cursor:
            segment_id = int.from_bytes(raw_key, "big")
            # A damaged B-tree can hand back a key of any length: check it before
            # packing the id back (an id of 2**64 or more does not pack).
            if len(raw_key) != 8 or raw_key != segment_key(segment_id):
                raise CorruptionError(f"segment table has a malformed key {raw_key!r}")
            found[segment_id] = SegmentState.from_entry(decode_segment_entry(segment_id, raw_value))
    return found


def load_retains(env: IndexEnv) -> set[bytes]:
    """Every persistently retained key, verified."""
    found: set[bytes] = set()
    with env.read() as txn, lmdb_read_errors(env.path):
        for raw_key, raw_value in txn.cursor(db=env.retains):
            key = bytes(raw_key)
            decode_meta_u64(key, raw_value)
            found.add(key)
    return found


def _read_ahead(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        size = os.fstat(fd).st_size
        if size > _READ_AHEAD_LIMIT_BYTES:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            return
        chunk = bytearray(4 << 20)
        offset = 0
        while offset < size:  # a streaming read fills the page cache in one pass
            count = os.preadv(fd, [chunk], offset)
            if count <= 0:
                break
            offset += count
    except OSError:
        pass
    finally:
        os.close(fd)


_READ_AHEAD_LIMIT_BYTES = 2 << 30

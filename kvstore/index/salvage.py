"""Salvage a damaged LMDB index: what still verifies, into a new environment.

When the structural walk (kvstore/index/lmdb_verify.py) finds ``data.mdb``
damaged, LMDB must not read it (it trusts its pages and could fault, or follow a
damaged pointer into a freed page that still holds older versions). Instead this
module reads the file itself:

- The current meta page is the one of the higher of two *consecutive*
  transaction ids (LMDB writes transaction t's meta to page ``t % 2``); if that
  cannot be told, nothing is taken from the file.
- From it, every page reachable in the main database and the named databases
  (``pages``, ``segments``, ``meta``, ``retains``, ``telemetry``) whose header
  and nodes lie inside the file is read; a damaged page is skipped with its
  subtree. A page LMDB's free lists name is never used: a damaged pointer that
  leads into a freed page would bring back older versions.
- Every value kvstore stores carries an xxh3 over its key and value, so a node
  is kept only if that checksum verifies; page entries must also fit the store's
  geometry. Telemetry values are copied as they are (their loader verifies them).

The result is written into a fresh LMDB environment, with the segment
accounting recomputed from the kept pages and, if the segment table lost
entries, segments adopted from their own file headers. What could not be kept
is counted, never guessed: a lost page entry is a miss.
"""

from __future__ import annotations

import os
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.errors import CorruptionError, KVStoreError
from kvstore.format.constants import BLOCK_BYTES, SEQUENCE_LIMIT
from kvstore.format.entries import (
    SEGMENT_ACTIVE,
    SEGMENT_SEALED,
    EntryLimits,
    SegmentEntry,
    decode_page_entry,
    decode_segment_entry,
    encode_segment_entry,
    segment_key,
    validate_page_entry,
)
from kvstore.format.names import parse_wal_name
from kvstore.format.records import Superblock, decode_segment_header
from kvstore.index.lmdb_env import IndexEnv, decode_meta_u64, encode_meta_u64
from kvstore.index.table import (
    META_CHECKPOINT_LSN,
    META_LSN_LEASE,
    META_NEXT_SEGMENT,
    META_PAGE_COUNT,
)
from kvstore.log.regular import open_regular, read_regular

__all__ = ["LEASE_MARGIN", "IndexSalvage", "read_sound_entries", "salvage_index"]

_HEADER = 16
_META = struct.Struct("<IIQQ")
_DB = struct.Struct("<IHHQQQQQ")
_MAGIC = 0xBEEFC0DE
_P_BRANCH, _P_LEAF, _P_OVERFLOW, _P_META, _P_LEAF2 = 0x01, 0x02, 0x04, 0x08, 0x20
_F_BIGDATA, _F_SUBDATA, _F_DUPDATA = 0x01, 0x02, 0x04
_P_INVALID = (1 << 64) - 1
_TELEMETRY_DB = b"telemetry"
LEASE_MARGIN = 1 << 40
"""LSNs skipped when the index's LSN lease is lost: a crashed writer may have stamped
records with LSNs below a lease it took before the checkpoint."""


@dataclass(slots=True)
class _Found:
    """The (key, value) pairs read from sound pages, per named database."""

    databases: dict[bytes, list[tuple[bytes, bytes]]] = field(default_factory=dict)
    complete: set[bytes] = field(default_factory=set)  # databases with no damaged page
    problems: list[str] = field(default_factory=list)
    current_meta: int | None = None
    entry_counts: dict[bytes, int] = field(default_factory=dict)  # as the tree's records say


class _Reader:
    def __init__(self, data: bytes, page_bytes: int, found: _Found) -> None:
        self.data = data
        self.page_bytes = page_bytes
        self.pages = len(data) // page_bytes
        self.found = found
        self.free: set[int] = set()
        self.seen: set[int] = set()

    def bad(self, message: str) -> None:
        if len(self.found.problems) < 50:
            self.found.problems.append(message)

    def walk(self, root: int, what: str) -> tuple[list[tuple[bytes, bytes, int]], bool]:
        """Leaf (key, value, node flags) of the tree at ``root``; and whether every page
        of it was sound."""
        out: list[tuple[bytes, bytes, int]] = []
        if root == _P_INVALID:
            return out, True
        sound = True
        todo = [root]
        while todo:
            pgno = todo.pop()
            if not 2 <= pgno < self.pages or pgno in self.seen:
                self.bad(f"{what}: page {pgno} is outside the file or reached twice")
                sound = False
                continue
            if pgno in self.free:
                self.bad(f"{what}: page {pgno} is on a free list (a damaged pointer)")
                sound = False
                continue
            self.seen.add(pgno)
            sound = self._page(pgno, what, todo, out) and sound
        return out, sound

    def _page(
        self, pgno: int, what: str, todo: list[int], out: list[tuple[bytes, bytes, int]]
    ) -> bool:
        data, page_bytes = self.data, self.page_bytes
        base = pgno * page_bytes
        stored, _, flags, lower, upper = struct.unpack_from("<QHHHH", data, base)
        if (
            stored != pgno
            or flags & (_P_OVERFLOW | _P_LEAF2)
            or not flags & (_P_BRANCH | _P_LEAF)
            or not _HEADER <= lower <= upper <= page_bytes
            or lower % 2
        ):
            self.bad(f"{what}: page {pgno} has a damaged header")
            return False
        sound = True
        for slot in range((lower - _HEADER) // 2):
            (node_at,) = struct.unpack_from("<H", data, base + _HEADER + 2 * slot)
            if node_at < upper or node_at % 2 or node_at + 8 > page_bytes:
                sound = False
                continue
            lo, hi, node_flags, key_bytes = struct.unpack_from("<HHHH", data, base + node_at)
            key_at = base + node_at + 8
            value_at = key_at + key_bytes
            if value_at > base + page_bytes:
                sound = False
                continue
            if flags & _P_BRANCH:
                todo.append(lo | hi << 16 | node_flags << 32)
                continue
            size = lo | hi << 16
            if node_flags & _F_DUPDATA:
                sound = False
                continue
            if node_flags & _F_BIGDATA:
                value = self._overflow(data, value_at, base + page_bytes, size)
                if value is None:
                    sound = False
                    continue
            elif value_at + size > base + page_bytes:
                sound = False
                continue
            else:
                value = data[value_at : value_at + size]
            out.append((data[key_at:value_at], value, node_flags))
        if not sound:
            self.bad(f"{what}: page {pgno} has damaged nodes (the sound ones are kept)")
        return sound

    def _overflow(self, data: bytes, value_at: int, page_end: int, size: int) -> bytes | None:
        if value_at + 8 > page_end:
            return None
        (first,) = struct.unpack_from("<Q", data, value_at)
        if not 2 <= first < self.pages or first in self.free:
            return None
        base = first * self.page_bytes
        stored, _, flags, count = struct.unpack_from("<QHHI", data, base)
        if (
            stored != first
            or not flags & _P_OVERFLOW
            or first + count > self.pages
            or size > count * self.page_bytes - _HEADER
        ):
            return None
        return data[base + _HEADER : base + _HEADER + size]


def _metas(data: bytes, page_bytes: int) -> list[tuple[int, int, tuple[Any, ...], bool]]:
    """(txnid, page, database records, intact) of both meta pages."""
    metas = []
    for pgno in (0, 1):
        base = pgno * page_bytes
        magic, version, _, _ = _META.unpack_from(data, base + _HEADER)
        (flags,) = struct.unpack_from("<H", data, base + 10)
        at = base + _HEADER + _META.size
        dbs = tuple(_DB.unpack_from(data, at + index * _DB.size) for index in (0, 1))
        _, txnid = struct.unpack_from("<QQ", data, at + 2 * _DB.size)
        intact = magic == _MAGIC and version == 1 and bool(flags & _P_META)
        metas.append((txnid, pgno, dbs, intact))
    return metas


def _names_databases(data: bytes, pgno: int, page_bytes: int) -> bool:
    """Whether page ``pgno`` is a leaf whose nodes all name kvstore's databases."""
    base = pgno * page_bytes
    _, _, flags, lower, upper = struct.unpack_from("<QHHHH", data, base)
    if flags != _P_LEAF or not _HEADER < lower <= upper <= page_bytes or lower % 2:
        return False
    for slot in range((lower - _HEADER) // 2):
        (node_at,) = struct.unpack_from("<H", data, base + _HEADER + 2 * slot)
        if node_at < upper or node_at + 8 > page_bytes:
            return False
        _, _, node_flags, key_bytes = struct.unpack_from("<HHHH", data, base + node_at)
        key = data[base + node_at + 8 : base + node_at + 8 + key_bytes]
        if not node_flags & _F_SUBDATA or key not in _DATABASES:
            return False
    return True


_DATABASES = frozenset({b"pages", b"segments", b"meta", b"retains", _TELEMETRY_DB})


def _read_tree(
    data: bytes, page_bytes: int, dbs: tuple[Any, ...], other_main_root: int | None = None
) -> _Found:
    """The named databases of the tree a meta page's records root."""
    found = _Found()
    reader = _Reader(data, page_bytes, found)
    free_nodes, free_sound = reader.walk(dbs[0][7], "free database")
    for _, value, _ in free_nodes:
        ids = [value[i : i + 8] for i in range(0, len(value) - len(value) % 8, 8)]
        reader.free.update(int.from_bytes(raw, "little") for raw in ids[1:])
    if not free_sound:
        found.problems.append(
            "the free lists are damaged: pages they should name could be followed"
        )
    reader.seen.clear()
    main, main_sound = reader.walk(dbs[1][7], "main database")
    if not main and other_main_root is not None:
        # The root itself is damaged (a flipped page number, say). The main database
        # is one leaf naming the others; the current one is the only such leaf that
        # no free list names and that the other meta page does not root.
        candidates = [
            pgno
            for pgno in range(2, reader.pages)
            if pgno not in reader.free
            and pgno != other_main_root
            and _names_databases(data, pgno, page_bytes)
        ]
        if len(candidates) == 1:
            found.problems.append(
                f"the main database root was damaged; found it at page {candidates[0]}"
            )
            reader.seen.clear()
            main, main_sound = reader.walk(candidates[0], "main database")
    for name, value, flags in main:
        if not flags & _F_SUBDATA or len(value) != _DB.size:
            continue
        record = _DB.unpack(value)
        found.entry_counts[name] = record[6]
        nodes, sound = reader.walk(record[7], f"database {name!r}")
        found.databases[name] = [(key, value) for key, value, _ in nodes]
        if sound and main_sound:
            found.complete.add(name)
    return found


def _checkpoint_of(found: _Found) -> int | None:
    for key, value in found.databases.get(b"meta", []):
        if key == META_CHECKPOINT_LSN:
            try:
                return decode_meta_u64(key, value)
            except CorruptionError:
                return None
    return None


def read_sound_entries(path: Path, page_bytes: int = 4096) -> _Found:
    """Every (key, value) of the current tree's named databases found in sound pages.

    The current tree is the meta page of the higher of two consecutive transaction
    ids. When one id is damaged (they are not consecutive), both trees are read:
    the one with the higher ``checkpoint_lsn`` is the newer (checkpoints only move
    forward); two trees of the same checkpoint hold the same page table (only
    telemetry or removals of undecodable values come between them). If that
    cannot be told either, nothing is taken.
    """
    fd = open_regular(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, size, 0) if size else b""
    finally:
        os.close(fd)
    if len(data) < 2 * page_bytes:
        found = _Found()
        found.problems.append(f"{path.name} is shorter than its two meta pages")
        return found
    metas = _metas(data, page_bytes)
    (t0, _, _, _), (t1, _, _, _) = metas
    if abs(t0 - t1) == 1 and t0 % 2 == 0 and t1 % 2 == 1:
        _, pgno, dbs, intact = max(metas)
        found = _read_tree(data, page_bytes, dbs, metas[1 - pgno][2][1][7])
        if not intact:
            found.problems.insert(0, f"meta page {pgno} (the current one) is damaged")
        found.current_meta = pgno
        if b"pages" not in found.entry_counts:  # only to count what is lost
            older = _read_tree(data, page_bytes, metas[1 - pgno][2])
            if b"pages" in older.entry_counts:
                found.entry_counts[b"pages"] = older.entry_counts[b"pages"]
        return found
    trees = [(_read_tree(data, page_bytes, dbs), pgno) for _, pgno, dbs, _ in metas]
    marks = [_checkpoint_of(tree) for tree, _ in trees]
    problem = f"meta pages name transactions {t0} and {t1}: not consecutive"
    first, second = marks
    if first is not None and second is not None:
        chosen, pgno = trees[0] if first >= second else trees[1]
        chosen.problems.insert(
            0, f"{problem}; the tree of meta page {pgno} holds the newer checkpoint"
        )
        chosen.current_meta = pgno
        return chosen
    found = _Found()
    found.problems.append(f"{problem}, and which tree is current cannot be told")
    # Only to count what is lost: the larger page table of the two.
    found.entry_counts[b"pages"] = max(tree.entry_counts.get(b"pages", 0) for tree, _ in trees)
    return found


@dataclass(slots=True)
class IndexSalvage:
    """What ``salvage_index`` kept of a damaged index, and what it could not."""

    problems: list[str]
    pages_kept: int = 0
    pages_expected: int | None = None  # page_count at the checkpoint, if it survived
    pages_bad: int = 0  # entries found but failing their checksum or geometry
    segments_kept: int = 0
    segments_adopted: int = 0  # from their file headers (the segment table lost them)
    retains_kept: int = 0
    meta_lost: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def pages_lost(self) -> int:
        """Page entries the index had that were not kept (a lower bound when unknown)."""
        lost = self.pages_bad
        if self.pages_expected is not None:
            lost = max(lost, self.pages_expected - self.pages_kept)
        return lost

    def summary(self) -> str:
        parts = [f"kept {self.pages_kept} page entries"]
        if self.pages_lost:
            parts.append(f"lost {self.pages_lost} (now misses)")
        if self.segments_adopted:
            parts.append(f"{self.segments_adopted} segments adopted from their headers")
        if self.meta_lost:
            parts.append(f"rebuilt {', '.join(self.meta_lost)}")
        return "; ".join(parts)


def salvage_index(
    source: Path, target: Path, root: Path, superblock: Superblock, problems: list[str]
) -> IndexSalvage:
    """Write what verifies of the index at ``source`` (a ``data.mdb``) into a new
    LMDB environment at ``target`` (a directory that must not exist yet)."""
    report = IndexSalvage(list(problems))
    found = read_sound_entries(source)
    report.problems.extend(found.problems)
    limits = EntryLimits(superblock.segment_bytes, superblock.max_page_bytes)
    pages: dict[bytes, bytes] = {}
    live_bytes: Counter[int] = Counter()
    live_pages: Counter[int] = Counter()
    highest_lsn = 0
    for key, value in found.databases.get(b"pages", []):
        try:
            entry = validate_page_entry(key, decode_page_entry(key, value), limits)
        except CorruptionError:
            report.pages_bad += 1
            continue
        pages[key] = value
        live_bytes[entry.segment_id] += entry.span_bytes
        live_pages[entry.segment_id] += 1
        highest_lsn = max(highest_lsn, entry.lsn, entry.generation)
    report.pages_kept = len(pages)
    segments: dict[int, SegmentEntry] = {}
    for raw_key, value in found.databases.get(b"segments", []):
        segment_id = int.from_bytes(raw_key, "big")
        if len(raw_key) != 8 or raw_key != segment_key(segment_id):
            continue
        try:
            seg = decode_segment_entry(segment_id, value)
        except CorruptionError:
            continue
        if (
            segment_id >= SEQUENCE_LIMIT
            or seg.generation >= SEQUENCE_LIMIT
            or seg.head_bytes % BLOCK_BYTES
            or not BLOCK_BYTES <= seg.head_bytes <= superblock.segment_bytes
            or seg.state not in (SEGMENT_ACTIVE, SEGMENT_SEALED)
        ):
            continue  # sealed, yet no writer makes it: adopted from its header instead
        segments[segment_id] = seg
    report.segments_kept = len(segments)
    if b"segments" not in found.complete or len(segments) < len(
        found.databases.get(b"segments", [])
    ):
        report.segments_adopted = _adopt_segments(root, superblock, segments)
    meta: dict[bytes, int] = {}
    for key, value in found.databases.get(b"meta", []):
        try:
            number = decode_meta_u64(key, value)
        except CorruptionError:
            continue
        if number < SEQUENCE_LIMIT:
            meta[key] = number
    retains: list[bytes] = []
    for key, value in found.databases.get(b"retains", []):
        try:
            decode_meta_u64(key, value)
        except CorruptionError:
            continue
        retains.append(key)
    report.retains_kept = len(retains)
    # How many page entries there were: the checkpoint's count if it survived, else
    # what the tree's own record of the ``pages`` database says (a count, never used
    # to serve anything).
    report.pages_expected = meta.get(META_PAGE_COUNT, found.entry_counts.get(b"pages"))
    for segment_id, seg in segments.items():
        highest_lsn = max(highest_lsn, seg.generation)
        segments[segment_id] = SegmentEntry(
            seg.generation,
            seg.head_bytes,
            live_bytes[segment_id],
            live_pages[segment_id],
            seg.created_unix_ns,
            seg.state,
        )
    wal_lsns = _wal_names(root)
    if META_CHECKPOINT_LSN not in meta:
        if not wal_lsns:
            raise CorruptionError(
                f"the LMDB index of {root} lost its checkpoint and no WAL file is left to "
                "replay; run `kvstore recover PATH`"
            )
        # Replay from the oldest file: the chain is checked link by link, and replay
        # is idempotent (newer LSN wins), so starting early loses nothing.
        meta[META_CHECKPOINT_LSN] = wal_lsns[0]
        report.meta_lost.append("checkpoint_lsn (from the oldest WAL file)")
    if META_LSN_LEASE not in meta:
        lease = max([highest_lsn, meta[META_CHECKPOINT_LSN], *wal_lsns]) + LEASE_MARGIN
        meta[META_LSN_LEASE] = lease
        report.meta_lost.append("lsn_lease")
    next_id = max([0, *segments, *(e.segment_id for e in _entries(pages))]) + 1
    if META_NEXT_SEGMENT not in meta:
        report.meta_lost.append("next_segment_id")
    meta[META_NEXT_SEGMENT] = max(meta.get(META_NEXT_SEGMENT, 0), next_id)
    meta[META_PAGE_COUNT] = len(pages)
    if b"retains" not in found.complete:
        report.notes.append("some retains may be lost (those pages may be evicted)")
    _write(target, pages, segments, meta, retains, found.databases.get(_TELEMETRY_DB, []))
    return report


def _entries(pages: dict[bytes, bytes]) -> Any:
    for key, value in pages.items():
        yield decode_page_entry(key, value)


def _wal_names(root: Path) -> list[int]:
    try:
        names = os.listdir(root / "wal")
    except OSError:
        return []
    return sorted(lsn for lsn in map(parse_wal_name, names) if lsn is not None)


def _adopt_segments(root: Path, superblock: Superblock, segments: dict[int, SegmentEntry]) -> int:
    """Add every segment file with a sound header of this store that the table lacks.

    Sealed, its head at the end (nothing is ever written into it again); a file
    that no page names is freed by GC like any empty segment.
    """
    from kvstore.log.segments import list_segment_files

    adopted = 0
    try:
        files = list_segment_files(root)
    except OSError:
        return 0
    for segment_id, path in files.items():
        if segment_id in segments or segment_id >= SEQUENCE_LIMIT:
            continue
        try:
            header = decode_segment_header(read_regular(path, BLOCK_BYTES))
        except (KVStoreError, OSError):
            continue
        if header.store_uuid != superblock.store_uuid or header.segment_id != segment_id:
            continue
        segments[segment_id] = SegmentEntry(
            header.generation,
            superblock.segment_bytes,
            0,
            0,
            header.created_unix_ns,
            SEGMENT_SEALED,
        )
        adopted += 1
    return adopted


def _write(
    target: Path,
    pages: dict[bytes, bytes],
    segments: dict[int, SegmentEntry],
    meta: dict[bytes, int],
    retains: list[bytes],
    telemetry: list[tuple[bytes, bytes]],
) -> None:
    target.mkdir(mode=0o700)
    env = IndexEnv(target, readonly=False, create=True)
    try:
        telemetry_db = env.env.open_db(_TELEMETRY_DB, create=True) if telemetry else None

        def body(txn: Any) -> None:
            for key, value in pages.items():
                txn.put(key, value, db=env.pages)
            for segment_id, entry in segments.items():
                txn.put(
                    segment_key(segment_id),
                    encode_segment_entry(segment_id, entry),
                    db=env.segments,
                )
            for key, number in meta.items():
                txn.put(key, encode_meta_u64(key, number), db=env.meta)
            for key in retains:
                txn.put(key, encode_meta_u64(key, 1), db=env.retains)
            for key, value in telemetry:
                txn.put(key, value, db=telemetry_db)

        env.write(body)
        env.sync()
    finally:
        env.close()

"""Corruption sweep: inject bit flips and byte runs into every file kind of a
realistic store and prove each one is caught, with zero wrong reads.

One pristine store is built once (several segments, pages checkpointed into
LMDB and pages only in the WAL, deletes, overwrites, a retain, a WAL chain of
two files left by a crash). Each worker keeps a private copy; per injection it
flips the bytes in place, opens the store read-only (as ``kvstore fsck`` does),
reads every page, runs ``check(deep=True)``, closes, and writes the original
bytes back. A worker that dies (a segfault inside LMDB, say) is counted and
replaced; its copy is restored from the pristine store.

Every injected byte falls in one region class (``REGIONS``). A class either
*matters* (some read, open or recovery depends on the byte) or is *unused*
(padding after a payload, space past a segment's head, dead records, LMDB
free pages and the free gap inside LMDB pages, lock files): no read depends
on it, and the sweep checks that too (no wrong read may come from it). The
"100 % detected" claim is over injections into classes that matter.

Outcomes of one injection:

- ``refused-open``: ``KVStore.open`` raised a ``KVStoreError`` (only a damaged
  superblock should: the store's identity);
- ``degraded-open``: the store opened and ``stats().degraded`` says what it
  repaired, salvaged or quarantined (docs/operations.md, "Degraded open");
- ``detected-by-read``: some ``get`` raised a ``KVStoreError``;
- ``detected-by-fsck``: ``check(deep=True)`` (plus the recovery notes that
  ``kvstore fsck`` prints) reported a finding;
- ``wrong-read``: a ``get`` returned bytes other than the last acknowledged
  put, or bytes for a deleted key (must be 0);
- ``crash``: a non-``KVStoreError`` exception or a dead worker (must be 0);
- ``undetected``: none of the above (expected only for unused classes).

Usage::

    python tools/corruption_sweep.py --flips 100000 --seed 1 --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import random
import shutil
import struct
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore import KVStore
from kvstore.errors import KVStoreError
from kvstore.format.constants import BLOCK_BYTES, record_span
from kvstore.format.names import INDEX_DIR, SEGMENTS_DIR, WAL_DIR

SEGMENT_BYTES = 128 << 10
WORKER_BATCH = 200  # injections per worker process before a fresh one takes over
MAX_PAGE_BYTES = 32 << 10
LMDB_PAGE = 4096

# Region class -> (matters, sampling weight). Weights spread the injections over
# every file kind instead of letting large unused areas dominate.
REGIONS: dict[str, tuple[bool, float]] = {
    "superblock": (True, 4),
    "segment-header": (True, 8),
    "record-header": (True, 16),
    "payload": (True, 18),
    "wal-file-header": (True, 5),
    "wal-record": (True, 16),
    "lmdb-meta-page": (True, 4),
    "lmdb-used-page": (True, 14),
    "record-padding": (False, 4),
    "segment-dead-record": (False, 3),
    "segment-free-space": (False, 3),
    "lmdb-free-space": (False, 3),
    "lmdb-meta-unused": (False, 2),
    "lmdb-lock-file": (False, 1),
    "writer-lock-file": (False, 0.5),
}


@dataclass(frozen=True, slots=True)
class Region:
    kind: str
    path: str  # relative to the store root
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class Injection:
    index: int
    kind: str  # region class
    path: str
    offset: int
    mode: str  # "bit" or "run"
    bit: int = 0
    run: bytes = b""


@dataclass
class Expected:
    pages: dict[bytes, bytes]  # key -> the last acknowledged put
    deleted: set[bytes]  # acknowledged deletes
    older: dict[bytes, list[bytes]] = field(default_factory=dict)  # overwritten values

    def __repr__(self) -> str:  # the pages are megabytes; keep test reports short
        return f"Expected({len(self.pages)} pages, {len(self.deleted)} deleted)"


# -- building the pristine store ----------------------------------------------------


def _builder(root: str, seed: int, phase: int, queue: Any) -> None:
    """Child process: write one phase of the store, then die without closing."""
    try:
        rng = random.Random(seed * 10 + phase)
        store = KVStore.open(
            root,
            create=phase == 0,
            segment_bytes=SEGMENT_BYTES,
            max_page_bytes=MAX_PAGE_BYTES,
            gc_interval_s=0,
            checkpoint_interval_s=3600,
        )
        pages: dict[bytes, bytes] = {}
        deleted: list[bytes] = []
        prefix = f"p{phase}/"
        # Phases 0 and 1 checkpoint part-way (pages in LMDB and pages only in the
        # WAL); phase 2 writes only to the WAL, so the chain holds two files.
        for index in range(28 if phase < 2 else 8):
            key = f"{prefix}{index}".encode()
            value = rng.randbytes(rng.randint(1, 24_000))
            store.put(key, value, meta={"layer": index} if index % 3 == 0 else None)
            pages[key] = value
        for index in range(0, 28 if phase < 2 else 8, 5):
            key = f"{prefix}{index}".encode()
            store.delete(key)
            deleted.append(key)
            del pages[key]
        key = f"{prefix}1".encode()
        older = {key: [pages[key]]}
        pages[key] = rng.randbytes(5000)
        store.put(key, pages[key])  # an overwrite: the old record is dead
        store.retain(f"{prefix}2".encode())
        if phase < 2:
            store.checkpoint()
        for index in range(10):
            key = f"{prefix}wal/{index}".encode()
            pages[key] = rng.randbytes(rng.randint(1, 20_000))
            store.put(key, pages[key])
        for key in (f"{prefix}wal/3".encode(), f"{prefix}4".encode()):
            store.delete(key)
            deleted.append(key)
            del pages[key]
        store.flush()
        queue.put((pages, deleted, older))
    except BaseException:
        queue.put(traceback.format_exc())
    queue.close()
    queue.join_thread()  # the result must reach the parent before the "crash"
    os._exit(0)  # a crash: no checkpoint, the WAL keeps the last changes


def build_pristine(root: Path, seed: int, phases: int = 3) -> Expected:
    """Crash-interrupted phases: LMDB pages, WAL-only pages and (3 phases) a 2-file WAL chain."""
    context = multiprocessing.get_context("fork")
    expected = Expected({}, set())
    for phase in range(phases):
        queue = context.Queue()
        process = context.Process(target=_builder, args=(str(root), seed, phase, queue))
        process.start()
        result = queue.get(timeout=120)
        process.join()
        if isinstance(result, str):
            raise RuntimeError(f"building the store failed:\n{result}")
        pages, deleted, older = result
        expected.older.update(older)
        expected.pages.update(pages)
        expected.deleted.update(deleted)
        expected.deleted.difference_update(pages)
    # The crashed writer's spare segment (made ahead, never named by the WAL) is an
    # orphan that the next writer open removes; remove it so the baseline is clean.
    with KVStore.open(root, readonly=True) as store:
        known = set(store.segment_states())
    for entry in os.scandir(root / SEGMENTS_DIR):
        segment_id = int(entry.name.split(".")[0], 16)
        if segment_id not in known:
            os.unlink(entry.path)
    return expected


# -- region map ---------------------------------------------------------------------


def map_regions(root: Path) -> list[Region]:
    """Classify every byte of every file of the pristine store."""
    regions: list[Region] = []

    def add(kind: str, path: Path, start: int, end: int) -> None:
        if end > start:
            regions.append(Region(kind, str(path.relative_to(root)), start, end))

    add("superblock", root / "KVSTORE", 0, BLOCK_BYTES)
    lock = root / "LOCK"
    add("writer-lock-file", lock, 0, lock.stat().st_size)
    with KVStore.open(root, readonly=True) as store:
        states = {sid: state for sid, state in store.segment_states().items()}
        live: dict[int, list[tuple[int, int]]] = {}
        for key in store.keys():  # noqa: SIM118 (KVStore.keys, not a dict)
            entry = store.internals.entry(key)
            assert entry is not None
            live.setdefault(entry.segment_id, []).append((entry.offset, entry.payload_bytes))
        segment_paths = {sid: segment.path for sid, segment, _ in store.internals.segments()}
        wal_files = [(path, path.stat().st_size) for path in sorted((root / WAL_DIR).iterdir())]
    for segment_id, path in segment_paths.items():
        add("segment-header", path, 0, BLOCK_BYTES)
        cursor = BLOCK_BYTES
        for offset, payload_bytes in sorted(live.get(segment_id, [])):
            add("segment-dead-record", path, cursor, offset)
            add("record-header", path, offset, offset + BLOCK_BYTES)
            payload_end = offset + BLOCK_BYTES + payload_bytes
            add("payload", path, offset + BLOCK_BYTES, payload_end)
            span_end = offset + record_span(payload_bytes)
            add("record-padding", path, payload_end, span_end)
            cursor = span_end
        head = states[segment_id].head_bytes
        add("segment-dead-record", path, cursor, head)
        add("segment-free-space", path, max(cursor, head), path.stat().st_size)
    for path, size in wal_files:
        add("wal-file-header", path, 0, 64)
        add("wal-record", path, 64, size)
    lock_mdb = root / INDEX_DIR / "lock.mdb"
    add("lmdb-lock-file", lock_mdb, 0, lock_mdb.stat().st_size)
    regions.extend(_lmdb_regions(root, root / INDEX_DIR / "data.mdb"))
    return regions


_META = struct.Struct("<IIQQ")  # magic, version, address, mapsize
_DB = struct.Struct("<IHHQQQQQ")  # pad, flags, depth, branch, leaf, overflow, entries, root
_P_BRANCH, _P_LEAF, _P_OVERFLOW = 0x01, 0x02, 0x04
_F_BIGDATA, _F_SUBDATA = 0x01, 0x02
_P_INVALID = (1 << 64) - 1
_META_END = 16 + _META.size + 2 * _DB.size + 16  # + last_pg, txnid


def _lmdb_regions(root: Path, path: Path) -> list[Region]:
    """Meta pages, the used bytes of pages reachable from the current meta, and the rest.

    LMDB 0.9 on 64-bit Linux: a page starts with pgno u64, pad u16, flags u16,
    lower u16, upper u16 (overflow pages: page count u32 instead); nodes sit
    at [upper, page end), their u16 offsets at [16, lower).
    """
    data = path.read_bytes()
    pages = len(data) // LMDB_PAGE

    def meta(pgno: int) -> tuple[int, list[tuple[int, ...]]]:
        base = pgno * LMDB_PAGE + 16
        dbs = [_DB.unpack_from(data, base + _META.size + i * _DB.size) for i in range(2)]
        (txnid,) = struct.unpack_from("<Q", data, base + _META.size + 2 * _DB.size + 8)
        return txnid, dbs

    metas = [meta(0), meta(1)]
    _, dbs = max(metas, key=lambda item: item[0])
    used: dict[int, list[tuple[int, int]]] = {}  # pgno -> used byte ranges in the page
    roots = [db[7] for db in dbs]
    todo = [r for r in roots if r != _P_INVALID]
    seen: set[int] = set()
    while todo:
        pgno = todo.pop()
        if pgno in seen or pgno >= pages:
            continue
        seen.add(pgno)
        base = pgno * LMDB_PAGE
        (flags,) = struct.unpack_from("<H", data, base + 10)
        if flags & _P_OVERFLOW:
            (count,) = struct.unpack_from("<I", data, base + 12)
            for extra in range(count):
                used[pgno + extra] = [(0, LMDB_PAGE)]
            continue
        lower, upper = struct.unpack_from("<HH", data, base + 12)
        used[pgno] = [(0, lower), (upper, LMDB_PAGE)]
        for slot in range((lower - 16) // 2):
            (node_at,) = struct.unpack_from("<H", data, base + 16 + 2 * slot)
            node = base + node_at
            lo, hi, nflags, ksize = struct.unpack_from("<HHHH", data, node)
            if flags & _P_BRANCH:
                todo.append(lo | hi << 16 | nflags << 32)
            elif flags & _P_LEAF:
                value_at = node + 8 + ksize
                if nflags & _F_BIGDATA:
                    todo.append(struct.unpack_from("<Q", data, value_at)[0])
                elif nflags & _F_SUBDATA:
                    todo.append(_DB.unpack_from(data, value_at)[7])
    regions: list[Region] = []
    relative = str(path.relative_to(root))
    for pgno in range(pages):
        base = pgno * LMDB_PAGE
        if pgno < 2:
            regions.extend(_meta_regions(data, relative, pgno))
            continue
        ranges = used.get(pgno)
        if ranges is None:
            regions.append(Region("lmdb-free-space", relative, base, base + LMDB_PAGE))
            continue
        cursor = 0
        for start, end in ranges:
            if start > cursor:
                regions.append(Region("lmdb-free-space", relative, base + cursor, base + start))
            regions.append(Region("lmdb-used-page", relative, base + start, base + end))
            cursor = end
    return regions


_META_FIELDS = [
    (0, 8, "page-pgno"),
    (8, 10, "page-pad"),
    (10, 12, "page-flags"),
    (12, 16, "page-lower-upper"),
    (16, 20, "meta-magic"),
    (20, 24, "meta-version"),
    (24, 32, "meta-address"),
    (32, 40, "meta-mapsize"),
]
_DB_FIELDS = [
    (0, 4, "pad"),
    (4, 6, "flags"),
    (6, 8, "depth"),
    (8, 16, "branch-pages"),
    (16, 24, "leaf-pages"),
    (24, 32, "overflow-pages"),
    (32, 40, "entries"),
    (40, 48, "root"),
]


def lmdb_field(data: bytes, offset: int) -> str:
    """Name the LMDB structure a byte of ``data.mdb`` belongs to (for the report)."""
    pgno, at = divmod(offset, LMDB_PAGE)
    if pgno < 2:
        txnids = [struct.unpack_from("<Q", data, p * LMDB_PAGE + _META_END - 8)[0] for p in (0, 1)]
        which = "current" if txnids[pgno] >= txnids[1 - pgno] else "previous"
        for start, end, name in _META_FIELDS:
            if start <= at < end:
                return f"meta({which}).{name}"
        for index, db in enumerate(("free-db", "main-db")):
            base = 16 + _META.size + index * _DB.size
            for start, end, name in _DB_FIELDS:
                if base + start <= at < base + end:
                    return f"meta({which}).{db}.{name}"
        if at < _META_END - 8:
            return f"meta({which}).last-pgno"
        return f"meta({which}).txnid" if at < _META_END else "meta.unused"
    base = pgno * LMDB_PAGE
    (flags,) = struct.unpack_from("<H", data, base + 10)
    kind = "branch" if flags & _P_BRANCH else "leaf" if flags & _P_LEAF else f"flags{flags:#x}"
    for start, end, name in _META_FIELDS[:4]:
        if start <= at < end:
            return f"{kind}.{name}"
    lower, upper = struct.unpack_from("<HH", data, base + 12)
    if at < lower:
        return f"{kind}.node-offsets"
    if at < upper:
        return f"{kind}.free-gap"
    for slot in range((lower - 16) // 2):
        (node_at,) = struct.unpack_from("<H", data, base + 16 + 2 * slot)
        lo, hi, nflags, ksize = struct.unpack_from("<HHHH", data, base + node_at)
        data_bytes = 0 if flags & _P_BRANCH else lo | hi << 16
        if nflags & _F_BIGDATA:
            data_bytes = 8
        end = node_at + 8 + ksize + data_bytes
        if node_at <= at < end:
            part = at - node_at
            if part < 8:
                return f"{kind}.node-header"
            return f"{kind}.node-key" if part < 8 + ksize else f"{kind}.node-value"
    return f"{kind}.between-nodes"


def _meta_regions(data: bytes, relative: str, pgno: int) -> list[Region]:
    """Split a meta page into what LMDB reads to open and locate, and the rest.

    LMDB reads the page flags, magic, version and txnid of both meta pages (the
    higher txnid wins); of the current one also each database's flags and root
    and ``last_pgno``. The rest (page number and bounds, the map address and
    size, depth and page/entry counters, the previous meta's roots) feed
    statistics and ``mdb_stat`` only: "lmdb-meta-unused".
    """
    base = pgno * LMDB_PAGE
    regions: list[Region] = []
    for at in range(LMDB_PAGE):
        name = lmdb_field(data, base + at)
        used = name.endswith(("page-flags", "meta-magic", "meta-version", "txnid")) or (
            name.startswith("meta(current)") and name.endswith((".flags", ".root", "last-pgno"))
        )
        kind = "lmdb-meta-page" if used else "lmdb-meta-unused"
        if regions and regions[-1].kind == kind and regions[-1].end == base + at:
            regions[-1] = Region(kind, relative, regions[-1].start, base + at + 1)
        else:
            regions.append(Region(kind, relative, base + at, base + at + 1))
    return regions


def plan(
    regions: list[Region],
    count: int,
    seed: int,
    run_fraction: float,
    only: set[str] | None = None,
) -> list[Injection]:
    """``count`` injections: a region class by weight, then a uniform byte in it."""
    rng = random.Random(seed)
    by_kind: dict[str, list[Region]] = {}
    for region in regions:
        if only is not None and region.kind not in only:
            continue
        by_kind.setdefault(region.kind, []).append(region)
    kinds = [kind for kind in REGIONS if kind in by_kind]
    weights = [REGIONS[kind][1] for kind in kinds]
    sizes = {kind: [r.end - r.start for r in by_kind[kind]] for kind in kinds}
    injections = []
    for index in range(count):
        kind = rng.choices(kinds, weights)[0]
        region = rng.choices(by_kind[kind], sizes[kind])[0]
        offset = rng.randrange(region.start, region.end)
        if rng.random() < run_fraction:
            length = min(rng.randint(2, 64), region.end - offset)
            pattern = rng.choice(["zero", "ones", "random"])
            run = {
                "zero": bytes(length),
                "ones": b"\xff" * length,
                "random": rng.randbytes(length),
            }[pattern]
            injections.append(Injection(index, kind, region.path, offset, "run", run=run))
        else:
            injections.append(
                Injection(index, kind, region.path, offset, "bit", bit=rng.randrange(8))
            )
    return injections


# -- one injection ------------------------------------------------------------------


@dataclass
class Outcome:
    index: int
    kind: str
    mode: str
    path: str = ""
    offset: int = 0
    changed: bool = True  # False: a byte run that wrote what was already there
    refused_open: bool = False
    detected_by_read: bool = False
    detected_by_fsck: bool = False
    wrong_reads: int = 0  # bytes that were never put under the key
    resurrected: int = 0  # a deleted key read back with the bytes it had before
    stale: int = 0  # an overwritten key read back with its previous bytes
    misses: int = 0
    crash: str | None = None
    refused_message: str = ""
    finding_kinds: list[str] = field(default_factory=list)
    degraded_open: bool = False  # opened, and stats() said what it could not vouch for
    quarantined_pages: int = 0  # stats().quarantined_pages of that open

    @property
    def detected(self) -> bool:
        return (
            self.refused_open
            or self.degraded_open
            or self.detected_by_read
            or self.detected_by_fsck
        )


def _apply(root: Path, injection: Injection) -> bytes:
    """Damage the file in place; returns the original bytes."""
    path = root / injection.path
    fd = os.open(path, os.O_RDWR)
    try:
        length = 1 if injection.mode == "bit" else len(injection.run)
        original = os.pread(fd, length, injection.offset)
        if injection.mode == "bit":
            damaged = bytes([original[0] ^ (1 << injection.bit)])
        else:
            damaged = injection.run
        os.pwrite(fd, damaged, injection.offset)
    finally:
        os.close(fd)
    return original


def _restore(root: Path, injection: Injection, original: bytes) -> None:
    fd = os.open(root / injection.path, os.O_WRONLY)
    try:
        os.pwrite(fd, original, injection.offset)
    finally:
        os.close(fd)


def run_one(root: Path, injection: Injection, expected: Expected) -> Outcome:
    """Inject, open read-only, read everything, fsck --deep, restore."""
    outcome = Outcome(
        injection.index, injection.kind, injection.mode, injection.path, injection.offset
    )
    original = _apply(root, injection)
    if injection.mode == "run" and original == injection.run:
        outcome.changed = False
    try:
        _probe(root, expected, outcome)
    finally:
        _restore(root, injection, original)
    return outcome


def _probe(root: Path, expected: Expected, outcome: Outcome) -> None:
    try:
        store = KVStore.open(root, readonly=True)
    except KVStoreError as e:
        outcome.refused_open = True
        outcome.refused_message = str(e)
        return
    except Exception as e:  # a reader bug: anything else must never escape
        outcome.crash = f"open: {type(e).__name__}: {e}"
        return
    try:
        stats = store.stats()
        outcome.degraded_open = stats.degraded
        outcome.quarantined_pages = stats.quarantined_pages
        for key, value in expected.pages.items():
            try:
                got = store.get(key)
            except KVStoreError:
                outcome.detected_by_read = True
                continue
            if got is None:
                outcome.misses += 1
            elif got in expected.older.get(key, ()):
                outcome.stale += 1  # an overwritten value: the newer put was lost
            elif got != value:
                outcome.wrong_reads += 1
        for key in expected.deleted:
            try:
                got = store.get(key)
            except KVStoreError:
                outcome.detected_by_read = True
                continue
            if got is not None:
                outcome.resurrected += 1  # a deleted page came back
        # What `kvstore fsck --deep` reports: the recovery notes, then check().
        findings = [f"recovery: {note}" for note in store.recovery_notes]
        findings += [finding.kind for finding in store.check(deep=True)]
        outcome.finding_kinds = sorted(set(findings))
        outcome.detected_by_fsck = bool(findings)
    except Exception as e:
        outcome.crash = f"read/check: {type(e).__name__}: {e}"
    finally:
        try:
            store.close()
        except Exception as e:
            outcome.crash = outcome.crash or f"close: {type(e).__name__}: {e}"


# -- workers ------------------------------------------------------------------------


def _worker(
    root: str, injections: list[Injection], expected: Expected, queue: Any, quiet: bool
) -> None:
    if quiet:  # a store refusing to open may log; keep the sweep's output readable
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
    # A fresh process every WORKER_BATCH injections: whatever a library leaks per
    # open (io_uring buffer exports do) must not turn into ENOMEM "crashes".
    for injection in injections[:WORKER_BATCH]:
        queue.put(("start", injection.index))
        queue.put(("done", run_one(Path(root), injection, expected)))
    queue.put(("exit", None))
    queue.close()
    queue.join_thread()


def run_sweep(
    pristine: Path,
    expected: Expected,
    injections: list[Injection],
    *,
    workers: int,
    work_dir: Path,
    progress: bool = False,
) -> list[Outcome]:
    """Run ``injections``; ``workers=0`` runs them in this process (for tests)."""
    if workers == 0:
        copy = work_dir / "copy-0"
        shutil.copytree(pristine, copy, symlinks=True)
        return [run_one(copy, injection, expected) for injection in injections]
    context = multiprocessing.get_context("fork")
    chunks = [injections[w::workers] for w in range(workers)]
    outcomes: list[Outcome] = []
    started = time.monotonic()
    queues = [context.Queue() for _ in chunks]
    copies = [work_dir / f"copy-{w}" for w in range(len(chunks))]
    remaining = [list(chunk) for chunk in chunks]
    processes: list[Any] = [None] * len(chunks)
    current: list[int | None] = [None] * len(chunks)

    def launch(w: int) -> None:
        if copies[w].exists():
            shutil.rmtree(copies[w])
        shutil.copytree(pristine, copies[w], symlinks=True)
        process = context.Process(
            target=_worker, args=(str(copies[w]), remaining[w], expected, queues[w], True)
        )
        process.start()
        processes[w] = process

    for w in range(len(chunks)):
        if remaining[w]:
            launch(w)
    by_index = {injection.index: injection for injection in injections}
    last_report = 0.0
    while any(p is not None for p in processes):
        for w, process in enumerate(processes):
            if process is None:
                continue
            drained = False
            while True:
                try:
                    message, payload = queues[w].get(timeout=0.05)
                except Exception:
                    break
                drained = True
                if message == "start":
                    current[w] = payload
                elif message == "done":
                    outcomes.append(payload)
                    current[w] = None
                    remaining[w] = remaining[w][1:]
                elif message == "exit":
                    process.join()
                    processes[w] = None
                    if remaining[w]:
                        launch(w)  # the next batch, on a fresh copy
                    break
            if processes[w] is None or drained or process.is_alive():
                continue
            # The worker died (a signal inside a C library): count it and carry on.
            process.join()
            dead = current[w]
            if dead is not None:
                injection = by_index[dead]
                outcomes.append(
                    Outcome(
                        injection.index,
                        injection.kind,
                        injection.mode,
                        injection.path,
                        injection.offset,
                        crash=f"worker died with exit code {process.exitcode}",
                    )
                )
                remaining[w] = [i for i in remaining[w] if i.index != dead]
                current[w] = None
            processes[w] = None
            if remaining[w]:
                launch(w)
        if progress and time.monotonic() - last_report > 10:
            last_report = time.monotonic()
            rate = len(outcomes) / max(1e-9, last_report - started)
            print(f"{len(outcomes)}/{len(injections)} injections, {rate:.0f}/s", file=sys.stderr)
    return sorted(outcomes, key=lambda outcome: outcome.index)


# -- report -------------------------------------------------------------------------


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    def tally(selected: list[Outcome]) -> dict[str, int]:
        return {
            "injections": len(selected),
            "no-op": sum(not o.changed for o in selected),
            "refused-open": sum(o.refused_open for o in selected),
            "degraded-open": sum(o.degraded_open for o in selected),
            "quarantined-pages": sum(o.quarantined_pages for o in selected),
            "detected-by-read": sum(o.detected_by_read for o in selected),
            "detected-by-fsck": sum(o.detected_by_fsck for o in selected),
            "detected": sum(o.detected for o in selected),
            "undetected": sum(
                o.changed and not o.detected and o.crash is None and not o.wrong_reads
                for o in selected
            ),
            "wrong-reads": sum(o.wrong_reads for o in selected),
            "resurrected-deletes": sum(o.resurrected for o in selected),
            "stale-reads": sum(o.stale for o in selected),
            "injections-with-misses": sum(bool(o.misses) for o in selected),
            "crashes": sum(o.crash is not None for o in selected),
        }

    per_kind = {
        kind: tally([o for o in outcomes if o.kind == kind])
        for kind in REGIONS
        if any(o.kind == kind for o in outcomes)
    }
    mattering = [o for o in outcomes if REGIONS[o.kind][0] and o.changed]
    unused = [o for o in outcomes if not REGIONS[o.kind][0]]
    refused = [o for o in outcomes if o.refused_open]
    detected = sum(o.detected for o in mattering)
    finding_kinds: Counter[str] = Counter()
    for outcome in outcomes:
        finding_kinds.update(kind.split(":")[0] for kind in outcome.finding_kinds)
    crashes = [
        {"index": o.index, "kind": o.kind, "crash": o.crash}
        for o in outcomes
        if o.crash is not None
    ]
    missed = [
        {"index": o.index, "kind": o.kind, "path": o.path, "offset": o.offset}
        for o in mattering
        if not o.detected and o.crash is None
    ]
    return {
        "total": tally(outcomes),
        "bit-flips": tally([o for o in outcomes if o.mode == "bit"]),
        "byte-runs": tally([o for o in outcomes if o.mode == "run"]),
        "mattering": {
            "denominator": len(mattering),
            "detected": detected,
            "detected_percent": round(100.0 * detected / max(1, len(mattering)), 4),
        },
        "unused": tally(unused),
        "refusals-naming-recover": sum("kvstore recover" in o.refused_message for o in refused),
        "refusals": len(refused),
        "per-region": per_kind,
        "finding-kinds": dict(finding_kinds.most_common()),
        "crashes": crashes[:50],
        "missed": missed,
    }


def clean_baseline(pristine: Path, expected: Expected) -> Outcome:
    """The pristine store itself: every read right, no finding."""
    outcome = Outcome(-1, "baseline", "none")
    _probe(pristine, expected, outcome)
    return outcome


@contextlib.contextmanager
def pristine_store(
    seed: int, base: Path | None = None, phases: int = 3
) -> Iterator[tuple[Path, Expected]]:
    with tempfile.TemporaryDirectory(prefix="kvstore-sweep-", dir=base) as tmp:
        root = Path(tmp) / "pristine"
        expected = build_pristine(root, seed, phases)
        yield root, expected


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flips", type=int, default=10_000, help="injections to make")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2, choices=(0, 1, 2))
    parser.add_argument(
        "--run-fraction", type=float, default=0.1, help="share of byte runs (rest: bit flips)"
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--dir", type=Path, default=None, help="where to build the stores")
    parser.add_argument(
        "--save-store", type=Path, default=None, help="copy the pristine store here"
    )
    parser.add_argument(
        "--phases", type=int, default=3, choices=(2, 3), help="2: one WAL file; 3: a chain of two"
    )
    parser.add_argument(
        "--only", default=None, help="comma-separated region classes to inject into"
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    with pristine_store(args.seed, args.dir, args.phases) as (root, expected):
        baseline = clean_baseline(root, expected)
        if args.save_store is not None:
            shutil.copytree(root, args.save_store, symlinks=True)
        regions = map_regions(root)
        only = set(args.only.split(",")) if args.only else None
        injections = plan(regions, args.flips, args.seed, args.run_fraction, only)
        outcomes = run_sweep(
            root,
            expected,
            injections,
            workers=args.workers,
            work_dir=root.parent,
            progress=not args.json,
        )
    summary = summarize(outcomes)
    summary["baseline"] = {
        "findings": baseline.finding_kinds,
        "wrong-reads": baseline.wrong_reads,
        "misses": baseline.misses,
        "crash": baseline.crash,
    }
    region_bytes: Counter[str] = Counter()
    for region in regions:
        region_bytes[region.kind] += region.end - region.start
    summary["store"] = {
        "pages": len(expected.pages),
        "deleted": len(expected.deleted),
        "region-bytes": dict(region_bytes),
    }
    summary["command"] = " ".join(["tools/corruption_sweep.py", *(argv or sys.argv[1:])])
    summary["seconds"] = round(time.monotonic() - started, 1)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for name in ("total", "bit-flips", "byte-runs", "mattering", "unused", "baseline"):
            print(f"{name}: {summary[name]}")
        for kind, row in summary["per-region"].items():
            print(f"  {kind}: {row}")
        print(f"crashes: {summary['crashes'][:5]}")
        print(f"missed: {summary['missed'][:5]}")
    bad = (
        summary["total"]["wrong-reads"]
        or summary["total"]["crashes"]
        or summary["mattering"]["detected"] != summary["mattering"]["denominator"]
        or baseline.finding_kinds
        or baseline.wrong_reads
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

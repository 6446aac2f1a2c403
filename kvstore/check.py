"""fsck: verify every on-disk structure of a store against the others, and repair
what is safe to repair.

``check_store(store)`` takes an open ``KVStore`` and returns a list of
``Finding``s; ``check_path(root)`` checks what can still be checked when the
store refuses to open (superblock, LMDB values, the WAL chain). Both are the
one implementation the CLI (``kvstore fsck``) and the tests use.

What is checked (docs/operations.md lists every finding kind):

- the superblock decodes and names this store;
- every LMDB value (``pages``, ``segments``, ``meta``, ``retains``) passes its
  own checksum;
- every page-table entry (LMDB and the in-memory overlay) names an open
  segment and lands on a record whose header checksum, key, segment, offset,
  generation, LSN, length and payload checksum field match; ``deep=True``
  also reads every payload and verifies its xxh3-64;
- per-segment live bytes and pages equal what the page table implies;
- no segment file is unknown to the index, no stray file sits in the store;
- the WAL chain from ``checkpoint_lsn`` is whole and every record decodes;
- every retained key is a live page.

Invariants:
- Checking never raises for damage it finds: damage is a Finding; only a
  failure to run at all (closed store, read-only repair) raises KVStoreError.
- Repairs are only the safe ones, and only with ``repair=True`` on a writable
  store: page-table entries whose record is missing or corrupt are deleted
  through the store (a logged DELETE), undecodable page-table values are
  removed from LMDB, accounting drift is recomputed, orphan segment files,
  WAL files below the checkpoint and dangling retains are dropped. Nothing
  that could still hold a readable page is ever removed.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import lmdb

from kvstore.errors import CorruptionError, KVStoreError, ReadOnlyError
from kvstore.format.checksum import checksum
from kvstore.format.constants import BLOCK_BYTES
from kvstore.format.entries import PageEntry, decode_page_entry, decode_segment_entry
from kvstore.format.names import (
    DEMO_MARKER_NAME,
    INDEX_DIR,
    LOCK_NAME,
    SEGMENTS_DIR,
    SUPERBLOCK_NAME,
    TIERING_STATS_NAME,
    TIERING_STATS_TMP_NAME,
    WAL_DIR,
    parse_segment_name,
    parse_wal_name,
)
from kvstore.format.records import (
    SegmentHeader,
    decode_record_header,
    decode_segment_header,
    decode_superblock,
    entry_mismatches,
)
from kvstore.format.wal import decode_body
from kvstore.index.lmdb_env import IndexEnv, decode_meta_u64, encode_meta_u64, lmdb_read_errors
from kvstore.index.lmdb_verify import verify_lmdb_file
from kvstore.index.table import META_CHECKPOINT_LSN, META_PAGE_COUNT, Tombstone
from kvstore.io.buffers import AlignedBuffer
from kvstore.io.engine import run_all
from kvstore.io.files import fsync_dir
from kvstore.log.regular import read_regular
from kvstore.log.wal import list_wal_files, read_wal_chain

if TYPE_CHECKING:
    from kvstore.store import KVStore

__all__ = ["FINDING_KINDS", "Finding", "Findings", "Progress", "check_path", "check_store"]

Severity = Literal["error", "warning"]
Progress = Callable[[int, int], None]
"""``progress(done_bytes, total_bytes)``, called as a deep check reads payloads."""

FINDING_KINDS = (
    "superblock",
    "index-unreadable",
    "index-value",
    "index-meta",
    "missing-segment",
    "segment-header",
    "record-bounds",
    "record-unreadable",
    "record-header",
    "record-mismatch",
    "payload-checksum",
    "accounting",
    "orphan-segment",
    "stray-file",
    "set-aside",
    "stale-wal",
    "wal-chain",
    "wal-record",
    "retain-dangling",
    "open-failed",
    "recovery",
    "operational",  # printed by `kvstore fsck --json` when it exits 8
)
"""Every ``Finding.kind``; each is explained in docs/operations.md."""

_HEADER_BATCH = 256  # header blocks read per batch (1 MiB)
_DEEP_BATCH_BYTES = 32 << 20  # record bytes read per batch with deep=True
_INDEX_FILES = frozenset({"data.mdb", "lock.mdb"})


@dataclass(frozen=True, slots=True)
class Finding:
    """One problem fsck found. Owned by the caller.

    ``kind`` is a short machine name (``FINDING_KINDS``); the location fields
    say where, when they apply. ``repaired`` is True when this check fixed it.
    """

    severity: Severity
    kind: str
    message: str
    path: str | None = None
    segment_id: int | None = None
    offset: int | None = None
    key: bytes | None = None
    repaired: bool = False

    def as_dict(self) -> dict[str, object]:
        """JSON-ready: the key as text (undecodable bytes escaped) and as hex."""
        return {
            "severity": self.severity,
            "kind": self.kind,
            "message": self.message,
            "path": self.path,
            "segment_id": self.segment_id,
            "offset": self.offset,
            "key": None if self.key is None else self.key.decode("utf-8", "backslashreplace"),
            "key_hex": None if self.key is None else self.key.hex(),
            "repaired": self.repaired,
        }


class Findings(list[Finding]):
    """What ``check_store`` found. ``changed_while_checking`` counts the objects a
    live writer changed under a read-only check (a segment it freed or reused, a
    WAL file its checkpoint deleted, its spare segment): skipped, not reported,
    because what the check read of them is no longer what is on disk."""

    changed_while_checking: int = 0


@dataclass(slots=True)
class _Run:
    store: KVStore
    deep: bool
    repair: bool
    progress: Progress | None
    findings: list[Finding] = field(default_factory=list)
    changed: int = 0  # objects skipped as changed while checking (Findings)
    live_writer: bool = False  # read-only beside a writer that may be running
    checkpointed: bool | None = None  # a repair's one checkpoint, once tried

    def add(self, severity: Severity, kind: str, message: str, **where: Any) -> Finding:
        finding = Finding(severity, kind, message, **where)
        self.findings.append(finding)
        return finding


def check_store(
    store: KVStore,
    *,
    deep: bool = False,
    repair: bool = False,
    progress: Progress | None = None,
) -> Findings:
    """Check an open store; with ``repair=True`` (writable stores only) fix the safe things.

    Returns every finding, repaired ones marked ``repaired=True``. Raises
    ``ReadOnlyError`` for ``repair=True`` on a read-only store and
    ``ClosedError`` on a closed one; damage never raises.

    A read-only store checks its view (one point in time, see KVStore.open);
    beside a live writer, what the writer changed since is skipped and counted
    (``Findings.changed_while_checking``), never reported as damage.
    """
    store.internals.check_open()
    if repair and store.readonly:
        raise ReadOnlyError(f"store {store.root} was opened read-only; fsck cannot repair it")
    run = _Run(store, deep, repair, progress)
    run.live_writer = _writer_may_be_live(store)
    run.findings.extend(_check_superblock(store.root, store.superblock.store_uuid))
    bad_page_keys = _check_index_values(run)
    tree_sound = not any(finding.kind == "index-unreadable" for finding in run.findings)
    _check_segment_headers(run)
    _check_degraded(run)
    if tree_sound:  # otherwise LMDB's own walk could crash the process
        _check_records(run, bad_page_keys)
        _check_accounting(run)
    _check_files(run)
    _check_wal(run)
    if tree_sound:
        _check_retains(run)
    findings = Findings(run.findings)
    findings.changed_while_checking = run.changed
    return findings


def check_path(
    root: str | os.PathLike[str], open_error: BaseException | None = None
) -> list[Finding]:
    """Check a store that cannot be opened: superblock, LMDB values, the WAL chain.

    Never repairs. ``open_error`` (why the open failed) is reported as an
    ``open-failed`` finding. Raises ``AlreadyOpenError`` if this process has
    the store open.
    """
    root = Path(root)
    findings: list[Finding] = []
    if open_error is not None:
        findings.append(
            Finding("error", "open-failed", f"the store refuses to open: {open_error}", str(root))
        )
    findings.extend(_check_superblock(root, None))
    try:
        superblock = decode_superblock(_read_superblock(root / SUPERBLOCK_NAME))
    except (KVStoreError, OSError):
        return findings
    try:
        env = IndexEnv(root / INDEX_DIR, readonly=True)
    except CorruptionError as e:
        findings.append(Finding("error", "index-unreadable", str(e), str(root / INDEX_DIR)))
        return findings
    try:
        values, _ = _scan_index(env, root)
        findings.extend(values)
        if any(finding.kind == "index-unreadable" for finding in values):
            return findings
        try:
            with env.read() as txn:
                checkpoint_lsn = env.get_meta(txn, META_CHECKPOINT_LSN, 0)
        except (CorruptionError, lmdb.Error):
            return findings  # already reported by the scan
    finally:
        env.close()
    if checkpoint_lsn:
        findings.extend(_wal_findings(root, superblock.store_uuid, checkpoint_lsn))
    return findings


# -- superblock -----------------------------------------------------------------


def _read_superblock(path: Path) -> bytes:
    """The first block of ``KVSTORE``: never more, and never from a FIFO or device."""
    return read_regular(path, BLOCK_BYTES)


def _check_superblock(root: Path, store_uuid: bytes | None) -> list[Finding]:
    path = root / SUPERBLOCK_NAME
    try:
        superblock = decode_superblock(_read_superblock(path))
    except OSError as e:
        return [Finding("error", "superblock", f"cannot read the superblock: {e}", str(path))]
    except KVStoreError as e:
        return [Finding("error", "superblock", str(e), str(path))]
    if store_uuid is not None and superblock.store_uuid != store_uuid:
        return [Finding("error", "superblock", "superblock names another store", str(path))]
    return []


# -- LMDB values ------------------------------------------------------------------


def _scan_index(env: IndexEnv, root: Path) -> tuple[list[Finding], set[bytes]]:
    """Decode every value of every database; returns findings and bad page keys."""
    findings: list[Finding] = []
    bad_page_keys: set[bytes] = set()
    where = str(root / INDEX_DIR)

    def bad(message: str, key: bytes | None = None) -> None:
        findings.append(Finding("error", "index-value", message, where, key=key))

    try:
        with env.read() as txn:
            # Walked first, inside the transaction (a live writer cannot reuse these
            # pages): a damaged tree would crash LMDB's own walk below.
            problems = _walk_index(env)
            if problems:
                for problem in problems:
                    findings.append(Finding("error", "index-unreadable", problem, where))
                return findings, bad_page_keys
            for raw_key, raw_value in txn.cursor(db=env.pages):
                key = bytes(raw_key)
                try:
                    decode_page_entry(key, bytes(raw_value))
                except CorruptionError as e:
                    bad(str(e), key)
                    bad_page_keys.add(key)
            for raw_key, raw_value in txn.cursor(db=env.segments):
                segment_id = int.from_bytes(raw_key, "big")
                if len(raw_key) != 8:
                    bad(f"segment table has a malformed key {bytes(raw_key)!r}")
                    continue
                try:
                    decode_segment_entry(segment_id, bytes(raw_value))
                except CorruptionError as e:
                    bad(str(e))
            for database, name in ((env.meta, "meta"), (env.retains, "retains")):
                for raw_key, raw_value in txn.cursor(db=database):
                    key = bytes(raw_key)
                    try:
                        decode_meta_u64(key, bytes(raw_value))
                    except CorruptionError as e:
                        bad(f"{name}: {e}", key)
            if txn.get(META_CHECKPOINT_LSN, db=env.meta) is None:
                findings.append(
                    Finding("error", "index-meta", "the index has no checkpoint_lsn", where)
                )
    except lmdb.Error as e:
        findings.append(Finding("error", "index-unreadable", f"LMDB read failed: {e}", where))
    return findings, bad_page_keys


def _walk_index(env: IndexEnv, attempts: int = 5) -> list[str]:
    """``verify_lmdb_file``, redone while a live writer's commits overlap the walk
    (the file grows past what was mapped, a meta page is rewritten under it)."""
    problems: list[str] = []
    for _ in range(attempts):
        before = _txnid(env)
        problems = verify_lmdb_file(env.path / "data.mdb")
        if not problems or before is None or _txnid(env) == before:
            return problems
    return problems


def _txnid(env: IndexEnv) -> int | None:
    try:
        return env.last_txnid()
    except KVStoreError:
        return None


def _check_index_values(run: _Run) -> set[bytes]:
    store = run.store
    findings, bad_page_keys = _scan_index(store.internals.env, store.root)
    overlay = _overlay(store)
    for finding in findings:
        key = finding.key
        if key is not None and key in bad_page_keys and key in overlay:
            # The overlay shadows it and the next checkpoint rewrites or deletes it.
            run.add(
                "warning",
                "index-value",
                f"{finding.message} (shadowed by a newer change; the next checkpoint rewrites it)",
                path=finding.path,
                key=key,
            )
            continue
        if key is not None and key in bad_page_keys and run.repair:
            finding = _drop_index_value(run, key, finding)
        run.findings.append(finding)
    return {key for key in bad_page_keys if key not in overlay}


def _drop_index_value(run: _Run, key: bytes, finding: Finding) -> Finding:
    """Remove an undecodable page-table value from LMDB (its page cannot be located)."""
    store = run.store
    env = store.internals.env
    with store.internals.writers_frozen():
        if key in _overlay(store):
            return finding

        def body(txn: Any) -> bool:
            if not txn.delete(key, db=env.pages):
                return False
            txn.delete(key, db=env.retains)
            raw = txn.get(META_PAGE_COUNT, db=env.meta)
            if raw is not None:
                count = max(0, decode_meta_u64(META_PAGE_COUNT, bytes(raw)) - 1)
                txn.put(META_PAGE_COUNT, encode_meta_u64(META_PAGE_COUNT, count), db=env.meta)
            return True

        try:
            removed = env.write(body)
        except KVStoreError as e:
            return _replace(finding, message=f"{finding.message}; repair failed: {e}")
        if removed:
            store.internals.forget_index_value(key)
    return _replace(finding, message=f"{finding.message}; entry removed", repaired=removed)


def _replace(finding: Finding, **changes: Any) -> Finding:
    values = {name: getattr(finding, name) for name in Finding.__dataclass_fields__}
    values.update(changes)
    return Finding(**values)


def _overlay(store: KVStore) -> dict[bytes, PageEntry | Tombstone]:
    return store.internals.overlay()


def _live_entries(store: KVStore) -> Iterator[tuple[bytes, PageEntry]]:
    """Every live entry (LMDB merged with the overlay), skipping undecodable values.

    A damaged LMDB tree raises ``CorruptionError`` (``_scan_index`` reports it).
    """
    overlay = _overlay(store)
    env = store.internals.env
    with env.read() as txn, lmdb_read_errors(env.path):
        for raw_key, raw_value in txn.cursor(db=env.pages):
            key = bytes(raw_key)
            if key in overlay:
                continue
            try:
                entry = decode_page_entry(key, bytes(raw_value))
            except CorruptionError:
                continue
            yield key, entry
    for key, slot in overlay.items():
        if isinstance(slot, PageEntry):
            yield key, slot


# -- segments and records -----------------------------------------------------------


def _check_segment_headers(run: _Run) -> None:
    store = run.store
    for segment_id, segment, state in store.internals.segments():
        path = str(segment.path)
        if state is None:
            run.add(
                "error",
                "missing-segment",
                f"segment {segment_id} is open but not in the segment table",
                path=path,
                segment_id=segment_id,
            )
            continue
        # Read as a registered reader, as a get does: GC may not free (close, or
        # reuse) the segment's descriptor under the read.
        if not store.internals.hold_segment(segment_id, segment):
            continue  # freed since the listing: no longer the store's
        try:
            header = _read_segment_header(segment.fd)
            if run.live_writer and isinstance(header, str):
                time.sleep(0.001)  # a live writer may be rewriting it (recycle_segment)
                header = _read_segment_header(segment.fd)
        finally:
            store.internals.release_segment(segment_id)
        if isinstance(header, str):
            run.add("error", "segment-header", header, path=path, segment_id=segment_id)
            continue
        if (
            header.store_uuid != store.superblock.store_uuid
            or header.segment_id != segment_id
            or header.generation != state.generation
        ):
            if run.live_writer and header.store_uuid == store.superblock.store_uuid:
                # The writer freed this segment after the view was taken and reused
                # its file under a new id and generation (a valid header of this
                # store says so): nothing of this view is left in it to check.
                run.changed += 1
                continue
            run.add(
                "error",
                "segment-header",
                f"header says id {header.segment_id} generation {header.generation}, the "
                f"index says {segment_id}/{state.generation} (or another store's uuid)",
                path=path,
                segment_id=segment_id,
            )


def _check_degraded(run: _Run) -> None:
    """What the open degraded around (``stats().degraded_reasons``), with the repair.

    - A quarantined segment whose pages verified: ``--repair`` rewrites its header
      from the index (its id and generation are proven by those records) and
      extends a short file; the next open uses it as any other.
    - Pages that were dropped (misses), WAL files with a damaged header or a
      repaired record: ``--repair`` checkpoints, which makes the drops durable and
      retires those WAL files (their records are then in the index).
    - A salvaged index: a writer open already swapped the rebuilt one in.
    """
    store = run.store
    found = store.internals.degraded
    if not found.reasons:
        return
    for segment_id, why in sorted(found.segments.items()):
        served = found.served.get(segment_id, 0)
        segment = store.internals.state.segments.get(segment_id)
        existing = [
            f for f in run.findings if f.kind == "segment-header" and f.segment_id == segment_id
        ]
        for finding in existing:
            run.findings.remove(finding)
        where = {"segment_id": segment_id, "path": str(segment.path) if segment else None}
        message = f"segment {segment_id} quarantined at open ({why}); {served} pages verified"
        if segment is None:
            run.add(
                "error",
                "missing-segment",
                f"{message}; its file is gone: its pages are misses (the next checkpoint "
                "makes that durable)",
                repaired=run.repair and _checkpoint_quietly(run),
                **where,
            )
            continue
        if not served:
            run.add(
                "error",
                "segment-header",
                f"{message}: no record proves its identity, so its header is not rewritten; "
                "GC frees it once empty, or move it aside and run `kvstore recover PATH`",
                **where,
            )
            continue
        repaired = False
        if run.repair:
            try:
                _rewrite_segment_header(store, segment_id)
                repaired = True
                message += "; header rewritten from the index"
            except (OSError, KVStoreError) as e:
                message += f"; rewriting its header failed: {e}"
        else:
            message += "; `kvstore fsck --repair PATH` rewrites its header from the index"
        run.add("error", "segment-header", message, repaired=repaired, **where)
    others = [
        reason
        for reason in found.reasons
        if not reason.startswith("segment ") or " quarantined (" not in reason
    ]
    for reason in others:
        if reason.startswith("LMDB index damaged"):
            run.add(
                "error",
                "degraded",
                f"{reason}; the damaged index was moved aside"
                if not store.readonly
                else f"{reason}; a writer open (or `kvstore fsck --repair PATH`) swaps the "
                "rebuilt index in",
                repaired=not store.readonly,
            )
            continue
        # A WAL file header or record undone or taken on trust lost nothing: a
        # warning (the damaged file retires at the next checkpoint). Anything else
        # left damage behind.
        wal_only = ".wal: " in reason and "fail their checksum" not in reason
        run.add(
            "warning" if wal_only else "error",
            "degraded",
            f"{reason}; `kvstore fsck --repair PATH` checkpoints, which retires the WAL "
            "file (its records are then in the index)",
            repaired=run.repair and _checkpoint_quietly(run),
        )


def _checkpoint_quietly(run: _Run) -> bool:
    """One checkpoint per fsck run (a repair of what a degraded open found)."""
    if run.checkpointed is None:
        try:
            run.store.checkpoint()
            run.checkpointed = True
        except KVStoreError:
            run.checkpointed = False
    return run.checkpointed


def _rewrite_segment_header(store: KVStore, segment_id: int) -> None:
    """Write a quarantined segment's header from the index, durably; extend a short file."""
    from kvstore.format.records import SegmentHeader
    from kvstore.log.segments import rewrite_segment_header

    with store.internals.state.lock:
        state = store.internals.state.segment_states[segment_id]
        segment = store.internals.state.segments[segment_id]
    rewrite_segment_header(
        segment.path,
        SegmentHeader(
            store.superblock.store_uuid,
            segment_id,
            state.generation,
            store.config.segment_bytes,
            state.created_unix_ns,
        ),
    )


def _read_segment_header(fd: int) -> SegmentHeader | str:
    """The decoded header block of a segment, or why it cannot be had."""
    block = AlignedBuffer(BLOCK_BYTES)
    try:
        count = os.preadv(fd, [block.view], 0)
        if count != BLOCK_BYTES:
            raise CorruptionError(f"segment header: short read ({count} bytes)")
        return decode_segment_header(block.view)
    except OSError as e:
        return f"cannot read: {e}"
    except KVStoreError as e:
        return str(e)


@dataclass(slots=True)
class _Target:
    key: bytes
    entry: PageEntry
    fd: int


def _check_records(run: _Run, bad_page_keys: set[bytes]) -> None:
    """Read the record of every page-table entry and compare it with the entry."""
    store = run.store
    targets: list[_Target] = []
    to_delete: list[tuple[bytes, PageEntry, Finding]] = []
    held: Counter[int] = Counter()
    try:
        entries = list(_live_entries(store))
    except KVStoreError as e:
        # The B-tree itself is damaged (LMDB has no checksums); what it still
        # yields cannot be trusted to be complete.
        run.add("error", "index-unreadable", str(e), path=str(store.root / INDEX_DIR))
        return
    try:
        for key, entry in entries:
            where = {"segment_id": entry.segment_id, "offset": entry.offset, "key": key}
            with store.internals.state.lock:
                segment = store.internals.state.segments.get(entry.segment_id)
                state = store.internals.state.segment_states.get(entry.segment_id)
                if segment is not None and state is not None:
                    store.internals.state.segment_readers[entry.segment_id] += 1
                    held[entry.segment_id] += 1
            if segment is None and entry.segment_id in store.internals.state.gone_segments:
                run.changed += 1  # read-only: the live writer freed it before the open
                continue
            if segment is None or state is None or state.generation != entry.generation:
                finding = _record_finding(
                    run,
                    "missing-segment",
                    f"page {key!r} names segment {entry.segment_id} generation "
                    f"{entry.generation}, which the store does not have",
                    where,
                )
                if finding is not None:
                    to_delete.append((key, entry, finding))
                continue
            end = entry.offset + entry.span_bytes
            if (
                entry.offset % BLOCK_BYTES
                or entry.offset < BLOCK_BYTES
                or end > segment.size_bytes
                or entry.payload_bytes > store.config.max_page_bytes  # never sized into a buffer
            ):
                finding = _record_finding(
                    run,
                    "record-bounds",
                    f"page {key!r} at offset {entry.offset} (+{entry.span_bytes}) does not fit "
                    f"segment {entry.segment_id} of {segment.size_bytes} bytes",
                    where,
                )
                if finding is not None:
                    to_delete.append((key, entry, finding))
                continue
            if end > state.head_bytes:
                run.add(
                    "error",
                    "record-bounds",
                    f"page {key!r} ends at {end}, past segment {entry.segment_id}'s head "
                    f"{state.head_bytes}",
                    path=str(segment.path),
                    **where,
                )
            targets.append(_Target(key, entry, segment.fd))
        for key, entry, finding in _verify_targets(run, targets):
            to_delete.append((key, entry, finding))
    finally:
        with store.internals.state.lock:
            for segment_id, count in held.items():
                for _ in range(count):
                    store.internals.state.release_reader_locked(segment_id)
    del bad_page_keys  # reported (and repaired) by _check_index_values
    for key, entry, finding in to_delete:
        repaired = False
        if run.repair and store.internals.entry(key) == entry:
            try:
                repaired = store.delete(key)
            except KVStoreError as e:
                finding = _replace(finding, message=f"{finding.message}; repair failed: {e}")
        run.findings.append(_replace(finding, repaired=repaired) if repaired else finding)


def _record_finding(run: _Run, kind: str, message: str, where: dict[str, Any]) -> Finding | None:
    """A finding for a bad record, unless the entry changed meanwhile (a live writer)."""
    key = where["key"]
    try:
        current = run.store.internals.entry(key)
    except KVStoreError:  # the entry itself is implausible: this finding stands
        return Finding("error", kind, message, **where)
    if current is None or (current.segment_id, current.offset) != (
        where["segment_id"],
        where["offset"],
    ):
        return None
    return Finding("error", kind, message, **where)


def _verify_targets(
    run: _Run, targets: list[_Target]
) -> Iterator[tuple[bytes, PageEntry, Finding]]:
    store = run.store
    queue = store.internals.engine.queue("fsck")
    total = sum(target.entry.span_bytes for target in targets) if run.deep else 0
    done = 0
    if run.progress is not None and run.deep:
        run.progress(0, total)
    start = 0
    while start < len(targets):
        batch: list[_Target] = []
        batch_bytes = 0
        while start < len(targets):
            target = targets[start]
            size = target.entry.span_bytes if run.deep else BLOCK_BYTES
            if batch and (
                len(batch) >= _HEADER_BATCH or (run.deep and batch_bytes + size > _DEEP_BATCH_BYTES)
            ):
                break
            batch.append(target)
            batch_bytes += size
            start += 1
        buffers = [
            AlignedBuffer(target.entry.span_bytes if run.deep else BLOCK_BYTES) for target in batch
        ]
        requests = [
            ("r", target.fd, target.entry.offset, buffer.view[: buffer.capacity])
            for target, buffer in zip(batch, buffers, strict=True)
        ]
        results = run_all(queue, requests)
        for target, buffer, result in zip(batch, buffers, results, strict=True):
            problem = _record_problem(run, target, buffer.view, result, buffer.capacity)
            if problem is not None and _reused_since_view(run, target.entry):
                run.changed += 1
                continue
            if problem is not None:
                kind, message = problem
                where = {
                    "segment_id": target.entry.segment_id,
                    "offset": target.entry.offset,
                    "key": target.key,
                }
                finding = _record_finding(run, kind, message, where)
                if finding is not None:
                    yield target.key, target.entry, finding
        if run.deep:
            done += batch_bytes
            if run.progress is not None:
                run.progress(done, total)


def _reused_since_view(run: _Run, entry: PageEntry) -> bool:
    """Read-only beside a live writer: whether the writer has freed the segment of
    ``entry`` since the view was taken and reused its file (then the record read
    is no longer this view's, and not damage)."""
    return run.live_writer and run.store.readonly and run.store.internals.recycled_since_view(entry)


def _record_problem(
    run: _Run, target: _Target, view: memoryview, result: int, wanted: int
) -> tuple[str, str] | None:
    key, entry = target.key, target.entry
    where = f"page {key!r} in segment {entry.segment_id} at offset {entry.offset}"
    if result != wanted:
        if result < 0:
            return "record-unreadable", f"{where}: read failed: {os.strerror(-result)}"
        return "record-unreadable", f"{where}: short read ({result} of {wanted} bytes)"
    try:
        header = decode_record_header(view, max_page_bytes=run.store.config.max_page_bytes)
    except KVStoreError as e:
        return "record-header", f"{where}: {e}"
    mismatched = entry_mismatches(header, key, entry)
    if mismatched:
        return "record-mismatch", (
            f"{where}: the record there does not match the index ({', '.join(mismatched)}; "
            f"it says key {header.key!r}, segment {header.segment_id}, offset {header.offset}, "
            f"lsn {header.lsn})"
        )
    if run.deep:
        payload = view[BLOCK_BYTES : BLOCK_BYTES + entry.payload_bytes]
        if checksum(payload) != entry.payload_checksum:
            return "payload-checksum", f"{where}: payload checksum mismatch"
    return None


# -- accounting --------------------------------------------------------------------


def _check_accounting(run: _Run) -> None:
    store = run.store
    with store.internals.writers_frozen():
        live: Counter[int] = Counter()
        pages: Counter[int] = Counter()
        try:
            for _, entry in _live_entries(store):
                live[entry.segment_id] += entry.span_bytes
                pages[entry.segment_id] += 1
        except (lmdb.Error, KVStoreError):
            return  # reported as index-unreadable
        with store.internals.state.lock:
            for segment_id, state in sorted(store.internals.state.segment_states.items()):
                if state.live_bytes == live[segment_id] and state.live_pages == pages[segment_id]:
                    continue
                message = (
                    f"segment {segment_id} accounts {state.live_bytes} live bytes in "
                    f"{state.live_pages} pages; the page table holds {live[segment_id]} bytes "
                    f"in {pages[segment_id]} pages"
                )
                if run.repair:
                    state.live_bytes = live[segment_id]
                    state.live_pages = pages[segment_id]
                run.add("error", "accounting", message, segment_id=segment_id, repaired=run.repair)


# -- files -------------------------------------------------------------------------


def _check_files(run: _Run) -> None:
    store = run.store
    root = store.root
    expected_top = {
        SUPERBLOCK_NAME,
        LOCK_NAME,
        SEGMENTS_DIR,
        WAL_DIR,
        INDEX_DIR,
        TIERING_STATS_NAME,
        TIERING_STATS_TMP_NAME,
        DEMO_MARKER_NAME,
    }
    with store.internals.writers_frozen(), store.internals.state.cond:
        while store.internals.state.preparing:
            store.internals.state.cond.wait()
        spare = store.internals.state.spare
        spare_id = spare.segment_id if spare is not None else None
        known = set(store.internals.state.segment_states)
        # A live writer beside a read-only open makes segments (and a spare) after
        # the open; their ids are at or past this open's next_segment_id.
        next_id = store.internals.state.next_segment_id if _writer_may_be_live(store) else None
        orphans: list[tuple[int, Path]] = []
        try:
            for entry in os.scandir(root / SEGMENTS_DIR):
                segment_id = parse_segment_name(entry.name)
                if segment_id is None:
                    run.add(
                        "warning", "stray-file", f"unexpected file {entry.name}", path=entry.path
                    )
                elif (
                    segment_id not in known
                    and segment_id != spare_id
                    and (next_id is None or segment_id < next_id)
                ):
                    orphans.append((segment_id, Path(entry.path)))
        except OSError as e:
            run.add("error", "stray-file", f"cannot list {root / SEGMENTS_DIR}: {e}")
        if run.live_writer:
            # Beside a live writer a segment file this view does not know is the
            # writer's: its spare (named by no WAL record until it is used, yet
            # counted in the checkpoint's next_segment_id) or a file it freed or
            # reused since the view. A writer removes real orphans when it opens.
            run.changed += len(orphans)
            orphans = []
        for segment_id, path in orphans:
            repaired = False
            if run.repair:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                repaired = True
            run.add(
                "error",
                "orphan-segment",
                f"segment file {path.name} is not in the segment table (no page can point into it)",
                path=str(path),
                segment_id=segment_id,
                repaired=repaired,
            )
    if any(finding.kind == "orphan-segment" and finding.repaired for finding in run.findings):
        fsync_dir(root / SEGMENTS_DIR)
    _stray(run, root, expected_top, _left_by_recover)
    _stray(run, root / WAL_DIR, set(), lambda name: parse_wal_name(name) is not None)
    _stray(run, root / INDEX_DIR, set(_INDEX_FILES), lambda name: False)


def _left_by_recover(name: str) -> bool:
    """``kvstore recover`` keeps what it replaced as ``*.damaged-<ts>`` (for forensics)."""
    return ".damaged-" in name


def set_aside_findings(root: str | os.PathLike[str]) -> list[Finding]:
    """A ``set-aside`` warning for each ``*.damaged-<ts>`` entry at the store's root.

    Not stray files (``check_store`` passes over them: kvstore made them), but not
    to keep forever: ``kvstore fsck`` lists them until the operator removes them.
    """
    try:
        names = sorted(name for name in os.listdir(root) if _left_by_recover(name))
    except OSError:
        return []  # check_store reports a directory it cannot list
    return [
        Finding(
            "warning",
            "set-aside",
            f"{name}: set aside by kvstore recover (or a salvaging open), no longer "
            "used; inspect it, then remove it",
            str(Path(root) / name),
        )
        for name in names
    ]


def _writer_may_be_live(store: KVStore) -> bool:
    """For a read-only open: whether the pid in LOCK (the last writer) still runs."""
    if not store.readonly:
        return False
    try:
        pid = int(read_regular(store.root / LOCK_NAME, 64).strip() or b"0")
    except (OSError, ValueError, KVStoreError):
        return True  # cannot tell: be conservative
    if pid <= 0 or pid == os.getpid():
        return False  # this process cannot hold a writer beside its read-only open
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def _stray(run: _Run, directory: Path, allowed: set[str], ok: Callable[[str], bool]) -> None:
    try:
        names = sorted(os.listdir(directory))
    except OSError as e:
        run.add("error", "stray-file", f"cannot list {directory}: {e}", path=str(directory))
        return
    for name in names:
        if name not in allowed and not ok(name):
            run.add("warning", "stray-file", f"unexpected file {name}", path=str(directory / name))


# -- WAL ----------------------------------------------------------------------------


def _check_wal(run: _Run) -> None:
    store = run.store
    root = store.root
    lock = store.internals.checkpoint_lock if not store.readonly else contextlib.nullcontext()
    with lock:
        checkpoint_lsn = store.internals.state.checkpoint_lsn
        wal_findings = _wal_findings(root, store.superblock.store_uuid, checkpoint_lsn)
        if wal_findings and run.live_writer and store.internals.view_moved():
            # The writer checkpointed since the view and deleted the WAL files the
            # view starts from (the view itself replayed them whole at open).
            run.changed += len(wal_findings)
            wal_findings = []
        run.findings.extend(wal_findings)
        try:
            stale = [
                (first, path) for first, path in list_wal_files(root) if first < checkpoint_lsn
            ]
            if stale and run.live_writer:
                # A writer deletes these right after the checkpoint that covers them
                # commits: only files still there a moment later are stale.
                time.sleep(0.05)
                gone = [path for _, path in stale if not path.exists()]
                run.changed += len(gone)
                stale = [(first, path) for first, path in stale if path not in gone]
        except OSError:
            stale = []
        for _, path in stale:
            repaired = False
            if run.repair:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                repaired = True
            run.add(
                "warning",
                "stale-wal",
                f"WAL file {path.name} is older than the checkpoint ({checkpoint_lsn:016x})",
                path=str(path),
                repaired=repaired,
            )


def _wal_findings(root: Path, store_uuid: bytes, checkpoint_lsn: int) -> list[Finding]:
    findings: list[Finding] = []
    try:
        chain = read_wal_chain(root, store_uuid, checkpoint_lsn)
    except KVStoreError as e:
        return [Finding("error", "wal-chain", str(e), str(root / WAL_DIR))]
    except OSError as e:
        return [Finding("error", "wal-chain", f"cannot read the WAL: {e}", str(root / WAL_DIR))]
    for wal_file in chain:
        for record in wal_file.records:
            try:
                decode_body(record)
            except KVStoreError as e:
                findings.append(
                    Finding(
                        "error",
                        "wal-record",
                        f"{wal_file.path.name}: {e}",
                        str(wal_file.path),
                        offset=record.end_offset,
                    )
                )
    return findings


# -- retains -------------------------------------------------------------------------


def _check_retains(run: _Run) -> None:
    store = run.store
    with store.internals.state.lock:
        retained = sorted(store.internals.state.retains)
    for key in retained:
        try:
            live = store.internals.entry(key) is not None
        except KVStoreError:
            continue  # an undecodable entry or a damaged tree, reported by the index scan
        if live:
            continue
        repaired = False
        if run.repair:
            try:
                repaired = store.release(key)
            except KVStoreError:
                repaired = False
        run.add(
            "error",
            "retain-dangling",
            f"retained key {key!r} is not a live page",
            key=key,
            repaired=repaired,
        )

"""``kvstore recover``: rebuild a consistent index from the segments' self-describing records.

Used when the WAL or the LMDB index is damaged or missing (the store refuses
to open and names ``kvstore recover PATH``). See docs/operations.md, section
"recover", for the rules; in short:

- Every segment file with a valid header of this store is scanned block by
  block; a record counts only if its header decodes and names this segment,
  this generation and its own offset, and its payload checksum is verified.
- A record is kept only if a surviving index source vouches for it: the LMDB
  entry of its key (when no surviving WAL record after the checkpoint
  overrides it), or a surviving WAL PUT/MOVE naming it (when nothing later
  deletes or overwrites the key). So a delete never comes back.
  ``salvage=True`` also keeps the newest valid record of a key when it is
  newer than every surviving index state of that key.
- The new index and a new empty WAL are built under ``recover-tmp/``, marked
  complete, then swapped in; the old ``index/`` and ``wal/`` are kept as
  ``index.damaged-<ts>/`` and ``wal.damaged-<ts>/``. Interrupted at any point,
  a rerun finishes the swap (if the build was complete) or starts over.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmdb

from kvstore.errors import (
    CorruptionError,
    FormatVersionError,
    IOFailure,
    KVStoreError,
    NotRegularFileError,
    StoreNotFoundError,
)
from kvstore.format.checksum import checksum
from kvstore.format.constants import (
    BLOCK_BYTES,
    MAX_INDEX_KEY_BYTES,
    RECORD_PAGE,
    SEQUENCE_LIMIT,
    record_span,
)
from kvstore.format.entries import (
    SEGMENT_SEALED,
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
from kvstore.format.names import (
    INDEX_DIR,
    LOCK_NAME,
    SEGMENTS_DIR,
    SUPERBLOCK_NAME,
    WAL_DIR,
    parse_segment_name,
    parse_wal_name,
)
from kvstore.format.records import (
    SegmentHeader,
    Superblock,
    decode_record_header,
    decode_segment_header,
)
from kvstore.format.wal import (
    DeleteBody,
    LsnLeaseBody,
    MoveBody,
    PutBody,
    RetainBody,
    SegmentFreeBody,
    SegmentOpenBody,
    WalBody,
    WalFileHeader,
    decode_body,
    decode_wal_file_header,
    iter_records,
    repair_wal_file_header,
)
from kvstore.index.lmdb_env import IndexEnv, decode_meta_u64, encode_meta_u64, open_environment
from kvstore.index.lmdb_verify import verify_lmdb_file
from kvstore.index.rules import delete_applies, move_applies, put_applies
from kvstore.index.table import (
    META_CHECKPOINT_LSN,
    META_LSN_LEASE,
    META_NEXT_SEGMENT,
    META_PAGE_COUNT,
    Tombstone,
)
from kvstore.io.files import acquire_writer_lock, fsync_dir, write_file_durably
from kvstore.log.regular import read_regular, require_directory, require_regular
from kvstore.log.segments import rewrite_segment_header
from kvstore.log.wal import WalWriter, scan_repairing

__all__ = [
    "LOSS_REASONS",
    "STAGE_DIR",
    "DroppedRecord",
    "KeptPage",
    "RecoveryReport",
    "recover_store",
]

STAGE_DIR = "recover-tmp"
"""Where the new index and WAL are built before the swap (``<root>/recover-tmp/``)."""
_COMPLETE = "COMPLETE"  # in STAGE_DIR: the build is whole and durable; holds the timestamp

LOSS_REASONS = frozenset({"corrupt", "unvouched", "missing"})
"""Drop reasons that may mean a page was lost (``kvstore recover`` exits 4)."""

Progress = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class KeptPage:
    key: bytes
    lsn: int
    segment_id: int
    offset: int
    payload_bytes: int
    source: str  # "index" (LMDB), "wal", or "salvage"

    def as_dict(self) -> dict[str, object]:
        return {
            "key": _key_text(self.key),
            "key_hex": self.key.hex(),
            "lsn": self.lsn,
            "segment_id": self.segment_id,
            "offset": self.offset,
            "payload_bytes": self.payload_bytes,
            "source": self.source,
        }


@dataclass(frozen=True, slots=True)
class DroppedRecord:
    """A segment record (or, reason ``missing``, an index entry) not kept."""

    key: bytes
    lsn: int
    segment_id: int
    offset: int
    reason: str  # corrupt | unvouched | superseded | deleted | freed | missing

    def as_dict(self) -> dict[str, object]:
        return {
            "key": _key_text(self.key),
            "key_hex": self.key.hex(),
            "lsn": self.lsn,
            "segment_id": self.segment_id,
            "offset": self.offset,
            "reason": self.reason,
        }


@dataclass(slots=True)
class RecoveryReport:
    """What ``recover_store`` kept and dropped, and what it changed on disk."""

    path: str
    dry_run: bool
    salvage: bool
    index_state: str = "missing"  # "ok" | "partial" (some values bad) | "missing"
    old_checkpoint_lsn: int | None = None
    new_checkpoint_lsn: int = 0
    segments_scanned: int = 0
    damaged_segments: list[str] = field(default_factory=list)
    wal_files_read: int = 0
    wal_records_used: int = 0
    kept: list[KeptPage] = field(default_factory=list)
    dropped: list[DroppedRecord] = field(default_factory=list)
    retained: int = 0
    moved_aside: list[str] = field(default_factory=list)
    resumed_swap: bool = False
    notes: list[str] = field(default_factory=list)
    superblock_rebuilt: bool = False

    @property
    def kept_by_source(self) -> dict[str, int]:
        return dict(Counter(page.source for page in self.kept))

    @property
    def dropped_by_reason(self) -> dict[str, int]:
        return dict(Counter(record.reason for record in self.dropped))

    @property
    def lost(self) -> bool:
        """True when something was dropped for a reason that may mean a lost page."""
        return any(record.reason in LOSS_REASONS for record in self.dropped)

    def as_dict(self, *, lists: bool = True) -> dict[str, object]:
        out: dict[str, object] = {
            "path": self.path,
            "dry_run": self.dry_run,
            "salvage": self.salvage,
            "index_state": self.index_state,
            "old_checkpoint_lsn": self.old_checkpoint_lsn,
            "new_checkpoint_lsn": self.new_checkpoint_lsn,
            "segments_scanned": self.segments_scanned,
            "damaged_segments": list(self.damaged_segments),
            "wal_files_read": self.wal_files_read,
            "wal_records_used": self.wal_records_used,
            "kept_pages": len(self.kept),
            "kept_by_source": self.kept_by_source,
            "dropped_records": len(self.dropped),
            "dropped_by_reason": self.dropped_by_reason,
            "retained": self.retained,
            "moved_aside": list(self.moved_aside),
            "resumed_swap": self.resumed_swap,
            "superblock_rebuilt": self.superblock_rebuilt,
            "notes": list(self.notes),
        }
        if lists:
            out["kept"] = [page.as_dict() for page in self.kept]
            out["dropped"] = [record.as_dict() for record in self.dropped]
        return out


def _key_text(key: bytes) -> str:
    return key.decode("utf-8", "backslashreplace")


# -- internal state -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Record:
    key: bytes
    meta: bytes
    lsn: int
    segment_id: int
    generation: int
    offset: int
    payload_bytes: int
    payload_checksum: int
    ok: bool  # payload checksum verified

    @property
    def location(self) -> tuple[int, int, int]:
        return (self.segment_id, self.generation, self.offset)


@dataclass(slots=True)
class _Segment:
    segment_id: int
    generation: int
    created_unix_ns: int
    segment_bytes: int
    file_bytes: int
    head: int = BLOCK_BYTES


@dataclass(frozen=True, slots=True)
class _Entry:
    """The index's view of a key: a page at a location, vouched for by ``source``."""

    entry: PageEntry
    source: str  # "index" | "wal"

    @property
    def lsn(self) -> int:
        return self.entry.lsn


_State = _Entry | Tombstone  # Tombstone: deleted (or absent from LMDB) as of its lsn


@dataclass(slots=True)
class _Scan:
    superblock: Superblock
    segments: dict[int, _Segment] = field(default_factory=dict)
    records: dict[bytes, list[_Record]] = field(default_factory=dict)
    states: dict[bytes, _State] = field(default_factory=dict)
    retains: set[bytes] = field(default_factory=set)
    freed: set[tuple[int, int]] = field(default_factory=set)
    damaged_segment_paths: list[Path] = field(default_factory=list)
    short_segments: list[_Segment] = field(default_factory=list)
    max_lsn: int = 0
    max_segment_id: int = 0
    suspect: set[bytes] = field(default_factory=set)  # vouched for only before a WAL gap
    # Segment id -> (generation, created_unix_ns) as the index and WAL name them: a
    # segment whose header is damaged is scanned with these (its records prove them).
    known: dict[int, tuple[int, int]] = field(default_factory=dict)
    rewrite: list[_Segment] = field(default_factory=list)  # headers to write back
    wal_gap: bool = False

    def saw_lsn(self, lsn: int) -> None:
        self.max_lsn = max(self.max_lsn, lsn)


# -- entry point -------------------------------------------------------------------


def recover_store(
    path: str | os.PathLike[str],
    *,
    salvage: bool = False,
    dry_run: bool = False,
    progress: Progress | None = None,
) -> RecoveryReport:
    """Rebuild the store's index and WAL from its segments; see the module docstring.

    Raises ``StoreNotFoundError`` when there is no superblock,
    ``CorruptionError`` when it is invalid, ``LockedError`` when a writer
    holds the store, ``IOFailure`` on I/O errors. ``progress(done, total)``
    is called with segment bytes scanned.
    """
    root = Path(path).absolute()
    superblock_path = root / SUPERBLOCK_NAME
    try:  # one block, and never a FIFO or device (open(2) of a FIFO blocks)
        raw = read_regular(superblock_path, BLOCK_BYTES)
    except FileNotFoundError:
        raise StoreNotFoundError(f"no kvstore at {root} (no {SUPERBLOCK_NAME})") from None
    except OSError as e:
        raise IOFailure(f"cannot read {superblock_path}", e.errno) from e
    rebuilt: bytes | None = None
    try:
        from kvstore.format.records import decode_superblock

        superblock = decode_superblock(raw)
    except NotRegularFileError:
        raise
    except CorruptionError as e:
        from kvstore.identity import reconstruct_superblock, superblock_error

        found = reconstruct_superblock(root)
        if found.superblock is None:
            raise superblock_error(root, e) from None
        superblock, rebuilt = found.superblock, found.block
        superblock_note = f"the superblock was damaged ({e.args[0]}); rebuilt: {found.how}"
    report = RecoveryReport(str(root), dry_run, salvage)
    if rebuilt is not None:
        report.notes.append(superblock_note if not dry_run else f"would rebuild: {superblock_note}")
    # A symlink loop or a file in place of either, refused before anything is moved
    # (a missing wal/ is rebuilt; a non-directory index/ is moved aside by the swap).
    for name in (SEGMENTS_DIR, WAL_DIR):
        require_directory(root / name)
    require_regular(root / LOCK_NAME)
    lock_fd = acquire_writer_lock(root, record_pid=not dry_run)
    try:
        if rebuilt is not None and not dry_run:
            write_file_durably(superblock_path, rebuilt)
            report.superblock_rebuilt = True
        stage = root / STAGE_DIR
        if stage.exists():
            if (stage / _COMPLETE).exists():
                if dry_run:
                    report.notes.append(
                        f"{STAGE_DIR}/ holds a complete, interrupted recover; a real run "
                        "finishes its swap first"
                    )
                else:
                    ts = read_regular(stage / _COMPLETE).decode(errors="replace").strip()
                    ts = ts or str(int(time.time()))
                    report.moved_aside.extend(_swap(root, stage, ts))
                    report.resumed_swap = True
                    report.notes.append("finished the swap of an interrupted recover")
            elif not dry_run:
                shutil.rmtree(stage)
                fsync_dir(root)
                report.notes.append(
                    f"removed an incomplete {STAGE_DIR}/ left by an interrupted run"
                )
        scan = _Scan(superblock)
        _read_index(root, scan, report)
        _read_wal(root, scan, report)
        _scan_segments(root, scan, report, progress)
        kept = _decide(scan, report, salvage=salvage)
        lsn = scan.max_lsn + 1
        report.new_checkpoint_lsn = lsn
        retained = {key for key in scan.retains if key in kept}
        report.retained = len(retained)
        if dry_run:
            return report
        _build(root, scan, report, kept, retained, lsn)
        return report
    finally:
        os.close(lock_fd)


# -- sources ------------------------------------------------------------------------


def _regular_file(path: Path) -> bool:
    """Whether ``path`` is (or links to) a regular file: never open a FIFO, device or
    directory that merely carries a store file name."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def _plausible(scan: _Scan, key: bytes, entry: PageEntry) -> bool:
    limits = EntryLimits(scan.superblock.segment_bytes, scan.superblock.max_page_bytes)
    try:
        validate_page_entry(key, entry, limits)
    except CorruptionError:
        return False
    return True


def _plausible_body(scan: _Scan, lsn: int, body: WalBody) -> bool:
    """A checksummed WAL body whose numbers a writer could have made."""
    if lsn >= SEQUENCE_LIMIT:
        return False
    if isinstance(body, PutBody | MoveBody):
        put = body.put if isinstance(body, MoveBody) else body
        entry = put.entry(lsn)
        return _plausible(scan, put.key, entry)
    if isinstance(body, SegmentOpenBody | SegmentFreeBody):
        return body.segment_id < SEQUENCE_LIMIT and body.generation < SEQUENCE_LIMIT
    if isinstance(body, LsnLeaseBody):
        return body.lease_until < SEQUENCE_LIMIT
    return True


def _read_index(root: Path, scan: _Scan, report: RecoveryReport) -> None:
    """Load LMDB's pages and retains as initial states; any failure: treat as missing."""
    index = root / INDEX_DIR
    if not (index / "data.mdb").exists():
        report.notes.append("index: no data.mdb; treated as missing")
        return
    try:  # LMDB would open data.mdb itself: a FIFO there would block forever
        require_regular(index / "data.mdb")
    except NotRegularFileError as e:
        report.notes.append(f"index: {e.args[0]}; treated as missing")
        return
    # LMDB trusts its pages: a damaged tree would crash this process, not raise.
    problems = verify_lmdb_file(index / "data.mdb")
    if problems:
        report.notes.append(f"index: damaged B-tree ({problems[0]}); treated as missing")
        return
    try:
        env = open_environment(index, readonly=True, lock=False)
    except lmdb.Error as e:
        report.notes.append(f"index: cannot open LMDB ({e}); treated as missing")
        return
    states: dict[bytes, _State] = {}
    retains: set[bytes] = set()
    bad_values = 0
    checkpoint: int | None = None
    try:
        pages_db = env.open_db(b"pages", create=False)
        with env.begin(buffers=False) as txn:
            meta_db = env.open_db(b"meta", txn=txn, create=False)
            for name in (META_CHECKPOINT_LSN, META_LSN_LEASE, META_NEXT_SEGMENT):
                raw = txn.get(name, db=meta_db)
                if raw is None:
                    continue
                try:
                    value = decode_meta_u64(name, raw)
                except CorruptionError:
                    bad_values += 1
                    continue
                if value >= SEQUENCE_LIMIT:
                    bad_values += 1
                    continue
                if name == META_CHECKPOINT_LSN:
                    checkpoint = value
                    scan.saw_lsn(value)
                elif name == META_LSN_LEASE:
                    scan.saw_lsn(value)
                else:
                    scan.max_segment_id = max(scan.max_segment_id, value - 1)
            for raw_key, raw_value in txn.cursor(db=pages_db):
                key = bytes(raw_key)
                try:
                    entry = decode_page_entry(key, bytes(raw_value))
                except CorruptionError:
                    bad_values += 1
                    continue
                if not _plausible(scan, key, entry):
                    bad_values += 1
                    continue
                states[key] = _Entry(entry, "index")
                scan.saw_lsn(entry.lsn)
            with contextlib.suppress(lmdb.NotFoundError):
                segments_db = env.open_db(b"segments", txn=txn, create=False)
                for raw_key, raw_value in txn.cursor(db=segments_db):
                    segment_id = int.from_bytes(raw_key, "big")
                    try:
                        seg = decode_segment_entry(segment_id, bytes(raw_value))
                    except CorruptionError:
                        bad_values += 1
                        continue
                    if (
                        bytes(raw_key) == segment_key(segment_id)
                        and segment_id < SEQUENCE_LIMIT
                        and seg.generation < SEQUENCE_LIMIT
                    ):
                        scan.max_segment_id = max(scan.max_segment_id, segment_id)
                        scan.saw_lsn(seg.generation)
                        scan.known[segment_id] = (seg.generation, seg.created_unix_ns)
            with contextlib.suppress(lmdb.NotFoundError):
                retains_db = env.open_db(b"retains", txn=txn, create=False)
                for raw_key, raw_value in txn.cursor(db=retains_db):
                    key = bytes(raw_key)
                    try:
                        decode_meta_u64(key, bytes(raw_value))
                    except CorruptionError:
                        bad_values += 1
                        continue
                    retains.add(key)
    except lmdb.Error as e:
        report.notes.append(f"index: LMDB unreadable ({e}); treated as missing")
        return
    finally:
        env.close()
    scan.states = states
    scan.retains = retains
    report.old_checkpoint_lsn = checkpoint
    report.index_state = "partial" if bad_values or checkpoint is None else "ok"
    if bad_values:
        report.notes.append(f"index: {bad_values} values failed their checksum and were ignored")
    if checkpoint is None:
        report.notes.append("index: no valid checkpoint_lsn; every WAL file present is used")


def _read_wal(root: Path, scan: _Scan, report: RecoveryReport) -> None:
    """Replay each WAL file's valid prefix, in file order, over the index states.

    With a valid checkpoint, files named below it are skipped (their changes
    are in LMDB; replaying them could only bring back deleted pages).
    """
    checkpoint = report.old_checkpoint_lsn
    trust_absence = report.index_state == "ok" and checkpoint is not None
    files: list[tuple[int, Path]] = []
    wal_dir = root / WAL_DIR
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(wal_dir):
            first = parse_wal_name(entry.name)
            if first is None:
                continue
            if first >= SEQUENCE_LIMIT or not _regular_file(Path(entry.path)):
                report.notes.append(f"{entry.name}: not a plausible WAL file; ignored")
                continue
            files.append((first, Path(entry.path)))
            scan.saw_lsn(first)
    files.sort()
    states = scan.states
    # LMDB's absence of a key is a state too: dead as of the checkpoint.
    floor = (checkpoint - 1) if trust_absence and checkpoint else None

    def current(key: bytes) -> _State | None:
        state = states.get(key)
        if state is None and floor is not None:
            return Tombstone(floor)
        return state

    for position, (first, path) in enumerate(files):
        if checkpoint is not None and first < checkpoint:
            report.notes.append(f"{path.name}: older than the checkpoint; not replayed")
            continue
        try:
            data = path.read_bytes()
        except OSError as e:
            report.notes.append(f"{path.name}: unreadable ({e}); its changes are lost")
            _wal_gap(scan, report, f"{path.name} could not be read")
            continue
        try:
            header: WalFileHeader | None = decode_wal_file_header(data)
        except (CorruptionError, FormatVersionError) as e:
            # Its records follow at a fixed offset and carry their own checksums: a
            # damaged header must not lose them (a DELETE there would come back).
            repaired = repair_wal_file_header(data, scan.superblock.store_uuid, first, None)
            header = None if repaired is None else repaired[0]
            how = "repaired" if repaired is not None else "beyond repair"
            report.notes.append(
                f"{path.name}: damaged header ({e.args[0]}), {how}; its records are used, "
                "each verified by its own checksum"
            )
        if header is not None and header.store_uuid != scan.superblock.store_uuid:
            report.notes.append(f"{path.name}: belongs to another store; ignored")
            continue
        report.wal_files_read += 1
        repairs: list[str] = []
        result = scan_repairing(data, path.name, repairs)
        report.notes.extend(repairs)
        records = list(result.records)
        is_last = position == len(files) - 1
        if result.stop_reason is not None:
            report.notes.append(
                f"{path.name}: records end at byte {result.valid_end} ({result.stop_reason})"
            )
        gap_at = None
        if result.stop_reason is not None and (
            not is_last or result.later_valid_offset is not None
        ):
            gap_at = len(records)
            if result.later_valid_offset is not None:  # replay what follows the gap too
                records += iter_records(data, result.later_valid_offset).records
        for index, record in enumerate(records):
            if index == gap_at:
                _wal_gap(scan, report, f"{path.name} at byte {result.valid_end}")
            try:
                body = decode_body(record)
            except KVStoreError as e:
                report.notes.append(f"{path.name}: {e}; the rest of the file is ignored")
                _wal_gap(scan, report, f"{path.name}: a record that does not decode")
                break
            if not _plausible_body(scan, record.lsn, body):
                report.notes.append(
                    f"{path.name}: record at lsn {record.lsn} holds implausible numbers; "
                    "the rest of the file is ignored"
                )
                _wal_gap(scan, report, f"{path.name}: a record with implausible numbers")
                break
            report.wal_records_used += 1
            scan.saw_lsn(record.lsn)
            _apply(scan, current, record.lsn, body)
        if gap_at is not None and gap_at >= len(records):
            _wal_gap(scan, report, f"{path.name} at byte {result.valid_end}")


def _wal_gap(scan: _Scan, report: RecoveryReport, where: str) -> None:
    """A WAL record that cannot be read: what it changed is unknown (it may have been
    a DELETE), so no state older than it vouches for a page any more."""
    suspects = {key for key, state in scan.states.items() if isinstance(state, _Entry)}
    scan.suspect |= suspects
    scan.wal_gap = True
    report.notes.append(
        f"WAL gap ({where}): a logged change cannot be read; the {len(suspects)} pages "
        "vouched for only by older states are dropped (unvouched) unless a later record "
        "names them"
    )


def _apply(scan: _Scan, current: Callable[[bytes], _State | None], lsn: int, body: WalBody) -> None:
    states = scan.states
    if isinstance(body, PutBody | MoveBody):
        put = body.put if isinstance(body, MoveBody) else body
        entry = put.entry(lsn)
        scan.saw_lsn(put.generation)
        now = current(put.key)
        known = now.entry if isinstance(now, _Entry) else now  # the rules' PageEntry
        if isinstance(body, MoveBody):
            old = (body.old_segment_id, body.old_generation, body.old_offset)
            applies = move_applies(known, lsn, old)
        else:
            applies = put_applies(known, lsn)
        if applies:
            states[put.key] = _Entry(entry, "wal")
            scan.suspect.discard(put.key)
    elif isinstance(body, DeleteBody):
        now = current(body.key)
        if delete_applies(now, lsn):
            states[body.key] = Tombstone(lsn)
            scan.suspect.discard(body.key)
        scan.retains.discard(body.key)
    elif isinstance(body, RetainBody):
        if body.retained:
            scan.retains.add(body.key)
        else:
            scan.retains.discard(body.key)
    elif isinstance(body, SegmentFreeBody):
        scan.freed.add((body.segment_id, body.generation))
        scan.max_segment_id = max(scan.max_segment_id, body.segment_id)
        scan.saw_lsn(body.generation)
    elif isinstance(body, SegmentOpenBody):
        scan.max_segment_id = max(scan.max_segment_id, body.segment_id)
        scan.saw_lsn(body.generation)
        scan.known[body.segment_id] = (body.generation, 0)
    elif isinstance(body, LsnLeaseBody):
        scan.saw_lsn(body.lease_until)


def _scan_segments(
    root: Path, scan: _Scan, report: RecoveryReport, progress: Progress | None
) -> None:
    files: list[tuple[int, Path, int]] = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(root / SEGMENTS_DIR):
            segment_id = parse_segment_name(entry.name)
            if segment_id is None:
                continue
            path = Path(entry.path)
            if segment_id >= SEQUENCE_LIMIT or not _regular_file(path):
                report.notes.append(f"{entry.name}: not a plausible segment file; ignored")
                continue
            files.append((segment_id, path, os.stat(path).st_size))
            scan.max_segment_id = max(scan.max_segment_id, segment_id)
    files.sort()
    total = sum(size for _, _, size in files)
    done = 0
    for segment_id, path, size in files:
        _scan_one(scan, report, segment_id, path)
        done += size
        if progress is not None:
            progress(done, total)


def _scan_one(scan: _Scan, report: RecoveryReport, segment_id: int, path: Path) -> None:
    superblock = scan.superblock
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise IOFailure(f"cannot open {path}", e.errno) from e
    try:
        file_bytes = os.fstat(fd).st_size
        problem = None
        try:
            header = decode_segment_header(os.pread(fd, BLOCK_BYTES, 0))
        except KVStoreError as e:
            problem = f"bad header ({e.args[0] if e.args else e})"
        else:
            if header.store_uuid != superblock.store_uuid:
                problem = "belongs to another store"
            elif header.segment_id != segment_id:
                problem = f"header names segment {header.segment_id}"
            elif header.generation >= SEQUENCE_LIMIT:
                problem = f"implausible generation {header.generation}"
        rewrite = False
        if problem is not None:
            if segment_id not in scan.known:
                _damaged(scan, report, path, problem)
                return
            # The index (or the WAL) names this segment: its records name their
            # segment and generation themselves, so scan it with the index's
            # generation; if any record proves it, the header is written back.
            generation, created = scan.known[segment_id]
            header = SegmentHeader(
                superblock.store_uuid, segment_id, generation, superblock.segment_bytes, created
            )
            rewrite = True
        report.segments_scanned += 1
        scan.saw_lsn(header.generation)
        segment = _Segment(
            segment_id, header.generation, header.created_unix_ns, header.segment_bytes, file_bytes
        )
        scan.segments[segment_id] = segment
        if file_bytes < header.segment_bytes:
            scan.short_segments.append(segment)
            report.notes.append(
                f"{path.name}: {file_bytes} bytes, shorter than its {header.segment_bytes}; "
                "records in what remains are used and the file is extended"
            )
        end = min(file_bytes, header.segment_bytes)
        offset = BLOCK_BYTES
        while offset + BLOCK_BYTES <= end:
            block = os.pread(fd, BLOCK_BYTES, offset)
            try:
                rec = decode_record_header(block, max_page_bytes=superblock.max_page_bytes)
            except KVStoreError:
                offset += BLOCK_BYTES  # a hole, or never written: resync at the next block
                continue
            if rec.lsn >= SEQUENCE_LIMIT:
                offset += BLOCK_BYTES  # sealed, but no writer issues such an LSN
                continue
            scan.saw_lsn(rec.lsn)
            span = record_span(rec.payload_bytes)
            if (
                rec.segment_id != segment_id
                or rec.generation != header.generation
                or rec.offset != offset
                or offset + span > end
            ):
                offset += BLOCK_BYTES  # stale: an earlier incarnation of a recycled file
                continue
            if rec.record_type == RECORD_PAGE:
                payload = os.pread(fd, rec.payload_bytes, offset + BLOCK_BYTES)
                ok = len(payload) == rec.payload_bytes and checksum(payload) == rec.payload_checksum
                record = _Record(
                    rec.key,
                    rec.meta,
                    rec.lsn,
                    segment_id,
                    header.generation,
                    offset,
                    rec.payload_bytes,
                    rec.payload_checksum,
                    ok,
                )
                scan.records.setdefault(rec.key, []).append(record)
            offset += span
            segment.head = offset
        if rewrite:
            # Proven only by a record the index itself vouches for (same key,
            # location, generation and LSN): a foreign file's records are not.
            proven = any(
                r.segment_id == segment_id
                and r.ok
                and isinstance(state := scan.states.get(key), _Entry)
                and (state.entry.segment_id, state.entry.generation, state.entry.offset)
                == r.location
                and state.lsn == r.lsn
                for key, records in scan.records.items()
                for r in records
            )
            if not proven:
                del scan.segments[segment_id]
                report.segments_scanned -= 1
                _damaged(scan, report, path, f"{problem}, and no record proves its identity")
                return
            scan.rewrite.append(segment)
            report.notes.append(
                f"{path.name}: {problem}; scanned with the index's generation "
                f"{header.generation} (its records prove it); its header is rewritten"
            )
    except OSError as e:
        raise IOFailure(f"cannot read {path}", e.errno) from e
    finally:
        os.close(fd)


def _damaged(scan: _Scan, report: RecoveryReport, path: Path, why: str) -> None:
    scan.damaged_segment_paths.append(path)
    report.damaged_segments.append(path.name)
    report.notes.append(f"{path.name}: {why}; not used, moved aside")


# -- decision -----------------------------------------------------------------------


def _decide(scan: _Scan, report: RecoveryReport, *, salvage: bool) -> dict[bytes, _Record]:
    """Pick the record each key keeps; every other record is reported with its reason."""
    trust_absence = report.index_state == "ok" and report.old_checkpoint_lsn is not None
    floor = (report.old_checkpoint_lsn or 1) - 1
    kept: dict[bytes, _Record] = {}
    for key in sorted(set(scan.records) | set(scan.states)):
        if len(key) > MAX_INDEX_KEY_BYTES:  # put by an older build; LMDB cannot hold it
            for r in scan.records.get(key, []):
                report.dropped.append(
                    DroppedRecord(key, r.lsn, r.segment_id, r.offset, "key-too-long")
                )
            continue
        state = scan.states.get(key)
        if state is None and trust_absence:
            state = Tombstone(floor)
        records = [
            r for r in scan.records.get(key, []) if (r.segment_id, r.generation) not in scan.freed
        ]
        freed = [r for r in scan.records.get(key, []) if r not in records]
        chosen: _Record | None = None
        source = ""
        if isinstance(state, _Entry) and key in scan.suspect:
            # Vouched for only by a state older than a WAL gap: the record that cannot
            # be read may have deleted or overwritten it. ``--salvage`` may keep the
            # newest valid record, with the risk it documents.
            if not salvage:
                for r in records + freed:
                    report.dropped.append(
                        DroppedRecord(key, r.lsn, r.segment_id, r.offset, "unvouched")
                    )
                continue
            state = None
        if isinstance(state, _Entry):
            want = state.entry
            match = next(
                (
                    r
                    for r in records
                    if r.location == (want.segment_id, want.generation, want.offset)
                    and r.lsn == want.lsn
                    and r.payload_bytes == want.payload_bytes
                    and r.payload_checksum == want.payload_checksum
                ),
                None,
            )
            if match is not None and match.ok:
                chosen, source = match, state.source
            elif match is None:
                report.dropped.append(
                    DroppedRecord(key, want.lsn, want.segment_id, want.offset, "missing")
                )
        if salvage:
            valid = [r for r in records if r.ok]
            newest = max(valid, key=lambda r: (r.lsn, r.generation, r.offset), default=None)
            if newest is not None and newest is not chosen:
                if chosen is not None:
                    allowed = newest.lsn > chosen.lsn
                elif state is None:
                    allowed = True
                else:  # never older than the key's index state; same LSN only for a copy
                    allowed = newest.lsn > state.lsn or (
                        isinstance(state, _Entry) and newest.lsn == state.lsn
                    )
                if allowed:
                    chosen, source = newest, "salvage"
        if chosen is not None:
            kept[key] = chosen
            report.kept.append(
                KeptPage(
                    key, chosen.lsn, chosen.segment_id, chosen.offset, chosen.payload_bytes, source
                )
            )
        for r in freed:
            report.dropped.append(DroppedRecord(key, r.lsn, r.segment_id, r.offset, "freed"))
        for r in records:
            if r is chosen:
                continue
            if not r.ok:
                reason = "corrupt"
            elif chosen is not None and r.lsn <= chosen.lsn:
                reason = "superseded"
            elif isinstance(state, Tombstone) and r.lsn <= state.lsn:
                reason = "deleted"
            elif isinstance(state, _Entry) and r.lsn < state.lsn:
                reason = "superseded"
            else:
                reason = "unvouched"
            report.dropped.append(DroppedRecord(key, r.lsn, r.segment_id, r.offset, reason))
    return kept


# -- output ---------------------------------------------------------------------------


def _build(
    root: Path,
    scan: _Scan,
    report: RecoveryReport,
    kept: dict[bytes, _Record],
    retained: set[bytes],
    lsn: int,
) -> None:
    ts = str(int(time.time()))
    for segment in scan.rewrite:  # proven by their records (see _scan_one)
        path = root / SEGMENTS_DIR / f"{segment.segment_id:016x}.seg"
        try:
            rewrite_segment_header(
                path,
                SegmentHeader(
                    scan.superblock.store_uuid,
                    segment.segment_id,
                    segment.generation,
                    segment.segment_bytes,
                    segment.created_unix_ns,
                ),
            )
        except OSError as e:
            raise IOFailure(f"cannot rewrite the header of {path}", e.errno) from e
    for segment in scan.short_segments:  # the store refuses a segment shorter than its header
        path = root / SEGMENTS_DIR / f"{segment.segment_id:016x}.seg"
        try:
            os.truncate(path, segment.segment_bytes)
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        except OSError as e:
            raise IOFailure(f"cannot extend {path}", e.errno) from e
    if scan.damaged_segment_paths:
        aside = _unique(root / f"{SEGMENTS_DIR}.damaged-{ts}")
        aside.mkdir(mode=0o700)
        for path in scan.damaged_segment_paths:
            os.rename(path, aside / path.name)
        fsync_dir(aside)
        fsync_dir(root / SEGMENTS_DIR)
        fsync_dir(root)
        report.moved_aside.append(aside.name)

    stage = root / STAGE_DIR
    stage.mkdir(mode=0o700)
    (stage / INDEX_DIR).mkdir(mode=0o700)
    (stage / WAL_DIR).mkdir(mode=0o700)
    live_bytes: Counter[int] = Counter()
    live_pages: Counter[int] = Counter()
    for record in kept.values():
        live_bytes[record.segment_id] += record_span(record.payload_bytes)
        live_pages[record.segment_id] += 1
    next_segment_id = max(scan.max_segment_id, *scan.segments, 0) + 1
    env = IndexEnv(stage / INDEX_DIR, readonly=False, create=True)
    try:

        def body(txn: Any) -> None:
            for key, record in kept.items():
                entry = PageEntry(
                    record.segment_id,
                    record.generation,
                    record.offset,
                    record.payload_bytes,
                    record.payload_checksum,
                    record.lsn,
                    record.meta,
                )
                txn.put(key, encode_page_entry(key, entry), db=env.pages)
            for segment_id, segment in scan.segments.items():
                seg_value = SegmentEntry(
                    segment.generation,
                    segment.head,
                    live_bytes[segment_id],
                    live_pages[segment_id],
                    segment.created_unix_ns,
                    SEGMENT_SEALED,
                )
                txn.put(
                    segment_key(segment_id),
                    encode_segment_entry(segment_id, seg_value),
                    db=env.segments,
                )
            for name, value in (
                (META_CHECKPOINT_LSN, lsn),
                (META_LSN_LEASE, lsn + 1),
                (META_PAGE_COUNT, len(kept)),
                (META_NEXT_SEGMENT, next_segment_id),
            ):
                txn.put(name, encode_meta_u64(name, value), db=env.meta)
            for key in retained:
                txn.put(key, encode_meta_u64(key, 1), db=env.retains)

        env.write(body)
        env.sync()
    finally:
        env.close()
    WalWriter(stage, scan.superblock.store_uuid, lsn, 0).close()
    fsync_dir(stage / INDEX_DIR)
    fsync_dir(stage)
    write_file_durably(stage / _COMPLETE, f"{ts}\n".encode())
    fsync_dir(root)
    report.moved_aside.extend(_swap(root, stage, ts))


def _unique(path: Path) -> Path:
    candidate, n = path, 1
    while candidate.exists():
        candidate = path.with_name(f"{path.name}.{n}")
        n += 1
    return candidate


def _swap(root: Path, stage: Path, ts: str) -> list[str]:
    """Move the old index and WAL aside and the staged ones in; each step is idempotent."""
    moved: list[str] = []
    try:
        # lexists: a symlink loop or dangling link is moved aside too (exists() says
        # False for it, and renaming a directory onto it fails with ENOTDIR).
        if (stage / INDEX_DIR).exists() and os.path.lexists(root / INDEX_DIR):
            aside = _unique(root / f"{INDEX_DIR}.damaged-{ts}")
            os.rename(root / INDEX_DIR, aside)
            moved.append(aside.name)
        if (stage / WAL_DIR).exists() and os.path.lexists(root / WAL_DIR):
            aside = _unique(root / f"{WAL_DIR}.damaged-{ts}")
            os.rename(root / WAL_DIR, aside)
            moved.append(aside.name)
        fsync_dir(root)
        if (stage / WAL_DIR).exists():
            os.rename(stage / WAL_DIR, root / WAL_DIR)
        if (stage / INDEX_DIR).exists():
            os.rename(stage / INDEX_DIR, root / INDEX_DIR)
        fsync_dir(root)
        (stage / _COMPLETE).unlink(missing_ok=True)
        stage.rmdir()
        fsync_dir(root)
    except OSError as e:
        raise IOFailure(f"cannot swap the recovered index into {root}", e.errno) from e
    return moved

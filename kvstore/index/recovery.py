"""Recovery on open: the checkpointed LMDB state plus a replay of the WAL.

Replay is idempotent: records in WAL files at or after ``checkpoint_lsn`` are
exactly the changes not yet in LMDB (a checkpoint drains in-flight puts before
it rotates the WAL), and "newer LSN wins" makes re-applying harmless.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvstore.errors import CorruptionError, IOFailure
from kvstore.format.constants import (
    BLOCK_BYTES,
    MAX_INDEX_KEY_BYTES,
    SEQUENCE_LIMIT,
    WAL_SEGMENT_FREE,
    WAL_SEGMENT_OPEN,
    record_span,
)
from kvstore.format.entries import (
    SEGMENT_ACTIVE,
    SEGMENT_SEALED,
    EntryLimits,
    PageEntry,
    decode_page_entry,
    decode_segment_entry,
    segment_key,
    validate_page_entry,
)
from kvstore.format.names import SUPERBLOCK_NAME
from kvstore.format.records import decode_superblock
from kvstore.format.wal import (
    DeleteBody,
    LsnLeaseBody,
    MoveBody,
    PutBody,
    RetainBody,
    SegmentFreeBody,
    SegmentOpenBody,
    WalBody,
    WalRecord,
    decode_body,
)
from kvstore.index.lmdb_env import IndexDamagedError, IndexEnv, lmdb_read_errors
from kvstore.index.rules import move_applies
from kvstore.index.table import (
    META_CHECKPOINT_LSN,
    META_LSN_LEASE,
    META_NEXT_SEGMENT,
    PageTable,
    SegmentState,
    Tombstone,
    load_retains,
    load_segments,
)
from kvstore.log.wal import WalFile, read_wal_chain

__all__ = [
    "Recovered",
    "apply_delete",
    "apply_move",
    "apply_put",
    "entries_in_segments",
    "live_segments_now",
    "recover_index",
]


@dataclass(slots=True)
class Recovered:
    table: PageTable
    segments: dict[int, SegmentState]
    lsn_lease: int
    max_lsn_seen: int
    checkpoint_lsn: int
    next_segment_id: int
    wal_files: list[WalFile]
    replayed_records: int = 0
    notes: list[str] = field(default_factory=list)
    retains: set[bytes] = field(default_factory=set)
    dropped_segments: list[int] = field(default_factory=list)
    # A degraded open: damage found and repaired or worked around (stats() says so).
    degraded: list[str] = field(default_factory=list)
    damaged_wal_headers: int = 0
    salvaged_wal_records: int = 0


def apply_put(
    table: PageTable, segments: dict[int, SegmentState], key: bytes, entry: PageEntry
) -> bool:
    """Apply a put to the table and the live-byte accounting; False if stale."""
    segment = segments.get(entry.segment_id)
    if segment is None or segment.generation != entry.generation:
        raise CorruptionError(
            f"put of {key!r} at lsn {entry.lsn} names segment {entry.segment_id} "
            f"generation {entry.generation}, which the index does not have"
        )
    span = entry.span_bytes
    segment.head_bytes = max(segment.head_bytes, entry.offset + span)
    applied, old = table.put(key, entry)
    if not applied:
        return False
    segment.live_bytes += span
    segment.live_pages += 1
    if old is not None:
        _unaccount(segments, old)
    return True


def apply_delete(
    table: PageTable, segments: dict[int, SegmentState], key: bytes, lsn: int
) -> PageEntry | None:
    old = table.delete(key, lsn)
    if old is not None:
        _unaccount(segments, old)
    return old


def apply_move(
    table: PageTable,
    segments: dict[int, SegmentState],
    key: bytes,
    entry: PageEntry,
    old_location: tuple[int, int, int],
    *,
    checkpoint_lsn: int,
) -> bool:
    """Apply a compaction MOVE where ``index.rules.move_applies`` says so. A key the
    table lacks is dead as of the checkpoint (``checkpoint_lsn``)."""
    segment = segments.get(entry.segment_id)
    if segment is None or segment.generation != entry.generation:
        raise CorruptionError(
            f"move of {key!r} names segment {entry.segment_id}, which the index does not have"
        )
    segment.head_bytes = max(segment.head_bytes, entry.offset + entry.span_bytes)
    now = table.state(key)
    if not move_applies(
        Tombstone(checkpoint_lsn - 1) if now is None else now, entry.lsn, old_location
    ):
        return False
    return apply_put(table, segments, key, entry)


def _unaccount(segments: dict[int, SegmentState], old: PageEntry) -> None:
    previous = segments.get(old.segment_id)
    if previous is not None:
        # Never below zero: only a damaged segment entry (one that undercounts the
        # pages in it) gets there, and a negative count could not be checkpointed
        # (the format's fields are unsigned). ``gc(full=True)`` recounts.
        previous.live_bytes = max(0, previous.live_bytes - old.span_bytes)
        previous.live_pages = max(0, previous.live_pages - 1)


def read_limits(root: Path) -> EntryLimits:
    """The geometry every entry must fit, from the superblock (one 4 KiB read)."""
    path = root / SUPERBLOCK_NAME
    try:
        with open(path, "rb") as handle:
            block = handle.read(BLOCK_BYTES)
    except OSError as e:
        raise IOFailure(f"cannot read {path}", e.errno) from e
    superblock = decode_superblock(block)
    return EntryLimits(superblock.segment_bytes, superblock.max_page_bytes)


def recover_index(
    env: IndexEnv, root: Path, store_uuid: bytes, limits: EntryLimits | None = None
) -> Recovered:
    """Load the checkpoint and replay the WAL chain after it into the overlay.

    Every number recovery does arithmetic on or sizes reads by is checked first
    (``SEQUENCE_LIMIT``, the superblock's geometry): a value that passed its
    checksum but no writer makes is ``CorruptionError``, never an overflow.
    """
    if limits is None:
        limits = read_limits(root)
    # Everything read from LMDB here is checked (checksums, plausibility); a value
    # that fails is index damage, which a store open salvages (IndexDamagedError).
    try:
        with env.read() as txn:
            checkpoint_lsn = env.get_meta(txn, META_CHECKPOINT_LSN, 0)
            lease = env.get_meta(txn, META_LSN_LEASE, 1)
            next_segment_id = env.get_meta(txn, META_NEXT_SEGMENT, 1)
        if checkpoint_lsn == 0:
            raise CorruptionError("index has no checkpoint_lsn; run `kvstore recover PATH`")
        for name, value in (
            ("checkpoint_lsn", checkpoint_lsn),
            ("lsn_lease", lease),
            ("next_segment_id", next_segment_id),
        ):
            _check_sequence(f"index meta {name}", value)
        table = PageTable(env, limits)
        segments = load_segments(env)
        for segment_id, state in segments.items():
            _check_segment_state(segment_id, state, limits)
        retains = load_retains(env)
    except IndexDamagedError:
        raise
    except CorruptionError as e:
        message = e.args[0] if e.args else str(e)
        raise IndexDamagedError(f"the LMDB index is damaged: {message}", [message]) from e
    if segments:
        next_segment_id = max(next_segment_id, max(segments) + 1)
    chain = read_wal_chain(root, store_uuid, checkpoint_lsn)
    for wal_file in chain:
        _check_sequence(f"WAL file {wal_file.path.name}", wal_file.first_lsn)
        for record in wal_file.records:
            _check_sequence(f"WAL {wal_file.path.name} record", record.lsn)
    recovered = Recovered(table, segments, lease, 0, checkpoint_lsn, next_segment_id, chain)
    recovered.retains = retains
    for wal_file in chain:
        recovered.degraded.extend(wal_file.repairs)
        recovered.notes.extend(wal_file.repairs)
        if wal_file.header_damaged:
            recovered.damaged_wal_headers += 1
            recovered.salvaged_wal_records += len(wal_file.records)
    decoded = [[(record, decode_body(record)) for record in wal_file.records] for wal_file in chain]
    table.prefetch_for_replay(
        {
            body.put.key if isinstance(body, MoveBody) else body.key
            for records in decoded
            for _, body in records
            if isinstance(body, PutBody | DeleteBody | MoveBody)
        }
    )
    for records in decoded:
        for record, body in records:
            _check_body(record, body, limits)
    try:
        _replay(recovered, chain, decoded)
    finally:
        table.end_replay()
    if table.unreadable_on_replay:
        reason = (
            f"{len(table.unreadable_on_replay)} page-table values the WAL replays over fail "
            f"their checksum (e.g. {table.unreadable_on_replay[0][:64]!r}): replayed as absent "
            "(a newer put still applies); `kvstore fsck --repair PATH` removes what is left"
        )
        recovered.degraded.append(reason)
        recovered.notes.append(reason)
    # A WAL file's name and the checkpoint LSN are issued LSNs too: never reissue them.
    issued = [checkpoint_lsn, *(wal_file.first_lsn for wal_file in chain)]
    recovered.lsn_lease = max(recovered.lsn_lease, recovered.max_lsn_seen + 1, max(issued) + 1)
    return recovered


def entries_in_segments(table: PageTable, segment_ids: set[int]) -> list[tuple[bytes, PageEntry]]:
    """Every live page-table entry (LMDB and overlay) in one of ``segment_ids``.

    One scan of the index; a value that fails its checksum is skipped (reads of its
    key raise CorruptionError, and fsck reports it).
    """
    overlay: dict[bytes, PageEntry | Tombstone] = dict(table.frozen or {})
    overlay.update(table.active)
    found: list[tuple[bytes, PageEntry]] = []
    for key, raw in table.env.iter_items(table.env.pages):
        if key in overlay:
            continue
        try:
            entry = decode_page_entry(key, raw)
            if table.limits is not None:
                validate_page_entry(key, entry, table.limits)
        except CorruptionError:
            continue
        if entry.segment_id in segment_ids:
            found.append((key, entry))
    for key, slot in overlay.items():
        if isinstance(slot, PageEntry) and slot.segment_id in segment_ids:
            found.append((key, slot))
    return found


def live_segments_now(
    env: IndexEnv, root: Path, store_uuid: bytes, attempts: int = 5
) -> dict[int, int] | None:
    """Segment id -> generation as of now, past any pin on ``env``; None if unknown.

    For a read-only view beside a live writer: the writer logs SEGMENT_FREE
    durably before it removes or reuses a segment's file, so a segment of the
    view whose file is gone or reused is freed in this newer state, while a
    segment that is live here really is missing or damaged. Reads a fresh LMDB
    checkpoint and the segment records of the WAL after it (retried while the
    writer's checkpoints delete the files being read).
    """
    for _ in range(attempts):
        try:
            with lmdb_read_errors(env.path):
                txn = env.env.begin(write=False, buffers=False)
            try:
                checkpoint_lsn = env.get_meta(txn, META_CHECKPOINT_LSN, 0)
                with lmdb_read_errors(env.path):
                    raw = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=env.segments)]
            finally:
                txn.abort()
            live = {}
            for raw_key, raw_value in raw:
                segment_id = int.from_bytes(raw_key, "big")
                if len(raw_key) == 8 and raw_key == segment_key(segment_id):
                    live[segment_id] = decode_segment_entry(segment_id, raw_value).generation
            for wal_file in read_wal_chain(root, store_uuid, checkpoint_lsn):
                for record in wal_file.records:
                    if record.record_type not in (WAL_SEGMENT_OPEN, WAL_SEGMENT_FREE):
                        continue
                    body = decode_body(record)
                    if isinstance(body, SegmentOpenBody):
                        live[body.segment_id] = body.generation
                    elif (
                        isinstance(body, SegmentFreeBody)
                        and live.get(body.segment_id) == body.generation
                    ):
                        del live[body.segment_id]
        except (CorruptionError, FileNotFoundError):
            continue  # a checkpoint moved on meanwhile (or damage: give up below)
        return live
    return None


def _check_sequence(what: str, value: int) -> None:
    if value >= SEQUENCE_LIMIT:
        raise CorruptionError(f"{what}: implausible number {value}; run `kvstore recover PATH`")


def _check_segment_state(segment_id: int, state: SegmentState, limits: EntryLimits) -> None:
    if (
        segment_id >= SEQUENCE_LIMIT
        or state.generation >= SEQUENCE_LIMIT
        or state.head_bytes % BLOCK_BYTES
        or not BLOCK_BYTES <= state.head_bytes <= limits.segment_bytes
        or state.state not in (SEGMENT_ACTIVE, SEGMENT_SEALED)
    ):
        raise CorruptionError(
            f"segment table entry {segment_id}: implausible (generation {state.generation}, "
            f"head {state.head_bytes}, state {state.state}); run `kvstore recover PATH`"
        )


def _check_body(record: WalRecord, body: WalBody, limits: EntryLimits) -> None:
    """Refuse a checksummed WAL record whose numbers no writer makes."""
    what = f"WAL record at lsn {record.lsn}"
    if isinstance(body, PutBody | MoveBody):
        put = body.put if isinstance(body, MoveBody) else body
        entry = put.entry(record.lsn)
        try:
            validate_page_entry(put.key, entry, limits)
        except CorruptionError as e:
            raise CorruptionError(f"{what}: {e}") from None
    elif isinstance(body, SegmentOpenBody | SegmentFreeBody):
        _check_sequence(f"{what}: segment id", body.segment_id)
        _check_sequence(f"{what}: generation", body.generation)
    elif isinstance(body, LsnLeaseBody):
        _check_sequence(f"{what}: lease", body.lease_until)


def _replay(
    recovered: Recovered,
    chain: list[WalFile],
    decoded: list[list[tuple[WalRecord, WalBody]]],
) -> None:
    table, segments, retains = recovered.table, recovered.segments, recovered.retains
    overlong: list[bytes] = []
    for wal_file, records in zip(chain, decoded, strict=True):
        if wal_file.torn_tail:
            recovered.notes.append(
                f"{wal_file.path.name}: torn tail at byte {wal_file.valid_end} "
                f"({wal_file.torn_tail})"
            )
        for record, body in records:
            recovered.max_lsn_seen = max(recovered.max_lsn_seen, record.lsn)
            recovered.replayed_records += 1
            key = _key_of(body)
            if key is not None and len(key) > MAX_INDEX_KEY_BYTES:
                # Logged by an older build that accepted keys LMDB cannot hold (its
                # checkpoints then all failed): the page is dropped, its space kept.
                if isinstance(body, PutBody | MoveBody):
                    put = body.put if isinstance(body, MoveBody) else body
                    state = segments.get(put.segment_id)
                    if state is not None and state.generation == put.generation:
                        end = put.offset + record_span(put.payload_bytes)
                        state.head_bytes = max(state.head_bytes, end)
                overlong.append(key)
                continue
            if isinstance(body, PutBody):
                entry = body.entry(record.lsn)
                apply_put(table, segments, body.key, entry)
            elif isinstance(body, MoveBody):
                put = body.put
                entry = put.entry(record.lsn)
                old = (body.old_segment_id, body.old_generation, body.old_offset)
                apply_move(
                    table, segments, put.key, entry, old, checkpoint_lsn=recovered.checkpoint_lsn
                )
            elif isinstance(body, DeleteBody):
                apply_delete(table, segments, body.key, record.lsn)
                retains.discard(body.key)
            elif isinstance(body, RetainBody):
                if body.retained:
                    retains.add(body.key)
                else:
                    retains.discard(body.key)
            elif isinstance(body, SegmentFreeBody):
                state = segments.get(body.segment_id)
                if state is not None and state.generation == body.generation:
                    del segments[body.segment_id]
                    recovered.dropped_segments.append(body.segment_id)
            elif isinstance(body, SegmentOpenBody):
                if body.segment_id not in segments:
                    segments[body.segment_id] = SegmentState(
                        body.generation, BLOCK_BYTES, 0, 0, 0, SEGMENT_ACTIVE
                    )
                recovered.next_segment_id = max(recovered.next_segment_id, body.segment_id + 1)
            elif isinstance(body, LsnLeaseBody):
                recovered.lsn_lease = max(recovered.lsn_lease, body.lease_until)
    if overlong:
        distinct = sorted(set(overlong))
        recovered.notes.append(
            f"dropped {len(distinct)} page(s) whose key is longer than the index's "
            f"{MAX_INDEX_KEY_BYTES}-byte limit (put by an older kvstore; {len(overlong)} WAL "
            f"records skipped), e.g. a key of {len(distinct[0])} bytes starting "
            f"{distinct[0][:32]!r}"
        )


def _key_of(body: WalBody) -> bytes | None:
    if isinstance(body, MoveBody):
        return body.put.key
    if isinstance(body, PutBody | DeleteBody | RetainBody):
        return body.key
    return None


def span_of(payload_bytes: int) -> int:
    return record_span(payload_bytes)

"""Creating, opening and repairing a store: the steps of ``KVStore.open`` that run
once, before the store serves anything (docs/design.md, "Layers").

``KVStore.__init__`` calls into here; these functions set the store's private
state (this module and store.py are the only ones that may, tests/unit/test_layering.py).
Nothing here runs after the open returns, so no lock is taken: the threads start last.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstore.config import StoreConfig
from kvstore.errors import (
    CorruptionError,
    IOFailure,
    KVStoreError,
    NotRegularFileError,
    StoreNotFoundError,
)
from kvstore.format.constants import BLOCK_BYTES, SEQUENCE_LIMIT
from kvstore.format.entries import SEGMENT_ACTIVE, SEGMENT_SEALED, PageEntry
from kvstore.format.names import INDEX_DIR, SEGMENTS_DIR, SUPERBLOCK_NAME, WAL_DIR
from kvstore.format.records import Superblock, decode_superblock, encode_superblock
from kvstore.format.wal import WAL_FILE_HEADER_BYTES
from kvstore.index.lmdb_env import IndexDamagedError, IndexEnv
from kvstore.index.recovery import (
    Recovered,
    apply_delete,
    entries_in_segments,
    live_segments_now,
    recover_index,
)
from kvstore.index.salvage import salvage_index
from kvstore.index.table import (
    META_CHECKPOINT_LSN,
    META_LSN_LEASE,
    META_NEXT_SEGMENT,
    META_PAGE_COUNT,
    SegmentState,
)
from kvstore.io.buffers import BufferPool
from kvstore.io.engine import make_engine, resolve_choice
from kvstore.io.files import fsync_dir, probe_direct_io, probe_direct_read, write_file_durably
from kvstore.log.journal import Journal
from kvstore.log.regular import directory_error, read_regular, require_directory
from kvstore.log.segment_reader import SegmentReader, verify_record
from kvstore.log.segments import (
    Segment,
    list_segment_files,
    open_segment,
    open_untrusted_segment,
)
from kvstore.log.wal import WalWriter, list_wal_files
from kvstore.runtime.checkpoint import Checkpointer
from kvstore.runtime.gc import Collector
from kvstore.runtime.internals import StoreInternals
from kvstore.runtime.policies import POLICIES, make_policy
from kvstore.runtime.reads import ReadPath
from kvstore.runtime.report import Degraded
from kvstore.runtime.rolling import SegmentSet
from kvstore.runtime.state import StoreState
from kvstore.runtime.writer import SegmentWriter
from kvstore.telemetry import counters as tc
from kvstore.telemetry.recorder import Recorder

if TYPE_CHECKING:
    from kvstore.store import KVStore

__all__ = [
    "check_config",
    "check_layout",
    "choose_active_segment",
    "create_store",
    "finish_index_swap",
    "internals_of",
    "open_components",
    "open_view_segment",
    "prepare",
    "quarantine_segments",
    "read_superblock",
    "recover",
    "salvage_damaged_index",
    "start_writing",
    "view_moved",
]

# A read-only open takes a new view this many times while the writer's checkpoints
# keep deleting the WAL files its view starts from.
VIEW_ATTEMPTS = 10


def recover(store: KVStore) -> Recovered:
    """The index as of one point in time: for a read-only open, one pinned LMDB
    read transaction and the WAL after its checkpoint (see ``_view_moved``)."""
    attempts = VIEW_ATTEMPTS if store.readonly else 1
    for attempt in range(attempts):
        if store.readonly:
            store._env.pin()
        try:
            recovered = recover_index(store._env, store.root, store.superblock.store_uuid)
            break
        except (CorruptionError, FileNotFoundError) as e:
            # A read-only open can race the writer's checkpoint deleting WAL files;
            # that is a view that moved, never damage: take a new one.
            if attempt < attempts - 1 and store.readonly and view_moved(store):
                continue
            if isinstance(e, FileNotFoundError):
                raise CorruptionError(
                    f"a file of {store.root} vanished or is a dangling link "
                    f"({e.filename}); run `kvstore recover PATH`"
                ) from e
            raise
    if not store.readonly:
        _repair_after_crash(store, recovered)
    return recovered


def view_moved(store: KVStore) -> bool:
    """Read-only: whether the writer has checkpointed since this view was pinned.

    Only a checkpoint deletes WAL files, and only those below its own
    ``checkpoint_lsn``: while the pinned checkpoint is still the newest, every
    WAL file from it on must be there, so a failure to read them is damage.
    """
    try:
        with store._env.read() as txn:
            pinned = store._env.get_meta(txn, META_CHECKPOINT_LSN, 0)
        return store._env.fresh_meta(META_CHECKPOINT_LSN, 0) != pinned
    except KVStoreError:
        return False


def open_view_segment(store: KVStore, segment_id: int, state: SegmentState) -> Segment | None:
    """Open a segment of the recovered index; None (read-only only) if the live
    writer has freed it since the view was taken (its file gone or reused)."""
    try:
        return open_segment(
            store.root,
            segment_id,
            state.generation,
            state.head_bytes,
            store_uuid=store.superblock.store_uuid,
            direct=store.direct_io,
            readonly=store.readonly,
        )
    except (CorruptionError, IOFailure) as e:
        if not store.readonly or (isinstance(e, IOFailure) and e.errno != errno.ENOENT):
            raise
        # A state read earlier in this open may predate this free: one that says
        # "freed" stays true (a segment id is never reused), "live" is re-read.
        for fresh in (False, True):
            if fresh or store._live_now is None:
                store._live_now = live_segments_now(
                    store._env, store.root, store.superblock.store_uuid
                )
            if store._live_now is not None and (
                store._live_now.get(segment_id) != state.generation
            ):
                return None
        raise  # still live (or cannot tell): the file really is missing or wrong


def salvage_damaged_index(store: KVStore, error: IndexDamagedError) -> IndexEnv:
    """Rebuild a structurally damaged LMDB index from what still verifies in it.

    LMDB must not read the file (it trusts its pages); kvstore/index/salvage.py
    reads it instead and keeps only checksummed values from sound, reachable,
    non-free pages of the current tree. A writer swaps the rebuilt index in
    (the damaged one is kept as ``index.damaged-<ts>/``; an interrupted swap is
    finished by the next open); a read-only open uses a private copy for its
    own life and changes nothing in the store.
    """
    root = store.root
    if store.readonly:
        store._salvage_dir = Path(tempfile.mkdtemp(prefix="kvstore-salvage-"))
        target = store._salvage_dir / INDEX_DIR
    else:
        target = root / INDEX_STAGE
        if target.exists():
            shutil.rmtree(target)
    try:
        store._index_salvage = salvage_index(
            root / INDEX_DIR / "data.mdb", target, root, store.superblock, error.problems
        )
    except (OSError, KVStoreError) as e:
        raise CorruptionError(
            f"{error.args[0]}; salvaging it failed too ({e}); run `kvstore recover PATH`"
        ) from e
    if not store.readonly:
        try:
            fsync_dir(target)
            fsync_dir(root)
            aside = root / f"{INDEX_DIR}.damaged-{int(time.time())}"
            n = 1
            while aside.exists():
                aside = aside.with_name(f"{INDEX_DIR}.damaged-{int(time.time())}.{n}")
                n += 1
            os.rename(root / INDEX_DIR, aside)
            os.rename(target, root / INDEX_DIR)
            fsync_dir(root)
        except OSError as e:
            raise IOFailure(f"cannot swap the salvaged index into {root}", e.errno) from e
        store._index_salvage.notes.append(f"the damaged index was kept as {aside.name}/")
        target = root / INDEX_DIR
    return IndexEnv(target, readonly=store.readonly)


def quarantine_segments(store: KVStore, damaged: dict[int, str]) -> None:
    """Keep serving what a damaged segment still holds, verified; drop the rest.

    A segment whose header is damaged (or names another id, generation or
    store), whose file is short, or whose file is missing cannot be vouched for
    as a whole. Its records can: each names its key, segment, offset,
    generation and LSN and carries its checksums. Every page the index places
    in such a segment is read and verified completely against its entry now;
    those that pass are served (and verified again on every read), the rest
    become misses (an in-memory delete at the page's own LSN, which the next
    checkpoint makes durable). The segment is opened read-only and sealed: no
    put, move or recycle ever writes into it (GC may still move its verified
    pages out and then remove the file). With its file gone, the segment is
    dropped. The damage stays on disk until then, so the next open finds it
    again, deterministically. Counted in ``stats()``.
    """
    quarantine = store._degraded
    for segment_id, why in sorted(damaged.items()):
        state = store._state.segment_states[segment_id]
        segment = open_untrusted_segment(
            store.root,
            segment_id,
            state.generation,
            state.head_bytes,
            size_bytes=store.config.segment_bytes,
            direct=store.direct_io,
        )
        if segment is not None:
            try:
                file_bytes = os.fstat(segment.fd).st_size
            except OSError:
                file_bytes = 0
            # A short file: GC must not scan past what is there.
            state.head_bytes = max(BLOCK_BYTES, min(state.head_bytes, file_bytes))
            state.head_bytes -= state.head_bytes % BLOCK_BYTES
            state.state = SEGMENT_SEALED
            store._state.segments[segment_id] = segment
        quarantine.segments[segment_id] = why
    served: Counter[int] = Counter()
    lost: Counter[int] = Counter()
    for key, entry in entries_in_segments(store._state.table, set(damaged)):
        segment = store._state.segments.get(entry.segment_id)
        state = store._state.segment_states[entry.segment_id]
        if (
            segment is not None
            and entry.offset + entry.span_bytes <= state.head_bytes  # inside the file
            and _verifies(store, segment, key, entry)
        ):
            served[entry.segment_id] += 1
            continue
        apply_delete(store._state.table, store._state.segment_states, key, entry.lsn)
        store._state.retains.discard(key)
        lost[entry.segment_id] += 1
    quarantine.salvaged_pages += sum(served.values())
    quarantine.served.update(served)
    quarantine.pages += sum(lost.values())
    for segment_id, why in sorted(damaged.items()):
        if segment_id not in store._state.segments:  # no file: nothing of it is left
            del store._state.segment_states[segment_id]
            store._state.dropped_segments.append(segment_id)
        reason = (
            f"segment {segment_id:016x}.seg quarantined ({why}): {served[segment_id]} "
            f"of its pages verified and are served, {lost[segment_id]} are misses"
        )
        quarantine.reasons.append(reason)
        store.recovery_notes.append(reason)


def _verifies(store: KVStore, segment: Segment, key: bytes, entry: PageEntry) -> bool:
    """Whether ``entry``'s record reads back whole and matches it (the read path's
    own check)."""
    buffer = store._buffers.acquire(entry.span_bytes)
    try:
        try:
            result = os.preadv(segment.fd, [buffer.view[: entry.span_bytes]], entry.offset)
        except OSError:
            return False
        try:
            verify_record(
                key, entry, buffer.view, result, max_page_bytes=store.config.max_page_bytes
            )
        except KVStoreError:
            return False
        return True
    finally:
        store._buffers.release(buffer)


def _repair_after_crash(store: KVStore, recovered: Recovered) -> None:
    """Cut torn WAL tails, drop WAL files below the checkpoint and orphan segments."""
    try:
        _repair_files(store, recovered)
    except OSError as e:
        raise IOFailure(f"cannot repair {store.root} after a crash", e.errno) from e


def _repair_files(store: KVStore, recovered: Recovered) -> None:
    root = store.root
    kept = []
    for wal_file in recovered.wal_files:
        if wal_file.torn_tail == "header never written":
            wal_file.path.unlink()
            continue
        if wal_file.valid_end < wal_file.file_bytes:
            with open(wal_file.path, "r+b") as handle:
                handle.truncate(wal_file.valid_end)
                handle.flush()
                os.fsync(handle.fileno())
        kept.append(wal_file)
    recovered.wal_files = kept
    for first_lsn, path in list_wal_files(root):
        if first_lsn < recovered.checkpoint_lsn:
            path.unlink()
    fsync_dir(root / WAL_DIR)
    for segment_id, path in list_segment_files(root).items():
        if segment_id not in recovered.segments:
            if path.is_dir() and not path.is_symlink():
                recovered.notes.append(f"left directory {path.name} (not a segment) alone")
                continue
            # Created, but its SEGMENT_OPEN never became durable: nothing points in.
            path.unlink()
            recovered.notes.append(f"removed orphan segment file {path.name}")
    # A segment id is never reused while anything of that name is in segments/ (a
    # directory left alone above, a quarantined segment's file, whatever its header
    # says): the writer creates its next segment past every one (O_EXCL would fail).
    # A name at or past SEQUENCE_LIMIT is one no writer reaches.
    left = [
        segment_id for segment_id in list_segment_files(root) if segment_id + 1 < SEQUENCE_LIMIT
    ]
    recovered.next_segment_id = max([recovered.next_segment_id, *(i + 1 for i in left)])
    for entry in os.scandir(root / SEGMENTS_DIR):
        if entry.name.endswith(".tmp") or entry.name.startswith("."):
            if entry.is_dir(follow_symlinks=False):
                recovered.notes.append(f"left directory {entry.name} in segments/ alone")
                continue
            os.unlink(entry.path)
    fsync_dir(root / SEGMENTS_DIR)


def choose_active_segment(store: KVStore) -> None:
    for segment_id in sorted(store._state.segments, reverse=True):
        segment = store._state.segments[segment_id]
        state = store._state.segment_states[segment_id]
        if state.state == SEGMENT_ACTIVE and segment.remaining() > BLOCK_BYTES:
            # Resume at the durable head: whatever a crash left past it is reclaimed.
            store._state.active = segment
            break
    for segment_id, state in store._state.segment_states.items():
        if store._state.active is None or segment_id != store._state.active.segment_id:
            state.state = SEGMENT_SEALED


def prepare(
    root: Path,
    *,
    create: bool,
    readonly: bool,
    capacity_bytes: int | None,
    segment_bytes: int,
    max_page_bytes: int | None,
    options: dict[str, Any],
) -> tuple[Path, StoreConfig]:
    """``KVStore.open``'s first step: the config from its options, every option checked
    before anything is created (a refused open leaves no store behind), and the store
    created when asked for and absent."""
    if max_page_bytes is None:
        max_page_bytes = 16 << 20
        if isinstance(segment_bytes, int):  # else validate() names the bad value
            max_page_bytes = min(max_page_bytes, segment_bytes - 2 * BLOCK_BYTES)
    try:
        config = StoreConfig(
            segment_bytes=segment_bytes,
            max_page_bytes=max_page_bytes,
            capacity_bytes=capacity_bytes,
            **options,
        )
    except TypeError as e:
        raise TypeError(f"unknown store option: {e}") from None
    creating = not check_layout(root)
    check_config(config, probe_engine=creating and create and not readonly)
    if creating:
        if not create or readonly:
            raise StoreNotFoundError(f"no kvstore at {root}")
        create_store(root, config)
    return root, config


def check_layout(root: Path) -> bool:
    """Whether a store is at ``root`` (its superblock is there); ``IOFailure`` for a
    damaged layout that no later step could report as more than a bare ``OSError``.

    The one place the open checks its directories, before it reads, creates or
    probes anything in them: a symlink loop as (or on the way to) the root, the
    superblock or ``segments/``, ``wal/``, ``index/``, or one of those three that
    is a regular file (FIFO, device, socket) instead of a directory. The message
    names the path, what is wrong and the fix; nothing is changed. What is missing
    passes: no root or no superblock is no store (refused, or created), and a
    missing (or dangling) directory is reported by the step that needs it, as
    before (``kvstore recover`` rebuilds ``wal/`` and ``index/``).
    """
    try:
        mode = os.stat(root).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as e:
        raise directory_error(root, e) from e
    if not stat.S_ISDIR(mode):
        return False  # no store: the open says so, and create_store refuses it
    superblock = root / SUPERBLOCK_NAME
    try:
        os.stat(superblock)
    except FileNotFoundError:
        return False
    except OSError as e:
        if e.errno == errno.ELOOP:
            message = (
                f"{superblock} is a symlink loop, not the store's superblock (kvstore "
                "changed nothing): restore it from a backup of this store"
            )
        else:
            message = f"cannot check {superblock}"
        raise IOFailure(message, e.errno) from e
    for name in (SEGMENTS_DIR, WAL_DIR, INDEX_DIR):
        require_directory(root / name)
    return True


def read_superblock(root: Path) -> Superblock:
    """The store's identity and geometry (one block, never a FIFO or a device)."""
    try:  # open(2) of a FIFO or device could block
        superblock = decode_superblock(read_regular(root / SUPERBLOCK_NAME, BLOCK_BYTES))
    except OSError as e:
        raise IOFailure(f"cannot read {root / SUPERBLOCK_NAME}", e.errno) from e
    except NotRegularFileError:
        raise
    except CorruptionError as e:
        # The one thing an open cannot degrade around: the store's identity.
        from kvstore.identity import superblock_error

        raise superblock_error(root, e) from None
    return superblock


def check_config(config: StoreConfig, *, probe_engine: bool) -> None:
    """``config.validate()`` plus the names it cannot check (they are registered in
    higher layers); with ``probe_engine``, also that an explicit ``io_engine="io_uring"``
    runs here (the probe is cached, so the open that follows pays nothing for it)."""
    config.validate()
    kind, binding, _ = resolve_choice(config.io_engine, config.uring_binding)
    if config.eviction_policy not in POLICIES:
        raise ValueError(
            f"eviction_policy must be one of {', '.join(sorted(POLICIES))}, "
            f"got {config.eviction_policy!r}"
        )
    if probe_engine and kind == "io_uring":
        from kvstore.io.probe import probe_uring

        verdict = probe_uring(binding)
        if not verdict.ok:
            raise IOFailure(f"io_engine='io_uring' cannot run here: {verdict.reason}")


INDEX_STAGE = "index.salvage"
"""Where a writer builds a salvaged index before swapping it in (docs/format.md)."""


def finish_index_swap(root: Path) -> None:
    """Finish, or undo, a salvaged-index swap a crash interrupted.

    The staged index is complete before the damaged one is renamed aside: with
    ``index/`` gone, the stage goes into place; with both there, the stage is
    dropped (the damage is found, and salvaged, again).
    """
    stage = root / INDEX_STAGE
    if not stage.exists():
        return
    try:
        if (root / INDEX_DIR).exists():
            shutil.rmtree(stage)
        else:
            os.rename(stage, root / INDEX_DIR)
        fsync_dir(root)
    except OSError as e:
        raise IOFailure(f"cannot finish the index swap in {root}", e.errno) from e


def create_store(root: Path, config: StoreConfig) -> None:
    """Build a new store under a temporary name, then rename it into place.

    A crash at any point leaves either no store or a whole one (a leftover
    ``.<name>.creating-*`` directory is ignored and may be removed). ``root`` may be
    a symlink to an empty directory: the store is made there (the rename would
    replace the link itself). An ``OSError`` is raised as ``IOFailure``.
    """
    root = root.absolute()
    if root.is_symlink():
        target = Path(os.path.realpath(root))
        if not target.exists():
            raise IOFailure(
                f"{root} is a symlink to {target}, which does not exist (kvstore changed "
                "nothing): create that directory, or pass another path",
                errno.ENOENT,
            )
        root = target
    try:
        _build_store(root, config)
    except OSError as e:
        where = f" ({e.filename})" if e.filename and Path(e.filename) != root else ""
        raise IOFailure(f"cannot create a store at {root}{where}", e.errno) from e


def _build_store(root: Path, config: StoreConfig) -> None:
    if root.exists():
        if not root.is_dir():
            raise ValueError(f"{root} exists and is not a directory")
        if any(root.iterdir()):
            raise ValueError(f"{root} exists, is not empty, and is not a kvstore")
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.parent / f".{root.name}.creating-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(mode=0o700)
    try:
        for name in (SEGMENTS_DIR, WAL_DIR, INDEX_DIR):
            (tmp / name).mkdir(mode=0o700)
        store_uuid = uuid.uuid4().bytes
        superblock = Superblock(
            store_uuid,
            time.time_ns(),
            config.segment_bytes,
            config.max_page_bytes,
            config.capacity_bytes or 0,
        )
        write_file_durably(tmp / SUPERBLOCK_NAME, encode_superblock(superblock))
        env = IndexEnv(tmp / INDEX_DIR, readonly=False, create=True)
        try:

            def body(txn: Any) -> None:
                from kvstore.index.lmdb_env import encode_meta_u64

                for key, value in (
                    (META_CHECKPOINT_LSN, 1),
                    (META_LSN_LEASE, 2),
                    (META_PAGE_COUNT, 0),
                    (META_NEXT_SEGMENT, 1),
                ):
                    txn.put(key, encode_meta_u64(key, value), db=env.meta)

            env.write(body)
        finally:
            env.close()
        WalWriter(tmp, store_uuid, 1, 0).close()
        for name in (SEGMENTS_DIR, WAL_DIR, INDEX_DIR):
            fsync_dir(tmp / name)
        fsync_dir(tmp)
        if root.exists():
            root.rmdir()
        os.rename(tmp, root)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(root.parent)


def open_components(store: KVStore) -> Recovered:
    """Open everything of ``store`` but its threads: the I/O engine, the index (salvaged
    if damaged), recovery, the telemetry recorder, the shared state, the segments
    (quarantined where damaged) and the components. Returns what recovery found."""
    root, config = store.root, store.config
    if config.direct_io is not None:
        store.direct_io = config.direct_io
    elif store.readonly:  # a reader must not create files; probe by reading
        store.direct_io = probe_direct_read(root / SUPERBLOCK_NAME)
    else:
        store.direct_io = probe_direct_io(root / SEGMENTS_DIR)
    store._engine = make_engine(config.io_engine, config.io_depth, config.uring_binding)
    store._buffers = BufferPool()
    store._index_salvage = None
    store._salvage_dir = None  # read-only: a private rebuilt index
    try:
        if not store.readonly:
            finish_index_swap(root)
        store._env = IndexEnv(root / INDEX_DIR, readonly=store.readonly)
    except IndexDamagedError as e:
        store._env = salvage_damaged_index(store, e)
    store._live_now = None
    try:
        recovered = recover(store)
    except IndexDamagedError as e:  # a damaged value: checksum or plausibility
        if store._index_salvage is not None:
            raise
        store._env.close()
        store._env = salvage_damaged_index(store, e)
        recovered = recover(store)
    store.recovery_notes = list(recovered.notes)
    store.replayed_records = recovered.replayed_records
    lock = threading.Lock()
    store._recorder = Recorder(root, config, store._env, lock, readonly=store.readonly)
    store.recovery_notes.extend(store._recorder.notes)
    capacity = config.capacity_bytes or store.superblock.capacity_bytes or None
    store._state = StoreState(
        lock=lock,
        table=recovered.table,
        segment_states=recovered.segments,
        next_segment_id=recovered.next_segment_id,
        checkpoint_lsn=recovered.checkpoint_lsn,
        lsn_lease=recovered.lsn_lease,
        retains=recovered.retains,
        dropped_segments=list(recovered.dropped_segments),
        capacity_bytes=capacity,
        segment_bytes=config.segment_bytes,
        gc_reserve_segments=config.gc_reserve_segments,
        policy=make_policy(config.eviction_policy),
        tv=store._recorder.values,
    )
    store._reader = SegmentReader(
        store._state.segments,
        store._engine,
        store._buffers,
        max_page_bytes=config.max_page_bytes,
        # Single-page reads poll their completion on io_uring (StoreConfig.read_poll_us).
        poll_ns=config.read_poll_us * 1000 if store._engine.name == "io_uring" else 0,
        readonly=store.readonly,
        on_stale=store._state.count_stale_read,  # no reference back to the store
    )
    damaged: dict[int, str] = {}
    for segment_id, state in sorted(store._state.segment_states.items()):
        try:
            segment = open_view_segment(store, segment_id, state)
        except CorruptionError as e:  # damaged header, another identity, missing, short
            damaged[segment_id] = e.args[0] if e.args else type(e).__name__
            continue
        if segment is None:
            del store._state.segment_states[segment_id]
            store._state.gone_segments.add(segment_id)
        else:
            store._state.segments[segment_id] = segment
    store._degraded = Degraded(
        reasons=list(recovered.degraded),
        damaged_wal_headers=recovered.damaged_wal_headers,
        salvaged_wal_records=recovered.salvaged_wal_records,
    )
    if store._index_salvage is not None:
        salvage = store._index_salvage
        store._degraded.index_salvaged = True
        store._degraded.pages += salvage.pages_lost
        reason = (
            f"LMDB index damaged ({salvage.problems[0]}); rebuilt from what verifies: "
            f"{salvage.summary()}"
        )
        store._degraded.reasons.append(reason)
        store.recovery_notes.append(reason)
        store.recovery_notes.extend(salvage.notes)
    if damaged:
        quarantine_segments(store, damaged)
    store._journal = Journal(
        store._state,
        lease_step=config.lsn_lease_step,
        check_writable=store._check_writable_locked,
        on_commit=store._recorder.count_commit_locked,
    )
    store._reads = ReadPath(store._state, store._reader)
    store._segment_set = SegmentSet(
        store._state,
        root,
        store_uuid=store.superblock.store_uuid,
        segment_bytes=config.segment_bytes,
        direct=store.direct_io,
    )
    store._writer = SegmentWriter(
        store._state,
        store._engine,
        store._buffers,
        io_depth=config.io_depth,
        segment_set=store._segment_set,
        journal=store._journal,
        check_writable=store._check_writable_locked,
    )
    store._collector = Collector(
        store._state,
        config,
        root=root,
        store_uuid=store.superblock.store_uuid,
        engine=store._engine,
        buffers=store._buffers,
        reader=store._reader,
        journal=store._journal,
        writer=store._writer,
        wait_writable=store._wait_writable_locked,
        segment_set=store._segment_set,
    )
    store._writer.make_room = store._collector.make_room
    store._checkpointer = Checkpointer(store._state, store._journal, store._recorder, root)
    store._stop = threading.Event()
    store._flusher = store._gc_thread = store._prepare_thread = store._telemetry_thread = None
    return recovered


def start_writing(store: KVStore, recovered: Recovered) -> None:
    """A writer's open: the active segment, and a new WAL file after the recovered ones."""
    choose_active_segment(store)
    chain = recovered.wal_files
    prev = chain[-1].first_lsn if chain else 0
    first_lsn = store._state.take_lsn_locked()
    store._journal.wal = WalWriter(store.root, store.superblock.store_uuid, first_lsn, prev)
    store._state.tv[tc.WAL] += WAL_FILE_HEADER_BYTES
    store._recorder.gauges_locked = store._gauges_locked  # persisted with the counters
    store._recorder.start_session()  # counting for stats() starts once open


def internals_of(store: KVStore) -> StoreInternals:
    """``KVStore.internals``: the typed view fsck and the test harnesses use."""

    def abandon() -> None:
        # The threads first: a prepare thread left running would make a spare segment
        # after the next open's orphan sweep, under the id that open's writer creates.
        store._stop_threads()
        store._release_resources()
        store._closed = True

    return StoreInternals(
        state=store._state,
        env=store._env,
        engine=store._engine,
        buffers=store._buffers,
        reader=store._reader,
        writer=store._writer,
        journal=store._journal,
        segment_set=store._segment_set,
        collector=store._collector,
        checkpoint_lock=store._checkpointer.lock,
        degraded=store._degraded,
        flusher=store._flusher,
        readonly=store.readonly,
        closed=store._closed,
        writer_lock_held=store._lock_fd >= 0,
        check_open=store._check_open,
        view_moved=lambda: view_moved(store),
        abandon=abandon,
    )

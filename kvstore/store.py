"""KVStore: the engine-facing API, a facade over the store's components.

The components (docs/design.md, "Layers"; each documents its own locks):
``lifecycle`` opens and repairs; ``runtime.state.StoreState`` is the state under the
one state lock; ``log.journal.Journal`` group-commits the WAL; ``runtime.writer``
batches, writes and publishes puts; ``log.segment_reader`` and ``runtime.reads`` read
and verify; ``runtime.rolling`` makes segment files; ``runtime.gc.Collector`` frees,
compacts and evicts; ``runtime.checkpoint.Checkpointer`` writes the index;
``telemetry.recorder.Recorder`` counts. The facade keeps the public methods, the
threads, the pin and unpin paths (inlined for speed), delete and retain.

Lock order: {checkpoint | GC} -> commit -> state; the state lock is innermost.
A failed write or fsync stops the writer for good (WriterFailedError); reopening
replays the WAL.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from kvstore import lifecycle
from kvstore.config import StoreConfig
from kvstore.errors import (
    ClosedError,
    KVStoreError,
    PinError,
    ReadOnlyError,
    WriterFailedError,
)
from kvstore.format.constants import MAX_INDEX_KEY_BYTES, record_span
from kvstore.format.names import LOCK_NAME
from kvstore.format.wal import encode_delete
from kvstore.index.lmdb_env import IndexEnv
from kvstore.index.recovery import apply_delete
from kvstore.index.salvage import IndexSalvage
from kvstore.index.table import SegmentState
from kvstore.inputs import (
    check_fits,
    decode_meta,
    key_bytes,
    meta_bytes,
    value_view,
    writable_view,
)
from kvstore.io.buffers import BufferPool
from kvstore.io.engine import IOEngine
from kvstore.io.files import acquire_writer_lock
from kvstore.log.journal import Journal
from kvstore.log.regular import require_regular
from kvstore.log.segment_reader import SegmentReader
from kvstore.log.wal import list_wal_files
from kvstore.runtime.checkpoint import Checkpointer
from kvstore.runtime.gc import Collector
from kvstore.runtime.internals import StoreInternals
from kvstore.runtime.protection import retain_step_locked
from kvstore.runtime.reads import ReadPath
from kvstore.runtime.report import Degraded, gauges_locked, store_stats_locked
from kvstore.runtime.rolling import SegmentSet
from kvstore.runtime.state import StoreState
from kvstore.runtime.tally import GCTally
from kvstore.runtime.writer import SegmentWriter, Turn
from kvstore.telemetry import TelemetrySnapshot
from kvstore.telemetry import counters as tc
from kvstore.telemetry.recorder import Recorder
from kvstore.telemetry.wear import WearReport
from kvstore.types import GCReport, HeldExtent, Key, Meta, PageInfo, StoreStats

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from kvstore.check import Finding

__all__ = ["KVStore", "StoreInternals"]


def _quietly(release: Callable[[], object]) -> None:
    """Run one release step of ``close``; an OSError must not skip the others."""
    try:
        release()
    except (OSError, KVStoreError):
        pass


def _payload_bytes(payload: memoryview, _in_place: bool) -> bytes:
    return bytes(payload)


class KVStore:
    """A persistent store of KV-cache pages. Open with ``KVStore.open``.

    Thread-safe. One writer process per store (flock on ``LOCK``); any number
    of ``readonly=True`` opens may run beside it and see the state as of their
    open.
    """

    max_key_bytes = MAX_INDEX_KEY_BYTES
    """The longest key accepted (bytes, or str as UTF-8): what the LMDB index holds."""

    # Set by the open (lifecycle.open_components), constant after it.
    direct_io: bool
    recovery_notes: list[str]
    replayed_records: int
    _engine: IOEngine
    _buffers: BufferPool
    _env: IndexEnv
    _index_salvage: IndexSalvage | None
    _salvage_dir: Path | None  # read-only: a private rebuilt index
    _live_now: dict[int, int] | None  # read-only: segments live now, when asked
    _degraded: Degraded
    # The components (docs/design.md, "Layers"), each documenting its locks.
    _recorder: Recorder
    _state: StoreState  # everything guarded by the state lock
    _reader: SegmentReader
    _reads: ReadPath
    _journal: Journal
    _segment_set: SegmentSet
    _collector: Collector
    _writer: SegmentWriter
    _checkpointer: Checkpointer
    # A writer's threads: started last by the open, joined by close.
    _stop: threading.Event
    _flusher: threading.Thread | None
    _gc_thread: threading.Thread | None
    _prepare_thread: threading.Thread | None
    _telemetry_thread: threading.Thread | None

    # -- opening -----------------------------------------------------------

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        create: bool = False,
        readonly: bool = False,
        capacity_bytes: int | None = None,
        segment_bytes: int = 256 << 20,
        max_page_bytes: int | None = None,
        **options: Any,
    ) -> KVStore:
        """Open (or with ``create=True`` create) the store at ``path``.

        ``options`` are the other ``StoreConfig`` fields (flush_interval_ms,
        checkpoint_wal_bytes, io_engine, direct_io, io_depth, ...).
        ``max_page_bytes`` defaults to 16 MiB, or less if the segment is smaller.
        """
        root, config = lifecycle.prepare(
            Path(path),
            create=create,
            readonly=readonly,
            capacity_bytes=capacity_bytes,
            segment_bytes=segment_bytes,
            max_page_bytes=max_page_bytes,
            options=options,
        )
        return cls(root, config, readonly=readonly)

    def __init__(self, root: Path, config: StoreConfig, *, readonly: bool) -> None:
        self.root = root
        self.readonly = readonly
        self._closed = False
        self._pipeline_pool: ThreadPoolExecutor | None = None
        self._pipeline_closed = False
        self._pipeline_lock = threading.Lock()
        self._turn = Turn()  # put_many_async batches reserve in submission order
        self._lock_fd = -1
        superblock = lifecycle.read_superblock(root)
        self.superblock = superblock
        # Geometry is fixed at creation; runtime options come from this open.
        self.config = dataclasses.replace(
            config,
            segment_bytes=superblock.segment_bytes,
            max_page_bytes=superblock.max_page_bytes,
        )
        if not readonly:
            require_regular(root / LOCK_NAME)
            self._lock_fd = acquire_writer_lock(root)
        try:
            recovered = lifecycle.open_components(self)
            if not readonly:
                lifecycle.start_writing(self, recovered)
                self._start_threads()
        except BaseException:
            self._stop_threads()  # any that started
            self._release_resources()
            raise

    def _start_threads(self) -> None:
        """A writer's background threads: group commit and checkpoints, telemetry, the
        spare segment, GC. They start last, once everything they touch is open."""
        self._flusher = threading.Thread(target=self._flush_loop, name="kvstore-flush", daemon=True)
        self._flusher.start()
        self._telemetry_thread = threading.Thread(
            target=self._telemetry_loop, name="kvstore-telemetry", daemon=True
        )
        self._telemetry_thread.start()
        self._prepare_thread = threading.Thread(
            target=self._segment_set.prepare_loop,
            args=(self._stop,),
            name="kvstore-prepare",
            daemon=True,
        )
        self._prepare_thread.start()
        if self.config.gc_interval_s > 0:
            self._gc_thread = threading.Thread(target=self._gc_loop, name="kvstore-gc", daemon=True)
            self._gc_thread.start()

    # -- context manager and closing --------------------------------------

    def __enter__(self) -> KVStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Flush, checkpoint and release everything. Idempotent."""
        if self._closed:
            return
        with self._pipeline_lock:
            self._pipeline_closed = True  # no new pipelined batch from here on
            pipeline, self._pipeline_pool = self._pipeline_pool, None
        try:
            if pipeline is not None:
                pipeline.shutdown(wait=True)  # the batches in flight finish first
            self._closed = True
            if not self.readonly and hasattr(self, "_stop"):
                self._stop_threads()
                if self._state.failed is None:
                    self._checkpointer.run()  # persists the telemetry too
                else:
                    with self._checkpointer.lock:
                        self._recorder.persist()
        finally:
            self._closed = True
            self._release_resources()

    def _stop_threads(self) -> None:
        """Stop the writer's background threads and wait for each (nothing is flushed
        or checkpointed here; what one was doing, it finishes). Once this returns, no
        thread of this store creates, writes or removes a file of the store: a spare
        segment the prepare thread made after a crash-like ``abandon`` would otherwise
        appear under an id the next open's writer creates too (EEXIST)."""
        stop: threading.Event | None = getattr(self, "_stop", None)
        if stop is None:
            return
        stop.set()
        self._state.spare_wanted.set()
        for name in ("_prepare_thread", "_gc_thread", "_flusher", "_telemetry_thread"):
            thread: threading.Thread | None = getattr(self, name, None)
            if thread is not None and thread is not threading.current_thread():
                thread.join()

    def _release_resources(self) -> None:
        """Release everything, even when one step fails: above all the writer lock.

        A failed unlink or close here loses nothing: the spare was never named
        by the WAL (the next open removes it) and every descriptor is freed by
        the kernel whatever close() returns.
        """
        state: StoreState | None = getattr(self, "_state", None)
        spare = state.spare if state is not None else None
        if state is not None and spare is not None:  # never named by the WAL: remove it now
            state.spare = None
            _quietly(spare.close)
            _quietly(lambda: spare.path.unlink(missing_ok=True))
        recorder = getattr(self, "_recorder", None)
        if recorder is not None:  # its gauge callback refers back to this store
            recorder.gauges_locked = None
        collector: Collector | None = getattr(self, "_collector", None)
        if collector is not None:
            collector.close()
        writer: SegmentWriter | None = getattr(self, "_writer", None)
        if writer is not None:
            writer.close()
        journal: Journal | None = getattr(self, "_journal", None)
        if journal is not None:
            _quietly(journal.close)  # the WAL file too
        for segment in state.segments.values() if state is not None else ():
            _quietly(segment.close)
        env = getattr(self, "_env", None)
        if env is not None:
            _quietly(env.close)
        engine = getattr(self, "_engine", None)
        if engine is not None:
            _quietly(engine.close)
        salvage_dir = getattr(self, "_salvage_dir", None)
        if salvage_dir is not None:
            self._salvage_dir = None
            shutil.rmtree(salvage_dir, ignore_errors=True)
        if self._lock_fd >= 0:
            fd, self._lock_fd = self._lock_fd, -1
            _quietly(lambda: os.close(fd))

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"store {self.root} is closed")

    def _check_writable_locked(self) -> None:
        """Raise unless writes are allowed. Caller holds the state lock."""
        if self._closed:
            raise ClosedError(f"store {self.root} is closed")
        if self.readonly:
            raise ReadOnlyError(f"store {self.root} was opened read-only")
        if self._state.failed is not None:
            raise WriterFailedError(
                f"the writer stopped after an earlier failure ({self._state.failed}); "
                "reopen the store"
            )

    def _wait_writable_locked(self) -> None:
        """Raise unless writes are allowed; wait out a writer barrier. Caller holds the
        state lock (``cond`` waits on it)."""
        self._check_writable_locked()
        while self._state.freezing:
            self._state.cond.wait()
            self._check_writable_locked()

    # -- writes --------------------------------------------------------------

    def put(self, key: Key, value: object, *, meta: Meta | None = None, sync: bool = False) -> bool:
        """Store ``value`` under ``key``. True when stored.

        Readable when this returns; durable at the next group commit (within
        ``flush_interval_ms``), or before returning when ``sync=True``.
        """
        return self.put_many([(key, value, meta)], sync=sync)[0]

    def put_many(
        self,
        items: Iterable[tuple[Key, object] | tuple[Key, object, Meta | None]],
        *,
        sync: bool = False,
    ) -> list[bool]:
        """Store many pages with up to ``io_depth`` writes in flight.

        Returns, per item, True when stored (False is reserved for an admission
        policy declining the page). Items are validated before anything is
        written, so a bad item raises without storing any of the batch.

        A value in writable, 4 KiB-aligned memory of at least 16 KiB (an mmap, an
        aligned numpy or torch buffer, pinned host memory) is written straight from
        that memory, without a copy (docs/design.md, "Write path"); other values are
        copied into the store's aligned buffers.
        """
        prepared = self._prepare_puts(items)
        return self._put_prepared(prepared, sync, None, 0)

    def put_many_async(
        self,
        items: Iterable[tuple[Key, object] | tuple[Key, object, Meta | None]],
        *,
        sync: bool = False,
    ) -> Future[list[bool]]:
        """``put_many`` on a pipeline thread: returns at once with a ``Future`` of its result.

        Up to ``pipeline_depth`` batches run at once, so the next batch's writes are
        prepared and submitted while the previous batch's I/O and group commit are in
        flight (docs/design.md, "Pipelined batches"). Items are validated here, before
        this returns (a bad item raises now and stores nothing); batches take their LSNs
        in the order they were submitted, so of two batches holding one key the later
        wins. Each page is readable once the future is done, and durable then when
        ``sync=True``; a page is never acknowledged before its write and, with ``sync``,
        its group commit are complete. The values' memory must stay unchanged until the
        future is done (pages in aligned memory are written straight from it).
        """
        prepared = self._prepare_puts(items)
        turn = self._turn
        ticket = turn.ticket()
        try:
            return self._pipeline().submit(self._put_prepared, prepared, sync, turn, ticket)
        except BaseException:
            turn.done(ticket)  # never run: the batches after it must not wait for it
            raise

    def _prepare_puts(
        self, items: Iterable[tuple[Key, object] | tuple[Key, object, Meta | None]]
    ) -> list[tuple[bytes, memoryview, bytes]]:
        self._check_open()
        if self.readonly:
            raise ReadOnlyError(f"store {self.root} was opened read-only")
        prepared = []
        for item in items:
            if not isinstance(item, tuple) or len(item) not in (2, 3):
                raise TypeError("put_many items must be (key, value) or (key, value, meta) tuples")
            key = key_bytes(item[0])
            view = value_view(item[1], self.config.max_page_bytes)
            meta = meta_bytes(item[2] if len(item) == 3 else None)
            prepared.append((key, view, meta))
        return prepared

    def _put_prepared(
        self,
        prepared: list[tuple[bytes, memoryview, bytes]],
        sync: bool,
        turn: Turn | None,
        ticket: int,
    ) -> list[bool]:
        st = self._state
        try:
            if not prepared:
                return []
            started_ns = time.perf_counter_ns()
            admitted: list[bool] | None = None
            if self._recorder.budget is not None:
                spans = [record_span(view.nbytes) for _, view, _ in prepared]
                with st.lock:
                    admitted = self._recorder.budget.admit(spans, tc.store_bytes(st.tv))
                    for ok, (_, view, _) in zip(admitted, prepared, strict=True):
                        if not ok:
                            st.tv[tc.DECLINED_PUTS] += 1
                            st.tv[tc.DECLINED_BYTES] += view.nbytes
                prepared = [item for item, ok in zip(prepared, admitted, strict=True) if ok]
            self._writer.write(prepared, started_ns, turn=turn, ticket=ticket)
        finally:
            if turn is not None:
                turn.done(ticket)  # a batch that wrote nothing passes its turn too
        if sync and prepared:
            self.flush()
        return [True] * len(prepared) if admitted is None else admitted

    def _pipeline(self) -> ThreadPoolExecutor:
        """The pipeline threads of the async calls, made on first use."""
        pipeline = self._pipeline_pool
        if pipeline is None:
            with self._pipeline_lock:
                if self._pipeline_closed:
                    raise ClosedError(f"store {self.root} is closed")
                pipeline = self._pipeline_pool
                if pipeline is None:
                    pipeline = self._pipeline_pool = ThreadPoolExecutor(
                        max_workers=self.config.pipeline_depth,
                        thread_name_prefix="kvstore-pipe",
                    )
        return pipeline

    def delete(self, key: Key) -> bool:
        """Delete ``key``; True if it was present. Durable like a plain put."""
        st = self._state
        raw = key_bytes(key)
        with st.cond:
            self._wait_writable_locked()
            if st.table.get(raw) is None:
                return False
            if st.next_lsn + 2 >= st.lease_until:
                lease_needed = True
            else:
                lease_needed = False
                lsn = st.take_lsn_locked()
                apply_delete(st.table, st.segment_states, raw, lsn)
                st.pending.append(encode_delete(lsn, raw))
                st.retains.discard(raw)
                st.policy.on_delete(raw)
                st.tv[tc.DELETES] += 1
                return True
        if lease_needed:
            self._journal.extend_lease()
        return self.delete(key)

    # -- durability --------------------------------------------------------

    def flush(self) -> None:
        """Return when every put and delete that returned before this call is durable."""
        self._check_open()
        if self.readonly:
            return
        self._journal.commit()

    def checkpoint(self) -> None:
        """Write the overlay to LMDB and drop WAL files it covers."""
        self._check_open()
        if self.readonly:
            raise ReadOnlyError(f"store {self.root} was opened read-only")
        self._checkpointer.run()

    def _telemetry_loop(self) -> None:
        """Sample throughput every second; persist the counters every
        ``telemetry_flush_interval_s`` (``Recorder.tick``)."""
        interval = self.config.telemetry_flush_interval_s
        while not self._stop.wait(min(1.0, interval)):
            self._recorder.tick(interval, self._checkpointer.lock)

    def _flush_loop(self) -> None:
        interval = self.config.flush_interval_ms / 1000.0
        try:
            while not self._stop.wait(interval):
                try:
                    if self._state.pending:  # a peek: a record appended just after waits one tick
                        self.flush()
                    wal = self._journal.wal
                    if wal is not None and (
                        wal.size_bytes >= self.config.checkpoint_wal_bytes
                        or (
                            time.monotonic() - self._checkpointer.last_run
                            >= self.config.checkpoint_interval_s
                            and not self._checkpointer.idle()
                        )  # an idle writer writes nothing
                    ):
                        self._checkpointer.run()
                except (KVStoreError, OSError):
                    # A failed write is recorded in self._state.failed (callers see it on
                    # their next write); a failed checkpoint is retried next time.
                    if self._state.failed is not None or self._closed:
                        return
        except BaseException as e:
            self._background_failed("kvstore-flush", e)

    def _background_failed(self, thread: str, error: BaseException) -> None:
        """A background thread met an exception it has no handling for (a bug): it
        stops, and so does the writer, with the reason, rather than going on without
        group commits (or GC) while writers wait for durability that never comes."""
        failure = WriterFailedError(
            f"the {thread} thread stopped on an unexpected {type(error).__name__}: {error}"
        )
        failure.__cause__ = error
        self._state.fail(failure)

    # -- reads ---------------------------------------------------------------

    def get(self, key: Key) -> bytes | None:
        """The verified bytes stored under ``key``, or None when absent."""
        self._check_open()
        return self._reads.read_one(key, _payload_bytes, None)

    def get_many(self, keys: Iterable[Key]) -> list[bytes | None]:
        """Many verified pages with up to ``io_depth`` reads in flight; None for misses."""
        self._check_open()
        wanted = [self._reads.entry(key) for key in keys]
        out: list[bytes | None] = [None] * len(wanted)

        def sink(index: int, payload: memoryview) -> None:
            out[index] = bytes(payload)

        self._reads.read_many(wanted, sink)
        return out

    def get_into(self, key: Key, buffer: object) -> int | None:
        """Read ``key`` into the caller's writable buffer; bytes written, or None.

        Zero-copy where the buffer allows it: 4 KiB-aligned memory (mmap, pinned
        host memory) and a page of whole 4 KiB blocks are read straight into the
        buffer by the device, and verified there. Otherwise the page is read into
        an aligned pool buffer, verified, and copied. Only the page's bytes are
        written either way. If the read fails (``IOFailure``, ``CorruptionError``)
        the buffer's first ``payload_bytes`` are unspecified, and so they are after
        a read-only view's miss of a page the live writer freed and reused since.
        """
        self._check_open()
        target = writable_view(buffer)

        def copy(payload: memoryview, in_place: bool) -> int:
            if not in_place:
                target[: payload.nbytes] = payload
            return payload.nbytes

        return self._reads.read_one(key, copy, target)

    def get_many_into(self, keys: Iterable[Key], buffers: Iterable[object]) -> list[int | None]:
        """Read many pages into the caller's buffers with up to ``io_depth`` reads in flight.

        ``buffers[i]`` receives ``keys[i]``; returns the bytes written per key, or
        None for a miss. Every buffer is checked (writable, contiguous, large
        enough for its page) before anything is read. Zero-copy per buffer as in
        ``get_into``.
        """
        self._check_open()
        wanted = [self._reads.entry(key) for key in keys]
        targets = [writable_view(buffer) for buffer in buffers]
        if len(targets) != len(wanted):
            raise ValueError(f"{len(wanted)} keys but {len(targets)} buffers")
        for (raw, entry), target in zip(wanted, targets, strict=True):
            if entry is not None:
                check_fits(target, raw, entry.payload_bytes)

        def sink(index: int, payload: memoryview) -> None:
            target = targets[index]
            check_fits(target, wanted[index][0], payload.nbytes)  # overwritten meanwhile?
            target[: payload.nbytes] = payload

        return self._reads.read_many(wanted, sink, targets)

    def get_many_async(self, keys: Iterable[Key]) -> Future[list[bytes | None]]:
        """``get_many`` on a pipeline thread: a ``Future`` of its result, at once.

        Up to ``pipeline_depth`` batches of reads run at once, so the device has the
        next batch's reads while the previous batch is verified and copied out.
        """
        keys = list(keys)
        self._check_open()
        return self._pipeline().submit(self.get_many, keys)

    def get_many_into_async(
        self, keys: Iterable[Key], buffers: Iterable[object]
    ) -> Future[list[int | None]]:
        """``get_many_into`` on a pipeline thread: a ``Future`` of its result, at once.

        The buffers are checked here (writable, contiguous, one per key); the sizes
        when the batch runs. They must not be read or reused until the future is done.
        """
        keys = list(keys)
        targets = [writable_view(buffer) for buffer in buffers]
        if len(targets) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(targets)} buffers")
        self._check_open()
        return self._pipeline().submit(self.get_many_into, keys, targets)

    # -- pins and retains ------------------------------------------------

    def pin(self, key: Key) -> bool:
        """Protect the page under ``key`` from being moved, evicted or freed.

        False if the key is absent or deleted. Volatile (this process only);
        every successful pin needs one ``unpin``.
        """
        st = self._state
        raw = key if type(key) is bytes and 0 < len(key) <= MAX_INDEX_KEY_BYTES else key_bytes(key)
        if self._closed:
            self._check_open()
        with st.lock:
            # The same steps as pin_many's loop, inlined: a shared helper costs
            # about 8% of a pin+unpin pair (docs/benchmarks.md, pin/unpin target).
            entry = st.table.get(raw)
            if entry is None:
                return False
            stack = st.pins.get(raw)
            if stack is None:
                st.pins[raw] = [entry]
            else:
                stack.append(entry)
            segment_pins = st.segment_pins
            segment_pins[entry.segment_id] = segment_pins.get(entry.segment_id, 0) + 1
            return True

    def pin_many(self, keys: Iterable[Key]) -> list[bool]:
        """``pin`` each key under one lock round; per key, False if it is absent."""
        st = self._state
        raws = [key_bytes(key) for key in keys]
        self._check_open()
        results = []
        with st.lock:
            lookup, pins, segment_pins = st.table.get, st.pins, st.segment_pins
            for raw in raws:
                entry = lookup(raw)
                if entry is None:
                    results.append(False)
                    continue
                stack = pins.get(raw)
                if stack is None:
                    pins[raw] = [entry]
                else:
                    stack.append(entry)
                segment_pins[entry.segment_id] += 1
                results.append(True)
        return results

    def unpin(self, key: Key) -> None:
        """Drop one pin of ``key``; PinError if it is not pinned."""
        st = self._state
        raw = key if type(key) is bytes and 0 < len(key) <= MAX_INDEX_KEY_BYTES else key_bytes(key)
        if self._closed:
            self._check_open()
        with st.lock:
            stack = st.pins.get(raw)
            if not stack:
                raise PinError(f"unpin of {raw!r}, which is not pinned")
            segment_id = stack.pop().segment_id
            if not stack:
                del st.pins[raw]
            segment_pins = st.segment_pins
            left = segment_pins[segment_id] - 1
            if left:
                segment_pins[segment_id] = left
            else:
                del segment_pins[segment_id]

    def unpin_many(self, keys: Iterable[Key]) -> None:
        """Drop one pin of each key; PinError, and nothing unpinned, if one is not pinned."""
        st = self._state
        raws = [key_bytes(key) for key in keys]
        self._check_open()
        with st.lock:
            pins, segment_pins = st.pins, st.segment_pins
            for raw, count in Counter(raws).items():
                if len(pins.get(raw, ())) < count:
                    raise PinError(f"unpin of {raw!r}, which is not pinned")
            for raw in raws:
                stack = pins[raw]
                segment_id = stack.pop().segment_id
                if not stack:
                    del pins[raw]
                segment_pins[segment_id] -= 1
                if not segment_pins[segment_id]:
                    del segment_pins[segment_id]

    @contextmanager
    def held_extents(self, keys: Iterable[Key]) -> Iterator[list[HeldExtent | None]]:
        """Where each page's payload is on disk, verified and held for the block
        (None: absent), for readers outside the store (the GDS path): the bytes stay
        the page's even if it is overwritten, deleted or moved meanwhile."""
        self._check_open()
        with self._reads.held_extents(list(keys)) as extents:
            yield extents

    @contextmanager
    def pinned(self, keys: Iterable[Key]) -> Iterator[list[bool]]:
        """Pin a batch for the ``with`` block; yields which keys were pinned."""
        raws = [key_bytes(key) for key in keys]
        results = self.pin_many(raws)
        try:
            yield results
        finally:
            if not self._closed:
                self.unpin_many([raw for raw, ok in zip(raws, results, strict=True) if ok])

    def pin_count(self, key: Key) -> int:
        """How many pins ``key`` holds in this process."""
        raw = key_bytes(key)
        self._check_open()
        with self._state.lock:
            return len(self._state.pins.get(raw, ()))

    def retain(self, key: Key) -> bool:
        """Persistently protect ``key`` from eviction (survives restart); False if absent.

        Logged in the WAL: durable at the next group commit, like a plain put.
        """
        return self._set_retain(key, True)

    def release(self, key: Key) -> bool:
        """Undo ``retain``; False if the key was not retained."""
        return self._set_retain(key, False)

    def _set_retain(self, key: Key, retained: bool) -> bool:
        st = self._state
        raw = key_bytes(key)
        while True:
            with st.cond:
                self._wait_writable_locked()
                done = retain_step_locked(st, raw, retained)
            if done is not None:
                return done
            self._journal.extend_lease()

    def is_retained(self, key: Key) -> bool:
        """Whether ``key`` is retained (``retain``), as of the latest change."""
        raw = key_bytes(key)
        self._check_open()
        return raw in self._state.retains

    # -- GC, compaction, eviction -------------------------------------------

    def gc(self, *, full: bool = False) -> GCReport:
        """One GC pass: free empty segments, compact sparse ones, evict if over the
        low watermark; with ``full=True`` also a mark-and-sweep that recomputes live
        bytes per segment from the page table and fixes any drift it finds."""
        self._check_open()
        if self.readonly:
            raise ReadOnlyError(f"store {self.root} was opened read-only")
        started = time.monotonic()
        report = GCTally()
        self._collector.run_pass(report, full=full)
        return report.freeze(time.monotonic() - started)

    def _gc_loop(self) -> None:
        try:
            while not self._stop.wait(self.config.gc_interval_s):
                try:
                    self._collector.run_pass(GCTally(), background=True)
                except (KVStoreError, OSError):
                    if self._state.failed is not None or self._closed:
                        return
        except BaseException as e:
            self._background_failed("kvstore-gc", e)

    def check(
        self,
        *,
        repair: bool = False,
        deep: bool = False,
        progress: Callable[[int, int], None] | None = None,
    ) -> list[Finding]:
        """Check the store's consistency (``kvstore fsck`` runs this); see kvstore/check.py.

        ``deep`` also verifies every payload checksum; ``repair`` fixes what is
        safe to fix (accounting drift, orphan files, entries whose record is
        gone) on a writable store and marks those findings ``repaired``.
        """
        from kvstore.check import check_store

        return check_store(self, deep=deep, repair=repair, progress=progress)

    def __contains__(self, key: object) -> bool:
        self._check_open()
        return self._state.table.contains(key_bytes(key))

    def __len__(self) -> int:
        self._check_open()
        return len(self._state.table)

    def keys(self) -> Iterator[bytes]:
        """Every key, as a snapshot taken lazily (keys added meanwhile may or may not show)."""
        self._check_open()
        return self._state.table.keys()

    def info(self, key: Key) -> PageInfo | None:
        """Where and what a page is, without reading it; None when absent."""
        self._check_open()
        raw, entry = self._reads.entry(key)
        if entry is None:
            return None
        return PageInfo(
            raw,
            entry.payload_bytes,
            entry.segment_id,
            entry.offset,
            entry.generation,
            entry.lsn,
            entry.payload_checksum,
            decode_meta(entry.meta),
        )

    def stats(self) -> StoreStats:
        st = self._state
        self._check_open()
        snapshot = self.telemetry_snapshot()
        wear = snapshot.wear_report()
        wal = self._journal.wal
        wal_files = len(list_wal_files(self.root))
        with st.lock:
            return store_stats_locked(
                st,
                snapshot,
                wear,
                self._recorder.session_counters(st.stale_reads),
                self._degraded.fields(self._env.check_seconds),
                path=str(self.root),
                io_engine=self._engine.name,
                io_engine_reason=self._engine.why,
                direct_io=self.direct_io,
                readonly=self.readonly,
                segment_bytes=self.config.segment_bytes,
                wal_files=wal_files,
                wal_bytes=wal.size_bytes if wal is not None else 0,
            )

    def telemetry_snapshot(self) -> TelemetrySnapshot:
        """Lifetime counters, hourly history and recent rates (see kvstore/telemetry)."""
        self._check_open()
        with self._state.lock:
            values = list(self._state.tv)
            gauges = self._gauges_locked()
        return self._recorder.snapshot(values, gauges, path=str(self.root))

    def _gauges_locked(self) -> dict[str, float]:
        """Fill levels and what a degraded open found (the exporter's gauges; the
        recorder persists them for ``kvstore metrics PATH``). Caller holds the state lock."""
        degraded = self._degraded.fields(self._env.check_seconds)
        return gauges_locked(self._state, degraded, self.config.segment_bytes)

    def wear(self) -> WearReport:
        """Write amplification, DWPD over 1 h / 24 h / 7 d, projected drive life."""
        return self.telemetry_snapshot().wear_report()

    def metrics_registry(self) -> CollectorRegistry:
        """A prometheus_client registry with this store's metrics, to mount in the engine
        (e.g. ``prometheus_client.make_wsgi_app(store.metrics_registry())``); each
        scrape reads the live counters."""
        from kvstore.telemetry.prometheus import registry_for

        self._check_open()
        return registry_for(self.telemetry_snapshot)

    def segment_states(self) -> dict[int, SegmentState]:
        """A copy of the per-segment accounting (for tools and tests)."""
        self._check_open()
        with self._state.lock:
            return {k: dataclasses.replace(v) for k, v in self._state.segment_states.items()}

    @property
    def internals(self) -> StoreInternals:
        """Typed access to internal state for fsck and the test harnesses (what they
        read through private attributes before). Not a stable API."""
        return lifecycle.internals_of(self)

    def __repr__(self) -> str:
        mode = "readonly" if self.readonly else "writer"
        state = "closed" if self._closed else "open"
        return f"<KVStore {str(self.root)!r} {mode} {state}>"

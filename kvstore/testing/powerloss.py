"""Power-loss and torn-write cases: a recorded workload, replayed cuts, an oracle.

``record_trace`` runs a seeded random workload (puts, batches, deletes, pins,
deletes of pinned pages, retains, releases, GC, checkpoints, flushes, close)
on a fresh store under a ``Recorder``, logging in the same log as the store's
file-system calls when each call began, returned and was acknowledged. The
oracle is that log: for a cut at op ``k``,

- an operation is *acknowledged* when a flush, ``sync=True`` put, checkpoint
  or close that began after it returned before ``k``;
- each key must hold the value of its last acknowledged operation, or the
  value of any later operation that began before ``k`` (whole or absent);
- the same for retains (a delete drops a retain);
- no key the workload never wrote may appear, and ``check()`` is clean.

A recording is the same for the same seed: the store's spare segment is made
between workload steps (``SegmentSet.prepare_once``) instead of on its prepare
thread, whose file calls would otherwise interleave with the workload's in a
different order each run (the kill -9 loops, kvstore.testing.crashloop, keep the
thread).

``run_case`` materialises the cut under a policy (kvstore.testing.faults),
opens the store, checks it against the oracle, then writes to it, closes,
reopens and checks again (recovery must leave a store that keeps working).
"""

from __future__ import annotations

import mmap
import random
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.errors import KVStoreError, StoreFullError
from kvstore.runtime.rolling import SegmentSet
from kvstore.store import KVStore
from kvstore.testing.faults import DiskModel, Recorder, Tear

__all__ = [
    "RECORD_OPTIONS",
    "CaseResult",
    "Trace",
    "Violation",
    "record_trace",
    "run_case",
    "tear_page_cases",
    "tear_wal_cases",
]

RECORD_OPTIONS: dict[str, Any] = {
    "segment_bytes": 1 << 20,
    "max_page_bytes": 256 << 10,
    "io_engine": "threadpool",
    "gc_interval_s": 0,
    "flush_interval_ms": 3_600_000.0,  # only the workload commits: a deterministic log
    "checkpoint_interval_s": 3600.0,
    "lsn_lease_step": 64,  # lease extensions happen inside the trace
    "gc_live_ratio": 0.6,
}
"""Store options for recorded runs (the thread-pool engine: writes pass through Python)."""

_ABSENT = None
_VALUE_SIZES = (1, 100, 4096, 5000, 20_000, 70_000)
_EVICTING_VALUE_SIZES = (5000, 70_000, 150_000, 250_000)


@dataclass(frozen=True, slots=True)
class Violation:
    """One way the recovered store disagreed with the oracle."""

    kind: str  # lost, wrong-bytes, resurrected, unexpected-key, lost-retain, ...
    detail: str


@dataclass(slots=True)
class Trace:
    """A recorded workload: the log, and per key the history of its states."""

    root: Path
    recorder: Recorder
    seed: int
    # key -> [(op_id, value or None for absent)]
    values: dict[bytes, list[tuple[int, bytes | None]]] = field(default_factory=dict)
    # key -> [(op_id, retained)]
    retains: dict[bytes, list[tuple[int, bool]]] = field(default_factory=dict)
    operations: int = 0
    evicting: bool = False  # a capacity was set: an unretained page may be evicted


@dataclass(slots=True)
class CaseResult:
    policy: str
    cut: int
    violations: list[Violation]
    acknowledged_pages: int
    open_seconds: float


class _Workload:
    def __init__(
        self,
        store: KVStore,
        trace: Trace,
        rng: random.Random,
        keys: int,
        prefix: str = "k",
        *,
        aligned: bool = False,
        pipelined: bool = False,
    ) -> None:
        self.aligned = aligned  # values in 4 KiB-aligned memory: written without a copy
        self.pipelined = pipelined  # batches through put_many_async
        self.store = store
        self.trace = trace
        self.rng = rng
        self.keys = [f"{prefix}{index:03d}".encode() for index in range(keys)]
        self.next_op = 0
        self.pins: list[bytes] = []

    @contextmanager
    def op(self, name: str) -> Iterator[int]:
        op_id = self.next_op
        self.next_op += 1
        self.trace.recorder.mark(("begin", op_id, name))
        yield op_id
        self.trace.recorder.mark(("done", op_id, name))

    def ack(self, op_id: int) -> None:
        """Everything that returned before operation ``op_id`` began is durable."""
        self.trace.recorder.mark(("ack", op_id))

    def note_value(self, op_id: int, key: bytes, value: bytes | None) -> None:
        self.trace.values.setdefault(key, []).append((op_id, value))

    def note_retain(self, op_id: int, key: bytes, retained: bool) -> None:
        self.trace.retains.setdefault(key, []).append((op_id, retained))

    def value(self) -> bytes:
        sizes = _EVICTING_VALUE_SIZES if self.trace.evicting else _VALUE_SIZES
        return self.rng.randbytes(self.rng.choice(sizes))

    def payload(self, value: bytes) -> bytes | memoryview:
        """What the store is handed: ``value`` itself, or a copy in aligned memory."""
        if not self.aligned:
            return value
        region = mmap.mmap(-1, len(value) + (-len(value) % 4096))
        region[: len(value)] = value
        return memoryview(region)[: len(value)]

    def put(self, key: bytes, sync: bool) -> None:
        value = self.value()
        with self.op("put") as op_id:
            try:
                self.store.put(
                    key,
                    self.payload(value),
                    sync=sync,
                    meta={"n": op_id} if self.rng.random() < 0.3 else None,
                )
            except StoreFullError:
                if not self.trace.evicting:
                    raise
                return  # nothing stored: everything left is pinned or retained
            self.note_value(op_id, key, value)
        if sync:
            self.ack(op_id + 1)

    def step(self) -> None:
        rng, store = self.rng, self.store
        roll = rng.random()
        key = rng.choice(self.keys)
        if roll < 0.40 or (roll < 0.47 and self.trace.evicting):
            # (no batches with a capacity: a batch that hits StoreFullError may be partial)
            self.put(key, sync=rng.random() < 0.15)
        elif roll < 0.47:
            batch = {k: self.value() for k in rng.sample(self.keys, rng.randint(2, 5))}
            items = [(k, self.payload(v)) for k, v in batch.items()]
            sync = self.pipelined and rng.random() < 0.5
            with self.op("put_many") as op_id:
                if self.pipelined:  # written on a pipeline thread; durable when done if sync
                    store.put_many_async(items, sync=sync).result()
                else:
                    store.put_many(items)
                for k, v in batch.items():
                    self.note_value(op_id, k, v)
            if sync:
                self.ack(op_id + 1)
        elif roll < 0.57:
            with self.op("delete") as op_id:
                was_retained = store.is_retained(key)
                if store.delete(key):
                    self.note_value(op_id, key, _ABSENT)
                    if was_retained:
                        self.note_retain(op_id, key, False)
        elif roll < 0.67:
            with self.op("flush") as op_id:
                store.flush()
            self.ack(op_id)
        elif roll < 0.75:
            with self.op("retain") as op_id:
                before = store.is_retained(key)
                store.retain(key)
                if store.is_retained(key) != before:
                    self.note_retain(op_id, key, True)
        elif roll < 0.80:
            with self.op("release") as op_id:
                if store.release(key):
                    self.note_retain(op_id, key, False)
        elif roll < 0.87:
            if self.pins and rng.random() < 0.5:
                store.unpin(self.pins.pop(rng.randrange(len(self.pins))))
            elif store.pin(key):
                self.pins.append(key)
                if rng.random() < 0.4:  # delete a pinned page: tombstone, bytes stay
                    with self.op("delete-pinned") as op_id:
                        was_retained = store.is_retained(key)
                        if store.delete(key):
                            self.note_value(op_id, key, _ABSENT)
                            if was_retained:
                                self.note_retain(op_id, key, False)
        elif roll < 0.94:
            while self.pins and rng.random() < 0.7:
                store.unpin(self.pins.pop())
            with self.op("gc"):
                store.gc(full=rng.random() < 0.3)
        else:
            with self.op("checkpoint") as op_id:
                store.checkpoint()
            self.ack(op_id)


def record_trace(
    root: Path,
    seed: int,
    *,
    steps: int = 120,
    keys: int = 16,
    create: bool = True,
    key_prefix: str = "k",
    after_open: Callable[[KVStore], None] | None = None,
    capacity_bytes: int | None = None,
    aligned: bool = False,
    pipelined: bool = False,
    **options: Any,
) -> Trace:
    """Record a random workload on the store at ``root`` (see module doc).

    ``aligned``: values are handed to the store in 4 KiB-aligned memory (pages of 16 KiB
    and more are written without a copy); ``pipelined``: batches go through
    ``put_many_async`` (half of them sync, acknowledged when done).

    With ``create`` a fresh store is made first; otherwise the store there is
    opened (and recovered) under the recorder, ``after_open`` sees it before
    the workload starts, and the workload uses keys starting ``key_prefix``.
    With ``capacity_bytes`` the store evicts (larger values, no batches) and the
    oracle lets an unretained page be absent.
    """
    merged = {**RECORD_OPTIONS, **options}
    if capacity_bytes is not None:
        merged["capacity_bytes"] = capacity_bytes
    if create:
        KVStore.open(root, create=True, **merged).close()
    recorder = Recorder(root)
    trace = Trace(root, recorder, seed, evicting=capacity_bytes is not None)
    rng = random.Random(seed)
    with recorder.installed(), _spares_between_steps():
        store = KVStore.open(root, **merged)
        try:
            spares = store.internals.segment_set  # the harness makes the spare, not the thread
            spares.prepare_once()
            if after_open is not None:
                after_open(store)
            workload = _Workload(
                store, trace, rng, keys, key_prefix, aligned=aligned, pipelined=pipelined
            )
            for _ in range(steps):
                workload.step()
                spares.prepare_once()
            for pinned in workload.pins:
                store.unpin(pinned)
            trace.operations = workload.next_op
        except BaseException:
            store.close()
            raise
        close_id = workload.next_op
        recorder.mark(("begin", close_id, "close"))
        store.close()
        recorder.mark(("ack", close_id))
    return trace


@contextmanager
def _spares_between_steps() -> Iterator[None]:
    """Stores opened inside have an idle prepare thread (``record_trace`` makes the
    spare itself, at fixed points of the workload)."""
    real = SegmentSet.prepare_loop

    def idle(self: SegmentSet, stop: threading.Event) -> None:
        stop.wait()

    SegmentSet.prepare_loop = idle  # type: ignore[method-assign]
    try:
        yield
    finally:
        SegmentSet.prepare_loop = real  # type: ignore[method-assign]


def _marks(trace: Trace, cut: int) -> tuple[set[int], int]:
    """(operations begun before the cut, highest op id acknowledged: ops below it)."""
    begun: set[int] = set()
    acked = 0
    for op in trace.recorder.ops[:cut]:
        if op.kind != "mark" or not isinstance(op.note, tuple):
            continue
        if op.note[0] == "begin":
            begun.add(op.note[1])
        elif op.note[0] == "ack":
            acked = max(acked, op.note[1])
    return begun, acked


def _allowed(
    history: list[tuple[int, Any]], begun: set[int], acked: int, initial: Any
) -> tuple[Any, list[Any]]:
    """(the acknowledged state, every state the recovered store may show)."""
    state = initial
    later: list[Any] = []
    for op_id, value in history:
        if op_id < acked:
            state = value
        elif op_id in begun:
            later.append(value)
    return state, [state, *later]


def verify(
    store: KVStore | _Without, trace: Trace, cut: int, other_keys: frozenset[bytes] = frozenset()
) -> tuple[list[Violation], int]:
    """Compare ``store`` with the oracle at ``cut``; (violations, acknowledged pages).

    ``other_keys`` are keys another oracle answers for (not "unexpected").
    """
    begun, acked = _marks(trace, cut)
    violations: list[Violation] = []
    acknowledged_pages = 0
    for key, history in trace.values.items():
        expected, allowed = _allowed(history, begun, acked, _ABSENT)
        if expected is not _ABSENT:
            acknowledged_pages += 1
        try:
            got = store.get(key)
        except KVStoreError as e:
            violations.append(Violation("read-error", f"{key!r}: {e}"))
            continue
        if any(got == candidate for candidate in allowed):
            continue
        if got is None and trace.evicting and not _surely_retained(trace, key, begun, acked):
            continue  # evicted
        if got is None:
            violations.append(Violation("lost", f"{key!r}: acknowledged page missing"))
        elif expected is _ABSENT and all(c is _ABSENT for c in allowed):
            violations.append(Violation("resurrected", f"{key!r}: deleted page came back"))
        else:
            violations.append(
                Violation("wrong-bytes", f"{key!r}: {len(got)} bytes match no allowed value")
            )
    for key in store.keys():  # noqa: SIM118 - KVStore has no __iter__
        if key not in trace.values and key not in other_keys:
            violations.append(Violation("unexpected-key", f"{key!r} was never written"))
    for key, retain_history in trace.retains.items():
        expected, allowed = _allowed(retain_history, begun, acked, False)
        got_retained = store.is_retained(key)
        if got_retained not in allowed:
            kind = "lost-retain" if expected else "resurrected-retain"
            violations.append(Violation(kind, f"{key!r}: retained={got_retained}"))
    for key in trace.values:
        if key not in trace.retains and store.is_retained(key):
            violations.append(Violation("resurrected-retain", f"{key!r} was never retained"))
    return violations, acknowledged_pages


def _surely_retained(trace: Trace, key: bytes, begun: set[int], acked: int) -> bool:
    _, allowed = _allowed(trace.retains.get(key, []), begun, acked, False)
    return all(allowed)


def _fsck(store: KVStore) -> list[Violation]:
    return [
        Violation("fsck", f"{finding.kind}: {finding.message}")
        for finding in store.check(deep=True)
        # A WAL record torn one byte short was completed at open (proven by its
        # checksum): reported as a warning, nothing lost, nothing to repair.
        if not (finding.kind == "degraded" and finding.severity == "warning")
    ]


def check_recovered(
    target: Path, trace: Trace, cut: int, *, reopen: bool = True, **options: Any
) -> tuple[list[Violation], int, float]:
    """Open the store at ``target``, verify it and (``reopen``) that it keeps working."""
    merged = {**RECORD_OPTIONS, **options}
    started = time.perf_counter()
    try:
        store = KVStore.open(target, **merged)
    except KVStoreError as e:
        return [Violation("open-failed", f"{type(e).__name__}: {e}")], 0, 0.0
    open_seconds = time.perf_counter() - started
    try:
        violations, acknowledged = verify(store, trace, cut)
        violations += _fsck(store)
        if reopen and not violations:
            probe = b"probe-after-recovery"
            store.put(probe, b"p" * 9000, sync=True)
            store.close()
            store = KVStore.open(target, **merged)
            if store.get(probe) != b"p" * 9000:
                violations.append(Violation("lost", "a put after recovery was lost on reopen"))
            again, _ = verify(_Without(store, probe), trace, cut)
            violations += again
            violations += _fsck(store)
    finally:
        store.close()
    return violations, acknowledged, open_seconds


class _Without:
    """A view of a store that hides one key (the probe) from ``keys()``."""

    def __init__(self, store: KVStore, hidden: bytes) -> None:
        self._store = store
        self._hidden = hidden

    def get(self, key: bytes) -> bytes | None:
        return self._store.get(key)

    def keys(self) -> Iterator[bytes]:
        return (key for key in self._store.keys() if key != self._hidden)  # noqa: SIM118

    def is_retained(self, key: bytes) -> bool:
        return self._store.is_retained(key)


def run_case(
    trace: Trace,
    cut: int,
    policy: str,
    work_dir: Path,
    rng: random.Random,
    *,
    drop: set[int] | None = None,
    reopen: bool = True,
) -> CaseResult:
    """Cut ``trace`` at ``cut`` under ``policy``, recover, and check against the oracle."""
    target = work_dir / f"case-{policy}-{cut}"
    if target.exists():
        shutil.rmtree(target)
    DiskModel(trace.recorder, cut).materialize(target, policy, rng, drop=drop)
    try:
        violations, acknowledged, seconds = check_recovered(target, trace, cut, reopen=reopen)
    finally:
        shutil.rmtree(target, ignore_errors=True)
    return CaseResult(policy, cut, violations, acknowledged, seconds)


def synced_put_writes(trace: Trace) -> list[tuple[int, int]]:
    """(cut, op index) pairs: a WAL write covered by a sync, and a cut after its ack.

    Used to prove the oracle notices a lost synced write: dropping the op at
    such a cut must produce a violation.
    """
    ops = trace.recorder.ops
    wal_inodes = {op.inode for op in ops if op.kind == "create" and op.path.startswith("wal")}
    found: list[tuple[int, int]] = []
    last_write: int | None = None
    for index, op in enumerate(ops):
        # Records, not a file header: a lost header loses nothing (the records after
        # it carry their own checksums and are replayed; docs/operations.md). A new
        # file's header means a checkpoint rotated the WAL: what was written before
        # is in LMDB by the ack, so dropping it must not be noticed.
        if op.kind == "write" and op.inode in wal_inodes:
            last_write = index if len(op.data) > 64 else None
        elif (
            op.kind == "mark"
            and isinstance(op.note, tuple)
            and op.note[0] == "ack"
            and last_write is not None
        ):
            found.append((index + 1, last_write))
            last_write = None
    return found


# -- torn writes ---------------------------------------------------------------


@dataclass(slots=True)
class TearSetup:
    """A recorded run ending in one unacknowledged write to tear."""

    trace: Trace
    cut: int
    op_index: int  # the write to tear
    write_bytes: int
    torn_key: bytes
    torn_value: bytes
    base: dict[bytes, bytes]


def _record_tear(root: Path, seed: int, kind: str, page_bytes: int) -> TearSetup:
    options = {**RECORD_OPTIONS, "segment_bytes": 4 << 20, "max_page_bytes": 1 << 20}
    rng = random.Random(seed)
    KVStore.open(root, create=True, **options).close()
    recorder = Recorder(root)
    trace = Trace(root, recorder, seed)
    base = {
        f"base{index}".encode(): rng.randbytes(rng.choice((5000, 70_000))) for index in range(6)
    }
    torn_key, torn_value = b"torn", rng.randbytes(page_bytes)
    with recorder.installed():
        store = KVStore.open(root, **options)
        try:
            for op_id, (key, value) in enumerate(base.items()):
                store.put(key, value)
                trace.values[key] = [(op_id, value)]
            store.delete(b"base0")  # a delete acknowledged before the tear
            trace.values[b"base0"].append((len(base), None))
            store.flush()
            recorder.mark(("ack", len(base) + 1))
            op_id = len(base) + 1
            recorder.mark(("begin", op_id, "torn put"))
            first = len(recorder.ops)
            store.put(torn_key, torn_value, sync=kind == "wal")
            trace.values[torn_key] = [(op_id, torn_value)]
            ops = recorder.ops
            if kind == "page":
                # the record's one pwritev to the segment, not yet synced
                writes = [
                    i
                    for i in range(first, len(ops))
                    if ops[i].kind == "write" and len(ops[i].data) >= page_bytes
                ]
                cut = len(ops)
            else:
                # the WAL append of the PUT record, cut before its fdatasync
                wal_inodes = {
                    op.inode for op in ops if op.kind == "create" and op.path.startswith("wal")
                } | {inode for path, inode in recorder.base.items() if path.startswith("wal")}
                writes = [
                    i
                    for i in range(first, len(ops))
                    if ops[i].kind == "write" and ops[i].inode in wal_inodes
                ]
                cut = writes[-1] + 1 if writes else len(ops)
            if len(writes) != 1:
                raise RuntimeError(f"expected one write to tear, found {len(writes)}")
        finally:
            store.close()
    del base[b"base0"]
    return TearSetup(trace, cut, writes[0], len(ops[writes[0]].data), torn_key, torn_value, base)


def _tear_cases(
    setup: TearSetup,
    points: list[int],
    work_dir: Path,
    tails: tuple[str, ...],
    on_case: Callable[[int, str, list[Violation]], None] | None,
) -> list[tuple[int, str, list[Violation]]]:
    rng = random.Random(setup.trace.seed)
    results = []
    model = DiskModel(setup.trace.recorder, setup.cut)
    for point in points:
        for tail in tails:
            target = work_dir / f"tear-{point}-{tail}"
            model.materialize(target, "drop", rng, tear=Tear(setup.op_index, point, tail))
            try:
                # A WAL record torn one byte short is one damaged byte: undone at open
                # (proven by its checksum), so it is whole.
                violations = _check_tear(target, setup, whole=point >= setup.write_bytes - 1)
            finally:
                shutil.rmtree(target, ignore_errors=True)
            results.append((point, tail, violations))
            if on_case is not None:
                on_case(point, tail, violations)
    return results


def _check_tear(target: Path, setup: TearSetup, *, whole: bool) -> list[Violation]:
    options = {**RECORD_OPTIONS, "segment_bytes": 4 << 20, "max_page_bytes": 1 << 20}
    try:
        store = KVStore.open(target, **options)
    except KVStoreError as e:
        return [Violation("open-failed", f"{type(e).__name__}: {e}")]
    violations: list[Violation] = []
    try:
        for key, value in setup.base.items():
            got = store.get(key)
            if got is None:
                violations.append(Violation("lost", f"{key!r}"))
            elif got != value:
                violations.append(Violation("wrong-bytes", f"{key!r}"))
        if store.get(b"base0") is not None:
            violations.append(Violation("resurrected", "base0"))
        torn = store.get(setup.torn_key)
        # A page record is never named by the WAL without its sync, so it is
        # always absent; a WAL record written whole (only the sync was lost) may stay.
        if torn is not None and not (whole and torn == setup.torn_value):
            violations.append(Violation("torn-present", f"{len(torn)} bytes"))
        violations += _fsck(store)
        store.put(b"after", b"a" * 70_000, sync=True)
        store.close()
        store = KVStore.open(target, **options)
        if store.get(b"after") != b"a" * 70_000:
            violations.append(Violation("lost", "put after recovery"))
        for key, value in setup.base.items():
            if store.get(key) != value:
                violations.append(Violation("lost", f"{key!r} after second reopen"))
        violations += _fsck(store)
    finally:
        store.close()
    return violations


def tear_page_cases(
    work_dir: Path,
    *,
    seed: int = 1,
    page_bytes: int = 1 << 20,
    stride: int = 4096,
    tails: tuple[str, ...] = ("zero", "garbage"),
    on_case: Callable[[int, str, list[Violation]], None] | None = None,
) -> list[tuple[int, str, list[Violation]]]:
    """Tear an unacknowledged ``page_bytes`` page record at every ``stride`` boundary."""
    setup = _record_tear(work_dir / "record-page", seed, "page", page_bytes)
    points = list(range(0, setup.write_bytes + 1, stride))
    if points[-1] != setup.write_bytes:
        points.append(setup.write_bytes)
    return _tear_cases(setup, points, work_dir, tails, on_case)


def tear_wal_cases(
    work_dir: Path,
    *,
    seed: int = 1,
    stride: int = 1,
    tails: tuple[str, ...] = ("zero", "garbage"),
    on_case: Callable[[int, str, list[Violation]], None] | None = None,
) -> list[tuple[int, str, list[Violation]]]:
    """Tear the WAL append of one PUT record at every ``stride``-th byte."""
    setup = _record_tear(work_dir / "record-wal", seed, "wal", 5000)
    points = list(range(0, setup.write_bytes + 1, stride))
    if points[-1] != setup.write_bytes:
        points.append(setup.write_bytes)
    return _tear_cases(setup, points, work_dir, tails, on_case)


# -- a crash during recovery ------------------------------------------------------


@dataclass(slots=True)
class _Observed:
    values: dict[bytes, bytes | None] = field(default_factory=dict)
    retained: dict[bytes, bool] = field(default_factory=dict)


def run_double_case(
    trace: Trace,
    cut: int,
    policy: str,
    second_policy: str,
    work_dir: Path,
    rng: random.Random,
    *,
    steps: int = 30,
) -> list[Violation]:
    """Crash, recover under the recorder (with more work), crash again, recover.

    The first recovery must pass the oracle; the second must show every key of
    the first workload exactly as the first recovery showed it (what recovery
    made visible never flips), and the second workload's keys must pass its
    own oracle.
    """
    first = work_dir / f"double-{policy}-{cut}"
    for leftover in (first, first.with_name(first.name + "-b")):
        if leftover.exists():
            shutil.rmtree(leftover)
    DiskModel(trace.recorder, cut).materialize(first, policy, rng)
    observed = _Observed()
    first_keys = frozenset(trace.values)

    def observe(store: KVStore) -> None:
        for key in first_keys:
            observed.values[key] = store.get(key)
            observed.retained[key] = store.is_retained(key)

    try:
        second = record_trace(
            first,
            rng.randrange(1 << 30),
            steps=steps,
            create=False,
            key_prefix="r",
            after_open=observe,
        )
    except KVStoreError as e:
        shutil.rmtree(first, ignore_errors=True)
        return [Violation("open-failed", f"first recovery: {type(e).__name__}: {e}")]
    violations = _check_observed(observed, trace, cut)
    cut2 = rng.randint(0, len(second.recorder.ops))
    target = first.with_name(first.name + "-b")
    DiskModel(second.recorder, cut2).materialize(target, second_policy, rng)
    shutil.rmtree(first, ignore_errors=True)
    try:
        store = KVStore.open(target, **RECORD_OPTIONS)
    except KVStoreError as e:
        shutil.rmtree(target, ignore_errors=True)
        return [*violations, Violation("open-failed", f"second: {type(e).__name__}: {e}")]
    try:
        for key in first_keys:
            got = store.get(key)
            if got != observed.values[key]:
                kind = "lost" if got is None else "flipped"
                violations.append(Violation(kind, f"{key!r} changed across the second crash"))
            if store.is_retained(key) != observed.retained[key]:
                violations.append(Violation("lost-retain", f"{key!r} retain flipped"))
        more, _ = verify(store, second, cut2, other_keys=first_keys)
        violations += more
        violations += _fsck(store)
    finally:
        store.close()
        shutil.rmtree(target, ignore_errors=True)
    return violations


def _check_observed(observed: _Observed, trace: Trace, cut: int) -> list[Violation]:
    """The first recovery, as seen through ``observed``, against the first oracle."""

    class _Seen:
        def get(self, key: bytes) -> bytes | None:
            return observed.values.get(key)

        def keys(self) -> Iterator[bytes]:
            return (key for key, value in observed.values.items() if value is not None)

        def is_retained(self, key: bytes) -> bool:
            return observed.retained.get(key, False)

    violations, _ = verify(_Seen(), trace, cut)  # type: ignore[arg-type]
    return violations

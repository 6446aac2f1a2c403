#!/usr/bin/env python3
"""kill -9 crash loop for kvstore, checked against an oracle kept outside the store.

Each cycle starts a child process (this file in ``--child`` mode) that opens the
store and runs a random mix of writes: ``put(sync=True)``, ``put_many(sync=True)``
batches, plain puts and deletes followed by ``flush()``, put/delete churn on a few
keys, occasional ``checkpoint()`` and ``gc()``. Before each operation the child reports
``begin ...`` on its stdout pipe, and once the operation is acknowledged (the sync
put or the flush returned) it reports ``ack ...``, before it starts the next one.
The parent SIGKILLs the child at a random moment, opens the store itself and
checks every key against the oracle (docs/reliability.md, "Kill -9 loop"):

- an acknowledged page is present with exactly the expected bytes (and meta),
  unless a later operation on that key had begun: then the page may also be in
  the state that operation leaves (any of them, when several had begun);
- an acknowledged delete stays deleted unless a later put of the key had begun;
- a get never returns bytes that match none of the allowed states.

Then it closes the store (a checkpoint), takes what it saw as the new baseline,
and the next cycle runs on the same store, so recovery after recovery is
exercised. Page bytes are derived from (key, version), so the parent never
stores them. The child also runs ``gc()`` now and then, and some cycles run the
background GC thread at a short interval, so kills land in page relocation and
segment frees too. Some cycles use a tiny ``lsn_lease_step`` so LSN lease
extensions (and their recovery) happen all the time. A child that stops making
progress for ``--stall-s`` seconds is a violation (its stacks are dumped first).

Space mode (``--capacity-mib N`` and/or ``--retain``). With a capacity the store
evicts, so an acknowledged page that is not retained may also be absent (never
other bytes, and an acknowledged delete still never comes back). With
``--retain`` the child also retains and releases keys (``ack`` after a flush),
pins pages, deletes pinned pages while pinned, and reads pinned and retained
pages back, reporting any broken promise as a ``bad ...`` line. The oracle then
also requires: a key whose retain was acknowledged and not released (nor the
key deleted) is present with its latest acknowledged bytes and
``is_retained()``; a retain that found its key absent makes that absence
durable (the eviction was flushed with it); ``is_retained()`` matches what was
acknowledged. Each cycle with a capacity picks an eviction policy.

Concurrent writers (``--threads N``; docs/reliability.md, "Concurrent writers:
the kill -9 soak"). The child runs N writer threads
on disjoint shares of the keys (key i belongs to thread i mod N), so per key the
operations stay sequential and the oracle above holds per key. Thread 0 runs the
mix above (with ``--retain``, the space operations too) on its share; threads
1..N-1 run ``put_many`` of 2-7 keys (sync or not; fresh keys, never written
before, ``--fresh-prob`` of the time), ``put(sync=True)``, plain puts, deletes,
``flush()`` and reads of their own keys. A sync put is acknowledged when it
returned; any other put or delete once a ``flush()`` that started after it
returned has returned, on whichever thread (the flush contract), so acks lag
behind and several operations of a key may be in flight: an ack settles the
operation it names and those begun before it on the key, and leaves the later
ones in flight (deletes carry a token for that). Fresh keys are checked once
after the kill, then deleted. ``--flush-interval-ms 1`` makes the store's
flusher commit all the time; ``--switch-interval-us``, ``--busy-threads`` and
``--busy-procs`` add GIL and CPU pressure; ``--max-page-kib`` caps page sizes for
more operations per second. ``--pipelined`` makes threads 1..N-1 write their
batches with ``put_many_async`` (up to three in flight, keys may repeat between
them; a sync batch is acknowledged when its future is done, docs/design.md,
"Pipelined batches"); ``--aligned`` hands every page to the store in 4 KiB-aligned
memory, so pages of 16 KiB and more are written straight from it (zero copy).
``--engine`` picks the I/O engine of every store the
loop opens; without it the store's default applies, which ``KVSTORE_IO_ENGINE``
overrides (the children inherit the environment). Which engine each child ran
is counted from its ``ready`` line (``engines`` in the summary).

    .venv/bin/python tools/crashloop.py --dir /tmp/crash --cycles 200 --seed 1
    .venv/bin/python tools/crashloop.py --dir /tmp/crash-space --cycles 300 --seed 1 \
        --segment-mib 2 --capacity-mib 16 --retain
    .venv/bin/python tools/crashloop.py --dir /tmp/crash-threads --cycles 2000 --seed 1 \
        --threads 4 --flush-interval-ms 1 --max-page-kib 64 --engine io_uring \
        --segment-mib 2 --capacity-mib 16 --retain --busy-threads 1 --json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import faulthandler
import functools
import hashlib
import itertools
import json
import mmap
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import xxhash

import kvstore
from kvstore import KVStore, KVStoreError, StoreNotFoundError

KIB = 1 << 10
MIB = 1 << 20
MAX_PAGE_BYTES = 1 * MIB
COMMON_PAGE_BYTES = 256 * KIB
MIN_PAGE_BYTES = 4 * KIB
MAX_DETAILS = 50

# A key's state in the oracle: ("put", version) or ("del", 0).
State = tuple[str, int]
ABSENT: State = ("del", 0)


# -- deterministic pages ------------------------------------------------------


def key_name(index: int) -> str:
    return f"k{index:05d}"


_PAGE_LIMIT = [MAX_PAGE_BYTES]  # set_page_limit (--max-page-kib), in parent and child alike


def set_page_limit(limit: int | None) -> None:
    """Cap every page size at ``limit`` bytes (None: the default 1 MiB)."""
    _PAGE_LIMIT[0] = MAX_PAGE_BYTES if limit is None else max(MIN_PAGE_BYTES, limit)


def page_size(key: str, version: int) -> int:
    """Mostly 256 KiB; otherwise log-uniform in 4 KiB..1 MiB at any byte count
    (both capped by ``set_page_limit``)."""
    h = xxhash.xxh64_intdigest(f"size/{key}/{version}".encode())
    limit = min(_PAGE_LIMIT[0], MAX_PAGE_BYTES)
    if h % 100 < 60:
        return min(COMMON_PAGE_BYTES, limit)
    frac = (h >> 8) / float(1 << 56)
    size = int(MIN_PAGE_BYTES * (limit / MIN_PAGE_BYTES) ** frac)
    return max(MIN_PAGE_BYTES, min(limit, size))


def page_bytes(key: str, version: int) -> bytes:
    # SHAKE-128 from the standard library: pseudo-random bytes without numpy, whose
    # import was a good part of each child's start-up.
    return hashlib.shake_128(f"page/{key}/{version}".encode()).digest(page_size(key, version))


def aligned_copy(data: bytes) -> memoryview:
    """``data`` in writable, 4 KiB-aligned memory of its own (an anonymous mmap): what
    the store writes in place, without a copy (``--aligned``)."""
    region = mmap.mmap(-1, max(len(data), 1) + (-len(data) % 4096))
    region[: len(data)] = data
    return memoryview(region)[: len(data)]


def page_meta(key: str, version: int) -> dict[str, Any] | None:
    """About a third of the pages carry meta naming their version."""
    if xxhash.xxh32_intdigest(f"meta/{key}/{version}".encode()) % 3:
        return None
    return {"key": key, "version": version}


# -- child ----------------------------------------------------------------------


class _Reporter:
    """Writes protocol lines straight to the pipe (one write(2) each: atomic, unbuffered)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __call__(self, line: str) -> None:
        data = (line + "\n").encode()
        while data:
            written = os.write(self.fd, data)
            data = data[written:]


def open_store(path: Path, segment_bytes: int, **options: Any) -> KVStore:
    return KVStore.open(
        path,
        create=True,
        segment_bytes=segment_bytes,
        max_page_bytes=MAX_PAGE_BYTES,
        **options,
    )


class _Durability:
    """Which puts and deletes a flush has made durable, across the child's threads.

    Each ``flush()`` takes a sequence number when it starts; a put or delete takes
    one when it returns. When a flush returns, everything that returned before it
    started is durable (the contract of ``flush``), whichever thread flushed:
    ``covered`` is the highest start number of a flush that has returned.
    """

    def __init__(self, store: KVStore) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._seq = 0
        self.covered = 0

    def tick(self) -> int:
        with self._lock:
            self._seq += 1
            return self._seq

    def flush(self) -> None:
        start = self.tick()
        self.store.flush()
        with self._lock:
            self.covered = max(self.covered, start)


@dataclasses.dataclass(slots=True)
class _Unacked:
    key: str
    kind: str  # "put" or "del"
    token: int  # the put's version, or the delete's token
    returned: int  # _Durability sequence number taken after the call returned
    durable: bool  # a sync put: durable when it returned


class _Worker:
    """One writer thread of ``--threads`` (threads 1..N-1; thread 0 runs the plain mix).

    It owns its share of the fixed keys (no other thread writes them, so per key
    the operations are sequential and LSNs follow the order they were begun in)
    and makes up fresh keys (``f<cycle>.<thread>.<n>``, each written once). Its
    mix: ``put_many`` of 2-7 keys (sync or not; fresh keys with ``fresh_prob``),
    ``put(sync=True)``, plain puts, deletes, ``flush()``, and reads of its own
    keys checked against what returned (``bad read ...`` on a mismatch).

    It writes ``begin`` before each call. It writes ``ack`` only for durable
    operations: a sync put once it returned; any other put or delete once a
    ``flush()`` that started after it returned has returned, on any thread
    (``_Durability``). Acks of one key come in the order its operations were begun;
    an operation whose ack would come after a later one's on the same key is
    superseded and never acknowledged. Deletes carry a token (``begin del K T``)
    so the oracle settles exactly the delete acknowledged and keeps the
    operations begun after it in flight.
    """

    def __init__(
        self,
        index: int,
        store: KVStore,
        keys: list[str],
        rng: random.Random,
        report: Callable[[str], None],
        durability: _Durability,
        next_version: Callable[[], int],
        args: argparse.Namespace,
    ) -> None:
        self.index = index
        self.store = store
        self.keys = keys
        self.rng = rng
        self.report = report
        self.durability = durability
        self.next_version = next_version
        self.cycle = int(args.cycle)
        self.fresh_prob = float(args.fresh_prob)
        self.bounded = bool(args.capacity_mib)
        self.pipelined = bool(getattr(args, "pipelined", False))
        self.aligned = bool(getattr(args, "aligned", False))
        # --pipelined: put_many_async batches not yet done, oldest first.
        self.in_flight: collections.deque[tuple[Future[list[bool]], list[tuple[str, int]], bool]]
        self.in_flight = collections.deque()
        self.unacked: list[_Unacked] = []
        self.current: dict[str, int | None] = {}  # what returned last: version, None = deleted
        self.fresh_count = 0

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            while self.in_flight and self.in_flight[0][0].done():
                self._finish_oldest()
            self.settle()
            r = self.rng.random()
            if self.pipelined and r < 0.45:
                self.put_batch(sync=r < 0.3)  # more batches, most of them sync
                continue
            # Every other operation is ordered after this thread's batches in flight.
            self.drain()
            if r < 0.30:
                self.put_batch(sync=False)
            elif r < 0.45:
                self.put_batch(sync=True)
            elif r < 0.60:
                self.put_one(sync=True)
            elif r < 0.65:
                self.put_one(sync=False)
            elif r < 0.75:
                self.delete_some()
            elif r < 0.90:
                self.durability.flush()
            else:
                self.read_back()

    def _returned(self, key: str, kind: str, token: int, durable: bool) -> None:
        self.unacked.append(_Unacked(key, kind, token, self.durability.tick(), durable))

    def settle(self) -> None:
        """Acknowledge what is durable now, in the order it was begun."""
        covered = self.durability.covered
        waiting: list[_Unacked] = []
        for op in self.unacked:
            if op.durable or op.returned < covered:
                waiting = [older for older in waiting if older.key != op.key]  # superseded
                self.report(f"ack {op.kind} {op.key} {op.token}")
            else:
                waiting.append(op)
        self.unacked = waiting

    def _fresh_keys(self, count: int) -> list[str]:
        start = self.fresh_count
        self.fresh_count += count
        return [f"f{self.cycle}.{self.index}.{n}" for n in range(start, start + count)]

    def put_batch(self, *, sync: bool) -> None:
        count = self.rng.randint(2, 7)
        if self.rng.random() < self.fresh_prob:
            keys = self._fresh_keys(count)
        else:
            keys = self.rng.sample(self.keys, min(count, len(self.keys)))
        batch = [(key, self.next_version()) for key in keys]
        for key, version in batch:
            self.report(f"begin put {key} {version}")
        items = [
            (key, self.payload(key, version), page_meta(key, version)) for key, version in batch
        ]
        if self.pipelined:
            self.in_flight.append((self.store.put_many_async(items, sync=sync), batch, sync))
            while len(self.in_flight) > 3:
                self._finish_oldest()
            return
        self.store.put_many(items, sync=sync)
        for key, version in batch:
            self.current[key] = version
            self._returned(key, "put", version, sync)
        if sync:
            self.settle()

    def payload(self, key: str, version: int) -> bytes | memoryview:
        data = page_bytes(key, version)
        return aligned_copy(data) if self.aligned else data

    def _finish_oldest(self) -> None:
        """Wait for the oldest batch in flight; its pages returned now (acknowledged
        at once for a sync batch: the future is done only once they are durable)."""
        future, batch, sync = self.in_flight.popleft()
        future.result()
        for key, version in batch:
            self.current[key] = version
            self._returned(key, "put", version, sync)
        if sync:
            self.settle()

    def drain(self) -> None:
        while self.in_flight:
            self._finish_oldest()

    def put_one(self, *, sync: bool) -> None:
        key, version = self.rng.choice(self.keys), self.next_version()
        self.report(f"begin put {key} {version}")
        self.store.put(key, self.payload(key, version), meta=page_meta(key, version), sync=sync)
        self.current[key] = version
        self._returned(key, "put", version, sync)
        if sync:
            self.settle()

    def delete_some(self) -> None:
        chosen = self.rng.sample(self.keys, min(len(self.keys), self.rng.randint(1, 3)))
        for key in chosen:
            token = self.next_version()
            self.report(f"begin del {key} {token}")
            self.store.delete(key)
            self.current[key] = None
            self._returned(key, "del", token, False)

    def read_back(self) -> None:
        """A key this thread wrote reads back as what it wrote last (or, under a
        capacity, as a miss); a deleted one stays deleted."""
        if not self.current:
            return
        key = self.rng.choice(sorted(self.current))
        version = self.current[key]
        got = self.store.get(key)
        if version is None:
            if got is not None:
                self.report(f"bad read {key}: deleted, but get returned {len(got)} bytes")
        elif got is None:
            if not self.bounded:
                self.report(f"bad read {key} v{version}: missing")
        elif got != page_bytes(key, version):
            self.report(f"bad read {key} v{version}: wrong bytes ({len(got)})")


def _spin(stop: threading.Event) -> None:
    """CPU load inside the child: pure Python, so it competes for the GIL too."""
    while not stop.is_set():
        sum(i * i for i in range(2000))


def _thread_main(body: Callable[[], None]) -> Callable[[], None]:
    """A worker that fails ends the child at once (the parent counts a child failure)."""

    def run() -> None:
        try:
            body()
        except BaseException:
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
            os._exit(70)

    return run


def child_main(args: argparse.Namespace) -> int:
    rng = random.Random(args.child_seed)
    report = _Reporter(sys.stdout.fileno())
    set_page_limit(args.max_page_kib * KIB if args.max_page_kib else None)
    if args.switch_interval_us:
        sys.setswitchinterval(args.switch_interval_us / 1e6)
    options: dict[str, Any] = {}
    if args.flush_interval_ms is not None:
        options["flush_interval_ms"] = args.flush_interval_ms
    if args.engine is not None:
        options["io_engine"] = args.engine
    if args.checkpoint_interval_s is not None:
        options["checkpoint_interval_s"] = args.checkpoint_interval_s
    if args.checkpoint_wal_bytes is not None:
        options["checkpoint_wal_bytes"] = args.checkpoint_wal_bytes
    if args.gc_interval_s is not None:
        options["gc_interval_s"] = args.gc_interval_s
    if args.lsn_lease_step is not None:
        options["lsn_lease_step"] = args.lsn_lease_step
    if args.capacity_mib:
        options["capacity_bytes"] = args.capacity_mib * MIB
    if args.eviction_policy is not None:
        options["eviction_policy"] = args.eviction_policy
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    started = time.perf_counter()
    store = open_store(Path(args.dir), args.segment_mib * MIB, **options)
    report(f"ready {time.perf_counter() - started:.6f} {store.stats().io_engine}")
    threads = max(1, int(args.threads))
    all_keys = [key_name(i) for i in range(args.keys)]
    keys = all_keys[0::threads]  # thread 0's share; all of them without --threads
    space = _ChildSpace(store, keys, rng, report, args) if args.retain else None
    versions = itertools.count(1)  # next() on a count is atomic: shared by the threads
    durability = _Durability(store)

    def next_version() -> int:
        return int(args.cycle) * 1_000_000 + next(versions)

    stop = threading.Event()
    helpers = []
    for index in range(1, threads):
        worker = _Worker(
            index,
            store,
            all_keys[index::threads],
            random.Random(args.child_seed * 1_000 + index),
            report,
            durability,
            next_version,
            args,
        )
        body = _thread_main(functools.partial(worker.run, stop))
        helpers.append(threading.Thread(target=body, name=f"writer-{index}", daemon=True))
    for _ in range(args.busy_threads):
        helpers.append(threading.Thread(target=_spin, args=(stop,), daemon=True))
    for helper in helpers:
        helper.start()

    def put_item(key: str, version: int) -> tuple[str, bytes | memoryview, dict[str, Any] | None]:
        data = page_bytes(key, version)
        return key, aligned_copy(data) if args.aligned else data, page_meta(key, version)

    def ack_put(key: str, version: int) -> None:
        report(f"ack put {key} {version}")
        if space is not None:
            space.known[key] = version

    def ack_del(key: str) -> None:
        report(f"ack del {key}")
        if space is not None:
            space.known[key] = None

    def begin_del(key: str) -> None:
        report(f"begin del {key}")
        if space is not None:  # the delete drops the retain (a churn may ack only a later put)
            space.retained.discard(key)

    ops = 0
    while args.max_ops <= 0 or ops < args.max_ops:
        ops += 1
        # Keys pinned by this child are not written (see _ChildSpace); with no
        # pins this is ``keys`` itself, so the random stream of the plain mode
        # is unchanged.
        free = space.writable() if space is not None else keys
        r = rng.random()
        if r < args.checkpoint_prob:
            report("begin ckpt")
            store.checkpoint()
            report("ack ckpt")
            continue
        if r < args.checkpoint_prob + args.gc_prob:
            report("begin gc")
            store.gc(full=rng.random() < 0.3)
            report("ack gc")
            continue
        if space is not None and r < args.checkpoint_prob + args.gc_prob + args.space_prob:
            space.step()
            continue
        r = rng.random()
        if r < 0.33:  # one sync put
            key, version = rng.choice(free), next_version()
            item = put_item(key, version)
            report(f"begin put {key} {version}")
            store.put(key, item[1], meta=item[2], sync=True)
            ack_put(key, version)
        elif r < 0.53:  # a sync batch of distinct keys
            batch = [(k, next_version()) for k in rng.sample(free, rng.randint(2, 8))]
            items = [put_item(k, v) for k, v in batch]
            for k, v in batch:
                report(f"begin put {k} {v}")
            store.put_many(items, sync=True)
            for k, v in batch:
                ack_put(k, v)
        elif r < 0.71:  # plain puts, then flush
            batch = [(k, next_version()) for k in rng.sample(free, rng.randint(1, 4))]
            for k, v in batch:
                item = put_item(k, v)
                report(f"begin put {k} {v}")
                store.put(k, item[1], meta=item[2])
            durability.flush()
            for k, v in batch:
                ack_put(k, v)
        elif r < 0.86:  # deletes, then flush
            chosen = rng.sample(free, rng.randint(1, 3))
            for k in chosen:
                begin_del(k)
                store.delete(k)
            durability.flush()
            for k in chosen:
                ack_del(k)
        else:  # churn: puts and deletes of a few keys, repeats included, then flush
            few = rng.sample(free, 2)
            final: dict[str, tuple[str, int | None]] = {}
            for _ in range(rng.randint(2, 5)):
                k = rng.choice(few)
                if rng.random() < 0.65:
                    v = next_version()
                    item = put_item(k, v)
                    report(f"begin put {k} {v}")
                    store.put(k, item[1], meta=item[2])
                    final[k] = ("put", v)
                else:
                    begin_del(k)
                    store.delete(k)
                    final[k] = ("del", None)
            durability.flush()
            for k, (kind, last) in final.items():
                if kind == "put":
                    assert last is not None
                    ack_put(k, last)
                else:
                    ack_del(k)
    stop.set()
    for helper in helpers:
        helper.join()
    if space is not None:
        space.unpin_all()
    store.close()
    report("done")
    return 0


class _ChildSpace:
    """The ``--retain`` mode's operations in the child: retains and releases
    (acknowledged after a flush), pins, deletes of pinned pages, and reads of
    pinned and retained pages checked against what this child acknowledged.

    Protocol lines: ``begin retain K`` / ``ack retain K 1|0`` (0: ``retain``
    returned False, the key was absent), ``begin release K`` / ``ack release K``,
    deletes as ``begin del K`` / ``ack del K``, and ``bad ...`` for a read that
    broke a promise (the parent counts it as a violation).

    At most ``MAX_PINS`` keys stay pinned across operations and those keys are
    not written meanwhile; the retained set is kept small enough to fit the
    capacity with room to spare, so a ``StoreFullError`` here is a failure.
    """

    MAX_PINS = 2

    def __init__(
        self,
        store: KVStore,
        keys: list[str],
        rng: random.Random,
        report: Callable[[str], None],
        args: argparse.Namespace,
    ) -> None:
        self.store = store
        self.keys = keys
        self.rng = rng
        self.report = report
        self.bounded = bool(args.capacity_mib)
        # A quarter of the capacity, counted in largest pages; 16 keys without one.
        self.max_retained = (
            max(2, args.capacity_mib * MIB // (4 * MAX_PAGE_BYTES)) if self.bounded else 16
        )
        self.retained = {key for key in keys if store.is_retained(key)}
        self.known: dict[str, int | None] = {}  # acknowledged this run: version, None = deleted
        self.pins: list[str] = []

    def writable(self) -> list[str]:
        if not self.pins:
            return self.keys
        pinned = set(self.pins)
        return [key for key in self.keys if key not in pinned]

    def step(self) -> None:
        r = self.rng.random()
        if r < 0.4:
            self.retain_some()
        elif r < 0.55:
            self.release_some()
        elif r < 0.8:
            self.delete_pinned()
        else:
            self.read_pinned()

    def check(self, key: str, where: str, *, present: bool) -> None:
        """A key this child wrote (and did not delete) reads back exactly; when
        ``present`` (pinned or retained), a miss is a failure too."""
        version = self.known.get(key)
        if version is None:
            return
        got = self.store.get(key)
        if got is None:
            if present or not self.bounded:
                self.report(f"bad {where} {key} v{version}: missing")
        elif got != page_bytes(key, version):
            self.report(f"bad {where} {key} v{version}: wrong bytes ({len(got)})")

    def retain_some(self) -> None:
        if len(self.retained) >= self.max_retained:
            self.release_some()
            return
        # Mostly keys written in this run (likely still present), else any key.
        written = sorted(key for key, version in self.known.items() if version is not None)
        pool = written if written and self.rng.random() < 0.8 else self.keys
        chosen = self.rng.sample(pool, min(len(pool), self.rng.randint(1, 3)))
        chosen = chosen[: self.max_retained - len(self.retained)]
        results = []
        for key in chosen:
            self.report(f"begin retain {key}")
            results.append(self.store.retain(key))
        self.store.flush()
        for key, ok in zip(chosen, results, strict=True):
            self.report(f"ack retain {key} {int(ok)}")
            if ok:
                self.retained.add(key)
                self.check(key, "retained", present=True)
            elif self.known.get(key) is not None and not self.bounded:
                self.report(f"bad retain {key}: returned False for a present key")

    def release_some(self) -> None:
        pool = sorted(self.retained) or self.keys
        chosen = self.rng.sample(pool, min(len(pool), self.rng.randint(1, 2)))
        for key in chosen:
            self.report(f"begin release {key}")
            self.store.release(key)
        self.store.flush()
        for key in chosen:
            self.report(f"ack release {key}")
            self.retained.discard(key)

    def pin(self, key: str) -> bool:
        if not self.store.pin(key):
            return False
        self.pins.append(key)
        return True

    def unpin_some(self, keep: int) -> None:
        while len(self.pins) > keep:
            self.store.unpin(self.pins.pop(0))

    def unpin_all(self) -> None:
        self.unpin_some(0)

    def delete_pinned(self) -> None:
        """Pin pages, read them, delete them (acknowledged after a flush), and keep
        the pins a while: the deleted pages' segments must outlive the pins."""
        self.unpin_some(self.MAX_PINS - 1)
        chosen = []
        for key in self.rng.sample(self.writable(), 2):
            if self.pin(key):
                chosen.append(key)
                break
        for key in chosen:
            self.check(key, "pinned", present=True)
            self.report(f"begin del {key}")
            self.retained.discard(key)
            self.store.delete(key)
        self.store.flush()
        for key in chosen:
            self.report(f"ack del {key}")
            self.known[key] = None
            if self.store.get(key) is not None:
                self.report(f"bad pinned {key}: readable after its delete")
        if self.rng.random() < 0.5:
            self.unpin_some(0)

    def read_pinned(self) -> None:
        """Pin a batch, read every page written here and every retained one."""
        candidates = [key for key, v in self.known.items() if v is not None]
        chosen = self.rng.sample(candidates, min(len(candidates), 4))
        chosen += self.rng.sample(sorted(self.retained), min(len(self.retained), 2))
        with self.store.pinned(chosen) as ok:
            for key, pinned in zip(chosen, ok, strict=True):
                if pinned:
                    self.check(key, "pinned", present=True)
                else:
                    self.check(key, "unpinnable", present=key in self.retained)
        for key in self.retained:
            self.check(key, "retained", present=True)


# -- parent ---------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class LoopConfig:
    dir: Path
    cycles: int = 200
    seed: int = 0
    keys: int = 200
    segment_mib: int = 8
    min_delay_s: float = 0.05
    max_delay_s: float = 1.5
    startup_kill_prob: float = 0.2  # delay counted from spawn, not from "ready"
    ckpt_hunt_prob: float = 0.15  # wait for "begin ckpt", then kill within a few ms
    checkpoint_prob: float = 0.03
    gc_prob: float = 0.02
    ready_timeout_s: float = 60.0
    quiet_s: float = 0.5  # a ready child silent this long is watched for a stall
    stall_s: float = 5.0  # ... and one silent this long has stalled (a violation)
    small_lease_prob: float = 0.3  # cycles with lsn_lease_step in 8..512
    verify_timeout_s: float | None = 120.0  # faulthandler watchdog; None: off
    stop_on_violation: bool = False
    python: str = sys.executable
    capacity_mib: int | None = None  # capacity_bytes for the store: eviction happens
    retain: bool = False  # the child also retains, releases, pins and deletes pinned pages
    space_prob: float = 0.2  # with retain: share of operations that are those
    eviction_policy: str | None = None  # with a capacity: None picks one per cycle
    # Concurrent writers (``--threads``): thread 0 runs the mix above on its share
    # of the keys, the others run _Worker on theirs (see child_main).
    threads: int = 1
    flush_interval_ms: float | None = None  # the store's flusher; None: its default
    engine: str | None = None  # io_engine for child and parent; None: the default
    fresh_prob: float = 0.5  # --threads: share of put_many batches of fresh keys
    switch_interval_us: float | None = None  # the child's GIL switch interval
    busy_threads: int = 0  # CPU-bound Python threads in the child (GIL contention)
    busy_procs: int = 0  # CPU-bound processes beside the loop, for the whole run
    max_page_kib: int | None = None  # cap on page sizes (more operations per second)
    pipelined: bool = False  # --threads: writer threads 1..N-1 use put_many_async
    aligned: bool = False  # pages handed over in 4 KiB-aligned memory (zero-copy writes)
    parent_engine: str | None = None  # io_engine of the parent's reopens; None: ``engine``
    # Called with the recovered store and the cycle after the oracle's checks found
    # every key readable (tools/crashloop_fsck.py runs fsck there).
    after_recovery: Callable[[KVStore, int], None] | None = None


@dataclasses.dataclass(slots=True)
class LoopSummary:
    seed: int = 0
    cycles: int = 0
    kills_during_startup: int = 0
    kills_during_ops: int = 0
    kills_during_checkpoint: int = 0
    kills_during_gc: int = 0
    store_not_created_yet: int = 0
    acks_put: int = 0
    acks_del: int = 0
    acks_ckpt: int = 0
    acks_gc: int = 0
    acks_retain: int = 0  # retains acknowledged (the key was present and is now retained)
    acks_retain_absent: int = 0  # retains that found the key gone (evicted or deleted)
    acks_release: int = 0
    checked_acked_puts: int = 0  # verifications of a put acknowledged in that cycle
    checked_acked_deletes: int = 0  # verifications of a delete acknowledged in that cycle
    checked_keys: int = 0  # every key verification, baseline carried over included
    inflight_became_new: int = 0  # an unacknowledged op that turned out durable
    inflight_stayed_old: int = 0
    checked_retained: int = 0  # verifications of a key whose retain was acknowledged
    evicted_seen: int = 0  # acknowledged pages found absent, allowed by the capacity
    lost_pages: int = 0
    wrong_bytes: int = 0
    wrong_meta: int = 0
    resurrected_deletes: int = 0
    lost_retains: int = 0  # an acknowledged, unreleased retain whose page is gone
    retain_mismatches: int = 0  # is_retained() disagrees with the acknowledged state
    child_check_failures: int = 0  # "bad ..." lines: the child read a broken promise
    read_errors: int = 0
    index_mismatches: int = 0
    child_failures: int = 0
    recovery_failures: int = 0
    reopen_s: list[float] = dataclasses.field(default_factory=list)
    close_s: list[float] = dataclasses.field(default_factory=list)
    replayed_records: list[int] = dataclasses.field(default_factory=list)
    elapsed_s: float = 0.0
    store_bytes: int = 0
    kvstore_module: str = ""
    capacity_mib: int | None = None
    retain: bool = False
    threads: int = 1
    flush_interval_ms: float | None = None
    checked_fresh_keys: int = 0  # fresh keys (--threads) verified, then deleted
    engines: dict[str, int] = dataclasses.field(default_factory=dict)  # children per engine
    details: list[str] = dataclasses.field(default_factory=list)

    @property
    def violations(self) -> int:
        return (
            self.lost_pages
            + self.wrong_bytes
            + self.wrong_meta
            + self.resurrected_deletes
            + self.lost_retains
            + self.retain_mismatches
            + self.child_check_failures
            + self.read_errors
            + self.index_mismatches
            + self.child_failures
            + self.recovery_failures
        )

    def note(self, detail: str) -> None:
        if len(self.details) < MAX_DETAILS:
            self.details.append(detail)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("reopen_s", "close_s", "replayed_records")
        }
        out["violations"] = self.violations
        out["reopen_s_mean"] = _mean(self.reopen_s)
        out["reopen_s_max"] = max(self.reopen_s, default=0.0)
        out["close_s_mean"] = _mean(self.close_s)
        out["close_s_max"] = max(self.close_s, default=0.0)
        out["replayed_records_mean"] = _mean([float(r) for r in self.replayed_records])
        out["replayed_records_max"] = max(self.replayed_records, default=0)
        return out


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


class Oracle:
    """The expected state, kept in the parent: per key the last acknowledged state,
    the states of operations begun since then, and every version ever begun; and
    per key whether a retain is acknowledged, with the retain flags that operations
    begun since then may leave (a release or a delete may drop it).

    ``bounded`` (the store has a capacity): a page that is not retained may also
    have been evicted, so absence is allowed for it; a retained one may not be.
    """

    def __init__(self, keys: list[str], bounded: bool = False) -> None:
        self.keys = keys
        self.bounded = bounded
        self.acked: dict[str, State] = dict.fromkeys(keys, ABSENT)
        self.begun: dict[str, list[State]] = {k: [] for k in keys}
        # Per begun state, what identifies its ack: the version of a put, the token
        # of a delete that carries one (``begin del K T``), else None.
        self.begun_tokens: dict[str, list[int | None]] = {k: [] for k in keys}
        self.fresh: set[str] = set()  # acknowledged during the current cycle
        self.history: dict[str, set[int]] = {k: set() for k in keys}
        self.retained: dict[str, bool] = dict.fromkeys(keys, False)
        self.retain_begun: dict[str, list[bool]] = {k: [] for k in keys}
        # Keys outside ``keys`` that the child wrote this cycle (``--threads``: the
        # fresh keys of put_many): verified once after the kill, then dropped.
        self.fresh_keys: list[str] = []

    def start_cycle(self) -> None:
        self.fresh.clear()
        for pending in self.begun.values():
            pending.clear()
        for tokens in self.begun_tokens.values():
            tokens.clear()
        for flags in self.retain_begun.values():
            flags.clear()

    def _know(self, key: str) -> None:
        """Start tracking a key outside the fixed key space (a fresh key)."""
        if key in self.acked:
            return
        self.acked[key] = ABSENT
        self.begun[key] = []
        self.begun_tokens[key] = []
        self.history[key] = set()
        self.retained[key] = False
        self.retain_begun[key] = []
        self.fresh_keys.append(key)

    def forget_fresh_keys(self) -> None:
        """Drop this cycle's fresh keys (verified, and deleted from the store)."""
        for key in self.fresh_keys:
            del self.acked[key], self.begun[key], self.begun_tokens[key]
            del self.history[key], self.retained[key], self.retain_begun[key]
            self.fresh.discard(key)
        self.fresh_keys.clear()

    def must_keep(self, key: str) -> bool:
        """A retain is acknowledged and nothing begun since may have dropped it."""
        return self.retained[key] and False not in self.retain_begun[key]

    def retain_flags(self, key: str) -> set[bool]:
        return {self.retained[key], *self.retain_begun[key]}

    def apply(self, line: str, summary: LoopSummary, cycle: int = 0) -> None:
        parts = line.split()
        if parts[:1] == ["bad"]:
            summary.child_check_failures += 1
            summary.note(f"cycle {cycle}: child check failed: {line[4:]}")
            return
        if len(parts) < 3 or parts[0] not in ("begin", "ack") or parts[1] in ("ckpt", "gc"):
            if parts[:2] == ["ack", "ckpt"]:
                summary.acks_ckpt += 1
            elif parts[:2] == ["ack", "gc"]:
                summary.acks_gc += 1
            return
        phase, kind, key = parts[0], parts[1], parts[2]
        if kind in ("retain", "release"):
            self._apply_retain(phase, kind, key, parts[3:], summary, cycle)
            return
        self._know(key)
        state: State = ("put", int(parts[3])) if kind == "put" else ABSENT
        token = int(parts[3]) if len(parts) > 3 else None
        if phase == "begin":
            self.begun[key].append(state)
            self.begun_tokens[key].append(token)
            if kind == "put":
                self.history[key].add(state[1])
            else:
                self.retain_begun[key].append(False)  # a delete drops the retain
            return
        # An ack settles the operation it names and every one begun before it on
        # that key (one writer per key: later ones have later LSNs). Operations
        # begun after it stay in flight (``--threads``: a worker acknowledges a put
        # only once a flush covers it, and may have begun others on the key since).
        # Without a token that matches, it settles everything begun.
        tokens = self.begun_tokens[key]
        cut = tokens.index(token) + 1 if token is not None and token in tokens else len(tokens)
        settled = self.begun[key][:cut]
        if ABSENT in settled:
            # A delete begun in the same group (a churn acknowledges only the last
            # state of each key): the flush made it durable, so the retain is gone.
            self.retained[key] = False
            self.retain_begun[key].clear()
        self.acked[key] = state
        del self.begun[key][:cut]
        del tokens[:cut]
        self.fresh.add(key)
        if kind == "put":
            summary.acks_put += 1
        else:
            summary.acks_del += 1
            self.retained[key] = False
            self.retain_begun[key].clear()

    def _apply_retain(
        self, phase: str, kind: str, key: str, rest: list[str], summary: LoopSummary, cycle: int
    ) -> None:
        if phase == "begin":
            self.retain_begun[key].append(kind == "retain")
            return
        self.retain_begun[key].clear()
        if kind == "release":
            self.retained[key] = False
            summary.acks_release += 1
            return
        if rest == ["1"]:
            self.retained[key] = True
            summary.acks_retain += 1
            return
        # retain() returned False: the key was absent. The child's operations run
        # one at a time, so nothing on this key was in flight: its acknowledged
        # state says what it should have been.
        summary.acks_retain_absent += 1
        if self.retained[key]:
            summary.lost_retains += 1
            summary.note(f"cycle {cycle}: {key}: retained, but retain() found it absent")
        elif self.acked[key][0] == "put":
            if self.bounded:
                # Evicted, and the flush after retain() made the eviction durable:
                # the page must never come back.
                self.acked[key] = ABSENT
            else:
                summary.lost_pages += 1
                summary.note(
                    f"cycle {cycle}: {key}: acked {self.acked[key]}, "
                    "but retain() found it absent (no capacity)"
                )
        self.retained[key] = False


def _classify(
    oracle: Oracle,
    key: str,
    got: bytes | None,
    meta: dict[str, Any] | None,
    summary: LoopSummary,
    cycle: int,
) -> State:
    """Check one key; returns the state the store is in (the new baseline)."""
    acked = oracle.acked[key]
    allowed = [acked, *oracle.begun[key]]
    summary.checked_keys += 1
    keep = oracle.must_keep(key)
    if keep:
        summary.checked_retained += 1
    if key in oracle.fresh:
        if acked[0] == "put":
            summary.checked_acked_puts += 1
        else:
            summary.checked_acked_deletes += 1
    seen: State | None = None
    if got is None:
        if ABSENT in allowed:
            seen = ABSENT
        elif oracle.bounded and not keep:
            summary.evicted_seen += 1  # evicted: allowed under a capacity
            return ABSENT
    else:
        for state in allowed:
            if (
                state[0] == "put"
                and page_size(key, state[1]) == len(got)
                and page_bytes(key, state[1]) == got
            ):
                seen = state
                break
    if seen is not None:
        if seen != acked:
            summary.inflight_became_new += 1
        elif oracle.begun[key]:
            summary.inflight_stayed_old += 1
        if seen[0] == "put" and meta != page_meta(key, seen[1]):
            summary.wrong_meta += 1
            summary.note(f"cycle {cycle}: {key} v{seen[1]}: meta {meta!r}")
        return seen
    what = f"cycle {cycle}: {key}: acked {acked}, begun since {oracle.begun[key]}"
    if got is None:
        if keep:
            summary.lost_retains += 1
            summary.note(f"{what}: LOST RETAINED PAGE (get returned None)")
        else:
            summary.lost_pages += 1
            summary.note(f"{what}: LOST (get returned None)")
        return ABSENT
    older = [
        v
        for v in sorted(oracle.history[key])
        if page_size(key, v) == len(got) and page_bytes(key, v) == got
    ]
    if older and acked[0] == "del" and not any(s[0] == "put" for s in oracle.begun[key]):
        summary.resurrected_deletes += 1
        summary.note(f"{what}: RESURRECTED v{older[0]}")
    else:
        summary.wrong_bytes += 1
        label = f"an older version v{older[0]}" if older else "no known version"
        summary.note(f"{what}: WRONG BYTES ({len(got)} bytes matching {label})")
    return ("put", older[0]) if older else ABSENT


Read = tuple[bytes | None, dict[str, Any] | None, bool]  # bytes, meta, read raised


def _read_all(store: KVStore, keys: list[str], summary: LoopSummary, cycle: int) -> list[Read]:
    """(bytes, meta, failed) per key; a read that raises is counted and marked failed."""
    try:
        values: list[bytes | None] = store.get_many(keys)
        failed = [False] * len(keys)
    except KVStoreError:
        values, failed = [], []
        for key in keys:
            try:
                values.append(store.get(key))
                failed.append(False)
            except KVStoreError as e:
                summary.read_errors += 1
                summary.note(f"cycle {cycle}: get({key}) raised {type(e).__name__}: {e}")
                values.append(None)
                failed.append(True)
    out: list[Read] = []
    for key, value, bad in zip(keys, values, failed, strict=True):
        meta: dict[str, Any] | None = None
        if value is not None:
            info = store.info(key)
            meta = dict(info.meta) if info is not None and info.meta else None
        out.append((value, meta, bad))
    return out


def _check_index(store: KVStore, present: set[str], summary: LoopSummary, cycle: int) -> None:
    listed = {k.decode() for k in store.keys()}  # noqa: SIM118 (no __iter__)
    live_pages = sum(state.live_pages for state in store.segment_states().values())
    if listed != present or len(store) != len(present) or live_pages != len(present):
        summary.index_mismatches += 1
        summary.note(
            f"cycle {cycle}: index disagrees with reads: {len(present)} keys readable, "
            f"keys() lists {len(listed)} (extra {sorted(listed - present)[:5]}, "
            f"missing {sorted(present - listed)[:5]}), len() {len(store)}, "
            f"live_pages {live_pages}"
        )


def _check_retain(
    store: KVStore, oracle: Oracle, key: str, present: bool, summary: LoopSummary, cycle: int
) -> None:
    """is_retained() matches the acknowledged retain (or one begun since); the new
    baseline is what the store says."""
    flag = store.is_retained(key)
    allowed = oracle.retain_flags(key) if present else {False}
    if flag not in allowed:
        summary.retain_mismatches += 1
        summary.note(
            f"cycle {cycle}: {key}: is_retained() {flag}, expected one of {sorted(allowed)} "
            f"({'present' if present else 'absent'})"
        )
    oracle.retained[key] = flag


def verify(config: LoopConfig, oracle: Oracle, summary: LoopSummary, cycle: int) -> bool:
    """Open, check every key, close. False when the store could not be recovered."""
    if config.verify_timeout_s:
        faulthandler.dump_traceback_later(config.verify_timeout_s, exit=True)
    try:
        started = time.perf_counter()
        try:
            options: dict[str, Any] = {}
            if config.capacity_mib:  # no background GC: nothing may be evicted while checked
                options.update(capacity_bytes=config.capacity_mib * MIB, gc_interval_s=0)
            engine = config.parent_engine or config.engine
            if engine is not None:
                options["io_engine"] = engine
            store = open_store(config.dir, config.segment_mib * MIB, **options)
        except StoreNotFoundError:
            # Killed while creating the store: fine as long as nothing was acknowledged.
            summary.store_not_created_yet += 1
            oracle.forget_fresh_keys()
            if any(state != ABSENT for state in oracle.acked.values()):
                summary.recovery_failures += 1
                summary.note(f"cycle {cycle}: the store vanished after acknowledged writes")
                return False
            return True
        except Exception as e:
            summary.recovery_failures += 1
            summary.note(f"cycle {cycle}: reopen raised {type(e).__name__}: {e}")
            return False
        summary.reopen_s.append(time.perf_counter() - started)
        summary.replayed_records.append(store.replayed_records)
        try:
            keys = oracle.keys + oracle.fresh_keys
            results = _read_all(store, keys, summary, cycle)
            present: set[str] = set()
            for key, (got, meta, failed) in zip(keys, results, strict=True):
                if failed:
                    continue  # counted as a read error; the baseline stays as it was
                oracle.acked[key] = _classify(oracle, key, got, meta, summary, cycle)
                if got is not None:
                    present.add(key)
                _check_retain(store, oracle, key, got is not None, summary, cycle)
            if oracle.fresh_keys:
                # Checked once: delete them, so the store (and each cycle's check)
                # stays the size of the fixed key space.
                summary.checked_fresh_keys += len(oracle.fresh_keys)
                for key in oracle.fresh_keys:
                    store.delete(key)
                    present.discard(key)
                oracle.forget_fresh_keys()
            if not any(failed for _, _, failed in results):
                _check_index(store, present, summary, cycle)
                if config.after_recovery is not None:
                    config.after_recovery(store, cycle)
        finally:
            started = time.perf_counter()
            try:
                store.close()
            except Exception as e:
                summary.recovery_failures += 1
                summary.note(f"cycle {cycle}: close after recovery raised {type(e).__name__}: {e}")
                return False
            summary.close_s.append(time.perf_counter() - started)
        return True
    finally:
        if config.verify_timeout_s:
            faulthandler.cancel_dump_traceback_later()


class _ChildWatch:
    """Reads the child's protocol lines on a thread; signals 'ready' and 'begin ckpt'."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self.last_line_at = time.monotonic()
        self.ready = threading.Event()
        self.engine: str | None = None  # what the child's store runs on (its ready line)
        self.in_checkpoint = threading.Event()
        self.ckpt_begun = threading.Event()
        self.in_gc = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            if not raw.endswith(b"\n"):
                break  # a line cut by the kill: never acknowledged
            line = raw.decode().strip()
            self.lines.append(line)
            self.last_line_at = time.monotonic()
            if line.startswith("ready"):
                fields = line.split()
                self.engine = fields[2] if len(fields) > 2 else None
                self.ready.set()
            elif line == "begin ckpt":
                self.in_checkpoint.set()
                self.ckpt_begun.set()
            elif line == "ack ckpt":
                self.in_checkpoint.clear()
            elif line == "begin gc":
                self.in_gc.set()
            elif line == "ack gc":
                self.in_gc.clear()

    def join(self) -> None:
        self._thread.join()


def _wait_for(event: threading.Event, proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Wait for ``event``; give up early when the child has exited."""
    deadline = time.monotonic() + timeout_s
    while not event.wait(0.01):
        if proc.poll() is not None or time.monotonic() >= deadline:
            return event.is_set()
    return True


def _stalled(config: LoopConfig, watch: _ChildWatch, proc: subprocess.Popen[bytes]) -> bool:
    """True when a ready, live child has reported nothing for ``stall_s`` seconds."""
    if time.monotonic() - watch.last_line_at < config.quiet_s:
        return False
    count = len(watch.lines)
    while time.monotonic() - watch.last_line_at < config.stall_s:
        if proc.poll() is not None or len(watch.lines) != count:
            return False
        time.sleep(0.01)
    if proc.poll() is not None or len(watch.lines) != count:
        return False
    proc.send_signal(signal.SIGUSR1)  # faulthandler: dump every thread to stderr
    time.sleep(0.5)
    return True


def _child_command(config: LoopConfig, cycle: int, rng: random.Random, hunt: bool) -> list[str]:
    command = [
        config.python,
        "-m",
        "kvstore.testing.crashloop",
        "--child",
        "--dir",
        str(config.dir),
        "--cycle",
        str(cycle),
        "--child-seed",
        str(rng.getrandbits(63)),
        "--keys",
        str(config.keys),
        "--segment-mib",
        str(config.segment_mib),
        "--checkpoint-prob",
        str(0.25 if hunt else config.checkpoint_prob),
        "--gc-prob",
        str(config.gc_prob),
        "--gc-interval-s",
        str(rng.choice([1.0, 1.0, 0.05, 0.0])),  # 0: no background GC thread
    ]
    if rng.random() < config.small_lease_prob:
        command += ["--lsn-lease-step", str(rng.choice([8, 32, 128, 512]))]
    if config.capacity_mib:
        policy = config.eviction_policy or rng.choice(["fifo", "fifo", "lru", "cost"])
        command += ["--capacity-mib", str(config.capacity_mib), "--eviction-policy", policy]
    if config.retain:
        command += ["--retain", "--space-prob", str(config.space_prob)]
    if rng.random() < 0.3:  # let the flusher thread checkpoint under the writes too
        command += ["--checkpoint-interval-s", f"{rng.uniform(0.05, 0.5):.3f}"]
        command += ["--checkpoint-wal-bytes", str(rng.choice([16 * KIB, 256 * KIB, 64 * MIB]))]
    # The options below draw nothing from rng: a loop without them runs the same cycles.
    if config.threads > 1:
        command += ["--threads", str(config.threads), "--fresh-prob", str(config.fresh_prob)]
    if config.flush_interval_ms is not None:
        command += ["--flush-interval-ms", str(config.flush_interval_ms)]
    if config.engine is not None:
        command += ["--engine", config.engine]
    if config.switch_interval_us:
        command += ["--switch-interval-us", str(config.switch_interval_us)]
    if config.busy_threads:
        command += ["--busy-threads", str(config.busy_threads)]
    if config.max_page_kib:
        command += ["--max-page-kib", str(config.max_page_kib)]
    if config.pipelined:
        command += ["--pipelined"]
    if config.aligned:
        command += ["--aligned"]
    return command


def run_cycle(
    config: LoopConfig,
    oracle: Oracle,
    summary: LoopSummary,
    cycle: int,
    rng: random.Random,
    log: Callable[[str], None],
) -> bool:
    """One spawn-kill-verify cycle. False when the loop must stop."""
    oracle.start_cycle()
    hunt = rng.random() < config.ckpt_hunt_prob
    from_spawn = not hunt and rng.random() < config.startup_kill_prob
    delay = rng.uniform(config.min_delay_s, config.max_delay_s)
    if from_spawn:  # aim at the child's imports, open and recovery (~0.2-0.5 s)
        delay = rng.uniform(config.min_delay_s, max(config.min_delay_s, 0.5))
    stderr_path = config.dir.parent / f".{config.dir.name}.child-stderr"
    with open(stderr_path, "wb") as stderr:
        proc = subprocess.Popen(
            _child_command(config, cycle, rng, hunt),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
    watch = _ChildWatch(proc)
    hung = False
    if from_spawn:
        time.sleep(delay)
    elif not _wait_for(watch.ready, proc, config.ready_timeout_s):
        hung = proc.poll() is None
    elif hunt:
        if _wait_for(watch.ckpt_begun, proc, max(delay, 1.0) * 3):
            time.sleep(rng.uniform(0.0, 0.004))
    else:
        time.sleep(delay)
    stalled = not from_spawn and not hunt and watch.ready.is_set() and _stalled(config, watch, proc)
    in_checkpoint = watch.in_checkpoint.is_set()
    in_gc = watch.in_gc.is_set()
    ready = watch.ready.is_set()
    exited_early = proc.poll() is not None
    if not exited_early:
        proc.send_signal(signal.SIGKILL)
    returncode = proc.wait()
    watch.join()
    if proc.stdout is not None:
        proc.stdout.close()
    if exited_early or hung or stalled:
        summary.child_failures += 1
        tail = stderr_path.read_text(errors="replace")[-3000:]
        why = (
            "hung before ready"
            if hung
            else f"stalled: no progress for {config.stall_s} s (stacks below)"
            if stalled
            else f"exited by itself with status {returncode}"
        )
        shown = tail.strip()
        if stalled and "Current thread" in shown:  # the main thread's stack
            shown = shown[shown.index("Current thread") :].split("\n\n")[0]
        summary.note(f"cycle {cycle}: child {why}: {shown[-600:]}")
        log(f"cycle {cycle}: child {why}\n{tail}")
    elif not ready:
        summary.kills_during_startup += 1
    elif in_checkpoint:
        summary.kills_during_checkpoint += 1
    elif in_gc:
        summary.kills_during_gc += 1
    else:
        summary.kills_during_ops += 1
    stderr_path.unlink(missing_ok=True)
    if watch.engine is not None:
        summary.engines[watch.engine] = summary.engines.get(watch.engine, 0) + 1
    before = summary.violations
    for line in watch.lines:
        oracle.apply(line, summary, cycle)  # may count "bad ..." lines and lost retains
    ok = verify(config, oracle, summary, cycle)
    summary.cycles += 1
    if summary.violations != before:
        log(f"cycle {cycle}: {summary.violations - before} new violation(s)")
        for detail in summary.details[-5:]:
            log(f"  {detail}")
    return ok and not (config.stop_on_violation and summary.violations)


def run_crashloop(config: LoopConfig, log: Callable[[str], None] | None = None) -> LoopSummary:
    """Run ``config.cycles`` crash cycles on a new store at ``config.dir``."""
    say = log or (lambda _: None)
    if config.dir.exists() and any(config.dir.iterdir()):
        raise ValueError(f"{config.dir} is not empty; the oracle needs a new store")
    rng = random.Random(config.seed)
    oracle = Oracle([key_name(i) for i in range(config.keys)], bounded=bool(config.capacity_mib))
    if config.capacity_mib and config.capacity_mib < 5 * config.segment_mib:
        raise ValueError(
            f"capacity_mib ({config.capacity_mib}) must hold at least 5 segments of "
            f"{config.segment_mib} MiB (watermark + GC reserve + 2)"
        )
    summary = LoopSummary(
        seed=config.seed,
        kvstore_module=str(Path(kvstore.__file__).parent),
        capacity_mib=config.capacity_mib,
        retain=config.retain,
        threads=config.threads,
        flush_interval_ms=config.flush_interval_ms,
    )
    set_page_limit(config.max_page_kib * KIB if config.max_page_kib else None)
    busy = [
        subprocess.Popen(
            [config.python, "-c", "while True: pass"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        for _ in range(config.busy_procs)
    ]
    started = time.perf_counter()
    try:
        for cycle in range(1, config.cycles + 1):
            if not run_cycle(config, oracle, summary, cycle, rng, say):
                say(f"stopping after cycle {cycle}")
                break
            if cycle % 10 == 0:
                say(
                    f"cycle {cycle}: acks {summary.acks_put} puts / {summary.acks_del} deletes, "
                    f"violations {summary.violations}, last reopen {summary.reopen_s[-1:]}"
                )
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    summary.elapsed_s = time.perf_counter() - started
    summary.store_bytes = (
        sum(f.stat().st_size for f in config.dir.rglob("*") if f.is_file())
        if config.dir.exists()
        else 0
    )
    return summary


def format_summary(summary: LoopSummary) -> str:
    d = summary.as_dict()
    lines = [
        f"seed                     {d['seed']}",
        f"kvstore                  {d['kvstore_module']}",
        f"cycles                   {d['cycles']} "
        f"(killed in startup/recovery {d['kills_during_startup']}, "
        f"in ops {d['kills_during_ops']}, in checkpoint {d['kills_during_checkpoint']}, "
        f"in gc {d['kills_during_gc']})",
        f"acks received            {d['acks_put']} puts, {d['acks_del']} deletes, "
        f"{d['acks_ckpt']} checkpoints, {d['acks_gc']} gc passes",
        f"acked ops verified       {d['checked_acked_puts']} puts, "
        f"{d['checked_acked_deletes']} deletes ({d['checked_keys']} key checks in all)",
        f"unacked ops resolved     {d['inflight_became_new']} to the new state, "
        f"{d['inflight_stayed_old']} to the old",
        "engines                  "
        + (", ".join(f"{name} {count} children" for name, count in d["engines"].items()) or "-"),
    ]
    if summary.threads > 1 or summary.flush_interval_ms is not None:
        lines += [
            f"writers                  {summary.threads} threads, flusher every "
            f"{summary.flush_interval_ms if summary.flush_interval_ms is not None else 'default'}"
            f" ms; {d['checked_fresh_keys']} fresh keys verified",
        ]
    if summary.capacity_mib or summary.retain:
        lines += [
            f"space mode               capacity "
            f"{f'{summary.capacity_mib} MiB' if summary.capacity_mib else 'none'}, "
            f"retain/pin ops {'on' if summary.retain else 'off'}",
            f"retains acked            {d['acks_retain']} (+{d['acks_retain_absent']} that "
            f"found the key evicted or deleted), {d['acks_release']} releases",
            f"retained keys verified   {d['checked_retained']}",
            f"evicted pages seen       {d['evicted_seen']} (acked, absent, not retained)",
        ]
    lines += [
        f"lost pages               {d['lost_pages']}",
        f"wrong bytes              {d['wrong_bytes']}",
        f"wrong meta               {d['wrong_meta']}",
        f"resurrected deletes      {d['resurrected_deletes']}",
        f"lost retains             {d['lost_retains']}",
        f"retain flag mismatches   {d['retain_mismatches']}",
        f"child check failures     {d['child_check_failures']}",
        f"read errors              {d['read_errors']}",
        f"index mismatches         {d['index_mismatches']}",
        f"child failures           {d['child_failures']}",
        f"recovery failures        {d['recovery_failures']}",
        f"reopen time              mean {d['reopen_s_mean'] * 1e3:.1f} ms, "
        f"max {d['reopen_s_max'] * 1e3:.1f} ms",
        f"close (checkpoint) time  mean {d['close_s_mean'] * 1e3:.1f} ms, "
        f"max {d['close_s_max'] * 1e3:.1f} ms",
        f"WAL records replayed     mean {d['replayed_records_mean']:.0f}, "
        f"max {d['replayed_records_max']}",
        f"store size at end        {d['store_bytes'] / MIB:.0f} MiB",
        f"elapsed                  {d['elapsed_s']:.1f} s",
        f"VIOLATIONS               {d['violations']}",
    ]
    lines += [f"  {detail}" for detail in summary.details]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The loop's options (tools/crashloop_fsck.py adds its own to them)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--dir", type=Path, required=True, help="store directory (new or empty)")
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--keys", type=int, default=200, help="size of the key space")
    parser.add_argument("--segment-mib", type=int, default=8)
    parser.add_argument("--min-delay", type=float, default=0.05, help="seconds before the kill")
    parser.add_argument("--max-delay", type=float, default=1.5)
    parser.add_argument("--startup-kill-prob", type=float, default=0.2)
    parser.add_argument("--ckpt-hunt-prob", type=float, default=0.15)
    parser.add_argument(
        "--fresh", action="store_true", help="remove --dir first if it holds a kvstore"
    )
    parser.add_argument(
        "--capacity-mib",
        type=int,
        default=None,
        help="store capacity in MiB (at least 5 segments): pages get evicted, and the "
        "oracle allows an unretained page to be absent",
    )
    parser.add_argument(
        "--retain",
        action="store_true",
        help="the child also retains/releases keys (acked after a flush), pins pages, "
        "deletes pinned pages and checks pinned and retained reads",
    )
    parser.add_argument(
        "--stall-s",
        type=float,
        default=5.0,
        help="a ready child silent this long has stalled (a violation); raise it on a "
        "heavily loaded machine",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="writer threads in the child: thread 0 runs the mix above on its share of "
        "the keys, the others put_many (2-7 keys, fresh ones too), put(sync=True), "
        "delete and flush() on theirs, acknowledging what any thread's flush covered",
    )
    parser.add_argument(
        "--flush-interval-ms",
        type=float,
        default=None,
        help="the child store's flush_interval_ms (default: the store's); 1 makes the "
        "flusher's group commits race the writers all the time",
    )
    parser.add_argument(
        "--engine",
        choices=["auto", "io_uring", "threadpool"],
        default=None,
        help="io_engine of every store the loop opens (child and parent); default: the "
        "store's, which KVSTORE_IO_ENGINE overrides (children inherit the environment)",
    )
    parser.add_argument(
        "--fresh-prob",
        type=float,
        default=0.5,
        help="with --threads: share of a worker's put_many batches that write fresh "
        "keys (written once, verified after the kill, then deleted)",
    )
    parser.add_argument(
        "--switch-interval-us",
        type=float,
        default=None,
        help="the child's GIL switch interval (sys.setswitchinterval) in microseconds: "
        "small values make thread switches land inside short critical windows",
    )
    parser.add_argument(
        "--busy-threads", type=int, default=0, help="CPU-bound Python threads in the child"
    )
    parser.add_argument(
        "--busy-procs",
        type=int,
        default=0,
        help="CPU-bound processes beside the loop for the whole run (CPU load)",
    )
    parser.add_argument(
        "--max-page-kib",
        type=int,
        default=None,
        help="cap page sizes (default 1 MiB, mostly 256 KiB): smaller pages, more "
        "operations and group commits per second",
    )
    parser.add_argument(
        "--pipelined",
        action="store_true",
        help="with --threads: writer threads 1..N-1 write batches with put_many_async, "
        "up to three in flight",
    )
    parser.add_argument(
        "--aligned",
        action="store_true",
        help="hand pages to the store in 4 KiB-aligned memory (zero-copy writes)",
    )
    parser.add_argument("--stop-on-violation", action="store_true")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    # child mode (internal)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cycle", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--child-seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint-prob", type=float, default=0.03, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint-interval-s", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint-wal-bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--gc-prob", type=float, default=0.02, help=argparse.SUPPRESS)
    parser.add_argument("--gc-interval-s", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--lsn-lease-step", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--max-ops", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--eviction-policy", help=argparse.SUPPRESS)
    parser.add_argument("--space-prob", type=float, default=0.2, help=argparse.SUPPRESS)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    summary = run_from_args(args)
    if args.json:
        print(json.dumps(summary.as_dict(), indent=2))
    else:
        print(format_summary(summary))
    return 1 if summary.violations else 0


def run_from_args(
    args: argparse.Namespace,
    *,
    parent_engine: str | None = None,
    after_recovery: Callable[[KVStore, int], None] | None = None,
) -> LoopSummary:
    """The loop that the parsed command line asks for (progress on stderr)."""
    directory: Path = args.dir.absolute()
    if args.fresh and (directory / "KVSTORE").exists():
        shutil.rmtree(directory)
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    config = LoopConfig(
        dir=directory,
        cycles=args.cycles,
        seed=seed,
        keys=args.keys,
        segment_mib=args.segment_mib,
        min_delay_s=args.min_delay,
        max_delay_s=args.max_delay,
        startup_kill_prob=args.startup_kill_prob,
        ckpt_hunt_prob=args.ckpt_hunt_prob,
        stop_on_violation=args.stop_on_violation,
        capacity_mib=args.capacity_mib,
        retain=args.retain,
        stall_s=args.stall_s,
        threads=args.threads,
        flush_interval_ms=args.flush_interval_ms,
        engine=args.engine,
        fresh_prob=args.fresh_prob,
        switch_interval_us=args.switch_interval_us,
        busy_threads=args.busy_threads,
        busy_procs=args.busy_procs,
        max_page_kib=args.max_page_kib,
        pipelined=args.pipelined,
        aligned=args.aligned,
        parent_engine=parent_engine,
        after_recovery=after_recovery,
    )

    def log(message: str) -> None:
        if not args.quiet:
            print(message, file=sys.stderr, flush=True)

    if args.capacity_mib is not None and args.capacity_mib < 5 * args.segment_mib:
        raise SystemExit(
            f"--capacity-mib must be at least 5 segments ({5 * args.segment_mib} MiB "
            f"with --segment-mib {args.segment_mib})"
        )
    log(f"crashloop: {config.cycles} cycles on {directory}, seed {seed}")
    return run_crashloop(config, log)


if __name__ == "__main__":
    sys.exit(main())

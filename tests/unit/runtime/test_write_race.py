"""The write path under concurrent writers: no acknowledged put lost to a group commit.

Issue 13: the publish step (``SegmentWriter._complete``, then
``KVStore._complete_puts``) took the pending-record list before it took the store lock;
a group commit on another thread in between swapped the list out and wrote it, so the
PUT record went into a list nobody wrote while the page was published and the next
``flush()`` returned. After a kill -9 the page was gone, or read back as an older
version of its key. These tests force that interleaving deterministically (a stand-in
for the store lock runs a group commit on another thread just before the publish takes
the lock), then stress it with real threads. A crash is simulated by copying the store
after ``flush()``: the copy is what a SIGKILL at that moment leaves behind.

Also here: the background threads never die silently, a group commit never
drops the records it swapped out, and the LRU policy's ranking survives
concurrent reads.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import xxhash

from kvstore import KVStore, WriterFailedError
from kvstore.runtime.gc import Collector
from kvstore.runtime.policies import LRUPolicy
from tests.conftest import OpenStore, open_small_store


def page(name: str, version: int = 0, size: int = 4096) -> bytes:
    seed = xxhash.xxh3_128_digest(f"{name}/{version}".encode())
    return (seed * (size // len(seed) + 1))[:size]


def crash_image(store: KVStore, to: Path) -> Path:
    """What a SIGKILL right now leaves on disk (nothing is flushed here)."""
    shutil.copytree(store.root, to, ignore=shutil.ignore_patterns("LOCK"))
    return to


def reopen(path: Path) -> KVStore:
    return open_small_store(path, create=False, gc_interval_s=0)


class CommitBeforePublish:
    """Stands in for ``store.internals.state.lock``. The first time
    ``SegmentWriter._complete`` takes it on the writer thread, a group commit runs to
    completion on another thread first:
    the moment between reaping a write's completion and publishing its page."""

    def __init__(self, store: KVStore) -> None:
        self.store = store
        self.real = store.internals.state.lock
        self.writer = threading.get_ident()
        self.armed = True
        self.commits = 0

    def __enter__(self) -> bool:
        if (
            self.armed
            and threading.get_ident() == self.writer
            and sys._getframe(1).f_code.co_name == "_complete"
        ):
            self.armed = False
            committer = threading.Thread(target=self.store.flush, name="test-group-commit")
            committer.start()
            committer.join()
            self.commits += 1
        return self.real.acquire()

    def __exit__(self, *exc: object) -> None:
        self.real.release()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self.real.acquire(blocking, timeout)

    def release(self) -> None:
        self.real.release()

    def locked(self) -> bool:
        return self.real.locked()


def put_with_a_commit_before_publish(store: KVStore, key: str, value: bytes) -> None:
    hook = CommitBeforePublish(store)
    store.internals.state.lock = hook  # type: ignore[assignment]
    try:
        store.put(key, value)
    finally:
        store.internals.state.lock = hook.real
    assert hook.commits == 1, "the hook never ran: SegmentWriter._complete changed?"


def test_a_group_commit_before_the_publish_does_not_lose_the_put(
    open_store: OpenStore, tmp_path: Path
) -> None:
    store = open_store(flush_interval_ms=10_000)  # no background commit gets in the way
    store.put("before", page("before"), sync=True)
    put_with_a_commit_before_publish(store, "raced", page("raced"))
    assert store.get("raced") == page("raced")
    store.flush()  # returns: "raced" returned before it, so it must be durable
    with reopen(crash_image(store, tmp_path / "crash")) as copy:
        assert copy.get("before") == page("before")
        assert copy.get("raced") == page("raced"), "an acknowledged put was lost"


def test_a_group_commit_before_the_publish_does_not_leave_an_older_version(
    open_store: OpenStore, tmp_path: Path
) -> None:
    store = open_store(flush_interval_ms=10_000)
    store.put("key", page("key", 1), sync=True)
    put_with_a_commit_before_publish(store, "key", page("key", 2))
    store.flush()
    with reopen(crash_image(store, tmp_path / "crash")) as copy:
        got = copy.get("key")
        assert got != page("key", 1), "the acknowledged overwrite reads back as the old version"
        assert got == page("key", 2)


def test_a_sync_put_after_the_race_is_durable_too(open_store: OpenStore, tmp_path: Path) -> None:
    """put_many(sync=True): its own flush() must cover the page it just published."""
    store = open_store(flush_interval_ms=10_000)
    hook = CommitBeforePublish(store)
    store.internals.state.lock = hook  # type: ignore[assignment]
    try:
        store.put_many([("a", page("a")), ("b", page("b"))], sync=True)
    finally:
        store.internals.state.lock = hook.real
    assert hook.commits == 1
    with reopen(crash_image(store, tmp_path / "crash")) as copy:
        assert copy.get_many(["a", "b"]) == [page("a"), page("b")]


def test_concurrent_writers_with_a_1ms_flusher_lose_no_acknowledged_page(
    open_store: OpenStore, tmp_path: Path
) -> None:
    """Several threads: put_many of 2-7 fresh keys, then flush(); the flusher runs every
    1 ms. Every page whose flush() returned is in the crash image, with its bytes.

    A 10 us GIL switch interval makes a thread switch land inside a short critical
    window often: on the old code this lost 20-60 of ~3,500 pages in every run.
    """
    store = open_store(flush_interval_ms=1, segment_bytes=4 << 20)
    threads = 6
    deadline = time.monotonic() + 1.5
    acked: list[list[str]] = [[] for _ in range(threads)]
    errors: list[BaseException] = []

    def writer(me: int) -> None:
        count = 0
        try:
            while time.monotonic() < deadline:
                size = 2 + count % 6
                keys = [f"t{me}-{count + i}" for i in range(size)]
                count += size
                store.put_many([(key, page(key, size=512)) for key in keys])
                store.flush()
                acked[me].extend(keys)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    workers = [threading.Thread(target=writer, args=(me,)) for me in range(threads)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    everything = [key for keys in acked for key in keys]
    assert len(everything) > 200, "the writers barely ran"
    with reopen(crash_image(store, tmp_path / "crash")) as copy:
        got = copy.get_many(everything)
    lost = [key for key, value in zip(everything, got, strict=True) if value is None]
    wrong = [
        key
        for key, value in zip(everything, got, strict=True)
        if value is not None and value != page(key, size=512)
    ]
    assert not lost and not wrong, (
        f"{len(lost)} of {len(everything)} acknowledged pages lost, {len(wrong)} wrong"
    )


# -- a group commit never drops what it swapped out ---------------------------------


def test_a_commit_interrupted_before_the_wal_keeps_its_records(
    open_store: OpenStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(flush_interval_ms=10_000)
    store.put("a", page("a"))
    real = os.fdatasync
    calls = {"n": 0}

    def interrupted_once(fd: int) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyboardInterrupt
        real(fd)

    monkeypatch.setattr(os, "fdatasync", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        store.flush()
    monkeypatch.setattr(os, "fdatasync", real)
    store.put("b", page("b"))
    store.flush()  # takes the interrupted commit's records over
    with reopen(crash_image(store, tmp_path / "crash")) as copy:
        assert copy.get_many(["a", "b"]) == [page("a"), page("b")]


def test_a_commit_interrupted_in_the_wal_append_stops_the_writer(
    open_store: OpenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(flush_interval_ms=10_000)
    store.put("a", page("a"))
    wal = store.internals.journal.wal
    assert wal is not None

    def interrupted(data: bytes) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(wal, "append", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.flush()
    # Part of the batch may be in the WAL file; the store cannot vouch for it.
    with pytest.raises(WriterFailedError, match="interrupted"):
        store.put("b", page("b"))
    with pytest.raises(WriterFailedError):
        store.flush()


# -- background threads never die silently --------------------------------------------


def _wait_for_failure(store: KVStore, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while store.internals.state.failed is None and time.monotonic() < deadline:
        time.sleep(0.005)


def test_an_unexpected_error_in_the_flusher_stops_the_writer_with_the_reason(
    open_store: OpenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(flush_interval_ms=1)

    def broken() -> None:
        raise RuntimeError("a bug in the group commit")

    monkeypatch.setattr(store, "flush", broken)
    store.put("a", page("a"))  # pending: the flusher calls flush()
    _wait_for_failure(store)
    flusher = store.internals.flusher
    assert flusher is not None
    flusher.join(5)
    assert not flusher.is_alive()
    with pytest.raises(WriterFailedError, match=r"kvstore-flush.*RuntimeError.*a bug"):
        store.put("b", page("b"))


def test_an_unexpected_error_in_the_gc_thread_stops_the_writer_with_the_reason(
    open_store: OpenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(gc_interval_s=0.01)

    def broken(self: Collector, tally: Any) -> None:
        raise RuntimeError("a bug in GC")

    monkeypatch.setattr(Collector, "_free_empty_segments", broken)
    _wait_for_failure(store)
    with pytest.raises(WriterFailedError, match=r"kvstore-gc.*RuntimeError.*a bug in GC"):
        store.put("a", page("a"))


# -- eviction policy state under concurrent reads -------------------------------------


def test_lru_victims_survive_reads_on_other_threads() -> None:
    """``victims`` runs without the store lock while reads update the order."""
    policy = LRUPolicy()
    keys = [b"k%05d" % i for i in range(20_000)]
    for key in keys:
        policy.on_put(key, 1, {})
    stop = threading.Event()

    def reader() -> None:
        position = 0
        while not stop.is_set():
            policy.on_read(keys[position % len(keys)])
            position += 7

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for _ in range(40):
            chosen = policy.victims(keys[:10], 15_000)
            assert len(chosen) == 10
    finally:
        stop.set()
        thread.join()

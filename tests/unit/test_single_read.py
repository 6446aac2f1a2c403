"""The single-page read path of ``get``/``get_into``: polled io_uring or one preadv."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvstore import KVStore
from kvstore.io.uring import UringQueue
from tests.conftest import OpenStore

PAGE_BYTES = 64 * 1024


def page(index: int, size: int = PAGE_BYTES) -> bytes:
    return (index.to_bytes(4, "little") * (size // 4 + 1))[:size]


@pytest.mark.parametrize("read_poll_us", [0, 1000, 1_000_000])
def test_get_and_get_into_with_and_without_polling(
    open_store: OpenStore, engine_kind: str, read_poll_us: int
) -> None:
    store = open_store(io_engine=engine_kind, read_poll_us=read_poll_us)
    expected = {f"k{i}".encode(): page(i, 1000 + 37 * i) for i in range(40)}
    store.put_many(list(expected.items()))
    store.flush()
    target = bytearray(PAGE_BYTES)
    for key, value in expected.items():
        assert store.get(key) == value
        assert store.get_into(key, target) == len(value)
        assert bytes(target[: len(value)]) == value
    assert store.get(b"absent") is None
    assert store.get_into(b"absent", target) is None
    counters = store.stats().counters
    assert counters["hits"] == 2 * len(expected)
    assert counters["misses"] == 2
    assert counters["bytes_read"] == 2 * sum(len(v) for v in expected.values())


def test_read_poll_us_must_not_be_negative(store_path: Path) -> None:
    with pytest.raises(ValueError, match="read_poll_us"):
        KVStore.open(store_path, create=True, read_poll_us=-1)


def test_interrupted_polled_get_leaves_the_next_reads_correct(
    open_store: OpenStore, io_uring_supported: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A get interrupted while its read is in flight abandons that read: later gets
    on the same thread must skip its completion and never reuse its buffer."""
    if not io_uring_supported:
        pytest.skip("io_uring is refused on this machine")
    store = open_store(io_engine="io_uring", read_poll_us=1000)
    store.put_many([(b"a", page(1)), (b"b", page(2))])
    store.flush()
    real_wait = UringQueue.wait
    calls = 0

    def interrupted_once(self: UringQueue, *args: Any, **kwargs: Any) -> list[tuple[int, int]]:
        nonlocal calls
        calls += 1
        if calls == 1:
            self.submit()  # the read is in the kernel's hands, then the caller is interrupted
            raise KeyboardInterrupt
        return real_wait(self, *args, **kwargs)

    monkeypatch.setattr(UringQueue, "wait", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        store.get(b"a")
    for _ in range(5):
        assert store.get(b"b") == page(2)
        assert store.get(b"a") == page(1)
    assert calls >= 11


def test_other_threads_keep_running_while_gets_poll(
    open_store: OpenStore, io_uring_supported: bool, direct_io_supported: bool
) -> None:
    """Polling yields the GIL between polls: a thread that needs the GIL for every
    iteration (time.sleep(0) releases it) keeps making progress during polled gets.
    Measured here: ~3 iterations per get while polling, ~4 when sleeping instead."""
    if not (io_uring_supported and direct_io_supported):
        pytest.skip("needs io_uring and O_DIRECT")
    store = open_store(io_engine="io_uring", direct_io=True, read_poll_us=1_000_000)
    keys = [f"k{i}".encode() for i in range(64)]
    store.put_many([(key, page(i, 256 * 1024 - 4096)) for i, key in enumerate(keys)])
    store.flush()
    done = threading.Event()
    counted = 0

    def count() -> None:
        nonlocal counted
        while not done.is_set():
            counted += 1
            time.sleep(0)

    counter = threading.Thread(target=count)
    counter.start()
    gets = 0
    try:
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline or gets < 200:
            assert store.get(keys[gets % len(keys)]) is not None
            gets += 1
    finally:
        done.set()
        counter.join(timeout=60)
    assert counted > gets, f"counter made {counted} iterations during {gets} polled gets"


def test_polled_get_does_not_leak_rings_or_descriptors(
    open_store: OpenStore, io_uring_supported: bool
) -> None:
    """One ``get`` ring per thread, closed with the store."""
    if not io_uring_supported:
        pytest.skip("io_uring is refused on this machine")
    store = open_store(io_engine="io_uring")
    store.put(b"a", page(1))
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        assert store.get(b"a") == page(1)
    threads = [threading.Thread(target=store.get, args=(b"a",)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    grown = len(os.listdir("/proc/self/fd")) - before
    assert grown <= 2 * 5  # a ring and an eventfd for this thread and each of 4 others
    store.close()
    assert len(os.listdir("/proc/self/fd")) <= before

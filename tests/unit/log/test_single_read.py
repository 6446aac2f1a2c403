"""The single-page read path of ``get``/``get_into``: polled io_uring or one preadv."""

from __future__ import annotations

import mmap
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvstore import CorruptionError, KVStore
from kvstore.format.constants import BLOCK_BYTES
from kvstore.format.names import segment_path
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
    """A get interrupted while its read is in flight first lets the read finish; if
    that wait is interrupted too, it abandons the read: later gets on the same
    thread must skip its completion and never reuse its buffer."""
    if not io_uring_supported:
        pytest.skip("io_uring is refused on this machine")
    store = open_store(io_engine="io_uring", read_poll_us=1000)
    store.put_many([(b"a", page(1)), (b"b", page(2))])
    store.flush()
    real_wait = UringQueue.wait
    calls = interrupts = 0

    def interrupted_once(self: UringQueue, *args: Any, **kwargs: Any) -> list[tuple[int, int]]:
        nonlocal calls
        calls += 1
        if calls <= interrupts:
            self.submit()  # the read is in the kernel's hands, then the caller is interrupted
            raise KeyboardInterrupt
        return real_wait(self, *args, **kwargs)

    assert store.get(b"a") == page(1)  # the pool now holds a buffer of this size
    monkeypatch.setattr(UringQueue, "wait", interrupted_once)
    for interrupts in (1, 2):  # the settling wait succeeds; then it is interrupted too
        calls = 0
        free_before = sum(len(free) for free in store.internals.buffers._free.values())
        with pytest.raises(KeyboardInterrupt):
            store.get(b"a")
        free_after = sum(len(free) for free in store.internals.buffers._free.values())
        # Settled: the buffer went back to the pool. Abandoned: it never does.
        assert free_after == free_before - (interrupts - 1)
        for _ in range(5):
            assert store.get(b"b") == page(2)
            assert store.get(b"a") == page(1)
        assert calls >= interrupts + 10


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
    # A ring and an eventfd for this thread and each of 4 others (the store's
    # background threads may hold a file or two open at any moment).
    assert grown <= 2 * 5 + 4
    store.close()
    assert len(os.listdir("/proc/self/fd")) <= before


# -- zero-copy reads into caller memory ---------------------------------------------


def aligned(size: int) -> memoryview:
    """Page-aligned, writable memory (what pinned host buffers look like)."""
    return memoryview(mmap.mmap(-1, size))


def unaligned(size: int) -> memoryview:
    """Writable memory 16 bytes past a page boundary: never read into directly."""
    return memoryview(mmap.mmap(-1, size + 4096))[16 : 16 + size]


def corrupt_payload(store: KVStore, store_path: Path, key: bytes, at: int) -> None:
    info = store.info(key)
    assert info is not None
    with open(segment_path(store_path, info.segment_id), "r+b") as handle:
        handle.seek(info.offset + BLOCK_BYTES + at)
        original = handle.read(1)
        handle.seek(info.offset + BLOCK_BYTES + at)
        handle.write(bytes([original[0] ^ 0xFF]))
        handle.flush()
        os.fsync(handle.fileno())


@pytest.mark.parametrize("read_poll_us", [0, 1000])
def test_get_into_reads_aligned_buffers_in_place(
    open_store: OpenStore,
    store_path: Path,
    engine_kind: str,
    read_poll_us: int,
    direct_io_supported: bool,
) -> None:
    """Proof that the payload went straight into the caller's memory: a corrupted
    page is still refused, and the caller's aligned buffer then holds the damaged
    bytes the device delivered, while an unaligned buffer (read through the pool,
    verified, then copied) is left untouched."""
    store = open_store(
        io_engine=engine_kind, read_poll_us=read_poll_us, direct_io=direct_io_supported
    )
    good, bad = page(1, 8 * 4096), page(2, 8 * 4096)
    store.put_many([(b"good", good), (b"bad", bad)])
    store.flush()
    target = aligned(16 * 4096)
    assert store.get_into(b"good", target) == len(good)
    assert bytes(target[: len(good)]) == good
    assert bytes(target[len(good) :]) == bytes(8 * 4096)  # nothing past the page written

    corrupt_payload(store, store_path, b"bad", 100)
    damaged = bytearray(bad)
    damaged[100] ^= 0xFF
    with pytest.raises(CorruptionError, match="payload checksum mismatch"):
        store.get_into(b"bad", target)
    assert bytes(target[: len(bad)]) == bytes(damaged)  # read in place, then refused

    elsewhere = unaligned(8 * 4096)
    elsewhere[:] = b"\x5a" * (8 * 4096)
    with pytest.raises(CorruptionError, match="payload checksum mismatch"):
        store.get_into(b"bad", elsewhere)
    assert bytes(elsewhere) == b"\x5a" * (8 * 4096)  # the copy path never copied it


def test_get_many_into_mixes_in_place_and_copied_pages(
    open_store: OpenStore, engine_kind: str
) -> None:
    store = open_store(io_engine=engine_kind)
    sizes = [8 * 4096, 8 * 4096 + 1, 4096, 5000, 16 * 4096]
    values = {f"k{i}".encode(): page(i, size) for i, size in enumerate(sizes)}
    store.put_many(list(values.items()))
    store.flush()
    for make in (aligned, unaligned):
        buffers = [make(16 * 4096) for _ in values]
        for buffer in buffers:
            buffer[:] = b"\x77" * buffer.nbytes
        assert store.get_many_into([*values, b"absent"], [*buffers, make(4096)]) == [
            *map(len, values.values()),
            None,
        ]
        for buffer, value in zip(buffers, values.values(), strict=True):
            assert bytes(buffer[: len(value)]) == value
            assert bytes(buffer[len(value) :]) == b"\x77" * (buffer.nbytes - len(value))
        # One page alone takes the single-read shortcut of the batch path.
        one = make(16 * 4096)
        assert store.get_many_into([b"k0"], [one]) == [sizes[0]]
        assert bytes(one[: sizes[0]]) == values[b"k0"]


def test_get_many_into_refuses_a_corrupt_page_read_in_place(
    open_store: OpenStore, store_path: Path
) -> None:
    store = open_store()
    values = {f"k{i}".encode(): page(i, 4 * 4096) for i in range(4)}
    store.put_many(list(values.items()))
    store.flush()
    corrupt_payload(store, store_path, b"k2", 7)
    buffers = [aligned(4 * 4096) for _ in values]
    with pytest.raises(CorruptionError, match="k2"):
        store.get_many_into(list(values), buffers)
    for index in (0, 1, 3):  # the other pages of the batch still landed and verified
        assert bytes(buffers[index]) == values[f"k{index}".encode()]


# -- coalesced writes (put_many) -------------------------------------------------------


def test_put_many_writes_back_to_back_records_together(
    open_store: OpenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """24 pages of 16 KiB (20 KiB records) go to disk as two writes of 12 records,
    each record where the page table says, and every page reads back whole."""
    store = open_store(io_engine="threadpool", segment_bytes=4 << 20)
    real_pwritev = os.pwritev
    writes: list[int] = []

    def counting(fd: int, buffers: Any, offset: int, *args: Any) -> int:
        written: int = real_pwritev(fd, buffers, offset, *args)
        if written >= 5 * 4096:  # segment writes only: WAL appends are smaller
            writes.append(written)
        return written

    monkeypatch.setattr(os, "pwritev", counting)
    values = {f"k{i:02d}".encode(): page(i, 16 * 1024) for i in range(24)}
    store.put_many(list(values.items()))
    monkeypatch.undo()
    assert writes == [12 * 20 * 1024, 12 * 20 * 1024]
    infos = [store.info(key) for key in values]
    offsets = [info.offset for info in infos if info is not None]
    assert offsets == [offsets[0] + i * 20 * 1024 for i in range(24)]
    store.flush()
    for key, value in values.items():
        assert store.get(key) == value
    store.close()
    reopened = open_store(create=False, io_engine="threadpool")
    assert reopened.get_many(list(values)) == list(values.values())

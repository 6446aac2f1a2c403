"""io/: both engines move aligned buffers at depth, report -errno, and never hold the GIL.

The GIL test is the reason the io_uring engine waits on an eventfd: while one
thread streams O_DIRECT writes, another Python thread must keep running.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.errors import IOFailure
from kvstore.io import make_engine, run_all
from kvstore.io.buffers import AlignedBuffer, BufferPool
from kvstore.io.engine import IOEngine
from kvstore.io.files import open_data_file, probe_direct_io, write_file_durably
from kvstore.io.threadpool import ThreadPoolEngine
from kvstore.io.uring import UringEngine

MIB = 1 << 20
CHUNK = 64 << 10


def address_of(buffer: AlignedBuffer) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer.view))


def pattern(index: int, size: int) -> bytes:
    """Content that differs for every request ``index``, so misplaced data shows."""
    block = bytes((index * 31 + i) % 251 for i in range(4096))
    return (block * (size // 4096 + 1))[:size]


@pytest.fixture
def engine(engine_kind: str) -> Iterator[IOEngine]:
    made = make_engine(engine_kind, depth=8)
    yield made
    made.close()


@pytest.fixture
def data_fd(tmp_path: Path, direct_io_supported: bool) -> Iterator[int]:
    """A preallocated file, opened with O_DIRECT where the file system allows it."""
    fd = open_data_file(tmp_path / "data", direct=direct_io_supported, create=True)
    os.posix_fallocate(fd, 0, 16 * MIB)
    yield fd
    os.close(fd)


# -- buffers --------------------------------------------------------------------


@pytest.mark.parametrize(("size", "capacity"), [(1, 8192), (8192, 8192), (8193, 16384)])
def test_aligned_buffers_are_page_aligned_power_of_two_classes(size: int, capacity: int) -> None:
    pool = BufferPool()
    buffer = pool.acquire(size)
    assert buffer.capacity == capacity
    assert len(buffer.view) == capacity
    assert address_of(buffer) % 4096 == 0


def test_buffer_pool_reuses_released_buffers_by_size_class() -> None:
    pool = BufferPool(max_free_per_class=1)
    first = pool.acquire(10_000)
    pool.release(first)
    assert pool.acquire(12_000) is first  # same 16 KiB class
    assert pool.acquire(12_000) is not first  # the free list is empty again
    second, third = pool.acquire(5000), pool.acquire(5000)
    pool.release(second)
    pool.release(third)  # over max_free_per_class: dropped
    assert pool.acquire(5000) is second
    assert pool.acquire(5000) is not third


# -- engines ----------------------------------------------------------------------


def test_make_engine_kinds(io_uring_supported: bool) -> None:
    pool = make_engine("threadpool", depth=3)
    assert isinstance(pool, ThreadPoolEngine)
    assert (pool.name, pool.depth) == ("threadpool", 3)
    pool.close()
    auto = make_engine("auto")
    assert auto.name == ("io_uring" if io_uring_supported else "threadpool")
    auto.close()
    with pytest.raises(ValueError, match="io_engine must be"):
        make_engine("spdk")


def test_each_thread_gets_its_own_queue(engine: IOEngine) -> None:
    mine = engine.queue()
    assert engine.queue() is mine
    theirs: list[object] = []
    thread = threading.Thread(target=lambda: theirs.append(engine.queue()))
    thread.start()
    thread.join()
    assert theirs[0] is not mine


def test_write_then_read_back_at_depth(engine: IOEngine, data_fd: int) -> None:
    queue = engine.queue()
    count = 8
    sources = []
    for index in range(count):
        buffer = AlignedBuffer(CHUNK)
        buffer.view[:] = pattern(index, CHUNK)
        sources.append(buffer)
        queue.write(data_fd, index * CHUNK, buffer.view, 100 + index)
    assert queue.in_flight == count
    queue.submit()
    completions: list[tuple[int, int]] = []
    while queue.in_flight:
        completions.extend(queue.wait(queue.in_flight))
    assert sorted(completions) == [(100 + index, CHUNK) for index in range(count)]

    targets = [AlignedBuffer(CHUNK) for _ in range(count)]
    requests = [
        ("r", data_fd, index * CHUNK, targets[index].view) for index in reversed(range(count))
    ]
    assert run_all(queue, requests) == [CHUNK] * count
    for index in range(count):
        assert bytes(targets[index].view) == pattern(index, CHUNK), index
    assert queue.in_flight == 0


def test_a_gather_as_long_as_the_engine_says_it_takes(engine: IOEngine, data_fd: int) -> None:
    """``max_iovecs`` is what the engine takes, not what the system allows: the liburing
    2024 binding's iovec refused more than 60 buffers (its ``SC_IOV_MAX`` is the sysconf
    name, not the limit), and a writer that gathered 62 raised OverflowError."""
    assert 16 <= engine.max_iovecs <= 1024
    count = engine.max_iovecs
    sources = []
    for index in range(count):
        buffer = AlignedBuffer(4096)
        buffer.view[:] = pattern(index, 4096)
        sources.append(buffer)
    queue = engine.queue()
    queue.writev(data_fd, 0, [b.view for b in sources], 1)
    queue.submit()
    assert queue.wait(1) == [(1, count * 4096)]
    targets = [AlignedBuffer(4096) for _ in range(count)]
    queue.readv(data_fd, 0, [t.view for t in targets], 2)
    queue.submit()
    assert queue.wait(1) == [(2, count * 4096)]
    assert all(bytes(t.view) == pattern(i, 4096) for i, t in enumerate(targets))


def test_the_iovec_limit_is_found_by_asking() -> None:
    from kvstore.io.bindings import _iovec_limit

    def refuses_over(limit: int) -> Any:
        def make(buffers: list[bytes]) -> int:
            if len(buffers) > limit:
                raise OverflowError(f"{len(buffers)} > {limit}")
            return len(buffers)

        return make

    assert _iovec_limit(refuses_over(60), 1024) == 60
    assert _iovec_limit(refuses_over(5000), 1024) == 1024
    assert _iovec_limit(refuses_over(1), 1024) == 1
    assert _iovec_limit(refuses_over(0), 1024) == 1  # never below one buffer


def test_more_requests_than_the_queue_depth(engine: IOEngine, data_fd: int) -> None:
    """5x the ring size in one batch: early completions are parked, none are lost."""
    queue = engine.queue()
    count = 40
    buffers = [AlignedBuffer(4096) for _ in range(count)]
    for index, buffer in enumerate(buffers):
        buffer.view[:] = pattern(index, 4096)
    writes = [("w", data_fd, index * 4096, buffers[index].view) for index in range(count)]
    assert run_all(queue, writes) == [4096] * count
    back = [AlignedBuffer(4096) for _ in range(count)]
    reads = [("r", data_fd, index * 4096, back[index].view) for index in range(count)]
    assert run_all(queue, reads) == [4096] * count
    assert [bytes(b.view) for b in back] == [pattern(i, 4096) for i in range(count)]


def test_wait_for_one_returns_at_least_one(engine: IOEngine, data_fd: int) -> None:
    queue = engine.queue()
    buffers = [AlignedBuffer(4096) for _ in range(4)]
    for index, buffer in enumerate(buffers):
        queue.write(data_fd, index * 4096, buffer.view, index)
    queue.submit()
    first = queue.wait(1)
    assert 1 <= len(first) <= 4
    assert queue.in_flight == 4 - len(first)
    rest = queue.wait(queue.in_flight) if queue.in_flight else []
    assert sorted(token for token, _ in first + rest) == [0, 1, 2, 3]
    assert queue.in_flight == 0
    assert queue.wait(1) == []  # nothing in flight: returns at once


def test_bad_fd_gives_negative_errno_not_an_exception(engine: IOEngine, tmp_path: Path) -> None:
    queue = engine.queue()  # first, so its ring and eventfd cannot reuse the closed number
    closed_fd = os.open(tmp_path / "gone", os.O_RDWR | os.O_CREAT, 0o600)
    os.close(closed_fd)
    buffer = AlignedBuffer(4096)
    requests = [("r", closed_fd, 0, buffer.view), ("w", closed_fd, 0, buffer.view)]
    requests.append(("r", 1_000_000, 0, buffer.view))
    assert run_all(queue, requests) == [-errno.EBADF] * 3


def test_read_past_end_of_file_returns_zero_bytes(engine: IOEngine, tmp_path: Path) -> None:
    fd = os.open(tmp_path / "empty", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        buffer = AlignedBuffer(4096)
        assert run_all(engine.queue(), [("r", fd, 0, buffer.view)]) == [0]
    finally:
        os.close(fd)


def test_unaligned_direct_write_reports_einval(
    engine: IOEngine, data_fd: int, direct_io_supported: bool
) -> None:
    if not direct_io_supported:
        pytest.skip("O_DIRECT is not supported here")
    buffer = AlignedBuffer(8192)
    results = run_all(engine.queue(), [("w", data_fd, 100, buffer.view[:4096])])
    assert results == [-errno.EINVAL]


def test_io_uring_wait_releases_the_gil(
    tmp_path: Path, io_uring_supported: bool, direct_io_supported: bool
) -> None:
    """Another thread keeps running while one streams O_DIRECT 1 MiB writes.

    The counter yields the GIL every iteration (time.sleep(0)), so it runs
    only when the writer does not hold the GIL. If the engine waited inside
    the liburing binding (which holds the GIL), the counter would get about
    one iteration per wait; it gets thousands when the wait is os.read on the
    eventfd. Both figures were measured: ~0.4 vs ~25 iterations per wait.
    """
    if not (io_uring_supported and direct_io_supported):
        pytest.skip("needs io_uring and O_DIRECT")
    depth = 8
    fd = open_data_file(tmp_path / "stream", direct=True, create=True)
    os.posix_fallocate(fd, 0, depth * MIB)
    engine = UringEngine(depth)
    buffers = [AlignedBuffer(MIB) for _ in range(depth)]
    for index, buffer in enumerate(buffers):
        buffer.view[:] = pattern(index, MIB)
    done = threading.Event()
    counted = 0
    waits = 0
    failures: list[object] = []

    def count() -> None:
        nonlocal counted
        while not done.is_set():
            counted += 1
            time.sleep(0)

    def write() -> None:
        nonlocal waits
        try:
            queue = engine.queue()
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline or waits < 50:
                for index, buffer in enumerate(buffers):
                    queue.write(fd, index * MIB, buffer.view, index)
                queue.submit()
                while queue.in_flight:
                    for token, result in queue.wait(queue.in_flight):
                        if result != MIB:
                            failures.append((token, result))
                    waits += 1
        finally:
            done.set()

    counter = threading.Thread(target=count)
    writer = threading.Thread(target=write)
    try:
        counter.start()
        writer.start()
        writer.join(timeout=60)
        counter.join(timeout=60)
    finally:
        done.set()
        engine.close()
        os.close(fd)
    assert failures == []
    assert waits >= 50
    assert counted > 1000, f"counter made {counted} iterations during {waits} waits"
    assert counted > 5 * waits, f"counter made {counted} iterations during {waits} waits"


# -- files ------------------------------------------------------------------------


def test_write_file_durably_replaces_atomically_with_owner_only_mode(tmp_path: Path) -> None:
    target = tmp_path / "KVSTORE"
    write_file_durably(target, b"first")
    write_file_durably(target, b"second version")
    assert target.read_bytes() == b"second version"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["KVSTORE"]


def test_write_file_durably_into_missing_directory_is_io_failure(tmp_path: Path) -> None:
    with pytest.raises(IOFailure) as caught:
        write_file_durably(tmp_path / "missing" / "file", b"x")
    assert caught.value.errno == errno.ENOENT


def test_open_data_file(tmp_path: Path) -> None:
    path = tmp_path / "segment"
    fd = open_data_file(path, direct=False, create=True)
    os.close(fd)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with pytest.raises(IOFailure) as caught:
        open_data_file(path, direct=False, create=True)  # O_EXCL: never reuse a file
    assert caught.value.errno == errno.EEXIST
    with pytest.raises(IOFailure) as caught:
        open_data_file(tmp_path / "absent", direct=False)
    assert caught.value.errno == errno.ENOENT
    assert "ENOENT" in str(caught.value)


def test_probe_direct_io_leaves_nothing_behind(tmp_path: Path) -> None:
    assert isinstance(probe_direct_io(tmp_path), bool)
    assert list(tmp_path.iterdir()) == []

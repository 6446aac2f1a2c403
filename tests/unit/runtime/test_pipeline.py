"""Zero-copy writes and pipelined batches (docs/design.md, "Write path" and
"Pipelined batches"), on both I/O engines."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore import KVStore
from kvstore.errors import ClosedError, WriterFailedError
from kvstore.runtime import writer as writer_module
from kvstore.runtime.writer import ZERO_COPY_MIN_BYTES, Turn, in_place


def _aligned(data: bytes, *, offset: int = 0) -> memoryview:
    """``data`` in writable mmap memory starting ``offset`` bytes past a 4 KiB boundary."""
    region = mmap.mmap(-1, len(data) + offset + (-(len(data) + offset) % 4096))
    region[offset : offset + len(data)] = data
    return memoryview(region)[offset : offset + len(data)]


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _open(path: Path, engine: str, **options: Any) -> KVStore:
    return KVStore.open(path, create=True, segment_bytes=16 << 20, io_engine=engine, **options)


class _GatherSpy:
    """Records the addresses of every caller-memory piece each write gathers."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.pieces: list[tuple[int, int]] = []
        real = writer_module._PendingWrite.views

        def views(write: Any) -> list[memoryview]:
            got = real(write)
            for piece in write.pieces:
                if isinstance(piece, memoryview):
                    self.pieces.append((_address(piece), piece.nbytes))
            return got

        monkeypatch.setattr(writer_module._PendingWrite, "views", views)


def test_which_payloads_are_written_in_place() -> None:
    page = os.urandom(64 << 10)
    assert in_place(_aligned(page))
    assert not in_place(_aligned(page, offset=512))  # not 4 KiB aligned
    assert not in_place(_aligned(page).toreadonly())  # read-only memory is copied
    assert not in_place(memoryview(page))  # bytes: never aligned, read-only
    assert not in_place(_aligned(page[: ZERO_COPY_MIN_BYTES - 4096]))  # small: copied
    assert in_place(_aligned(os.urandom(ZERO_COPY_MIN_BYTES + 1)))  # any length above


@pytest.mark.parametrize(
    "size", [16 << 10, 256 << 10, (1 << 20) + 100, (64 << 10) + 1, (256 << 10) - 7]
)
def test_aligned_pages_are_written_straight_from_the_caller(
    tmp_path: Path, engine_kind: str, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = _GatherSpy(monkeypatch)
    data = os.urandom(size)
    view = _aligned(data)
    with _open(tmp_path / "s", engine_kind) as store:
        store.put_many([(b"k", view, {"n": 1})], sync=True)
        whole = size - size % 4096
        assert spy.pieces == [(_address(view), whole)]  # the payload, not a copy of it
        assert store.get(b"k") == data
        assert store.check(deep=True) == []
    with KVStore.open(tmp_path / "s", io_engine=engine_kind) as store:
        assert store.get(b"k") == data  # the padding after a partial block reads as a page
        assert store.check(deep=True) == []


@pytest.mark.parametrize("size", [16 << 10, (20 << 10) + 3, 24 << 10])
def test_a_batch_of_small_aligned_pages_gathers_within_the_engines_limit(
    tmp_path: Path, engine_kind: str, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """64 small pages in place fill a gathered write with two or three pieces each; with
    the liburing 2024 binding (its iovec takes 60 buffers) put_many raised OverflowError
    for 16-24 KiB pages until the writer kept to the engine's ``max_iovecs``."""
    spy = _GatherSpy(monkeypatch)
    pieces_per_write: list[int] = []
    real = writer_module._PendingWrite.views

    def views(write: Any) -> list[memoryview]:
        got = real(write)
        pieces_per_write.append(len(got))
        return got

    monkeypatch.setattr(writer_module._PendingWrite, "views", views)
    data = [os.urandom(size) for _ in range(64)]
    with _open(tmp_path / "s", engine_kind) as store:
        store.put_many([(b"k%d" % i, _aligned(d)) for i, d in enumerate(data)], sync=True)
        assert len(spy.pieces) == 64  # every payload went in place
        assert max(pieces_per_write) <= store.internals.engine.max_iovecs
        assert store.get_many([b"k%d" % i for i in range(64)]) == data
    with KVStore.open(tmp_path / "s", io_engine=engine_kind) as store:
        assert store.get_many([b"k%d" % i for i in range(64)]) == data
        assert store.check(deep=True) == []


def test_a_batch_mixing_in_place_and_copied_pages_reads_back(
    tmp_path: Path, engine_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small copied pages coalesce around gathered ones; every record lands where the
    index says, whatever mix of pieces its write had."""
    spy = _GatherSpy(monkeypatch)
    sizes = [4096, 300, 64 << 10, 20_000, 8192, (128 << 10) + 5, 1, 256 << 10, 5000]
    values: list[tuple[bytes, bytes | memoryview]] = []
    for i, size in enumerate(sizes * 3):
        data = os.urandom(size)
        values.append((data, _aligned(data) if i % 2 else data))
    with _open(tmp_path / "s", engine_kind) as store:
        store.put_many([(b"k%d" % i, value) for i, (_, value) in enumerate(values)])
        store.flush()
        assert spy.pieces, "no page was written in place"
        got = store.get_many([b"k%d" % i for i in range(len(values))])
        assert got == [data for data, _ in values]
        assert store.check(deep=True) == []
    with KVStore.open(tmp_path / "s", io_engine=engine_kind) as store:
        assert store.get_many([b"k%d" % i for i in range(len(values))]) == [d for d, _ in values]


def test_numpy_and_mmap_pages_round_trip_through_get_many_into(
    tmp_path: Path, engine_kind: str
) -> None:
    """The tier manager's shapes: numpy views of one aligned arena, out and back in."""
    slot = 256 << 10
    arena = np.frombuffer(mmap.mmap(-1, 8 * slot), dtype=np.uint8)
    rng = np.random.default_rng(1)
    arena[:] = rng.integers(0, 256, arena.size, dtype=np.uint8)
    slots = [arena[i * slot : (i + 1) * slot] for i in range(8)]
    keys = [b"slot%d" % i for i in range(8)]
    with _open(tmp_path / "s", engine_kind) as store:
        assert store.put_many(list(zip(keys, slots, strict=True)), sync=True) == [True] * 8
        back = np.frombuffer(mmap.mmap(-1, 8 * slot), dtype=np.uint8)
        dsts = [back[i * slot : (i + 1) * slot] for i in range(8)]
        assert store.get_many_into(keys, dsts) == [slot] * 8
        assert np.array_equal(back, arena)


def test_put_many_async_returns_a_future_and_stores_the_batch(
    tmp_path: Path, engine_kind: str
) -> None:
    pages = [os.urandom(64 << 10) for _ in range(8)]
    with _open(tmp_path / "s", engine_kind) as store:
        futures = [
            store.put_many_async([(b"b%d/%d" % (b, i), _aligned(p)) for i, p in enumerate(pages)])
            for b in range(4)
        ]
        assert all(isinstance(f, Future) for f in futures)
        assert [f.result(timeout=30) for f in futures] == [[True] * 8] * 4
        for b in range(4):
            assert store.get_many([b"b%d/%d" % (b, i) for i in range(8)]) == pages
        done = store.put_many_async([(b"s", pages[0])], sync=True)
        assert done.result(timeout=30) == [True]
    with KVStore.open(tmp_path / "s", io_engine=engine_kind) as store:
        assert store.get(b"s") == pages[0]


def test_a_bad_item_raises_at_submission_and_stores_nothing(tmp_path: Path) -> None:
    with _open(tmp_path / "s", "threadpool") as store:
        with pytest.raises(TypeError):
            store.put_many_async([(b"a", b"x"), (b"b", 42)])
        with pytest.raises(ValueError):
            store.put_many_async([(b"a", b"x"), (b"", b"y")])
        assert store.put_many_async([(b"c", b"z")]).result(timeout=30) == [True]
        assert b"a" not in store and store.get(b"c") == b"z"


def test_later_batches_win_whatever_the_pipeline_threads_do(
    tmp_path: Path, engine_kind: str
) -> None:
    """Batches reserve in submission order: the last batch holding a key wins."""
    with _open(tmp_path / "s", engine_kind, pipeline_depth=4) as store:
        futures = []
        for version in range(40):
            futures.append(
                store.put_many_async(
                    [(b"k%d" % i, b"v%03d" % version + os.urandom(20_000)) for i in range(5)]
                )
            )
        for future in futures:
            future.result(timeout=60)
        for i in range(5):
            got = store.get(b"k%d" % i)
            assert got is not None and got[:4] == b"v039"


def test_turn_passes_in_ticket_order_and_a_skipped_ticket_does_not_block() -> None:
    turn = Turn()
    order: list[int] = []
    tickets = [turn.ticket() for _ in range(4)]

    def run(ticket: int) -> None:
        turn.wait(ticket)
        order.append(ticket)
        turn.done(ticket)

    threads = [threading.Thread(target=run, args=(t,)) for t in reversed(tickets)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert order == tickets
    turn.done(tickets[-1])  # twice: no effect
    late = turn.ticket()
    turn.wait(late)  # its turn at once


def test_a_failed_batch_passes_its_turn_and_the_next_ones_fail_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write error stops the writer; the batches queued behind it raise
    WriterFailedError instead of waiting for a turn forever."""
    from kvstore.io import threadpool

    def failing(fd: int, buffers: list[memoryview], offset: int) -> int:
        return -5  # EIO

    with _open(tmp_path / "s", "threadpool") as store:
        monkeypatch.setattr(threadpool, "_pwritev", failing)
        futures = [store.put_many_async([(b"k%d" % i, b"x" * 5000)]) for i in range(6)]
        for future in futures:
            with pytest.raises(WriterFailedError):
                future.result(timeout=30)


def test_close_waits_for_batches_in_flight(tmp_path: Path, engine_kind: str) -> None:
    page = os.urandom(256 << 10)
    store = _open(tmp_path / "s", engine_kind)
    futures = [store.put_many_async([(b"k%d" % i, _aligned(page))]) for i in range(12)]
    store.close()
    assert all(f.done() and f.result() == [True] for f in futures)
    with pytest.raises(ClosedError):
        store.put_many_async([(b"late", page)])
    with KVStore.open(tmp_path / "s", io_engine=engine_kind) as store:
        assert all(store.get(b"k%d" % i) == page for i in range(12))


def test_get_many_async_and_get_many_into_async(tmp_path: Path, engine_kind: str) -> None:
    pages = [os.urandom(256 << 10) for _ in range(6)]
    keys = [b"k%d" % i for i in range(6)]
    with _open(tmp_path / "s", engine_kind) as store:
        store.put_many(list(zip(keys, pages, strict=True)), sync=True)
        assert store.get_many_async([*keys, b"missing"]).result(timeout=30) == [*pages, None]
        targets = [_aligned(bytes(256 << 10)) for _ in range(6)]
        futures = [store.get_many_into_async(keys, targets) for _ in range(3)]
        assert [f.result(timeout=30) for f in futures] == [[256 << 10] * 6] * 3
        assert [bytes(t) for t in targets] == pages
        with pytest.raises(ValueError):
            store.get_many_into_async(keys, targets[:2])
        with pytest.raises(TypeError):
            store.get_many_into_async(keys[:1], [b"read-only"])


def test_a_torch_arena_slot_is_written_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tier manager hands ``slot.numpy()`` of its 4 KiB-aligned arena to put_many:
    written straight from the slot."""
    torch = pytest.importorskip("torch")
    backing = torch.empty(3 * (64 << 10) + 4096, dtype=torch.uint8)
    start = -backing.data_ptr() % 4096
    arena = backing[start : start + 3 * (64 << 10)]
    arena.copy_(torch.randint(0, 256, (arena.numel(),), dtype=torch.uint8))
    slots = [arena[i * (64 << 10) : (i + 1) * (64 << 10)] for i in range(3)]
    spy = _GatherSpy(monkeypatch)
    with _open(tmp_path / "s", "threadpool") as store:
        store.put_many([(b"s%d" % i, slot.numpy(), None) for i, slot in enumerate(slots)])
        assert sorted(address for address, _ in spy.pieces) == [s.data_ptr() for s in slots]
        for i, slot in enumerate(slots):
            assert store.get(b"s%d" % i) == bytes(slot.numpy())

"""tiering/mover.py: CPUMover (threads, priorities, NVMe through a real store),
FakeMover (exact virtual-time schedule), VirtualClock, make_mover; CUDAMover where CUDA is."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path as FsPath
from typing import Any

import numpy as np
import pytest
import torch

from kvstore import ClosedError, KVStore
from kvstore.testing.faults import FaultInjector
from kvstore.tiering.arena import Arena
from kvstore.tiering.fake_mover import FakeMover, VirtualClock
from kvstore.tiering.mover import (
    CPUMover,
    CUDAMover,
    Mover,
    Path,
    Priority,
    Ticket,
    make_mover,
)

OpenStore = Callable[..., KVStore]
WAIT_S = 10.0


@pytest.fixture
def mover() -> Iterator[CPUMover]:
    moving = CPUMover()
    yield moving
    moving.close()


def random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    generator = np.random.default_rng(seed)
    return torch.from_numpy(generator.integers(0, 256, nbytes, dtype=np.uint8))


class Blocker:
    """A stand-in for a CUDA event: ``synchronize()`` blocks the copy thread until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def synchronize(self) -> None:
        self.entered.set()
        if not self.release.wait(WAIT_S):
            raise TimeoutError("the test never released the blocker")


def block_copy_thread(mover: Mover) -> tuple[Blocker, Ticket]:
    """Occupy the copy thread with a job waiting on a Blocker; returns once it runs."""
    blocker = Blocker()
    src = torch.zeros(16, dtype=torch.uint8)
    dst = torch.empty(16, dtype=torch.uint8)
    ticket = mover.copy(Path.H2H, [(src, dst)], priority=Priority.BACKGROUND, wait_event=blocker)
    assert blocker.entered.wait(WAIT_S)
    return blocker, ticket


def drain(mover: Mover, count: int) -> list[Ticket]:
    """Poll until ``count`` tickets came back (each poll returns only new ones)."""
    seen: list[Ticket] = []
    deadline = time.monotonic() + WAIT_S
    while len(seen) < count and time.monotonic() < deadline:
        seen.extend(mover.poll())
        time.sleep(0.001)
    return seen


# -- CPUMover: copies ------------------------------------------------------------


def test_copies_bytes_exactly_into_arena_slots(mover: CPUMover) -> None:
    arena = Arena(4 * 8192, 8192, "cpu")
    sentinel = 0xA5
    arena.buffer().fill_(sentinel)
    sources = [random_bytes(size, seed) for seed, size in enumerate((8192, 5000, 1, 4097))]
    pairs = [(src, arena.view(slot)) for slot, src in enumerate(sources)]
    ticket = mover.copy(Path.D2H, pairs, priority=Priority.DEMAND, tag="mine")
    assert ticket.wait(WAIT_S)
    assert ticket.done() and ticket.error is None
    assert ticket.path is Path.D2H and ticket.tag == "mine" and ticket.results is None
    assert ticket.nbytes == ticket.moved_bytes == 8192 + 5000 + 1 + 4097
    for slot, src in enumerate(sources):
        view = arena.view(slot)
        assert torch.equal(view[: src.numel()], src)
        assert bool((view[src.numel() :] == sentinel).all())  # nothing past the source
    seconds = ticket.seconds()
    assert seconds is not None and seconds >= 0
    assert ticket.submitted_s <= ticket.started_s <= ticket.finished_s  # type: ignore[operator]
    assert mover.poll() == [ticket]
    assert mover.poll() == []
    assert mover.in_flight_bytes() == 0


def test_copy_of_whole_mebibyte_pages(mover: CPUMover) -> None:
    arena = Arena(8 << 20, 1 << 20, "cpu")
    sources = [random_bytes(1 << 20, 100 + index) for index in range(8)]
    ticket = mover.copy(
        Path.H2D,
        [(src, arena.view(index)) for index, src in enumerate(sources)],
        priority=Priority.PREFETCH,
    )
    assert ticket.wait(WAIT_S) and ticket.error is None
    assert torch.equal(arena.buffer(), torch.cat(sources))


def test_bad_copies_are_refused_at_submit(mover: CPUMover) -> None:
    small = torch.zeros(10, dtype=torch.uint8)
    large = torch.zeros(20, dtype=torch.uint8)
    with pytest.raises(ValueError, match="holds 10"):
        mover.copy(Path.D2H, [(large, small)], priority=Priority.DEMAND)
    with pytest.raises(ValueError, match="dtypes differ"):
        mover.copy(Path.D2H, [(small, large.view(torch.int16))], priority=Priority.DEMAND)
    with pytest.raises(ValueError, match="1-D"):
        mover.copy(Path.D2H, [(large.view(2, 10), large)], priority=Priority.DEMAND)
    with pytest.raises(ValueError, match="not a copy path"):
        mover.copy(Path.NVME_READ, [(small, large)], priority=Priority.DEMAND)
    with pytest.raises(ValueError, match="FakeMover"):
        mover.copy(Path.D2H, [], priority=Priority.DEMAND, nbytes=5)
    assert mover.in_flight_bytes() == 0
    assert mover.poll() == []


def test_demand_runs_before_writeback_queued_earlier(mover: CPUMover) -> None:
    blocker, first = block_copy_thread(mover)
    order: list[str] = []

    class Mark:
        def __init__(self, name: str) -> None:
            self.name = name

        def synchronize(self) -> None:
            order.append(self.name)

    def job(name: str, priority: Priority) -> Ticket:
        src = random_bytes(4096, len(order))
        dst = torch.empty(4096, dtype=torch.uint8)
        return mover.copy(
            Path.D2H, [(src, dst)], priority=priority, tag=name, wait_event=Mark(name)
        )

    tickets = [
        job("writeback-1", Priority.WRITEBACK),
        job("background", Priority.BACKGROUND),
        job("writeback-2", Priority.WRITEBACK),
        job("prefetch", Priority.PREFETCH),
        job("demand", Priority.DEMAND),
    ]
    assert not tickets[-1].wait(0.05)  # the copy thread is still held
    assert mover.in_flight_bytes(Path.D2H) == 5 * 4096
    assert mover.in_flight_bytes() == 5 * 4096 + 16
    blocker.release.set()
    completed = drain(mover, 6)
    assert order == ["demand", "prefetch", "writeback-1", "writeback-2", "background"]
    assert [t.tag for t in completed] == [None, *order]  # poll: completion order
    assert completed[0] is first
    assert all(t.error is None for t in completed)
    assert mover.in_flight_bytes() == 0


def test_a_failing_job_sets_error_and_the_thread_lives_on(mover: CPUMover) -> None:
    class Broken:
        def synchronize(self) -> None:
            raise RuntimeError("producer stream failed")

    dst = torch.zeros(8, dtype=torch.uint8)
    failed = mover.copy(
        Path.D2H,
        [(torch.ones(8, dtype=torch.uint8), dst)],
        priority=Priority.DEMAND,
        wait_event=Broken(),
    )
    assert failed.wait(WAIT_S)
    assert isinstance(failed.error, RuntimeError)
    assert failed.moved_bytes == 0
    assert bool((dst == 0).all())  # the copy never ran
    src = random_bytes(8, 7)
    ticket = mover.copy(Path.D2H, [(src, dst)], priority=Priority.DEMAND)
    assert ticket.wait(WAIT_S) and ticket.error is None
    assert torch.equal(dst, src)
    assert mover.poll() == [failed, ticket]


def test_wait_times_out_while_blocked(mover: CPUMover) -> None:
    blocker, first = block_copy_thread(mover)
    started = time.monotonic()
    assert first.wait(0.05) is False
    assert time.monotonic() - started >= 0.04
    assert not first.done()
    assert first.seconds() is None
    blocker.release.set()
    assert first.wait(WAIT_S) is True


def test_worker_threads_are_named_daemons(mover: CPUMover) -> None:
    names = {thread.name: thread.daemon for thread in threading.enumerate()}
    assert names.get("kvstore-tier-copy") is True
    assert names.get("kvstore-tier-io") is True


# -- CPUMover: close ---------------------------------------------------------------


def test_close_finishes_queued_work_joins_and_is_idempotent() -> None:
    mover = CPUMover()
    blocker, first = block_copy_thread(mover)
    src = random_bytes(4096, 3)
    dst = torch.zeros(4096, dtype=torch.uint8)
    queued = mover.copy(Path.D2H, [(src, dst)], priority=Priority.WRITEBACK)
    threading.Timer(0.05, blocker.release.set).start()
    mover.close()
    assert first.done() and queued.done() and queued.error is None
    assert torch.equal(dst, src)
    assert not mover._copy_queue._thread.is_alive()
    assert not mover._io_queue._thread.is_alive()
    mover.close()
    assert mover.poll() == [first, queued]
    with pytest.raises(ClosedError):
        mover.copy(Path.D2H, [(src, dst)], priority=Priority.DEMAND)
    assert mover.in_flight_bytes() == 0


def test_close_with_cancel_fails_jobs_not_started() -> None:
    mover = CPUMover()
    blocker, first = block_copy_thread(mover)
    dst = torch.zeros(4096, dtype=torch.uint8)
    queued = mover.copy(
        Path.D2H, [(random_bytes(4096, 4), dst)], priority=Priority.DEMAND, tag="queued"
    )
    closer = threading.Thread(target=lambda: mover.close(cancel=True))
    closer.start()
    deadline = time.monotonic() + WAIT_S
    while not mover._copy_queue._closed and time.monotonic() < deadline:
        time.sleep(0.001)
    blocker.release.set()
    closer.join(WAIT_S)
    assert not closer.is_alive()
    assert first.error is None
    assert isinstance(queued.error, ClosedError)
    assert bool((dst == 0).all())
    assert mover.poll() == [first, queued]
    assert mover.in_flight_bytes() == 0


# -- CPUMover: NVMe through a real store -------------------------------------------------


def test_nvme_write_then_read_round_trip(mover: CPUMover, open_store: OpenStore) -> None:
    store = open_store()
    arena = Arena(4 * 8192, 8192, "cpu")
    pages = [random_bytes(size, 50 + index) for index, size in enumerate((8192, 3000, 4096))]
    for slot, page in enumerate(pages):
        arena.view(slot, page.numel()).copy_(page)
    items = [
        (b"page-%d" % slot, arena.view(slot, page.numel()), {"parent": slot - 1})
        for slot, page in enumerate(pages)
    ]
    write = mover.nvme_write(store, items, priority=Priority.WRITEBACK, tag="w")
    assert write.path is Path.NVME_WRITE and write.nbytes == 8192 + 3000 + 4096
    assert write.wait(WAIT_S) and write.error is None
    assert write.results == [8192, 3000, 4096]
    assert write.moved_bytes == write.nbytes
    info = store.info(b"page-1")
    assert info is not None and dict(info.meta) == {"parent": 0}

    arena.buffer().zero_()
    keys = [b"page-2", b"missing", b"page-0", b"page-1"]
    dsts = [arena.view(0, 4096), arena.view(1), arena.view(2), arena.view(3, 3000)]
    read = mover.nvme_read(store, keys, dsts, priority=Priority.DEMAND, tag="r")
    assert read.wait(WAIT_S) and read.error is None
    assert read.results == [4096, None, 8192, 3000]
    assert read.moved_bytes == 4096 + 8192 + 3000
    assert read.nbytes == 4096 + 8192 + 8192 + 3000
    assert torch.equal(arena.view(0, 4096), pages[2])
    assert bool((arena.view(1) == 0).all())  # a miss writes nothing
    assert torch.equal(arena.view(2), pages[0])
    assert torch.equal(arena.view(3, 3000), pages[1])
    assert drain(mover, 2) == [write, read]
    assert mover.in_flight_bytes() == 0


def test_injected_read_eio_reports_each_failing_page_missing(
    mover: CPUMover, store_path: FsPath, open_store: OpenStore
) -> None:
    store = open_store(io_engine="threadpool")
    store.put_many([(b"a", bytes(range(256)) * 16), (b"b", b"\x07" * 5000)])
    store.close()
    injector = FaultInjector(
        store_path,
        0,
        persistent=True,
        only=lambda call, rel: call in ("pread", "preadv") and rel.startswith("segments"),
    )
    arena = Arena(2 * 8192, 8192, "cpu")
    with injector.installed():
        store = open_store(io_engine="threadpool")  # opened under the injector: its fds are known
        injector.fail_at = injector.count + 1
        read = mover.nvme_read(
            store, [b"a", b"b"], [arena.view(0), arena.view(1)], priority=Priority.DEMAND
        )
        assert read.wait(WAIT_S)
        injector.armed = False
    # The batch read failed, then each page was read alone: each failed too (the
    # fault is persistent), so each is reported missing, none raised for the ticket.
    assert read.error is None
    assert read.results == [None, None]
    assert read.moved_bytes == 0
    assert injector.failed  # the fault did fire
    again = mover.nvme_read(store, [b"a"], [arena.view(0)], priority=Priority.DEMAND)
    assert again.wait(WAIT_S) and again.error is None and again.results == [4096]


def test_a_write_error_is_reported_not_raised(mover: CPUMover, open_store: OpenStore) -> None:
    store = open_store()  # max_page_bytes 256 KiB: a larger page is refused by put_many
    big = torch.zeros(300 << 10, dtype=torch.uint8)
    ticket = mover.nvme_write(store, [(b"big", big, None)], priority=Priority.WRITEBACK)
    assert ticket.wait(WAIT_S)
    assert isinstance(ticket.error, ValueError)
    assert ticket.results == [None]
    assert store.get(b"big") is None


def test_a_declined_put_is_none(mover: CPUMover) -> None:
    class Declining:
        def put_many(self, items: list[tuple[bytes, Any, Any]]) -> list[bool]:
            return [index % 2 == 0 for index in range(len(items))]

    views = [torch.zeros(100 + index, dtype=torch.uint8) for index in range(3)]
    ticket = mover.nvme_write(
        Declining(),  # type: ignore[arg-type]
        [(b"k%d" % index, view, None) for index, view in enumerate(views)],
        priority=Priority.WRITEBACK,
    )
    assert ticket.wait(WAIT_S) and ticket.error is None
    assert ticket.results == [100, None, 102]
    assert ticket.moved_bytes == 202


def test_io_thread_serves_demand_reads_before_writebacks(mover: CPUMover) -> None:
    entered = threading.Event()
    release = threading.Event()
    served: list[str] = []

    class SlowStore:
        def get_many_into(self, keys: list[bytes], buffers: list[Any]) -> list[int | None]:
            if keys == [b"first"]:
                entered.set()
                release.wait(WAIT_S)
            served.append(keys[0].decode())
            return [None] * len(keys)

        def put_many(self, items: list[tuple[bytes, Any, Any]]) -> list[bool]:
            served.append(items[0][0].decode())
            return [True] * len(items)

    store: Any = SlowStore()
    view = torch.zeros(64, dtype=torch.uint8)
    mover.nvme_read(store, [b"first"], [view], priority=Priority.BACKGROUND)
    assert entered.wait(WAIT_S)
    mover.nvme_write(store, [(b"write", view, None)], priority=Priority.WRITEBACK)
    mover.nvme_read(store, [b"prefetch"], [view], priority=Priority.PREFETCH)
    mover.nvme_read(store, [b"demand"], [view], priority=Priority.DEMAND)
    release.set()
    assert len(drain(mover, 4)) == 4
    assert served == ["first", "demand", "prefetch", "write"]


def test_nvme_misuse_is_refused(mover: CPUMover) -> None:
    store: Any = object()
    view = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="1 keys but 2"):
        mover.nvme_read(store, [b"a"], [view, view], priority=Priority.DEMAND)
    with pytest.raises(ValueError, match="needs the store"):
        mover.nvme_read(None, [b"a"], [view], priority=Priority.DEMAND)
    with pytest.raises(ValueError, match="sizes"):
        mover.nvme_read(store, [b"a"], [view], priority=Priority.DEMAND, sizes=[8])
    with pytest.raises(ValueError, match="no tensor"):
        mover.nvme_write(store, [(b"a", None, None)], priority=Priority.DEMAND)
    assert mover.in_flight_bytes() == 0


# -- make_mover ----------------------------------------------------------------------


def test_make_mover_kinds() -> None:
    with make_mover("cpu", "cpu") as cpu:
        assert isinstance(cpu, CPUMover)
    with make_mover("auto", "cpu") as auto:
        assert isinstance(auto, CPUMover)
    if not torch.cuda.is_available():
        with make_mover("auto", "cuda:0") as fallback:
            assert isinstance(fallback, CPUMover)
        with pytest.raises(ValueError, match="CUDA is not available"):
            make_mover("cuda", "cuda:0")
    with pytest.raises(ValueError, match="mover kind"):
        make_mover("fake", "cpu")


# -- VirtualClock and FakeMover -------------------------------------------------------


def test_virtual_clock_is_monotone() -> None:
    clock = VirtualClock()
    assert clock.now() == 0.0
    clock.advance(1.5)
    clock.set(2.0)
    clock.set(2.0)
    clock.advance(0)
    assert clock.now() == 2.0
    with pytest.raises(ValueError):
        clock.advance(-0.1)
    with pytest.raises(ValueError):
        clock.set(1.0)
    assert clock.now() == 2.0
    assert VirtualClock(5.0).now() == 5.0


MIB = 1 << 20


def fake(clock: VirtualClock) -> FakeMover:
    # Powers of two: every scheduled time below is exact in binary floating point.
    return FakeMover(
        {Path.D2H: MIB, Path.H2D: 2 * MIB, Path.NVME_READ: MIB / 4, Path.NVME_WRITE: MIB / 8},
        {Path.D2H: 0.25, Path.NVME_READ: 0.5},
        clock,
    )


def test_fake_serial_per_path_with_latency_plus_bytes_over_bandwidth() -> None:
    clock = VirtualClock(10.0)
    mover = fake(clock)
    first = mover.copy(Path.D2H, (), nbytes=MIB // 2, priority=Priority.WRITEBACK, tag=1)
    second = mover.copy(Path.D2H, (), nbytes=MIB, priority=Priority.DEMAND, tag=2)
    other = mover.copy(Path.H2D, (), nbytes=MIB, priority=Priority.DEMAND, tag=3)
    assert (first.started_s, first.finished_s) == (10.0, 10.75)
    assert (second.started_s, second.finished_s) == (10.75, 12.0)  # queued behind the first
    assert (other.started_s, other.finished_s) == (10.0, 10.5)  # another path overlaps
    assert first.seconds() == 0.75 and second.seconds() == 1.25
    assert first.submitted_s == second.submitted_s == 10.0
    assert mover.in_flight_bytes(Path.D2H) == MIB + MIB // 2
    assert mover.in_flight_bytes() == 2 * MIB + MIB // 2
    assert mover.next_completion_s() == 10.5
    assert mover.poll() == []

    clock.set(10.75)
    assert mover.poll() == [other, first]  # finish order
    assert other.done() and first.done() and not second.done()
    assert second.wait(100) is False  # a virtual wait does not block
    assert mover.in_flight_bytes() == MIB
    assert mover.next_completion_s() == 12.0
    clock.set(20.0)
    assert second.done() and second.wait()
    assert mover.in_flight_bytes() == 0
    assert mover.poll() == [second]
    assert mover.poll() == []
    assert mover.next_completion_s() is None

    idle = mover.copy(Path.D2H, (), nbytes=0, priority=Priority.DEMAND)
    assert (idle.started_s, idle.finished_s) == (20.0, 20.25)  # an idle server starts now


def test_fake_nvme_sizes_and_results() -> None:
    clock = VirtualClock()
    mover = fake(clock)
    read = mover.nvme_read(
        None, [b"a", b"b", b"c"], (), sizes=[MIB // 8, None, MIB // 8], priority=Priority.DEMAND
    )
    assert read.path is Path.NVME_READ
    assert read.results == [MIB // 8, None, MIB // 8]
    assert read.nbytes == read.moved_bytes == MIB // 4
    assert read.finished_s == 0.5 + 1.0
    write = mover.nvme_write(
        None, [(b"a", None, {"parent": None})], sizes=[MIB // 8], priority=Priority.WRITEBACK
    )
    assert write.results == [MIB // 8]
    assert write.finished_s == 1.0  # reads and writes are separate servers
    views = [torch.zeros(MIB // 4, dtype=torch.uint8)]
    from_tensors = mover.nvme_read(None, [b"x"], views, priority=Priority.DEMAND)
    assert from_tensors.results == [MIB // 4]
    assert from_tensors.started_s == 1.5 and from_tensors.finished_s == 3.0
    clock.set(3.0)
    assert mover.poll() == [write, read, from_tensors]


def test_fake_copy_size_from_pairs_and_ties_in_submit_order() -> None:
    clock = VirtualClock()
    mover = FakeMover({Path.D2H: MIB, Path.H2D: MIB}, {}, clock)
    src = torch.zeros(MIB // 2, dtype=torch.uint8)
    d2h = mover.copy(
        Path.D2H, [(src, torch.zeros(MIB, dtype=torch.uint8))], priority=Priority.DEMAND
    )
    h2d = mover.copy(Path.H2D, None, nbytes=MIB // 2, priority=Priority.DEMAND)
    assert d2h.nbytes == MIB // 2 and d2h.finished_s == h2d.finished_s == 0.5
    clock.set(0.5)
    assert mover.poll() == [d2h, h2d]


def test_fake_refuses_what_it_cannot_model() -> None:
    clock = VirtualClock()
    with pytest.raises(ValueError, match="without a bandwidth"):
        FakeMover({}, {Path.D2H: 0.1}, clock)
    with pytest.raises(ValueError, match="must be > 0"):
        FakeMover({Path.D2H: 0}, {}, clock)
    mover = FakeMover({Path.D2H: MIB}, {}, clock)
    with pytest.raises(ValueError, match="no bandwidth"):
        mover.copy(Path.H2D, (), nbytes=1, priority=Priority.DEMAND)
    with pytest.raises(ValueError, match="not a copy path"):
        mover.copy(Path.NVME_WRITE, (), nbytes=1, priority=Priority.DEMAND)
    with pytest.raises(ValueError, match="sizes"):
        mover.nvme_read(None, [b"a"], (), priority=Priority.DEMAND)
    with pytest.raises(ValueError, match="sizes"):
        mover.nvme_write(None, [(b"a", None, None)], priority=Priority.DEMAND)
    with pytest.raises(ValueError, match="1 keys but 2 sizes"):
        mover.nvme_read(None, [b"a"], (), sizes=[1, 2], priority=Priority.DEMAND)
    assert mover.in_flight_bytes() == 0
    mover.close()
    mover.close()
    with pytest.raises(ClosedError):
        mover.copy(Path.D2H, (), nbytes=1, priority=Priority.DEMAND)


def test_fake_set_path_changes_later_jobs_only() -> None:
    clock = VirtualClock()
    mover = FakeMover({Path.D2H: MIB}, {}, clock)
    before = mover.copy(Path.D2H, (), nbytes=MIB, priority=Priority.DEMAND)
    mover.set_path(Path.D2H, 2 * MIB, 0.5)
    after = mover.copy(Path.D2H, (), nbytes=MIB, priority=Priority.DEMAND)
    assert before.finished_s == 1.0
    assert (after.started_s, after.finished_s) == (1.0, 2.0)


# -- CUDAMover ---------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
def test_cuda_round_trip_with_events() -> None:
    with CUDAMover("cuda") as mover:
        host = Arena(4 * 8192, 8192, "cpu", pin=True)
        device = Arena(4 * 8192, 8192, "cuda", name="hbm")
        sources = [random_bytes(8192 - 100 * index, index) for index in range(4)]
        for slot, src in enumerate(sources):
            host.view(slot, src.numel()).copy_(src)
        producer = torch.cuda.Event()  # type: ignore[no-untyped-call]
        producer.record()
        up = mover.copy(
            Path.H2D,
            [(host.view(s, src.numel()), device.view(s)) for s, src in enumerate(sources)],
            priority=Priority.DEMAND,
            wait_event=producer,
        )
        assert up.event is not None
        assert up.wait(WAIT_S)
        host.buffer().zero_()
        down = mover.copy(
            Path.D2H,
            [(device.view(s, src.numel()), host.view(s)) for s, src in enumerate(sources)],
            priority=Priority.WRITEBACK,
            wait_event=up.event,
        )
        assert down.wait(WAIT_S) and down.error is None
        for slot, src in enumerate(sources):
            assert torch.equal(host.view(slot, src.numel()), src)
        seconds = down.seconds()
        assert seconds is not None and seconds >= 0
        assert down.moved_bytes == down.nbytes == sum(src.numel() for src in sources)
        completed = drain(mover, 2)
        assert set(map(id, completed)) == {id(up), id(down)}
        assert up.event is None and up.done()  # events went back to the pool
        assert mover.in_flight_bytes() == 0
        pooled = len(mover._event_pool)
        again = mover.copy(
            Path.D2D, [(device.view(0), device.view(1))], priority=Priority.BACKGROUND
        )
        assert len(mover._event_pool) == pooled - 2  # reused, not allocated
        assert again.wait(WAIT_S)
        assert torch.equal(device.view(1), device.view(0))


def test_wait_completed_sleeps_until_a_ticket_lands(mover: CPUMover) -> None:
    blocker, ticket = block_copy_thread(mover)
    started = time.monotonic()
    assert mover.wait_completed(0.05) is False
    assert time.monotonic() - started >= 0.04  # it slept, not spun out at once
    woke: list[float] = []
    waiter = threading.Thread(target=lambda: woke.append(mover.wait_completed(WAIT_S)))
    waiter.start()
    time.sleep(0.02)
    assert not woke  # still asleep: nothing has completed
    released = time.monotonic()
    blocker.release.set()
    waiter.join(WAIT_S)
    assert woke == [True]
    assert time.monotonic() - released < WAIT_S / 2
    assert mover.wait_completed(0) is True  # not consumed: poll() still has it
    assert mover.poll() == [ticket]
    assert mover.wait_completed(0) is False


def test_fake_wait_completed_never_blocks() -> None:
    clock = VirtualClock()
    moving = fake(clock)
    ticket = moving.copy(Path.D2H, [], priority=Priority.DEMAND, nbytes=MIB)
    started = time.monotonic()
    assert moving.wait_completed(5.0) is False  # the virtual clock has not reached it
    assert time.monotonic() - started < 1.0
    before = moving.completions()
    assert moving.wait_completed(5.0, since=before) is False
    clock.set(ticket.finished_s)  # type: ignore[arg-type]
    assert moving.wait_completed(5.0) is True
    assert moving.completions() == before + 1
    assert moving.poll() == [ticket]
    assert moving.wait_completed(0) is False
    assert moving.wait_completed(5.0, since=before) is True


def test_wait_completed_since_a_count_sees_completions_polled_elsewhere(
    mover: CPUMover,
) -> None:
    """A waiter whose completion another thread polled first still wakes (the manager's
    control thread harvests beside a caller waiting for its load)."""
    blocker, ticket = block_copy_thread(mover)
    before = mover.completions()
    blocker.release.set()
    assert drain(mover, 1) == [ticket]  # someone else took it
    assert mover.completions() == before + 1
    started = time.monotonic()
    assert mover.wait_completed(WAIT_S, since=before) is True
    assert time.monotonic() - started < WAIT_S / 2
    assert mover.wait_completed(0.02) is False  # nothing left to poll
    assert mover.wait_completed(0.02, since=before + 1) is False


# -- CPUMover: NVMe on the store's pipeline (issue 30) ------------------------------------


class Spy:
    """Which of the store's calls ran, on which thread, and whether each page went
    straight from / into the caller's memory (the store's own zero-copy checks)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from kvstore.log import segment_reader
        from kvstore.runtime import writer

        self.calls: list[tuple[str, str]] = []  # (call, thread name)
        self.addresses: list[int] = []  # of every value / buffer the mover passed
        self.put_in_place: list[bool] = []
        self.read_direct: list[bool] = []
        in_place, direct_target = writer.in_place, segment_reader.direct_target

        def spy_in_place(view: memoryview) -> bool:
            self.put_in_place.append(in_place(view))
            return self.put_in_place[-1]

        def spy_direct(entry: Any, target: memoryview) -> memoryview | None:
            direct = direct_target(entry, target)
            self.read_direct.append(direct is not None)
            return direct

        monkeypatch.setattr(writer, "in_place", spy_in_place)
        monkeypatch.setattr(segment_reader, "direct_target", spy_direct)
        for name in ("put_many", "put_many_async", "get_many_into", "get_many_into_async"):
            monkeypatch.setattr(KVStore, name, self._wrap(name, getattr(KVStore, name)))

    def _wrap(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def called(store: KVStore, *args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, threading.current_thread().name))
            if name.endswith("_async"):
                values = [item[1] for item in args[0]] if name.startswith("put") else list(args[1])
                self.addresses.extend(np.asarray(v).__array_interface__["data"][0] for v in values)
            return method(store, *args, **kwargs)

        return called


def test_nvme_batches_go_through_the_pipeline_straight_from_and_into_the_slots(
    monkeypatch: pytest.MonkeyPatch, mover: CPUMover, open_store: OpenStore
) -> None:
    store = open_store()
    page_bytes = 64 << 10
    arena = Arena(8 * page_bytes, page_bytes, "cpu")
    pages = [random_bytes(page_bytes, 70 + i) for i in range(4)]
    for slot, page in enumerate(pages):
        arena.view(slot).copy_(page)
    slot_addresses = [arena.view(slot).data_ptr() for slot in range(8)]
    spy = Spy(monkeypatch)
    items = [(b"p%d" % slot, arena.view(slot), None) for slot in range(4)]
    write = mover.nvme_write(store, items, priority=Priority.WRITEBACK)
    assert write.wait(WAIT_S) and write.error is None
    assert write.results == [page_bytes] * 4
    keys = [b"p%d" % i for i in range(4)]
    read = mover.nvme_read(
        store, keys, [arena.view(4 + i) for i in range(4)], priority=Priority.DEMAND
    )
    assert read.wait(WAIT_S) and read.error is None
    assert read.results == [page_bytes] * 4
    for i, page in enumerate(pages):
        assert torch.equal(arena.view(4 + i), page)
    # The async calls only, each made on the mover's I/O thread (never the caller's;
    # their synchronous halves then run on the store's pipeline threads).
    mover_calls = [c for c in spy.calls if c[1] == "kvstore-tier-io"]
    assert [c[0] for c in mover_calls] == ["put_many_async", "get_many_into_async"]
    assert not [c for c in spy.calls if c[1] == threading.current_thread().name]
    # The arena's own memory went to the store: slots 0-3 written, 4-7 read into...
    assert spy.addresses == slot_addresses
    # ... with no copy on either side: every page written from, and read into, the slot.
    assert spy.put_in_place == [True] * 4
    assert spy.read_direct == [True] * 4


class FutureStore:
    """A stand-in store whose pipelined calls return futures the test settles; its
    synchronous calls (the per-page retries of a failed batch) answer at once."""

    def __init__(self, depth: int) -> None:
        self.config = type("Config", (), {"pipeline_depth": depth})()
        self.futures: list[tuple[str, Future[Any]]] = []
        self.started = threading.Semaphore(0)
        self.retried: list[bytes] = []
        self.bad: set[bytes] = set()

    def _start(self, name: str) -> Future[Any]:
        future: Future[Any] = Future()
        self.futures.append((name, future))
        self.started.release()
        return future

    def put_many_async(self, items: list[tuple[bytes, Any, Any]]) -> Future[Any]:
        return self._start(items[0][0].decode())

    def get_many_into_async(self, keys: list[bytes], buffers: list[Any]) -> Future[Any]:
        return self._start(keys[0].decode())

    def put_many(self, items: list[tuple[bytes, Any, Any]]) -> list[bool]:
        self.retried.append(items[0][0])
        if items[0][0] in self.bad:
            raise OSError(5, "Input/output error")
        return [True]

    def get_many_into(self, keys: list[bytes], buffers: list[Any]) -> list[int | None]:
        self.retried.append(keys[0])
        if keys[0] in self.bad:
            raise OSError(5, "Input/output error")
        return [int(np.asarray(buffers[0]).nbytes)]


def settle_all(mover: CPUMover, store: FutureStore) -> None:
    """Land every batch the store has, and those the I/O thread starts meanwhile
    (after a failed assertion: so that ``close`` does not wait for them forever)."""
    deadline = time.monotonic() + WAIT_S
    while mover.in_flight_bytes() and time.monotonic() < deadline:
        for _, future in list(store.futures):
            if not future.done():
                future.set_result([True])
        time.sleep(0.001)


def wait_started(store: FutureStore, count: int) -> None:
    for _ in range(count):
        assert store.started.acquire(timeout=WAIT_S)


def test_up_to_depth_batches_in_flight_and_the_queue_keeps_priority() -> None:
    mover = CPUMover(nvme_depth=2)
    store: Any = FutureStore(depth=8)  # nvme_depth overrides the store's pipeline_depth
    view = torch.zeros(64, dtype=torch.uint8)
    try:
        first = mover.nvme_write(store, [(b"w1", view, None)], priority=Priority.WRITEBACK)
        second = mover.nvme_write(store, [(b"w2", view, None)], priority=Priority.WRITEBACK)
        wait_started(store, 2)
        third = mover.nvme_write(store, [(b"w3", view, None)], priority=Priority.WRITEBACK)
        demand = mover.nvme_read(store, [b"r"], [view], priority=Priority.DEMAND)
        time.sleep(0.05)
        assert [name for name, _ in store.futures] == ["w1", "w2"]  # two in flight, no more
        assert not first.done() and not second.done()
        store.futures[1][1].set_result([True])  # the second lands first ...
        wait_started(store, 1)  # ... its place in flight is taken at once ...
        assert store.futures[2][0] == "r"  # ... by the DEMAND read, queued after w3
        # ... but its ticket completes after the first's: tickets complete in the
        # order they started, as when the I/O thread ran one job at a time.
        assert not second.wait(0.05)
        store.futures[0][1].set_result([True])
        assert second.wait(WAIT_S) and second.results == [64]
        wait_started(store, 1)
        assert store.futures[3][0] == "w3"
        store.futures[2][1].set_result([64])
        store.futures[3][1].set_result([True])
        for ticket in (first, third, demand):
            assert ticket.wait(WAIT_S) and ticket.error is None and ticket.results == [64]
        assert mover.poll() == [first, second, demand, third]
    finally:
        settle_all(mover, store)
        mover.close()
    assert mover.in_flight_bytes() == 0
    assert store.retried == []


@pytest.mark.parametrize("path", ["write", "read"])
def test_a_failed_batch_in_flight_is_handled_as_a_synchronous_failure(path: str) -> None:
    # Several pages: each again alone (synchronously, on the I/O thread), only the bad
    # one missing; one page: the error in the ticket. As the synchronous path does.
    mover = CPUMover()
    store: Any = FutureStore(depth=2)
    store.bad = {b"b"}
    views = [torch.zeros(100 + i, dtype=torch.uint8) for i in range(3)]
    keys = [b"a", b"b", b"c"]

    def submit(ks: list[bytes]) -> Ticket:
        if path == "write":
            items = [(k, v, None) for k, v in zip(ks, views, strict=False)]
            return mover.nvme_write(store, items, priority=Priority.WRITEBACK)
        return mover.nvme_read(store, ks, views[: len(ks)], priority=Priority.DEMAND)

    try:
        several = submit(keys)
        wait_started(store, 1)
        store.futures[0][1].set_exception(OSError(5, "Input/output error"))
        assert several.wait(WAIT_S)
        assert several.error is None
        assert several.results == [100, None, 102]
        assert several.moved_bytes == 202
        assert store.retried == keys
        alone = submit([b"a"])
        wait_started(store, 1)
        eio = OSError(5, "Input/output error")
        store.futures[1][1].set_exception(eio)
        assert alone.wait(WAIT_S)
        assert alone.error is eio and alone.results == [None] and alone.moved_bytes == 0
        assert store.retried == keys  # one page: no retry
        assert mover.poll() == [several, alone]
    finally:
        mover.close()
    assert mover.in_flight_bytes() == 0


class Synchronous:
    """The store without its pipelined calls: the mover calls it as it always did."""

    def __init__(self, store: KVStore) -> None:
        self._store = store

    def put_many(self, items: Any) -> list[bool]:
        return self._store.put_many(items)

    def get_many_into(self, keys: Any, buffers: Any) -> list[int | None]:
        return self._store.get_many_into(keys, buffers)


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_closed_store_fails_the_same_either_way(
    pipelined: bool, mover: CPUMover, open_store: OpenStore
) -> None:
    store = open_store()
    arena = Arena(4 * 8192, 8192, "cpu")
    store.put_many([(b"a", b"x" * 8192)])
    store.close()
    target: Any = store if pipelined else Synchronous(store)
    items = [(b"k%d" % i, arena.view(i), None) for i in range(2)]
    several = mover.nvme_write(target, items, priority=Priority.WRITEBACK)
    one = mover.nvme_write(target, items[:1], priority=Priority.WRITEBACK)
    read = mover.nvme_read(
        target, [b"a", b"b"], [arena.view(2), arena.view(3)], priority=Priority.DEMAND
    )
    read_one = mover.nvme_read(target, [b"a"], [arena.view(2)], priority=Priority.DEMAND)
    for ticket in (several, one, read, read_one):
        assert ticket.wait(WAIT_S)
    assert several.error is None and several.results == [None, None]
    assert read.error is None and read.results == [None, None]
    assert isinstance(one.error, ClosedError) and one.results == [None]
    assert isinstance(read_one.error, ClosedError) and read_one.results == [None]
    assert mover.in_flight_bytes() == 0


def test_close_waits_for_batches_in_flight() -> None:
    mover = CPUMover()
    store: Any = FutureStore(depth=2)
    view = torch.zeros(64, dtype=torch.uint8)
    ticket = mover.nvme_write(store, [(b"w", view, None)], priority=Priority.WRITEBACK)
    wait_started(store, 1)
    threading.Timer(0.05, lambda: store.futures[0][1].set_result([True])).start()
    mover.close(cancel=True)  # a batch the store has is never cancelled: it lands first
    assert ticket.done() and ticket.error is None and ticket.results == [64]
    assert not mover._io_queue._thread.is_alive()
    assert mover.poll() == [ticket]


def test_batches_in_flight_together_share_the_disk_time() -> None:
    # Two batches started together, landing 0.1 s apart: the second counts only the
    # time after the first landed (the disk was the first's until then), so the
    # bandwidth fit sees the disk's rate, not half of it.
    mover = CPUMover()
    store: Any = FutureStore(depth=2)
    view = torch.zeros(64, dtype=torch.uint8)
    try:
        first = mover.nvme_write(store, [(b"w1", view, None)], priority=Priority.WRITEBACK)
        second = mover.nvme_write(store, [(b"w2", view, None)], priority=Priority.WRITEBACK)
        wait_started(store, 2)
        time.sleep(0.1)
        store.futures[0][1].set_result([True])
        assert first.wait(WAIT_S)
        time.sleep(0.1)
        store.futures[1][1].set_result([True])
        assert second.wait(WAIT_S)
    finally:
        mover.close()
    first_s, second_s = first.seconds(), second.seconds()
    assert first_s is not None and second_s is not None
    assert first_s >= 0.09
    assert second.finished_s is not None and second.started_s is not None
    assert second.finished_s - second.started_s >= 0.19  # its wall time
    assert 0.09 <= second_s < 0.19  # its share

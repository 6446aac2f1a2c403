"""The tier manager under concurrent engines while its NVMe store fails at random.

Three offer threads each grow their own prefix chains (pin part of the chain
now and then, look up the chain, load the resident prefix, offer the missing
tail, unpin), a fourth looks up and loads the
others' chains, and the control thread evicts between them. Tiers are tiny (HBM
4 pages, DRAM 10, 16 KiB pages, low watermarks) so pages go down to NVMe and come
back all the time. The store opened by the manager fails on its own I/O thread:

- ``get_many_into`` raises ``IOFailure``, or reports a page missing or short
  after scribbling over its buffer (a read that died mid-DMA);
- every read first scribbles over its buffers, so a slot served while its NVMe
  read is still in flight (rule R4, docs/tiering.md) would show garbage;
- ``put_many`` raises ``IOFailure``, sometimes after storing part of the batch;
  so does a batch of ``put_many_async`` (the mover's write-back), in flight.

A page's bytes are a function of its key (keys are content hashes in an
engine), so any byte a load returns can be checked on the spot. Asserted: every
loaded page has its key's bytes and size, a failed page is reported missing
(result 0, ``loaded_pages`` shorter), never wrong; no engine-facing call raises
and no load hangs; afterwards no pin leaks, slots and byte counts agree with
the pages, every NVMe page the manager counts is in the store with its bytes;
``close`` finishes. The random choices use fixed seeds; the thread interleaving
differs from run to run, and the assertions hold for every interleaving.
"""

from __future__ import annotations

import functools
import random
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore import KVStore
from kvstore.errors import IOFailure
from kvstore.tiering import LookupState, ModelCost, TierConfig, TierManager

PAGE = 16 * 1024
CHAIN_PAGES = 8
CHAINS_PER_THREAD = 3
OFFER_THREADS = 3
ROUNDS = 60  # per offer thread
# Pages one thread pins at a time. Four threads pin at most 8 of DRAM's 10 slots:
# a load waits for a DRAM slot as long as it takes (see
# test_a_load_behind_a_dram_full_of_pins_settles), so pins that filled DRAM while
# their owners wait on loads would deadlock the threads.
MAX_PINS = 2
SMALL_MODEL = ModelCost(1e9, 8, 8, 64, PAGE // 16)


def chain_key(owner: int, chain: int, position: int) -> bytes:
    return f"t{owner}c{chain}p{position}".encode()


def page_size(key: bytes) -> int:
    # Mostly whole pages; some short ones so a size mix crosses the slots.
    return PAGE if key[-1] % 3 else 4096 + key[-1] * 37


def page_bytes(key: bytes) -> bytes:
    return random.Random(key).randbytes(page_size(key))


class FaultyStore:
    """Wraps the manager's store's batch I/O with seeded random failures."""

    def __init__(self, store: KVStore, seed: int, rate: float) -> None:
        self.store = store
        self.rng = random.Random(seed)
        self.rate = rate
        self.lock = threading.Lock()
        self.injected: dict[str, int] = {}
        self.real_get = store.get_many_into
        self.real_put = store.put_many
        self.enabled = True

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(self.store, "get_many_into", self.get_many_into)
        monkeypatch.setattr(self.store, "put_many", self.put_many)
        monkeypatch.setattr(self.store, "put_many_async", self.put_many_async)

    def roll(self) -> float:
        with self.lock:
            return self.rng.random() if self.enabled else 1.0

    def count(self, what: str) -> None:
        with self.lock:
            self.injected[what] = self.injected.get(what, 0) + 1

    def get_many_into(self, keys: list[bytes], buffers: list[Any]) -> list[int | None]:
        buffers = list(buffers)
        for buffer in buffers:
            buffer[:] = 0xEE  # as if a DMA were still landing: never to be served
        roll = self.roll()
        if roll < self.rate:
            self.count("read_raise")
            raise IOFailure("injected read failure", 5)
        results = self.real_get(keys, buffers)
        if roll < 2 * self.rate and results:
            index = self.rng.randrange(len(results))
            buffers[index][:] = 0xAB
            got = results[index]
            if got and roll < 1.5 * self.rate:
                results[index] = got // 2  # a short read
                self.count("read_short")
            else:
                results[index] = None
                self.count("read_missing")
        return results

    def put_many(self, items: list[Any], **options: Any) -> list[bool]:
        items = list(items)
        roll = self.roll()
        if roll < self.rate:
            self.count("write_raise")
            raise IOFailure("injected write failure", 5)
        if roll < 1.5 * self.rate and len(items) > 1:
            # Part of the batch reached the disk before the error.
            self.real_put(items[: len(items) // 2], **options)
            self.count("write_partial")
            raise IOFailure("injected write failure after a partial batch", 28)
        return self.real_put(items, **options)

    def put_many_async(self, items: list[Any], **options: Any) -> Future[list[bool]]:
        # The mover's write-back: the same faults, raised by the batch in flight (its
        # future's exception, on a thread of its own as on the store's pipeline), not
        # at submission.
        future: Future[list[bool]] = Future()
        items = list(items)

        def run() -> None:
            try:
                future.set_result(self.put_many(items, **options))
            except BaseException as e:  # the future carries it, as the pipeline's would
                future.set_exception(e)

        threading.Thread(target=run, name="faulty-put-many", daemon=True).start()
        return future


def config(tmp_path: Path) -> TierConfig:
    return TierConfig(
        device="cpu",
        hbm_bytes=4 * PAGE,
        dram_bytes=10 * PAGE,
        page_bytes=PAGE,
        tokens_per_page=16,
        nvme_path=str(tmp_path / "nvme"),
        nvme_options={"segment_bytes": 1 << 20, "gc_interval_s": 0},
        model=SMALL_MODEL,
        compute_flops=1e11,  # slow: by the seeded bandwidths, loading wins everywhere
        admission="all",
        hysteresis_s=0.0,
        watermark_low=0.3,
        watermark_warn=0.5,
        watermark_force=0.7,
        probe_at_open=False,
        control_interval_s=0.001,
        warm_dram_on_open=False,
    )


class Engine:
    """What the threads share: the manager, the outcome counters, the failures."""

    def __init__(self, tm: TierManager) -> None:
        self.tm = tm
        self.lock = threading.Lock()
        self.errors: list[str] = []
        self.loaded = 0
        self.failed = 0
        self.offered = 0
        self.by_tier = [0, 0, 0]

    def run(self, name: str, body: Callable[[], None]) -> threading.Thread:
        def guarded() -> None:
            try:
                body()
            except BaseException:
                with self.lock:
                    self.errors.append(f"{name}: {traceback.format_exc()}")

        thread = threading.Thread(target=guarded, name=name, daemon=True)
        thread.start()
        return thread

    def load(self, keys: list[bytes]) -> int:
        """Look up ``keys``, load the plan, check every byte; the loaded page count."""
        result = self.tm.lookup(keys)
        plan = result.plan
        assert result.hit_pages <= len(keys)
        assert list(plan.keys) == keys[: result.hit_pages]
        if result.hit_pages:
            assert result.state is not LookupState.MISS, result  # compute is slow here
        dst = [torch.full((PAGE,), 0x55, dtype=torch.uint8) for _ in range(plan.load_pages)]
        handle = self.tm.prepare_load(plan, dst)
        assert handle.wait(20), f"a load of {keys[0]!r}.. never finished: {handle.results}"
        loaded = self.tm.complete_load(handle)
        assert loaded == handle.loaded_pages
        for index, key in enumerate(plan.keys[: plan.load_pages]):
            nbytes = handle.results[index]
            assert nbytes is not None
            if nbytes == 0:
                continue  # missing (a failed read): the engine recomputes it
            expected = page_bytes(key)
            assert nbytes == len(expected), (key, nbytes, len(expected))
            got = bytes(dst[index][:nbytes].numpy())
            assert got == expected, f"{key!r}: wrong bytes from tier {plan.tiers[index]}"
        with self.lock:
            self.loaded += loaded
            self.failed += handle.failed_pages
            for tier in plan.tiers[:loaded]:
                self.by_tier[tier] += 1
        return loaded

    def load_pinned(self, keys: list[bytes]) -> int:
        """A request that holds the head of its prefix while it runs: pin, load, unpin."""
        head = keys[:MAX_PINS]
        pinned = [k for k, ok in zip(head, self.tm.pin(head), strict=True) if ok]
        try:
            return self.load(keys)
        finally:
            self.tm.unpin(pinned)

    def offer(self, keys: list[bytes], parent: bytes | None) -> None:
        srcs = [torch.frombuffer(bytearray(page_bytes(k)), dtype=torch.uint8) for k in keys]
        parents = [parent, *keys[:-1]]
        out = self.tm.offer(keys, srcs, parents=parents)
        assert len(out.tiers) == len(keys)
        assert out.hbm_release.wait(20), "the offer's copies never landed"
        with self.lock:
            self.offered += out.admitted


def grow(engine: Engine, owner: int, seed: int) -> None:
    """One engine's requests: its chains, each a prompt that grows or is replayed."""
    rng = random.Random(seed)
    for _ in range(ROUNDS):
        chain = rng.randrange(CHAINS_PER_THREAD)
        keys = [chain_key(owner, chain, p) for p in range(CHAIN_PAGES)]
        # Sometimes the engine pins the prefix it is about to use (a running request).
        pins = rng.randint(0, MAX_PINS) if rng.random() < 0.4 else 0
        pinned = [k for k, ok in zip(keys, engine.tm.pin(keys[:pins]), strict=False) if ok]
        hit = engine.load(keys)
        if hit < CHAIN_PAGES:
            tail = keys[hit : hit + rng.randint(1, 4)]
            engine.offer(tail, keys[hit - 1] if hit else None)
        engine.tm.unpin(pinned)
        if rng.random() < 0.2:
            time.sleep(0.002)


def borrow(engine: Engine, stop: threading.Event, seed: int) -> None:
    """Another engine's requests: prefixes of the offer threads' chains."""
    rng = random.Random(seed)
    while not stop.is_set():
        owner = rng.randrange(OFFER_THREADS)
        chain = rng.randrange(CHAINS_PER_THREAD)
        length = rng.randint(1, CHAIN_PAGES)
        engine.load_pinned([chain_key(owner, chain, p) for p in range(length)])


def sweep(engine: Engine) -> None:
    """The last requests, with nobody offering after them: every chain, pinned."""
    for owner in range(OFFER_THREADS):
        for chain in range(CHAINS_PER_THREAD):
            engine.load_pinned([chain_key(owner, chain, p) for p in range(CHAIN_PAGES)])


def check_settled(tm: TierManager) -> None:
    """After the threads and a drain: pins, slots and byte counts agree with the pages.

    White-box (``tm._pages``, the arenas): the public stats cannot show a leaked pin
    or slot, and a leak is what a failure path most often gets wrong."""
    assert tm.drain(20)
    stats = tm.stats()
    with tm._lock:
        records = list(tm._pages.values())
        hbm_slots, dram_slots = tm._hbm.used_slots(), tm._dram.used_slots()
    leaked = [r for r in records if r.pins or r.waiters]
    assert not leaked, f"pins or waiters left after every load completed: {leaked[:5]}"
    homeless = [r for r in records if not r.tiers]
    assert not homeless, f"records in no tier: {homeless[:5]}"
    for tier in range(3):
        count = sum(1 for r in records if r.in_tier(tier))
        assert stats.pages_by_tier[tier] == count, (tier, stats.pages_by_tier, count)
        assert stats.used_bytes[tier] <= stats.capacity_bytes[tier], (tier, stats.used_bytes)
    assert stats.used_bytes[0] == stats.pages_by_tier[0] * PAGE
    assert stats.used_bytes[1] == stats.pages_by_tier[1] * PAGE
    assert stats.used_bytes[2] == sum(r.nbytes for r in records if r.in_tier(2))
    assert hbm_slots == stats.pages_by_tier[0], (hbm_slots, stats.pages_by_tier)
    assert dram_slots == stats.pages_by_tier[1], (dram_slots, stats.pages_by_tier)
    store = tm.store
    for rec in records:
        if rec.in_tier(2):
            info = store.info(rec.key)
            assert info is not None, f"{rec!r} counted on NVMe but not in the store"
            assert info.payload_bytes == rec.nbytes == page_size(rec.key)


@pytest.mark.parametrize("seed", [1, 2])
def test_threads_with_io_errors_never_see_a_wrong_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    tm = TierManager.open(config(tmp_path))
    faults = FaultyStore(tm.store, seed, rate=0.15)
    faults.install(monkeypatch)
    engine = Engine(tm)
    stop = threading.Event()
    try:
        growers = [
            engine.run(f"grow{i}", functools.partial(grow, engine, i, seed * 100 + i))
            for i in range(OFFER_THREADS)
        ]
        reader = engine.run("borrow", functools.partial(borrow, engine, stop, seed * 100 + 99))
        for thread in growers:
            thread.join(60)
        stop.set()
        reader.join(60)
        assert not any(t.is_alive() for t in [*growers, reader]), "a thread hung"
        assert not engine.errors, "\n".join(engine.errors)
        for _ in range(3):
            sweep(engine)
        faults.enabled = False
        check_settled(tm)
        # The run did what it is for: faults fired and pages came back from every tier.
        injected = faults.injected
        assert injected.get("read_raise", 0) + injected.get("read_missing", 0) > 0, injected
        assert injected.get("write_raise", 0) > 0, injected
        assert all(engine.by_tier), (engine.by_tier, injected)
        assert engine.failed > 0, (engine.failed, injected)
        assert tm.stats().load_failures > 0
    finally:
        stop.set()
        closer = threading.Thread(target=tm.close, daemon=True)
        closer.start()
        closer.join(30)
    assert not closer.is_alive(), "close() did not finish"
    # What reached the disk, even from a batch that failed half way, is whole.
    with KVStore.open(tmp_path / "nvme") as store:
        for key in store.keys():  # noqa: SIM118 (KVStore is not a Mapping)
            assert store.get(key) == page_bytes(key), key


# -- the bugs the runs above found, each as a plain deterministic test ------------


class Gate:
    """A producer "event" (R1) that holds an offer's copy until ``open``."""

    def __init__(self) -> None:
        self.opened = threading.Event()

    def synchronize(self) -> None:
        self.opened.wait(10)

    def open(self) -> None:
        self.opened.set()


def tiny_config(tmp_path: Path, **overrides: Any) -> TierConfig:
    base: dict[str, Any] = dict(
        device="cpu",
        hbm_bytes=2 * PAGE,
        dram_bytes=2 * PAGE,
        page_bytes=PAGE,
        tokens_per_page=16,
        nvme_path=str(tmp_path / "nvme"),
        nvme_options={"segment_bytes": 1 << 20, "gc_interval_s": 0},
        model=SMALL_MODEL,
        compute_flops=1e11,
        admission="all",
        hysteresis_s=0.0,
        probe_at_open=False,
        control_interval_s=0,
        warm_dram_on_open=False,
    )
    base.update(overrides)
    return TierConfig(**base)


def test_close_with_a_load_waiting_on_an_offer_copy(tmp_path: Path) -> None:
    # The load waits for the offer's copy; close harvested that copy after closing
    # the mover, and the waiter's copy to the destination raised ClosedError out of
    # close(), leaving the store open.
    tm = TierManager.open(tiny_config(tmp_path))
    gate = Gate()
    value = page_bytes(b"k1")
    out = tm.offer([b"k1"], [torch.frombuffer(bytearray(value), dtype=torch.uint8)], event=gate)
    assert out.reasons == ("admitted",)
    result = tm.lookup([b"k1"])
    assert result.state is LookupState.PENDING  # the copy is held at the gate
    dst = [torch.zeros(PAGE, dtype=torch.uint8)]
    handle = tm.prepare_load(result.plan, dst)
    gate.open()
    tm.close()
    assert handle.done()
    assert handle.results[0] in (0, len(value))
    if handle.results[0]:
        assert bytes(dst[0][: len(value)].numpy()) == value
    with KVStore.open(tmp_path / "nvme"):
        pass  # the store was closed: its writer lock is free


def test_drain_harvests_what_lands_during_its_own_harvest(tmp_path: Path) -> None:
    # drain() harvested, then found nothing in flight and returned True, while a
    # ticket that landed between the two stayed unharvested (its page WRITING).
    with TierManager.open(tiny_config(tmp_path)) as tm:
        gate = Gate()
        src = torch.frombuffer(bytearray(page_bytes(b"k1")), dtype=torch.uint8)
        tm.offer([b"k1"], [src], event=gate)
        real_harvest = tm._harvest

        def harvest_then_land() -> None:
            real_harvest()
            if not gate.opened.is_set():
                gate.open()  # the copy lands right after this harvest
                deadline = time.monotonic() + 10
                while tm._mover.in_flight_bytes() and time.monotonic() < deadline:
                    time.sleep(0.001)

        tm._harvest = harvest_then_land  # type: ignore[method-assign]
        assert tm.drain(10)
        del tm._harvest
        assert tm._pages[b"k1"].state.name == "READY", tm._pages[b"k1"]


def test_unpin_forgets_a_page_whose_last_copy_failed_while_pinned(tmp_path: Path) -> None:
    # The read of a pinned NVMe-only page fails: the page is in no tier but the pin
    # kept its record; unpin left the record behind for good (stats counted a page
    # no tier held, the page table leaked one record per failure).
    cfg = tiny_config(
        tmp_path, hbm_bytes=0, watermark_low=0.01, watermark_warn=0.01, watermark_force=0.01
    )
    with TierManager.open(cfg) as tm:
        tm.offer([b"k1"], [torch.frombuffer(bytearray(page_bytes(b"k1")), dtype=torch.uint8)])
        for _ in range(5):
            assert tm.drain(10)
            tm.step()
        assert tm.stats().pages_by_tier == (0, 0, 1)

        def failing_read(*args: object, **kwargs: object) -> list[int | None]:
            raise IOFailure("injected read failure", 5)

        tm.store.get_many_into = failing_read
        assert tm.pin([b"k1"]) == [True]
        result = tm.lookup([b"k1"])
        handle = tm.prepare_load(result.plan, [torch.zeros(PAGE, dtype=torch.uint8)])
        assert handle.wait(10)
        assert tm.complete_load(handle) == 0  # missing, never wrong
        tm.unpin([b"k1"])
        stats = tm.stats()
        assert stats.pages_by_tier == (0, 0, 0)
        assert stats.pages == 0, tm.explain(b"k1")


def test_a_load_behind_a_dram_full_of_pins_settles(tmp_path: Path) -> None:
    # An NVMe-only page is to be loaded while both DRAM slots hold pinned pages.
    # The engine cannot cancel the load, and complete_load raises while it is in
    # flight; a page that cannot be loaded should be reported missing (0), as the
    # LoadHandle contract says, so the engine recomputes it.
    cfg = tiny_config(
        tmp_path, hbm_bytes=0, watermark_low=0.01, watermark_warn=0.01, watermark_force=0.01
    )
    with TierManager.open(cfg) as tm:
        keys = [b"k1", b"k2", b"k3"]
        for key in keys:
            src = torch.frombuffer(bytearray(page_bytes(key)), dtype=torch.uint8)
            assert tm.offer([key], [src], parents=[None]).reasons == ("admitted",)
            for _ in range(5):
                assert tm.drain(10)
                tm.step()
        assert tm.stats().pages_by_tier == (0, 0, 3)
        for key in keys[:2]:  # loading promotes them into DRAM; pin them there
            result = tm.lookup([key])
            handle = tm.prepare_load(result.plan, [torch.zeros(PAGE, dtype=torch.uint8)])
            assert handle.wait(10)
            assert tm.complete_load(handle) == 1
        assert tm.pin(keys[:2]) == [True, True]
        assert tm.stats().pages_by_tier == (0, 2, 3)
        result = tm.lookup([keys[2]])
        assert result.plan.load_pages == 1
        handle = tm.prepare_load(result.plan, [torch.zeros(PAGE, dtype=torch.uint8)])
        assert handle.wait(2), f"the load is still waiting for a DRAM slot: {handle.results}"
        assert tm.complete_load(handle) in (0, 1)
        tm.unpin(keys[:2])

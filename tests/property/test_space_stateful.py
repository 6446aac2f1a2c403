"""Pins, retains, GC and eviction against a model, under random operations.

Two machines share the rules:

- ``ExactSpaceMachine`` (no capacity): the model is exact. Every put is
  readable with its bytes until overwritten or deleted, pins and retains are
  exactly as modelled, ``gc(full=True)`` finds no drift, and after a reopen the
  pins are gone (volatile) while the retains persist.
- ``CapacitySpaceMachine`` (1 MiB segments, 6 MiB capacity, pages up to
  250 KiB, so eviction really happens): a get returns the latest put bytes or
  None (evicted), never other bytes; a key once seen evicted or deleted never
  comes back; a retained key, and a key while pinned, is never evicted; a
  ``StoreFullError`` comes only when nothing evictable is left where eviction
  could make room.

Page bytes are derived from (key, version), so any bytes a get returns can be
named. Every example gets its own directory. Most examples run without the
background GC thread (``gc_interval_s=0``) so the run is deterministic; a few
run it at a short interval. Each example draws its eviction policy.

Set KVSTORE_SPACE_EXAMPLES (default 25) for a longer soak. Bugs found here are
reproduced as plain tests in test_space_regressions.py.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from kvstore import KVStore, PinError, StoreFullError
from kvstore.format.constants import BLOCK_BYTES
from kvstore.format.entries import SEGMENT_SEALED

SEGMENT_BYTES = 1 << 20
MAX_PAGE_BYTES = 256 << 10
CAPACITY_BYTES = 6 << 20
CAPACITY_SEGMENTS = CAPACITY_BYTES // SEGMENT_BYTES

KEY_NAMES = [f"k{i}".encode() for i in range(12)]
KEYS = st.sampled_from(KEY_NAMES)
# Mostly large pages (a 1 MiB segment holds 3-4 of them) so segments fill, seal,
# empty and, under a capacity, get evicted within a few dozen steps.
SIZES = st.one_of(
    st.integers(min_value=1, max_value=300),
    st.sampled_from([4096, 60_000, 150_000, 200_000, 250_000]),
    st.sampled_from([150_000, 200_000, 250_000]),
)

SETTINGS = settings(
    max_examples=int(os.environ.get("KVSTORE_SPACE_EXAMPLES", "25")),
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def page(key: bytes, version: int, size: int) -> bytes:
    """Deterministic, distinct bytes per (key, version)."""
    return random.Random(f"{key!r}/{version}").randbytes(size)


def _pinned_and_active(store: KVStore) -> tuple[set[int], int | None]:
    """The segments with pins, and the active segment's id, read under the state lock."""
    state = store.internals.state
    with state.lock:
        active = state.active.segment_id if state.active is not None else None
        return set(state.segment_pins), active


class SpaceMachine(RuleBasedStateMachine):
    """The shared rules; subclasses set ``capacity_bytes``."""

    capacity_bytes: ClassVar[int | None] = None

    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="kvstore-space-"))
        self.path = self.directory / "store"
        self.options: dict[str, Any] = {}
        self.store: KVStore | None = None
        # key -> latest put bytes; under a capacity: "present or evicted".
        self.values: dict[bytes, bytes] = {}
        self.pins: Counter[bytes] = Counter()
        self.retained: set[bytes] = set()
        self.version = 0
        self.evictions_seen = 0

    # -- helpers ---------------------------------------------------------------

    @property
    def bounded(self) -> bool:
        return self.capacity_bytes is not None

    @property
    def kv(self) -> KVStore:
        assert self.store is not None
        return self.store

    def open(self) -> KVStore:
        return KVStore.open(
            self.path,
            create=True,
            segment_bytes=SEGMENT_BYTES,
            max_page_bytes=MAX_PAGE_BYTES,
            capacity_bytes=self.capacity_bytes,
            **self.options,
        )

    def protected(self, key: bytes) -> bool:
        return self.pins[key] > 0 or key in self.retained

    def new_value(self, key: bytes, size: int) -> bytes:
        self.version += 1
        return page(key, self.version, size)

    def saw_absent(self, key: bytes, where: str) -> None:
        """The store says ``key`` is gone: legal only if it may have been evicted."""
        if key not in self.values:
            return
        assert self.bounded, f"{where}: {key!r} lost without a capacity"
        assert not self.protected(key), (
            f"{where}: {key!r} evicted while pinned ({self.pins[key]}) "
            f"or retained ({key in self.retained})"
        )
        del self.values[key]  # evicted: it must never come back
        self.evictions_seen += 1
        event("eviction observed")

    def check_get(self, key: bytes, got: bytes | None, where: str) -> None:
        expected = self.values.get(key)
        if got is None:
            self.saw_absent(key, where)
            return
        assert expected is not None, f"{where}: {key!r} came back ({len(got)} bytes)"
        assert got == expected, f"{where}: {key!r}: wrong bytes ({len(got)} vs {len(expected)})"

    def check_all(self, where: str) -> None:
        for key in KEY_NAMES:
            self.check_get(key, self.kv.get(key), where)

    def check_store_full(self, where: str) -> None:
        """A StoreFullError is legal only when eviction and relocation can make no room.

        Movable segments are the sealed ones without a pinned page (a segment
        holding a pinned entry is never compacted or freed; the active one is not
        a victim). The error is wrong if a movable segment still holds a page
        whose key is neither pinned nor retained (it could have been evicted), or
        if two movable segments' live pages fit in one segment (relocating them
        through the GC reserve would free a segment).
        """
        store = self.kv
        event("StoreFullError")
        if self.options["gc_interval_s"]:
            return  # the background thread reshapes segments meanwhile: not checkable
        pinned_segments, active = _pinned_and_active(store)
        states = store.segment_states()
        movable = {
            segment_id: state
            for segment_id, state in states.items()
            if segment_id != active
            and segment_id not in pinned_segments
            and state.state == SEGMENT_SEALED
        }
        evictable = []
        for key in store.keys():  # noqa: SIM118 (no __iter__)
            info = store.info(key)
            if info is not None and not self.protected(key) and info.segment_id in movable:
                evictable.append((key, info.segment_id))
        summary = (
            f"pins {dict(+self.pins)}, retained {sorted(self.retained)}, "
            f"pinned segments {sorted(pinned_segments)}, active {active}, "
            f"live bytes { {i: s.live_bytes for i, s in sorted(states.items())} }"
        )
        assert not evictable, f"{where}: StoreFullError with evictable pages {evictable}; {summary}"
        sparse = sorted(state.live_bytes for state in movable.values())
        mergeable = len(sparse) >= 2 and sparse[0] + sparse[1] <= SEGMENT_BYTES - BLOCK_BYTES
        assert not mergeable, (
            f"{where}: StoreFullError although two movable segments fit in one; {summary}"
        )

    def resolve(self, candidates: dict[bytes, list[bytes]], where: str) -> None:
        """After a failed batch: each key holds its old bytes, one of the new ones, or
        (unless protected and already present) nothing."""
        for key, news in candidates.items():
            got = self.kv.get(key)
            old = self.values.get(key)
            if got is None:
                if old is not None:
                    self.saw_absent(key, where)
                continue
            assert got == old or got in news, f"{where}: {key!r}: bytes of no candidate"
            self.values[key] = got

    # -- rules -----------------------------------------------------------------

    @initialize(
        policy=st.sampled_from(["fifo", "lru", "cost"]),
        gc_interval_s=st.sampled_from([0.0, 0.0, 0.0, 0.0, 0.01]),
        prefill=st.lists(KEYS, min_size=12, max_size=28),
    )
    def start(self, policy: str, gc_interval_s: float, prefill: list[bytes]) -> None:
        """Open the store and write ``prefill`` large pages (3-7 segments' worth),
        so that the capacity is reached within a few steps even in the short runs
        hypothesis favours."""
        self.options = {"eviction_policy": policy, "gc_interval_s": gc_interval_s}
        if gc_interval_s:
            event("background GC thread")
        self.store = self.open()
        if prefill:
            self.put_many([(key, 250_000) for key in prefill])

    @rule(keys=st.lists(KEYS, min_size=4, max_size=12))
    def fill(self, keys: list[bytes]) -> None:
        """A large batch of large pages: fills segments (and the capacity) fast."""
        self.put_many([(key, 250_000) for key in keys])

    @rule(key=KEYS, size=SIZES, sync=st.booleans())
    def put(self, key: bytes, size: int, sync: bool) -> None:
        value = self.new_value(key, size)
        try:
            assert self.kv.put(key, value, sync=sync) is True
        except StoreFullError:
            assert self.bounded, "StoreFullError without a capacity"
            self.check_store_full("put")
            self.resolve({key: [value]}, "put after StoreFullError")
            return
        self.values[key] = value

    @rule(items=st.lists(st.tuples(KEYS, SIZES), min_size=1, max_size=5))
    def put_many(self, items: list[tuple[bytes, int]]) -> None:
        batch = [(key, self.new_value(key, size)) for key, size in items]
        try:
            assert self.kv.put_many(batch) == [True] * len(batch)
        except StoreFullError:
            assert self.bounded, "StoreFullError without a capacity"
            self.check_store_full("put_many")
            candidates: dict[bytes, list[bytes]] = {}
            for key, value in batch:
                candidates.setdefault(key, []).append(value)
            self.resolve(candidates, "put_many after StoreFullError")
            return
        for key, value in batch:  # in one batch the later item wins
            self.values[key] = value

    @rule(key=KEYS)
    def get(self, key: bytes) -> None:
        self.check_get(key, self.kv.get(key), "get")

    @rule(key=KEYS)
    def delete(self, key: bytes) -> None:
        result = self.kv.delete(key)
        if key not in self.values:
            assert result is False, f"delete of absent {key!r} returned True"
        elif not self.bounded or self.protected(key):
            assert result is True, f"delete of present {key!r} returned False"
        elif not result:
            self.saw_absent(key, "delete")
        self.values.pop(key, None)
        self.retained.discard(key)  # a delete drops the retain
        assert not self.kv.is_retained(key)

    @rule(key=KEYS)
    def pin(self, key: bytes) -> None:
        result = self.kv.pin(key)
        if key not in self.values:
            assert result is False, f"pin of absent {key!r} returned True"
        elif not self.bounded or self.protected(key):
            assert result is True, f"pin of present {key!r} returned False"
        elif not result:
            self.saw_absent(key, "pin")
        if result:
            self.pins[key] += 1

    @rule(key=KEYS)
    def unpin(self, key: bytes) -> None:
        if self.pins[key]:
            self.kv.unpin(key)
            self.pins[key] -= 1
        else:
            with pytest.raises(PinError):
                self.kv.unpin(key)

    @rule()
    def pin_everything(self) -> None:
        """Pin every key: pinned segments and protected pages pile up, so a
        StoreFullError (and whether it was legal) becomes reachable."""
        for key in KEY_NAMES:
            self.pin(key)

    @rule()
    def unpin_everything(self) -> None:
        for key, count in list(self.pins.items()):
            for _ in range(count):
                self.kv.unpin(key)
        self.pins.clear()

    @rule(keys=st.lists(KEYS, min_size=1, max_size=4))
    def read_pinned(self, keys: list[bytes]) -> None:
        """``pinned()``: a pinned key reads back exactly for the whole block."""
        with self.kv.pinned(keys) as ok:
            for key, pinned in zip(keys, ok, strict=True):
                if pinned:
                    self.pins[key] += 1
                    assert key in self.values, f"pinned() pinned absent {key!r}"
                else:
                    self.saw_absent(key, "pinned()")
            for key, pinned in zip(keys, ok, strict=True):
                if pinned:
                    assert self.kv.get(key) == self.values[key], f"pinned {key!r} changed"
        for key, pinned in zip(keys, ok, strict=True):
            if pinned:
                self.pins[key] -= 1

    @rule(key=KEYS)
    def retain(self, key: bytes) -> None:
        result = self.kv.retain(key)
        if key not in self.values:
            assert result is False, f"retain of absent {key!r} returned True"
        elif not self.bounded or self.protected(key):
            assert result is True, f"retain of present {key!r} returned False"
        elif not result:
            self.saw_absent(key, "retain")
        if result:
            self.retained.add(key)

    @rule(keys=st.lists(KEYS, min_size=2, max_size=8))
    def retain_many(self, keys: list[bytes]) -> None:
        """Retain a lot at once, so a store full of retained pages is reachable."""
        for key in keys:
            self.retain(key)

    @rule(key=KEYS)
    def release(self, key: bytes) -> None:
        assert self.kv.release(key) is (key in self.retained)
        self.retained.discard(key)

    @rule(full=st.booleans())
    def gc(self, full: bool) -> None:
        report = self.kv.gc(full=full)
        if full:
            assert report.drift_segments == 0, f"accounting drift: {report}"
            assert report.drift_bytes == 0, f"accounting drift: {report}"
        if not self.bounded:
            assert report.pages_evicted == 0, f"eviction without a capacity: {report}"
        if report.pages_evicted:
            event("gc evicted pages")
        if report.pages_moved:
            event("gc moved pages")
        if report.segments_freed:
            event("gc freed segments")
        self.check_all("after gc")

    @rule()
    def gc_twice_leaves_no_empty_segment(self) -> None:
        """Two passes in a row free every sealed segment with no live and no pinned page."""
        self.kv.gc()
        self.kv.gc()
        store = self.kv
        pinned_segments, active = _pinned_and_active(store)
        empty = [
            segment_id
            for segment_id, state in store.segment_states().items()
            if state.live_pages == 0 and segment_id != active and segment_id not in pinned_segments
        ]
        assert not empty, f"gc left empty segments {empty}"

    @rule()
    def flush(self) -> None:
        self.kv.flush()

    @rule()
    def checkpoint(self) -> None:
        self.kv.checkpoint()

    @rule(unpin_first=st.booleans())
    def reopen(self, unpin_first: bool) -> None:
        if unpin_first:
            for key, count in self.pins.items():
                for _ in range(count):
                    self.kv.unpin(key)
        self.kv.close()
        self.pins.clear()  # pins are volatile
        self.store = self.open()
        for key in KEY_NAMES:
            assert self.kv.pin_count(key) == 0, f"{key!r} still pinned after reopen"
        assert self.kv.gc(full=True).drift_segments == 0
        self.check_all("after reopen")

    @rule()
    def full_gc_finds_no_drift(self) -> None:
        report = self.kv.gc(full=True)
        assert report.drift_segments == 0 and report.drift_bytes == 0, report

    # -- invariants --------------------------------------------------------------

    @invariant()
    def matches_model(self) -> None:
        if self.store is None:
            return
        store = self.store
        listed = set(store.keys())
        for key in KEY_NAMES:
            assert store.pin_count(key) == self.pins[key], f"{key!r} pin count"
            assert store.is_retained(key) is (key in self.retained), f"{key!r} retain"
        if self.bounded:
            assert listed <= set(self.values), f"came back: {listed - set(self.values)}"
            for key in set(self.values) - listed:
                self.saw_absent(key, "keys()")
            stats = store.stats()
            assert stats.segments <= CAPACITY_SEGMENTS, f"{stats.segments} segments"
        else:
            assert listed == set(self.values)
            assert len(store) == len(self.values)
            stats = store.stats()
        for key in self.retained:
            assert key in listed, f"retained {key!r} is gone"
        states = store.segment_states()
        for key in listed:
            info = store.info(key)
            assert info is None or info.segment_id in states, f"{key!r} in a freed segment"
        if self.bounded:
            files = [f for f in (self.path / "segments").iterdir() if f.suffix == ".seg"]
            assert len(files) <= CAPACITY_SEGMENTS, f"{len(files)} segment files on disk"
        assert stats.pinned_pages == sum(self.pins.values())
        assert stats.retained_pages == len(self.retained)

    def teardown(self) -> None:
        try:
            if self.store is not None:
                self.store.close()
        finally:
            with contextlib.suppress(OSError):
                shutil.rmtree(self.directory)


class ExactSpaceMachine(SpaceMachine):
    capacity_bytes = None


class CapacitySpaceMachine(SpaceMachine):
    capacity_bytes = CAPACITY_BYTES


TestExactSpace = ExactSpaceMachine.TestCase
TestExactSpace.settings = SETTINGS
TestCapacitySpace = CapacitySpaceMachine.TestCase
TestCapacitySpace.settings = SETTINGS

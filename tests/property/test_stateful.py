"""The store against a dict, under random put/get/delete/flush/checkpoint/reopen.

Keys come from a tiny alphabet so overwrites and deletes of live keys are
common; values are small random bytes. Every example gets its own directory.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

from kvstore import KVStore

KEYS = st.text(alphabet="abc", min_size=1, max_size=2)
VALUES = st.binary(min_size=1, max_size=300)


def open_small(path: Path) -> KVStore:
    """The geometry of tests/conftest.py's open_small_store."""
    return KVStore.open(path, create=True, segment_bytes=1 << 20, max_page_bytes=256 << 10)


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="kvstore-stateful-"))
        self.path = self.directory / "store"
        self.store = open_small(self.path)
        self.model: dict[bytes, bytes] = {}

    @rule(key=KEYS, value=VALUES, sync=st.booleans())
    def put(self, key: str, value: bytes, sync: bool) -> None:
        assert self.store.put(key, value, sync=sync) is True
        self.model[key.encode()] = value

    @rule(items=st.lists(st.tuples(KEYS, VALUES), min_size=1, max_size=4))
    def put_many(self, items: list[tuple[str, bytes]]) -> None:
        assert self.store.put_many(items) == [True] * len(items)
        for key, value in items:  # in one batch the later item wins
            self.model[key.encode()] = value

    @rule(key=KEYS)
    def get(self, key: str) -> None:
        assert self.store.get(key) == self.model.get(key.encode())

    @rule(keys=st.lists(KEYS, max_size=5))
    def get_many(self, keys: list[str]) -> None:
        assert self.store.get_many(keys) == [self.model.get(key.encode()) for key in keys]

    @rule(key=KEYS)
    def delete(self, key: str) -> None:
        present = key.encode() in self.model
        assert self.store.delete(key) is present
        self.model.pop(key.encode(), None)

    @rule()
    def flush(self) -> None:
        self.store.flush()

    @rule()
    def checkpoint(self) -> None:
        self.store.checkpoint()
        assert self.store.stats().overlay_entries == 0

    @rule()
    def reopen(self) -> None:
        self.store.close()
        self.store = open_small(self.path)

    @invariant()
    def matches_model(self) -> None:
        assert len(self.store) == len(self.model)
        assert sorted(self.store.keys()) == sorted(self.model)

    def teardown(self) -> None:
        try:
            self.store.close()
        finally:
            with contextlib.suppress(OSError):
                shutil.rmtree(self.directory)


def test_store_matches_a_dict_model() -> None:
    run_state_machine_as_test(
        StoreMachine,
        settings=settings(
            max_examples=30,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )

"""What the public API accepts and refuses: misuse is TypeError/ValueError, never stored.

Values are anything with a C-contiguous buffer (bytes, bytearray, memoryview,
numpy arrays of any dtype and shape) and round-trip byte for byte.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import kvstore.inputs as inputs_module
import kvstore.store as store_module
from kvstore import KVStore
from kvstore.errors import ClosedError, FormatVersionError, IOFailure
from kvstore.format.constants import MAX_KEY_BYTES
from kvstore.index.lmdb_env import check_key_limit

MAX_PAGE_BYTES = 256 << 10  # the ``open_store`` fixture's max_page_bytes


def assert_empty(store: KVStore) -> None:
    assert len(store) == 0
    assert list(store.keys()) == []
    assert store.stats().counters["puts"] == 0


# -- keys -------------------------------------------------------------------------


@pytest.mark.parametrize("key", [1, None, bytearray(b"k"), memoryview(b"k"), 1.5, ("k",)], ids=type)
def test_key_of_the_wrong_type_is_type_error(store: KVStore, key: Any) -> None:
    for call in key_taking_calls(store, key):
        with pytest.raises(TypeError, match="key must be bytes or str"):
            call()
    assert_empty(store)


def key_taking_calls(store: KVStore, key: Any) -> list[Callable[[], object]]:
    """Every public call that takes a key, with that key."""
    return [
        lambda: store.put(key, b"v"),
        lambda: store.put_many([(key, b"v")]),
        lambda: store.get(key),
        lambda: store.get_many([key]),
        lambda: store.get_into(key, bytearray(8)),
        lambda: store.get_many_into([key], [bytearray(8)]),
        lambda: store.delete(key),
        lambda: store.info(key),
        lambda: key in store,
        lambda: store.pin(key),
        lambda: store.pin_many([key]),
        lambda: store.unpin(key),
        lambda: store.unpin_many([key]),
        lambda: store.pin_count(key),
        lambda: store.retain(key),
        lambda: store.release(key),
        lambda: store.is_retained(key),
    ]


@pytest.mark.parametrize(
    "key", [b"", "", b"k" * 512, "k" * 512, "\u00e9" * 256, b"k" * 1024], ids=len
)
def test_key_of_the_wrong_length_is_value_error(store: KVStore, key: bytes | str) -> None:
    for call in key_taking_calls(store, key):
        with pytest.raises(ValueError, match=r"key must be 1\.\.511 bytes \(the LMDB index"):
            call()
    assert_empty(store)


def test_keys_at_the_limits_and_utf8(store: KVStore) -> None:
    longest = b"\xff" * 511
    unicode_key = "層/ブロック/7 🧠"
    store.put(b"x", b"one byte key")
    store.put(longest, b"511 byte key")
    store.put(unicode_key, b"unicode")
    store.put("\u00e9" * 255 + "x", b"511 bytes of UTF-8")
    assert store.get(b"x") == b"one byte key"
    assert store.get(longest) == b"511 byte key"
    assert store.get(unicode_key) == b"unicode"
    assert store.get(unicode_key.encode("utf-8")) == b"unicode"
    assert unicode_key.encode("utf-8") in store
    assert store.get("\u00e9" * 255 + "x") == b"511 bytes of UTF-8"
    info = store.info(unicode_key)
    assert info is not None
    assert info.key == unicode_key.encode("utf-8")
    assert set(store.keys()) == {
        b"x",
        longest,
        unicode_key.encode(),
        ("\u00e9" * 255 + "x").encode(),
    }
    assert store.retain(longest)
    assert store.pin(longest)
    store.unpin(longest)
    store.checkpoint()  # the longest key fits the index: the checkpoint commits it
    assert store.get(longest) == b"511 byte key"


def test_the_key_limit_is_the_index_limit(store: KVStore) -> None:
    """LMDB's own key limit is what put enforces: no accepted key can fail a checkpoint."""
    env = store.internals.env.env
    assert KVStore.max_key_bytes == env.max_key_size() == 511
    store.put(b"k" * KVStore.max_key_bytes, b"v")
    with pytest.raises(ValueError, match="511"):
        store.put(b"k" * (KVStore.max_key_bytes + 1), b"v")
    store.checkpoint()
    store.close()  # a key of 512-1024 bytes used to make every checkpoint, and close, fail


def test_an_lmdb_build_with_a_smaller_key_limit_is_refused() -> None:
    check_key_limit(511)
    check_key_limit(1982)  # LMDB built with MDB_MAXKEYSIZE=0 on 4 KiB pages
    with pytest.raises(FormatVersionError, match="at most 255 bytes"):
        check_key_limit(255)


def test_key_with_a_lone_surrogate_is_value_error_naming_it(store: KVStore) -> None:
    key = "layer0/\udc80"  # what os.fsdecode makes of an undecodable byte
    for call in key_taking_calls(store, key):
        with pytest.raises(ValueError, match=r"key 'layer0/\\udc80' is not encodable as UTF-8"):
            call()
    with pytest.raises(ValueError, match="surrogate"):
        store.put(key, b"v")
    assert_empty(store)


# -- values ---------------------------------------------------------------------------


VALUES: dict[str, Any] = {
    "bytes": b"\x00\x01\x02 plain bytes",
    "bytearray": bytearray(range(256)) * 3,
    "memoryview": memoryview(b"abcdefgh" * 100),
    "memoryview-slice": memoryview(b"0123456789" * 100)[7:503],
    "memoryview-of-int32": memoryview(np.arange(10, dtype=np.int32)),
    "float16-3d": np.arange(2 * 3 * 700, dtype=np.float16).reshape(2, 3, 700),
    "float32-2d": np.linspace(-1, 1, 4000, dtype=np.float32).reshape(40, 100),
    "bfloat16-like-uint16": np.arange(5000, dtype=np.uint16),
    "int8": np.arange(-128, 128, dtype=np.int8),
    "bool": np.array([True, False, True]),
    "complex64": np.arange(7, dtype=np.complex64) * 1j,
    "big-endian-float32": np.arange(9, dtype=">f4"),
    "zero-dim": np.array(3.25, dtype=np.float64),
    "contiguous-slice": np.arange(100, dtype=np.float16).reshape(10, 10)[2:5],
}


@pytest.mark.parametrize("value", VALUES.values(), ids=VALUES.keys())
def test_buffer_values_round_trip_byte_exactly(store: KVStore, value: Any) -> None:
    expected = value.tobytes() if hasattr(value, "tobytes") else bytes(value)
    store.put("k", value)
    assert store.get("k") == expected
    info = store.info("k")
    assert info is not None
    assert info.payload_bytes == len(expected)


def test_numpy_value_reads_back_into_numpy(store: KVStore) -> None:
    kv = np.random.default_rng(7).standard_normal((2, 8, 16, 64)).astype(np.float16)
    store.put("layer0/block0", kv)
    out = np.empty_like(kv)
    assert store.get_into("layer0/block0", out) == kv.nbytes
    assert np.array_equal(out, kv)
    raw = store.get("layer0/block0")
    assert raw is not None
    assert np.array_equal(np.frombuffer(raw, dtype=np.float16).reshape(kv.shape), kv)


def test_value_is_copied_at_put(store: KVStore) -> None:
    value = bytearray(b"before" * 100)
    store.put("k", value)
    value[:6] = b"AFTER!"
    assert store.get("k") == b"before" * 100


@pytest.mark.parametrize(
    "value",
    [
        np.arange(100, dtype=np.float16)[::2],
        np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4)),
        np.arange(100, dtype=np.uint8).reshape(10, 10)[:, 3],
        memoryview(b"0123456789")[::2],
    ],
    ids=["strided", "fortran", "column", "strided-memoryview"],
)
def test_non_contiguous_value_is_value_error(store: KVStore, value: Any) -> None:
    with pytest.raises(ValueError, match="C-contiguous"):
        store.put("k", value)
    assert_empty(store)


@pytest.mark.parametrize(
    "value", ["a str", 42, None, 3.5, [1, 2], object()], ids=lambda v: type(v).__name__
)
def test_value_without_a_buffer_is_type_error(store: KVStore, value: Any) -> None:
    with pytest.raises(TypeError, match="buffer protocol"):
        store.put("k", value)
    assert_empty(store)


@pytest.mark.parametrize(
    "value", [b"", bytearray(), memoryview(b""), np.zeros(0, dtype=np.float16)], ids=type
)
def test_empty_value_is_value_error(store: KVStore, value: Any) -> None:
    with pytest.raises(ValueError, match="empty"):
        store.put("k", value)
    assert_empty(store)


def test_value_size_limit_is_max_page_bytes(store: KVStore) -> None:
    store.put("largest", b"\x07" * MAX_PAGE_BYTES)
    assert store.get("largest") == b"\x07" * MAX_PAGE_BYTES
    with pytest.raises(ValueError, match="max_page_bytes") as caught:
        store.put("too-big", b"\x07" * (MAX_PAGE_BYTES + 1))
    assert str(MAX_PAGE_BYTES + 1) in str(caught.value)
    with pytest.raises(ValueError, match="max_page_bytes"):
        store.put("too-big", np.zeros(MAX_PAGE_BYTES // 2 + 1, dtype=np.float16))
    assert "too-big" not in store
    assert len(store) == 1


# -- meta -----------------------------------------------------------------------------------


def test_meta_round_trips_as_json(store: KVStore) -> None:
    meta = {"dtype": "float16", "shape": [2, 8, 16], "ok": True, "none": None, "x": 0.5}
    store.put("k", b"v", meta=meta)
    info = store.info("k")
    assert info is not None
    assert dict(info.meta) == meta
    store.put("k", b"v2")  # an overwrite without meta carries none
    info = store.info("k")
    assert info is not None
    assert dict(info.meta) == {}


def test_meta_at_the_size_limit(store: KVStore) -> None:
    overhead = len(json.dumps({"m": ""}, separators=(",", ":")))
    largest = {"m": "x" * (2048 - overhead)}
    store.put("k", b"v", meta=largest)
    info = store.info("k")
    assert info is not None
    assert dict(info.meta) == largest
    with pytest.raises(ValueError, match="2048"):
        store.put("k2", b"v", meta={"m": "x" * (2049 - overhead)})
    with pytest.raises(ValueError, match="2048"):
        store.put("k2", b"v", meta={"m": "é" * 400})  # 400 chars, 2400 bytes as JSON escapes
    assert "k2" not in store


@pytest.mark.parametrize(
    "meta",
    [{"a": object()}, {"a": b"bytes"}, {"a": {1, 2}}, {"a": float("nan")}, ["not", "a", "map"]],
    ids=["object", "bytes", "set", "nan", "list"],
)
def test_meta_that_is_not_json_is_type_error(store: KVStore, meta: Any) -> None:
    with pytest.raises(TypeError, match="meta must"):
        store.put("k", b"v", meta=meta)
    assert_empty(store)


def nested(depth: int) -> Any:
    """A JSON list ``depth`` levels deep."""
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


def test_meta_nested_too_deeply_is_value_error(store: KVStore) -> None:
    """A 5,000-deep meta used to escape as a raw RecursionError."""
    deep: Any = {}
    for _ in range(5000):
        deep = {"a": deep}
    with pytest.raises(ValueError, match="meta nests deeper than 64 levels"):
        store.put("k", b"v", meta=deep)
    with pytest.raises(ValueError, match="meta nests deeper than 64 levels"):
        store.put("k", b"v", meta={"a": nested(64)})  # 65 with the outer object
    assert_empty(store)
    store.put("k", b"v", meta={"a": nested(63)})  # 64 levels: accepted, and read back
    info = store.info("k")
    assert info is not None
    assert dict(info.meta) == {"a": nested(63)}
    store.put("brackets", b"v", meta={"s": "[{" * 500})  # brackets in a string are no nesting
    assert store.get("brackets") == b"v"


# -- batches -------------------------------------------------------------------------------------

GOOD = [("a", b"1"), ("b", b"2"), ("c", b"3")]
BAD_ITEMS: dict[str, tuple[Any, type[Exception]]] = {
    "int-key": ((7, b"x"), TypeError),
    "empty-key": ((b"", b"x"), ValueError),
    "long-key": ((b"k" * 512, b"x"), ValueError),
    "surrogate-key": (("\udc80", b"x"), ValueError),
    "deep-meta": (("d", b"x", {"a": nested(64)}), ValueError),
    "str-value": (("d", "text"), TypeError),
    "empty-value": (("d", b""), ValueError),
    "too-big": (("d", b"x" * (MAX_PAGE_BYTES + 1)), ValueError),
    "strided": (("d", np.arange(10, dtype=np.uint8)[::2]), ValueError),
    "bad-meta": (("d", b"x", {"a": object()}), TypeError),
    "huge-meta": (("d", b"x", {"a": "y" * 3000}), ValueError),
    "not-a-tuple": (["d", b"x"], TypeError),
    "one-element": (("d",), TypeError),
}


@pytest.mark.parametrize("position", [0, 1, 3])
@pytest.mark.parametrize(("item", "error"), BAD_ITEMS.values(), ids=BAD_ITEMS.keys())
def test_a_bad_item_anywhere_stores_nothing_of_the_batch(
    store: KVStore, item: Any, error: type[Exception], position: int
) -> None:
    batch: list[Any] = list(GOOD)
    batch.insert(position, item)
    with pytest.raises(error):
        store.put_many(batch)
    assert_empty(store)
    assert store.get_many(["a", "b", "c", "d"]) == [None] * 4
    assert store.put_many(GOOD) == [True, True, True]  # the store is still usable
    assert store.get_many(["a", "b", "c"]) == [b"1", b"2", b"3"]


def test_put_many_accepts_any_iterable_and_optional_meta(store: KVStore) -> None:
    items = iter([("a", b"1"), ("b", b"2", None), ("c", b"3", {"n": 3})])
    assert store.put_many(items) == [True, True, True]
    assert store.put_many([]) == []
    info = store.info("c")
    assert info is not None
    assert dict(info.meta) == {"n": 3}
    assert store.get_many(["a", "b", "c"]) == [b"1", b"2", b"3"]


# -- a closed store -----------------------------------------------------------------------------


def closed_store_calls(store: KVStore) -> dict[str, Callable[[], object]]:
    """Every public method, called as a user would."""
    return {
        "put": lambda: store.put("k", b"v"),
        "put_many": lambda: store.put_many([("k", b"v")]),
        "get": lambda: store.get("k"),
        "get_many": lambda: store.get_many(["k"]),
        "get_into": lambda: store.get_into("k", bytearray(8)),
        "get_many_into": lambda: store.get_many_into(["k"], [bytearray(8)]),
        "put_many_async": lambda: store.put_many_async([("k", b"v")]),
        "get_many_async": lambda: store.get_many_async(["k"]),
        "get_many_into_async": lambda: store.get_many_into_async(["k"], [bytearray(8)]),
        "delete": lambda: store.delete("k"),
        "flush": store.flush,
        "checkpoint": store.checkpoint,
        "pin": lambda: store.pin("k"),
        "pin_many": lambda: store.pin_many(["k"]),
        "unpin": lambda: store.unpin("k"),
        "unpin_many": lambda: store.unpin_many(["k"]),
        "pinned": lambda: store.pinned(["k"]).__enter__(),
        "held_extents": lambda: store.held_extents(["k"]).__enter__(),
        "pin_count": lambda: store.pin_count("k"),
        "retain": lambda: store.retain("k"),
        "release": lambda: store.release("k"),
        "is_retained": lambda: store.is_retained("k"),
        "gc": store.gc,
        "check": store.check,
        "contains": lambda: "k" in store,
        "len": lambda: len(store),
        "keys": lambda: list(store.keys()),
        "info": lambda: store.info("k"),
        "stats": store.stats,
        "telemetry_snapshot": store.telemetry_snapshot,
        "wear": store.wear,
        "metrics_registry": store.metrics_registry,
        "segment_states": store.segment_states,
    }


def test_every_public_method_raises_closed_error_after_close(store: KVStore) -> None:
    store.put("k", b"v")
    assert store.retain("k")
    assert store.pin("k")
    calls = closed_store_calls(store)
    public = {
        name
        for name in dir(KVStore)
        if not name.startswith("_") and callable(getattr(KVStore, name)) and name != "open"
    }
    assert public - {"close"} <= set(calls) | {"__contains__", "__len__"}, "a new public method"
    store.close()
    answered = []
    for name, call in calls.items():
        try:
            call()
        except ClosedError as e:
            assert "is closed" in str(e)
        else:
            answered.append(name)
    assert answered == []
    store.close()  # idempotent
    assert "closed" in repr(store)


# -- keys an older build accepted ---------------------------------------------------------------


def test_a_wal_holding_an_overlong_key_recovers_with_a_note(
    open_store: Callable[..., KVStore], store_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before the limit was LMDB's, put took 512-1024 byte keys: every checkpoint then
    failed, close() raised and the WAL kept growing. Such a store now opens, drops the
    page with a note, and checkpoints again."""
    long_key = b"L" * 600
    # the old limit, in the put path's fast check and in the key check
    monkeypatch.setattr(store_module, "MAX_INDEX_KEY_BYTES", MAX_KEY_BYTES)
    monkeypatch.setattr(inputs_module, "MAX_INDEX_KEY_BYTES", MAX_KEY_BYTES)
    store = open_store(gc_interval_s=0)
    store.put("before", b"1")
    store.put(long_key, b"too long for LMDB")
    assert store.retain(long_key)
    store.put("after", b"2", sync=True)
    with pytest.raises(IOFailure, match="MDB_BAD_VALSIZE"):
        store.close()  # the old failure: the checkpoint cannot write the key
    monkeypatch.undo()

    reopened = open_store(create=False)
    assert any(
        "longer than the index's 511-byte limit" in note and "600 bytes" in note
        for note in reopened.recovery_notes
    ), reopened.recovery_notes
    assert reopened.get_many(["before", "after"]) == [b"1", b"2"]
    assert len(reopened) == 2
    assert sorted(reopened.keys()) == [b"after", b"before"]
    with pytest.raises(ValueError, match="511"):
        reopened.get(long_key)
    assert reopened.check() == []
    reopened.close()  # the checkpoint succeeds and rotates the WAL past the old records

    again = open_store(create=False)
    assert again.recovery_notes == []
    assert again.get_many(["before", "after"]) == [b"1", b"2"]
    assert again.check() == []

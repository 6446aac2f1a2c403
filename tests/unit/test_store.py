"""store.py: the public API, persistence across close and crash, locking, verification.

A crash is simulated by a child process that writes and then calls os._exit
without closing the store; the test process is the oracle (it keeps the
expected state outside the store) and checks every acknowledged page.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from kvstore import (
    FORMAT_VERSION,
    ClosedError,
    CorruptionError,
    FormatVersionError,
    KVStore,
    KVStoreError,
    LockedError,
    PageInfo,
    ReadOnlyError,
    StoreNotFoundError,
)
from kvstore.format.constants import BLOCK_BYTES, record_span
from kvstore.format.names import SUPERBLOCK_NAME, segment_path
from kvstore.format.wal import iter_records
from kvstore.log.wal import list_wal_files

REPO_ROOT = Path(__file__).resolve().parents[2]
# The geometry of the ``open_store`` fixture (tests/conftest.py).
SMALL_SEGMENT_BYTES = 1 << 20
SMALL_MAX_PAGE_BYTES = 256 << 10
SMALL = {"segment_bytes": SMALL_SEGMENT_BYTES, "max_page_bytes": SMALL_MAX_PAGE_BYTES}
OpenStore = Callable[..., KVStore]


def page(index: int, size: int = 3000) -> bytes:
    """Deterministic page content, different for every index."""
    seed = xxhash.xxh3_128_digest(b"page-%d" % index)
    return (seed * (size // len(seed) + 1))[:size]


# -- child processes (crash simulation, readers beside a writer) -------------------

_CHILD_PRELUDE = """
import json, os, sys
from kvstore import KVStore, ReadOnlyError
spec = json.load(sys.stdin)
"""

_CRASHING_WRITER = """
store = KVStore.open(spec["path"], **spec["options"])
for key, value, sync in spec["puts"]:
    store.put(key, bytes.fromhex(value), sync=sync)
for key in spec["deletes"]:
    store.delete(key)
if spec["checkpoint"]:
    store.checkpoint()
for key, value, sync in spec["puts_after"]:
    store.put(key, bytes.fromhex(value), sync=sync)
if spec["flush"]:
    store.flush()
print(json.dumps({"pid": os.getpid()}), flush=True)
os._exit(0)  # no close, no checkpoint: the store sees a crash
"""

_READER = """
store = KVStore.open(spec["path"], readonly=True)
out = {"values": {}, "refused": [], "len": len(store), "readonly": store.stats().readonly}
for key in spec["keys"]:
    value = store.get(key)
    out["values"][key] = None if value is None else value.hex()
for name, call in [
    ("put", lambda: store.put("new", b"x")),
    ("put_many", lambda: store.put_many([("new", b"x")])),
    ("delete", lambda: store.delete(spec["keys"][0])),
    ("checkpoint", lambda: store.checkpoint()),
]:
    try:
        call()
    except ReadOnlyError:
        out["refused"].append(name)
store.close()
print(json.dumps(out), flush=True)
"""


def run_child(script: str, spec: dict[str, Any]) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_CHILD_PRELUDE) + textwrap.dedent(script)],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr
    parsed: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return parsed


def crash_after_writes(
    path: Path,
    puts: list[tuple[str, bytes]],
    *,
    sync: bool = True,
    deletes: tuple[str, ...] = (),
    checkpoint: bool = False,
    puts_after: list[tuple[str, bytes]] | None = None,
    flush: bool = False,
    create: bool = True,
) -> None:
    """A child process opens the store, writes, and exits without closing it."""
    run_child(
        _CRASHING_WRITER,
        {
            "path": str(path),
            "options": {"create": create, **SMALL},
            "puts": [(key, value.hex(), sync) for key, value in puts],
            "deletes": list(deletes),
            "checkpoint": checkpoint,
            "puts_after": [(key, value.hex(), sync) for key, value in puts_after or []],
            "flush": flush,
        },
    )


def newest_wal_file(path: Path) -> Path:
    return list_wal_files(path)[-1][1]


def assert_contents(store: KVStore, expected: dict[str, bytes]) -> None:
    keys = sorted(expected)
    assert store.get_many(keys) == [expected[key] for key in keys]
    assert sorted(store.keys()) == sorted(key.encode() for key in keys)
    assert len(store) == len(expected)


# -- round trip ------------------------------------------------------------------------

ROUND_TRIP_SIZES = [1, 100, 4095, 4096, 4097, 65539, SMALL_MAX_PAGE_BYTES]


@pytest.mark.parametrize("direct_io", [True, False], ids=["direct", "buffered"])
def test_round_trip_with_each_engine_and_direct_mode(
    open_store: OpenStore,
    store_path: Path,
    engine_kind: str,
    direct_io: bool,
    direct_io_supported: bool,
) -> None:
    if direct_io and not direct_io_supported:
        pytest.skip("O_DIRECT is not supported here")
    options = {"io_engine": engine_kind, "direct_io": direct_io}
    expected = {f"page-{size}": page(size, size) for size in ROUND_TRIP_SIZES}
    store = open_store(**options)
    stats = store.stats()
    assert (stats.io_engine, stats.direct_io) == (engine_kind, direct_io)
    assert store.put_many(list(expected.items())) == [True] * len(expected)
    assert store.get_many([*expected, "absent"]) == [*expected.values(), None]
    for key, value in expected.items():
        info = store.info(key)
        assert info is not None
        assert info.payload_bytes == len(value)
        assert info.offset % BLOCK_BYTES == 0
    store.close()

    store = open_store(**options)
    assert (store.stats().io_engine, store.stats().direct_io) == (engine_kind, direct_io)
    assert_contents(store, expected)


def test_put_get_contains_len_keys(store: KVStore) -> None:
    assert len(store) == 0
    assert list(store.keys()) == []
    assert store.get(b"a") is None
    assert b"a" not in store
    assert store.put(b"a", b"alpha") is True
    assert store.put("b", b"beta") is True
    value = store.get(b"a")
    assert value == b"alpha"
    assert type(value) is bytes
    assert store.get("a") == b"alpha"  # str keys are their UTF-8 bytes
    assert store.get(b"b") == b"beta"
    assert b"a" in store
    assert "b" in store
    assert "c" not in store
    assert len(store) == 2
    assert sorted(store.keys()) == [b"a", b"b"]


def test_overwrite_returns_the_newest_value(open_store: OpenStore) -> None:
    store = open_store()
    lsns = []
    for version in range(4):
        store.put("k", page(version, 1000 + version))
        info = store.info("k")
        assert info is not None
        lsns.append(info.lsn)
    assert store.get("k") == page(3, 1003)
    assert lsns == sorted(set(lsns))
    assert len(store) == 1
    store.put_many([("j", b"first"), ("j", b"second"), ("j", b"third")])
    assert store.get("j") == b"third"
    assert len(store) == 2
    store.close()
    store = open_store()
    assert store.get("k") == page(3, 1003)
    assert store.get("j") == b"third"
    assert len(store) == 2


def test_delete(open_store: OpenStore) -> None:
    store = open_store()
    store.put_many([("a", b"1"), ("b", b"2"), ("c", b"3")])
    assert store.delete("b") is True
    assert store.delete("b") is False
    assert store.delete("never") is False
    assert store.get("b") is None
    assert "b" not in store
    assert store.info("b") is None
    assert len(store) == 2
    assert sorted(store.keys()) == [b"a", b"c"]
    store.close()
    store = open_store()
    assert_contents(store, {"a": b"1", "c": b"3"})
    store.put("b", b"again")
    assert store.get("b") == b"again"
    assert len(store) == 3


def test_get_many_keeps_order_duplicates_and_misses(store: KVStore) -> None:
    store.put_many([("a", b"AAA"), ("b", b"BB")])
    assert store.get_many(["b", "x", "a", "b", b"a"]) == [b"BB", None, b"AAA", b"BB", b"AAA"]
    assert store.get_many([]) == []
    assert store.get_many(iter(["a"])) == [b"AAA"]


def test_get_into_caller_buffers(store: KVStore) -> None:
    value = page(1, 5000)
    store.put("k", value)
    target = bytearray(b"\xee" * 6000)
    assert store.get_into("k", target) == 5000
    assert bytes(target[:5000]) == value
    assert bytes(target[5000:]) == b"\xee" * 1000
    array = np.zeros((10, 500), dtype=np.uint8)
    assert store.get_into(b"k", array) == 5000
    assert array.tobytes() == value
    halves = np.zeros(2500, dtype=np.float16)
    assert store.get_into("k", halves) == 5000
    assert halves.tobytes() == value
    untouched = bytearray(b"\x01" * 10)
    assert store.get_into("missing", untouched) is None
    assert untouched == bytearray(b"\x01" * 10)


def test_get_into_rejects_unusable_buffers(store: KVStore) -> None:
    store.put("k", b"x" * 100)
    with pytest.raises(ValueError, match="too small"):
        store.get_into("k", bytearray(99))
    with pytest.raises(TypeError, match="writable"):
        store.get_into("k", b"\x00" * 200)
    with pytest.raises(TypeError, match="buffer protocol"):
        store.get_into("k", [0] * 200)
    with pytest.raises(ValueError, match="C-contiguous"):
        store.get_into("k", np.zeros(400, dtype=np.uint8)[::2])


def test_get_many_into_fills_each_buffer(store: KVStore) -> None:
    values = [page(i, 3000 + 1000 * i) for i in range(5)]
    store.put_many([(f"k{i}", value) for i, value in enumerate(values)])
    targets = [bytearray(b"\xee" * 8000) for _ in range(6)]
    keys = ["k3", "missing", "k0", "k4", "k1", "k3"]
    got = store.get_many_into(keys, targets)
    assert got == [6000, None, 3000, 7000, 4000, 6000]
    for key, target, n in zip(keys, targets, got, strict=True):
        if n is None:
            assert target == bytearray(b"\xee" * 8000)  # a miss leaves the buffer alone
        else:
            assert bytes(target[:n]) == values[int(key[1:])]
            assert bytes(target[n:]) == b"\xee" * (8000 - n)
    arrays = [np.zeros(7000, dtype=np.uint8) for _ in range(2)]
    assert store.get_many_into(["k4", "k2"], arrays) == [7000, 5000]
    assert arrays[1][:5000].tobytes() == values[2]
    assert store.get_many_into([], []) == []


def test_get_many_into_checks_every_buffer_before_reading(store: KVStore) -> None:
    store.put_many([("a", b"a" * 100), ("b", b"b" * 200)])
    first = bytearray(100)
    with pytest.raises(ValueError, match="too small for page b'b'"):
        store.get_many_into(["a", "b"], [first, bytearray(199)])
    assert first == bytearray(100)  # nothing was read
    with pytest.raises(ValueError, match="2 keys but 1 buffers"):
        store.get_many_into(["a", "b"], [bytearray(300)])
    with pytest.raises(TypeError, match="writable"):
        store.get_many_into(["a"], [b"\x00" * 200])


def test_info_describes_the_page_exactly(store: KVStore) -> None:
    first, second = page(1, 5000), page(2, 10)
    store.put("first", first, meta={"dtype": "float16", "layer": 3, "shape": [2, 4]})
    store.put(b"second", second)
    info = store.info("first")
    assert isinstance(info, PageInfo)
    assert info.key == b"first"
    assert info.payload_bytes == 5000
    assert info.segment_id == 1
    assert info.offset == BLOCK_BYTES  # block 0 is the segment header
    assert info.checksum == xxhash.xxh3_64_intdigest(first)
    assert dict(info.meta) == {"dtype": "float16", "layer": 3, "shape": [2, 4]}
    other = store.info(b"second")
    assert other is not None
    assert other.offset == BLOCK_BYTES + record_span(5000)
    assert other.segment_id == info.segment_id
    assert other.generation == info.generation
    assert other.lsn > info.lsn
    assert dict(other.meta) == {}
    assert store.info("missing") is None


def test_stats_counts_exactly(store: KVStore, store_path: Path) -> None:
    store.put_many([("a", b"x" * 10), ("b", b"y" * 20)])
    store.get("a")
    store.get("b")
    store.get("missing")
    store.get_many(["a", "nope"])
    store.delete("b")
    stats = store.stats()
    assert stats.path == str(store_path)
    assert stats.format_version == FORMAT_VERSION
    assert stats.readonly is False
    assert stats.pages == 1
    assert stats.segments == 1
    assert stats.segment_bytes == SMALL_SEGMENT_BYTES
    assert stats.active_segment_id == 1
    counters = stats.counters
    assert counters["puts"] == 2
    assert counters["host_bytes_written"] == 30
    assert counters["segment_bytes_written"] == 2 * record_span(10)
    assert (counters["gets"], counters["hits"], counters["misses"]) == (5, 3, 2)
    assert counters["bytes_read"] == 10 + 20 + 10
    assert counters["deletes"] == 1
    assert stats.as_dict()["pages"] == 1


def test_put_is_durable_at_flush_or_with_sync(open_store: OpenStore) -> None:
    store = open_store(flush_interval_ms=600_000)  # no background commit during the test
    store.put("lazy", b"1")
    lazy = store.info("lazy")
    assert lazy is not None
    assert store.stats().durable_lsn < lazy.lsn
    commits = store.stats().counters["commits"]
    store.flush()
    assert store.stats().durable_lsn >= lazy.lsn
    assert store.stats().counters["commits"] == commits + 1
    store.flush()  # nothing new: no commit
    assert store.stats().counters["commits"] == commits + 1
    store.put("eager", b"2", sync=True)
    eager = store.info("eager")
    assert eager is not None
    assert store.stats().durable_lsn >= eager.lsn
    assert store.stats().counters["commits"] == commits + 2


# -- persistence: close, checkpoint, crash ------------------------------------------------


def test_reopen_after_close_keeps_pages_meta_and_deletes(open_store: OpenStore) -> None:
    store = open_store()
    expected = {f"k{index}": page(index, 700 * index + 1) for index in range(20)}
    store.put_many(list(expected.items()))
    store.put("meta", b"m", meta={"tokens": 16, "model": "llama"})
    for index in range(0, 20, 3):
        assert store.delete(f"k{index}") is True
        del expected[f"k{index}"]
    expected["meta"] = b"m"
    store.close()
    store = open_store()
    assert_contents(store, expected)
    info = store.info("meta")
    assert info is not None
    assert dict(info.meta) == {"tokens": 16, "model": "llama"}
    assert store.stats().overlay_entries == 0  # close checkpointed everything into LMDB


def test_checkpoint_then_reopen(open_store: OpenStore, store_path: Path) -> None:
    store = open_store()
    store.put_many([("a", b"1"), ("b", b"2"), ("c", b"3")])
    before = store.stats()
    store.checkpoint()
    after = store.stats()
    assert after.overlay_entries == 0
    assert after.checkpoint_lsn > before.checkpoint_lsn
    assert after.counters["checkpoints"] == before.counters["checkpoints"] + 1
    assert [first for first, _ in list_wal_files(store_path)] == [after.checkpoint_lsn]
    assert store.get_many(["a", "b", "c"]) == [b"1", b"2", b"3"]  # now read through LMDB
    store.put("a", b"new")
    store.delete("b")
    store.put("d", b"4")
    store.close()
    store = open_store()
    assert_contents(store, {"a": b"new", "c": b"3", "d": b"4"})


def test_many_pages_across_several_segments(open_store: OpenStore) -> None:
    options = {"segment_bytes": 64 << 10, "max_page_bytes": 16 << 10}
    store = open_store(**options)
    sizes = [1 + (index * 977) % (16 << 10) for index in range(60)]
    expected = {f"page/{index:03d}": page(index, size) for index, size in enumerate(sizes)}
    for key, value in expected.items():
        store.put(key, value)
    infos = [store.info(key) for key in expected]
    assert all(info is not None for info in infos)
    used = {info.segment_id for info in infos if info is not None}
    assert len(used) >= 8
    assert store.stats().segments == len(used)
    assert_contents(store, expected)
    store.close()
    store = open_store(**options)
    assert_contents(store, expected)
    assert store.stats().segment_bytes == 64 << 10


def test_geometry_comes_from_the_superblock(open_store: OpenStore) -> None:
    open_store().close()
    store = open_store(segment_bytes=4 << 20, max_page_bytes=1 << 20)
    assert store.stats().segment_bytes == SMALL_SEGMENT_BYTES
    with pytest.raises(ValueError, match="max_page_bytes"):
        store.put("big", b"x" * (SMALL_MAX_PAGE_BYTES + 1))


def test_crash_keeps_acknowledged_pages(open_store: OpenStore, store_path: Path) -> None:
    expected = {f"sync-{index}": page(index, 100 + 1500 * index) for index in range(8)}
    crash_after_writes(store_path, list(expected.items()))
    store = open_store()
    assert_contents(store, expected)
    store.put("after", b"recovery")
    store.close()
    store = open_store()
    assert_contents(store, {**expected, "after": b"recovery"})


def test_crash_keeps_flushed_pages_and_deletes(open_store: OpenStore, store_path: Path) -> None:
    puts = [(f"k{index}", page(index)) for index in range(6)]
    crash_after_writes(store_path, puts, sync=False, deletes=("k1", "k4"), flush=True)
    store = open_store()
    assert_contents(store, {key: value for key, value in puts if key not in ("k1", "k4")})


def test_crash_after_a_checkpoint_replays_the_rest(open_store: OpenStore, store_path: Path) -> None:
    before = [(f"old-{index}", page(index)) for index in range(4)]
    after = [("old-0", b"overwritten"), ("new", page(99))]
    crash_after_writes(store_path, before, deletes=("old-3",), checkpoint=True, puts_after=after)
    store = open_store()
    expected = dict(before)
    del expected["old-3"]
    expected.update(after)
    assert_contents(store, expected)


def test_crash_in_a_later_session_keeps_both_sessions(
    open_store: OpenStore, store_path: Path
) -> None:
    store = open_store()
    store.put_many([("first", b"session one"), ("shared", b"old")])
    store.close()
    crash_after_writes(store_path, [("second", b"session two"), ("shared", b"new")])
    store = open_store()
    assert_contents(store, {"first": b"session one", "second": b"session two", "shared": b"new"})


# A writer names its WAL file, and each checkpoint's file, with an LSN. A session
# that writes nothing never extends the LSN lease, so a reopen that started again
# at the lease reissued those LSNs: the next session's WAL file was skipped (and
# deleted) by recovery, or its creation failed with EEXIST. Found by these tests
# at c479881; recovery now starts past every LSN named by a WAL file.


def test_crash_after_an_idle_session_keeps_acknowledged_pages(
    open_store: OpenStore, store_path: Path
) -> None:
    open_store().close()  # a session that wrote nothing
    crash_after_writes(store_path, [("acknowledged", b"synced before the crash")], create=False)
    store = open_store()
    assert store.get("acknowledged") == b"synced before the crash"
    store.close()
    crash_after_writes(store_path, [("second", b"crash")], create=False)
    store = open_store()
    assert_contents(store, {"acknowledged": b"synced before the crash", "second": b"crash"})


def test_idle_sessions_open_and_close_cleanly(open_store: OpenStore, store_path: Path) -> None:
    for _ in range(4):
        open_store().close()
    store = open_store()
    store.put("k", b"v")
    store.close()
    for _ in range(3):
        open_store().close()
    store = open_store()
    assert_contents(store, {"k": b"v"})
    assert len(list_wal_files(store_path)) >= 1


def test_reopen_after_a_writer_crashed_before_writing(
    open_store: OpenStore, store_path: Path
) -> None:
    store = open_store()
    store.put("kept", b"value")
    store.close()
    crash_after_writes(store_path, [], create=False)
    crash_after_writes(store_path, [], create=False)
    store = open_store()
    assert store.get("kept") == b"value"
    store.put("more", b"after", sync=True)
    store.close()
    assert_contents(open_store(), {"kept": b"value", "more": b"after"})


def test_failed_put_does_not_wedge_close(open_store: OpenStore, monkeypatch: Any) -> None:
    store = open_store()
    store.put("before", b"kept")

    def no_memory(size: int) -> object:
        raise MemoryError("injected: no buffer")

    monkeypatch.setattr(store.internals.buffers, "acquire", no_memory)
    with pytest.raises(MemoryError):
        store.put("failed", b"x")
    monkeypatch.undo()
    closer = threading.Thread(target=store.close, daemon=True)
    closer.start()
    closer.join(timeout=3)
    assert not closer.is_alive(), "close() is stuck waiting for a put that never started"


def test_concurrent_writers_and_readers(open_store: OpenStore) -> None:
    store = open_store()
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            for index in range(25):
                key = f"w{worker}/{index}"
                store.put(key, page(worker * 100 + index, 2000 + index), sync=index % 10 == 0)
                assert store.get(key) == page(worker * 100 + index, 2000 + index)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=work, args=(worker,)) for worker in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    expected = {
        f"w{worker}/{index}": page(worker * 100 + index, 2000 + index)
        for worker in range(4)
        for index in range(25)
    }
    assert_contents(store, expected)
    store.close()
    assert_contents(open_store(), expected)


# -- torn WAL tails ------------------------------------------------------------------------


def crash_with_three_synced_puts(store_path: Path) -> dict[str, bytes]:
    puts = {"p0": page(0), "p1": page(1), "p2": page(2)}
    crash_after_writes(store_path, list(puts.items()))
    return puts


def test_torn_tail_record_is_absent_after_reopen(open_store: OpenStore, store_path: Path) -> None:
    puts = crash_with_three_synced_puts(store_path)
    wal = newest_wal_file(store_path)
    data = wal.read_bytes()
    records = iter_records(data).records
    last_start = records[-2].end_offset  # the last record is the PUT of p2
    wal.write_bytes(data[: last_start + (records[-1].end_offset - last_start) // 2])
    store = open_store()
    assert store.get_many(["p0", "p1", "p2"]) == [puts["p0"], puts["p1"], None]
    assert len(store) == 2
    assert wal.stat().st_size == last_start  # the writer cut the torn tail off
    store.put("p3", b"after the tear")
    store.close()
    store = open_store()
    assert_contents(store, {"p0": puts["p0"], "p1": puts["p1"], "p3": b"after the tear"})


@pytest.mark.parametrize(
    "tail", [bytes(4096), b"\x5a" * 777, bytes(13)], ids=["zero-block", "garbage", "few-zeros"]
)
def test_junk_after_the_last_record_is_ignored(
    open_store: OpenStore, store_path: Path, tail: bytes
) -> None:
    puts = crash_with_three_synced_puts(store_path)
    wal = newest_wal_file(store_path)
    size = wal.stat().st_size
    with open(wal, "ab") as handle:
        handle.write(tail)
    store = open_store()
    assert_contents(store, puts)
    assert wal.stat().st_size == size


def test_corrupt_record_before_valid_ones_refuses_to_open(store_path: Path) -> None:
    """Two damaged bytes: the record cannot be read, and what it changed (it could
    be a delete) cannot be vouched for."""
    crash_with_three_synced_puts(store_path)
    wal = newest_wal_file(store_path)
    data = bytearray(wal.read_bytes())
    records = iter_records(bytes(data)).records
    data[records[-2].end_offset - 3] ^= 0xFF  # inside the PUT of p1; p2 follows intact
    data[records[-2].end_offset - 12] ^= 0x01
    wal.write_bytes(bytes(data))
    with pytest.raises(CorruptionError, match="kvstore recover"):
        KVStore.open(store_path, **SMALL)


def test_one_damaged_byte_in_a_record_is_undone_at_open(
    open_store: OpenStore, store_path: Path
) -> None:
    puts = crash_with_three_synced_puts(store_path)
    wal = newest_wal_file(store_path)
    data = bytearray(wal.read_bytes())
    records = iter_records(bytes(data)).records
    data[records[-2].end_offset - 3] ^= 0xFF  # inside the PUT of p1; p2 follows intact
    wal.write_bytes(bytes(data))
    store = open_store()
    assert_contents(store, puts)
    stats = store.stats()
    assert stats.degraded and "one damaged byte, undone" in stats.degraded_reasons[0]
    assert stats.quarantined_pages == 0


# -- readers and writers ---------------------------------------------------------------------


def test_readonly_beside_a_writer_sees_synced_data(open_store: OpenStore, store_path: Path) -> None:
    writer = open_store()
    writer.put_many([("a", b"alpha"), ("b", b"beta")], sync=True)
    seen = run_child(_READER, {"path": str(store_path), "keys": ["a", "b", "zzz"]})
    assert seen["values"] == {"a": b"alpha".hex(), "b": b"beta".hex(), "zzz": None}
    assert seen["len"] == 2
    assert seen["readonly"] is True
    assert seen["refused"] == ["put", "put_many", "delete", "checkpoint"]
    writer.put("c", b"gamma")  # the writer is unaffected
    assert writer.get_many(["a", "c"]) == [b"alpha", b"gamma"]


def test_readonly_open_refuses_writes(open_store: OpenStore, store_path: Path) -> None:
    writer = open_store()
    writer.put("a", b"alpha")
    writer.close()
    reader = KVStore.open(store_path, readonly=True)
    try:
        assert reader.get("a") == b"alpha"
        assert reader.stats().readonly is True
        for call in (
            lambda: reader.put("b", b"x"),
            lambda: reader.put_many([("b", b"x")]),
            lambda: reader.delete("a"),
            lambda: reader.checkpoint(),
        ):
            with pytest.raises(ReadOnlyError):
                call()
        reader.flush()  # nothing to make durable: a no-op
        assert reader.get("a") == b"alpha"
        assert "b" not in reader
    finally:
        reader.close()


def test_readonly_open_in_the_writers_process_is_not_called_corruption(
    open_store: OpenStore, store_path: Path
) -> None:
    writer = open_store()
    writer.put("a", b"alpha", sync=True)
    try:
        reader = KVStore.open(store_path, readonly=True)
    except KVStoreError as error:
        assert not isinstance(error, CorruptionError), str(error)
    else:
        with reader:
            assert reader.get("a") == b"alpha"


def test_second_writer_is_locked_out_naming_the_pid(
    open_store: OpenStore, store_path: Path
) -> None:
    first = open_store()
    with pytest.raises(LockedError, match=f"pid {os.getpid()}"):
        KVStore.open(store_path, **SMALL)
    first.put("still", b"works")
    first.close()
    second = open_store()
    assert second.get("still") == b"works"


def test_open_missing_store(tmp_path: Path) -> None:
    with pytest.raises(StoreNotFoundError):
        KVStore.open(tmp_path / "nothing")
    with pytest.raises(StoreNotFoundError):
        KVStore.open(tmp_path / "nothing", create=True, readonly=True)
    assert not (tmp_path / "nothing").exists()


def test_create_refuses_a_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_bytes(b"mine")
    with pytest.raises(ValueError, match="not empty"):
        KVStore.open(tmp_path / "busy", create=True, **SMALL)
    assert (tmp_path / "busy" / "file").read_bytes() == b"mine"


def test_create_into_an_existing_empty_directory(open_store: OpenStore, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    store = open_store(tmp_path / "empty")
    store.put("k", b"v")
    assert store.get("k") == b"v"
    assert not [p for p in tmp_path.iterdir() if ".creating" in p.name]


def test_bad_options(store_path: Path) -> None:
    with pytest.raises(TypeError, match="unknown store option"):
        KVStore.open(store_path, create=True, no_such_option=1)
    with pytest.raises(ValueError, match="segment_bytes"):
        KVStore.open(store_path, create=True, segment_bytes=5000)
    with pytest.raises(ValueError, match="fit in a segment"):
        KVStore.open(store_path, create=True, segment_bytes=1 << 20, max_page_bytes=1 << 20)
    assert not store_path.exists()  # validated before anything is created
    with pytest.raises(ValueError, match="io_engine"):
        KVStore.open(store_path, create=True, io_engine="spdk", **SMALL)


def test_damaged_superblock_refuses_to_open(open_store: OpenStore, store_path: Path) -> None:
    open_store().close()
    superblock = store_path / SUPERBLOCK_NAME
    data = bytearray(superblock.read_bytes())
    data[40] ^= 0x01
    superblock.write_bytes(bytes(data))
    with pytest.raises(CorruptionError, match="superblock"):
        KVStore.open(store_path)


def test_superblock_of_another_version_refuses_to_open(
    open_store: OpenStore, store_path: Path
) -> None:
    from kvstore.format.records import decode_superblock, encode_superblock

    open_store().close()
    superblock = store_path / SUPERBLOCK_NAME
    current = decode_superblock(superblock.read_bytes())
    newer = type(current)(
        current.store_uuid,
        current.created_unix_ns,
        current.segment_bytes,
        current.max_page_bytes,
        current.capacity_bytes,
        FORMAT_VERSION + 1,
    )
    superblock.write_bytes(encode_superblock(newer))
    with pytest.raises(FormatVersionError):
        KVStore.open(store_path)


# -- closed stores -----------------------------------------------------------------------------

CALLS_AFTER_CLOSE: dict[str, Callable[[KVStore], object]] = {
    "put": lambda s: s.put("k", b"v"),
    "put_many": lambda s: s.put_many([("k", b"v")]),
    "get": lambda s: s.get("k"),
    "get_many": lambda s: s.get_many(["k"]),
    "get_into": lambda s: s.get_into("k", bytearray(10)),
    "delete": lambda s: s.delete("k"),
    "contains": lambda s: "k" in s,
    "len": lambda s: len(s),
    "keys": lambda s: s.keys(),
    "info": lambda s: s.info("k"),
    "stats": lambda s: s.stats(),
    "flush": lambda s: s.flush(),
    "checkpoint": lambda s: s.checkpoint(),
}


@pytest.mark.parametrize("call", CALLS_AFTER_CLOSE.values(), ids=CALLS_AFTER_CLOSE.keys())
def test_every_method_raises_closed_error_after_close(
    store: KVStore, call: Callable[[KVStore], object]
) -> None:
    store.put("k", b"v")
    store.close()
    with pytest.raises(ClosedError):
        call(store)
    store.close()  # idempotent


def test_context_manager_closes(store_path: Path) -> None:
    with KVStore.open(store_path, create=True, **SMALL) as store:
        store.put("k", b"v")
    with pytest.raises(ClosedError):
        store.get("k")
    assert "closed" in repr(store)
    with KVStore.open(store_path) as store:
        assert store.get("k") == b"v"


# -- corruption on disk ---------------------------------------------------------------------


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        original = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([original[0] ^ 0x20]))
        handle.flush()
        os.fsync(handle.fileno())


@pytest.mark.parametrize("direct_io", [True, False], ids=["direct", "buffered"])
def test_flipped_payload_byte_is_caught_and_named(
    open_store: OpenStore, store_path: Path, direct_io: bool, direct_io_supported: bool
) -> None:
    if direct_io and not direct_io_supported:
        pytest.skip("O_DIRECT is not supported here")
    store = open_store(direct_io=direct_io)
    values = {"before": page(1, 9000), "victim": page(2, 9000), "after": page(3, 9000)}
    store.put_many(list(values.items()), sync=True)
    info = store.info("victim")
    assert info is not None
    flip_byte(segment_path(store_path, info.segment_id), info.offset + BLOCK_BYTES + 4500)
    with pytest.raises(CorruptionError) as caught:
        store.get("victim")
    message = str(caught.value)
    assert "b'victim'" in message
    assert f"segment {info.segment_id}" in message
    assert f"offset {info.offset}" in message
    assert "payload checksum mismatch" in message
    with pytest.raises(CorruptionError, match="victim"):
        store.get_many(["before", "victim"])
    with pytest.raises(CorruptionError, match="victim"):
        store.get_into("victim", bytearray(9000))
    assert store.get_many(["before", "after"]) == [values["before"], values["after"]]
    assert store.get("before") == values["before"]


@pytest.mark.parametrize("header_offset", [0, 30, 64, 4090], ids=["magic", "lsn", "key", "sum"])
def test_flipped_record_header_byte_is_caught(
    open_store: OpenStore, store_path: Path, header_offset: int
) -> None:
    store = open_store()
    store.put_many([("victim", page(5, 100)), ("bystander", page(6, 100))], sync=True)
    info = store.info("victim")
    assert info is not None
    flip_byte(segment_path(store_path, info.segment_id), info.offset + header_offset)
    with pytest.raises(CorruptionError) as caught:
        store.get("victim")
    assert "b'victim'" in str(caught.value)
    assert f"offset {info.offset}" in str(caught.value)
    assert store.get("bystander") == page(6, 100)


def test_record_copied_over_another_page_is_caught(open_store: OpenStore, store_path: Path) -> None:
    """A misdirected write: a whole, valid record of another page at this location."""
    store = open_store()
    store.put_many([("a", page(7, 6000)), ("b", page(8, 6000))], sync=True)
    a, b = store.info("a"), store.info("b")
    assert a is not None and b is not None
    path = segment_path(store_path, a.segment_id)
    span = record_span(6000)
    with open(path, "r+b") as handle:
        handle.seek(a.offset)
        record = handle.read(span)
        handle.seek(b.offset)
        handle.write(record)
        handle.flush()
        os.fsync(handle.fileno())
    with pytest.raises(CorruptionError, match="not this page"):
        store.get("b")
    assert store.get("a") == page(7, 6000)


def test_an_entry_naming_a_missing_segment_is_corruption_not_a_hang(store: KVStore) -> None:
    """A damaged or hostile index entry that names a segment the store does not
    have must end in CorruptionError; a read once retried it forever (found by the
    hostile-store fuzzer)."""
    import dataclasses

    store.put_many([("good", b"g" * 100), ("bad", b"b" * 100)])
    entry = store.internals.entry(b"bad")
    assert entry is not None
    with store.internals.state.lock:
        store.internals.state.table.active[b"bad"] = dataclasses.replace(entry, segment_id=999_999)
    result: list[object] = []

    def read() -> None:
        try:
            result.append(store.get("bad"))
        except KVStoreError as e:
            result.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "get() spun on an entry naming a missing segment"
    assert isinstance(result[0], CorruptionError)
    assert "999999" in str(result[0]) and "kvstore recover" in str(result[0])
    with pytest.raises(CorruptionError):
        store.get_many(["good", "bad"])
    assert store.get("good") == b"g" * 100  # nothing was left held or broken
    assert store.internals.segment_reads() == {}


def test_stats_counters_are_this_opens_growth_of_the_telemetry_vector(
    open_store: OpenStore,
) -> None:
    """One set of counters: ``stats().counters`` is what the persisted telemetry
    vector grew by since this open, so the two can never disagree."""
    from kvstore.telemetry import counters as tc

    store = open_store(gc_interval_s=0)
    for i in range(3):
        store.put(f"k{i}", b"x" * 100)
    store.close()
    store = open_store(create=False, gc_interval_s=0)
    at_open = store.telemetry_snapshot().values
    assert store.stats().counters["puts"] == 0
    store.put("k9", b"y" * 50)
    store.get("k9")
    store.get("absent")
    store.flush()
    counters = store.stats().counters
    now = store.telemetry_snapshot().values

    def grown(index: int) -> int:
        return now[index] - at_open[index]

    assert at_open[tc.PUTS] == 3 and now[tc.PUTS] == 4
    assert counters["puts"] == grown(tc.PUTS) == 1
    assert counters["host_bytes_written"] == grown(tc.HOST) == 50
    assert counters["segment_bytes_written"] == record_span(50)
    assert (counters["gets"], counters["hits"], counters["misses"]) == (2, 1, 1)
    assert counters["commits"] == grown(tc.COMMITS) >= 1
    assert counters["wal_bytes_written"] == grown(tc.WAL) > 0


def test_internals_report_the_prepared_spare_segment(open_store: OpenStore) -> None:
    """``KVStore.internals``: the typed view tests and tools use instead of private
    attributes. The prepare thread makes the next segment file ahead of the writer."""
    store = open_store(gc_interval_s=0)
    store.put("a", b"x", sync=True)  # leases LSNs: a spare needs ids to take
    spare = store.internals.wait_for_spare(20)
    assert spare is not None
    segment_id, path = spare
    assert path.exists() and path.parent.name == "segments"
    assert segment_id not in store.segment_states()  # made ahead, not in use yet
    assert store.internals.spare_segment() == spare


def test_internals_writers_frozen_holds_a_put_until_it_ends(open_store: OpenStore) -> None:
    """The one writer barrier (checkpoint, mark-and-sweep and fsck use it): a put
    started inside waits until the block ends, then lands."""
    store = open_store(gc_interval_s=0)
    store.put("before", b"1")
    done = threading.Event()

    def writer() -> None:
        store.put("during", b"2")
        done.set()

    with store.internals.writers_frozen():
        thread = threading.Thread(target=writer)
        thread.start()
        assert not done.wait(0.3), "a put went through the freeze"
        assert store.internals.entry(b"during") is None
    thread.join(10)
    assert done.is_set() and store.get("during") == b"2"
    assert set(store.internals.overlay()) >= {b"before", b"during"}

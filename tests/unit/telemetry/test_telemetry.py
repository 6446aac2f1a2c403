"""Telemetry counters: a known workload counted to the byte, hourly buckets,
persistence across reopen, retention, and a damaged telemetry state.

The expected numbers come from the workload and from the files on disk (WAL and
segment files), not from the counters themselves.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lmdb
import pytest

from kvstore import KVStore
from kvstore.format.constants import BLOCK_BYTES, record_span
from kvstore.format.wal import WAL_FILE_HEADER_BYTES
from kvstore.telemetry import counters as tc
from kvstore.telemetry import read_snapshot
from kvstore.telemetry.counters import COUNTER_NAMES, STATE_KEY, TELEMETRY_DB
from tests.conftest import OpenStore

HOUR = 3600
T0 = 500_000 * HOUR + 60.0  # one minute into a clock hour
CAPACITY = 1 << 30
QUIET = {  # no background work that would write at a time the test does not choose
    "checkpoint_interval_s": 1e6,
    "checkpoint_wal_bytes": 1 << 30,
    "gc_interval_s": 0,
    "telemetry_flush_interval_s": 3600.0,
}


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def wal_bytes_on_disk(root: Path) -> int:
    return sum(path.stat().st_size for path in (root / "wal").glob("*.wal"))


def wait_for_spare(store: KVStore) -> None:
    """The prepare thread makes the next segment file in the background; wait for it."""
    assert store.internals.wait_for_spare(20) is not None, "no spare segment was prepared"


def put_wal_bytes(key: bytes, meta: dict[str, object] | None) -> int:
    """A WAL PUT record: 20-byte frame header + 44-byte body + key + meta + 8 checksum."""
    meta_bytes = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode() if meta else b""
    return 20 + 44 + len(key) + len(meta_bytes) + 8


def test_known_workload_counts_every_byte_exactly(open_store: OpenStore, store_path: Path) -> None:
    clock = FakeClock(T0)
    store = open_store(telemetry_clock=clock, drive_capacity_bytes=CAPACITY, **QUIET)
    at_open = store.telemetry_snapshot().counters()
    # A new store's counters start at its first open, which wrote one WAL file header.
    assert at_open == {name: 0 for name in COUNTER_NAMES} | {"wal_bytes": WAL_FILE_HEADER_BYTES}
    wal_at_open = wal_bytes_on_disk(store_path)

    sizes = [1, 4095, 4096, 4097, 10_000, 65_536, 200_000, 123]
    workload = []
    for index in range(40):
        key = f"req{index % 30}/layer{index % 2}".encode()  # 10 overwrites
        meta = {"tokens": index, "dtype": "fp16"} if index % 3 == 0 else None
        workload.append((key, bytes([index]) * sizes[index % len(sizes)], meta))
    store.put_many(workload[:25])
    for key, value, meta in workload[25:]:
        assert store.put(key, value, meta=meta)
    deleted = [b"req0/layer0", b"req5/layer1", b"missing"]
    results = [store.delete(key) for key in deleted]
    assert results == [True, True, False]
    assert store.get(b"req1/layer1") is not None
    assert store.get(b"req0/layer0") is None
    store.flush()
    wait_for_spare(store)
    clock.now = T0 + 600

    snapshot = store.telemetry_snapshot()
    counters = snapshot.counters()
    host = sum(len(value) for _, value, _ in workload)
    overhead = sum(record_span(len(value)) - len(value) for _, value, _ in workload)
    segment_files = list((store_path / "segments").glob("*.seg"))
    wal_on_disk = WAL_FILE_HEADER_BYTES + wal_bytes_on_disk(store_path) - wal_at_open
    # The same WAL bytes from the record layouts in docs/format.md:
    opened_segments = len(segment_files) - 1  # all but the spare were named by SEGMENT_OPEN
    wal_by_format = (
        WAL_FILE_HEADER_BYTES
        + 36  # one LSN_LEASE record before the first put
        + 44 * opened_segments
        + sum(put_wal_bytes(key, meta) for key, _, meta in workload)
        + sum(20 + 2 + len(key) + 8 for key in deleted[:2])  # DELETE records
    )
    assert wal_on_disk == wal_by_format
    expected = {
        "host_bytes": host,
        "record_overhead_bytes": overhead,
        "segment_header_bytes": BLOCK_BYTES * len(segment_files),
        "gc_copy_bytes": 0,
        "wal_bytes": wal_on_disk,
        "index_bytes": 0,
        "telemetry_bytes": 0,
        "puts": 40,
        "deletes": 2,
        "gets": 2,
        "hits": 1,
        "misses": 1,
        "read_bytes": len(workload[31][1]),  # the newest version of req1/layer1
    }
    assert {name: counters[name] for name in expected} == expected
    store_bytes = host + overhead + BLOCK_BYTES * len(segment_files) + wal_on_disk

    wear = snapshot.wear_report()
    assert (wear.host_bytes, wear.store_bytes) == (host, store_bytes)
    assert wear.write_amplification == store_bytes / host
    expected_dwpd = store_bytes / CAPACITY * 86_400 / 600  # 600 s of counting so far
    assert wear.dwpd == pytest.approx(
        {"1h": expected_dwpd, "24h": expected_dwpd, "7d": expected_dwpd}, rel=1e-12
    )
    stats = store.stats().as_dict()
    assert stats["host_bytes"] == host
    assert stats["write_amplification"] == store_bytes / host
    assert stats["dwpd"] == pytest.approx(wear.dwpd, rel=1e-12)


def test_gc_copies_are_counted_exactly(open_store: OpenStore, store_path: Path) -> None:
    store = open_store(**QUIET)
    pages = {f"p{index:02d}": bytes([index]) * 100_000 for index in range(12)}
    store.put_many(list(pages.items()))
    first_segment = store.info("p00").segment_id  # type: ignore[union-attr]
    in_first = [key for key in pages if store.info(key).segment_id == first_segment]  # type: ignore[union-attr]
    for key in in_first[:6]:
        store.delete(key)
    store.flush()
    where = {key: store.info(key).segment_id for key in pages if key not in in_first[:6]}  # type: ignore[union-attr]
    before = store.telemetry_snapshot().counters()
    report = store.gc()
    after = store.telemetry_snapshot().counters()
    moved = [key for key, segment in where.items() if store.info(key).segment_id != segment]  # type: ignore[union-attr]
    assert len(moved) == len(in_first) - 6 > 0
    assert after["gc_copy_bytes"] - before["gc_copy_bytes"] == len(moved) * record_span(100_000)
    assert after["gc_moved_pages"] - before["gc_moved_pages"] == len(moved) == report.pages_moved
    assert after["segments_freed"] - before["segments_freed"] == report.segments_freed >= 1
    assert after["gc_passes"] - before["gc_passes"] == 1
    assert after["host_bytes"] == before["host_bytes"]  # GC is not host traffic
    for key in where:
        assert store.get(key) == pages[key]


def test_counters_survive_close_and_reopen(open_store: OpenStore, store_path: Path) -> None:
    store = open_store(**QUIET)
    store.put_many([(f"k{index}", b"v" * 5000) for index in range(10)])
    store.get("k1")
    before_close = store.telemetry_snapshot().counters()
    store.close()
    persisted = read_snapshot(store_path).counters()
    for name in ("host_bytes", "record_overhead_bytes", "puts", "gets", "hits"):
        assert persisted[name] == before_close[name]
    assert persisted["checkpoints"] == before_close["checkpoints"] + 1
    assert persisted["index_bytes"] > before_close["index_bytes"] + BLOCK_BYTES  # LMDB pages
    # A reader opened beside nothing sees the same; a new writer continues from there.
    reopened = open_store(create=False, **QUIET)
    assert reopened.telemetry_snapshot().counter("host_bytes") == 50_000
    reopened.put("more", b"x" * 777)
    assert reopened.telemetry_snapshot().counter("host_bytes") == 50_777
    assert reopened.telemetry_snapshot().counter("puts") == 11


def test_hourly_buckets_add_up_and_expire(open_store: OpenStore, store_path: Path) -> None:
    clock = FakeClock(T0)
    store = open_store(telemetry_clock=clock, drive_capacity_bytes=CAPACITY, **QUIET)
    store.put("a", b"a" * 1000)
    store.telemetry_snapshot()
    clock.now = T0 + HOUR
    store.telemetry_snapshot()  # closes the first hour
    store.put("b", b"b" * 3000)
    store.put("c", b"c" * 5000)
    clock.now = T0 + 2 * HOUR + 30
    snapshot = store.telemetry_snapshot()
    by_hour = {bucket.hour: bucket for bucket in snapshot.buckets}
    first = int(T0 // HOUR)
    assert by_hour[first].get("host_bytes") == 1000
    assert by_hour[first + 1].get("host_bytes") == 8000
    assert by_hour[first + 1].get("puts") == 2
    for position, name in enumerate(COUNTER_NAMES):
        assert sum(bucket.values[position] for bucket in snapshot.buckets) == snapshot.counter(
            name
        ), name
    store.close()
    persisted = read_snapshot(store_path, clock=clock)
    hours = {bucket.hour: bucket.get("host_bytes") for bucket in persisted.buckets}
    assert (hours[first], hours[first + 1]) == (1000, 8000)

    clock.now = T0 + 40 * 24 * HOUR  # past the 35-day retention
    late = open_store(create=False, telemetry_clock=clock, **QUIET)
    late.put("d", b"d" * 10)
    late.close()
    kept = read_snapshot(store_path, clock=clock)
    assert min(bucket.hour for bucket in kept.buckets) > first + 1
    assert kept.counter("host_bytes") == 9010  # totals are lifetime; only history expires


def test_damaged_telemetry_never_stops_the_store(open_store: OpenStore, store_path: Path) -> None:
    store = open_store(**QUIET)
    store.put("k", b"v" * 100)
    store.close()
    env = lmdb.open(str(store_path / "index"), max_dbs=8)
    db = env.open_db(TELEMETRY_DB)
    with env.begin(write=True) as txn:
        raw = bytearray(txn.get(STATE_KEY, db=db))
        raw[40] ^= 0xFF
        txn.put(STATE_KEY, bytes(raw), db=db)
    env.close()
    reopened = open_store(create=False, **QUIET)
    assert any("checksum mismatch" in note for note in reopened.recovery_notes)
    assert reopened.get("k") == b"v" * 100
    assert reopened.telemetry_snapshot().counter("host_bytes") == 0  # started over, said so
    reopened.put("k2", b"w" * 10)
    assert reopened.telemetry_snapshot().counter("host_bytes") == 10


def test_latency_histograms_count_every_operation(open_store: OpenStore) -> None:
    store = open_store(**QUIET)
    store.put_many([(f"k{index}", b"x" * 100) for index in range(5)])
    store.get("k1")
    store.get_many(["k1", "k2", "nope"])
    store.flush()
    store.gc()
    snapshot = store.telemetry_snapshot()
    puts, put_seconds = snapshot.histogram("put")
    gets, _ = snapshot.histogram("get")
    flushes, _ = snapshot.histogram("flush")
    gcs, _ = snapshot.histogram("gc")
    assert sum(puts) == 5 and put_seconds > 0
    assert sum(gets) == 2  # one get, one get_many call
    assert sum(flushes) == snapshot.counter("commits") >= 1
    assert sum(gcs) == 1
    assert snapshot.counter("gets") == 4 and snapshot.counter("misses") == 1


def test_throughput_windows_from_the_telemetry_thread(open_store: OpenStore) -> None:
    store = open_store()
    deadline = time.monotonic() + 30
    while not store.stats().throughput and time.monotonic() < deadline:
        time.sleep(0.2)  # wait for the telemetry thread's first one-second sample
    store.put_many([(f"k{index}", b"t" * 50_000) for index in range(20)])
    store.get_many([f"k{index}" for index in range(10)])
    rates = store.stats().throughput["10s"]
    assert rates["seconds"] > 0
    assert rates["host_write_bytes_per_s"] == pytest.approx(1_000_000 / rates["seconds"])
    assert rates["puts_per_s"] == pytest.approx(20 / rates["seconds"])
    assert rates["read_bytes_per_s"] == pytest.approx(500_000 / rates["seconds"])
    assert rates["store_write_bytes_per_s"] > rates["host_write_bytes_per_s"]


def test_a_failed_counter_save_is_noted_and_retried(
    open_store: OpenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Telemetry writes go through ``IndexEnv.write`` (the path the fault injector
    sees), whose failures are IOFailure: a checkpoint must not fail for them, the note
    says why, and the next save writes what the failed one could not."""
    from kvstore.errors import IOFailure
    from kvstore.index.lmdb_env import IndexEnv

    store = open_store(telemetry_flush_interval_s=3600)
    original = IndexEnv.write
    failing = {"on": True}

    def write(env: IndexEnv, body: Any) -> Any:
        if failing["on"] and body.__module__ == "kvstore.telemetry.counters":
            raise IOFailure("LMDB write failed: injected")
        return original(env, body)

    monkeypatch.setattr(IndexEnv, "write", write)
    store.put(b"k", b"v" * 100)
    store.checkpoint()  # saves the counters: fails, noted, the checkpoint stands
    notes = store.telemetry_snapshot().notes
    assert any("saving the counters failed" in n and "injected" in n for n in notes), notes
    failing["on"] = False
    store.put(b"k2", b"v" * 100)
    store.checkpoint()
    store.close()
    reopened = open_store(create=False)
    snapshot = reopened.telemetry_snapshot()
    assert snapshot.values[tc.PUTS] == 2  # both puts counted: the retry wrote them


def test_an_idle_writer_writes_nothing(
    open_store: OpenStore, store_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 29 #6: the GC thread's idle passes changed the counters every second, so
    an idle writer saved them every second (~12 KB/s), and its timed checkpoint
    rotated the WAL and committed LMDB every minute. An idle writer writes nothing:
    no LMDB write transaction, the index and the WAL untouched; a change is saved."""
    from kvstore.index.lmdb_env import IndexEnv

    store = open_store(
        gc_interval_s=0.05, telemetry_flush_interval_s=0.05, checkpoint_interval_s=0.05
    )
    store.put(b"k", b"v" * 100)
    store.checkpoint()
    time.sleep(0.5)  # the put's save and the GC thread's first passes
    writes: list[str] = []
    original = IndexEnv.write

    def write(env: IndexEnv, body: Any) -> Any:
        writes.append(body.__module__)
        return original(env, body)

    monkeypatch.setattr(IndexEnv, "write", write)
    index_file = store_path / "index" / "data.mdb"
    before = (index_file.stat().st_mtime_ns, index_file.stat().st_size)
    wal_before = sorted((p.name, p.stat().st_size) for p in (store_path / "wal").iterdir())
    counters = store.telemetry_snapshot().values
    time.sleep(1.5)  # 30 GC passes, telemetry beats and checkpoint deadlines
    assert writes == []
    assert (index_file.stat().st_mtime_ns, index_file.stat().st_size) == before
    assert sorted((p.name, p.stat().st_size) for p in (store_path / "wal").iterdir()) == wal_before
    assert store.telemetry_snapshot().values == counters
    store.get(b"k")  # a change is saved at the next beat
    deadline = time.monotonic() + 5
    while not writes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert writes, "a changed counter vector was not saved"


def test_the_writers_gauges_round_trip_and_a_damaged_value_is_ignored() -> None:
    gauges = {"pages": 3.0, "live_bytes": 12_000.0, "degraded": 1.0, "unknown_name": 7.0}
    raw = tc.encode_gauges(gauges)
    # Absent ones (no capacity here) and names this version does not keep are left out.
    assert tc.decode_gauges(raw) == {"pages": 3.0, "live_bytes": 12_000.0, "degraded": 1.0}
    damaged = bytearray(raw)
    damaged[12] ^= 0x01
    with pytest.raises(ValueError, match="checksum"):
        tc.decode_gauges(bytes(damaged))
    with pytest.raises(ValueError, match="too short"):
        tc.decode_gauges(raw[:10])


def test_a_reader_gets_the_closed_writers_gauges(open_store: OpenStore, store_path: Path) -> None:
    store = open_store(capacity_bytes=16 << 20)
    store.put_many([(f"k{index}", b"g" * 3000) for index in range(3)])
    stats = store.stats()
    store.close()
    gauges = read_snapshot(store_path).gauges
    assert gauges["pages"] == 3 and gauges["live_bytes"] == stats.live_bytes
    assert gauges["capacity_bytes"] == 16 << 20 and gauges["free_bytes"] == stats.free_bytes
    assert gauges["degraded"] == 0

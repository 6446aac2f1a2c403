"""Micro-benchmarks of the hot paths: checksum, record and WAL encode/decode,
page-table lookup, WAL append, pin/unpin. Each also asserts what it computed,
so a broken hot path fails here rather than reporting a fast wrong answer.
"""

from __future__ import annotations

import os
import random
import uuid
from pathlib import Path

import pytest
from conftest import PAGES, page_key
from pytest_benchmark.fixture import BenchmarkFixture

from kvstore import KVStore
from kvstore.format.checksum import checksum
from kvstore.format.constants import BLOCK_BYTES, RECORD_PAGE
from kvstore.format.names import WAL_DIR
from kvstore.format.records import RecordHeader, decode_record_header, encode_record_header_into
from kvstore.format.wal import WAL_PUT, PutBody, decode_body, encode_put, iter_records
from kvstore.log.wal import WalWriter

HEADER = RecordHeader(RECORD_PAGE, b"layer07/block000123", b'{"tokens":16}', 262144, 42, 3,
                      1 << 20, 1, 0x1234_5678_9ABC_DEF0)  # fmt: skip
PUT = PutBody(b"layer07/block000123", 3, 1, 1 << 20, 262144, 0x1234_5678_9ABC_DEF0, b"")


@pytest.mark.parametrize("size", [4096, 256 << 10, 1 << 20], ids=["4KiB", "256KiB", "1MiB"])
def test_checksum(benchmark: BenchmarkFixture, size: int) -> None:
    data = os.urandom(size)
    assert benchmark(checksum, data) == checksum(data)


def test_record_header_encode(benchmark: BenchmarkFixture) -> None:
    block = memoryview(bytearray(BLOCK_BYTES))
    benchmark(encode_record_header_into, block, HEADER)
    assert decode_record_header(block, max_page_bytes=1 << 24) == HEADER


def test_record_header_decode(benchmark: BenchmarkFixture) -> None:
    block = memoryview(bytearray(BLOCK_BYTES))
    encode_record_header_into(block, HEADER)
    assert benchmark(decode_record_header, block, max_page_bytes=1 << 24) == HEADER


def test_wal_put_encode(benchmark: BenchmarkFixture) -> None:
    record = benchmark(encode_put, 42, PUT)
    (parsed,) = iter_records(record, 0).records
    assert parsed.record_type == WAL_PUT and decode_body(parsed) == PUT


def test_wal_put_decode(benchmark: BenchmarkFixture) -> None:
    data = encode_put(42, PUT) * 64

    def decode() -> list[object]:
        return [decode_body(record) for record in iter_records(data, 0).records]

    assert benchmark(decode) == [PUT] * 64


def test_page_table_lookup(benchmark: BenchmarkFixture, filled_store: KVStore) -> None:
    """``key in store`` for 1,000 random present keys (per-lookup time = mean / 1000)."""
    keys = [page_key(random.Random(1).randrange(PAGES)) for _ in range(1000)]

    def lookups() -> int:
        return sum(1 for key in keys if key in filled_store)

    assert benchmark(lookups) == 1000


def test_pin_unpin(benchmark: BenchmarkFixture, filled_store: KVStore) -> None:
    """1,000 pin + unpin pairs (per-pair time = mean / 1000)."""
    keys = [page_key(i) for i in range(0, PAGES, PAGES // 1000)]

    def pairs() -> None:
        for key in keys:
            filled_store.pin(key)
            filled_store.unpin(key)

    benchmark(pairs)
    assert filled_store.pin_count(keys[0]) == 0


@pytest.mark.parametrize("sync", [False, True], ids=["append", "append+fdatasync"])
def test_wal_append(benchmark: BenchmarkFixture, scratch: Path, sync: bool) -> None:
    """One group commit's worth of records (64 PUTs) appended, optionally made durable."""
    (scratch / WAL_DIR).mkdir()
    writer = WalWriter(scratch, uuid.uuid4().bytes, 1, 0)
    batch = b"".join(encode_put(lsn, PUT) for lsn in range(1, 65))

    def append() -> None:
        writer.append(batch)
        if sync:
            writer.sync()

    try:
        before = writer.size_bytes
        benchmark(append)
        assert writer.size_bytes > before and (writer.size_bytes - before) % len(batch) == 0
    finally:
        writer.close()

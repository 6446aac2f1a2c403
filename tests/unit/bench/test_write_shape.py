"""``tools/write_shape.py``: the store's durable puts beside the same I/O from plain threads.

Tiny sizes and no fio; what is checked is that each variant does the work it claims
(the store holds every page it was given, the threads lay out the store's records) and
that the report holds every variant and ratio.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvstore import KVStore
from kvstore.bench import write_shape
from kvstore.bench.fio_ratios import aligned_payloads, page_key
from kvstore.format.constants import BLOCK_BYTES

PAGE = 64 * 1024
SMALL = 8 << 20  # segment bytes: the default preallocates 256 MiB per segment


@pytest.mark.parametrize("sync", [True, False])
def test_the_store_variant_stores_every_page_of_every_batch(tmp_path: Path, sync: bool) -> None:
    payloads = aligned_payloads(4 * write_shape.BATCH, PAGE)
    total = 3 * write_shape.BATCH * PAGE
    rate = write_shape.store_puts(
        tmp_path / "s", payloads, total, depth=2, sync=sync, segment_bytes=SMALL
    )
    assert rate > 0
    with KVStore.open(tmp_path / "s", readonly=True) as store:
        assert len(list(store.keys())) == 3 * write_shape.BATCH
        assert store.get(page_key(PAGE, 0)) == bytes(payloads[0])
        last = 3 * write_shape.BATCH - 1
        assert store.get(page_key(PAGE, last)) == bytes(payloads[last % len(payloads)])


def test_the_threads_write_the_stores_record_layout(tmp_path: Path) -> None:
    payloads = aligned_payloads(4 * write_shape.BATCH, PAGE)
    write_shape.thread_writes(tmp_path / "t", payloads, batches=6, depth=2, flush=True)
    data = (tmp_path / "t" / "data").read_bytes()
    span = BLOCK_BYTES + PAGE
    # batch i starts at record i * 32, and each record is a header block, then its
    # payload: the store's page for that record (batches 4 and 5 reuse the memory of 0, 1)
    for index in (0, 3, 5):
        first = index * write_shape.BATCH * span
        for i in (0, write_shape.BATCH - 1):
            start = first + i * span + BLOCK_BYTES
            assert data[start : start + PAGE] == bytes(write_shape.batch_of(payloads, index)[i])
    assert write_shape.batch_of(payloads, 5)[0] is payloads[write_shape.BATCH]
    assert os.path.getsize(tmp_path / "t" / "wal") == 6 * write_shape.BATCH * 100


def test_every_variant_runs_each_round_and_leaves_nothing(tmp_path: Path) -> None:
    rates = write_shape.measure(
        tmp_path, PAGE, 4 << 20, depth=2, rounds=2, seed=3, fio=None, segment_bytes=SMALL
    )
    assert set(rates) == set(write_shape.VARIANTS)
    assert all(len(v) == 2 and min(v) > 0 for v in rates.values())
    assert list(tmp_path.iterdir()) == []


def test_the_report_sets_the_store_beside_the_threads_and_fio() -> None:
    rates = {
        "store, sync": [900.0, 1000.0, 1100.0],
        "store, no sync": [1500.0],
        "threads, two flushes": [1250.0],
        "threads, no flush": [1600.0],
    }
    document = write_shape.report(rates)
    assert document["median_mb_per_s"] == {
        "store, sync": 1000,
        "store, no sync": 1500,
        "threads, two flushes": 1250,
        "threads, no flush": 1600,
    }
    assert document["store_sync_over_threads_two_flushes"] == 0.8
    assert "store_sync_over_fio" not in document
    document = write_shape.report({**rates, write_shape.FIO: [2000.0]})
    assert document["store_sync_over_fio"] == 0.5
    assert document["threads_two_flushes_over_fio"] == 0.625


def test_the_command_line_says_why_there_is_no_fio_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    measured: dict[str, object] = {}

    def measure(*args: object, **kwargs: object) -> dict[str, list[float]]:
        measured["page_bytes"] = args[1]
        return {variant: [100.0] for variant in write_shape.VARIANTS}

    monkeypatch.setattr(write_shape, "measure", measure)
    argv = ["--dir", str(tmp_path), "--mib", "1", "--page-kib", "64", "--rounds", "1"]
    assert write_shape.main([*argv, "--fio", "none", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["fio"] == "no fio row: fio disabled (--fio none)"
    assert document["bytes_per_variant"] == 32 * PAGE  # whole batches of 32 pages
    assert measured["page_bytes"] == PAGE
    assert write_shape.main([*argv, "--fio", "none"]) == 0
    text = capsys.readouterr().out
    assert "threads, two flushes" in text and "no fio row: fio disabled" in text
    available = write_shape.FioStatus(True, "/usr/bin/fio", "fio-3.36")
    assert write_shape.fio_row(available, 256 * 1024) == "fio-3.36"
    assert "256 KiB or 1024 KiB pages only" in write_shape.fio_row(available, PAGE)


def test_a_page_size_the_format_cannot_take_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        write_shape.main(["--dir", str(tmp_path), "--page-kib", "6"])
    assert exited.value.code == 2
    assert "--page-kib must be a multiple of 4 from 16 to 16384" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        write_shape.main(["--dir", str(tmp_path), "--page-kib", "8"])

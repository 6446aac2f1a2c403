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
from kvstore.format.constants import BLOCK_BYTES

PAGE = 64 * 1024


def test_the_store_variant_stores_every_page_of_every_batch(tmp_path: Path) -> None:
    payloads = write_shape.Payloads(PAGE, 4)
    write_shape.store_puts(tmp_path / "s", payloads, batches=3, depth=2, sync=True)
    with KVStore.open(tmp_path / "s", readonly=True) as store:
        # the warm-up's depth + 2 batches and the three measured ones
        assert len(list(store.keys())) == (2 + 2 + 3) * write_shape.BATCH
        assert store.get(b"k0") == bytes(payloads.pages[0])


def test_the_threads_write_the_stores_record_layout(tmp_path: Path) -> None:
    payloads = write_shape.Payloads(PAGE, 4)
    write_shape.thread_writes(tmp_path / "t", payloads, batches=2, depth=2, flush=True)
    data = (tmp_path / "t" / "data").read_bytes()
    span = BLOCK_BYTES + PAGE
    # depth + 2 warm-up batches (0-3), then the two measured ones (4, 5); batch i
    # starts at record i * 32, and each record is a header block, then its payload
    for index in (0, 3, 5):
        first = index * write_shape.BATCH * span
        for i in (0, write_shape.BATCH - 1):
            start = first + i * span + BLOCK_BYTES
            assert data[start : start + PAGE] == bytes(payloads.batch(index)[i])
    assert os.path.getsize(tmp_path / "t" / "wal") == 6 * write_shape.BATCH * 100


def test_the_report_has_every_variant_and_cleans_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--dir", str(tmp_path), "--mib", "4", "--page-kib", "64", "--rounds", "2"]
    assert write_shape.main([*argv, "--fio", "none", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert set(document["mb_per_s"]) == set(write_shape.VARIANTS)
    assert all(len(v) == 2 and min(v) > 0 for v in document["mb_per_s"].values())
    assert document["store_sync_over_threads_two_flushes"] > 0
    assert document["fio"] == "fio disabled (--fio none)"
    assert list(tmp_path.iterdir()) == []
    assert write_shape.main([*argv, "--fio", "none"]) == 0
    text = capsys.readouterr().out
    assert "threads, two flushes" in text and "no fio row" in text


def test_a_page_size_the_format_cannot_take_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        write_shape.main(["--dir", str(tmp_path), "--page-kib", "6"])
    assert exited.value.code == 2
    assert "--page-kib must be a positive multiple of 4" in capsys.readouterr().err

"""``kvstore gc PATH [--full] [--json]``: one GC pass from the command line.

Exit codes as the other commands: 0 ran, 3 another writer holds the store
(refused, nothing done), 4 the store is damaged, 8 operational (no store).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from click.testing import CliRunner

from kvstore import KVStore
from kvstore.cli import main
from kvstore.format.names import SUPERBLOCK_NAME, segment_path

OpenStore = Callable[..., KVStore]
PAGE = 64 << 10  # 15 records fill a 1 MiB segment


def gc(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["gc", *args])
    return result.exit_code, result.stdout, result.stderr


def store_with_an_empty_segment(open_store: OpenStore) -> dict[str, bytes]:
    """A closed store whose first segment holds no live page (GC frees it)."""
    store = open_store(gc_interval_s=0)
    pages = {f"p{index:02d}": bytes([index]) * PAGE for index in range(30)}
    store.put_many(list(pages.items()))
    for key in [key for key in pages if (info := store.info(key)) and info.segment_id == 1]:
        store.delete(key)
        del pages[key]
    store.close()
    return pages


def test_gc_json_reports_the_pass_and_keeps_every_page(
    open_store: OpenStore, store_path: Path
) -> None:
    pages = store_with_an_empty_segment(open_store)
    code, out, _ = gc(str(store_path), "--json")
    assert code == 0, out
    report = json.loads(out)
    assert report["path"] == str(store_path) and report["full"] is False
    assert report["segments_freed"] >= 1
    assert set(report) >= {"segments_scanned", "pages_moved", "pages_evicted", "seconds"}
    assert not segment_path(store_path, 1).exists()
    with KVStore.open(store_path, readonly=True) as reader:
        assert reader.get_many(list(pages)) == list(pages.values())


def test_gc_full_prints_a_table(open_store: OpenStore, store_path: Path) -> None:
    store_with_an_empty_segment(open_store)
    code, out, _ = gc(str(store_path), "--full")
    assert code == 0, out
    assert "kvstore gc" in out and "--full" in out
    assert "drift_segments" in out and "segments_freed" in out
    assert "freed 1 segments" in out
    code, out, _ = gc(str(store_path), "--full", "--json")  # nothing left to do
    assert code == 0 and json.loads(out)["segments_freed"] == 0
    assert json.loads(out)["drift_segments"] == 0


def test_gc_refuses_politely_while_a_writer_holds_the_store(
    open_store: OpenStore, store_path: Path
) -> None:
    writer = open_store()  # this process holds the writer lock
    writer.put("kept", b"x", sync=True)
    code, out, err = gc(str(store_path), "--json")
    assert code == 3
    refused = json.loads(out)
    assert refused["exit_code"] == 3 and refused["error"]["type"] == "LockedError"
    assert "not run" in refused["error"]["message"]
    assert "GC thread" in refused["error"]["message"]
    code, out, err = gc(str(store_path))
    assert code == 3 and out == ""
    assert "refused" in err and "writer" in err
    assert writer.get("kept") == b"x"  # the writer is untouched


def test_gc_of_no_store_exits_8_with_json(tmp_path: Path) -> None:
    code, out, _ = gc(str(tmp_path / "nothing"), "--json")
    assert code == 8
    assert json.loads(out)["error"]["type"] == "StoreNotFoundError"


def test_gc_of_a_damaged_store_exits_4(open_store: OpenStore, store_path: Path) -> None:
    store_with_an_empty_segment(open_store)
    superblock = store_path / SUPERBLOCK_NAME
    data = bytearray(superblock.read_bytes())
    data[40] ^= 0xFF  # the store's identity cannot be established: it refuses to open
    superblock.write_bytes(bytes(data))
    code, out, _ = gc(str(store_path), "--json")
    assert code == 4
    assert json.loads(out)["exit_code"] == 4

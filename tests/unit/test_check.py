"""check.py and ``kvstore fsck``: a clean store is clean, every corruption kind is
found, repair fixes what it claims, and the CLI exit codes follow e2fsck.

Damage is made on disk by hand (a flipped byte, a raw LMDB write, a deleted
file) or in memory (accounting drift), then the check must name it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest
from click.testing import CliRunner

import kvstore.check as check_module
from kvstore import KVStore
from kvstore.check import FINDING_KINDS, Finding, check_store
from kvstore.cli import main
from kvstore.format.constants import BLOCK_BYTES
from kvstore.format.names import INDEX_DIR, segment_path
from kvstore.io.buffers import AlignedBuffer
from kvstore.log.wal import list_wal_files

REPO_ROOT = Path(__file__).resolve().parents[2]
SMALL = {"segment_bytes": 1 << 20, "max_page_bytes": 256 << 10}
OpenStore = Callable[..., KVStore]


def page(index: int, size: int = 50_000) -> bytes:
    return bytes((index * 7 + position) % 251 for position in range(256)) * (size // 256)


def build_store(store: KVStore) -> dict[str, bytes]:
    """Pages across several segments, with deletes, overwrites, retains and a GC pass."""
    expected = {f"page{index:03d}": page(index) for index in range(60)}
    store.put_many(list(expected.items()))
    for index in range(0, 20):  # empties most of the first segments: GC frees/compacts them
        store.delete(f"page{index:03d}")
        del expected[f"page{index:03d}"]
    for index in (30, 31):
        expected[f"page{index:03d}"] = page(1000 + index, 7000)
        store.put(f"page{index:03d}", expected[f"page{index:03d}"])
    store.retain("page040")
    store.retain("page041")
    store.flush()
    store.gc(full=True)
    store.checkpoint()
    store.put("after-checkpoint", b"in the overlay only")  # LMDB + overlay both checked
    store.delete("page050")
    del expected["page050"]
    expected["after-checkpoint"] = b"in the overlay only"
    store.flush()
    return expected


def kinds(findings: list[Finding]) -> list[str]:
    return sorted(finding.kind for finding in findings)


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0x40]))


@pytest.fixture
def built(open_store: OpenStore, store_path: Path) -> Path:
    """A closed store built by ``build_store``."""
    store = open_store()
    build_store(store)
    assert len({info.segment_id for info in map(store.info, store.keys()) if info}) >= 2
    store.close()
    return store_path


def test_clean_store_has_no_findings(open_store: OpenStore, store_path: Path) -> None:
    store = open_store()
    expected = build_store(store)
    assert check_store(store) == []
    progress: list[tuple[int, int]] = []
    assert check_store(store, deep=True, progress=lambda d, t: progress.append((d, t))) == []
    assert progress[-1][0] == progress[-1][1] > 0
    assert check_store(store, repair=True) == []
    store.close()
    store = open_store(readonly=True, create=False)
    assert check_store(store) == []
    assert check_store(store, deep=True) == []
    assert store.get_many(sorted(expected)) == [expected[key] for key in sorted(expected)]


def test_flipped_payload_byte_is_found_by_deep_only(open_store: OpenStore, built: Path) -> None:
    store = open_store(create=False)
    info = store.info("page045")
    assert info is not None
    flip_byte(segment_path(built, info.segment_id), info.offset + BLOCK_BYTES + 1234)
    assert check_store(store) == []
    [finding] = check_store(store, deep=True)
    assert (finding.kind, finding.key, finding.segment_id, finding.offset) == (
        "payload-checksum",
        b"page045",
        info.segment_id,
        info.offset,
    )
    [repaired] = check_store(store, deep=True, repair=True)
    assert repaired.repaired and repaired.kind == "payload-checksum"
    assert "page045" not in store
    assert check_store(store, deep=True) == []
    store.close()
    store = open_store(create=False)
    assert "page045" not in store
    assert check_store(store, deep=True) == []


def test_flipped_record_header_byte_is_found(open_store: OpenStore, built: Path) -> None:
    store = open_store(readonly=True, create=False)
    info = store.info("page033")
    assert info is not None
    flip_byte(segment_path(built, info.segment_id), info.offset + 70)
    [finding] = check_store(store)
    assert finding.kind == "record-header" and finding.key == b"page033"
    assert finding.severity == "error" and not finding.repaired


def test_record_of_another_page_is_a_mismatch(open_store: OpenStore, built: Path) -> None:
    store = open_store(readonly=True, create=False)
    first, second = store.info("page030"), store.info("page031")
    assert first is not None and second is not None
    # page030 and page031 were overwritten with pages of one size: swap their records.
    path_first = segment_path(built, first.segment_id)
    path_second = segment_path(built, second.segment_id)
    span = BLOCK_BYTES + 8192
    record_first = path_first.read_bytes()[first.offset : first.offset + span]
    record_second = path_second.read_bytes()[second.offset : second.offset + span]
    with open(path_first, "r+b") as handle:
        handle.seek(first.offset)
        handle.write(record_second)
    with open(path_second, "r+b") as handle:
        handle.seek(second.offset)
        handle.write(record_first)
    assert kinds(check_store(store)) == ["record-mismatch", "record-mismatch"]


def test_corrupt_page_table_value_in_lmdb(open_store: OpenStore, built: Path) -> None:
    env = lmdb.open(str(built / INDEX_DIR), max_dbs=8, subdir=True)
    with env.begin(write=True) as txn:
        pages = env.open_db(b"pages", txn=txn)
        raw = txn.get(b"page041", db=pages)
        assert raw is not None
        damaged = bytearray(raw)
        damaged[3] ^= 0xFF
        txn.put(b"page041", bytes(damaged), db=pages)
    env.close()
    store = open_store(create=False)
    findings = check_store(store)
    assert kinds(findings) == ["accounting", "index-value"]
    [value] = [f for f in findings if f.kind == "index-value"]
    assert value.key == b"page041" and "checksum" in value.message
    repaired = check_store(store, repair=True)
    assert all(finding.repaired for finding in repaired), repaired
    assert kinds(repaired) == ["accounting", "index-value"]
    assert "page041" not in store and not store.is_retained("page041")
    assert check_store(store) == []
    length = len(store)
    store.close()
    store = open_store(create=False)
    assert check_store(store, deep=True) == []
    assert len(store) == length == len(list(store.keys()))


def test_accounting_drift_is_found_and_fixed(open_store: OpenStore, built: Path) -> None:
    store = open_store(create=False)
    segment_id = max(store.internals.state.segment_states)
    store.internals.state.segment_states[segment_id].live_bytes += BLOCK_BYTES
    store.internals.state.segment_states[segment_id].live_pages -= 1
    [finding] = check_store(store)
    assert (finding.kind, finding.segment_id, finding.repaired) == (
        "accounting",
        segment_id,
        False,
    )
    [fixed] = check_store(store, repair=True)
    assert fixed.repaired
    assert check_store(store) == []


def test_orphan_segment_file_is_found_and_removed(open_store: OpenStore, built: Path) -> None:
    store = open_store(create=False)
    orphan = segment_path(built, 0xABC)
    orphan.write_bytes(bytes(BLOCK_BYTES))
    [finding] = check_store(store)
    assert (finding.kind, finding.segment_id, finding.path) == (
        "orphan-segment",
        0xABC,
        str(orphan),
    )
    [fixed] = check_store(store, repair=True)
    assert fixed.repaired and not orphan.exists()
    assert check_store(store) == []


def test_stray_file_is_a_warning(open_store: OpenStore, built: Path) -> None:
    (built / "wal" / "notes.txt").write_text("hello")
    store = open_store(readonly=True, create=False)
    [finding] = check_store(store)
    assert (finding.severity, finding.kind) == ("warning", "stray-file")


_CRASH = """
import os, sys
from kvstore import KVStore
store = KVStore.open(sys.argv[1], segment_bytes=1 << 20, max_page_bytes=256 << 10)
store.put(sys.argv[2], b"x" * 5000, sync=True)
os._exit(0)
"""


def crash_writer(path: Path, key: str) -> None:
    subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_CRASH), str(path), key],
        check=True,
        cwd=REPO_ROOT,
        timeout=60,
    )


def chain_of_three(open_store: OpenStore, store_path: Path) -> Path:
    open_store().close()
    crash_writer(store_path, "one")
    crash_writer(store_path, "two")
    files = list_wal_files(store_path)
    assert len(files) == 3, files
    return files[1][1]


def test_missing_wal_file_in_the_middle(open_store: OpenStore, store_path: Path) -> None:
    middle = chain_of_three(open_store, store_path)
    store = open_store(readonly=True, create=False)
    assert check_store(store) == []
    middle.unlink()
    [finding] = check_store(store)
    assert finding.kind == "wal-chain" and "chain broken" in finding.message


def test_check_reads_segment_headers_as_a_registered_reader(
    open_store: OpenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(gc_interval_s=0)
    names = [f"p{index:02d}" for index in range(30)]
    store.put_many([(name, page(index, 65536)) for index, name in enumerate(names)])
    first = [name for name in names if (info := store.info(name)) and info.segment_id == 1]
    for key in first:
        store.delete(key)
    store.flush()  # segment 1 is sealed and empty: the next GC pass frees it
    freed = []

    def gc_before_the_first_read(size: int) -> AlignedBuffer:
        if not freed:  # GC runs just as check() reads segment 1's header
            freed.append(store.gc().segments_freed)
        return AlignedBuffer(size)

    monkeypatch.setattr(check_module, "AlignedBuffer", gc_before_the_first_read)
    # Before: GC freed segment 1 under the read, which then read a closed (or
    # reused) descriptor: a false segment-header finding (EBADF, or the header
    # of the file the descriptor now belongs to).
    assert store.check() == []
    assert freed == [0]  # the registered read kept GC off segment 1
    assert store.gc().segments_freed == 1  # and released it afterwards
    assert store.check() == []


# -- CLI -----------------------------------------------------------------------------


def fsck(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["fsck", *args])
    return result.exit_code, result.output


def test_cli_clean_exits_0_and_json_parses(built: Path) -> None:
    code, output = fsck(str(built), "--deep")
    assert code == 0, output
    code, output = fsck(str(built), "--json")
    assert (code, json.loads(output)) == (0, [])


def test_cli_uncorrected_exits_4_then_repair_exits_1_then_0(built: Path) -> None:
    (segment_path(built, 0xABC)).write_bytes(bytes(BLOCK_BYTES))
    code, output = fsck(str(built), "--json")
    assert code == 4, output
    [finding] = json.loads(output)
    assert finding["kind"] == "orphan-segment" and finding["repaired"] is False
    assert set(finding) >= {"severity", "message", "path", "segment_id", "offset", "key"}
    code, output = fsck(str(built), "--repair", "--json")
    assert code == 1, output
    assert all(item["repaired"] for item in json.loads(output))
    code, output = fsck(str(built))
    assert code == 0, output


def test_cli_repairs_a_corrupt_payload_exit_1(built: Path, open_store: OpenStore) -> None:
    store = open_store(readonly=True, create=False)
    info = store.info("page044")
    assert info is not None
    store.close()
    flip_byte(segment_path(built, info.segment_id), info.offset + BLOCK_BYTES + 7)
    assert fsck(str(built))[0] == 0  # shallow does not read payloads
    code, output = fsck(str(built), "--deep")
    assert code == 4 and "payload-checksum" in output
    code, output = fsck(str(built), "--deep", "--repair", "--json")
    assert code == 1, output
    assert [item["key"] for item in json.loads(output)] == ["page044"]
    assert fsck(str(built), "--deep")[0] == 0


def test_cli_store_that_refuses_to_open_exits_4(open_store: OpenStore, store_path: Path) -> None:
    chain_of_three(open_store, store_path).unlink()
    code, output = fsck(str(store_path), "--json")
    assert code == 4, output
    assert {item["kind"] for item in json.loads(output)} == {"open-failed", "wal-chain"}


def test_cli_operational_errors_exit_8(open_store: OpenStore, store_path: Path) -> None:
    assert fsck(str(store_path / "missing"))[0] == 8
    open_store()  # this process holds the writer lock
    code, output = fsck(str(store_path), "--repair")
    assert code == 8, output


def test_every_kind_is_documented() -> None:
    operations = (REPO_ROOT / "docs" / "operations.md").read_text()
    for kind in FINDING_KINDS:
        assert f"`{kind}`" in operations, kind

"""Every command's exit codes are the documented ones, and ``--json`` always prints JSON.

README.md and docs/operations.md: 0 ok, 1 key not found, 2 usage, 3 locked by
another writer, 4 corruption, 8 operational error (I/O, missing store, format
version); ``fsck`` 0/1/4/8 as e2fsck; ``recover`` 0/4/8. With ``--json`` a failing
command prints ``{"error": {"type", "message"}, "exit_code"}`` (``fsck``: a
findings list holding one ``operational`` finding).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from kvstore import KVStore
from kvstore.cli import main
from kvstore.format.constants import BLOCK_BYTES, FORMAT_VERSION
from kvstore.format.names import SUPERBLOCK_NAME
from kvstore.format.records import decode_superblock, encode_superblock

OpenStore = Callable[..., KVStore]


def run(*args: str, stdin: bytes | None = None) -> Result:
    return CliRunner().invoke(main, list(args), input=stdin)


def json_of(result: Result) -> Any:
    return json.loads(result.stdout)


@pytest.fixture
def built(open_store: OpenStore, store_path: Path) -> Path:
    store = open_store()
    store.put("k", b"value")
    store.close()
    return store_path


def _newer_format(path: Path) -> None:
    superblock = decode_superblock((path / SUPERBLOCK_NAME).read_bytes()[:BLOCK_BYTES])
    newer = dataclasses.replace(superblock, format_version=FORMAT_VERSION + 1)
    (path / SUPERBLOCK_NAME).write_bytes(encode_superblock(newer))


# -- fsck ------------------------------------------------------------------------------------


def test_fsck_of_a_newer_format_version_exits_8_with_json(built: Path) -> None:
    """README: 8 for a format version this build cannot read (it exited 4, as corruption)."""
    _newer_format(built)
    result = run("fsck", str(built), "--json")
    assert result.exit_code == 8, result.output
    [finding] = json_of(result)
    assert finding["kind"] == "operational" and finding["severity"] == "error"
    assert f"format version {FORMAT_VERSION + 1}" in finding["message"]
    assert run("fsck", str(built)).exit_code == 8


def test_fsck_operational_errors_print_json(open_store: OpenStore, store_path: Path) -> None:
    result = run("fsck", str(store_path / "missing"), "--json")
    assert result.exit_code == 8
    [finding] = json_of(result)  # it printed nothing before
    assert finding["kind"] == "operational" and "no kvstore" in finding["message"]
    open_store()  # this process holds the writer lock
    result = run("fsck", str(store_path), "--repair", "--json")
    assert result.exit_code == 8
    [finding] = json_of(result)
    assert finding["kind"] == "operational"


# -- recover ---------------------------------------------------------------------------------


def test_recover_operational_errors_print_json(open_store: OpenStore, store_path: Path) -> None:
    for args in (["--dry-run", "--json"], ["--json"]):
        result = run("recover", str(store_path / "missing"), *args)
        assert result.exit_code == 8
        report = json_of(result)  # it printed nothing before
        assert report["exit_code"] == 8
        assert report["error"]["type"] == "StoreNotFoundError"
    store = open_store()
    result = run("recover", str(store_path), "--dry-run", "--json")
    assert result.exit_code == 8
    assert json_of(result)["error"]["type"] == "LockedError"
    store.close()
    _newer_format(store_path)
    result = run("recover", str(store_path), "--dry-run", "--json")
    assert result.exit_code == 8
    assert json_of(result)["error"]["type"] == "FormatVersionError"


# -- stat, wear ------------------------------------------------------------------------------


def test_stat_and_wear_json_errors(built: Path, tmp_path: Path) -> None:
    for command in ("stat", "wear"):
        result = run(command, str(tmp_path / "missing"), "--json")
        assert result.exit_code == 8
        assert json_of(result)["error"]["type"] == "StoreNotFoundError"
    result = run("stat", str(built), "--json")
    assert result.exit_code == 0
    assert json_of(result)["pages"] == 1
    _newer_format(built)
    result = run("stat", str(built), "--json")
    assert result.exit_code == 8
    assert json_of(result)["error"]["type"] == "FormatVersionError"


def test_metrics_and_report_of_a_missing_store_exit_8(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing")
    assert run("metrics", missing, "--port", "0").exit_code == 8  # before serving anything
    assert run("report", missing, "--html", str(tmp_path / "r.html")).exit_code == 8
    assert not (tmp_path / "r.html").exists()


# -- put, get, init --------------------------------------------------------------------------


def test_put_and_get_exit_codes(built: Path, open_store: OpenStore) -> None:
    assert run("put", str(built), "k2", "-", stdin=b"data").exit_code == 0
    result = run("get", str(built), "k2")
    assert (result.exit_code, result.stdout_bytes) == (0, b"data")
    assert run("get", str(built), "absent").exit_code == 1
    long_key = "k" * 512
    for result in (
        run("put", str(built), long_key, "-", stdin=b"data"),  # a traceback and 1 before
        run("get", str(built), long_key),
        run("put", str(built), "k3", "-", "--meta", "{not json", stdin=b"data"),
        run("put", str(built), "k3", "-", "--meta", "[1, 2]", stdin=b"data"),
        run("put", str(built), "k3", "-", stdin=b""),
    ):
        assert result.exit_code == 2, result.output
        assert "Traceback" not in result.output
    assert "511" in run("get", str(built), long_key).stderr
    assert run("get", str(built), "k3").exit_code == 1  # nothing was stored
    assert run("put", str(built / "missing"), "k", "-", stdin=b"x").exit_code == 8
    assert run("get", str(built / "missing"), "k").exit_code == 8
    writer = open_store(path=built, create=False)
    assert run("put", str(built), "k4", "-", stdin=b"x").exit_code == 3
    writer.close()


def test_init_exit_codes(tmp_path: Path) -> None:
    path = tmp_path / "store"
    assert run("init", str(path), "--segment-mib", "1", "--max-page-mib", "0").exit_code == 2
    assert not path.exists()  # refused before anything was created
    assert run("init", str(path), "--segment-mib", "4", "--max-page-mib", "1").exit_code == 0
    result = run("init", str(path))
    assert result.exit_code == 2
    assert "already holds a kvstore" in result.output

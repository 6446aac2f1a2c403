"""The CLI's edges an operator or a newcomer trips on (issue 29): one error line and
the documented exit code for ordinary mistakes, no Python in human output, and a
demo that never deletes a store it did not create.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner, Result

from kvstore import KVStore
from kvstore.cli import main
from kvstore.format.names import DEMO_MARKER_NAME


def run(*args: str, stdin: bytes | None = None) -> Result:
    return CliRunner().invoke(main, list(args), input=stdin, env={"COLUMNS": "200"})


def json_of(result: Result) -> Any:
    return json.loads(result.stdout)


# -- demo (item 4) -------------------------------------------------------------------


def test_demo_refuses_a_store_it_did_not_create_unless_force(tmp_path: Path) -> None:
    path = tmp_path / "mine"
    with KVStore.open(path, create=True) as store:
        store.put("precious", b"data", sync=True)
    result = run("demo", "--path", str(path), "--layers", "1", "--blocks", "2")
    assert result.exit_code == 2, result.output
    assert "did not create" in result.output and "--force" in result.output
    with KVStore.open(path, readonly=True) as store:
        assert store.get("precious") == b"data"

    result = run("demo", "--path", str(path), "--layers", "1", "--blocks", "2", "--force")
    assert result.exit_code == 0, result.output
    assert (path / DEMO_MARKER_NAME).exists()
    with KVStore.open(path, readonly=True) as store:
        assert store.get("precious") is None
    # The demo's own store: recreated without --force, and fsck does not call its
    # marker a stray file.
    result = run("demo", "--path", str(path), "--layers", "1", "--blocks", "2")
    assert result.exit_code == 0, result.output
    fsck = run("fsck", str(path), "--json")
    assert fsck.exit_code == 0, fsck.output
    assert not [f for f in json_of(fsck) if f["kind"] == "stray-file"]


def test_demo_refuses_a_directory_that_is_no_store(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("keep me")
    result = run("demo", "--path", str(tmp_path), "--layers", "1", "--blocks", "2", "--force")
    assert result.exit_code == 2
    assert (tmp_path / "notes.txt").read_text() == "keep me"

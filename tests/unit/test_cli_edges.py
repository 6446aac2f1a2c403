"""The CLI's edges an operator or a newcomer trips on: one error line and
the documented exit code for ordinary mistakes, no Python in human output, and a
demo that never deletes a store it did not create.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any, NoReturn

import pytest
from click.testing import CliRunner, Result

from kvstore import KVStore
from kvstore.cli import main
from kvstore.format.names import DEMO_MARKER_NAME
from tests.conftest import open_small_store


def run(*args: str, stdin: bytes | None = None) -> Result:
    return CliRunner().invoke(main, list(args), input=stdin, env={"COLUMNS": "200"})


def json_of(result: Result) -> Any:
    return json.loads(result.stdout)


@pytest.fixture
def built_store(tmp_path: Path) -> Path:
    path = tmp_path / "store"
    with open_small_store(path) as store:  # 1 MiB segments: the default preallocates 256
        store.put("k", b"value", sync=True)
    return path


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


# -- ordinary mistakes: one line, exit 8 or 2 (item 5) ---------------------------------


def one_error_line(result: Result) -> str:
    assert "Traceback" not in result.output
    [line] = result.stderr.splitlines()
    assert line.startswith("error: "), line
    return line


def test_metrics_on_a_port_in_use_is_one_line_exit_8(built_store: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run("metrics", str(built_store), "--port", str(port), "--addr", "127.0.0.1")
    assert result.exit_code == 8, result.output
    line = one_error_line(result)
    assert f"127.0.0.1:{port}" in line and "in use" in line


def test_metrics_on_a_port_out_of_range_is_a_usage_error(built_store: Path) -> None:
    for port in ("70000", "-1"):
        result = run("metrics", str(built_store), "--port", port)
        assert result.exit_code == 2, result.output
        assert "--port" in result.output and "Traceback" not in result.output


def test_report_into_a_missing_directory_is_one_line_exit_8(
    built_store: Path, tmp_path: Path
) -> None:
    target = tmp_path / "missing" / "report.html"
    result = run("report", str(built_store), "--html", str(target))
    assert result.exit_code == 8, result.output
    line = one_error_line(result)
    assert str(target) in line and "No such file or directory" in line


def test_init_under_a_path_it_cannot_create_is_one_line_exit_8(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    result = run("init", str(tmp_path / "file" / "store"))
    assert result.exit_code == 8, result.output
    assert str(tmp_path / "file") in one_error_line(result)


def test_an_unwrapped_os_error_is_one_line_exit_8(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As an unprivileged user under a read-only directory (the tests may run as root)."""
    denied = tmp_path / "ro" / "store"

    def refuse(*args: object, **kwargs: object) -> NoReturn:
        raise PermissionError(errno.EACCES, "Permission denied", str(denied.parent))

    monkeypatch.setattr(KVStore, "open", refuse)
    result = run("init", str(denied))
    assert result.exit_code == 8, result.output
    assert one_error_line(result) == f"error: {denied.parent}: Permission denied"


# -- recover on a healthy store (item 8) ------------------------------------------------


def test_recover_on_a_healthy_store_says_so_and_fsck_lists_what_it_set_aside(
    built_store: Path,
) -> None:
    result = run("recover", str(built_store))
    assert result.exit_code == 0, result.output
    assert "the store was healthy" in result.output
    assert "moved aside: index.damaged-" in result.output
    assert "{" not in result.output  # no Python dict repr of the counts
    aside = sorted(p.name for p in built_store.glob("*.damaged-*"))
    assert [name.split(".")[0] for name in aside] == ["index", "wal"]

    fsck = run("fsck", str(built_store), "--json")
    assert fsck.exit_code == 0, fsck.output  # warnings: still clean for the exit code
    listed = [f for f in json_of(fsck) if f["kind"] == "set-aside"]
    assert sorted(Path(f["path"]).name for f in listed) == aside
    assert all(f["severity"] == "warning" for f in listed)
    fsck = run("fsck", str(built_store))
    assert "clean" not in fsck.output and "set-aside" in fsck.output


def test_demo_recreates_a_store_an_older_demo_made_before_the_marker(tmp_path: Path) -> None:
    path = tmp_path / "kvstore-demo"
    assert run("demo", "--path", str(path), "--layers", "1", "--blocks", "2").exit_code == 0
    (path / DEMO_MARKER_NAME).unlink()  # as `make run` left it before the marker
    result = run("demo", "--path", str(path), "--layers", "1", "--blocks", "2")
    assert result.exit_code == 0, result.output


# -- small edges (item 10) ----------------------------------------------------------------


def test_wear_refuses_a_rating_that_is_not_positive(built_store: Path) -> None:
    for option, value in (("--rated-dwpd", "-1"), ("--rated-dwpd", "0"), ("--warranty-years", "0")):
        result = run("wear", str(built_store), option, value)
        assert result.exit_code == 2, result.output
        assert option in result.output


def test_cli_errors_name_commands_not_python_calls(tmp_path: Path) -> None:
    for args in (("stat",), ("fsck",), ("recover",), ("wear",)):
        result = run(*args, str(tmp_path / "none"))
        assert result.exit_code == 8, result.output
        assert "create=True" not in result.output
        assert "kvstore init PATH" in result.output


def test_put_names_meta_when_it_is_not_a_json_object(built_store: Path) -> None:
    for meta, why in (("notjson", "not JSON"), ("5", "not a number"), ("[1]", "not an array")):
        result = run("put", str(built_store), "k2", "--meta", meta, stdin=b"x")
        assert result.exit_code == 2, result.output
        assert "--meta" in result.output and why in result.output


def test_human_output_has_no_python_reprs_or_raw_unix_times(built_store: Path) -> None:
    for command in ("stat", "wear"):
        result = run(command, str(built_store))
        assert result.exit_code == 0, result.output
        for python in ("None", "True", "False", "{'", "': "):
            assert python not in result.stdout, (command, python)
    wear = run("wear", str(built_store)).stdout
    assert "counters_since_unix_s" in wear and " UTC" in wear


def test_the_quick_bench_says_its_verdicts_are_a_smoke_test() -> None:
    from rich.console import Console

    from kvstore.bench.fio_ratios import make_title
    from kvstore.bench.report import SMOKE_TEST_CAVEAT, render

    target = {"text": "put MB/s", "value": 1.0, "bound": 2.0, "higher_is_better": True}
    document = {"measurements": [], "targets": [{**target, "status": "not met"}]}
    console = Console(record=True, width=400)
    render({**document, "quick": True}, console)
    assert "smoke test" in console.export_text()
    console = Console(record=True, width=400)
    render(document, console)
    assert "smoke test" not in console.export_text()
    assert SMOKE_TEST_CAVEAT in make_title({}, 512, 32, quick=True)
    assert "smoke test" not in make_title({}, 512, 32)

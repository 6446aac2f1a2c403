"""A damaged store layout is refused with one of the store's own errors, never a bare
``OSError``, and nothing in the store is deleted or moved.

The layouts: ``wal/``, ``segments/`` or ``index/`` (kvstore/format/names.py) replaced
by a symlink loop or a regular file, the superblock a symlink loop, the store root a
symlink loop (or one on its path). ``KVStore.open`` (read-only, writer, or with
``create=True``, as ``TierManager.open`` opens its NVMe tier) raised ``OSError``
(ELOOP, ENOTDIR) from the WAL listing, or a misleading error (a loop in place of the
root or the superblock was "no kvstore", and with ``create=True`` a raw
``NotADirectoryError``). Now ``lifecycle.check_layout`` refuses each with
``IOFailure`` naming the path and what is there, and the CLI exits 8 with one line.
(``TierManager.open`` itself is not run here: it imports torch, seconds.)
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from kvstore import KVStore
from kvstore.cli import main
from kvstore.errors import IOFailure
from kvstore.format.names import INDEX_DIR, SEGMENTS_DIR, SUPERBLOCK_NAME, WAL_DIR
from tests.conftest import open_small_store

PAGE = b"page bytes " * 100


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pristine") / "store"
    with open_small_store(root) as store:
        store.put("k", PAGE)
    return root


@pytest.fixture
def built(pristine: Path, store_path: Path) -> Path:
    """A closed small store holding one page (a copy: no fsync per test)."""
    shutil.copytree(pristine, store_path, symlinks=True)
    return store_path


def _loop(path: Path) -> None:
    """Move the real directory (or file) aside and put a symlink loop in its place."""
    path.rename(path.with_name(path.name + ".real"))
    os.symlink(path.name, path)


def _file(path: Path) -> None:
    path.rename(path.with_name(path.name + ".real"))
    path.write_bytes(b"not a directory")


def _restore(path: Path) -> None:
    path.unlink()
    path.with_name(path.name + ".real").rename(path)


def _tree(top: Path) -> dict[str, tuple[int, int]]:
    """Every name under ``top``'s parent, without following links: (mode, size)."""
    found: dict[str, tuple[int, int]] = {}
    for dirpath, dirnames, filenames in os.walk(top.parent):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            found[str(path.relative_to(top.parent))] = (st.st_mode, st.st_size)
    return found


DAMAGE: dict[str, tuple[Callable[[Path], None], str, str, int]] = {
    # name: (damage, what is damaged, the words the message uses, errno)
    "wal-loop": (_loop, WAL_DIR, "is a symlink loop, not a directory", errno.ELOOP),
    "wal-file": (_file, WAL_DIR, "is a regular file, not a directory", errno.ENOTDIR),
    "segments-loop": (_loop, SEGMENTS_DIR, "is a symlink loop, not a directory", errno.ELOOP),
    "segments-file": (_file, SEGMENTS_DIR, "is a regular file, not a directory", errno.ENOTDIR),
    "index-loop": (_loop, INDEX_DIR, "is a symlink loop, not a directory", errno.ELOOP),
    "index-file": (_file, INDEX_DIR, "is a regular file, not a directory", errno.ENOTDIR),
    "superblock-loop": (_loop, SUPERBLOCK_NAME, "is a symlink loop", errno.ELOOP),
    "root-loop": (_loop, "", "is a symlink loop, not a directory", errno.ELOOP),
}
MODES = {
    "readonly": {"readonly": True},
    "writer": {},
    "create": {"create": True},  # as TierManager.open opens its NVMe tier
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_damaged_layout_is_refused_with_ioerror_and_nothing_changes(
    built: Path, kind: str, mode: str
) -> None:
    damage, name, words, code = DAMAGE[kind]
    damaged = built / name if name else built
    damage(damaged)
    before = _tree(built)
    with pytest.raises(IOFailure) as refused:
        KVStore.open(built, **MODES[mode])
    message = str(refused.value)
    assert f"{damaged} {words}" in message
    assert "kvstore changed nothing" in message
    assert refused.value.errno == code
    assert _tree(built) == before  # nothing deleted, moved or created
    # Put back, the store opens with its page.
    _restore(damaged)
    with KVStore.open(built, readonly=True) as store:
        assert store.get("k") == PAGE


def test_a_symlink_loop_on_the_path_to_the_root_is_named(tmp_path: Path) -> None:
    os.symlink("loop", tmp_path / "loop")
    for options in ({}, {"create": True}):
        with pytest.raises(IOFailure, match="a symlink on its path loops") as refused:
            KVStore.open(tmp_path / "loop" / "store", **options)
        assert refused.value.errno == errno.ELOOP
    assert sorted(os.listdir(tmp_path)) == ["loop"]


def test_create_through_a_symlink_to_an_empty_directory(tmp_path: Path) -> None:
    """The store is built beside its path and renamed into place: onto a symlink that
    raised NotADirectoryError; now it is made where the link points."""
    (tmp_path / "target").mkdir()
    os.symlink("target", tmp_path / "store")
    with open_small_store(tmp_path / "store") as store:
        store.put("k", PAGE)
    assert (tmp_path / "store").is_symlink()
    assert (tmp_path / "target" / SUPERBLOCK_NAME).is_file()
    with KVStore.open(tmp_path / "store", readonly=True) as store:
        assert store.get("k") == PAGE


def test_create_at_a_dangling_symlink_is_refused(tmp_path: Path) -> None:
    os.symlink("nowhere", tmp_path / "store")
    with pytest.raises(IOFailure, match=r"is a symlink to .*nowhere, which does not exist"):
        open_small_store(tmp_path / "store")
    assert sorted(os.listdir(tmp_path)) == ["store"]
    assert os.readlink(tmp_path / "store") == "nowhere"


def test_create_under_a_file_is_an_ioerror(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(IOFailure, match="cannot create a store at"):
        open_small_store(tmp_path / "file" / "store")


# -- the CLI -----------------------------------------------------------------------------


def _run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def _one_error_line(result: Result, words: str) -> None:
    assert result.exit_code == 8, result.output
    assert isinstance(result.exception, SystemExit)  # no traceback
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and words in lines[0]


@pytest.mark.parametrize("kind", ["wal-loop", "segments-file", "root-loop"])
@pytest.mark.parametrize(
    "command", [["stat"], ["fsck"], ["fsck", "--repair"], ["gc"], ["recover", "--dry-run"]]
)
def test_cli_exits_8_with_one_line(built: Path, kind: str, command: list[str]) -> None:
    damage, name, words, _ = DAMAGE[kind]
    damaged = built / name if name else built
    damage(damaged)
    before = _tree(built)
    if kind == "root-loop" and command[0] == "recover":
        words = "cannot open"  # recover reads the superblock first, through the loop
    result = _run(command[0], str(built), *command[1:])
    _one_error_line(result, words if words == "cannot open" else f"{damaged} {words}")
    assert _tree(built) == before


def test_recover_refuses_a_wal_loop_before_moving_anything(built: Path) -> None:
    _loop(built / WAL_DIR)
    before = _tree(built)
    _one_error_line(_run("recover", str(built)), "wal is a symlink loop")
    assert _tree(built) == before


def test_recover_moves_an_index_loop_aside(built: Path) -> None:
    """recover treats an index/ that is no directory as missing and moves it aside: a
    symlink loop there made its swap fail half-way (exists() is False for a loop)."""
    _loop(built / INDEX_DIR)
    result = _run("recover", str(built))
    assert result.exit_code in (0, 4), result.output
    aside = [p for p in built.iterdir() if p.name.startswith(INDEX_DIR + ".damaged-")]
    assert len(aside) == 1 and aside[0].is_symlink()
    with KVStore.open(built, readonly=True):
        pass  # without its index, a page no WAL record vouches for is dropped (exit 4)

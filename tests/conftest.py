"""Shared fixtures: a fresh store path per test and a helper that opens a small store.

"Small" keeps every test fast: 1 MiB segments (fallocate and fsync stay cheap)
and pages up to 256 KiB.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore import KVStore
from kvstore.io.engine import resolve_choice
from kvstore.io.files import probe_direct_io
from kvstore.io.probe import probe_uring

SMALL_SEGMENT_BYTES = 1 << 20
SMALL_MAX_PAGE_BYTES = 256 << 10

OpenStore = Callable[..., KVStore]


def open_small_store(path: str | os.PathLike[str], **options: Any) -> KVStore:
    """``KVStore.open(path, create=True, segment_bytes=1 MiB, max_page_bytes=256 KiB)``.

    ``options`` override any of those or add other ``StoreConfig`` fields.
    """
    options.setdefault("create", True)
    options.setdefault("segment_bytes", SMALL_SEGMENT_BYTES)
    options.setdefault("max_page_bytes", SMALL_MAX_PAGE_BYTES)
    return KVStore.open(path, **options)


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    """Where the test's store lives; it does not exist until the store is opened."""
    return tmp_path / "store"


@pytest.fixture
def open_store(store_path: Path) -> Iterator[OpenStore]:
    """``open_store(path=store_path, **options)``: open a small store, closed at teardown.

    Teardown closes every store the test left open, so no flusher thread, file
    descriptor or writer lock leaks into the next test. A close that fails
    there is ignored: the test already passed or failed on its own assertions.
    """
    opened: list[KVStore] = []

    def _open(path: str | os.PathLike[str] | None = None, **options: Any) -> KVStore:
        store = open_small_store(store_path if path is None else path, **options)
        opened.append(store)
        return store

    yield _open
    for store in opened:
        with contextlib.suppress(Exception):
            store.close()


@pytest.fixture
def store(open_store: OpenStore) -> KVStore:
    """A freshly created small store with the default engine and O_DIRECT choice."""
    return open_store()


@pytest.fixture(scope="session")
def direct_io_supported(tmp_path_factory: pytest.TempPathFactory) -> bool:
    """True when O_DIRECT works where pytest puts its temporary directories."""
    return probe_direct_io(tmp_path_factory.mktemp("direct-probe"))


# Suites by folder: `make unit` runs `-m unit`, `make crash` `-m crash` (crash loops,
# power loss, EIO, property machines), `make integ` the engines in their own venv.
_SUITE_MARKS = {
    "unit": "unit",
    "gpu": "unit",
    "crash": "crash",
    "property": "crash",
    "reliability": "crash",
    "integrations": "integ",
}
_TESTS_DIR = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        try:
            suite = Path(str(item.fspath)).resolve().relative_to(_TESTS_DIR).parts[0]
        except ValueError:  # outside tests/ (benches)
            continue
        mark = _SUITE_MARKS.get(suite)
        if mark is not None:
            item.add_marker(getattr(pytest.mark, mark))


def pytest_report_header(config: pytest.Config) -> str:
    """Which engine and binding this run exercises (CI reruns suites per engine)."""
    kind, binding, source = resolve_choice()
    verdict = probe_uring(binding)
    return f"kvstore: io_engine {kind} ({source}), uring_binding {binding}: {verdict.describe()}"


@pytest.fixture(scope="session")
def io_uring_supported() -> bool:
    """True when the binding in force (KVSTORE_URING_BINDING) passed its probe."""
    return probe_uring(resolve_choice()[1]).ok


@pytest.fixture(params=["io_uring", "threadpool"])
def engine_kind(request: pytest.FixtureRequest, io_uring_supported: bool) -> str:
    """Each I/O engine in turn; io_uring is skipped, with the probe's reason,
    where the binding in force cannot run here."""
    kind: str = request.param
    if kind == "io_uring" and not io_uring_supported:
        pytest.skip(f"io_uring is unusable here: {probe_uring(resolve_choice()[1]).reason}")
    return kind


def run_in_child(body: Callable[[], str]) -> str:
    """Run ``body`` in a forked child and return what it returned (or how it
    raised): a SIGBUS or SIGSEGV there fails the calling test, not pytest."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            result = body()
        except BaseException as e:
            result = f"raised {type(e).__name__}: {e}"
        os.write(write, result.encode()[:4000])
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        output = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    assert not os.WIFSIGNALED(status), f"killed by signal {os.WTERMSIG(status)}"
    return output

"""The io_uring binding is probed in a child process: nothing it does can kill us.

Fake ``liburing`` packages stand in for a binding built for another CPU (it
dies with SIGILL at its first ring, as the 2026 wheels do on CPUs without
AVX-512), one that hangs, and one that raises. Each must leave this process
alive, give a verdict that names what happened, and make ``io_engine="auto"``
fall back to the thread pool with that reason in ``stats()``.
"""

from __future__ import annotations

import json
import os
import textwrap
import time
from pathlib import Path

import pytest

from kvstore import IOFailure
from kvstore.io import probe as probe_module
from kvstore.io.bindings import load_binding
from kvstore.io.engine import make_engine, resolve_choice
from kvstore.io.probe import probe_uring
from tests.conftest import OpenStore

# A package that looks like the 2026 binding to kvstore (Ring + CqeIter) and
# does something fatal at its first ring.
_FAKE = """
import os, signal, time

class CqeIter: ...

def Ring():
    {body}
"""

BODIES = {
    "sigill": "os.kill(os.getpid(), signal.SIGILL)",
    "segv": "os.kill(os.getpid(), signal.SIGSEGV)",
    "hang": "time.sleep(600)",
    "raise": "raise RuntimeError('the fake binding is broken')",
    "exit": "os._exit(3)",
}


def _fake_binding(root: Path, behaviour: str) -> tuple[str, ...]:
    package = root / behaviour / "liburing"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        textwrap.dedent(_FAKE).format(body=BODIES[behaviour]), encoding="utf-8"
    )
    return (str(root / behaviour),)


@pytest.fixture
def probe_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private verdict cache (and no memo from earlier tests)."""
    directory = tmp_path / "probe-cache"
    monkeypatch.setenv("KVSTORE_CACHE_DIR", str(directory))
    monkeypatch.setattr(probe_module, "_memo", {})
    return directory


@pytest.mark.parametrize(
    ("behaviour", "words"),
    [
        ("sigill", "SIGILL"),
        ("segv", "SIGSEGV"),
        ("raise", "RuntimeError: the fake binding is broken"),
        ("exit", "probe process failed"),
    ],
)
def test_a_fatal_binding_gives_a_verdict_not_a_dead_process(
    tmp_path: Path, probe_cache: Path, behaviour: str, words: str
) -> None:
    search = _fake_binding(tmp_path, behaviour)
    verdict = probe_uring(search_path=search, timeout_s=20)
    assert not verdict.ok
    assert words in verdict.reason
    assert not verdict.cached


def test_a_hanging_binding_times_out(tmp_path: Path, probe_cache: Path) -> None:
    search = _fake_binding(tmp_path, "hang")
    started = time.monotonic()
    verdict = probe_uring(search_path=search, timeout_s=2)
    assert time.monotonic() - started < 15
    assert not verdict.ok
    assert "hung" in verdict.reason


def test_the_verdict_is_cached_on_disk_and_keyed_by_the_binding_files(
    tmp_path: Path, probe_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    search = _fake_binding(tmp_path, "sigill")
    first = probe_uring(search_path=search, timeout_s=20)
    files = list(probe_cache.glob("uring-probe-*.json"))
    assert len(files) == 1
    assert json.loads(files[0].read_text())["ok"] is False
    # A new process (no memo) answers from the file without starting a child.
    monkeypatch.setattr(probe_module, "_memo", {})

    def no_child(*args: object, **kwargs: object) -> object:
        raise AssertionError("the cached verdict should have answered")

    monkeypatch.setattr(probe_module, "_run_child", no_child)
    second = probe_uring(search_path=search, timeout_s=20)
    assert second.cached and second.reason == first.reason
    # Another build of the binding (its file changed) is probed again.
    init = Path(search[0]) / "liburing" / "__init__.py"
    init.write_text(init.read_text() + "\n# rebuilt\n", encoding="utf-8")
    monkeypatch.setattr(probe_module, "_memo", {})
    with pytest.raises(AssertionError, match="cached verdict"):
        probe_uring(search_path=search, timeout_s=20)


def test_a_damaged_cache_file_is_probed_again(tmp_path: Path, probe_cache: Path) -> None:
    search = _fake_binding(tmp_path, "raise")
    probe_uring(search_path=search, timeout_s=20)
    (cache_file,) = probe_cache.glob("uring-probe-*.json")
    cache_file.write_text('{"ok": true, "key": "someone else', encoding="utf-8")
    probe_module._memo.clear()
    verdict = probe_uring(search_path=search, timeout_s=20)
    assert not verdict.ok and not verdict.cached


def test_no_binding_installed(
    tmp_path: Path, probe_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(probe_module, "_binding_files", lambda search_path: None)
    verdict = probe_uring(search_path=(str(tmp_path),))
    assert not verdict.ok and "no io_uring binding" in verdict.reason


def test_auto_falls_back_to_the_thread_pool_with_the_reason(
    tmp_path: Path, probe_cache: Path, monkeypatch: pytest.MonkeyPatch, open_store: OpenStore
) -> None:
    search = _fake_binding(tmp_path, "sigill")
    verdict = probe_uring(search_path=search, timeout_s=20)
    # The verdict of whichever binding is in force (KVSTORE_URING_BINDING may name one).
    monkeypatch.setattr(probe_module, "_memo", {(resolve_choice()[1], ()): verdict})
    store = open_store(io_engine="auto")
    stats = store.stats()
    assert stats.io_engine == "threadpool"
    assert "SIGILL" in stats.io_engine_reason
    store.put(b"k", b"v" * 5000, sync=True)
    assert store.get(b"k") == b"v" * 5000
    # Asking for io_uring by name is an error that carries the reason.
    with pytest.raises(IOFailure, match="SIGILL"):
        make_engine("io_uring")


def test_the_environment_forces_an_engine(
    monkeypatch: pytest.MonkeyPatch, open_store: OpenStore
) -> None:
    monkeypatch.setenv("KVSTORE_IO_ENGINE", "threadpool")
    store = open_store()
    assert store.stats().io_engine == "threadpool"
    assert "KVSTORE_IO_ENGINE" in store.stats().io_engine_reason
    monkeypatch.setenv("KVSTORE_IO_ENGINE", "spdk")
    with pytest.raises(ValueError, match="KVSTORE_IO_ENGINE"):
        resolve_choice("auto")
    # An explicit config value wins over the environment.
    assert resolve_choice("threadpool")[0] == "threadpool"


def test_a_binding_of_the_other_flavour_is_refused_by_name(probe_cache: Path) -> None:
    installed = load_binding().name
    other = "liburing-2026" if installed == "liburing-2024" else "liburing-2024"
    with pytest.raises(IOFailure, match=f"uring_binding={other!r}"):
        load_binding(other)
    with pytest.raises(ValueError, match="uring_binding must be"):
        load_binding("liburing-1999")


def test_the_installed_binding_runs_here(io_uring_supported: bool) -> None:
    """On every CI machine the pinned binding (2024.5.3) must pass its probe:
    this is the test that fails where io_uring silently became the fallback."""
    if os.environ.get("KVSTORE_URING_BINDING") or os.environ.get("KVSTORE_EXPECT_NO_URING"):
        pytest.skip("a binding other than the pinned one is being exercised")
    verdict = probe_uring()
    assert verdict.ok, verdict.reason
    assert io_uring_supported


def _cpu_has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as handle:
            return "avx512f" in handle.read()
    except OSError:
        return False


def test_the_2026_wheel_runs_or_is_refused_for_a_named_reason() -> None:
    """`make test` reruns the engine tests with the 2026 wheel on PYTHONPATH
    (KVSTORE_URING_BINDING=liburing-2026): where the CPU has AVX-512 it must
    run; where it does not, the probe must have caught its SIGILL."""
    if os.environ.get("KVSTORE_URING_BINDING") != "liburing-2026":
        pytest.skip("the 2026 wheel is exercised by `make test-bindings`")
    verdict = probe_uring("liburing-2026")
    release = os.uname().release.split("-")[0].split(".")
    kernel = (int(release[0]), int(release[1])) if len(release) > 1 else (0, 0)
    if _cpu_has_avx512() and kernel >= (6, 14):
        assert verdict.ok, verdict.reason
    else:
        assert verdict.ok or "SIGILL" in verdict.reason or "refused" in verdict.reason, verdict


def _flaky_import(monkeypatch: pytest.MonkeyPatch, failures: int) -> list[str]:
    """``import liburing`` fails ``failures`` times with the 2024 wheel's loader's
    FileNotFoundError (two processes racing on its bytecode cache), then imports."""
    import importlib

    from kvstore.io import bindings as bindings_module

    real = importlib.import_module
    calls: list[str] = []

    def flaky(name: str, package: str | None = None) -> object:
        if name == "liburing":
            calls.append(name)
            if len(calls) <= failures:
                raise FileNotFoundError(2, "No such file or directory", "__init__.importer.pyc")
        return real(name, package)

    monkeypatch.setattr(bindings_module, "_loaded", {})
    monkeypatch.setattr(importlib, "import_module", flaky)
    return calls


def test_an_import_that_loses_the_loaders_file_race_is_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CI's fresh clone: a reader process opening the store lost that race and died
    (FileNotFoundError out of KVStore.open); the second import finds the cache rebuilt."""
    try:
        installed = load_binding().name
    except IOFailure:
        pytest.skip("no liburing importable here")
    calls = _flaky_import(monkeypatch, failures=1)
    assert load_binding().name == installed
    assert len(calls) == 2


def test_an_import_that_keeps_failing_on_a_file_is_an_io_failure_and_auto_falls_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _flaky_import(monkeypatch, failures=99)
    with pytest.raises(IOFailure, match=r"importing liburing failed.*FileNotFoundError"):
        load_binding()
    assert len(calls) == 2
    # The child's probe could import it, this process cannot: auto takes the thread
    # pool with the reason, io_uring by name is refused with it (never a raw OSError).
    ok = probe_module.ProbeVerdict(ok=True, binding="liburing-2024", version="0", reason="")
    monkeypatch.setattr(probe_module, "probe_uring", lambda *a, **k: ok)
    engine = make_engine("auto")
    try:
        assert engine.why.startswith("thread pool: io_uring unusable")
        assert "FileNotFoundError" in engine.why
    finally:
        engine.close()
    with pytest.raises(IOFailure, match=r"cannot run here.*FileNotFoundError"):
        make_engine("io_uring")

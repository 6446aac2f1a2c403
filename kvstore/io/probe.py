"""Prove an io_uring binding runs here, in a child process, before using it.

A native binding can kill the process that calls it: the PyPI ``liburing``
2026 wheels carry AVX-512 instructions and die with SIGILL on CPUs without
them, inside the first ``Ring()``. No ``try`` catches that. So the first time
a binding is wanted on a machine, a child process imports it, makes a ring,
runs a NOP and a write + scattered read through a temporary file, and prints
one JSON line. The parent turns whatever happened (an answer, a signal, a hang,
an exception) into a ``ProbeVerdict`` with the reason in words.

The verdict is cached, in this process and in a small JSON file under
``$KVSTORE_CACHE_DIR`` (default ``$XDG_CACHE_HOME/kvstore`` or
``~/.cache/kvstore``), keyed by the binding's files (names, sizes, mtimes), the
CPU's flags, the kernel release, ``kernel.io_uring_disabled`` and the Python
build: a second open costs a few stat calls, and any change that could change
the answer probes again. The cache holds no code and nothing but JSON.

``python -m kvstore.io.probe`` prints the verdict (``--json``, ``--fresh``).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["ProbeVerdict", "cache_dir", "probe_uring", "uring_available"]

PROBE_VERSION = 1
_TIMEOUT_S = 30.0
_memo: dict[tuple[str, tuple[str, ...]], ProbeVerdict] = {}
_memo_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class ProbeVerdict:
    """Whether io_uring through ``binding`` works in this process, and why not."""

    ok: bool
    binding: str | None  # "liburing-2024" / "liburing-2026" when known
    version: str | None
    reason: str  # empty when ok
    cached: bool = False

    def describe(self) -> str:
        if self.ok:
            return f"io_uring via {self.binding} {self.version}"
        return self.reason


def cache_dir() -> Path:
    """Where probe verdicts are cached (``$KVSTORE_CACHE_DIR`` overrides)."""
    explicit = os.environ.get("KVSTORE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvstore"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as handle:
            for line in handle:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _read_small(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as handle:
            return handle.read(64).strip()
    except OSError:
        return ""


def _binding_files(search_path: tuple[str, ...]) -> list[list[object]] | None:
    """Name, size and mtime of each file of the importable ``liburing``, found
    without importing it (importing native code is what the child is for)."""
    path = list(search_path) + sys.path if search_path else None
    spec = importlib.machinery.PathFinder.find_spec("liburing", path)
    if spec is None or spec.origin is None:
        return None
    origin = Path(spec.origin)
    root = origin.parent if spec.submodule_search_locations else origin
    files: list[list[object]] = []
    candidates = sorted(root.rglob("*")) if root.is_dir() else [root]
    for candidate in candidates:
        if candidate.suffix in (".py", ".so", ".pyd") or ".so." in candidate.name:
            try:
                stat = candidate.stat()
            except OSError:
                continue
            files.append([str(candidate), stat.st_size, stat.st_mtime_ns])
    return files


def _fingerprint(wanted: str, files: list[list[object]]) -> str:
    uname = os.uname()
    facts = {
        "probe": PROBE_VERSION,
        "wanted": wanted,
        "files": files,
        "cpu": hashlib.sha256(_cpu_flags().encode()).hexdigest(),
        "kernel": [uname.release, uname.machine],
        "io_uring_disabled": _read_small("/proc/sys/kernel/io_uring_disabled"),
        "python": [sys.executable, sys.version],
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def _load_cached(directory: Path, key: str) -> ProbeVerdict | None:
    try:
        with open(directory / f"uring-probe-{key[:32]}.json", encoding="utf-8") as handle:
            raw = json.load(handle)
        if raw.get("key") != key:
            return None
        return ProbeVerdict(
            ok=bool(raw["ok"]),
            binding=raw.get("binding"),
            version=raw.get("version"),
            reason=str(raw.get("reason", "")),
            cached=True,
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # no cache, or a damaged one: probe again


def _store_cached(directory: Path, key: str, verdict: ProbeVerdict) -> None:
    record = {**asdict(verdict), "key": key}
    record.pop("cached", None)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".probe-", dir=directory)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(record, handle)
        os.replace(tmp, directory / f"uring-probe-{key[:32]}.json")
    except OSError:
        pass  # a read-only home: the in-process memo still spares this process


def _signal_reason(signum: int) -> str:
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    if signum == signal.SIGILL:
        return (
            "the binding was killed by SIGILL in a probe process: it executes CPU "
            "instructions this CPU lacks (the liburing 2026 wheels need AVX-512)"
        )
    return f"the binding was killed by {name} in a probe process"


def _run_child(wanted: str, search_path: tuple[str, ...], timeout_s: float) -> ProbeVerdict:
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    parts = [*search_path, package_root]
    if env.get("PYTHONPATH"):
        parts.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env.pop("KVSTORE_IO_ENGINE", None)
    command = [sys.executable, "-m", "kvstore.io.probe", "--child", wanted]
    try:
        done = subprocess.run(
            command,
            env=env,
            capture_output=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return ProbeVerdict(
            False,
            None,
            None,
            f"the binding hung: a probe process gave no answer in {timeout_s:g} s",
        )
    except OSError as e:
        return ProbeVerdict(False, None, None, f"could not start a probe process: {e}")
    if done.returncode < 0:
        return ProbeVerdict(False, None, None, _signal_reason(-done.returncode))
    answer: dict[str, object] | None = None
    for line in reversed(done.stdout.decode(errors="replace").splitlines()):
        try:
            parsed = json.loads(line)
        except ValueError:
            continue
        if isinstance(parsed, dict) and "ok" in parsed:
            answer = parsed
            break
    if answer is None:
        tail = done.stderr.decode(errors="replace").strip().splitlines()
        detail = tail[-1] if tail else f"exit status {done.returncode}"
        return ProbeVerdict(False, None, None, f"the probe process failed: {detail}")
    binding = answer.get("binding")
    version = answer.get("version")
    return ProbeVerdict(
        ok=bool(answer["ok"]),
        binding=str(binding) if binding is not None else None,
        version=str(version) if version is not None else None,
        reason="" if answer["ok"] else str(answer.get("reason", "unknown")),
    )


def probe_uring(
    wanted: str = "auto",
    *,
    search_path: tuple[str, ...] = (),
    timeout_s: float = _TIMEOUT_S,
    use_cache: bool = True,
    cache: Path | None = None,
) -> ProbeVerdict:
    """Whether io_uring through the importable binding (``wanted``: ``"auto"``,
    ``"liburing-2024"`` or ``"liburing-2026"``) runs here. Never raises, never
    runs the binding in this process.

    ``search_path`` is put before ``sys.path`` when looking for the binding (and
    on the child's PYTHONPATH): tests use it to probe fake bindings.
    """
    memo_key = (wanted, search_path)
    if use_cache:
        with _memo_lock:
            memoised = _memo.get(memo_key)
        if memoised is not None:
            return memoised
    try:
        files = _binding_files(search_path)
    except (ImportError, ValueError, OSError) as e:
        files, find_error = None, str(e)
    else:
        find_error = ""
    if files is None:
        verdict = ProbeVerdict(
            False,
            None,
            None,
            "no io_uring binding is installed (pip install liburing==2024.5.3)"
            + (f": {find_error}" if find_error else ""),
        )
    else:
        directory = cache if cache is not None else cache_dir()
        key = _fingerprint(wanted, files)
        cached = _load_cached(directory, key) if use_cache else None
        if cached is not None:
            verdict = cached
        else:
            verdict = _run_child(wanted, search_path, timeout_s)
            _store_cached(directory, key, verdict)
    with _memo_lock:
        _memo[memo_key] = verdict
    return verdict


def uring_available(binding: str = "auto") -> bool:
    """True if io_uring through ``binding`` runs here (probed in a child process)."""
    return probe_uring(binding).ok


def _child(wanted: str) -> int:
    """Run in the probe process: exercise the binding, print one JSON line."""
    from kvstore.errors import IOFailure
    from kvstore.io.bindings import load_binding
    from kvstore.io.uring import UringQueue

    answer: dict[str, object] = {"ok": False, "binding": None, "version": None}
    try:
        binding = load_binding(wanted)
        answer.update(binding=binding.name, version=binding.version)
        queue = UringQueue(4, binding)
        try:
            queue.nop(1)
            if queue.wait(1) != [(1, 0)]:
                raise IOFailure("a NOP did not complete as expected")
            with tempfile.TemporaryFile() as handle:
                data = bytes(range(256)) * 32  # 8 KiB
                queue.write(handle.fileno(), 0, memoryview(data), 2)
                if queue.wait(1) != [(2, len(data))]:
                    raise IOFailure("a write did not complete as expected")
                head, tail = bytearray(4096), bytearray(4096)
                queue.readv(handle.fileno(), 0, [memoryview(head), memoryview(tail)], 3)
                if queue.wait(1) != [(3, len(data))] or bytes(head + tail) != data:
                    raise IOFailure("a scattered read returned other bytes")
        finally:
            queue.close()
        answer["ok"] = True
    except (OSError, IOFailure, ValueError) as e:
        detail = e.args[0] if isinstance(e, IOFailure) and e.args else str(e)
        answer["reason"] = f"io_uring is refused here: {detail}"
    except Exception as e:  # a binding that raises what it should not
        answer["reason"] = f"the binding raised {type(e).__name__}: {e}"
    print(json.dumps(answer), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "--child":
        return _child(args[1])
    fresh = "--fresh" in args
    as_json = "--json" in args
    rest = [arg for arg in args if arg not in ("--fresh", "--json")]
    wanted = rest[0] if rest else os.environ.get("KVSTORE_URING_BINDING", "auto")
    verdict = probe_uring(wanted, use_cache=not fresh)
    if as_json:
        print(json.dumps(asdict(verdict)))
    else:
        print(("usable: " if verdict.ok else "not usable: ") + verdict.describe())
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

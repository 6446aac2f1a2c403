"""The package's layers, and who may reach into ``KVStore`` and LMDB.

Three ratchets (docs/design.md, "Layers"): the allowed imports per layer, LMDB writes and
syncs only through ``IndexEnv`` (the path kvstore.testing.faults records and cuts),
and no private ``KVStore`` name used outside kvstore/store.py and
kvstore/lifecycle.py. Each has a list of today's exceptions. The lists may only
shrink: a new exception fails, and so does one that is no longer needed (remove
it, or lower its count, in the same change that made it unnecessary).
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvstore"

# Lowest first. A package imports from lower layers; within its own layer only
# along SAME_LAYER. ``__init__`` is kvstore/__init__.py.
LAYERS: list[set[str]] = [
    {"errors"},
    {"format"},
    {"config", "types", "io"},
    {"log", "inputs"},
    {"index", "identity"},
    {"telemetry"},
    {"space"},
    {"store", "lifecycle", "check", "recover"},
    {"gpu", "tiering", "bench", "testing"},
    {"integrations", "cli", "__init__"},
]
SAME_LAYER = {
    ("store", "check"),  # KVStore.check runs check_store (a lazy import)
    ("check", "store"),
    ("lifecycle", "store"),
    ("store", "lifecycle"),
    ("testing", "tiering"),  # the tier manager's kill -9 harness (testing/tier_crash.py)
}
# (file, imported package): why. Only shrinks.
IMPORT_EXCEPTIONS = {
    ("kvstore/tiering/sim/cli.py", "cli"): "shares the CLI's console and exit codes",
    ("kvstore/bench/cli.py", "cli"): "shares the CLI's console and exit codes",
}
# gpu/ may not import format/: it reads held, verified extents from the store.
FORBIDDEN = {("gpu", "format")}


def _package(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else path.stem


def _layer_of(package: str) -> int:
    for index, members in enumerate(LAYERS):
        if package in members:
            return index
    raise AssertionError(f"kvstore/{package} is in no layer of tests/unit/test_layering.py")


def _kvstore_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "kvstore" and len(parts) > 1:
                found.add(parts[1])
    return found


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_imports_follow_the_layers() -> None:
    used: set[tuple[str, str]] = set()
    wrong = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        source = _package(path)
        for target in _kvstore_imports(path) - {source}:
            below = _layer_of(target) < _layer_of(source)
            same = _layer_of(target) == _layer_of(source) and (source, target) in SAME_LAYER
            allowed = (below or same) and (source, target) not in FORBIDDEN
            if allowed:
                continue
            if (rel, target) in IMPORT_EXCEPTIONS:
                used.add((rel, target))
                continue
            wrong.append(f"{rel} imports kvstore.{target}")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)
    stale = set(IMPORT_EXCEPTIONS) - used
    assert not stale, f"exceptions no longer needed, remove them: {sorted(stale)}"


# -- LMDB: writes and syncs only through IndexEnv ----------------------------

INDEX_ENV = "kvstore/index/lmdb_env.py"
# (file, what): how many. Only shrinks.
LMDB_EXCEPTIONS: Counter[tuple[str, str]] = Counter()  # none left: keep it so
# Not the store's index: the peers' LMDB-blob write path, benchmarked.
LMDB_NOT_THE_INDEX = {"kvstore/bench/peers.py"}


def _lmdb_uses(path: Path) -> Counter[str]:
    uses: Counter[str] = Counter()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        func = node.func
        if func.attr == "open" and isinstance(func.value, ast.Name) and func.value.id == "lmdb":
            uses["lmdb.open"] += 1
        elif func.attr == "begin":
            for kw in node.keywords:
                if kw.arg == "write" and not (
                    isinstance(kw.value, ast.Constant) and kw.value.value is False
                ):
                    uses["write transaction"] += 1
        elif (
            func.attr == "sync"
            and isinstance(func.value, ast.Attribute)
            and func.value.attr == "env"  # IndexEnv.env.sync(...): LMDB's own fsync
        ):
            uses["sync"] += 1
    return uses


def test_lmdb_writes_and_syncs_go_through_index_env() -> None:
    found: Counter[tuple[str, str]] = Counter()
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        if rel == INDEX_ENV or rel in LMDB_NOT_THE_INDEX:
            continue
        for what, count in _lmdb_uses(path).items():
            found[(rel, what)] += count
    extra = {k: v for k, v in found.items() if v > LMDB_EXCEPTIONS.get(k, 0)}
    assert not extra, (
        "LMDB opened, written or synced outside IndexEnv (the fault injector does not "
        f"see it): {extra}"
    )
    fewer = {k: (found.get(k, 0), v) for k, v in LMDB_EXCEPTIONS.items() if found.get(k, 0) < v}
    assert not fewer, f"exceptions that shrank, lower them (found, allowed): {fewer}"


def test_the_lmdb_scan_sees_what_it_looks_for(tmp_path: Path) -> None:
    """The scan above would pass vacuously if it recognised nothing."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import lmdb\n"
        "env = lmdb.open('x')\n"
        "with env.begin(write=True) as txn: pass\n"
        "with env.begin(write=False) as txn: pass\n"
        "index.env.sync(True)\n"
    )
    assert _lmdb_uses(sample) == Counter({"lmdb.open": 1, "write transaction": 1, "sync": 1})


# -- no private KVStore names outside the store ------------------------------

STORE_FILES = {"kvstore/store.py", "kvstore/lifecycle.py"}
_THIS_FILE = "tests/unit/test_layering.py"
# file: uses of private KVStore names. Issue 17 took it to none; it may not grow.
PRIVATE_ALLOWANCE: dict[str, int] = {}  # none left: keep it so (KVStore.internals)
# Receivers that are not a KVStore (another class's private names of the same
# spelling): the tier manager, its mover's queue and tickets, LMCache's backend.
NOT_A_STORE = {"tm", "b", "mover._copy_queue", "ticket"}


def _private_store_names() -> set[str]:
    tree = ast.parse((PACKAGE / "store.py").read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "KVStore":
            for inner in ast.walk(node):
                if isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef):
                    name = inner.name
                elif isinstance(inner, ast.AnnAssign) and isinstance(inner.target, ast.Name):
                    name = inner.target.id  # a field declared in the class body
                elif (
                    isinstance(inner, ast.Attribute)
                    and isinstance(inner.value, ast.Name)
                    and inner.value.id == "self"
                ):
                    name = inner.attr
                else:
                    continue
                if name.startswith("_") and not name.startswith("__"):
                    names.add(name)
    return names


def _private_uses_in(text: str, pattern: re.Pattern[str]) -> int:
    found = 0
    for line in text.splitlines():
        for match in pattern.finditer(line):
            receiver = match.group(1)
            if receiver == "self" or receiver in NOT_A_STORE:
                continue
            if receiver.startswith("self.") and receiver not in ("self.store", "self._store"):
                continue  # the module's own object's attribute
            found += 1
    return found


def _private_pattern() -> re.Pattern[str]:
    names = _private_store_names()
    assert {
        "_state",
        "_env",
        "_check_writable_locked",
        "_buffers",
    } <= names  # the scan found the class
    alternatives = "|".join(sorted(names, key=len, reverse=True))
    return re.compile(rf"\b([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)\.({alternatives})\b")


def _private_uses() -> Counter[str]:
    pattern = _private_pattern()
    uses: Counter[str] = Counter()
    for top in ("kvstore", "tests", "tools", "benches"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in STORE_FILES or rel == _THIS_FILE or "__pycache__" in path.parts:
                continue  # (this file names private uses in its own test of the scan)
            found = _private_uses_in(path.read_text(), pattern)
            if found:
                uses[rel] = found
    return uses


def test_the_private_scan_sees_what_it_looks_for() -> None:
    pattern = _private_pattern()
    text = "store._state.lock\nrun.store._journal.wal\nself._state = x\ntm._lock\nstore.internals"
    assert _private_uses_in(text, pattern) == 2


def test_no_new_private_access_to_kvstore() -> None:
    uses = _private_uses()
    over = {
        f: (n, PRIVATE_ALLOWANCE.get(f, 0))
        for f, n in uses.items()
        if n > PRIVATE_ALLOWANCE.get(f, 0)
    }
    assert not over, (
        "private KVStore names used outside kvstore/store.py (found, allowed); add a "
        f"public or internal accessor instead: {over}"
    )
    fewer = {f: (uses.get(f, 0), n) for f, n in PRIVATE_ALLOWANCE.items() if uses.get(f, 0) < n}
    assert not fewer, f"allowances that shrank, lower them (found, allowed): {fewer}"

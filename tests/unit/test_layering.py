"""The package's layers, and who may reach into ``KVStore`` and LMDB.

Four ratchets (docs/design.md, "Layers"): the allowed imports per layer, LMDB writes and
syncs only through ``IndexEnv`` (the path kvstore.testing.faults records and cuts),
no private ``KVStore`` name used outside kvstore/store.py and
kvstore/lifecycle.py, and no import circles between kvstore modules. Each has a
list of today's exceptions. The lists may only shrink: a new exception fails, and
so does one that is no longer needed (remove it, or lower its count, in the same
change that made it unnecessary).
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvstore"

# Lowest first. A package imports from lower layers; within its own layer only
# along SAME_LAYER. ``__init__`` is kvstore/__init__.py.
LAYERS: list[set[str]] = [
    {"errors"},
    {"format"},
    {"config", "types", "io", "clikit"},  # clikit: what the command lines share
    {"log", "inputs"},
    {"index", "identity"},
    {"telemetry"},
    {"runtime"},
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
    ("bench", "tiering"),  # the tier manager's costs (bench/tiering.py)
    ("bench", "gpu"),  # the HBM path's check and bandwidth (bench/gpu_check.py)
}
# (file, imported package): why. Only shrinks.
IMPORT_EXCEPTIONS: dict[tuple[str, str], str] = {}  # none left (the CLIs share clikit)
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


# -- no import circles ----------------------------------------------------------

# Circles of kvstore modules (the modules of one strongly connected component):
# why it is still there. Only shrinks: a new circle fails, and so does one listed
# here that is gone (remove it in the change that broke it). None left (issue 26):
# the CLIs share kvstore/clikit.py, the vLLM tier and spec share
# kvstore/integrations/vllm_namespace.py, and uring_available moved from
# kvstore/io/uring.py to kvstore/io/probe.py. Keep it so.
CIRCLE_ALLOWANCE: dict[frozenset[str], str] = {}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import the interpreter can run: at module level and inside functions
    (lazy imports are the ones that hide a circle), not under ``if TYPE_CHECKING:``
    (never run: an annotation cannot make an import circle)."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def _import_graph(package_dir: Path) -> dict[str, dict[str, int]]:
    """Module -> {imported module of the same package: line of the first import}.

    An import names the deepest module it reaches (``from kvstore.io import probe``
    is kvstore.io.probe; ``from kvstore.tiering import TierManager`` is
    kvstore.tiering, its ``__init__``). The parent packages a module import runs
    implicitly are not edges.
    """
    top = package_dir.name
    modules: dict[str, tuple[Path, str]] = {}  # name: (file, package it is in)
    for path in sorted(package_dir.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = (top, *path.relative_to(package_dir).with_suffix("").parts)
        if parts[-1] == "__init__":
            modules[".".join(parts[:-1])] = (path, ".".join(parts[:-1]))
        else:
            modules[".".join(parts)] = (path, ".".join(parts[:-1]))

    def deepest(name: str) -> str | None:
        while name not in modules:
            if "." not in name:
                return None
            name = name.rsplit(".", 1)[0]
        return name

    graph: dict[str, dict[str, int]] = {name: {} for name in modules}
    for name, (path, package) in modules.items():
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [deepest(alias.name) for alias in node.names]
            else:
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    where = ".".join(base + ([node.module] if node.module else []))
                else:
                    where = node.module or ""
                targets = [deepest(f"{where}.{alias.name}") for alias in node.names]
            for target in targets:
                if target is not None and target != name:
                    graph[name].setdefault(target, node.lineno)
    return graph


def _circles(graph: dict[str, dict[str, int]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in graph[node]:
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.add(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _circle_problems(
    graph: dict[str, dict[str, int]], allowance: Mapping[frozenset[str], str]
) -> list[str]:
    circles = _circles(graph)
    problems = []
    for circle in sorted(circles - set(allowance), key=sorted):
        edges = [
            f"    {source} -> {target} (line {line})"
            for source in sorted(circle)
            for target, line in sorted(graph[source].items())
            if target in circle
        ]
        problems.append(f"import circle {sorted(circle)}:\n" + "\n".join(edges))
    for circle in sorted(set(allowance) - circles, key=sorted):
        problems.append(f"allowed circle {sorted(circle)} is gone: remove it from the list")
    return problems


def test_no_import_circles() -> None:
    problems = _circle_problems(_import_graph(PACKAGE), CIRCLE_ALLOWANCE)
    assert not problems, (
        "kvstore modules that import each other, lazily or not (move what both need "
        "into a module below them):\n" + "\n".join(problems)
    )


def test_the_circle_check_sees_a_new_circle(tmp_path: Path) -> None:
    """On a tiny package: a circle closed by a lazy import fails; a type-only
    import and a one-way import do not; an allowance that is gone fails too."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.c import C\n")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from .sub import c\n"
        "if TYPE_CHECKING:\n"
        "    from pkg.a import A\n"
    )
    (pkg / "sub" / "c.py").write_text("class C:\n    pass\n")
    (pkg / "d.py").write_text("import pkg.a\n")
    graph = _import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.b": 1}
    assert graph["pkg.b"] == {"pkg.sub.c": 2}  # the TYPE_CHECKING import is no edge
    assert graph["pkg.sub"] == {"pkg.sub.c": 1}
    assert _circle_problems(graph, {}) == []

    # c.py (in a subpackage) imports d in a function; d imports a: a circle of four.
    (pkg / "sub" / "c.py").write_text("def late():\n    from pkg.d import x\n")
    graph = _import_graph(pkg)
    circle = frozenset({"pkg.a", "pkg.b", "pkg.sub.c", "pkg.d"})
    assert _circles(graph) == {circle}
    problems = _circle_problems(graph, {})
    assert len(problems) == 1 and "pkg.sub.c -> pkg.d (line 2)" in problems[0], problems
    assert _circle_problems(graph, {circle: "why"}) == []

    # b.py imports a lazily too: the same circle, still one.
    (pkg / "b.py").write_text("from .sub import c\n\n\ndef late():\n    import pkg.a\n")
    assert _circles(_import_graph(pkg)) == {circle}

    (pkg / "sub" / "c.py").write_text("")  # now only a <-> b: not the allowed circle
    graph = _import_graph(pkg)
    assert _circles(graph) == {frozenset({"pkg.a", "pkg.b"})}
    problems = _circle_problems(graph, {circle: "why"})
    assert len(problems) == 2, problems
    assert "pkg.b -> pkg.a (line 5)" in problems[0] and "is gone" in problems[1]

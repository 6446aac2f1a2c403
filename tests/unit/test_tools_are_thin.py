"""tools/*.py are command lines only: their code lives under kvstore/ (bench, testing),
where mypy checks it and there is one copy of each helper (docs/benchmarks.md, "The
tools"). A tool holds a docstring, imports, at most a ``sys.path`` line (so that it
runs from a checkout without an install) and ``sys.exit(main())``; nothing else.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)


def _is_sys_path_insert(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Call)
        and ast.unparse(node.value.func) == "sys.path.insert"
    )


def _is_main_guard(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.If)
        and ast.unparse(node.test) == "__name__ == '__main__'"
        and [ast.unparse(s) for s in node.body] == ["sys.exit(main())"]
    )


def _what_is_not_thin(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    wrong = []
    mains = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and any(a.name == "main" for a in node.names):
            mains.append(node.module or "")
        if isinstance(node, ast.Import | ast.ImportFrom) or _is_docstring(node):
            continue
        if _is_sys_path_insert(node) or _is_main_guard(node):
            continue
        wrong.append(f"line {node.lineno}: {ast.unparse(node).splitlines()[0]}")
    if len(mains) != 1 or not mains[0].startswith("kvstore."):
        wrong.append(f"main comes from {mains or 'nowhere'}, not one kvstore module")
    return wrong


@pytest.mark.parametrize("path", sorted(TOOLS.glob("*.py")), ids=lambda p: p.name)
def test_a_tool_is_a_thin_command_line(path: Path) -> None:
    wrong = _what_is_not_thin(path)
    assert not wrong, f"{path.name} holds code that belongs under kvstore/: {wrong}"


def test_the_check_sees_code_in_a_tool(tmp_path: Path) -> None:
    """The check above would pass vacuously if it recognised nothing."""
    thin = tmp_path / "thin.py"
    thin.write_text(
        '"""Doc."""\nimport sys\nfrom kvstore.bench.x import main\n\n'
        'if __name__ == "__main__":\n    sys.exit(main())\n'
    )
    assert _what_is_not_thin(thin) == []
    fat = tmp_path / "fat.py"
    fat.write_text(
        "import sys\nfrom kvstore.bench.x import main\nMIB = 1 << 20\n\n"
        "def helper() -> None:\n    pass\n"
    )
    wrong = _what_is_not_thin(fat)
    assert len(wrong) == 2 and "MIB" in wrong[0] and "def helper" in wrong[1], wrong
    local = tmp_path / "local.py"
    local.write_text("def main() -> int:\n    return 0\n")
    assert any("not one kvstore module" in w for w in _what_is_not_thin(local))

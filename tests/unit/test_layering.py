"""The head does not import the worker package: it validates with triptych.families, and only
monolithic mode (triptych_head.main.run_monolithic) loads the in-process pipeline."""

from __future__ import annotations

import ast
from pathlib import Path

HEAD = Path(__file__).resolve().parents[2] / "head" / "triptych_head"


def _worker_imports(path: Path) -> list[tuple[str, int]]:
    """(enclosing function, line) of every import of triptych_worker in `path`."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else function
            modules = []
            if isinstance(child, ast.Import):
                modules = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                modules = [child.module or ""]
            if any(m.split(".")[0] == "triptych_worker" for m in modules):
                found.append((name, child.lineno))
            visit(child, name)

    visit(ast.parse(path.read_text()), "<module>")
    return found


def test_only_monolithic_mode_reaches_into_the_worker_package() -> None:
    imports = {str(p.relative_to(HEAD)): _worker_imports(p) for p in sorted(HEAD.rglob("*.py"))}
    imports = {path: found for path, found in imports.items() if found}
    assert list(imports) == ["main.py"], imports
    assert [function for function, _ in imports["main.py"]] == ["run_monolithic"]

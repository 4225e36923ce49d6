"""Which shipped package may import which, read from the source with `ast` (every import statement,
top-level or inside a function, and importlib.import_module / __import__ of a constant name).

- No shipped package (what the images install) imports the local tooling, triptych_dev (devtools/):
  no image has it.
- The core, triptych, imports neither the head nor the worker package, except where `triptych serve`
  hands over to the role it starts (ALLOWED_CORE_IMPORTS).
- The head does not import the worker package: it validates with triptych.families, and only
  monolithic mode (triptych_head.main.run_monolithic) loads the in-process pipeline.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from tests.source_ast import parse

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = {
    "triptych": ROOT / "triptych",
    "triptych_head": ROOT / "head" / "triptych_head",
    "triptych_worker": ROOT / "worker" / "triptych_worker",
    "triptych_operator": ROOT / "operator" / "triptych_operator",
}
LOCAL_TOOLING = "triptych_dev"
HEAD = SHIPPED["triptych_head"]

# (module of the core, enclosing function, imported module) -> why the core may import it.
ALLOWED_CORE_IMPORTS = {
    ("triptych/launch.py", "_serve_role", "triptych_head.main"): (
        "`triptych serve --disagg-role server|monolithic` starts the head; imported only then, so the "
        "worker image's other roles and the operator image never load it"
    ),
    ("triptych/launch.py", "_serve_role", "triptych_worker.transfer.listeners"): (
        "a worker re-executes under the bind shim before the worker's own imports (torch, the model), "
        "so that the first image of the process does as little as it can"
    ),
    ("triptych/launch.py", "_serve_role", "triptych_worker.runtime"): (
        "`triptych serve --disagg-role <worker role>` starts the worker; imported only then, so the "
        "head image (no torch) never loads it"
    ),
}


@dataclass(frozen=True)
class Import:
    path: str  # relative to the repository
    function: str  # the enclosing function, "<module>" at top level
    module: str
    line: int


def imports_of(path: Path, package: str) -> list[Import]:
    """Every import in `path`, a module of the shipped `package`."""
    parts = path.relative_to(SHIPPED[package]).with_suffix("").parts
    is_package = parts[-1] == "__init__"
    name = ".".join([package, *parts[:-1]] if is_package else [package, *parts])
    return imports_in(path.read_text(), name, is_package, path.relative_to(ROOT).as_posix())


def imports_in(source: str, name: str, is_package: bool, path: str) -> list[Import]:
    """Every import in the source of module `name`, with the function it sits in."""
    found: list[Import] = []
    here = name.split(".") if is_package else name.split(".")[:-1]

    def absolute(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        return ".".join([*here[: len(here) - node.level + 1], *([node.module] if node.module else [])])

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            enclosing = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else function
            modules: list[str] = []
            if isinstance(child, ast.Import):
                modules = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                modules = [absolute(child)]
            elif isinstance(child, ast.Call) and _is_dynamic_import(child):
                modules = [child.args[0].value]  # type: ignore[attr-defined]
            found.extend(Import(path, enclosing, module, child.lineno) for module in modules)  # type: ignore[attr-defined]
            visit(child, enclosing)

    visit(parse(source, path), "<module>")
    return found


def _is_dynamic_import(call: ast.Call) -> bool:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    first = call.args[0] if call.args else None
    return name in ("import_module", "__import__") and isinstance(first, ast.Constant) and isinstance(first.value, str)


def shipped_imports(package: str) -> list[Import]:
    return [i for path in sorted(SHIPPED[package].rglob("*.py")) for i in imports_of(path, package)]


def top(module: str) -> str:
    return module.partition(".")[0]


def test_no_shipped_package_imports_the_local_tooling() -> None:
    found = [i for package in SHIPPED for i in shipped_imports(package) if top(i.module) == LOCAL_TOOLING]
    assert found == [], "the images do not install triptych_dev; move this code there or out of it:\n" + "\n".join(
        f"{i.path}:{i.line} ({i.function}) imports {i.module}" for i in found
    )


def test_the_core_imports_the_head_and_worker_packages_only_where_serve_starts_them() -> None:
    found = [i for i in shipped_imports("triptych") if top(i.module) in ("triptych_head", "triptych_worker")]
    unexpected = [i for i in found if (i.path, i.function, i.module) not in ALLOWED_CORE_IMPORTS]
    assert unexpected == [], "\n".join(f"{i.path}:{i.line} ({i.function}) imports {i.module}" for i in unexpected)
    assert {(i.path, i.function, i.module) for i in found} == set(ALLOWED_CORE_IMPORTS), "a stale allow-list entry"


def test_only_monolithic_mode_reaches_into_the_worker_package() -> None:
    found = [i for i in shipped_imports("triptych_head") if top(i.module) == "triptych_worker"]
    assert found, "monolithic mode loads the pipeline from the worker package"
    assert {(i.path, i.function) for i in found} == {("head/triptych_head/main.py", "run_monolithic")}, found


def test_the_walk_sees_imports_inside_functions_relative_ones_and_import_module() -> None:
    source = (
        "import os\n"
        "def f():\n"
        "    from triptych_dev.pool import launch_pool\n"
        "async def g():\n"
        "    import importlib\n"
        "    return importlib.import_module('triptych_dev.prefork')\n"
        "from ..roles import Role\n"
        "from . import rules\n"
    )
    found = imports_in(source, "triptych.families.probe", is_package=False, path="probe.py")
    assert [(i.function, i.module) for i in found] == [
        ("<module>", "os"),
        ("f", "triptych_dev.pool"),
        ("g", "importlib"),
        ("g", "triptych_dev.prefork"),
        ("<module>", "triptych.roles"),
        ("<module>", "triptych.families"),
    ]

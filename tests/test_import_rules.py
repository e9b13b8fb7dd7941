"""The package's layering, read from the source: which part may import which.

Every ``import`` in ``src/tokenmill`` is parsed (``ast``, nothing is imported)
and resolved to the module it names. How imports count:

* the layer rules count every import: at module level, inside a function (a
  function-local import is still a dependency, only a later one), and under
  ``if TYPE_CHECKING:`` (an annotation that names another layer's type couples
  the two all the same);
* the circle check counts the imports that run: module-level and
  function-local ones, not ``TYPE_CHECKING`` ones (those never execute). A
  function-local import does not fail at import time, but it still closes a
  circle between two modules that each need the other, which is what the rule
  is about; so it counts.

An import of a package names its ``__init__``; ``from pkg import name`` names
the submodule ``pkg.name`` when there is one.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "tokenmill"
# The package root's base modules: what every part may build on; they build on nothing above them.
BASE = {"config", "options", "tokenizer", "capture", "corpus", "cli_args", "gguf_file", "bundled", "credentials",
        "unsupported", "kv_events", "cache_misses", "request_guard", "grammar_limits", "tenants", "tenant_gate",
        "priority_classes", "tracing"}


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    target: str  # dotted module name (in the package) or a top-level name outside it
    function_local: bool
    type_checking: bool
    line: int


def _modules() -> dict[str, tuple[Path, bool]]:
    found = {}
    for path in (SRC / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        found[".".join(parts)] = (path, is_package)
    return found


MODULES = _modules()


def _resolve(name: str) -> str:
    """The deepest module of the package that ``name`` lies in, or its top-level name outside it."""
    if not name.startswith(PACKAGE):
        return name.split(".")[0]
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports_of(module: str, path: Path, is_package: bool) -> list[Import]:
    package = module if is_package else module.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, local: bool, type_checking: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for stmt in child.body:
                    one(stmt, local, True)
                for stmt in child.orelse:
                    one(stmt, local, type_checking)
            else:
                one(child, local, type_checking)

    def one(node: ast.AST, local: bool, type_checking: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(module, _resolve(alias.name), local, type_checking, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                full = f"{target}.{alias.name}"
                found.append(Import(module, _resolve(full if full in MODULES else target), local, type_checking,
                                    node.lineno))
        visit(node, local or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)), type_checking)

    visit(ast.parse(path.read_text(encoding="utf-8")), False, False)
    return found


IMPORTS = [imp for module, (path, is_package) in sorted(MODULES.items())
           for imp in _imports_of(module, path, is_package)]


def _part(module: str) -> str:
    """``model``, ``engine``, ... for modules in a sub-package; ``base`` for the root's base modules."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return parts[0]  # outside the package (torch, the standard library, ...)
    if len(parts) == 1:
        return "root"
    if parts[1] in BASE:
        return "base"
    return parts[1] if (SRC / PACKAGE / parts[1]).is_dir() else f"root:{parts[1]}"


# importer part -> parts it must never import (with the reason the rule holds)
NEVER: dict[str, dict[str, str]] = {
    "model": {"engine": "the model knows no scheduler"},
    "engine": {"entrypoints": "the engine speaks no HTTP"},
    "bench": {"engine": "the load tester talks HTTP only", "model": "the load tester talks HTTP only",
              "torch": "the load tester installs without torch"},
    "router": {"engine": "the router talks HTTP only", "model": "the router talks HTTP only",
               "torch": "the router installs without torch", "entrypoints": "the router is not a server of models"},
    "evaluate": {"model": "evaluation scores through the engine"},
    "base": {part: "base modules build on nothing above them"
             for part in ("model", "engine", "entrypoints", "bench", "router", "evaluate", "root")},
}


def _violations() -> list[str]:
    out = []
    for imp in IMPORTS:
        reason = NEVER.get(_part(imp.importer), {}).get(_part(imp.target))
        if reason is not None:
            kind = "type-checking " if imp.type_checking else "function-local " if imp.function_local else ""
            out.append(f"{imp.importer}:{imp.line} {kind}imports {imp.target} ({reason})")
    return out


def _circles() -> list[list[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for imp in IMPORTS:
        if not imp.type_checking and imp.target in MODULES and imp.target != imp.importer:
            graph[imp.importer].add(imp.target)
    # Tarjan's strongly connected components: every component of more than one module is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return circles


def test_the_reader_sees_the_package() -> None:
    assert "tokenmill.engine.engine" in MODULES and "tokenmill.model.llama" in MODULES
    engine_imports = {imp.target for imp in IMPORTS if imp.importer == "tokenmill.engine.engine"}
    assert "tokenmill.engine.step_batch" in engine_imports and "torch" in engine_imports
    assert _part("tokenmill.config") == "base" and _part("tokenmill.engine.runner") == "engine"


def test_no_layer_imports_what_it_must_not() -> None:
    assert _violations() == []


def test_no_import_circles() -> None:
    assert _circles() == []


def test_the_checks_catch_a_break() -> None:
    """The rules and the circle search fail on a planted break (they are not vacuous)."""
    kept = list(IMPORTS)
    try:
        IMPORTS.append(Import("tokenmill.model.llama", "tokenmill.engine.runner", True, False, 1))
        assert "tokenmill.model.llama:1 function-local imports tokenmill.engine.runner (the model knows no " \
               "scheduler)" in _violations()
        assert any({"tokenmill.engine.runner", "tokenmill.model.llama"} <= set(c) for c in _circles())
    finally:
        IMPORTS[:] = kept

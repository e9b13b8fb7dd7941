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
# The package root holds only its faces; everything else lives in a folder named for its kind.
FACES = {"__init__", "demo", "__main__"}
# The shared floor, lowest first: each folder builds only on those before it (and nothing above).
FLOOR = ["settings", "files", "gateway", "traffic"]
WINGS = ["model", "engine", "entrypoints", "bench", "router", "evaluate"]


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
    """The folder a module lives in, as a path below the package (``engine/kv``, ``settings``);
    ``root`` for the package's faces; a top-level name outside the package (``torch``)."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return parts[0]
    path, is_package = MODULES[module]
    folder = path.parent.relative_to(SRC / PACKAGE)
    return "root" if str(folder) == "." else folder.as_posix()


def _wing(part: str) -> str:
    """The top folder of a part (``engine`` for ``engine/kv``)."""
    return part.split("/")[0]


def _floor_rules() -> dict[str, dict[str, str]]:
    above = WINGS + ["root"]
    rules = {}
    for i, name in enumerate(FLOOR):
        later = FLOOR[i + 1:]
        rules[name] = {p: "the shared floor builds on nothing above it" for p in above}
        rules[name] |= {p: f"{name} builds only on {', '.join(FLOOR[:i]) or 'nothing of the package'}" for p in later}
    return rules


# importer (a folder, or a wing for all its folders) -> folders or wings it must never import, and why
NEVER: dict[str, dict[str, str]] = {
    "model": {"engine": "the model knows no scheduler"},
    "engine": {"entrypoints": "the engine speaks no HTTP"},
    "bench": {"engine": "the load tester talks HTTP only", "model": "the load tester talks HTTP only",
              "torch": "the load tester installs without torch"},
    "router": {"engine": "the router talks HTTP only", "model": "the router talks HTTP only",
               "torch": "the router installs without torch", "entrypoints": "the router is not a server of models"},
    "evaluate": {"model": "evaluation scores through the engine"},
    "engine/kv": {"engine": "the KV cache's bookkeeping knows no engine above it",
                  "engine/step": "the KV cache's bookkeeping runs no model",
                  "engine/sched": "the KV cache's bookkeeping knows no scheduler",
                  "engine/spec": "the KV cache's bookkeeping knows no speculation"},
    "engine/grammar": {p: "grammars know nothing of the engine" for p in
                       ("engine", "engine/step", "engine/sched", "engine/kv", "engine/spec")},
    "engine/sched": {"engine/step": "the scheduler runs no model", "engine/spec": "speculation proposes before scheduling"},
    "engine/step": {"engine/sched": "a step runs what it is given"},
    "model/kernels": {p: "kernels know no model" for p in ("model", "model/models", "model/quant", "model/lora",
                                                         "model/attention")},
    "entrypoints/parsers": {p: "parsers read model text, whatever API carries it" for p in
                            ("entrypoints/openai", "entrypoints/anthropic", "entrypoints/console", "entrypoints/cli")},
    **_floor_rules(),
}


def _rule(importer: str, target: str) -> str | None:
    """The reason ``importer``'s folder must not import ``target``'s, if any: rules named for the
    folder itself come before its wing's, and a rule against another wing covers all its folders
    (inside a wing a rule names the folder: ``engine`` there is the wing's own top modules)."""
    if importer == target:
        return None
    for who in (importer, _wing(importer)):
        rules = NEVER.get(who, {})
        if target in rules:
            return rules[target]
        if _wing(target) != _wing(importer) and _wing(target) in rules:
            return rules[_wing(target)]
    return None


def _violations() -> list[str]:
    out = []
    for imp in IMPORTS:
        reason = _rule(_part(imp.importer), _part(imp.target))
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
    assert "tokenmill.engine.engine" in MODULES and "tokenmill.model.models.llama" in MODULES
    engine_imports = {imp.target for imp in IMPORTS if imp.importer == "tokenmill.engine.engine"}
    assert "tokenmill.engine.step.step_batch" in engine_imports and "torch" in engine_imports
    assert _part("tokenmill.settings.config") == "settings" and _part("tokenmill.engine.step.runner") == "engine/step"
    assert _part("tokenmill") == "root" and _part("tokenmill.engine") == "engine"


def _loose() -> list[str]:
    """Modules at the package root that are not its faces."""
    return sorted(m for m, (path, _) in MODULES.items()
                  if path.parent == SRC / PACKAGE and path.stem not in FACES)


def _crowded(limit: int = 16) -> list[str]:
    """Folders holding more than ``limit`` modules (their ``__init__`` aside)."""
    count: dict[str, int] = {}
    for path, is_package in MODULES.values():
        if not is_package:
            folder = path.parent.relative_to(SRC / PACKAGE).as_posix()
            count[folder] = count.get(folder, 0) + 1
    return sorted(f"{f} ({n})" for f, n in count.items() if n > limit)


def test_the_root_holds_only_faces() -> None:
    assert _loose() == []


def test_no_folder_is_crowded() -> None:
    assert _crowded() == []


def test_every_folder_has_a_place_in_the_rules() -> None:
    """A new top folder is a floor folder or a wing: the rules cannot miss it."""
    tops = {p.name for p in (SRC / PACKAGE).iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert tops == set(FLOOR) | set(WINGS)


def test_no_layer_imports_what_it_must_not() -> None:
    assert _violations() == []


def test_no_import_circles() -> None:
    assert _circles() == []


def test_the_checks_catch_a_break() -> None:
    """The rules, the root check and the circle search fail on a planted break (they are not vacuous)."""
    kept = list(IMPORTS)
    try:
        IMPORTS.append(Import("tokenmill.model.models.llama", "tokenmill.engine.step.runner", True, False, 1))
        assert "tokenmill.model.models.llama:1 function-local imports tokenmill.engine.step.runner (the model " \
               "knows no scheduler)" in _violations()
        assert any({"tokenmill.engine.step.runner", "tokenmill.model.models.llama"} <= set(c) for c in _circles())
        IMPORTS.append(Import("tokenmill.settings.config", "tokenmill.gateway.tenants", False, False, 2))
        assert any("settings.config:2" in v and "builds only on" in v for v in _violations())
        IMPORTS.append(Import("tokenmill.engine.kv.block_pool", "tokenmill.engine.sched.scheduler", False, True, 3))
        assert any("block_pool:3 type-checking" in v for v in _violations())
    finally:
        IMPORTS[:] = kept
    MODULES["tokenmill.stray"] = (SRC / PACKAGE / "stray.py", False)
    try:
        assert _loose() == ["tokenmill.stray"]
    finally:
        del MODULES["tokenmill.stray"]

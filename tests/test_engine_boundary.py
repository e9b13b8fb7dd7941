"""Nothing outside the engine reaches into its scheduler or KV pool.

The scheduler and the pool belong to the engine's thread; the server, the
console, the offline ``LLM`` and the evaluation probes read the engine's
published snapshot (``LLMEngine.stats``, engine/stats.py) or call an engine
method (``temporary_budget``, ``tenant_shares``, ``num_running``). Read from the
source with ``ast`` (nothing is imported): an attribute ``scheduler`` or
``pool`` taken of anything named ``engine`` (``engine.pool``,
``self.engine.scheduler``, ``getattr(state.engine, "pool")``) in
``entrypoints/`` or ``evaluate/`` fails. The engine's resolved settings
(``engine.config.scheduler``) are settings, not the scheduler, and stay readable.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "tokenmill"
OUTSIDE = ("entrypoints", "evaluate")
INTERNALS = {"scheduler", "pool"}


def _names_engine(node: ast.expr) -> bool:
    """``engine``, ``aengine.engine``, ``self.engine``, ``state.engine``, ..."""
    if isinstance(node, ast.Name):
        return node.id == "engine"
    return isinstance(node, ast.Attribute) and node.attr == "engine"


def reach_ins(source: str, filename: str = "<source>") -> list[int]:
    """Lines of ``source`` that take the engine's scheduler or pool."""
    lines = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Attribute) and node.attr in INTERNALS and _names_engine(node.value):
            lines.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "getattr", "setattr", "hasattr") and len(node.args) >= 2 and _names_engine(node.args[0])
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in INTERNALS):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_scan_finds_each_way_of_reaching_in():
    source = ("engine.pool.num_blocks\nself.engine.scheduler.running\nstate.engine.scheduler.order\n"
              "getattr(engine, 'pool')\nengine.config.scheduler.max_num_seqs\nengine.stats.blocks_total\n"
              "router.pool\n")
    assert reach_ins(source) == [1, 2, 3, 4]


def test_entrypoints_and_evaluate_read_only_what_the_engine_publishes():
    found = []
    for folder in OUTSIDE:
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            for line in reach_ins(path.read_text(), str(path)):
                found.append(f"{path.relative_to(PACKAGE)}:{line}")
    assert not found, "the engine's scheduler or pool reached from outside it: " + ", ".join(found)


def test_temporary_budget_widens_the_steps_and_gives_the_budget_back():
    from conftest import make_tiny_llm

    engine = make_tiny_llm(max_num_batched_tokens=32, scheduling_policy="fair").engine
    with engine.temporary_budget(100):
        assert engine.scheduler.token_budget == 100
    assert engine.scheduler.token_budget == 32
    with pytest.raises(RuntimeError), engine.temporary_budget(8):
        assert engine.scheduler.token_budget == 32  # never narrower than configured
        raise RuntimeError
    assert engine.config.scheduler.max_num_batched_tokens == 32
    assert engine.tenant_shares() == {}  # nobody served yet

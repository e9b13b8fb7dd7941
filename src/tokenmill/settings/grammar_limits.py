"""How big a grammar or JSON schema may be, and the cheap checks made before compiling one.

Why: the grammar library parses a grammar by recursion, so a grammar that is
a chain of a few thousand rules, or a schema whose ``$defs`` chain a thousand
references, overflows a thread's stack and takes the whole process with it
(a SIGSEGV cannot be caught). Compiling therefore happens first in a worker
process (grammar_worker.py), and these checks refuse the plainly oversized
inputs before even that: the text's size, the number of rules, the depth of
the rule (or ``$ref``) graph. All limits are ``serve`` flags
(docs/security.md lists them).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

# Lark: "name:" or "?name:" / "!name:" or "name.2:" at a line's start (not GBNF's "::=")
_LARK_RULE = re.compile(r"^\s*[?!]?([A-Za-z_][A-Za-z0-9_]*)(?:\.-?\d+)?\s*:(?!:)", re.MULTILINE)
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_STRINGS = re.compile(r'"(?:[^"\\\n]|\\.)*"i?|/(?:[^/\\\n]|\\.)+/[imslux]*|\'(?:[^\'\\\n]|\\.)*\'')


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on one grammar's compilation and on what compiled grammars may hold."""

    max_bytes: int = 256 * 1024  # the grammar text or the schema as JSON
    max_rules: int = 2000  # Lark/GBNF rules, or schema nodes with a $ref or in $defs
    max_depth: int = 200  # the longest chain of rule references (or $refs)
    compile_timeout_s: float = 10.0  # one compilation in the worker
    worker_memory_bytes: int = 2 << 30  # address space of a worker process
    workers: int = 1  # worker processes compiling in parallel
    queue_size: int = 16  # compilations waiting for a worker; beyond it, 429
    cache_bytes: int = 256 << 20  # compiled grammars kept, by their measured size

    def problems(self) -> list[str]:
        """What is wrong with the values (empty: usable)."""
        out = []
        for name in ("max_bytes", "max_rules", "max_depth", "worker_memory_bytes", "workers", "queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                out.append(f"{name} must be a positive integer (got {value!r})")
        if not isinstance(self.cache_bytes, int) or self.cache_bytes < 0:
            out.append(f"cache_bytes must be a non-negative integer (got {self.cache_bytes!r})")
        if not isinstance(self.compile_timeout_s, (int, float)) or not self.compile_timeout_s > 0:
            out.append(f"compile_timeout_s must be a positive number (got {self.compile_timeout_s!r})")
        return out


class GrammarTooLarge(ValueError):
    """A grammar or schema over one of the limits; the message names which."""


def check_text(kind: str, value: Any, limits: GrammarLimits) -> None:
    """Raises GrammarTooLarge when the spec's text, rule count or reference depth is over the limits."""
    if kind == "json":
        text = value if isinstance(value, str) else json.dumps(value)
        _check_size(len(text.encode("utf-8", "replace")), "the JSON schema", limits)
        schema = value
        if isinstance(value, str):
            try:
                schema = json.loads(value)
            except (json.JSONDecodeError, RecursionError):
                return  # the compiler's own message says what is wrong with it
        nodes, depth = schema_shape(schema)
        if nodes > limits.max_rules:
            raise GrammarTooLarge(f"the JSON schema has {nodes} definitions and references, more than the "
                                  f"limit of {limits.max_rules} (--grammar-max-rules)")
        if depth > limits.max_depth:
            raise GrammarTooLarge(f"the JSON schema nests or chains references {depth} deep, more than the "
                                  f"limit of {limits.max_depth} (--grammar-max-depth)")
    elif kind == "grammar" and isinstance(value, str):
        _check_size(len(value.encode("utf-8", "replace")), "the grammar", limits)
        rules = len(_LARK_RULE.findall(value.replace("::=", ":")))  # counted first: cheap, and refuses most
        if rules > limits.max_rules:
            raise GrammarTooLarge(f"the grammar has {rules} rules, more than the limit of {limits.max_rules} "
                                  "(--grammar-max-rules)")
        _, depth = lark_shape(value)
        if depth > limits.max_depth:
            raise GrammarTooLarge(f"the grammar's rules reference each other {depth} deep, more than the "
                                  f"limit of {limits.max_depth} (--grammar-max-depth)")
    elif kind in ("regex", "choice"):
        size = len(value.encode("utf-8", "replace")) if isinstance(value, str) else \
            sum(len(str(v).encode("utf-8", "replace")) for v in value or ())
        _check_size(size, "the regex" if kind == "regex" else "the choice list", limits)


def _check_size(size: int, what: str, limits: GrammarLimits) -> None:
    if size > limits.max_bytes:
        raise GrammarTooLarge(f"{what} has {size} bytes, more than the limit of {limits.max_bytes} "
                              "(--grammar-max-bytes)")


def lark_shape(text: str) -> tuple[int, int]:
    """(number of rules, longest chain of references between them) of a Lark or GBNF grammar.

    A rough reading (definitions at line starts, identifiers in bodies with
    string and regex literals removed) that errs on the side of counting a
    reference; cycles (recursive rules) count once."""
    text = text.replace("::=", ":")  # GBNF definitions read the same way here
    text = _STRINGS.sub(" ", text)
    heads = list(_LARK_RULE.finditer(text))
    bodies: dict[str, set[str]] = {}
    for i, head in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        body = text[head.end():end]
        bodies.setdefault(head.group(1), set()).update(_IDENT.findall(body))
    graph = {name: {ref for ref in refs if ref in bodies and ref != name} for name, refs in bodies.items()}
    return len(heads), longest_chain(graph)


def schema_shape(schema: Any) -> tuple[int, int]:
    """(number of ``$defs``/``definitions`` entries and ``$ref``s, deepest nesting counting each
    ``$ref`` hop) of a JSON schema; cycles count once. Iterative: a deep input cannot overflow here."""
    defs: dict[str, Any] = {}
    nodes = 0
    stack: list[Any] = [schema]
    while stack:  # collect named definitions and count references
        node = stack.pop()
        if isinstance(node, dict):
            for key in ("$defs", "definitions"):
                block = node.get(key)
                if isinstance(block, dict):
                    for name, sub in block.items():
                        defs[f"#/{key}/{name}"] = sub
                        nodes += 1
            if isinstance(node.get("$ref"), str):
                nodes += 1
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    # the graph: each definition (and the root) -> (definitions it references, its own nesting depth)
    own: dict[str, tuple[set[str], int]] = {}
    for name, sub in [("#", schema), *defs.items()]:
        refs: set[str] = set()
        deepest = 0
        walk: list[tuple[Any, int]] = [(sub, 1)]
        while walk:
            node, depth = walk.pop()
            deepest = max(deepest, depth)
            if isinstance(node, dict):
                ref = node.get("$ref")
                if isinstance(ref, str) and ref in defs:
                    refs.add(ref)
                for key, value in node.items():
                    if key not in ("$defs", "definitions"):
                        walk.append((value, depth + 1))
            elif isinstance(node, list):
                walk.extend((v, depth + 1) for v in node)
        own[name] = (refs, deepest)
    graph = {name: refs - {name} for name, (refs, _) in own.items()}
    nesting = max(d for _, d in own.values()) // 2  # a schema level is an object and its keyword
    return nodes, longest_chain(graph) + nesting


def longest_chain(graph: dict[str, set[str]]) -> int:
    """Edges on the longest path of ``graph`` (an edge back into the path is not followed), iteratively."""
    best: dict[str, int] = {}
    on_path: set[str] = set()
    for start in graph:
        if start in best:
            continue
        stack: list[tuple[str, list[str]]] = [(start, sorted(graph.get(start, ())))]
        on_path.add(start)
        while stack:
            name, todo = stack[-1]
            while todo and (todo[-1] in on_path or todo[-1] in best):
                todo.pop()
            if todo:
                child = todo.pop()
                on_path.add(child)
                stack.append((child, sorted(graph.get(child, ()))))
                continue
            stack.pop()
            on_path.discard(name)
            best[name] = max((best[c] + 1 for c in graph.get(name, ()) if c in best), default=0)
    return max(best.values(), default=0)

"""What a request constrains its output to (``GrammarSpec``) and how that becomes llguidance's
grammar text: JSON schemas closed and their regex classes made ASCII, choices, Lark and GBNF.

Its own module so that the grammar compile worker (grammar_worker.py, a separate process)
and the server's structured outputs (structured.py) share it without importing each other.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

GrammarKind = Literal["json", "json_object", "regex", "choice", "grammar"]

# JSON without free whitespace: a small model left free to emit whitespace
# inside an object can loop on newlines until max_tokens.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class GrammarSpec:
    """What one request constrains its output to. ``value``: the schema (dict or JSON
    text) for ``json``, the pattern for ``regex``, a tuple of strings for ``choice``,
    Lark or GBNF text for ``grammar``; unused for ``json_object``."""

    kind: GrammarKind
    value: Any = None

    def key(self) -> str:
        value = self.value
        if isinstance(value, dict):
            value = json.dumps(value, sort_keys=True)
        elif isinstance(value, (list, tuple)):
            value = json.dumps(list(value))
        return f"{self.kind}\x00{value}"

    def to_llguidance(self) -> str:
        """The llguidance grammar text; raises ValueError for malformed input."""
        import llguidance

        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        if self.kind == "json":
            schema = self.value
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
            if isinstance(schema, bool):
                schema = {} if schema else {"not": {}}
            if not isinstance(schema, dict):
                raise ValueError("the JSON schema must be an object")
            return llguidance.LLMatcher.grammar_from_json_schema(ascii_schema(closed_schema(schema)),
                                                                 defaults=_JSON_OPTIONS)
        if self.kind == "regex":
            if not isinstance(self.value, str):
                raise ValueError("the regex must be a string")
            return llguidance.LLMatcher.grammar_from_regex(ascii_classes(self.value))
        if self.kind == "choice":
            choices = list(self.value or [])
            if not choices or not all(isinstance(c, str) for c in choices):
                raise ValueError("choice must be a non-empty list of strings")
            alternatives = " | ".join(json.dumps(c) for c in choices)
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
        if self.kind == "grammar":
            if not isinstance(self.value, str) or not self.value.strip():
                raise ValueError("the grammar must be a non-empty string")
            text = self.value
            if "::=" in text:  # GBNF / EBNF as llama.cpp and xgrammar take it
                from llguidance.gbnf_to_lark import gbnf_to_lark

                try:
                    text = gbnf_to_lark(text)
                except Exception as exc:  # noqa: BLE001 - the converter raises its own types
                    raise ValueError(f"the GBNF grammar could not be read: {exc}") from None
            return llguidance.LLMatcher.grammar_from_lark(text)
        raise ValueError(f"unknown structured output kind {self.kind!r}")


def closed_schema(schema: Any, depth: int = 0) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that lists its
    properties and says nothing about others (``true`` stays open).

    Why: a schema's author almost always means the keys listed (OpenAI's strict
    mode requires saying so, and xgrammar, vLLM's default backend, assumes it);
    left open, a small model constrained to the object tends to invent extra
    keys with long free-text values until max_tokens instead of closing it."""
    if depth > 32:
        return schema
    if isinstance(schema, list):
        return [closed_schema(s, depth + 1) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_schema(v, depth + 1) if k in _SUBSCHEMA_KEYS else v for k, v in schema.items()}
    for key in ("properties", "$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            out[key] = {k: closed_schema(v, depth + 1) for k, v in schema[key].items()}
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema \
            and "patternProperties" not in schema:
        out["additionalProperties"] = False
    return out


# Shorthand classes as vLLM's default engine and JSON Schema read them (ASCII);
# llguidance's regex engine reads them as Unicode (``\d`` matching any script's digits).
_ASCII_CLASSES = {"d": "0-9", "w": "0-9A-Za-z_", "s": " \\t\\n\\r\\f\\v"}


def ascii_classes(pattern: str) -> str:
    """``pattern`` with ``\\d``, ``\\w``, ``\\s`` (and their negations outside brackets)
    spelled as ASCII classes. A negated shorthand inside brackets (``[\\D]``) has no
    ASCII spelling there and is left as written."""
    out: list[str] = []
    depth = 0  # bracket nesting (regex-syntax allows nested classes)
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            cls = _ASCII_CLASSES.get(nxt.lower())
            if cls is not None and nxt.islower():
                out.append(cls if depth else f"[{cls}]")
            elif cls is not None and not depth:
                out.append(f"[^{cls}]")
            else:
                out.append(pattern[i:i + 2])
            i += 2
            continue
        if ch == "[":
            depth += 1
            out.append(ch)
            i += 1
            if pattern.startswith("^", i):
                out.append("^")
                i += 1
            if pattern.startswith("]", i):  # a leading ] is a literal
                out.append("]")
                i += 1
            continue
        if ch == "]" and depth:
            depth -= 1
        out.append(ch)
        i += 1
    return "".join(out)


def ascii_schema(schema: Any, depth: int = 0) -> Any:
    """``schema`` with every ``pattern`` (and ``patternProperties`` key) through ``ascii_classes``."""
    if depth > 64:
        return schema
    if isinstance(schema, list):
        return [ascii_schema(s, depth + 1) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "pattern" and isinstance(value, str):
            out[key] = ascii_classes(value)
        elif key == "patternProperties" and isinstance(value, dict):
            out[key] = {ascii_classes(k): ascii_schema(v, depth + 1) for k, v in value.items()}
        elif key in ("enum", "const", "default", "examples"):
            out[key] = value
        else:
            out[key] = ascii_schema(value, depth + 1)
    return out


_SUBSCHEMA_KEYS = ("items", "anyOf", "oneOf", "allOf", "prefixItems", "not", "if", "then", "else")


def first_line(message: str) -> str:
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    text = " ".join(lines[:4]) if lines else "the grammar is invalid"
    return text if len(text) <= 400 else text[:400] + "..."

"""Structured outputs: a per-request grammar that masks the sampler's logits.

Why llguidance: it installs from pip with no dependencies, builds its token
trie straight from the ``tokenizers`` JSON the engine already holds, and
refuses (rather than silently drops) JSON-schema keywords it cannot enforce,
so a request it cannot honour becomes a 400 that names the keyword instead
of free text. Its masks cost a few hundredths of a millisecond per row at a
49k vocabulary (docs/structured_outputs.md has the measurement against
xgrammar and outlines-core).

The flow: ``GrammarSpec`` (what the client asked: a JSON schema, any JSON
object, a regex, a choice, a Lark/GBNF grammar) is compiled once per
distinct grammar into a template matcher; each sequence gets a cheap copy.
Before sampling, the engine fills one bitmask row per constrained sequence
(in parallel, on a worker thread while the forward pass runs); the sampler
sets disallowed logits to -inf; after sampling, each accepted token advances
its sequence's matcher. EOS is in the mask only where the grammar accepts.

With speculative decoding a constrained sequence may run proposals: they are
cut at the first token the grammar refuses (``grammar_prefix``), and its
verify rows get one mask each, at the matcher's state after the proposals
before them (``fill_step``: llguidance advances a matcher through the draft
and rolls it back). The matcher itself only ever consumes emitted tokens, so a
rejected proposal leaves nothing to undo.
"""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

import torch

GrammarKind = Literal["json", "json_object", "regex", "choice", "grammar"]

# JSON without free whitespace: a small model left free to emit whitespace
# inside an object can loop on newlines until max_tokens.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHE_SIZE = 128


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


def grammar_prefix(matcher: Any, draft: Sequence[int], eos_token_ids: Sequence[int] | frozenset[int]) -> int:
    """How many leading tokens of ``draft`` the grammar accepts from ``matcher``'s state,
    stopping before any EOS (a proposal past the end of the text is of no use, and a
    matcher that consumed EOS has no further masks). Leaves the matcher as it was."""
    if not draft or matcher.is_stopped() or matcher.is_error():
        return 0
    n = int(matcher.validate_tokens(list(draft)))
    for i in range(n):
        if draft[i] in eos_token_ids:
            return i
    return n


@dataclass
class StepMasks:
    """Grammar mask rows of one step: per constrained request, its first row in
    ``rows``; a request verifying K proposals owns 1 + K consecutive rows (the mask
    before each proposal, then the one after the last)."""

    rows: torch.Tensor
    first_row: dict[int, int] = field(default_factory=dict)  # id(request) -> row

    def has(self, request: Any) -> bool:
        return id(request) in self.first_row

    def of(self, request: Any, count: int = 1) -> torch.Tensor:
        """The ``count`` rows of ``request``."""
        start = self.first_row[id(request)]
        return self.rows[start : start + count]

    def select(self, requests: Sequence[Any]) -> torch.Tensor:
        """The first row of each of ``requests``, in order."""
        order = torch.tensor([self.first_row[id(r)] for r in requests], dtype=torch.long)
        return self.rows.index_select(0, order)


class GrammarError(ValueError):
    """A grammar the engine cannot enforce; the message names the part."""


class StructuredOutputs:
    """Compiles grammars for one tokenizer and fills batches of token masks.

    Thread-safe for ``compile`` (the server validates requests on its own
    threads while the engine thread runs)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 num_threads: int = 2) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._num_threads = num_threads
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._executor: Any = None
        self._templates: OrderedDict[str, Any] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self.words = (vocab_size + 31) // 32
        # what masks cost: time spent filling them, and the part of it the step waited for
        self.mask_rows = 0
        self.mask_seconds = 0.0
        self.mask_wait_seconds = 0.0

    def _tok(self) -> Any:
        """The llguidance tokenizer, built on first use (it takes a moment at a 49k vocabulary)."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                backend = self._tokenizer.backend
                self._ll_tokenizer = llguidance.LLTokenizer(
                    backend.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None)
                self._executor = llguidance.LLExecutor(self._num_threads)
            return self._ll_tokenizer

    def compile(self, spec: GrammarSpec) -> Any:
        """A fresh matcher for ``spec``; raises GrammarError naming what cannot be enforced."""
        import llguidance

        key = spec.key()
        with self._lock:
            template = self._templates.get(key)
            if template is not None:
                self._templates.move_to_end(key)
                return template.deep_copy()
        try:
            tok = self._tok()
        except Exception as exc:  # noqa: BLE001 - a tokenizer llguidance cannot read
            raise GrammarError(f"structured outputs are not available with this model's tokenizer: {exc}") from None
        try:
            grammar = spec.to_llguidance()
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tok)
        except Exception as exc:  # noqa: BLE001 - whatever the input did to the compiler, it is the input's fault
            raise GrammarError(_first_line(str(exc))) from None
        if is_error or messages:
            # warnings name keywords the compiler would ignore: refuse instead of half-enforcing
            raise GrammarError(_first_line(messages[0]) if messages else "the grammar is invalid")
        template = llguidance.LLMatcher(tok, grammar, log_level=0)
        if template.is_error():
            raise GrammarError(_first_line(template.get_error()))
        with self._lock:
            self._templates[key] = template
            while len(self._templates) > _CACHE_SIZE:
                self._templates.popitem(last=False)
        return template.deep_copy()

    def validate(self, spec: GrammarSpec) -> None:
        self.compile(spec)

    # -- masks --------------------------------------------------------------
    def fill(self, matchers: Sequence[Any]) -> torch.Tensor:
        """Bitmask rows (int32, 32 tokens per word) for ``matchers``, in order."""
        from llguidance.torch import fill_next_token_bitmask_par

        self._tok()
        started = time.perf_counter()
        mask = torch.full((len(matchers), self.words), -1, dtype=torch.int32)
        fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], mask)
        self.mask_rows += len(matchers)
        self.mask_seconds += time.perf_counter() - started
        return mask

    def wait(self, future: "Future[Any]") -> Any:
        """The masks of ``fill_step_async``; the time spent waiting here
        is what they cost the step."""
        started = time.perf_counter()
        mask = future.result()
        self.mask_wait_seconds += time.perf_counter() - started
        return mask

    def fill_step(self, requests: Sequence[Any], drafts: Sequence[Sequence[int]] | None = None) -> StepMasks:
        """Mask rows for ``requests`` (engine Requests with a grammar): one row each, or,
        for a request with a non-empty entry in ``drafts`` (its proposals, each already
        accepted by its grammar), one row per verify position."""
        if drafts is None or not any(drafts):
            mask = self.fill([r.grammar for r in requests])
            return StepMasks(mask, {id(r): i for i, r in enumerate(requests)})
        from llguidance.torch import fill_next_token_bitmask_par, fill_next_token_bitmask_par_with_draft_tokens

        self._tok()
        started = time.perf_counter()
        plain: list[tuple[Any, int]] = []
        drafted: list[tuple[Any, int, list[int]]] = []  # llguidance refuses an empty draft here
        first: dict[int, int] = {}
        total = 0
        for request, draft in zip(requests, drafts):
            if draft:
                drafted.append((request.grammar, total, list(draft)))
            else:
                plain.append((request.grammar, total))
            first[id(request)] = total
            total += 1 + len(draft)
        mask = torch.full((total, self.words), -1, dtype=torch.int32)
        if plain:
            fill_next_token_bitmask_par(self._executor, plain, mask)
        fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, mask)
        self.mask_rows += total
        self.mask_seconds += time.perf_counter() - started
        return StepMasks(mask, first)

    def fill_step_async(self, requests: Sequence[Any]) -> "Future[StepMasks]":
        """``fill_step`` on a worker thread for ``requests`` and their proposals as they
        are now (copied here: the step may change them while the worker runs)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-grammar")
        drafts = [list(r.spec_token_ids) for r in requests]
        return self._pool.submit(self.fill_step, list(requests), drafts)


def _first_line(message: str) -> str:
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    text = " ".join(lines[:4]) if lines else "the grammar is invalid"
    return text if len(text) <= 400 else text[:400] + "..."

"""Request fields that ask for structured output -> one ``GrammarSpec``.

OpenAI's ``response_format`` (``json_object``, ``json_schema``) and vLLM's
extra fields (``guided_json``/``guided_regex``/``guided_choice``/
``guided_grammar`` and the newer ``structured_outputs`` object) all land
here; at most one may be given. ``check_grammar`` compiles the grammar
before the request reaches the engine, so a schema the engine cannot
enforce is a 400 naming the unsupported part, not free text later. It runs
after the tenant checks (``Admission.check``, entrypoints/server/admission.py), never before.
"""
from __future__ import annotations

import asyncio
from typing import Any

from ...engine.grammar.grammar_worker import GrammarBusy
from ...engine.grammar.structured import GrammarError, GrammarSpec
from ..server.errors import APIError


_FORMAT_KEYS = {"type", "json_schema", "name", "schema", "strict", "description"}  # the last four: Responses' flat form
_SCHEMA_BLOCK_KEYS = {"name", "schema", "schema_", "strict", "description"}


def _response_format(fmt: dict[str, Any]) -> GrammarSpec | None:
    kind = fmt.get("type")
    unknown = sorted(set(fmt) - _FORMAT_KEYS)
    if not unknown and isinstance(fmt.get("json_schema"), dict):
        unknown = [f"json_schema.{k}" for k in sorted(set(fmt["json_schema"]) - _SCHEMA_BLOCK_KEYS)]
    if unknown:
        raise APIError(400, f"response_format: unknown key {unknown[0]!r} (a constraint this server would not "
                       "enforce)", param="response_format", code="unknown_parameter")
    if kind != "json_schema" and ("schema" in fmt or "json_schema" in fmt):
        raise APIError(400, f"response_format: a schema is only read with type 'json_schema' (got type {kind!r})",
                       param="response_format")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        block = fmt.get("json_schema")
        if block is None and "schema" in fmt:  # the Responses API's flat text.format
            block = fmt
        if not isinstance(block, dict):
            raise APIError(400, "response_format: json_schema must be an object with a 'schema'",
                           param="response_format")
        schema = block.get("schema", block.get("schema_"))
        if schema is None:
            return GrammarSpec("json_object")
        if not isinstance(schema, (dict, bool)):
            raise APIError(400, "response_format: json_schema.schema must be a JSON object",
                           param="response_format")
        return GrammarSpec("json", schema)
    raise APIError(400, f"response_format: unsupported type {kind!r} (supported: text, json_object, json_schema)",
                   param="response_format")


# vLLM's StructuredOutputsParams keys: the constraints, and options this server
# honours as they are (its JSON never has free whitespace, its schemas are closed,
# it has no fallback backend) or refuses when set.
_CONSTRAINT_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_HONOURED_OPTIONS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties")
_REFUSED_OPTIONS = {"whitespace_pattern": "JSON output uses a fixed whitespace layout",
                    "structural_tag": "structural tags are not implemented; use tools or a grammar",
                    "backend": "structured outputs run on llguidance"}


def _structured_outputs(block: dict[str, Any]) -> GrammarSpec | None:
    for key, value in block.items():
        if key in _CONSTRAINT_KEYS or key in _HONOURED_OPTIONS or value is None:
            continue
        if key in _REFUSED_OPTIONS:
            if key == "backend" and value in ("auto", "guidance", "llguidance"):
                continue
            raise APIError(400, f"structured_outputs.{key}: not supported: {_REFUSED_OPTIONS[key]}",
                           param="structured_outputs")
        raise APIError(400, f"structured_outputs: unknown key {key!r} (known: {', '.join(_CONSTRAINT_KEYS)})",
                       param="structured_outputs", code="unknown_parameter")
    given = [k for k in ("json", "regex", "choice", "grammar") if block.get(k) is not None]
    if block.get("json_object"):
        given.append("json_object")
    if len(given) > 1:
        raise APIError(400, f"structured_outputs: give only one of {', '.join(given)}", param="structured_outputs")
    if not given:
        return None
    key = given[0]
    if key == "json_object":
        return GrammarSpec("json_object")
    value = block[key]
    if key == "choice":
        if not isinstance(value, list):
            raise APIError(400, "structured_outputs: choice must be a list of strings", param="structured_outputs")
        value = tuple(value)
    return GrammarSpec(key, value)  # type: ignore[arg-type]


def grammar_spec(body: Any) -> tuple[GrammarSpec | None, str | None]:
    """The request's grammar (or None) and the parameter it came from."""
    found: list[tuple[GrammarSpec, str]] = []
    if body.response_format is not None:
        spec = _response_format(body.response_format)
        if spec is not None:
            found.append((spec, "response_format"))
    if body.guided_json is not None:
        found.append((GrammarSpec("json", body.guided_json), "guided_json"))
    if body.guided_regex is not None:
        found.append((GrammarSpec("regex", body.guided_regex), "guided_regex"))
    if body.guided_choice is not None:
        found.append((GrammarSpec("choice", tuple(body.guided_choice)), "guided_choice"))
    if body.guided_grammar is not None:
        found.append((GrammarSpec("grammar", body.guided_grammar), "guided_grammar"))
    if body.structured_outputs is not None:
        spec = _structured_outputs(body.structured_outputs)
        if spec is not None:
            found.append((spec, "structured_outputs"))
    if len(found) > 1:
        names = ", ".join(param for _, param in found)
        raise APIError(400, f"{found[1][1]}: only one structured output constraint per request (got {names})",
                       param=found[1][1])
    return found[0] if found else (None, None)


_WHAT = {"json": "the JSON schema", "json_object": "JSON output", "regex": "the regex", "choice": "the choice list",
         "grammar": "the grammar"}


async def check_grammar(state: Any, spec: GrammarSpec, param: str, tenant: Any = None) -> None:
    """Compile ``spec`` off the event loop (a worker process first, engine/grammar/grammar_worker.py):
    a 400 naming what cannot be enforced or which limit it is over, a 429 when too many
    grammars already wait to be compiled, or ``tenant`` already has its part of that queue
    (``Admission.hold_compile``; it holds its place until the compilation ends, even
    when the client leaves first). Handlers ask ``Admission.check`` before this, so a
    request its tenant could not send never enters the queue."""
    release = state.admission.hold_compile(tenant)
    try:
        try:
            # the size checks and the cache key read the whole schema: off the event loop too
            pending = await asyncio.to_thread(state.engine.structured.prepare, spec)
        except BaseException:
            release()
            raise
        pending.add_done_callback(lambda _: release())
        # a client that leaves does not cancel the compilation under way (it still takes a
        # worker): shielded, the place is given back when the compilation ends
        await asyncio.shield(asyncio.wrap_future(pending))
    except GrammarBusy as exc:
        raise APIError(429, f"{param}: {exc}", param=param, code="grammar_queue_full",
                       headers={"Retry-After": "1"}) from None
    except GrammarError as exc:
        raise APIError(400, f"{param}: {_WHAT.get(spec.kind, 'the constraint')} cannot be enforced: {exc}",
                       param=param, code="invalid_structured_output") from None

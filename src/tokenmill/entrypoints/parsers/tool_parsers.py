"""Model output -> tool calls, for the formats of the model families we load.

Chosen with ``--tool-call-parser NAME`` (the names vLLM users know):

- ``hermes`` (also ``qwen``): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call, text before the first block (less trailing blank space) is content;
- ``llama3_json``: the output is ``{"name": ..., "parameters": {...}}`` (optionally after
  ``<|python_tag|>``), several separated by ``;``;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` (or the newer
  ``[TOOL_CALLS]name[ARGS]{...}`` form).

A parser that finds no well-formed call returns the whole text as content:
free text must never be lost because it looked a little like a call.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text


def _arguments(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value if value is not None else {}, ensure_ascii=False)


def _call(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    return ParsedCall(obj["name"], _arguments(args))


def _json_values(text: str, separators: str = " \n\r\t;,") -> list[Any] | None:
    """Every JSON value in ``text`` one after another (separated by ``separators``), or None."""
    decoder = json.JSONDecoder()
    values, i = [], 0
    while True:
        while i < len(text) and text[i] in separators:
            i += 1
        if i >= len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        values.append(value)


class ToolParser:
    """``extract(text)`` -> (content or None, calls). ``markers``: strings whose appearance
    means a call has started (streaming holds text back from there)."""

    name = ""
    markers: tuple[str, ...] = ()
    at_start_only = False  # a marker only counts at the start of the output

    def __init__(self) -> None:
        self.longest = max(map(len, self.markers))  # the longest marker (streams look back this far)

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        raise NotImplementedError

    def call_start(self, text: str, since: int = 0) -> int | None:
        """Index where a call begins in ``text``, if one has; ``since``: no call begins before
        it (a stream looks only at what its new text could have completed)."""
        if self.at_start_only:
            stripped = text.lstrip()
            offset = len(text) - len(stripped)
            return offset if any(stripped.startswith(m) for m in self.markers) else None
        hits = [at for at in (text.find(m, since) for m in self.markers) if at >= 0]
        return min(hits) if hits else None

    def possible_start(self, text: str) -> int | None:
        """Index from which ``text`` could still become a marker (hold it back while streaming)."""
        if self.at_start_only:
            stripped = text.lstrip()
            if not stripped or any(m.startswith(stripped) or stripped.startswith(m) for m in self.markers):
                return len(text) - len(stripped)
            return None
        found: int | None = None
        for m in self.markers:  # only where the marker's first character is: a find, not a loop over the tail
            i = text.find(m[0], max(0, len(text) - len(m)))
            while i >= 0 and (found is None or i < found):
                if m.startswith(text[i:]):
                    found = i
                    break
                i = text.find(m[0], i + 1)
        return found


def _content(text: str) -> str | None:
    return text if text.strip() else None


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        start = text.find("<tool_call>")
        if start < 0:
            return _content(text), []
        calls = []
        blocks = list(self._block.finditer(text[start:]))
        for k, block in enumerate(blocks):
            values = _json_values(block.group(1))
            if not values or len(values) != 1 or (call := _call(values[0])) is None:
                if k and k == len(blocks) - 1 and not block.group(0).rstrip().endswith("</tool_call>"):
                    break  # a last call cut off (max_tokens): the complete ones before it stand
                return _content(text), []
            calls.append(call)
        return _content(text[:start].rstrip()), calls


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = ("<|python_tag|>", "{")
    at_start_only = True

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):]
        if not body.startswith("{"):
            return _content(text), []
        values = _json_values(body)
        calls = [_call(v) for v in values or []]
        if not values or any(c is None for c in calls):
            return _content(text), []
        return None, [c for c in calls if c is not None]


class MistralParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    _args_form = re.compile(r"\s*([a-zA-Z0-9_.-]+)\s*\[ARGS\]")

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        start = text.find("[TOOL_CALLS]")
        if start < 0:
            return _content(text), []
        calls: list[ParsedCall] = []
        for part in text[start:].split("[TOOL_CALLS]")[1:]:
            m = self._args_form.match(part)
            if m:
                values = _json_values(part[m.end():])
                if not values or len(values) != 1:
                    return _content(text), []
                calls.append(ParsedCall(m.group(1), _arguments(values[0])))
                continue
            values = _json_values(part)
            if not values:
                return _content(text), []
            items = values[0] if len(values) == 1 and isinstance(values[0], list) else values
            parsed = [_call(v) for v in items]
            if not parsed or any(c is None for c in parsed):
                return _content(text), []
            calls.extend(c for c in parsed if c is not None)
        return _content(text[:start].rstrip()), calls


PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesParser,
    "qwen": HermesParser,
    "qwen2_5": HermesParser,
    "llama3_json": Llama3JsonParser,
    "llama4_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def get_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r} (known: {', '.join(sorted(PARSERS))})") from None

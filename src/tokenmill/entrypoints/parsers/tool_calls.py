"""Tool calling: what a request's ``tools``/``tool_choice`` mean for generation and output.

- ``none``: tools still reach the chat template, output is plain text;
- ``auto``: free generation, then the server's ``--tool-call-parser`` finds calls
  (refused unless the server runs with ``--enable-auto-tool-choice``, as vLLM does);
- ``required``: output constrained to a JSON list of ``{"name", "arguments"}``
  objects, one per allowed tool schema, so it always parses; the list holds at
  most ``MAX_PARALLEL_CALLS`` calls (a small model otherwise repeats its call
  until ``max_tokens``), and a list cut short by ``max_tokens`` still yields
  every call completed before the cut;
- a named function: output constrained to that function's ``parameters`` schema.

Messages go to the chat template the way Hugging Face passes them:
``tools=[{"type": "function", "function": {...}}]``, assistant ``tool_calls``
with ``arguments`` decoded to a mapping (templates write ``arguments | tojson``)
and ``role: "tool"`` messages with their ``tool_call_id``.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from ...engine.grammar.structured import GrammarSpec
from ..server.errors import APIError
from .output_events import Event, TextDelta, ToolArgsDelta, ToolCallEnd, ToolCallStart
from .tool_parsers import ParsedCall, ToolParser, get_parser

ToolMode = Literal["none", "auto", "required", "named"]
_EMPTY_PARAMS: dict[str, Any] = {"type": "object", "properties": {}}
MAX_PARALLEL_CALLS = 8  # calls in one ``required`` answer: the grammar closes the list after this many


@dataclass
class ToolPlan:
    tools: list[dict[str, Any]]  # chat-format tool dicts, as the template gets them
    mode: ToolMode
    named: str | None = None
    parallel: bool = True
    parser: ToolParser | None = None

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def params_of(self, name: str) -> dict[str, Any]:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"].get("parameters") or _EMPTY_PARAMS
        return _EMPTY_PARAMS

    def grammar(self) -> GrammarSpec | None:
        """The constraint that makes ``required``/named output parse."""
        if self.mode == "named":
            assert self.named is not None
            return GrammarSpec("json", self.params_of(self.named))
        if self.mode == "required":
            one_of = [{"type": "object", "properties": {"name": {"const": name},
                                                        "arguments": self.params_of(name)},
                       "required": ["name", "arguments"], "additionalProperties": False}
                      for name in self.names]
            schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                      "maxItems": MAX_PARALLEL_CALLS if self.parallel else 1,
                                      "items": one_of[0] if len(one_of) == 1 else {"anyOf": one_of}}
            return GrammarSpec("json", schema)
        return None

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool,
               settings: Any, parser_hint: str = "hermes") -> ToolPlan | None:
    """Check ``tools``/``tool_choice`` against each other and the server's flags."""
    tools = tools or []
    if not tools:
        if tool_choice in (None, "none"):
            return None
        raise APIError(400, "tool_choice: set without any tools", param="tool_choice")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: function names must be unique", param="tools")
    named: str | None = None
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function") if isinstance(tool_choice.get("function"), dict) else tool_choice
        named = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(named, str):
            raise APIError(400, "tool_choice: expected {\"type\": \"function\", \"function\": {\"name\": ...}}",
                           param="tool_choice")
        if named not in names:
            raise APIError(400, f"tool_choice: function {named!r} is not among the given tools "
                           f"({', '.join(names)})", param="tool_choice")
        mode: ToolMode = "named"
    else:
        mode = tool_choice or "auto"
        if mode not in ("none", "auto", "required"):
            raise APIError(400, f"tool_choice: unknown value {tool_choice!r}", param="tool_choice")
    parser = None
    if mode == "auto":
        if not (getattr(settings, "enable_auto_tool_choice", False) and getattr(settings, "tool_call_parser", None)):
            flags = ("--enable-auto-tool-choice" if not getattr(settings, "enable_auto_tool_choice", False)
                     else "") + f" --tool-call-parser {getattr(settings, 'tool_call_parser', None) or parser_hint}"
            raise APIError(400, f'tool_choice: "auto" (the default when tools are given) needs a tool-call '
                           f'parser: start the server with {flags.strip()}; or send tool_choice "required", '
                           f'a named function or "none"', param="tool_choice")
        parser = get_parser(settings.tool_call_parser)
    return ToolPlan(tools=tools, mode=mode, named=named, parallel=parallel, parser=parser)


def tool_schemas(plan: ToolPlan) -> list[tuple[GrammarSpec, str]]:
    """Every tool's parameter schema, to compile (and refuse if malformed) up front."""
    return [(GrammarSpec("json", plan.params_of(name)), "tools") for name in plan.names]


# ---- messages for the template ---------------------------------------------------

def template_message(m: Any) -> dict[str, Any]:
    """One pydantic ChatMessage -> the dict a Hugging Face chat template expects."""
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.tool_calls:
        calls = []
        for call in m.tool_calls:
            args: Any = call.function.arguments
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    pass  # leave the text as given
            calls.append({"id": call.id, "type": call.type,
                          "function": {"name": call.function.name, "arguments": args}})
        out["tool_calls"] = calls
        if m.content is None:
            out["content"] = None
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


# ---- output --------------------------------------------------------------------

def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def openai_call(call: ParsedCall, call_id: str | None = None) -> dict[str, Any]:
    return {"id": call_id or new_call_id(), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def extract(plan: ToolPlan, text: str) -> tuple[str | None, list[ParsedCall]]:
    """The generated text as (content, calls) under ``plan``."""
    if plan.mode == "named":
        assert plan.named is not None
        try:
            json.loads(text)
        except json.JSONDecodeError:
            return text, []  # cut short (max_tokens): not a call
        return None, [ParsedCall(plan.named, text)]
    if plan.mode == "required":
        calls = [ParsedCall(i["name"], json.dumps(i.get("arguments", {}), ensure_ascii=False))
                 for i in complete_items(text) if isinstance(i, dict) and isinstance(i.get("name"), str)]
        return (None, calls) if calls else (text, [])
    if plan.mode == "auto" and plan.parser is not None:
        content, calls = plan.parser.extract(text)
        return content, calls if plan.parallel else calls[:1]
    return text, []


def complete_items(text: str) -> list[Any]:
    """The items of a JSON array that are complete, even when the array itself was cut off."""
    decoder = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        return []
    items: list[Any] = []
    i += 1
    while True:
        while i < len(text) and text[i] in " \n\r\t,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return items
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return items
        items.append(item)


@dataclass
class ToolStream:
    """One choice's answer as tool-call events while it arrives: text before a call goes
    out as content; from where a call may start, text is held back, and the calls go out
    whole at the end (for a named function the arguments stream as they are generated).

    Why content holds back trailing whitespace under a parser: the content of an answer
    with calls ends where the first call begins, less the blank space before it; text
    already sent cannot be taken back, so blank space goes out only once text follows it.
    Then the streamed content is exactly the whole answer's, and ``finish`` sends only
    what the held-back part turned out to be."""

    plan: ToolPlan
    index: int = 0  # the choice the events are of
    text: str = ""
    sent: int = 0  # characters of ``text`` already sent as content
    held: bool = False  # a call has started
    named_id: str | None = None
    plain: bool = False  # the answer can no longer start a call (at_start_only parsers): all content
    scanned: int = 0  # no call begins before this (the text had no marker up to here)

    def feed(self, delta: str) -> list[Event]:
        """Events for a new piece of the answer."""
        self.text += delta
        mode = self.plan.mode
        if mode == "named":
            if not delta:
                return []
            out: list[Event] = []
            if self.named_id is None:
                assert self.plan.named is not None
                self.named_id = new_call_id()
                out.append(ToolCallStart(self.index, 0, self.named_id, self.plan.named))
            out.append(ToolArgsDelta(self.index, 0, delta))
            return out
        if mode == "required":
            return []
        parser = self.plan.parser
        if mode != "auto" or parser is None:
            return self._content_upto(len(self.text), hold_blank=False)
        if self.held:
            return []
        if self.plain:
            return self._content_upto(len(self.text))
        start = parser.call_start(self.text, self.scanned)
        if start is not None:
            self.held = True
            return self._content_upto(start)
        maybe = parser.possible_start(self.text)
        if maybe is None and parser.at_start_only:
            self.plain = True  # past the start with no marker: none can come
        self.scanned = max(0, len(self.text) - parser.longest + 1)
        return self._content_upto(len(self.text) if maybe is None else maybe)

    def _content_upto(self, end: int, hold_blank: bool = True) -> list[Event]:
        piece = self.text[self.sent:end]
        if hold_blank:
            piece = piece.rstrip()
        if not piece:
            return []
        self.sent += len(piece)
        return [TextDelta(self.index, piece)]

    def finish(self) -> tuple[list[Event], bool]:
        """Events still owed at the end, and whether the answer parsed as tool calls."""
        content, calls = extract(self.plan, self.text)
        if self.plan.mode == "named":
            return ([ToolCallEnd(self.index, 0)] if self.named_id is not None else []), bool(calls)
        if not calls:
            rest = self.text[self.sent:]
            return ([TextDelta(self.index, rest)] if rest else []), False
        out: list[Event] = []
        if content and len(content) > self.sent:  # the parsers' content is the text before the calls, rstripped
            out.append(TextDelta(self.index, content[self.sent:]))
        for i, call in enumerate(calls):
            out += [ToolCallStart(self.index, i, new_call_id(), call.name), ToolArgsDelta(self.index, i, call.arguments),
                    ToolCallEnd(self.index, i)]
        return out, True

"""Output events (parsers/output_events.py) -> Anthropic's Messages: its event sequence or one message.

One builder makes both. Streamed: ``message_start`` once the first engine delta says
how much of the prompt the cache held, then per content block (``thinking``,
``text``, ``tool_use``) ``content_block_start``, its deltas (``thinking_delta``,
``text_delta``, ``input_json_delta``) and ``content_block_stop`` (a ``ping`` after
the first start), then ``message_delta`` with the stop reason and usage, and
``message_stop``. Whole, it writes none of them and the message holds the blocks
the events built. An answer of nothing is one empty text block.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..parsers.output_events import Event, Finish, TextDelta, ThinkingDelta, ToolArgsDelta, ToolCallStart, Usage
from ..server.errors import APIError

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                529: "overloaded_error"}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


@dataclass
class MessageSpec:
    message_id: str
    model: str
    stop_sequences: list[str] | None
    created: float = field(default_factory=time.time)


def message_usage(usage: Usage) -> dict[str, Any]:
    """Anthropic's split: ``input_tokens`` are the prompt tokens the prefix cache did not hold."""
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": usage.cached_tokens}


def _stop(spec: MessageSpec, finish: Finish | None) -> tuple[str, str | None]:
    reason = finish.reason if finish else None
    if finish is not None and finish.tool_calls and reason != "length":
        return "tool_use", None
    if reason == "length":
        return "max_tokens", None
    stop_reason = finish.stop_reason if finish else None
    if isinstance(stop_reason, str) and stop_reason in (spec.stop_sequences or []):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        value = {}
    return value if isinstance(value, dict) else {}


def _new_tool_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _message(spec: MessageSpec, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
             usage: dict[str, Any]) -> dict[str, Any]:
    return {"id": spec.message_id, "type": "message", "role": "assistant", "model": spec.model,
            "content": content, "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}


def _event(kind: str, **payload: Any) -> bytes:
    data = json.dumps({"type": kind, **payload}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


class MessagesEncoder:
    """The Messages encoder: ``streamed`` writes the SSE events, else only the message is built."""

    def __init__(self, spec: MessageSpec, streamed: bool = True) -> None:
        self.spec = spec
        self.streamed = streamed
        self.blocks: list[dict[str, Any]] = []  # content blocks so far; the last may be open
        self.open = False
        self.pinged = False
        self.started = False
        self.finish: Finish | None = None
        self.message: dict[str, Any] | None = None
        self._out: list[bytes] = []

    def ev(self, kind: str, **payload: Any) -> None:
        if self.streamed:
            self._out.append(_event(kind, **payload))

    def opening(self, usage: Usage) -> list[bytes]:
        return []

    def encode(self, events: list[Event]) -> list[bytes]:
        for e in events:
            if isinstance(e, Usage):
                self._usage(e)
            elif isinstance(e, ThinkingDelta):
                if not (self.open and self.blocks[-1]["type"] == "thinking"):
                    self._start({"type": "thinking", "thinking": "", "signature": ""})
                self._delta("thinking", {"type": "thinking_delta", "thinking": e.text}, e.text)
            elif isinstance(e, TextDelta):
                if not (self.open and self.blocks[-1]["type"] == "text"):
                    self._start({"type": "text", "text": ""})
                self._delta("text", {"type": "text_delta", "text": e.text}, e.text)
            elif isinstance(e, ToolCallStart):
                self._start({"type": "tool_use", "id": _new_tool_id(), "name": e.name, "input": {}}, "")
            elif isinstance(e, ToolArgsDelta):
                self._delta("partial", {"type": "input_json_delta", "partial_json": e.arguments}, e.arguments)
            elif isinstance(e, Finish):
                self.finish = e
        out, self._out = self._out, []
        return out

    def _usage(self, usage: Usage) -> None:
        if not self.started:
            self.started = True
            self.ev("message_start", message=_message(self.spec, [], (None, None),
                                                      message_usage(usage) | {"output_tokens": 0}))
        if usage.final:
            if not self.blocks:
                self._start({"type": "text", "text": ""})
            self._stop_block()
            stop = _stop(self.spec, self.finish)
            self.message = _message(self.spec, [self._final(b) for b in self.blocks], stop, message_usage(usage))
            self.ev("message_delta", delta={"stop_reason": stop[0], "stop_sequence": stop[1]},
                    usage=message_usage(usage))
            self.ev("message_stop")

    def _start(self, block: dict[str, Any], partial: str | None = None) -> None:
        self._stop_block()
        self.ev("content_block_start", index=len(self.blocks), content_block=block)
        self.blocks.append(dict(block) if partial is None else dict(block, partial=partial))
        self.open = True
        if not self.pinged:
            self.pinged = True
            self.ev("ping")

    def _delta(self, key: str, delta: dict[str, Any], text: str) -> None:
        if text:
            self.blocks[-1][key] += text
            self.ev("content_block_delta", index=len(self.blocks) - 1, delta=delta)

    def _stop_block(self) -> None:
        if self.open:
            self.open = False
            self.ev("content_block_stop", index=len(self.blocks) - 1)

    @staticmethod
    def _final(block: dict[str, Any]) -> dict[str, Any]:
        if block["type"] != "tool_use":
            return block
        partial = block.pop("partial")
        return dict(block, input=_tool_input(partial))

    def error(self, exc: BaseException) -> bytes:
        status, message = (exc.status, exc.message) if isinstance(exc, APIError) else (500, f"internal error: {exc}")
        return _event("error", error=anthropic_error(status, message)["error"])

    def done(self) -> list[bytes]:
        return []

    # the whole message: the same events, folded
    def add(self, events: list[Event]) -> None:
        self.encode(events)

    def body(self) -> dict[str, Any]:
        assert self.message is not None
        return self.message

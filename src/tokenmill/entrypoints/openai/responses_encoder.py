"""Output events (parsers/output_events.py) -> the Responses API: typed SSE events or one response.

One builder makes both: while streaming it writes each event the SDKs accumulate
(``response.created`` ... ``response.output_text.delta`` ... ``response.completed``);
whole, it writes none and the response is what ``response.completed`` would carry.
Items come in output order: a ``reasoning`` item (with ``--reasoning-parser``), a
``message`` (when there is text, or nothing else), then ``function_call`` items; an
item is done when the next one starts or the output ends.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..parsers.output_events import (Event, Finish, TextDelta, ThinkingDelta, ToolArgsDelta, ToolCallStart,
                                     Usage)
from .response_store import ResponseStore, StoredResponse
from .streaming import error_event

log = logging.getLogger("tokenmill.server")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponseSpec:
    response_id: str
    model: str
    body: Any  # the ResponsesRequest
    created: int = field(default_factory=lambda: int(time.time()))
    store: ResponseStore | None = None  # where the finished response goes (None: not stored)
    owner: str | None = None  # whose it is (tenants.owner_of): only they and the operator reach it
    conversation: list[dict[str, Any]] = field(default_factory=list)  # the messages this response answers
    count_tokens: Any = None  # text -> token count (reasoning_tokens)

    def keep(self, response: dict[str, Any]) -> None:
        """Store the finished response with its conversation (this answer appended)."""
        if self.store is None:
            return
        answer: dict[str, Any] = {"role": "assistant", "content": None}
        calls = []
        for item in response["output"]:
            if item["type"] == "message":
                answer["content"] = "".join(part["text"] for part in item["content"])
            elif item["type"] == "function_call":
                calls.append({"id": item["call_id"], "type": "function",
                              "function": {"name": item["name"], "arguments": item["arguments"]}})
        if calls:
            answer["tool_calls"] = calls
        elif answer["content"] is None:
            answer["content"] = ""
        stored = StoredResponse(response, self.conversation + [answer], self.owner)
        if not self.store.put(self.response_id, stored) and self.store.capacity:
            log.warning("response %s not stored: its conversation is larger than --responses-store-bytes (%d); "
                        "previous_response_id to it will get 404", self.response_id, self.store.max_bytes)


def response_usage(usage: Usage, reasoning_tokens: int = 0) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, usage.completion_tokens)}}


def response_body(spec: ResponseSpec, status: str, output: list[dict[str, Any]],
                  usage: dict[str, Any] | None) -> dict[str, Any]:
    body = spec.body
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": spec.response_id, "object": "response", "created_at": spec.created, "status": status,
        "error": None, "incomplete_details": incomplete, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "model": spec.model, "output": output,
        "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
        "reasoning": None, "store": spec.store is not None,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": body.text or {"format": {"type": "text"}},
        "tool_choice": body.tool_choice or ("auto" if body.tools else "none"), "tools": body.tools or [],
        "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled", "usage": usage,
        "user": body.user, "metadata": body.metadata or {},
    }


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _status(finish: str | None) -> str:
    """The response's, and a message item's: cut by max_output_tokens is incomplete."""
    return "incomplete" if finish == "length" else "completed"


def _event(kind: str, seq: int, **payload: Any) -> bytes:
    data = json.dumps({"type": kind, "sequence_number": seq, **payload}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


@dataclass
class _Open:
    """The item being written: its id, place in the output, text so far (and a call's id and name)."""

    id: str
    index: int
    text: str = ""
    call_id: str = ""
    name: str = ""


class ResponsesEncoder:
    """The Responses encoder: ``streamed`` writes the SSE events, else only the response is built."""

    def __init__(self, spec: ResponseSpec, streamed: bool = True) -> None:
        self.spec = spec
        self.streamed = streamed
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # finished items, in output order
        self.msg: _Open | None = None
        self.call: _Open | None = None
        self.thought: _Open | None = None
        self.thought_total: str | None = None
        self.finish: str | None = None
        self.response: dict[str, Any] | None = None  # the finished response
        self._out: list[bytes] = []

    def ev(self, kind: str, **payload: Any) -> None:
        if self.streamed:
            self._out.append(_event(kind, self.seq, **payload))
        self.seq += 1

    def opening(self, usage: Usage) -> list[bytes]:
        started = response_body(self.spec, "in_progress", [], None)
        self.ev("response.created", response=started)
        self.ev("response.in_progress", response=started)
        return self._take()

    def _take(self) -> list[bytes]:
        out, self._out = self._out, []
        return out

    def encode(self, events: list[Event]) -> list[bytes]:
        for e in events:  # an item closed by this delta's end is as incomplete as the response
            if isinstance(e, Finish):
                self.finish = e.reason
        for e in events:
            if isinstance(e, ThinkingDelta):
                self._thought_delta(e.text)
            elif isinstance(e, TextDelta):
                self._text_delta(e.text)
            elif isinstance(e, ToolCallStart):
                self._close_thought(), self._close_msg(), self._close_call()
                self._open_call(e)
            elif isinstance(e, ToolArgsDelta):
                self._args_delta(e.arguments)
            elif isinstance(e, Usage) and e.final:
                self._end(e)
        return self._take()

    def _close_msg(self) -> None:
        m, self.msg = self.msg, None
        if m is None:
            return
        part = {"type": "output_text", "text": m.text, "annotations": [], "logprobs": []}
        item = _message_item(m.id, m.text, _status(self.finish))
        self.output.append(item)
        self.ev("response.output_text.done", item_id=m.id, output_index=m.index, content_index=0, text=m.text,
                logprobs=[])
        self.ev("response.content_part.done", item_id=m.id, output_index=m.index, content_index=0, part=part)
        self.ev("response.output_item.done", output_index=m.index, item=item)

    def _thought_delta(self, text: str) -> None:
        if self.thought is None:
            self.thought = _Open(new_id("rs"), len(self.output))
            item = _reasoning_item(self.thought.id, "", "in_progress") | {"content": []}
            self.ev("response.output_item.added", output_index=self.thought.index, item=item)
        if text:
            self.thought.text += text
            self.ev("response.reasoning_text.delta", item_id=self.thought.id, output_index=self.thought.index,
                    content_index=0, delta=text)
        self.thought_total = self.thought.text

    def _close_thought(self) -> None:
        t, self.thought = self.thought, None
        if t is None:
            return
        item = _reasoning_item(t.id, t.text)
        self.output.append(item)
        self.ev("response.reasoning_text.done", item_id=t.id, output_index=t.index, content_index=0, text=t.text)
        self.ev("response.output_item.done", output_index=t.index, item=item)

    def _close_call(self) -> None:
        c, self.call = self.call, None
        if c is None:
            return
        item = _call_item(c.id, c.call_id, c.name, c.text)
        self.output.append(item)
        self.ev("response.function_call_arguments.done", item_id=c.id, output_index=c.index, name=c.name,
                arguments=c.text)
        self.ev("response.output_item.done", output_index=c.index, item=item)

    def _text_delta(self, text: str) -> None:
        self._close_thought(), self._close_call()
        if self.msg is None:
            m = self.msg = _Open(new_id("msg"), len(self.output))
            self.ev("response.output_item.added", output_index=m.index,
                    item=_message_item(m.id, "", "in_progress") | {"content": []})
            self.ev("response.content_part.added", item_id=m.id, output_index=m.index, content_index=0,
                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        if text:
            self.msg.text += text
            self.ev("response.output_text.delta", item_id=self.msg.id, output_index=self.msg.index,
                    content_index=0, delta=text, logprobs=[])

    def _open_call(self, e: ToolCallStart) -> None:
        c = self.call = _Open(new_id("fc"), len(self.output), call_id=e.id, name=e.name)
        self.ev("response.output_item.added", output_index=c.index,
                item=_call_item(c.id, c.call_id, c.name, "", "in_progress"))

    def _args_delta(self, delta: str) -> None:
        if delta and self.call is not None:
            self.call.text += delta
            self.ev("response.function_call_arguments.delta", item_id=self.call.id, output_index=self.call.index,
                    delta=delta)

    def _end(self, usage: Usage) -> None:
        if self.msg is None and self.call is None and all(item["type"] == "reasoning" for item in self.output):
            self._text_delta("")  # an answer of nothing is an empty message
        self._close_thought(), self._close_msg(), self._close_call()
        count = self.spec.count_tokens
        thought = count(self.thought_total) if self.thought_total and count else 0
        status = _status(self.finish)
        self.response = response_body(self.spec, status, self.output, response_usage(usage, thought))
        self.spec.keep(self.response)
        self.ev("response.completed" if status == "completed" else "response.incomplete", response=self.response)

    def error(self, exc: BaseException) -> bytes:
        return error_event(exc)

    def done(self) -> list[bytes]:
        return []

    # the whole response: the same events, folded
    def add(self, events: list[Event]) -> None:
        self.encode(events)

    def body(self) -> dict[str, Any]:
        assert self.response is not None
        return self.response

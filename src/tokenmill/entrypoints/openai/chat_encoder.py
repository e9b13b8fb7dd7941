"""Output events (parsers/output_events.py) -> ``/v1/chat/completions``: chunks or one body.

Streaming rules (what SDKs rely on): a role-only delta first for each choice;
reasoning (``reasoning_content``), content and tool-call deltas follow as they are
known; a delta's logprobs ride on the first chunk it makes (an empty content chunk
when it makes none); each choice ends with a chunk carrying ``finish_reason``;
``stream_options.include_usage`` adds a last chunk with empty ``choices`` and the
usage; then ``data: [DONE]``. A request that used the legacy ``functions`` field
gets its first call as ``function_call``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ...model.sampler import Logprob
from ..parsers.output_events import (Event, Finish, Logprobs, TextDelta, ThinkingDelta, ToolArgsDelta,
                                     ToolCallStart, Usage)
from ..parsers.reasoning import ReasoningParser
from ..parsers.tool_calls import ToolPlan
from .prompt_logprobs import vllm_prompt_logprobs
from .streaming import DONE, error_event, sse


@dataclass
class ChatSpec:
    request_id: str
    model: str
    n: int
    logprobs: bool
    top_logprobs: int
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_logprobs: int | None = None  # vLLM's field: alternatives per prompt token
    tools: ToolPlan | None = None
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage so far in every chunk
    legacy_functions: bool = False  # the request used functions/function_call: answer with function_call
    reasoning: ReasoningParser | None = None  # --reasoning-parser: thinking goes to reasoning_content


def top_sorted(lp: Logprob) -> list[tuple[int, float]]:
    return sorted(lp.top.items(), key=lambda kv: -kv[1])


def chat_logprobs(state: Any, lps: list[Logprob], k: int) -> list[dict[str, Any]]:
    out = []
    for lp in lps:
        text = state.token_text(lp.token_id)
        top = [{"token": state.token_text(t), "logprob": v, "bytes": list(state.token_text(t).encode())}
               for t, v in top_sorted(lp)[:k]]
        out.append({"token": text, "logprob": lp.logprob, "bytes": list(text.encode()), "top_logprobs": top})
    return out


def _tool_finish(reason: str | None, called: bool, legacy: bool = False) -> str | None:
    return ("function_call" if legacy else "tool_calls") if called and reason == "stop" else reason


def _call_delta(e: Event, legacy: bool) -> dict[str, Any] | None:
    """A tool-call event as a chat delta (legacy: the ``function_call`` shape, first call only)."""
    if isinstance(e, ToolCallStart):
        fn = {"name": e.name, "arguments": ""}
        call: dict[str, Any] = {"index": e.call, "id": e.id, "type": "function", "function": fn}
    elif isinstance(e, ToolArgsDelta):
        fn = {"arguments": e.arguments}
        call = {"index": e.call, "function": fn}
    else:
        return None
    if not legacy:
        return {"tool_calls": [call]}
    return {"function_call": fn} if e.call == 0 else None


class ChatStream:
    """The chat encoder, streamed. ``state``: token texts for logprobs (``ServerState.token_text``)."""

    def __init__(self, spec: ChatSpec, state: Any = None) -> None:
        self.spec = spec
        self.state = state
        self.base: dict[str, Any] = {"id": spec.request_id, "object": "chat.completion.chunk",
                                     "created": spec.created, "model": spec.model}
        if spec.include_usage:
            self.base["usage"] = None
        self.usage: Usage | None = None

    def _chunk(self, index: int, delta: dict[str, Any], logprobs: Any = None, finish: Finish | None = None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
        reason = None if finish is None else _tool_finish(finish.reason, finish.tool_calls,
                                                          self.spec.legacy_functions)
        if finish is not None and reason is not None:
            choice["finish_reason"] = reason
            choice["stop_reason"] = finish.stop_reason
        if self.spec.continuous_usage and self.usage is not None:
            return sse({**self.base, "choices": [choice], "usage": self.usage.openai()})
        return sse({**self.base, "choices": [choice]})

    def opening(self, usage: Usage) -> list[bytes]:
        self.usage = usage
        return [self._chunk(i, {"role": "assistant", "content": ""}) for i in range(self.spec.n)]

    def encode(self, events: list[Event]) -> list[bytes]:
        out: list[bytes] = []
        pending: list[tuple[int, dict[str, Any]]] = []  # this delta's chunks until its logprobs are known
        for e in events:  # answer text first: most deltas are one piece of it
            if type(e) is TextDelta:
                pending.append((e.index, {"content": e.text}))
            elif isinstance(e, Usage):
                self.usage = e
                if e.final and self.spec.include_usage:
                    out.append(sse({**self.base, "choices": [], "usage": e.openai()}))
            elif isinstance(e, ThinkingDelta):
                if e.text:
                    pending.append((e.index, {"reasoning_content": e.text}))
            elif isinstance(e, Logprobs):
                lp = {"content": chat_logprobs(self.state, e.logprobs, self.spec.top_logprobs)} \
                    if self.spec.logprobs and e.logprobs else None
                if lp and not pending:
                    out.append(self._chunk(e.index, {"content": ""}, lp))
                out += [self._chunk(i, d, lp if k == 0 else None) for k, (i, d) in enumerate(pending)]
                pending = []
            elif isinstance(e, Finish):
                out += [self._chunk(i, d) for i, d in pending]
                pending = []
                out.append(self._chunk(e.index, {}, None, e))
            else:
                delta = _call_delta(e, self.spec.legacy_functions)
                if delta is not None:
                    pending.append((e.index, delta))
        if pending:
            out += [self._chunk(i, d) for i, d in pending]
        return out

    def error(self, exc: BaseException) -> bytes:
        return error_event(exc)

    def done(self) -> list[bytes]:
        return [DONE]


@dataclass
class _ChoiceFold:
    reasoning: str | None = None
    content: list[str] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)  # {"id", "name", "arguments"}
    logprobs: list[Logprob] = field(default_factory=list)
    finish: Finish | None = None


class ChatFold:
    """The chat encoder, whole: the body the streamed chunks add up to."""

    def __init__(self, spec: ChatSpec, state: Any = None) -> None:
        self.spec = spec
        self.state = state
        self.choices = [_ChoiceFold() for _ in range(spec.n)]
        self.prompt_logprobs: list[Logprob | None] | None = None
        self.usage: Usage | None = None

    def add(self, events: list[Event]) -> None:
        for e in events:
            if type(e) is TextDelta:
                self.choices[e.index].content.append(e.text)
                continue
            if isinstance(e, Usage):
                self.usage = e
                continue
            c = self.choices[e.index]
            if isinstance(e, ThinkingDelta):
                c.reasoning = (c.reasoning or "") + e.text
            elif isinstance(e, ToolCallStart):
                c.calls.append({"id": e.id, "name": e.name, "arguments": ""})
            elif isinstance(e, ToolArgsDelta):
                c.calls[e.call]["arguments"] += e.arguments
            elif isinstance(e, Logprobs):
                c.logprobs.extend(e.logprobs)
                if e.prompt_logprobs is not None and self.prompt_logprobs is None:
                    self.prompt_logprobs = e.prompt_logprobs
            elif isinstance(e, Finish):
                c.finish = e

    def _message(self, c: _ChoiceFold) -> dict[str, Any]:
        text = "".join(c.content)
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not c.calls else None}
        if c.calls and self.spec.legacy_functions:
            message["function_call"] = {"name": c.calls[0]["name"], "arguments": c.calls[0]["arguments"]}
        elif c.calls:
            message["tool_calls"] = [{"id": call["id"], "type": "function",
                                      "function": {"name": call["name"], "arguments": call["arguments"]}}
                                     for call in c.calls]
        if self.spec.reasoning is not None:
            message["reasoning_content"] = c.reasoning
        return message

    def body(self) -> dict[str, Any]:
        spec = self.spec
        choices = []
        for i, c in enumerate(self.choices):
            lp = {"content": chat_logprobs(self.state, c.logprobs, spec.top_logprobs)} if spec.logprobs else None
            finish = c.finish or Finish(i, None, None, False)
            choices.append({"index": i, "message": self._message(c), "logprobs": lp,
                            "finish_reason": _tool_finish(finish.reason, finish.tool_calls, spec.legacy_functions),
                            "stop_reason": finish.stop_reason})
        assert self.usage is not None
        body = {"id": spec.request_id, "object": "chat.completion", "created": spec.created, "model": spec.model,
                "choices": choices, "usage": self.usage.openai()}
        if spec.prompt_logprobs is not None:
            body["prompt_logprobs"] = vllm_prompt_logprobs(self.state, self.prompt_logprobs, spec.prompt_logprobs)
        return body

"""Engine deltas -> OpenAI responses: SSE chunks while streaming, one body otherwise.

Why chunks are built as plain dicts and ``json.dumps``: this runs once per
token per stream on the event loop, which must stay responsive with dozens of
streams; pydantic models describe the same shapes for the OpenAPI schema.

Streaming rules (what SDKs rely on): chat sends a role-only delta first for
each choice; text deltas follow as tokens arrive (empty ones, e.g. text held
back by a possible stop string, are skipped); each choice ends with a chunk
carrying ``finish_reason``; ``stream_options.include_usage`` adds a last chunk
with empty ``choices`` and the usage; then ``data: [DONE]``.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ...engine.engine import SequenceDelta
from ...model.sampler import Logprob
from ..server.errors import APIError, error_body
from .prompt_logprobs import echo_logprobs, join, vllm_prompt_logprobs
from ..server.serving import Job, ServerState, merge_streams
from ..parsers.reasoning import ReasoningParser, ReasoningSplit, split_reasoning
from ..parsers.tool_calls import ToolPlan, ToolStream, extract, openai_call

log = logging.getLogger("tokenmill.server")


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its generator and releases its jobs.

    Starlette cancels the response task when the client disconnects; if that
    happens while the generator is suspended at a ``yield`` (a send was in
    flight), nothing would close it until garbage collection. Closing it here
    runs its ``finally`` blocks now, and those abort the engine requests."""

    def __init__(self, content: AsyncIterator[bytes], state: ServerState, jobs: list[Job]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._state = state
        self._jobs = jobs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            for job in self._jobs:
                if job.reserved:  # never started: abort is moot, but the slot must go back
                    self._state.admission.release(job)


# ---- logprobs ----------------------------------------------------------------

def _top_sorted(lp: Logprob) -> list[tuple[int, float]]:
    return sorted(lp.top.items(), key=lambda kv: -kv[1])


def completion_logprobs(state: ServerState, lps: list[Logprob], offset: int) -> dict[str, Any]:
    tokens, values, tops, offsets = [], [], [], []
    for lp in lps:
        text = state.token_text(lp.token_id)
        tokens.append(text)
        values.append(lp.logprob)
        tops.append({state.token_text(t): v for t, v in _top_sorted(lp)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(state: ServerState, lps: list[Logprob], k: int) -> list[dict[str, Any]]:
    out = []
    for lp in lps:
        text = state.token_text(lp.token_id)
        top = [{"token": state.token_text(t), "logprob": v, "bytes": list(state.token_text(t).encode())}
               for t, v in _top_sorted(lp)[:k]]
        out.append({"token": text, "logprob": lp.logprob, "bytes": list(text.encode()), "top_logprobs": top})
    return out


# ---- accounting --------------------------------------------------------------

@dataclass
class _Tally:
    """Usage of a whole HTTP request (every job, every choice)."""

    jobs: list[Job]
    completion_tokens: int = 0
    cached: dict[int, int] = field(default_factory=dict)

    def add(self, job_index: int, delta: SequenceDelta) -> None:
        self.completion_tokens += len(delta.token_ids)
        self.cached[job_index] = max(self.cached.get(job_index, 0), delta.num_cached_tokens)

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(j.prompt_ids) for j in self.jobs)
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())}}


def _error_event(exc: BaseException) -> bytes:
    if isinstance(exc, APIError):
        return sse(error_body(exc.status, exc.message, exc.param, exc.code, exc.type))
    log.error("stream failed: %s", exc)
    return sse(error_body(500, f"internal error: {exc}"))


def _streams(state: ServerState, jobs: list[Job]) -> AsyncIterator[tuple[int, SequenceDelta]]:
    return merge_streams([state.stream_job(j) for j in jobs])


# ---- completions ---------------------------------------------------------------

@dataclass
class CompletionSpec:
    request_id: str
    model: str
    n: int
    logprobs: int | None
    echo_texts: list[str] | None  # per job, when echo is on
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_logprobs: int | None = None  # vLLM's field: alternatives per prompt token
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage so far in every chunk

    @property
    def echo_logprobs(self) -> bool:
        """Legacy echo with logprobs: the prompt's logprobs lead the choice's ``logprobs``."""
        return self.echo_texts is not None and self.logprobs is not None


async def completion_stream(state: ServerState, spec: CompletionSpec, jobs: list[Job]) -> AsyncIterator[bytes]:
    tally = _Tally(jobs)
    offsets: dict[int, int] = {}
    base = {"id": spec.request_id, "object": "text_completion", "created": spec.created, "model": spec.model}
    if spec.include_usage:
        base["usage"] = None

    def chunk(index: int, text: str, logprobs: Any, finish: str | None, stop: Any = None) -> bytes:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                  "stop_reason": stop}
        if spec.continuous_usage:
            return sse({**base, "choices": [choice], "usage": tally.usage()})
        return sse({**base, "choices": [choice]})

    merged = _streams(state, jobs)
    try:
        async for job_i, d in merged:
            idx = job_i * spec.n + d.index
            tally.add(job_i, d)
            text = d.text
            if idx not in offsets:
                prefix = spec.echo_texts[job_i] if spec.echo_texts else ""
                text = prefix + text
                offsets[idx] = len(prefix)
            lp = None
            if spec.logprobs is not None and d.logprobs:
                lp = completion_logprobs(state, d.logprobs, offsets[idx])
            if spec.echo_logprobs and d.prompt_logprobs is not None:
                lp = join(echo_logprobs(state, jobs[job_i].prompt_ids, d.prompt_logprobs, spec.logprobs or 0), lp)
            offsets[idx] += len(d.text)
            if text or lp:
                yield chunk(idx, text, lp, None)
            if d.finished:
                yield chunk(idx, "", None, d.finish_reason, d.stop_reason)
        if spec.include_usage:
            yield sse({**base, "choices": [], "usage": tally.usage()})
    except Exception as exc:  # noqa: BLE001 - reported in-band: the status line is already sent
        yield _error_event(exc)
    finally:
        await merged.aclose()  # type: ignore[attr-defined]
    yield DONE


async def completion_body(state: ServerState, spec: CompletionSpec, jobs: list[Job]) -> dict[str, Any]:
    tally = _Tally(jobs)
    total = len(jobs) * spec.n
    texts = [""] * total
    lps: list[list[Logprob]] = [[] for _ in range(total)]
    prompt_lps: list[list[Logprob | None] | None] = [None] * total
    finish: list[str | None] = [None] * total
    stops: list[Any] = [None] * total
    merged = _streams(state, jobs)
    try:
        async for job_i, d in merged:
            idx = job_i * spec.n + d.index
            tally.add(job_i, d)
            texts[idx] += d.text
            lps[idx].extend(d.logprobs)
            if d.prompt_logprobs is not None:
                prompt_lps[idx] = d.prompt_logprobs
            if d.finished:
                finish[idx], stops[idx] = d.finish_reason, d.stop_reason
    finally:
        await merged.aclose()  # type: ignore[attr-defined]
    choices = []
    echoed: dict[int, Any] = {}  # per prompt, converted once: its n choices share one list
    scored: dict[int, Any] = {}
    for idx in range(total):
        job_i = idx // spec.n
        prefix = spec.echo_texts[job_i] if spec.echo_texts else ""
        lp = completion_logprobs(state, lps[idx], len(prefix)) if spec.logprobs is not None else None
        if spec.echo_logprobs:
            if job_i not in echoed:
                echoed[job_i] = echo_logprobs(state, jobs[job_i].prompt_ids, prompt_lps[idx], spec.logprobs or 0)
            lp = join(echoed[job_i], lp)
        choice = {"index": idx, "text": prefix + texts[idx], "logprobs": lp,
                  "finish_reason": finish[idx], "stop_reason": stops[idx]}
        if spec.prompt_logprobs is not None:
            if job_i not in scored:
                scored[job_i] = vllm_prompt_logprobs(state, prompt_lps[idx], spec.prompt_logprobs)
            choice["prompt_logprobs"] = scored[job_i]
        choices.append(choice)
    return {"id": spec.request_id, "object": "text_completion", "created": spec.created, "model": spec.model,
            "choices": choices, "usage": tally.usage()}


# ---- chat ----------------------------------------------------------------------

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


def _tool_finish(reason: str | None, called: bool, legacy: bool = False) -> str | None:
    return ("function_call" if legacy else "tool_calls") if called and reason == "stop" else reason


def _legacy_delta(delta: dict[str, Any]) -> dict[str, Any] | None:
    """A tool-call delta in the legacy functions shape (only the first call exists there)."""
    if "tool_calls" not in delta:
        return delta
    call = delta["tool_calls"][0]
    if call.get("index", 0) != 0:
        return None
    fn = call.get("function", {})
    return {"function_call": {k: fn[k] for k in ("name", "arguments") if k in fn}}


async def chat_stream(state: ServerState, spec: ChatSpec, job: Job) -> AsyncIterator[bytes]:
    tally = _Tally([job])
    base = {"id": spec.request_id, "object": "chat.completion.chunk", "created": spec.created,
            "model": spec.model}
    if spec.include_usage:
        base["usage"] = None

    def chunk(index: int, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None,
              stop: Any = None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop
        if spec.continuous_usage:
            return sse({**base, "choices": [choice], "usage": tally.usage()})
        return sse({**base, "choices": [choice]})

    def pieces_of(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not spec.legacy_functions:
            return deltas
        return [d for d in map(_legacy_delta, deltas) if d is not None]

    for i in range(spec.n):
        yield chunk(i, {"role": "assistant", "content": ""})
    tool_streams = {i: ToolStream(spec.tools) for i in range(spec.n)} if spec.tools is not None else {}
    splits = {i: ReasoningSplit(spec.reasoning, job.prompt_text) for i in range(spec.n)} if spec.reasoning else {}
    merged = _streams(state, [job])
    try:
        async for _, d in merged:
            tally.add(0, d)
            lp = None
            if spec.logprobs and d.logprobs:
                lp = {"content": chat_logprobs(state, d.logprobs, spec.top_logprobs)}
            text = d.text
            if splits:  # the thinking streams as deltas of its own; the rest goes on as the answer
                thought, text = splits[d.index].feed(d.text, final=d.finished)
                if thought:
                    yield chunk(d.index, {"reasoning_content": thought}, lp)
                    lp = None
            if tool_streams:
                ts = tool_streams[d.index]
                pieces = pieces_of(ts.feed(text))
                for k, piece in enumerate(pieces):
                    yield chunk(d.index, piece, lp if k == 0 else None)
                if lp and not pieces:
                    yield chunk(d.index, {"content": ""}, lp)
                if d.finished:
                    rest, called = ts.finish()
                    for piece in pieces_of(rest):
                        yield chunk(d.index, piece)
                    yield chunk(d.index, {}, None, _tool_finish(d.finish_reason, called, spec.legacy_functions),
                                d.stop_reason)
                continue
            if text or lp:
                yield chunk(d.index, {"content": text}, lp)
            if d.finished:
                yield chunk(d.index, {}, None, d.finish_reason, d.stop_reason)
        if spec.include_usage:
            yield sse({**base, "choices": [], "usage": tally.usage()})
    except Exception as exc:  # noqa: BLE001 - reported in-band
        yield _error_event(exc)
    finally:
        await merged.aclose()  # type: ignore[attr-defined]
    yield DONE


async def chat_body(state: ServerState, spec: ChatSpec, job: Job) -> dict[str, Any]:
    tally = _Tally([job])
    texts = [""] * spec.n
    lps: list[list[Logprob]] = [[] for _ in range(spec.n)]
    prompt_lps: list[Logprob | None] | None = None
    finish: list[str | None] = [None] * spec.n
    stops: list[Any] = [None] * spec.n
    merged = _streams(state, [job])
    try:
        async for _, d in merged:
            tally.add(0, d)
            texts[d.index] += d.text
            lps[d.index].extend(d.logprobs)
            if d.prompt_logprobs is not None and prompt_lps is None:
                prompt_lps = d.prompt_logprobs
            if d.finished:
                finish[d.index], stops[d.index] = d.finish_reason, d.stop_reason
    finally:
        await merged.aclose()  # type: ignore[attr-defined]
    choices = []
    for i in range(spec.n):
        lp = {"content": chat_logprobs(state, lps[i], spec.top_logprobs)} if spec.logprobs else None
        thought, answer = None, texts[i]
        if spec.reasoning is not None:
            thought, answer = split_reasoning(spec.reasoning, texts[i], job.prompt_text)
        message: dict[str, Any] = {"role": "assistant", "content": answer}
        reason = finish[i]
        if spec.tools is not None:
            content, calls = extract(spec.tools, answer)
            if calls and spec.legacy_functions:
                message = {"role": "assistant", "content": content,
                           "function_call": {"name": calls[0].name, "arguments": calls[0].arguments}}
                reason = _tool_finish(reason, True, legacy=True)
            elif calls:
                message = {"role": "assistant", "content": content,
                           "tool_calls": [openai_call(c) for c in calls]}
                reason = _tool_finish(reason, True)
        if spec.reasoning is not None:
            message["reasoning_content"] = thought
        choices.append({"index": i, "message": message, "logprobs": lp,
                        "finish_reason": reason, "stop_reason": stops[i]})
    body = {"id": spec.request_id, "object": "chat.completion", "created": spec.created, "model": spec.model,
            "choices": choices, "usage": tally.usage()}
    if spec.prompt_logprobs is not None:
        body["prompt_logprobs"] = vllm_prompt_logprobs(state, prompt_lps, spec.prompt_logprobs)
    return body

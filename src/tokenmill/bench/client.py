"""One streamed request over plain OpenAI-compatible HTTP, timed from the client.

Speaks only the wire format (SSE ``data:`` lines, ``[DONE]``, a final usage
chunk), so it works against vLLM, SGLang, llama.cpp's server and tokenmill.
Every failure becomes a record with a readable ``error``; nothing raises.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from tokenmill.bench.types import RequestRecord, RequestSpec

# The one clock every per-request time comes from (tests substitute a scripted one).
_clock = time.perf_counter


@dataclass
class Target:
    """Where and how to send requests."""

    base_url: str
    model: str
    endpoint: str = "completions"  # completions | chat
    api_key: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    extra_headers: dict[str, str] = field(default_factory=dict)  # --header KEY=VALUE

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        h.update(self.extra_headers)
        return h


def normalize_base_url(url: str) -> str:
    """Accept 'host:port', 'http://h:p', 'http://h:p/v1' -> 'http://h:p'."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    for suffix in ("/v1/completions", "/v1/chat/completions", "/v1"):
        if url.endswith(suffix):
            url = url[: -len(suffix)]
    return url.rstrip("/")


def build_body(target: Target, spec: RequestSpec) -> dict[str, Any]:
    """The JSON body: the spec's own sampling wins over the target's defaults."""
    body: dict[str, Any] = {"model": target.model, "stream": True,
                            "stream_options": {"include_usage": True},
                            "temperature": target.temperature}
    if target.endpoint == "chat":
        body["messages"] = spec.messages or [{"role": "user", "content": spec.prompt or ""}]
    else:
        if spec.prompt is not None:
            body["prompt"] = spec.prompt
        else:
            body["prompt"] = "\n".join(f"{m['role']}: {m['content']}" for m in spec.messages or [])
    if spec.output_len is not None:
        body["max_tokens"] = int(spec.output_len)
        if target.ignore_eos:
            body["ignore_eos"] = True
    body.update(target.extra_body)
    body.update(spec.sampling)
    return body


def _chunk_text(obj: dict[str, Any]) -> tuple[str, str | None]:
    """Text carried by one SSE chunk (completions or chat), and its finish_reason."""
    choices = obj.get("choices") or []
    if not choices:
        return "", None
    ch = choices[0]
    if "text" in ch:
        text = ch.get("text") or ""
    else:
        delta = ch.get("delta") or {}
        text = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return text, ch.get("finish_reason")


def _error_message(status: int, body: bytes) -> str:
    try:
        obj = json.loads(body)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        msg = err.get("message") if isinstance(err, dict) else None
        if not msg and isinstance(obj, dict):
            msg = obj.get("detail") or obj.get("message")
        if msg:
            return str(msg)[:300]
    except (ValueError, AttributeError):
        pass
    text = body.decode("utf-8", "replace").strip()
    return text[:300] or f"HTTP {status}"


async def send_request(client: httpx.AsyncClient, target: Target, spec: RequestSpec,
                       index: int, t0: float,
                       count_tokens: Callable[[str], int] | None = None) -> RequestRecord:
    """Send ``spec``, stream the answer, and measure it. ``t0`` is the run's
    perf_counter origin. Output tokens come from ``usage`` when the server
    sends it, else from ``count_tokens(text)``, else one per content chunk."""
    rec = RequestRecord(index=index, prompt_len_target=spec.prompt_len,
                        output_len_target=spec.output_len, session=spec.session, turn=spec.turn)
    body = build_body(target, spec)
    headers = target.headers()
    if spec.session is not None:  # the server's capture keeps the conversation together
        headers.setdefault("x-session-id", spec.session)
    start = _clock()
    rec.start = start - t0
    streamed = _Streamed(last=start)
    try:
        async with client.stream("POST", target.base_url + target.path, json=body,
                                 headers=headers) as resp:
            rec.status = resp.status_code
            rec.variant = resp.headers.get("x-tokenmill-variant") or None
            if resp.status_code != 200:
                rec.error = _error_message(resp.status_code, await resp.aread())
                rec.e2e = _clock() - start
                return rec
            await _read_stream(resp, rec, start, streamed)
    except _StreamError as exc:
        rec.error = str(exc)
    except httpx.ConnectError as exc:
        rec.error = f"cannot connect to {target.base_url}: {_reason(exc)}"
    except httpx.TimeoutException as exc:
        rec.error = f"timed out ({type(exc).__name__})"
    except httpx.HTTPError as exc:
        rec.error = f"{type(exc).__name__}: {_reason(exc)}"
    rec.e2e = _clock() - start
    if not rec.error:
        _complete(rec, spec, streamed, count_tokens)
    return rec


@dataclass
class _Streamed:
    """What a stream carried so far, besides what goes straight into the record."""

    last: float  # when the last content chunk came (the start before any)
    chunks: int = 0  # content chunks
    pieces: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None


async def _read_stream(resp: httpx.Response, rec: RequestRecord, start: float, streamed: _Streamed) -> None:
    """Read the SSE lines up to ``[DONE]``, timing each content chunk; raises _StreamError for a
    malformed or failed stream, or one that ends without ``[DONE]`` or a finish reason."""
    done = False
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        obj = _payload(data)
        if obj.get("usage"):
            streamed.usage = obj["usage"]
        text, finish = _chunk_text(obj)
        if finish:
            rec.finish_reason = finish
        if text:
            now = _clock()
            if streamed.chunks == 0:
                rec.ttft = now - start
            else:
                rec.itls.append(now - streamed.last)
            streamed.last = now
            streamed.chunks += 1
            streamed.pieces.append(text)
    if not done and rec.finish_reason is None:
        raise _StreamError("stream ended early (no [DONE] and no finish_reason)")


def _payload(data: str) -> dict[str, Any]:
    """One ``data:`` line's JSON object; an error the server put in the stream raises."""
    try:
        obj = json.loads(data)
    except json.JSONDecodeError:
        raise _StreamError(f"malformed SSE data: {data[:80]!r}") from None
    if not isinstance(obj, dict):
        raise _StreamError(f"unexpected SSE payload: {data[:80]!r}")
    if obj.get("error"):
        err = obj["error"]
        raise _StreamError("server error in stream: "
                           + str(err.get("message") if isinstance(err, dict) else err))
    return obj


def _complete(rec: RequestRecord, spec: RequestSpec, streamed: _Streamed,
              count_tokens: Callable[[str], int] | None) -> None:
    """A stream that ended well: its answer and token counts (the server's usage when sent)."""
    rec.ok = True
    rec.answer = "".join(streamed.pieces)
    usage = streamed.usage
    if usage:
        rec.usage_reported = True
        rec.prompt_tokens = usage.get("prompt_tokens")
        rec.output_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            rec.cached_tokens = int(details["cached_tokens"])
    else:
        rec.prompt_tokens = spec.prompt_len
        rec.output_tokens = count_tokens("".join(streamed.pieces)) if count_tokens else streamed.chunks


class _StreamError(Exception):
    pass


def _reason(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    if "Connection refused" in text or "Errno 111" in text:
        return "connection refused"
    return text.splitlines()[0][:200]

"""Running an API's encoder over a request's engine streams: SSE while streaming, one body otherwise.

Every endpoint answers the same way: the jobs' deltas, merged, go through one
``Assembler`` (parsers/assembler.py) into output events, and an encoder of the
endpoint's API turns the events into its SSE events (``stream_events``) or a fold of
them into its whole body (``fold_events``). The encoders are chat_encoder.py and
completion_encoder.py here, responses_encoder.py for the Responses API and the
Messages encoder under ``anthropic/``.

Why chunks are built as plain dicts and ``json.dumps``: this runs once per
token per stream on the event loop, which must stay responsive with dozens of
streams; pydantic models describe the same shapes for the OpenAPI schema.
"""
from __future__ import annotations

import json
import logging
from typing import Any, AsyncIterator, Protocol

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ...engine.engine import SequenceDelta
from ..parsers.assembler import Assembler
from ..parsers.output_events import Event, Usage
from ..server.errors import APIError, error_body
from ..server.job_stream import merge_streams
from ..server.serving import Job, ServerState

log = logging.getLogger("tokenmill.server")


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def error_event(exc: BaseException) -> bytes:
    """An error after the status line went out, as an OpenAI-shaped SSE event."""
    if isinstance(exc, APIError):
        return sse(error_body(exc.status, exc.message, exc.param, exc.code, exc.type))
    log.error("stream failed: %s", exc)
    return sse(error_body(500, f"internal error: {exc}"))


class Encoder(Protocol):
    """An API's streamed shape of the output events."""

    def opening(self, usage: Usage) -> list[bytes]:
        """What goes out before the engine's first delta."""

    def encode(self, events: list[Event]) -> list[bytes]:
        """The SSE events of one engine delta's events (or of the final ``Usage``)."""

    def error(self, exc: BaseException) -> bytes:
        """An error after the stream started, in-band."""

    def done(self) -> list[bytes]:
        """What ends the stream, error or not."""


class Fold(Protocol):
    """An API's whole body, folded from the output events."""

    def add(self, events: list[Event]) -> None: ...

    def body(self) -> dict[str, Any]: ...


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


def _streams(state: ServerState, jobs: list[Job]) -> AsyncIterator[tuple[int, SequenceDelta]]:
    return merge_streams([state.stream_job(j) for j in jobs])


async def stream_events(state: ServerState, jobs: list[Job], assembler: Assembler,
                        encoder: Encoder) -> AsyncIterator[bytes]:
    """The jobs' output as ``encoder``'s SSE events; an error mid-stream is reported in-band
    (the status line is already sent)."""
    for chunk in encoder.opening(assembler.usage()):
        yield chunk
    merged = _streams(state, jobs)
    try:
        async for job_i, delta in merged:
            for chunk in encoder.encode(assembler.feed(job_i, delta)):
                yield chunk
        for chunk in encoder.encode(assembler.close()):
            yield chunk
    except Exception as exc:  # noqa: BLE001 - reported in-band
        yield encoder.error(exc)
    finally:
        await merged.aclose()  # type: ignore[attr-defined]
    for chunk in encoder.done():
        yield chunk


async def fold_events(state: ServerState, jobs: list[Job], assembler: Assembler, fold: Fold) -> dict[str, Any]:
    """The jobs' output as ``fold``'s whole body: the same events a stream would encode."""
    merged = _streams(state, jobs)
    try:
        async for job_i, delta in merged:
            fold.add(assembler.feed(job_i, delta))
    finally:
        await merged.aclose()  # type: ignore[attr-defined]
    fold.add(assembler.close())
    return fold.body()

"""Bounded request bodies: a size limit, a read deadline, and JSON parsing off the event loop.

Why: one event loop answers every client. A body of tens of megabytes read,
parsed and tokenized on it stalls ``/health`` and every other request for as
long as that takes, and a client that sends half a body and stops would hold
a request open (and shutdown with it) forever. So before routing, the whole
body is read here, under two bounds:

- ``max_request_bytes``: a ``Content-Length`` above it is refused with 413
  before the app sees a byte; a chunked body is counted as it arrives and
  refused the moment it passes the limit. The rest of a refused body, up to
  ``DRAIN_BYTES``, is read and dropped before the answer: a server that
  closes a connection with unread data in it resets it, and the client (a
  router, say) may lose the 413 and see only a broken connection, which a
  router would take for a dead backend. Beyond that much the connection is
  closed at once. The default follows the context
  length (``default_body_limit``): a body much larger than any prompt the
  model can take cannot be a valid request.
- ``request_read_timeout_s``: the whole body must arrive within it (408);
  while the server drains, an unfinished body is given up at once (503), so
  a stalled client cannot hold shutdown.

Why not parse JSON in a worker thread instead: ``json.loads`` is one C call
that holds the GIL from start to end, so the event loop waits for it on any
thread (0.4 s for a 50 MB string, seconds for millions of token ids). The
limit is what keeps parsing short. What does release the GIL, tokenizing
long text, runs in a worker thread (``openai_routes.encode``), and text that
cannot fit the context is refused before it is tokenized at all.

The request line and headers come before any of that, inside the HTTP server
(uvicorn), which on its own waits for them forever: a client that opens a
connection and sends half a header, or nothing, holds it (and a file
descriptor) for good, and enough such clients take every descriptor there is.
``header_guarded_protocol`` gives both servers (``tokenmill serve`` and the
router) uvicorn's HTTP/1.1 protocol with a deadline on that phase:

- ``header_read_timeout_s``: from the moment a connection opens, or the first
  byte of the next request on a kept-alive one, the whole request line and
  headers must arrive within it; else the connection is closed, with a 408 when
  part of a request had come. A request being answered (a long stream, say) is
  past this phase and never timed out here; an idle kept-alive connection is
  uvicorn's own keep-alive timeout's.
- ``max_pending_connections``: at most this many connections may wait for their
  headers at once; one more closes the one that has waited longest, so a flood
  of stalled connections costs each of them its place, not the clients that
  send a request at once.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# a context token is a few bytes of text, or up to ~12 as JSON-escaped non-ASCII or a token id;
# the rest is room for a batch of prompts, chat framing and sampling fields
BYTES_PER_CONTEXT_TOKEN = 64
MIN_BODY_LIMIT = 1 << 20
JOIN_OFF_LOOP_BYTES = 1 << 20
_POLL_S = 0.25  # how often a body read looks at the drain flag
DRAIN_BYTES = 8 << 20  # of a refused body, read and dropped so the client can read the 413
TRIM_AFTER_BYTES = 4 << 20  # after a body this large, freed heap memory is handed back to the OS

def default_body_limit(max_model_len: int) -> int:
    """Bytes a request body may have unless the operator says otherwise."""
    return max(MIN_BODY_LIMIT, BYTES_PER_CONTEXT_TOKEN * int(max_model_len))


# OpenAI's error types for the statuses a guard answers with (entrypoints/server/errors.py has the full table)
_ERROR_TYPES = {408: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable"}


def _error_body(status: int, message: str, code: str) -> bytes:
    error = {"message": message, "type": _ERROR_TYPES.get(status, "invalid_request_error"), "param": None,
             "code": code}
    return json.dumps({"error": error}).encode()


async def _reject(send: Send, status: int, message: str, code: str, headers: dict[str, str] | None = None) -> None:
    body = _error_body(status, message, code)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
           (b"connection", b"close")]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class BodyGuard:
    """Reads every request body in full, within a size limit and a deadline, before the app sees it.

    ``limit()``, ``timeout()`` and ``draining()`` are read per request, so
    settings changed after start-up (tests) take effect. ``after_large_body`` runs (in a
    worker thread) once a body over ``TRIM_AFTER_BYTES`` is done with: the server hands
    freed heap memory back to the OS there (entrypoints/server/heap.py).

    A base module: the server and the router (which must not import the server) both use it."""

    def __init__(self, app: ASGIApp, limit: Callable[[], int], timeout: Callable[[], float],
                 draining: Callable[[], bool], on_reject: Callable[[str], None] | None = None,
                 after_large_body: Callable[[], object] | None = None) -> None:
        self.app = app
        self.limit = limit
        self.timeout = timeout
        self.draining = draining
        self.on_reject = on_reject or (lambda reason: None)
        self.after_large_body = after_large_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        limit = self.limit()
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            self.on_reject("too_large")
            if declared <= DRAIN_BYTES:
                await self._drain(receive, 0)
            await _reject(send, 413, f"the request body has {declared} bytes, more than this server accepts "
                          f"({limit} bytes; see --max-request-bytes)", "request_too_large")
            return
        body = await self._read(receive, send, limit)
        if body is None:
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: disconnects, for streaming responses

        try:
            await self.app(scope, replay, send)
        finally:
            if len(body) > TRIM_AFTER_BYTES and self.after_large_body is not None:
                del body
                await asyncio.to_thread(self.after_large_body)

    async def _drain(self, receive: Receive, seen: int) -> None:
        """Read and drop the rest of a refused body: up to DRAIN_BYTES in all, within the read deadline."""
        deadline = time.monotonic() + self.timeout()
        while seen <= DRAIN_BYTES and not self.draining():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                message = await asyncio.wait_for(receive(), timeout=min(_POLL_S, left))
            except asyncio.TimeoutError:
                continue
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                return
            seen += len(message.get("body", b""))

    async def _read(self, receive: Receive, send: Send, limit: int) -> bytes | None:
        """The whole body, or None once an error response is sent (or the client left)."""
        chunks: list[bytes] = []
        size = 0
        deadline = time.monotonic() + self.timeout()
        pending: asyncio.Task[Message] | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(receive())
                left = deadline - time.monotonic()
                done, _ = await asyncio.wait({pending}, timeout=max(0.0, min(_POLL_S, left)))
                if not done:
                    if self.draining():
                        self.on_reject("draining")
                        await _reject(send, 503, "the server is shutting down", "shutting_down",
                                      {"Retry-After": "5"})
                        return None
                    if time.monotonic() >= deadline:
                        self.on_reject("read_timeout")
                        await _reject(send, 408, f"the request body did not arrive within {self.timeout():g} s",
                                      "request_timeout")
                        return None
                    continue
                message, pending = pending.result(), None
                if message["type"] == "http.disconnect":
                    return None
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    self.on_reject("too_large")
                    chunks.clear()
                    if message.get("more_body", False):
                        await self._drain(receive, size)
                    await _reject(send, 413, f"the request body is larger than this server accepts ({limit} bytes; "
                                  "see --max-request-bytes)", "request_too_large")
                    return None
                if chunk:
                    chunks.append(chunk)
                if not message.get("more_body", False):
                    if len(chunks) == 1:
                        return chunks[0]
                    if size > JOIN_OFF_LOOP_BYTES:  # a large join lets go of the GIL: off the loop
                        return await asyncio.to_thread(b"".join, chunks)
                    return b"".join(chunks)
        finally:
            if pending is not None and not pending.done():
                pending.cancel()


def _content_length(scope: Scope) -> int | None:
    for key, value in scope.get("headers") or []:
        if key.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


# ---- the request line and headers --------------------------------------------------------

DEFAULT_HEADER_READ_TIMEOUT_S = 20.0
DEFAULT_MAX_PENDING_CONNECTIONS = 512


@dataclass
class HeaderDeadline:
    """What the connections of one server share: the deadline for a request's line and headers
    (``timeout()``, read as each wait starts, so a setting changed after start-up counts), the
    bound on connections waiting for theirs, and those connections, longest waiting first."""

    timeout: Callable[[], float]
    max_pending: int = DEFAULT_MAX_PENDING_CONNECTIONS
    on_reject: Callable[[str], None] = lambda reason: None
    pending: "OrderedDict[Any, None]" = field(default_factory=OrderedDict)


def header_guarded_protocol(deadline: HeaderDeadline) -> type:
    """uvicorn's h11 HTTP/1.1 protocol, with ``deadline`` on each request's line and headers.

    A class for ``uvicorn.Config(http=...)``. h11 rather than httptools even where httptools
    is installed: one parser, whose state says whether a request's headers are still to come
    (``their_state`` is IDLE until they have all arrived)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderGuardedProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._await_headers()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self.conn.their_state is h11.IDLE:
                self._await_headers()  # the first byte of the next request on a kept-alive connection
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._headers_done()

        def connection_lost(self, exc: Exception | None) -> None:
            self._headers_done()
            super().connection_lost(exc)

        def _await_headers(self) -> None:
            self._header_timer = self.loop.call_later(deadline.timeout(), self._give_up, "header_timeout")
            deadline.pending[self] = None
            while len(deadline.pending) > deadline.max_pending:
                oldest = next(iter(deadline.pending))
                oldest._give_up("too_many_pending")

        def _headers_done(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            deadline.pending.pop(self, None)

        def _give_up(self, reason: str) -> None:
            """Close a connection whose headers did not come in time (or that lost its place):
            with a 408 when part of a request had come, quietly when nothing had."""
            self._headers_done()
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            deadline.on_reject(reason)
            if self.conn.trailing_data[0]:
                message = (f"the request headers did not arrive within {deadline.timeout():g} s"
                           if reason == "header_timeout" else "too many connections are waiting to send a request")
                body = _error_body(408, message, "request_timeout")
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                     b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body)
            self.transport.close()

    return HeaderGuardedProtocol

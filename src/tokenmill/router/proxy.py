"""OpenAI-compatible reverse proxy in front of the backends.

Streams pass through chunk by chunk: the backend's bytes are relayed as they
arrive, never re-framed or buffered. Failure handling follows what a client
can tolerate:

- a backend that cannot be reached (the request never left): it leaves
  rotation and the request is tried once on another;
- a 429 or 502/503/504 answer before the first byte: tried once elsewhere;
  on the last try such an answer is passed through as it is. A 5xx makes
  the health loop check at once; a 4xx (the client's fault, 413 included)
  never counts against a backend;
- a failure after the request was sent: the backend's /health is asked at
  once. Dead: the request is *poison* (its attempt coincided with the
  backend's death), so it is refused with 502 rather than replayed to kill
  the next replica. Alive (a connection that broke, or a backend that
  refused the body and closed): not held against the backend, tried once
  elsewhere;
- a stream that breaks after its first byte: the client gets an SSE error
  event and the stream ends (no hang, no silent truncation);
- non-streaming responses are read whole before answering, so any failure
  there counts as "before the first byte"; a client that hangs up meanwhile
  cancels the backend request (its connection closes, so the backend aborts);
- a request continuing a Responses API conversation (``previous_response_id``)
  the router has seen is sent to the replica that holds it and nowhere else:
  a busy replica queues it, a failing one's answer is passed through, and a
  replica out of rotation is a 502 that says so (another replica could only
  answer 404).

The tenant headers (``x-gateway-inference-fairness-id``, ``-objective``) the
replica sees are the ones tenancy.py decides, never the client's own when the
router has a keys file.

Bodies are read whole first, within ``max_request_bytes`` (413) and
``request_read_timeout`` (408), as the server does (gateway/request_guard.py); every
error, a body nested too deep for the JSON parser included, is OpenAI-shaped
JSON.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from typing import AsyncIterator, Callable

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..gateway.credentials import bearer_token
from ..gateway.request_guard import BodyGuard
from .backend import Backend
from .core import ConversationUnavailable, NoBackendError, Router, ShedError
from .sessions import ResponseIdSniffer, previous_response_of, response_id_of_body, session_key
from .tenancy import FAIRNESS_HEADER, OBJECTIVE_HEADER, Caller, TenantLimited

log = logging.getLogger("tokenmill.router")

_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
        "proxy-authorization", "proxy-connection", "accept-encoding", "trailer"}
# set by the router from the caller (tenancy.py), never copied from the client's request
_TENANT_HEADERS = {FAIRNESS_HEADER, OBJECTIVE_HEADER}
_RESP_DROP = {"content-length", "connection", "keep-alive", "transfer-encoding", "content-encoding",
              "date", "server", "trailer"}
# A replica that is shedding (429) or failing (502-504) before any byte is
# worth one try elsewhere; on the last try its answer is passed through.
_RETRY_STATUS = {429, 502, 503, 504}
# failures where the request never reached the backend: the backend is unreachable, the request innocent
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


class Poisoned(Exception):
    """The backend died while handling this request: refuse it, do not replay it elsewhere."""


def parse_body(raw: bytes) -> tuple[dict | None, JSONResponse | None]:
    """The JSON object of a request body, or the 400 that refuses it."""
    try:
        body = json.loads(raw)
    except RecursionError:
        return None, error(400, "request body is nested too deeply", "invalid_request_error", "invalid_json")
    except ValueError:
        return None, error(400, "request body is not valid JSON", "invalid_request_error", "invalid_json")
    if not isinstance(body, dict):
        return None, error(400, "request body must be a JSON object", "invalid_request_error")
    return body, None


async def _then(chunks: AsyncIterator[bytes], done: Callable[[], None]) -> AsyncIterator[bytes]:
    """``chunks``, then ``done()`` however the stream ends."""
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        done()


def error(status: int, message: str, kind: str = "server_error", code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}},
                        status_code=status)


def sse_error(message: str) -> bytes:
    payload = {"error": {"message": message, "type": "server_error", "param": None, "code": "backend_stream_broken"}}
    return f"data: {json.dumps(payload)}\n\n".encode()


class Proxy:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.metrics = router.metrics
        self.canary = router.canary  # None unless --variant groups are configured

    # -- helpers ----------------------------------------------------------
    @staticmethod
    def _presented_key(request: Request) -> str | None:
        """The key the client sent: Bearer (the scheme in any letter case), else x-api-key
        (where Anthropic's clients send it)."""
        got = bearer_token(request.headers.get("authorization"))
        if got is None and "x-api-key" in request.headers:
            got = request.headers["x-api-key"].encode("latin-1")
        return got.decode("latin-1") if got is not None else None

    def _authorized(self, request: Request) -> bool:
        key = self.router.config.api_key
        tenancy = self.router.tenancy
        if not key and tenancy.directory is None:
            return True
        got = self._presented_key(request)
        if got is None:
            return False
        if key and hmac.compare_digest(hashlib.sha256(got.encode("latin-1")).digest(),
                                       hashlib.sha256(key.encode()).digest()):
            return True
        return tenancy.key_opens(got)

    def _caller(self, request: Request) -> Caller:
        return self.router.tenancy.caller(request.headers, self._presented_key(request))

    def _forward_headers(self, request: Request, caller: Caller) -> dict[str, str]:
        out = {k: v for k, v in request.headers.items() if k.lower() not in _HOP and k.lower() not in _TENANT_HEADERS}
        out.update(caller.headers())
        out["accept-encoding"] = "identity"
        bkey = self.router.config.backend_api_key
        if bkey:
            out["authorization"] = f"Bearer {bkey}"
            out.pop("x-api-key", None)  # the router's own key stays here
        return out

    @staticmethod
    def _response_headers(resp: httpx.Response, backend: Backend) -> dict[str, str]:
        out = {k: v for k, v in resp.headers.items() if k.lower() not in _RESP_DROP}
        out["x-tokenmill-backend"] = backend.endpoint
        return out

    def _answer(self, resp: Response) -> Response:
        self.metrics.responses.labels(str(resp.status_code)).inc()
        return resp

    # -- endpoints --------------------------------------------------------
    async def health(self, request: Request) -> Response:
        n = len(self.router.pool.healthy())
        return JSONResponse({"status": "ok" if n else "unavailable", "healthy_backends": n},
                            status_code=200 if n else 503)

    async def metrics_endpoint(self, request: Request) -> Response:
        for b in self.router.pool.backends.values():
            self.metrics.healthy.labels(b.url).set(1 if b.healthy else 0)
            self.metrics.in_flight.labels(b.url).set(b.in_flight)
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def backends(self, request: Request) -> Response:
        if not self._authorized(request):
            return error(401, "invalid API key", "authentication_error", "invalid_api_key")
        return JSONResponse(self.router.snapshot())

    async def models(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._answer(error(401, "invalid API key", "authentication_error", "invalid_api_key"))
        headers = self._forward_headers(request, self._caller(request))
        tried: set[str] = set()
        for _ in range(2):
            cands = self.router.candidates(exclude=tried)
            if not cands:
                break
            b = min(cands, key=lambda b: b.in_flight)
            tried.add(b.url)
            try:
                r = await self.router.client.get(b.url + "/v1/models", headers=headers)
            except httpx.TransportError as exc:
                self.router.pool.report_failure(b, f"{type(exc).__name__} on /v1/models")
                continue
            return self._answer(Response(r.content, r.status_code, self._response_headers(r, b)))
        return self._answer(error(503, "no ready backend", code="no_backend"))

    async def stored_response(self, request: Request) -> Response:
        """GET / DELETE /v1/responses/{id}: to the replica that produced it (learned from the
        responses relayed), and only there; when unknown (another router, a restart), each
        ready replica in turn until one has it."""
        if not self._authorized(request):
            return self._answer(error(401, "invalid API key", "authentication_error", "invalid_api_key"))
        rid = request.path_params["response_id"]
        headers = self._forward_headers(request, self._caller(request))
        try:
            home = self.router.conversation_home({"previous_response_id": rid})
        except ConversationUnavailable as exc:
            return self._answer(error(502, str(exc), code="conversation_replica_unavailable"))
        last: Response | None = None
        for b in [home] if home is not None else self.router.candidates():
            try:
                r = await self.router.client.request(request.method, b.url + request.url.path, headers=headers)
            except httpx.TransportError as exc:
                self.router.pool.report_failure(b, f"{type(exc).__name__} on {request.method} response")
                if home is not None:
                    return self._answer(error(502, f"the replica holding response {rid!r} ({b.endpoint}) failed: "
                                                   f"{type(exc).__name__}", code="conversation_replica_unavailable"))
                continue
            last = Response(r.content, r.status_code, self._response_headers(r, b))
            if r.status_code != 404:
                if home is None and r.status_code == 200 and request.method == "GET":
                    self.router.sessions.learn_response(rid, b.url)  # found: its continuation goes there
                return self._answer(last)
        if last is not None:
            return self._answer(last)
        return self._answer(error(503, "no ready backend", code="no_backend"))

    async def generate(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._answer(error(401, "invalid API key", "authentication_error", "invalid_api_key"))
        raw = await request.body()
        body, refusal = parse_body(raw)
        if refusal is not None or body is None:
            return self._answer(refusal or error(400, "bad body", "invalid_request_error"))
        if body.get("stream"):
            return await self._admitted(request, raw, body)
        # not streamed: the answer is read whole; a client that leaves meanwhile cancels it,
        # which closes the backend connection and so aborts the backend's work
        work = asyncio.ensure_future(self._admitted(request, raw, body))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, gone):
                if not task.done():
                    task.cancel()
            await asyncio.gather(work, gone, return_exceptions=True)
        if work.cancelled():
            self.metrics.responses.labels("499").inc()
            return Response(status_code=499)
        return work.result()

    async def _admitted(self, request: Request, raw: bytes, body: dict) -> Response:
        """The tenant's limits and the trace around the routing and its attempts."""
        path = request.url.path
        caller = self._caller(request)
        headers = self._forward_headers(request, caller)
        try:
            self.router.tenancy.admit(caller, path, body)
        except TenantLimited as exc:
            response = error(429, str(exc), "rate_limit_error", exc.code)
            response.headers["Retry-After"] = str(exc.retry_after_s)
            return self._answer(response)
        tracing, span = self.router.tracing, None
        if tracing is not None:  # the caller's trace continues here and on to the replica
            span = tracing.start(f"route {request.method} {path}", tracing.extract(request.headers),
                                 attributes={"tokenmill.tenant": caller.fairness_id or "",
                                             "gen_ai.request.model": str(body.get("model") or "")})
            headers.pop("traceparent", None)
            headers.pop("tracestate", None)
            tracing.inject(span, headers)

        def done() -> None:
            self.router.tenancy.done(caller)
            if span is not None:
                span.set_attribute("http.response.status_code", result.status_code)
                span.end()

        result = await self._generate(request, path, body, raw, headers, caller.priority)
        if isinstance(result, StreamingResponse):
            result.body_iterator = _then(result.body_iterator, done)
        else:
            done()
        return result

    async def _generate(self, request: Request, path: str, body: dict, raw: bytes, headers: dict[str, str],
                        priority: int | None) -> Response:
        stream = bool(body.get("stream"))
        tried: set[str] = set()
        last_error = ""
        for attempt in range(2):
            subset = None
            if self.canary is not None:
                ready = {b.endpoint for b in self.router.candidates(exclude=tried)}
                _, subset = self.canary.subset_for(request.headers, body, ready)
            try:
                decision = await self.router.route(path, body, exclude=tried, subset=subset,
                                                   session=session_key(request.headers, body), priority=priority)
            except ConversationUnavailable as exc:
                return self._answer(error(502, str(exc), code="conversation_replica_unavailable"))
            except NoBackendError:
                if last_error:
                    return self._answer(error(502, f"backend failed before responding: {last_error}",
                                              code="backend_unavailable"))
                return self._answer(error(503, "no ready backend", code="no_backend"))
            except ShedError:
                return self._answer(error(429, "all backends are saturated; retry later",
                                          "rate_limit_error", "overloaded"))
            b = decision.backend
            pinned = decision.reason == "conversation"  # no other replica holds it: never tried elsewhere
            tried.add(b.url)
            if attempt:
                self.metrics.retries.inc()
            try:
                result = await self._attempt(b, path, raw, headers, stream, last_try=attempt == 1 or pinned)
            except Poisoned as exc:
                self.metrics.poisoned.inc()
                log.warning("request refused, not retried: %s", exc)
                return self._answer(error(502, f"{exc}; the request is not retried on another backend",
                                          code="backend_died"))
            if isinstance(result, Response):
                if self.canary is not None:
                    result.headers["x-tokenmill-variant"] = self.canary.variant_of(b.endpoint) or ""
                return self._answer(result)
            if pinned:
                return self._answer(error(502, f"the replica holding previous_response_id "
                                               f"{previous_response_of(body)!r} failed before responding: {result}; "
                                               "no other replica holds the conversation",
                                          code="conversation_replica_unavailable"))
            last_error = result
        return self._answer(error(502, f"backend failed before responding: {last_error}",
                                  code="backend_unavailable"))

    async def _attempt(self, b: Backend, path: str, raw: bytes, headers: dict[str, str],
                       stream: bool, last_try: bool) -> Response | str:
        """One try on one backend: a Response to return, or an error text to retry on."""
        client = self.router.client
        started = time.monotonic()
        req = client.build_request("POST", b.url + path, content=raw, headers=headers)
        try:
            resp = await client.send(req, stream=True)
        except httpx.TransportError as exc:
            self._observe_failure(b)
            self.router.release(b)
            return await self._failed(b, exc, "sending the request")
        except BaseException:  # cancelled (the client left): httpx closes the connection, the backend aborts
            self.router.release(b)
            raise
        if resp.status_code >= 500:
            self.router.pool.report_suspect(b, f"HTTP {resp.status_code}")
        if resp.status_code in _RETRY_STATUS and not last_try and len(self.router.candidates({b.url})) > 0:
            await resp.aclose()
            if resp.status_code >= 500:
                self._observe_failure(b)
            self.router.release(b)
            return f"{b.endpoint}: HTTP {resp.status_code}"
        is_sse = resp.headers.get("content-type", "").startswith("text/event-stream")
        if not (stream and is_sse):
            try:
                content = await resp.aread()
            except httpx.TransportError as exc:
                self._observe_failure(b)
                await resp.aclose()
                self.router.release(b)
                return await self._failed(b, exc, "reading the answer")
            except BaseException:  # cancelled (the client left): the connection closes, the backend aborts
                await resp.aclose()
                self.router.release(b)
                raise
            await resp.aclose()
            self.router.release(b)
            if self.canary is not None:
                self.canary.observe_response(b.endpoint, resp.status_code, content, started)
            if self._responses_api(path, resp.status_code):
                rid = response_id_of_body(content)
                if rid is not None:
                    self.router.sessions.learn_response(rid, b.url)
            return Response(content, resp.status_code, self._response_headers(resp, b))
        chunks = resp.aiter_raw()
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            first = b""
        except httpx.TransportError as exc:
            await resp.aclose()
            self._observe_failure(b)
            self.router.release(b)
            return await self._failed(b, exc, "before the first byte")
        except BaseException:
            await resp.aclose()
            self.router.release(b)
            raise
        meter = self.canary.meter(b.endpoint, started) if self.canary is not None else None
        sniffer = ResponseIdSniffer() if self._responses_api(path, resp.status_code) else None
        return StreamingResponse(self._relay(b, resp, first, chunks, meter, sniffer), resp.status_code,
                                 self._response_headers(resp, b))

    async def _failed(self, b: Backend, exc: httpx.TransportError, when: str) -> str:
        """A transport failure of one attempt: an error text to retry on, or Poisoned.

        Not sent: the backend is unreachable (out of rotation), the request innocent.
        Sent: the backend's health decides: dead means this request may be what
        killed it, so it must not reach another replica."""
        what = f"{b.endpoint}: {type(exc).__name__} {when}"
        if isinstance(exc, _NOT_SENT):
            self.router.pool.report_failure(b, what)
            return what
        if not await self.router.pool.probe(b):
            raise Poisoned(f"backend {b.endpoint} stopped answering while handling this request "
                           f"({type(exc).__name__} {when})")
        return what + " (the backend is alive)"

    @staticmethod
    def _responses_api(path: str, status: int) -> bool:
        """Whether an answer may name a stored Responses API response (its id is learned)."""
        return status == 200 and path.endswith("/responses")

    def _observe_failure(self, b: Backend) -> None:
        if self.canary is not None:
            self.canary.observe_failure(b.endpoint)

    async def _relay(self, b: Backend, resp: httpx.Response, first: bytes, chunks: AsyncIterator[bytes],
                     meter=None, sniffer: ResponseIdSniffer | None = None) -> AsyncIterator[bytes]:
        """The stream, chunk by chunk; a Responses API stream's id is learned from the chunk
        that completes its event, before that chunk reaches the client."""
        def seen(chunk: bytes) -> None:
            if meter is not None:
                meter.feed(chunk)
            rid = sniffer.feed(chunk) if sniffer is not None else None
            if rid is not None:
                self.router.sessions.learn_response(rid, b.url)

        last = first
        broken = False
        try:
            if first:
                seen(first)
                yield first
            async for chunk in chunks:
                last = chunk
                seen(chunk)
                yield chunk
        except httpx.HTTPError as exc:
            broken = True
            log.warning("stream from %s broke after first byte: %s", b.url, exc)
            self.metrics.stream_errors.labels(b.url).inc()
            await self.router.pool.probe(b)  # out of rotation only if it is dead
            sep = b"" if last.endswith(b"\n\n") else b"\n\n"
            yield sep + sse_error(f"backend {b.endpoint} failed mid-stream: {type(exc).__name__}")
        finally:
            if meter is not None:
                meter.finish(error=broken or resp.status_code >= 500)
            await resp.aclose()
            self.router.release(b)


async def _disconnected(request: Request) -> None:
    """Returns once the client has hung up (the body was read already, by the body guard)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _http_error(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", None) or "error"
    kind = "invalid_request_error" if status < 500 else "server_error"
    code = {404: "not_found", 405: "method_not_allowed"}.get(status)
    return error(status, str(detail), kind, code)


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s", request.url.path)
    return error(500, f"internal error: {type(exc).__name__}", code="internal_error")


def build_app(router: Router, manage_router: bool = True) -> Starlette:
    """The HTTP app. With ``manage_router`` its lifespan starts/stops the router."""
    proxy = Proxy(router)
    routes = [
        Route("/v1/completions", proxy.generate, methods=["POST"]),
        Route("/v1/chat/completions", proxy.generate, methods=["POST"]),
        Route("/v1/responses", proxy.generate, methods=["POST"]),
        Route("/v1/responses/{response_id}", proxy.stored_response, methods=["GET", "DELETE"]),
        Route("/v1/responses/{response_id}/input_items", proxy.stored_response, methods=["GET"]),
        Route("/v1/messages", proxy.generate, methods=["POST"]),
        Route("/v1/messages/count_tokens", proxy.generate, methods=["POST"]),
        Route("/v1/models", proxy.models, methods=["GET"]),
        Route("/health", proxy.health, methods=["GET"]),
        Route("/metrics", proxy.metrics_endpoint, methods=["GET"]),
        Route("/router/backends", proxy.backends, methods=["GET"]),
    ]
    if router.canary is not None:
        from .canary.admin import split_routes

        routes += split_routes(router)

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: Starlette):
        if manage_router:
            await router.start()
        try:
            yield
        finally:
            if manage_router:
                await router.stop()

    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware

    config = router.config
    guard = Middleware(BodyGuard, limit=lambda: config.max_request_bytes, timeout=lambda: config.request_read_timeout,
                       draining=lambda: False,
                       on_reject=lambda reason: router.metrics.responses.labels(reason).inc())
    return Starlette(routes=routes, lifespan=lifespan, middleware=[guard],
                     exception_handlers={HTTPException: _http_error, Exception: _unexpected})

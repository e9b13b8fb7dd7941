"""OpenAI-compatible reverse proxy in front of the backends.

Streams pass through chunk by chunk: the backend's bytes are relayed as they
arrive, never re-framed or buffered. Failure handling follows what a client
can tolerate:

- connect failure, or a failure before the first byte (including a 429 or
  502/503/504 answer): retried once on another backend; the failed one leaves
  rotation if it could not be reached; on the last try such an answer is
  passed through as it is;
- a stream that breaks after its first byte: the client gets an SSE error
  event and the stream ends (no hang, no silent truncation);
- non-streaming responses are read whole before answering, so any failure
  there counts as "before the first byte".
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from typing import AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..entrypoints.console_auth import bearer_token
from .backend import Backend
from .core import NoBackendError, Router, ShedError
from .sessions import response_id_in, session_key

log = logging.getLogger("tokenmill.router")

_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
        "proxy-authorization", "proxy-connection", "accept-encoding", "trailer"}
_RESP_DROP = {"content-length", "connection", "keep-alive", "transfer-encoding", "content-encoding",
              "date", "server", "trailer"}
# A replica that is shedding (429) or failing (502-504) before any byte is
# worth one try elsewhere; on the last try its answer is passed through.
_RETRY_STATUS = {429, 502, 503, 504}


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
    def _authorized(self, request: Request) -> bool:
        key = self.router.config.api_key
        if not key:
            return True
        got = bearer_token(request.headers.get("authorization"))  # the scheme in any letter case
        if got is None and "x-api-key" in request.headers:  # Anthropic's clients send the key here
            got = request.headers["x-api-key"].encode("latin-1")
        return got is not None and hmac.compare_digest(hashlib.sha256(got).digest(),
                                                       hashlib.sha256(key.encode()).digest())

    def _forward_headers(self, request: Request) -> dict[str, str]:
        out = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
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
        headers = self._forward_headers(request)
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
        responses relayed); when unknown (another router, a restart), each ready replica in turn
        until one has it."""
        if not self._authorized(request):
            return self._answer(error(401, "invalid API key", "authentication_error", "invalid_api_key"))
        rid = request.path_params["response_id"]
        headers = self._forward_headers(request)
        home = self.router.sessions.home("response:" + rid)
        order = sorted(self.router.candidates(), key=lambda b: b.url != home)
        last: Response | None = None
        for b in order:
            try:
                r = await self.router.client.request(request.method, b.url + request.url.path, headers=headers)
            except httpx.TransportError as exc:
                self.router.pool.report_failure(b, f"{type(exc).__name__} on {request.method} response")
                continue
            last = Response(r.content, r.status_code, self._response_headers(r, b))
            if r.status_code != 404:
                return self._answer(last)
        if last is not None:
            return self._answer(last)
        return self._answer(error(503, "no ready backend", code="no_backend"))

    async def generate(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._answer(error(401, "invalid API key", "authentication_error", "invalid_api_key"))
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            return self._answer(error(400, "request body is not valid JSON", "invalid_request_error"))
        if not isinstance(body, dict):
            return self._answer(error(400, "request body must be a JSON object", "invalid_request_error"))
        path = request.url.path
        headers = self._forward_headers(request)
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
                                                   session=session_key(request.headers, body))
            except NoBackendError:
                if last_error:
                    return self._answer(error(502, f"backend failed before responding: {last_error}",
                                              code="backend_unavailable"))
                return self._answer(error(503, "no ready backend", code="no_backend"))
            except ShedError:
                return self._answer(error(429, "all backends are saturated; retry later",
                                          "rate_limit_error", "overloaded"))
            b = decision.backend
            tried.add(b.url)
            if attempt:
                self.metrics.retries.inc()
            result = await self._attempt(b, path, raw, headers, stream, last_try=attempt == 1)
            if isinstance(result, Response):
                if self.canary is not None:
                    result.headers["x-tokenmill-variant"] = self.canary.variant_of(b.endpoint) or ""
                return self._answer(result)
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
            self.router.pool.report_failure(b, f"{type(exc).__name__}: {exc}")
            return f"{b.endpoint}: {type(exc).__name__}"
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
                self.router.pool.report_failure(b, f"{type(exc).__name__} reading body")
                return f"{b.endpoint}: {type(exc).__name__}"
            finally:
                await resp.aclose()
                self.router.release(b)
            if self.canary is not None:
                self.canary.observe_response(b.endpoint, resp.status_code, content, started)
            self._learn_response(path, resp.status_code, content, b)
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
            self.router.pool.report_failure(b, f"{type(exc).__name__} before first byte")
            return f"{b.endpoint}: {type(exc).__name__}"
        except BaseException:
            await resp.aclose()
            self.router.release(b)
            raise
        self._learn_response(path, resp.status_code, first, b)  # response.created comes first
        meter = self.canary.meter(b.endpoint, started) if self.canary is not None else None
        return StreamingResponse(self._relay(b, resp, first, chunks, meter), resp.status_code,
                                 self._response_headers(resp, b))

    def _learn_response(self, path: str, status: int, content: bytes, b: Backend) -> None:
        """Remember which replica produced a Responses API id: its continuation
        (``previous_response_id``) and its GET/DELETE go there."""
        if status == 200 and path.endswith("/responses"):
            rid = response_id_in(content)
            if rid is not None:
                self.router.sessions.learn_response(rid, b.url)

    def _observe_failure(self, b: Backend) -> None:
        if self.canary is not None:
            self.canary.observe_failure(b.endpoint)

    async def _relay(self, b: Backend, resp: httpx.Response, first: bytes,
                     chunks: AsyncIterator[bytes], meter=None) -> AsyncIterator[bytes]:
        last = first
        broken = False
        try:
            if first:
                if meter is not None:
                    meter.feed(first)
                yield first
            async for chunk in chunks:
                last = chunk
                if meter is not None:
                    meter.feed(chunk)
                yield chunk
        except httpx.HTTPError as exc:
            broken = True
            log.warning("stream from %s broke after first byte: %s", b.url, exc)
            self.metrics.stream_errors.labels(b.url).inc()
            self.router.pool.report_failure(b, f"stream broke: {type(exc).__name__}")
            sep = b"" if last.endswith(b"\n\n") else b"\n\n"
            yield sep + sse_error(f"backend {b.endpoint} failed mid-stream: {type(exc).__name__}")
        finally:
            if meter is not None:
                meter.finish(error=broken or resp.status_code >= 500)
            await resp.aclose()
            self.router.release(b)


def build_app(router: Router, manage_router: bool = True) -> Starlette:
    """The HTTP app. With ``manage_router`` its lifespan starts/stops the router."""
    proxy = Proxy(router)
    routes = [
        Route("/v1/completions", proxy.generate, methods=["POST"]),
        Route("/v1/chat/completions", proxy.generate, methods=["POST"]),
        Route("/v1/responses", proxy.generate, methods=["POST"]),
        Route("/v1/responses/{response_id}", proxy.stored_response, methods=["GET", "DELETE"]),
        Route("/v1/messages", proxy.generate, methods=["POST"]),
        Route("/v1/messages/count_tokens", proxy.generate, methods=["POST"]),
        Route("/v1/models", proxy.models, methods=["GET"]),
        Route("/health", proxy.health, methods=["GET"]),
        Route("/metrics", proxy.metrics_endpoint, methods=["GET"]),
        Route("/router/backends", proxy.backends, methods=["GET"]),
    ]
    if router.canary is not None:
        from .admin import split_routes

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

    return Starlette(routes=routes, lifespan=lifespan)

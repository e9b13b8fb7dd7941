"""The OpenAI-compatible HTTP app: ``build_app(async_engine, settings)``, its routes and middleware.

Routes: ``/v1/completions`` and ``/v1/chat/completions`` (openai_routes.py),
``/v1/models``, ``/health``, ``/metrics``, ``/tokenize``, ``/detokenize``,
``/reset_prefix_cache``. In front of everything, auth.py's middleware checks
the API key on every route but a listed few (before the body is even parsed,
so a bad key is a 401 whatever the body); the key is either
``Authorization: Bearer KEY`` (or ``x-api-key: KEY``, as Anthropic's clients send
it) or the web console's session cookie
(console_auth.py; cookie-authenticated writes must come from the server's
own origin). Behind it a plain ASGI middleware refuses new work with 503
while draining after SIGTERM, and counts requests in flight so shutdown can
wait for them. Starting, draining and stopping a process around the app is
lifecycle.py's job.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from ...engine.async_engine import AsyncEngine
from .metrics import CONTENT_TYPE
from .auth import AuthMiddleware, route_path
from ..console.console_auth import ConsoleSessions
from .errors import APIError, error_body, install_error_handlers
from ..openai.openai_routes import ChatRender, encode, get_state, render_chat_async, router
from ..openai.protocol import (DetokenizeRequest, DetokenizeResponse, ErrorResponse, ModelCard, ModelList,
                       TokenizeRequest, TokenizeResponse)
from ..openai.request_fields import ignored_headers, judge_extra
from ...gateway.request_guard import BodyGuard, default_body_limit
from .heap import trim_heap
from .model_set import LEASES_KEY, ModelSet, ModelSetState, model_cards
from .serving import ServerSettings, ServerShared, ServerState, model_not_found
from ...gateway.tenants import is_operator, tenant_of

_ALWAYS_OPEN = ("/health", "/metrics", "/docs", "/openapi.json", "/ping")  # answered while draining


class GateMiddleware:
    """Drain refusal and in-flight count, before routing (the API key is auth.py's, in front of this)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def _reject(self, send: Send, status: int, message: str, code: str,
                      headers: dict[str, str] | None = None) -> None:
        body = json.dumps(error_body(status, message, code=code)).encode()
        raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        if self.state.draining and not path.startswith(_ALWAYS_OPEN):
            self.state.metrics.rejected.labels("draining").inc()
            await self._reject(send, 503, "the server is shutting down", "shutting_down", {"Retry-After": "5"})
            return
        if self.state.loop is None:
            self.state.loop = asyncio.get_running_loop()  # for the shutdown thread's calls
        self.state.inflight_http += 1
        leases: list[Callable[[], None]] = []  # models this request holds in memory (model_set.py)
        scope[LEASES_KEY] = leases
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.inflight_http -= 1
            for release in leases:  # the response is sent: its model may be unloaded again
                release()


def build_app(async_engine: AsyncEngine, settings: ServerSettings | None = None) -> FastAPI:
    """A FastAPI app over a running AsyncEngine.

    The caller owns the engine (and ``app.state.tokenmill.close()``): test
    clients run the lifespan once per client, which must not stop the engine."""
    settings = settings or ServerSettings()
    return _assemble(ServerState(async_engine, settings), settings)


def build_model_set_app(models: ModelSet, settings: ServerSettings, shared: ServerShared | None = None) -> FastAPI:
    """The same app over several models, each loaded when a request first names it (model_set.py);
    ``shared``: the tenants and tracer the set's loader gives each model (None: made here).

    The caller owns the set (``app.state.tokenmill.close()`` unloads every model)."""
    return _assemble(ModelSetState(models, settings, shared), settings)


def _assemble(state: Any, settings: ServerSettings) -> FastAPI:
    """Routes and middleware around the server's state: a ``ServerState`` (one model) or a
    ``ModelSetState`` (several); routes that name a model ask it ``serving_for(model)``."""
    app = FastAPI(title="tokenmill", version="0.1.0",
                  description="OpenAI-compatible LLM server (completions, chat, streaming, metrics).")
    app.state.tokenmill = state
    install_error_handlers(app)
    app.include_router(router)
    from ..openai.responses_api import router as responses_router

    app.include_router(responses_router)
    from ..anthropic.anthropic_api import AnthropicErrors, router as messages_router
    from ..openai.response_store import ResponseStore

    app.state.response_store = ResponseStore(settings.responses_store_size, settings.responses_store_bytes)
    app.include_router(messages_router)
    from .adapter_routes import router as adapter_router

    app.include_router(adapter_router)
    _misc_routes(app)
    # one session store for the gate and the console's login routes (console.py)
    app.state.console_sessions = sessions = ConsoleSessions(settings.api_key)
    # inside the gate: the key is checked before a byte of the body is read
    app.add_middleware(BodyGuard, limit=lambda: state.settings.max_request_bytes or default_body_limit(
        state.max_model_len), timeout=lambda: state.settings.request_read_timeout_s,
        draining=lambda: state.draining, on_reject=lambda reason: state.metrics.rejected.labels(reason).inc(),
        after_large_body=trim_heap)
    app.add_middleware(GateMiddleware, state=state)
    # in front of every route: deny by default, judged on the route path (auth.py)
    app.add_middleware(AuthMiddleware, sessions=sessions, tenants=state.tenants,
                       on_reject=lambda: state.metrics.rejected.labels("auth").inc())
    from .request_id import RequestIdMiddleware

    app.add_middleware(RequestIdMiddleware)  # outermost: 401s and 503s carry the id too
    app.add_middleware(AnthropicErrors)  # /v1/messages errors in Anthropic's shape, whoever raised them
    if state.tracing is not None:  # off: not in the stack at all
        from ...gateway.tracing import TracingMiddleware

        app.add_middleware(TracingMiddleware, tracing=state.tracing)
    return app


_ERRORS: dict[int | str, dict[str, Any]] = {c: {"model": ErrorResponse} for c in (400, 401, 404)}


def _misc_routes(app: FastAPI) -> None:
    """The routes besides the generation APIs: models, status, tokens, the prefix cache."""
    _model_routes(app)
    _status_routes(app)
    _token_routes(app)
    _cache_routes(app)


def _model_routes(app: FastAPI) -> None:
    """``/v1/models`` and ``/v1/models/{id}``: the models and adapters the caller may use."""

    def cards(request: Request) -> list[dict[str, Any]]:
        """The cards the caller may see. ``root`` is a name, never the folder or file a model
        or adapter was read from: a card shows a tenant nothing of the server's disk."""
        state, caller = get_state(request), tenant_of(request.scope)
        if isinstance(state, ModelSetState):
            return list(model_cards(state.models, show_errors=is_operator(caller)))
        from .adapter_routes import adapter_cards

        return [{"id": name, "root": name, "max_model_len": state.max_model_len}
                for name in state.settings.served_model_names] + adapter_cards(state, caller)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models(request: Request) -> ModelList:
        return ModelList(data=[ModelCard(**card) for card in cards(request)])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERRORS)
    async def get_model(model_id: str, request: Request) -> ModelCard:
        known = cards(request)
        for card in known:
            if card["id"] == model_id:
                return ModelCard(**card)
        raise model_not_found(model_id, [card["id"] for card in known])


def _status_routes(app: FastAPI) -> None:
    """``/health``, ``/metrics`` and ``/v1/usage``."""

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health(request: Request) -> Response:
        state = get_state(request)
        if state.draining:
            return JSONResponse(error_body(503, "shutting down", code="shutting_down"), status_code=503)
        for model in state.loaded_states():  # a server of several: each model in memory
            engine = model.aengine
            silent = time.monotonic() - engine.last_heartbeat
            if not engine.is_alive:
                return JSONResponse(error_body(503, "the engine loop is not running", code="engine_dead"),
                                    status_code=503)
            if silent > state.settings.heartbeat_timeout_s:
                return JSONResponse(error_body(503, f"the engine loop has been silent for {silent:.0f}s",
                                               code="engine_stalled"), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(get_state(request).metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/usage")
    async def usage(request: Request) -> JSONResponse:
        """Usage per tenant (tenant_usage.py): a tenant sees its own, the operator
        (tenants.is_operator: an --api-key key, or a server without keys) every tenant's."""
        state = get_state(request)
        tenant = tenant_of(request.scope)
        only = None if is_operator(tenant) else tenant.name  # type: ignore[union-attr]
        return JSONResponse({"object": "usage", "tenants": state.usage.snapshot(only)})


def _token_routes(app: FastAPI) -> None:
    """``/tokenize`` and ``/detokenize`` with the served model's tokenizer."""

    @app.post("/tokenize", response_model=TokenizeResponse, response_model_exclude_none=True, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest, request: Request) -> Response:
        state = await get_state(request).serving_for(body.model, request.scope)
        headers = ignored_headers(judge_extra(body.model_extra, "tokenize"))
        if body.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            how = ChatRender(body.add_generation_prompt and not body.continue_final_message, tools,
                             continue_final_message=body.continue_final_message,
                             variables=dict(body.chat_template_kwargs or {}))
            text = await render_chat_async(state, body.messages, how)
            ids = await encode(state, text, False)
        else:
            ids = await encode(state, body.prompt or "", body.add_special_tokens)
        out = TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids)
        if body.return_token_strs:
            out.token_strs = [state.tokenizer.id_to_token(t) or "" for t in ids]
        return JSONResponse(out.model_dump(exclude_none=True), headers=headers)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
        state = await get_state(request).serving_for(body.model, request.scope)
        headers = ignored_headers(judge_extra(body.model_extra, "detokenize"))
        bad = next((t for t in body.tokens if not 0 <= t < state.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"tokens: token id {bad} is out of range [0, {state.vocab_size})", param="tokens")
        return JSONResponse({"prompt": state.tokenizer.decode(body.tokens)}, headers=headers)


def _cache_routes(app: FastAPI) -> None:
    """``/reset_prefix_cache``: every loaded model drops its idle cached blocks."""

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> JSONResponse:
        freed, enabled = 0, False
        for state in get_state(request).loaded_states():  # a server of several: each model in memory
            freed += int(await state.aengine.call(lambda engine: engine.reset_prefix_cache()))
            enabled = enabled or state.engine.stats.prefix_cache_enabled
        return JSONResponse({"freed_blocks": freed, "enabled": enabled})


def add_cors(app: FastAPI, origins: list[str] | None, allow_credentials: bool = False) -> None:
    """CORS headers for the browser origins --allowed-origins names (none: no CORS).
    Added last, so preflight requests are answered before the API-key gate."""
    if not origins:
        return
    from starlette.middleware.cors import CORSMiddleware

    app.add_middleware(CORSMiddleware, allow_origins=origins, allow_credentials=allow_credentials,
                       allow_methods=["*"], allow_headers=["*"])

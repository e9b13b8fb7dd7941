"""The OpenAI-compatible HTTP server: ``build_app(async_engine, settings)`` and ``run_server(args)``.

Routes: ``/v1/completions`` and ``/v1/chat/completions`` (openai_routes.py),
``/v1/models``, ``/health``, ``/metrics``, ``/tokenize``, ``/detokenize``,
``/reset_prefix_cache``. A plain ASGI middleware in front of everything
checks the API key (before the body is even parsed, so a bad key is a 401
whatever the body), refuses new work with 503 while draining after SIGTERM,
and counts requests in flight so shutdown can wait for them. The key is
either ``Authorization: Bearer KEY`` or the web console's session cookie
(console_auth.py; cookie-authenticated writes must come from the server's
own origin).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from ..engine.async_engine import AsyncEngine
from ..metrics import CONTENT_TYPE
from .console_auth import ConsoleSessions
from .errors import APIError, error_body, install_error_handlers
from .openai_routes import encode, get_state, render_chat, router
from .protocol import (DetokenizeRequest, DetokenizeResponse, ErrorResponse, ModelCard, ModelList,
                       TokenizeRequest, TokenizeResponse)
from .serving import ServerSettings, ServerState

log = logging.getLogger("tokenmill.server")

_PROTECTED = ("/v1/", "/tokenize", "/detokenize", "/reset_prefix_cache")
_ALWAYS_OPEN = ("/health", "/metrics", "/docs", "/openapi.json", "/ping")


class GateMiddleware:
    """API key, drain refusal and in-flight count, before routing."""

    def __init__(self, app: ASGIApp, state: ServerState, sessions: ConsoleSessions | None = None) -> None:
        self.app = app
        self.state = state
        self.sessions = sessions if sessions is not None else ConsoleSessions(state.settings.api_key)

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
        path: str = scope.get("path", "")
        if self.sessions.enabled and path.startswith(_PROTECTED):
            verdict = self.sessions.check(scope)
            if verdict == "unauthorized":
                self.state.metrics.rejected.labels("auth").inc()
                await self._reject(send, 401, "missing or incorrect API key (send 'Authorization: Bearer KEY')",
                                   "invalid_api_key", {"WWW-Authenticate": "Bearer"})
                return
            if verdict == "cross_origin":
                self.state.metrics.rejected.labels("auth").inc()
                await self._reject(send, 403, "cross-origin request with the console's session cookie refused "
                                   "(send 'Authorization: Bearer KEY')", "cross_origin")
                return
        if self.state.draining and not path.startswith(_ALWAYS_OPEN):
            self.state.metrics.rejected.labels("draining").inc()
            await self._reject(send, 503, "the server is shutting down", "shutting_down", {"Retry-After": "5"})
            return
        self.state.inflight_http += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.inflight_http -= 1


def build_app(async_engine: AsyncEngine, settings: ServerSettings | None = None) -> FastAPI:
    """A FastAPI app over a running AsyncEngine.

    The caller owns the engine (and ``app.state.tokenmill.close()``): test
    clients run the lifespan once per client, which must not stop the engine."""
    settings = settings or ServerSettings()
    state = ServerState(async_engine, settings)
    app = FastAPI(title="tokenmill", version="0.1.0",
                  description="OpenAI-compatible LLM server (completions, chat, streaming, metrics).")
    app.state.tokenmill = state
    install_error_handlers(app)
    app.include_router(router)
    _misc_routes(app)
    # one session store for the gate and the console's login routes (console.py)
    app.state.console_sessions = sessions = ConsoleSessions(settings.api_key)
    app.add_middleware(GateMiddleware, state=state, sessions=sessions)
    return app


def _misc_routes(app: FastAPI) -> None:
    errors: dict[int | str, dict[str, Any]] = {c: {"model": ErrorResponse} for c in (400, 401, 404)}

    @app.get("/v1/models", response_model=ModelList)
    async def list_models(request: Request) -> ModelList:
        state = get_state(request)
        root = state.settings.model_path
        return ModelList(data=[ModelCard(id=name, root=root, max_model_len=state.max_model_len)
                               for name in state.settings.served_model_names])

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health(request: Request) -> Response:
        state = get_state(request)
        engine = state.aengine
        silent = time.monotonic() - engine.last_heartbeat
        if state.draining:
            return JSONResponse(error_body(503, "shutting down", code="shutting_down"), status_code=503)
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

    @app.post("/tokenize", response_model=TokenizeResponse, responses=errors)
    async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
        # ``model`` is not checked: one tokenizer per server, and a 404 here would
        # make clients (the router, the load tester) conclude /tokenize is missing
        state = get_state(request)
        if body.messages is not None:
            text = render_chat(state, body.messages, body.add_generation_prompt)
            ids = await encode(state, text, False)
        else:
            ids = await encode(state, body.prompt or "", body.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=errors)
    async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
        state = get_state(request)
        bad = next((t for t in body.tokens if not 0 <= t < state.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"tokens: token id {bad} is out of range [0, {state.vocab_size})", param="tokens")
        return DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens))

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> JSONResponse:
        state = get_state(request)
        freed = await state.aengine.call(lambda engine: engine.reset_prefix_cache())
        return JSONResponse({"freed_blocks": int(freed),
                             "enabled": state.engine.prefix_cache is not None})


# ---- running it -------------------------------------------------------------

def _settings_from_args(args: Any) -> ServerSettings:
    names = args.served_model_name or [_default_model_name(args.model)]
    model_path = args.model
    if model_path is None:
        from ..model.bundled import default_model_path

        model_path = default_model_path()
    return ServerSettings(
        served_model_names=list(names), model_path=model_path,
        api_key=args.api_key or os.environ.get("TOKENMILL_API_KEY") or None,
        max_waiting=args.max_waiting, max_output_tokens=args.max_output_tokens, log_requests=args.log_requests,
        capture_path=args.capture_traffic, capture_text=args.capture_text,
        grace_period_s=args.shutdown_grace)


def _default_model_name(path: str | None) -> str:
    if path is None:
        from ..model.bundled import default_model_path

        path = default_model_path()
    base = os.path.basename(os.path.normpath(path))
    for suffix in (".gguf", ".GGUF"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
    return base


def engine_config_from_args(args: Any) -> Any:
    from ..config import EngineConfig

    options: dict[str, Any] = dict(model=args.model, dtype=args.dtype, device=args.device,
                                   block_size=args.block_size, enable_prefix_caching=not args.no_prefix_caching,
                                   max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                   batching=args.batching, quantization=args.quantization,
                                   max_waiting=args.max_waiting)
    for key in ("kv_cache_memory", "max_model_len", "num_blocks", "memory_budget", "quant_group_size",
                "quantize_lm_head", "num_threads", "speculative_config", "tensor_parallel_size"):
        value = getattr(args, key, None)
        if value is not None:
            options[key] = value
    return EngineConfig.from_options(**options)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


class _DrainingServer:
    """uvicorn.Server whose first SIGTERM/SIGINT drains instead of stopping at once.

    Draining: new requests get 503 (and /health too, so balancers move
    away), running ones may finish for up to the grace period, then uvicorn
    shuts down (closing what is left) and the process exits 0. A second
    signal stops at once."""

    def __init__(self, config: Any, state: ServerState) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            def handle_exit(inner, sig: int, frame: Any) -> None:  # noqa: N805
                if state.draining or inner.should_exit:
                    inner.force_exit = inner.should_exit
                    inner.should_exit = True
                    return
                state.draining = True
                log.info("signal %s: draining (%d requests in flight, grace %.0fs)",
                         sig, state.inflight_http, state.settings.grace_period_s)
                threading.Thread(target=self._drain, args=(inner,), daemon=True).start()

        self.state = state
        self.server = Server(config)

    def _drain(self, server: Any) -> None:
        deadline = time.monotonic() + self.state.settings.grace_period_s
        while self.state.inflight_http > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.state.inflight_http > 0:
            log.warning("grace period over; closing %d requests", self.state.inflight_http)
        server.should_exit = True


def run_server(args: Any) -> int:
    """Load the model, start the engine loop and serve until SIGTERM/SIGINT."""
    import uvicorn

    from ..engine.engine import LLMEngine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = _settings_from_args(args)
    config = engine_config_from_args(args)
    engine = LLMEngine(config)
    aengine = AsyncEngine(engine)
    app = build_app(aengine, settings)
    # /v1/engine/stats always; the web console at GET / unless --no-ui (entrypoints/console.py)
    from .console import mount_console
    mount_console(app, ui=not getattr(args, "no_ui", False))
    state: ServerState = app.state.tokenmill
    url = f"http://{args.host}:{args.port}"
    log.info("tokenmill serving model=%s (%s) dtype=%s quantization=%s weights=%s kv_pool=%d blocks x %d = %d tokens "
             "max_model_len=%d prefix_caching=%s url=%s", settings.served_model_names[0],
             args.model or "bundled SmolLM2-135M-Instruct", config.dtype, config.quantization,
             _human(engine.weight_bytes), engine.pool.num_blocks, engine.block_size, state.pool_tokens,
             engine.max_model_len, engine.prefix_cache is not None, url)
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                               timeout_graceful_shutdown=1, access_log=False)
    uv_server = _DrainingServer(uv_config, state).server
    if engine.parallel is not None:  # a dead tensor-parallel rank stops the server, non-zero
        from ..engine.distributed import supervise_server
        supervise_server(engine.parallel, aengine, uv_server)
    try:
        uv_server.run()
    finally:
        state.close()
        aengine.shutdown()
        engine.close()
    log.info("tokenmill stopped")
    if engine.parallel is not None and engine.parallel.failure is not None:
        log.error("exiting with status 1: %s", engine.parallel.failure)
        return 1
    return 0


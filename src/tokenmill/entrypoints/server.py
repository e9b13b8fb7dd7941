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

import asyncio
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
from .heap import HeapTrimmer, bound_onednn_caches, trim_heap
from .openai_routes import encode, get_state, render_chat_async, router
from .protocol import (DetokenizeRequest, DetokenizeResponse, ErrorResponse, ModelCard, ModelList,
                       TokenizeRequest, TokenizeResponse)
from .request_guard import BodyGuard, default_body_limit
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
        if self.state.loop is None:
            self.state.loop = asyncio.get_running_loop()  # for the shutdown thread's calls
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
    from .responses_api import router as responses_router

    app.include_router(responses_router)
    _misc_routes(app)
    # one session store for the gate and the console's login routes (console.py)
    app.state.console_sessions = sessions = ConsoleSessions(settings.api_key)
    # inside the gate: the key is checked before a byte of the body is read
    app.add_middleware(BodyGuard, limit=lambda: state.settings.max_request_bytes or default_body_limit(
        state.max_model_len), timeout=lambda: state.settings.request_read_timeout_s,
        draining=lambda: state.draining, on_reject=lambda reason: state.metrics.rejected.labels(reason).inc())
    app.add_middleware(GateMiddleware, state=state, sessions=sessions)
    from .request_id import RequestIdMiddleware

    app.add_middleware(RequestIdMiddleware)  # outermost: 401s and 503s carry the id too
    return app


def _misc_routes(app: FastAPI) -> None:
    errors: dict[int | str, dict[str, Any]] = {c: {"model": ErrorResponse} for c in (400, 401, 404)}

    @app.get("/v1/models", response_model=ModelList)
    async def list_models(request: Request) -> ModelList:
        state = get_state(request)
        root = state.settings.model_path
        return ModelList(data=[ModelCard(id=name, root=root, max_model_len=state.max_model_len)
                               for name in state.settings.served_model_names])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=errors)
    async def get_model(model_id: str, request: Request) -> ModelCard:
        state = get_state(request)
        if model_id not in state.settings.served_model_names:
            raise APIError(404, f"the model {model_id!r} does not exist (served: "
                           f"{', '.join(state.settings.served_model_names)})", param="model",
                           code="model_not_found")
        return ModelCard(id=model_id, root=state.settings.model_path, max_model_len=state.max_model_len)

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
            text = await render_chat_async(state, body.messages, body.add_generation_prompt)
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
    keys = args.api_key or [k for k in (os.environ.get("TOKENMILL_API_KEY"), os.environ.get("VLLM_API_KEY")) if k]
    from .serve_cli import generation_defaults

    return ServerSettings(
        served_model_names=list(names), model_path=model_path,
        api_key=(keys[0] if len(keys) == 1 else list(keys)) if keys else None,
        max_waiting=args.max_waiting, max_output_tokens=args.max_output_tokens, log_requests=args.log_requests,
        capture_path=args.capture_traffic, capture_text=args.capture_text,
        capture_key=getattr(args, "capture_key", None) or os.environ.get("TOKENMILL_CAPTURE_KEY") or None,
        grace_period_s=args.shutdown_grace, max_request_bytes=getattr(args, "max_request_bytes", None),
        request_read_timeout_s=getattr(args, "request_read_timeout", 30.0),
        sampling_defaults=generation_defaults(getattr(args, "generation_config", "vllm"), model_path),
        enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
        tool_call_parser=getattr(args, "tool_call_parser", None))


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
    from .serve_cli import engine_options

    options = engine_options(args)
    options.update(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                   batching=args.batching, max_waiting=args.max_waiting, seed=getattr(args, "seed", 0))
    return EngineConfig.from_options(**options)


def tokenizer_from_args(args: Any) -> Any:
    """The tokenizer --tokenizer / --chat-template ask for, or None for the model's own."""
    tokenizer_path = getattr(args, "tokenizer", None)
    template = getattr(args, "chat_template", None)
    if tokenizer_path is None and template is None:
        return None
    from ..tokenizer import Tokenizer
    from .serve_cli import read_chat_template

    tok = Tokenizer.from_model_path(tokenizer_path or args.model)
    if template is not None:
        tok.chat_template = read_chat_template(template)
        tok.has_chat_template = True
    return tok


def add_cors(app: Any, origins: list[str] | None, allow_credentials: bool = False) -> None:
    """CORS headers for the browser origins --allowed-origins names (none: no CORS).
    Added last, so preflight requests are answered before the API-key gate."""
    if not origins:
        return
    from starlette.middleware.cors import CORSMiddleware

    app.add_middleware(CORSMiddleware, allow_origins=origins, allow_credentials=allow_credentials,
                       allow_methods=["*"], allow_headers=["*"])


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
        if self.state.inflight_http > 0 and self.state.loop is not None:
            # end what is left in-band (an SSE error event, a 503 body) rather than
            # letting uvicorn cancel the tasks mid-write
            log.warning("grace period over; ending %d requests", self.state.inflight_http)
            try:
                asyncio.run_coroutine_threadsafe(_cut_all(self.state), self.state.loop).result(5)
            except Exception:  # noqa: BLE001 - the loop is gone or stuck: uvicorn closes what is left
                log.warning("could not end the running requests in-band")
            deadline = time.monotonic() + _CUT_WAIT_S
            while self.state.inflight_http > 0 and time.monotonic() < deadline:
                time.sleep(0.05)
        server.should_exit = True


_CUT_WAIT_S = 5.0  # after the grace period: time for cut requests to send their last bytes


async def _cut_all(state: ServerState) -> int:
    return state.cut_all()


def run_server(args: Any) -> int:
    """Load the model, start the engine loop and serve until SIGTERM/SIGINT."""
    import uvicorn

    from ..engine.engine import LLMEngine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    bound_onednn_caches()  # before the model makes its first primitive (entrypoints/heap.py)
    settings = _settings_from_args(args)
    config = engine_config_from_args(args)
    if getattr(args, "enforce_eager", False):
        config.kernel_options = config.kernel_options.replace(cuda_graphs=False)
    tokenizer = tokenizer_from_args(args)  # None: the model's own
    engine = LLMEngine(config) if tokenizer is None else LLMEngine(config, tokenizer=tokenizer)
    aengine = AsyncEngine(engine)
    app = build_app(aengine, settings)
    # /v1/engine/stats always; the web console at GET / unless --no-ui (entrypoints/console.py)
    from .console import mount_console
    mount_console(app, ui=not getattr(args, "no_ui", False))
    add_cors(app, getattr(args, "allowed_origins", None), getattr(args, "allow_credentials", False))
    state: ServerState = app.state.tokenmill
    ssl = bool(getattr(args, "ssl_certfile", None))
    url = f"{'https' if ssl else 'http'}://{args.host}:{args.port}{getattr(args, 'root_path', '') or ''}"
    log.info("tokenmill serving model=%s (%s) dtype=%s quantization=%s weights=%s kv_pool=%d blocks x %d = %d tokens "
             "max_model_len=%d prefix_caching=%s url=%s", settings.served_model_names[0],
             args.model or "bundled SmolLM2-135M-Instruct", config.dtype, config.quantization,
             _human(engine.weight_bytes), engine.pool.num_blocks, engine.block_size, state.pool_tokens,
             engine.max_model_len, engine.prefix_cache is not None, url)
    level = getattr(args, "uvicorn_log_level", "warning")
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=level,
                               timeout_graceful_shutdown=1, access_log=level in ("info", "debug", "trace"),
                               root_path=getattr(args, "root_path", "") or "",
                               ssl_keyfile=getattr(args, "ssl_keyfile", None),
                               ssl_certfile=getattr(args, "ssl_certfile", None))
    uv_server = _DrainingServer(uv_config, state).server
    if engine.parallel is not None:  # a dead tensor-parallel rank stops the server, non-zero
        from ..engine.distributed import supervise_server
        supervise_server(engine.parallel, aengine, uv_server)
    # what loading freed (file buffers, dequantization scratch) goes back now, the rest of
    # what requests free every half minute (entrypoints/heap.py)
    trim_heap()
    trimmer = HeapTrimmer().start()
    try:
        uv_server.run()
    finally:
        trimmer.stop()
        state.close()
        aengine.shutdown()
        engine.close()
    log.info("tokenmill stopped")
    if engine.parallel is not None and engine.parallel.failure is not None:
        log.error("exiting with status 1: %s", engine.parallel.failure)
        return 1
    return 0


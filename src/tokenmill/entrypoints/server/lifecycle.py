"""A `tokenmill serve` process from start to exit: ``run_server(args)``.

Startup loads the engine and builds the app (app.py) from the parsed flags
(serve_config.py); the first SIGTERM/SIGINT drains (new requests get 503,
running ones get a grace period, then what is left is ended in-band); the
engine and its threads stop on the way out. With tensor parallelism a dead
rank stops the server too, and the process exits non-zero.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import logging
import signal
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from ...engine.async_engine import AsyncEngine
from ...engine.kv.kv_event_publisher import KVEventsConfig, attach_kv_events
from ...gateway.request_guard import HeaderDeadline, header_guarded_protocol
from .app import add_cors, build_app, build_model_set_app
from .heap import HeapTrimmer, bound_onednn_caches, trim_heap
from ..cli.serve_config import engine_config_from_args, settings_from_args, tokenizer_from_args
from .model_set import ModelSet, ModelSetOptions, ModelSpec, ResidentModel, model_settings
from .serving import ServerSettings, ServerShared, ServerState

if TYPE_CHECKING:
    import uvicorn

    from ...settings.config import EngineConfig
    from ...engine.engine import LLMEngine

log = logging.getLogger("tokenmill.server")

CUT_WAIT_S = 5.0  # after the grace period: time for cut requests to send their last bytes


class DrainingServer:
    """uvicorn.Server whose first SIGTERM/SIGINT drains instead of stopping at once.

    Draining: new requests get 503 (and /health too, so balancers move
    away), running ones may finish for up to the grace period, then uvicorn
    shuts down (closing what is left) and the process exits 0. A second
    signal stops at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
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

    def _drain(self, server: uvicorn.Server) -> None:
        deadline = time.monotonic() + self.state.settings.grace_period_s
        while self.state.inflight_http > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.state.inflight_http > 0 and self.state.loop is not None:
            # end what is left in-band (an SSE error event, a 503 body) rather than
            # letting uvicorn cancel the tasks mid-write
            log.warning("grace period over; ending %d requests", self.state.inflight_http)
            try:
                asyncio.run_coroutine_threadsafe(cut_all(self.state), self.state.loop).result(5)
            except Exception:  # noqa: BLE001 - the loop is gone or stuck: uvicorn closes what is left
                log.warning("could not end the running requests in-band")
            deadline = time.monotonic() + CUT_WAIT_S
            while self.state.inflight_http > 0 and time.monotonic() < deadline:
                time.sleep(0.05)
        server.should_exit = True


async def cut_all(state: ServerState) -> int:
    """End every running request in-band; run on the server's loop (from the drain thread)."""
    return state.cut_all()


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _start_engine(args: argparse.Namespace, config: EngineConfig) -> LLMEngine:
    from ...engine.engine import LLMEngine

    if getattr(args, "enforce_eager", False):  # vLLM's flag: no CUDA graphs
        config.kernel_options = config.kernel_options.replace(cuda_graphs=False)
    tokenizer = tokenizer_from_args(args)  # None: the model's own
    return LLMEngine(config) if tokenizer is None else LLMEngine(config, tokenizer=tokenizer)


def _log_startup(args: argparse.Namespace, settings: ServerSettings, config: EngineConfig, engine: LLMEngine,
                 state: ServerState) -> None:
    ssl = bool(getattr(args, "ssl_certfile", None))
    url = f"{'https' if ssl else 'http'}://{args.host}:{args.port}{getattr(args, 'root_path', '') or ''}"
    log.info("tokenmill serving model=%s (%s) dtype=%s quantization=%s weights=%s kv_pool=%d blocks x %d = %d tokens "
             "max_model_len=%d prefix_caching=%s url=%s", settings.served_model_names[0],
             args.model or "bundled SmolLM2-135M-Instruct", engine.config.dtype, engine.config.quantization,
             human_bytes(engine.weight_bytes), engine.stats.blocks_total, engine.block_size, state.pool_tokens,
             engine.max_model_len, engine.stats.prefix_cache_enabled, url)


def _uvicorn_config(args: argparse.Namespace, app: Any) -> uvicorn.Config:
    import uvicorn

    level = getattr(args, "uvicorn_log_level", "warning")
    # X-Forwarded-For names the client only when it comes from a proxy the operator trusts
    # (--forwarded-allow-ips); otherwise any client could pick its own address, and with it
    # its own row in the console's sign-in throttle. uvicorn would trust loopback by default.
    trusted = getattr(args, "forwarded_allow_ips", None)
    return uvicorn.Config(app, host=args.host, port=args.port, log_level=level, http=_http_protocol(app),
                          timeout_graceful_shutdown=1, access_log=level in ("info", "debug", "trace"),
                          proxy_headers=bool(trusted), forwarded_allow_ips=trusted or None,
                          root_path=getattr(args, "root_path", "") or "",
                          ssl_keyfile=getattr(args, "ssl_keyfile", None),
                          ssl_certfile=getattr(args, "ssl_certfile", None))


def _http_protocol(app: Any) -> type:
    """HTTP/1.1 with a deadline on each request's line and headers (gateway/request_guard.py): what
    --header-read-timeout and --max-pending-connections set; refusals count in the same
    ``tokenmill:requests_rejected`` series as the body guard's."""
    state = app.state.tokenmill
    return header_guarded_protocol(HeaderDeadline(
        timeout=lambda: state.settings.header_read_timeout_s, max_pending=state.settings.max_pending_connections,
        on_reject=lambda reason: state.metrics.rejected.labels(reason).inc()))


def model_loader(args: argparse.Namespace, settings: ServerSettings, shared: ServerShared,
                 resident_at_once: int) -> Callable[[ModelSpec], ResidentModel]:
    """How a server of several models loads one of them (on a model set's worker thread): the
    engine flags with this model's path, its own engine, KV pool and ``ServerState``. The KV pool
    flags (--kv-cache-memory, --num-blocks) size each model's pool; a memory budget
    (--memory-budget, --gpu-memory-utilization) is split evenly among the ``resident_at_once``
    models that may be in memory together."""
    from ..cli.serve_config import generation_defaults

    def load(spec: ModelSpec) -> ResidentModel:
        one = copy.copy(args)
        one.model = spec.path
        config = engine_config_from_args(one)
        if config.memory_budget is not None:
            config.memory_budget //= resident_at_once
        engine = _start_engine(one, config)
        aengine = AsyncEngine(engine)
        sampling = generation_defaults(getattr(args, "generation_config", "vllm"), spec.path)
        state = ServerState(aengine, model_settings(settings, spec, sampling), shared)
        log.info("model %s: dtype=%s quantization=%s weights=%s kv_pool=%d blocks x %d = %d tokens max_model_len=%d",
                 spec.name, engine.config.dtype, engine.config.quantization, human_bytes(engine.weight_bytes),
                 engine.stats.blocks_total, engine.block_size, state.pool_tokens, engine.max_model_len)

        def close() -> None:
            state.close()
            aengine.shutdown()
            engine.close()

        return ResidentModel(state, close)

    return load


def _model_set_app(args: argparse.Namespace, settings: ServerSettings) -> Any:
    """The app of a server of several models (none loaded yet: each loads on first use)."""
    specs = args.model_set
    options = ModelSetOptions(max_loaded=getattr(args, "max_loaded_models", None),
                              idle_unload_s=getattr(args, "idle_unload_seconds", None),
                              load_timeout_s=getattr(args, "model_load_timeout", 300.0),
                              max_waiters=getattr(args, "max_load_waiters", 64))
    shared = ServerShared.from_settings(settings)  # tenants, usage, tracer: one for every model
    resident_at_once = min(len(specs), options.max_loaded or len(specs))
    models = ModelSet(specs, model_loader(args, settings, shared, resident_at_once), options)
    app = build_model_set_app(models, settings, shared)
    log.info("tokenmill serving %d models, loaded on first use (at most %s in memory, idle unload %s): %s; "
             "url=http://%s:%s", len(specs), options.max_loaded or "all",
             f"{options.idle_unload_s:g}s" if options.idle_unload_s else "off",
             ", ".join(f"{s.name} ({s.path})" for s in specs), args.host, args.port)
    return app


def run_server(args: argparse.Namespace) -> int:
    """Load the model, start the engine loop and serve until SIGTERM/SIGINT."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    bound_onednn_caches()  # before the model makes its first primitive (entrypoints/server/heap.py)
    settings = settings_from_args(args)
    if getattr(args, "model_set", None):
        app = _model_set_app(args, settings)
        add_cors(app, getattr(args, "allowed_origins", None), getattr(args, "allow_credentials", False))
        return _serve(args, settings, app, app.state.tokenmill, lambda: None)
    return _serve_one(args, settings)


def _serve_one(args: argparse.Namespace, settings: ServerSettings) -> int:
    """One model, loaded now: its engine, the app over it, the console."""
    from ..console.console import mount_console

    config = engine_config_from_args(args)
    kv_events = KVEventsConfig.parse(getattr(args, "kv_events_config", None))  # before the model loads
    engine = _start_engine(args, config)
    aengine = AsyncEngine(engine)
    publisher = attach_kv_events(aengine, kv_events) if kv_events is not None else None
    app = build_app(aengine, settings)
    # /v1/engine/stats always; the web console at GET / unless --no-ui (entrypoints/console/console.py)
    mount_console(app, ui=not getattr(args, "no_ui", False))
    add_cors(app, getattr(args, "allowed_origins", None), getattr(args, "allow_credentials", False))
    state: ServerState = app.state.tokenmill
    _log_startup(args, settings, config, engine, state)

    def stop_engine() -> None:
        aengine.shutdown()
        if publisher is not None:
            publisher.close()
        engine.close()

    def supervise(uv_server: uvicorn.Server) -> None:
        if engine.parallel is not None:  # a dead tensor-parallel rank stops the server, non-zero
            from ...engine.step.distributed import supervise_server
            supervise_server(engine.parallel, aengine, uv_server)

    code = _serve(args, settings, app, state, stop_engine, supervise)
    if engine.parallel is not None and engine.parallel.failure is not None:
        log.error("exiting with status 1: %s", engine.parallel.failure)
        return 1
    return code


def _serve(args: argparse.Namespace, settings: ServerSettings, app: Any, state: Any, stop: Callable[[], None],
           supervise: Callable[[Any], None] | None = None) -> int:
    """Serve ``app`` until SIGTERM/SIGINT has drained it, then close ``state`` (a server of several
    models unloads them there) and ``stop`` what else runs."""
    uv_server = DrainingServer(_uvicorn_config(args, app), state).server
    if supervise is not None:
        supervise(uv_server)
    # what loading freed (file buffers, dequantization scratch) goes back now, the rest of
    # what requests free every half minute (entrypoints/server/heap.py)
    trim_heap()
    trimmer = HeapTrimmer().start()
    if settings.api_keys_file and hasattr(signal, "SIGHUP"):  # new keys and limits without a restart
        signal.signal(signal.SIGHUP, lambda *_: state.tenants.reload())
    try:
        uv_server.run()
    finally:
        trimmer.stop()
        state.close()
        stop()
    log.info("tokenmill stopped")
    return 0

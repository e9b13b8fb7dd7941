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
import logging
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

from ..engine.async_engine import AsyncEngine
from ..engine.kv_event_publisher import KVEventsConfig, attach_kv_events
from .app import add_cors, build_app
from .heap import HeapTrimmer, bound_onednn_caches, trim_heap
from .serve_config import engine_config_from_args, settings_from_args, tokenizer_from_args
from .serving import ServerSettings, ServerState

if TYPE_CHECKING:
    import uvicorn

    from ..config import EngineConfig
    from ..engine.engine import LLMEngine

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
    from ..engine.engine import LLMEngine

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
             human_bytes(engine.weight_bytes), engine.pool.num_blocks, engine.block_size, state.pool_tokens,
             engine.max_model_len, engine.prefix_cache is not None, url)


def _uvicorn_config(args: argparse.Namespace, app: Any) -> uvicorn.Config:
    import uvicorn

    level = getattr(args, "uvicorn_log_level", "warning")
    return uvicorn.Config(app, host=args.host, port=args.port, log_level=level,
                          timeout_graceful_shutdown=1, access_log=level in ("info", "debug", "trace"),
                          root_path=getattr(args, "root_path", "") or "",
                          ssl_keyfile=getattr(args, "ssl_keyfile", None),
                          ssl_certfile=getattr(args, "ssl_certfile", None))


def run_server(args: argparse.Namespace) -> int:
    """Load the model, start the engine loop and serve until SIGTERM/SIGINT."""
    from .console import mount_console

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    bound_onednn_caches()  # before the model makes its first primitive (entrypoints/heap.py)
    settings = settings_from_args(args)
    config = engine_config_from_args(args)
    kv_events = KVEventsConfig.parse(getattr(args, "kv_events_config", None))  # before the model loads
    engine = _start_engine(args, config)
    aengine = AsyncEngine(engine)
    publisher = attach_kv_events(aengine, kv_events) if kv_events is not None else None
    app = build_app(aengine, settings)
    # /v1/engine/stats always; the web console at GET / unless --no-ui (entrypoints/console.py)
    mount_console(app, ui=not getattr(args, "no_ui", False))
    add_cors(app, getattr(args, "allowed_origins", None), getattr(args, "allow_credentials", False))
    state: ServerState = app.state.tokenmill
    _log_startup(args, settings, config, engine, state)
    uv_server = DrainingServer(_uvicorn_config(args, app), state).server
    if engine.parallel is not None:  # a dead tensor-parallel rank stops the server, non-zero
        from ..engine.distributed import supervise_server
        supervise_server(engine.parallel, aengine, uv_server)
    # what loading freed (file buffers, dequantization scratch) goes back now, the rest of
    # what requests free every half minute (entrypoints/heap.py)
    trim_heap()
    trimmer = HeapTrimmer().start()
    if settings.api_keys_file and hasattr(signal, "SIGHUP"):  # new keys and limits without a restart
        signal.signal(signal.SIGHUP, lambda *_: state.tenants.reload())
    try:
        uv_server.run()
    finally:
        trimmer.stop()
        state.close()
        aengine.shutdown()
        if publisher is not None:
            publisher.close()
        engine.close()
    log.info("tokenmill stopped")
    if engine.parallel is not None and engine.parallel.failure is not None:
        log.error("exiting with status 1: %s", engine.parallel.failure)
        return 1
    return 0

"""Run the router: HTTP proxy (always) and the ext_proc gRPC server (EPP mode).

Both share one event loop and one Router. ``RouterServer.start_in_thread``
runs the whole thing on a background thread, which the tests and the
benchmark use to drive a real router over loopback.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time

import uvicorn

from ..gateway.request_guard import HeaderDeadline, header_guarded_protocol
from .config import RouterConfig
from .core import Router
from .proxy import build_app

log = logging.getLogger("tokenmill.router")


class RouterServer:
    def __init__(self, config: RouterConfig, log_level: str = "warning") -> None:
        self.config = config
        self.router = Router(config)
        self.log_level = log_level
        self.grpc_port: int | None = None
        self._uvicorn: uvicorn.Server | None = None
        self._grpc = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    async def serve(self) -> None:
        c = self.config
        await self.router.start()
        try:
            if c.endpoint_picker:
                from .k8s.ext_proc import start_grpc

                self._grpc, _, self.grpc_port = await start_grpc(self.router, c.grpc_host or c.host, c.grpc_port)
                log.info("endpoint picker (ext_proc) on %s:%d", c.grpc_host or c.host, self.grpc_port)
            app = build_app(self.router, manage_router=False)
            # a deadline on each request's line and headers (gateway/request_guard.py), counted as the body guard's
            http = header_guarded_protocol(HeaderDeadline(
                timeout=lambda: c.header_read_timeout, max_pending=c.max_pending_connections,
                on_reject=lambda reason: self.router.metrics.responses.labels(reason).inc()))
            uconf = uvicorn.Config(app, host=c.host, port=c.port, log_level=self.log_level, http=http,
                                   access_log=False, lifespan="on", timeout_graceful_shutdown=5)
            self._uvicorn = uvicorn.Server(uconf)
            watcher = asyncio.create_task(self._mark_started())
            await self._uvicorn.serve()
            watcher.cancel()
        finally:
            if self._grpc is not None:
                await self._grpc.stop(grace=1.0)
            await self.router.stop()

    async def _mark_started(self) -> None:
        while self._uvicorn is not None and not self._uvicorn.started:
            await asyncio.sleep(0.02)
        if self._uvicorn is not None and self.config.port == 0:
            # Bound to an ephemeral port: learn which one.
            for srv in self._uvicorn.servers:
                for sock in srv.sockets:
                    self.config.port = sock.getsockname()[1]
        self._started.set()

    # -- background thread (tests, benchmarks) ----------------------------
    def start_in_thread(self, timeout: float = 20.0) -> "RouterServer":
        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self.serve())
            except BaseException as exc:  # surfaced to the starting thread
                self._error = exc
                self._started.set()
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="tokenmill-router", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._started.wait(0.05):
            if time.monotonic() > deadline:
                raise TimeoutError("router did not start")
        if self._error:
            raise RuntimeError("router failed to start") from self._error
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def call(self, fn, *args):
        """Run ``fn(*args)`` on the router's loop thread and wait (tests inspect state this way)."""
        if self._loop is None:
            return fn(*args)
        fut = asyncio.run_coroutine_threadsafe(_call(fn, *args), self._loop)
        return fut.result(10)


async def _call(fn, *args):
    return fn(*args)

"""Helpers for the server tests (no tests here): tiny in-process apps, the placements
(tenant, class) a server hands its engine, a uvicorn thread, real `tokenmill serve`
subprocesses (one or several side by side), a Prometheus text reader, a /health prober
and a started SSE stream."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families

from conftest import tiny_loaded, tiny_tokenizer
from fake_backend import free_port


def make_tiny_app(engine_options: dict[str, Any] | None = None, **settings: Any) -> Any:
    """A FastAPI app over the tiny random model; ``app.state.tokenmill`` is the ServerState."""
    from tokenmill.settings.config import EngineConfig
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.engine.engine import LLMEngine
    from tokenmill.entrypoints.server.app import build_app
    from tokenmill.entrypoints.server.serving import ServerSettings

    opts = {"num_blocks": 128, "max_num_batched_tokens": 256}
    opts.update(engine_options or {})
    engine = LLMEngine(EngineConfig.from_options(**opts), loaded=tiny_loaded(), tokenizer=tiny_tokenizer())
    settings.setdefault("served_model_names", ["tiny"])
    return build_app(AsyncEngine(engine), ServerSettings(**settings))


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of samples called ``name`` whose labels include ``labels``."""
    total = 0.0
    found = False
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
                found = True
    if not found:
        raise KeyError(name)
    return total


def placements(monkeypatch, state) -> list:
    """Where each request the server hands the engine is placed (tenant, class), as it goes."""
    seen: list = []
    generate = state.aengine.generate

    def recording(request_id, prompt, params, placement=None, *args, **kwargs):
        seen.append((placement.tenant, placement.priority_class))
        return generate(request_id, prompt, params, placement, *args, **kwargs)

    monkeypatch.setattr(state.aengine, "generate", recording)
    return seen


class ThreadServer:
    """uvicorn serving an app in a background thread (real sockets, real disconnects)."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "ThreadServer":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def serve_command(*extra: str) -> list[str]:
    return [sys.executable, "-m", "tokenmill.entrypoints.cli.main", "serve", "--host", "127.0.0.1", *extra]


class RealServer:
    """A running `tokenmill serve` subprocess: ``url``, ``proc`` and its stderr ``lines``."""

    def __init__(self, url: str, proc: subprocess.Popen) -> None:
        self.url = url
        self.proc = proc
        self.lines: list[str] = []

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            self.lines.append(raw.decode(errors="replace").rstrip())


@contextmanager
def real_servers(*arg_lists: Sequence[str], startup_timeout: float = 180.0, env: dict[str, str] | None = None
                 ) -> Iterator[list[RealServer]]:
    """Several `tokenmill serve` processes with the bundled model, one per argument list, started
    together so they load side by side; yielded once all answer /health, killed on exit."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    servers: list[RealServer] = []
    try:
        for extra in arg_lists:
            port = free_port()
            proc = subprocess.Popen(serve_command("--port", str(port), *extra), env=full_env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            server = RealServer(f"http://127.0.0.1:{port}", proc)
            threading.Thread(target=server._drain, daemon=True).start()  # never let a full pipe block it
            servers.append(server)
        deadline = time.monotonic() + startup_timeout
        pending = list(servers)
        while pending:
            for server in list(pending):
                if server.proc.poll() is not None:
                    time.sleep(0.2)
                    raise RuntimeError(f"tokenmill serve exited with {server.proc.returncode}: "
                                       + "\n".join(server.lines[-30:]))
                try:
                    if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                        pending.remove(server)
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"tokenmill serve did not become healthy in {startup_timeout:.0f}s: "
                                   + "\n".join(pending[0].lines[-30:]))
            time.sleep(0.25)
        yield servers
    finally:
        for server in servers:
            if server.proc.poll() is None:
                server.proc.kill()
                server.proc.wait(10)


@contextmanager
def real_server(*extra: str, startup_timeout: float = 180.0, env: dict[str, str] | None = None
                ) -> Iterator[RealServer]:
    """`tokenmill serve` with the bundled model in a subprocess (killed on exit if still running)."""
    with real_servers(extra, startup_timeout=startup_timeout, env=env) as (server,):
        yield server


@contextmanager
def health_probe(url: str, interval_s: float = 0.01, timeout: float = 10.0) -> Iterator[list[float]]:
    """GET ``url``/health in a background thread while the block runs; yields the list the
    answers' latencies go into. On leaving, any answer other than 200 (or none at all) fails."""
    latencies: list[float] = []
    problems: list[str] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(timeout=timeout) as client:
            while not stop.is_set():
                t = time.perf_counter()
                try:
                    status = client.get(url + "/health").status_code
                except httpx.HTTPError as exc:
                    problems.append(repr(exc))
                    return
                if status != 200:
                    problems.append(f"/health answered {status}")
                latencies.append(time.perf_counter() - t)
                time.sleep(interval_s)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    try:
        yield latencies
    finally:
        stop.set()
        prober.join(30)
    assert not problems, problems[:3]


@contextmanager
def started_stream(client: httpx.Client, url: str, body: dict[str, Any]) -> Iterator[tuple[str, Iterator[str]]]:
    """POST a streaming request and wait for its first SSE event; yields that event's data
    and an iterator over the data of the events still to come (``[DONE]`` included)."""
    with client.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200, resp.read()
        events = (line[6:] for line in resp.iter_lines() if line.startswith("data: "))
        first = next(events)
        yield first, events

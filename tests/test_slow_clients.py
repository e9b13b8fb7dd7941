"""Clients that connect and stall before their request is whole (gateway/request_guard.py's header deadline):

- a connection that sends part of a request line and headers, then nothing, is closed with a
  408 once ``--header-read-timeout`` passes, while other connections are served meanwhile;
- one that sends nothing at all is closed quietly;
- a kept-alive connection idle longer than the deadline, and a stream that lasts longer, are
  not cut by it;
- past ``--max-pending-connections`` connections waiting for their headers, the one waiting
  longest is closed;

on a real router (in-process, over loopback, fake backends) and on a real `tokenmill serve`
(a subprocess over a tiny model)."""
from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import httpx
import pytest

from conftest import save_tiny_hf_folder
from fake_backend import FakeConfig, free_port, make_app
from test_server_support import real_servers
from tokenmill.router.config import RouterConfig
from tokenmill.router.server import RouterServer

STALLED = b"GET / HTTP/1.1\r\nHost: x\r\n"  # the request line and one header; the blank line never comes
DEADLINE_S = 1.0


def read_until_closed(sock: socket.socket, limit_s: float = 10.0) -> tuple[bytes, float]:
    """Everything the peer sends until it closes, and how long that took (``limit_s`` at most)."""
    started = time.monotonic()
    sock.settimeout(limit_s)
    reply = b""
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    except (socket.timeout, ConnectionResetError):
        pass
    return reply, time.monotonic() - started


def assert_408(reply: bytes) -> None:
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    head, body = reply.split(b"\r\n\r\n", 1)
    assert b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert {"message", "type", "param", "code"} <= set(error) and error["code"] == "request_timeout", error


def stalled_is_cut_while_others_are_served(port: int, served: Any) -> None:
    """A half-sent header is answered 408 and closed after the deadline; ``served()`` (a normal
    request on another connection) succeeds while it waits."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as stalled:
        stalled.sendall(STALLED)
        started = time.monotonic()
        served()
        reply, _ = read_until_closed(stalled)
        waited = time.monotonic() - started
    assert_408(reply)
    assert DEADLINE_S * 0.8 <= waited < DEADLINE_S + 5


def keep_alive_outlives_the_deadline(port: int, path: str) -> None:
    """Two requests on one connection, idle longer than the header deadline between them (uvicorn's
    keep-alive timeout, 5 s, is what bounds that idle time)."""
    request = f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        for _ in range(2):
            sock.sendall(request)
            reply = b""
            while b"\r\n\r\n" not in reply:
                data = sock.recv(65536)
                assert data, "closed before answering"
                reply += data
            assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
            head, rest = reply.split(b"\r\n\r\n", 1)
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            while len(rest) < length:
                rest += sock.recv(65536)
            time.sleep(DEADLINE_S * 1.5)


# ---- the router ---------------------------------------------------------------------------

class FakeBackend:
    """A fake backend in this process; its tokens take 30 ms each, so a stream of 60 lasts ~2 s."""

    def __init__(self) -> None:
        import uvicorn

        self.url = f"http://127.0.0.1:{free_port()}"
        app = make_app(FakeConfig(name="slow", decode_s_per_token=0.03))
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=int(self.url.rsplit(":", 1)[1]),
                                                    log_level="warning"))
        threading.Thread(target=self.server.run, daemon=True).start()
        while not self.server.started:
            time.sleep(0.02)


def start_router(backend: FakeBackend, **kw: Any) -> RouterServer:
    router = RouterServer(RouterConfig(backends=[backend.url], port=0, health_interval=0.5, **kw)).start_in_thread()
    deadline = time.monotonic() + 10
    while not all(b["healthy"] for b in httpx.get(router.url + "/router/backends").json()["backends"]):
        assert time.monotonic() < deadline, "the backend never became healthy"
        time.sleep(0.05)
    return router


@pytest.fixture(scope="module")
def backend():
    fake = FakeBackend()
    yield fake
    fake.server.should_exit = True


@pytest.fixture(scope="module")
def router(backend):
    server = start_router(backend, header_read_timeout=DEADLINE_S)
    yield server
    server.stop()


def test_router_closes_a_half_sent_header_with_408(router):
    def served() -> None:
        r = httpx.post(router.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text

    stalled_is_cut_while_others_are_served(router.config.port, served)
    text = httpx.get(router.url + "/metrics", timeout=10).text
    assert 'tokenmill_router_responses_total{code="header_timeout"}' in text


def test_router_closes_a_silent_connection_quietly(router):
    with socket.create_connection(("127.0.0.1", router.config.port), timeout=10) as silent:
        reply, waited = read_until_closed(silent)
    assert reply == b"" and DEADLINE_S * 0.8 <= waited < DEADLINE_S + 5


def test_router_keeps_alive_and_streams_past_the_deadline(router):
    keep_alive_outlives_the_deadline(router.config.port, "/health")
    started = time.monotonic()
    with httpx.stream("POST", router.url + "/v1/completions", timeout=30,
                      json={"prompt": "hello", "max_tokens": 60, "stream": True}) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert time.monotonic() - started > DEADLINE_S * 1.2  # it did outlast the deadline
    assert events[-1] == "data: [DONE]" and len(events) > 60  # every token came, and the end


def test_router_bounds_connections_waiting_for_headers(backend):
    router = start_router(backend, header_read_timeout=60.0, max_pending_connections=3)
    socks = [socket.create_connection(("127.0.0.1", router.config.port), timeout=10) for _ in range(5)]
    try:
        for sock in socks:
            sock.sendall(b"GET /health HTTP/1.1\r\n")
        for oldest in socks[:2]:  # the two that waited longest lost their places: closed
            reply, waited = read_until_closed(oldest)
            if reply:  # with a 408 when the server had read their bytes by then
                assert_408(reply)
            assert waited < 10
        for newer in socks[2:]:  # the rest still wait (their deadline is a minute away)
            newer.settimeout(0.2)
            with pytest.raises(socket.timeout):
                newer.recv(1)
        socks[-1].sendall(b"Host: x\r\n\r\n")  # and can still finish their request
        socks[-1].settimeout(10)
        assert socks[-1].recv(65536).startswith(b"HTTP/1.1 200")
    finally:
        for sock in socks:
            sock.close()
        router.stop()


# ---- tokenmill serve ------------------------------------------------------------------------

@pytest.mark.slow
def test_server_closes_a_half_sent_header_with_408(tmp_path):
    model = save_tiny_hf_folder(tmp_path / "tiny")
    flags = ["--model", model, "--dtype", "float32", "--quantization", "none", "--num-blocks", "64",
             "--max-num-batched-tokens", "256", "--header-read-timeout", str(DEADLINE_S)]
    with real_servers(flags) as (server,):
        port = int(server.url.rsplit(":", 1)[1])

        def served() -> None:
            r = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={"prompt": "hello", "max_tokens": 4, "ignore_eos": True})
            assert r.status_code == 200, r.text

        stalled_is_cut_while_others_are_served(port, served)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as silent:
            reply, waited = read_until_closed(silent)
        assert reply == b"" and waited < DEADLINE_S + 5
        keep_alive_outlives_the_deadline(port, "/health")
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        assert 'tokenmill:requests_rejected_total{reason="header_timeout"}' in metrics


def test_the_flags_are_checked():
    from tokenmill.entrypoints.cli.main import build_parser
    from tokenmill.entrypoints.cli.serve_cli import config_problems, finalize_serve_args
    from tokenmill.entrypoints.cli.serve_config import settings_from_args
    from tokenmill.router.cli import config_from_args

    args = build_parser().parse_args(["serve", "--header-read-timeout", "2.5", "--max-pending-connections", "7"])
    assert finalize_serve_args(args) is None and config_problems(args) == []
    settings = settings_from_args(args)
    assert (settings.header_read_timeout_s, settings.max_pending_connections) == (2.5, 7)
    bad = build_parser().parse_args(["serve", "--header-read-timeout", "0"])
    assert any("--header-read-timeout must be a positive" in p for p in config_problems(bad))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-pending-connections", "0"])
    route = build_parser().parse_args(["route", "--backend", "http://127.0.0.1:1", "--header-read-timeout", "3",
                                       "--max-pending-connections", "9"])
    config = config_from_args(route)
    assert (config.header_read_timeout, config.max_pending_connections) == (3.0, 9)
    config.validate()
    for field, value in (("header_read_timeout", 0.0), ("max_pending_connections", 0)):
        with pytest.raises(ValueError, match="--header-read-timeout and --max-pending-connections"):
            RouterConfig(backends=["http://127.0.0.1:1"], **{field: value}).validate()

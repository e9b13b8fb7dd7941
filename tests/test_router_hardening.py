"""The router under hostile input, three replicas (fake backends; one real check, slow):

- bodies: its own size limit (413) and read deadline (408); every bad body, 5,000-deep JSON
  included, gets an OpenAI-shaped JSON error;
- a backend's 413 (the body over *its* limit) is passed through and never takes it out of
  rotation, while other clients keep being served;
- poison: a request that kills the backend handling it is refused with 502, not replayed on
  the next replica;
- a non-streaming client that hangs up aborts the backend's work;
- with real replicas: a grammar bomb through the router leaves all three alive."""
from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import httpx
import pytest

from fake_backend import CRASH_WORD, FakeConfig, free_port, make_app, start_fakes
from tokenmill.gateway.request_guard import BodyGuard
from tokenmill.router.config import RouterConfig
from tokenmill.router.server import RouterServer

BACKEND_LIMIT = 64 << 10


def _router(urls: list[str], **kw: Any) -> RouterServer:
    kw.setdefault("health_interval", 0.5)
    kw.setdefault("policy", "round-robin")
    return RouterServer(RouterConfig(backends=urls, port=0, **kw)).start_in_thread()


def _state(router: RouterServer) -> dict[str, dict]:
    return {b["url"]: b for b in httpx.get(router.url + "/router/backends").json()["backends"]}


def _metric(router: RouterServer, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(router.url + "/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _json_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert {"message", "type", "param", "code"} <= set(err) and err["message"], err
    return err


class GuardedFakes:
    """Fake backends in this process, each behind the server's body guard (a 64 KiB limit)."""

    def __init__(self, n: int) -> None:
        import uvicorn

        self.servers = []
        for i in range(n):
            app = BodyGuard(make_app(FakeConfig(name=f"g{i}", decode_s_per_token=0.001)),
                            limit=lambda: BACKEND_LIMIT, timeout=lambda: 5.0, draining=lambda: False)
            port = free_port()
            server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
            threading.Thread(target=server.run, daemon=True).start()
            self.servers.append((server, f"http://127.0.0.1:{port}"))
        for server, _ in self.servers:
            while not server.started:
                time.sleep(0.02)

    @property
    def urls(self) -> list[str]:
        return [url for _, url in self.servers]

    def stop(self) -> None:
        for server, _ in self.servers:
            server.should_exit = True


@pytest.fixture(scope="module")
def guarded():
    fakes = GuardedFakes(3)
    router = _router(fakes.urls, max_request_bytes=256 << 10, request_read_timeout=1.0)
    deadline = time.monotonic() + 10
    while not all(b["healthy"] for b in _state(router).values()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield router, fakes
    router.stop()
    fakes.stop()


def test_router_body_limit_and_read_deadline(guarded):
    router, _ = guarded
    before = sum(b["requests_total"] for b in _state(router).values())
    big = json.dumps({"prompt": "x" * (300 << 10), "max_tokens": 1})
    t = time.perf_counter()
    err = _json_error(httpx.post(router.url + "/v1/completions", content=big,
                                 headers={"content-type": "application/json"}, timeout=30), 413)
    assert err["code"] == "request_too_large" and time.perf_counter() - t < 2
    assert sum(b["requests_total"] for b in _state(router).values()) == before  # no backend saw it
    with socket.create_connection(("127.0.0.1", router.config.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\": \"half")
        started = time.monotonic()
        reply = b""
        while not reply.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert 0.8 <= time.monotonic() - started < 5


def test_every_bad_body_is_a_json_error(guarded):
    router, _ = guarded
    deep = ("[" * 5000 + "]" * 5000).encode()
    nested = ('{"prompt": ' + "[" * 5000 + "]" * 5000 + "}").encode()
    for raw in (deep, nested, b"{", b"[1, 2]", b"\xff\xfe", b""):
        r = httpx.post(router.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
        _json_error(r, 400)
        r = httpx.post(router.url + "/v1/chat/completions", content=raw)
        _json_error(r, 400)
    _json_error(httpx.get(router.url + "/nope"), 404)
    _json_error(httpx.get(router.url + "/v1/completions"), 405)


def test_split_admin_answers_deep_json_with_json():
    from tokenmill.router.canary.canary import CanaryConfig
    from tokenmill.router.canary.variants import parse_split, parse_variant

    fakes = GuardedFakes(2)
    canary = CanaryConfig(variants=[parse_variant(f"base={fakes.urls[0]}"), parse_variant(f"int4={fakes.urls[1]}")],
                          split=parse_split(["int4=10"]))
    router = RouterServer(RouterConfig(backends=[], port=0, canary=canary)).start_in_thread()
    try:
        deep = ("[" * 5000 + "]" * 5000).encode()
        _json_error(httpx.post(router.url + "/admin/split", content=deep), 400)
    finally:
        router.stop()
        fakes.stop()


def test_a_backends_413_passes_through_and_never_ejects_it(guarded):
    """Two clients send bodies over the backends' limit (under the router's) while a third sends
    ordinary requests: the large ones get the backend's 413, the others all succeed, and no
    backend leaves rotation."""
    router, _ = guarded
    downs = _metric(router, "tokenmill_router_backend_health_changes_total", state="down")
    large = json.dumps({"prompt": "w " * (100 << 10), "max_tokens": 1}).encode()  # 200 KB
    statuses: list[int] = []
    ok: list[int] = []

    def oversize() -> None:
        with httpx.Client(timeout=30) as c:
            for _ in range(10):
                statuses.append(c.post(router.url + "/v1/completions", content=large,
                                       headers={"content-type": "application/json"}).status_code)

    def ordinary() -> None:
        with httpx.Client(timeout=30) as c:
            for i in range(30):
                ok.append(c.post(router.url + "/v1/completions",
                                 json={"prompt": f"hello {i}", "max_tokens": 2}).status_code)

    threads = [threading.Thread(target=oversize) for _ in range(2)] + [threading.Thread(target=ordinary)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert statuses == [413] * 20, statuses
    assert ok == [200] * 30, ok
    assert all(b["healthy"] for b in _state(router).values())
    assert _metric(router, "tokenmill_router_backend_health_changes_total", state="down") == downs


def test_a_request_that_kills_its_backend_is_not_replayed():
    fakes = start_fakes(3)
    router = _router([f.url for f in fakes])
    try:
        deadline = time.monotonic() + 10
        while not all(b["healthy"] for b in _state(router).values()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for stream in (False, True):
            body = {"prompt": f"please {CRASH_WORD}", "max_tokens": 4, "stream": stream}
            r = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
            err = _json_error(r, 502)
            assert err["code"] == "backend_died", err
        dead = [f for f in fakes if f.proc is not None and f.proc.poll() is not None]
        assert len(dead) == 2, "each crashing request killed exactly one backend"
        assert _metric(router, "tokenmill_router_poisoned_requests_total") == 2
        assert _metric(router, "tokenmill_router_retries_total") == 0
        for i in range(4):
            r = httpx.post(router.url + "/v1/completions", json={"prompt": f"fine {i}", "max_tokens": 2}, timeout=30)
            assert r.status_code == 200
    finally:
        router.stop()
        for f in fakes:
            f.kill()


def test_a_non_streaming_client_that_hangs_up_aborts_the_backend():
    (fake,) = start_fakes(1, decode_s_per_token=0.05)
    router = _router([fake.url])

    def running() -> float:
        for line in httpx.get(fake.url + "/metrics").text.splitlines():
            if line.startswith("vllm:num_requests_running"):
                return float(line.split()[-1])
        return 0.0

    try:
        with pytest.raises(httpx.ReadTimeout):  # 200 tokens take 10 s; the client leaves after 0.5 s
            httpx.post(router.url + "/v1/completions", json={"prompt": "long", "max_tokens": 200}, timeout=0.5)
        left = time.monotonic()
        while running() > 0:
            assert time.monotonic() - left < 3, "the backend kept generating after the client left"
            time.sleep(0.05)
        assert _state(router)[fake.url]["in_flight"] == 0
    finally:
        router.stop()
        fake.kill()


@pytest.mark.slow
def test_a_grammar_bomb_through_the_router_leaves_real_replicas_alive(tmp_path):
    """Three `tokenmill serve` processes (the tiny model, so they start in seconds)."""
    from conftest import save_tiny_hf_folder
    from test_grammar_safety import chained_lark, chained_schema
    from test_server_support import real_servers

    model = save_tiny_hf_folder(tmp_path / "tiny")
    args = ("--model", model, "--max-model-len", "512", "--num-blocks", "64", "--threads", "1", "--no-ui",
            "--dtype", "float32", "--quantization", "none")
    with real_servers(args, args, args) as servers:
        pids = [s.proc.pid for s in servers]
        router = _router([s.url for s in servers], policy="least-load")
        try:
            bombs = [{"prompt": "x", "max_tokens": 2, "guided_grammar": chained_lark(3000)},
                     {"prompt": "x", "max_tokens": 2, "guided_json": chained_schema(1000)}]
            for body in bombs * 2:
                r = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
                assert r.status_code == 400, r.text[:300]
            assert all(s.proc.poll() is None for s in servers) and [s.proc.pid for s in servers] == pids
            for s in servers:
                t = time.perf_counter()
                assert httpx.get(s.url + "/health", timeout=5).status_code == 200
                assert time.perf_counter() - t < 1.0
            assert all(b["healthy"] for b in _state(router).values())
            r = httpx.post(router.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
            assert r.status_code == 200
        finally:
            router.stop()

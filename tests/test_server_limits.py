"""Bounded requests over real sockets (tiny model, fast): body-size limit, read deadline,
a large body does not stall /health, admission counts sequences (prompts x n)."""
from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import httpx
import pytest

from test_server_support import ThreadServer, health_probe, make_tiny_app, metric

LIMIT = 64 << 10


@pytest.fixture(scope="module")
def served():
    app = make_tiny_app({"max_num_seqs": 2}, max_request_bytes=LIMIT, request_read_timeout_s=1.0, max_waiting=4)
    with ThreadServer(app) as server:
        yield server, app.state.tokenmill
    app.state.tokenmill.aengine.shutdown()


def _error(resp: httpx.Response) -> dict[str, Any]:
    body = resp.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    return body["error"]


def _rejected(state: Any, reason: str) -> float:
    try:
        return metric(state.metrics.render().decode(), "tokenmill:requests_rejected_total", reason=reason)
    except KeyError:  # not counted yet
        return 0.0


def test_declared_body_over_the_limit_is_413_before_reading(served):
    server, state = served
    before = _rejected(state, "too_large")
    body = json.dumps({"prompt": "x" * (LIMIT + 10), "max_tokens": 1}).encode()
    resp = httpx.post(server.url + "/v1/completions", content=body,
                      headers={"content-type": "application/json"}, timeout=30)
    assert resp.status_code == 413
    err = _error(resp)
    assert err["code"] == "request_too_large" and str(LIMIT) in err["message"]
    after = _rejected(state, "too_large")
    assert after == before + 1


def test_chunked_body_over_the_limit_is_413(served):
    server, _ = served

    def chunks():
        yield b'{"prompt": "'
        for _ in range(LIMIT // 1024 + 2):
            yield b"y" * 1024
        yield b'", "max_tokens": 1}'

    resp = httpx.post(server.url + "/v1/completions", content=chunks(),
                      headers={"content-type": "application/json"}, timeout=30)
    assert resp.status_code == 413 and _error(resp)["code"] == "request_too_large"


def test_body_under_the_limit_still_works(served):
    server, _ = served
    resp = httpx.post(server.url + "/v1/completions", json={"prompt": "hello " * 1000, "max_tokens": 2},
                      timeout=60)
    # the tiny model's context is short: a clear 400 about length, not a size refusal
    assert resp.status_code in (200, 400), resp.text
    if resp.status_code == 400:
        assert _error(resp)["code"] == "context_length_exceeded"
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_half_sent_body_gets_408_after_the_read_timeout(served):
    server, _ = served
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\": \"half")
        started = time.monotonic()
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            reply += data
        waited = time.monotonic() - started
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert 0.8 <= waited < 5


def test_health_answers_while_a_huge_body_arrives(served):
    """A 50 MB body is refused without being read and a 6 MB one (below a raised limit) is read and
    refused as too long without being tokenized; /health answers quickly all along."""
    server, state = served
    with health_probe(server.url) as latencies:
        time.sleep(0.1)
        huge = b'{"prompt": "' + b"z" * (50 << 20) + b'", "max_tokens": 1}'
        resp = httpx.post(server.url + "/v1/completions", content=huge,
                          headers={"content-type": "application/json"}, timeout=60)
        assert resp.status_code == 413
        del huge
        state.settings.max_request_bytes = 16 << 20
        try:
            big = json.dumps({"messages": [{"role": "user", "content": "lorem ipsum " * 500_000}]})
            t = time.perf_counter()
            resp = httpx.post(server.url + "/v1/chat/completions", content=big,
                              headers={"content-type": "application/json"}, timeout=60)
            took = time.perf_counter() - t
        finally:
            state.settings.max_request_bytes = LIMIT
        assert resp.status_code == 400 and _error(resp)["code"] == "context_length_exceeded", resp.text
        assert took < 5  # refused before tokenizing six megabytes
        time.sleep(0.1)
    assert len(latencies) >= 5
    assert max(latencies) < 1.0, sorted(latencies)[-5:]


def test_a_request_larger_than_the_queue_is_400(served):
    server, _ = served
    body = {"prompt": [f"prompt {i}" for i in range(64)], "n": 16, "max_tokens": 2}
    resp = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert resp.status_code == 400
    err = _error(resp)
    assert err["code"] == "too_many_sequences" and "1024" in err["message"] and err["param"] == "n"
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                      json={"messages": [{"role": "user", "content": "hi"}], "n": 5, "max_tokens": 2})
    assert chat.status_code == 400 and _error(chat)["code"] == "too_many_sequences"
    fits = httpx.post(server.url + "/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 2},
                      timeout=60)
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 4


def test_waiting_sequences_never_pass_max_waiting(served):
    """Many concurrent n=2 requests: some get 429, and the waiting count (in sequences) stays <= 4."""
    server, state = served
    peak = 0
    stop = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, state.num_waiting())
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    statuses: list[int] = []

    def one(i: int) -> None:
        r = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"prompt": f"story {i}", "n": 2, "max_tokens": 24, "ignore_eos": True,
                             "stream": i % 2 == 0})
        statuses.append(r.status_code)
        if r.status_code == 429:
            assert _error(r)["code"] == "queue_full" and int(r.headers["retry-after"]) >= 1

    try:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        stop.set()
        watcher.join()
    assert set(statuses) <= {200, 429} and statuses.count(200) >= 2 and statuses.count(429) >= 1, statuses
    assert peak <= 4
    assert state.num_waiting() == 0 and state.admission.pending == 0


def test_cut_all_ends_streams_with_an_error_event_then_done(served):
    """What shutdown does when the grace period is over: running streams end in-band."""
    import asyncio

    from tokenmill.entrypoints.server.lifecycle import cut_all

    server, state = served
    body = {"prompt": "cut me", "max_tokens": 100, "ignore_eos": True, "stream": True}
    events: list[str] = []
    step = state.engine.step

    def slow_step() -> Any:  # the tiny model would finish before the cut arrives
        time.sleep(0.02)
        return step()

    state.engine.step = slow_step
    try:
        with httpx.Client(timeout=60) as client, client.stream("POST", server.url + "/v1/completions",
                                                                 json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        assert asyncio.run_coroutine_threadsafe(cut_all(state), state.loop).result(10) >= 1
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == "shutting_down" and err["type"] == "service_unavailable"
        late = httpx.post(server.url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=30)
        assert late.status_code == 503 and _error(late)["code"] == "shutting_down"
    finally:
        state.cutting = False
        del state.engine.step
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "ok", "max_tokens": 2},
                      timeout=30).status_code == 200


def test_heap_housekeeping(monkeypatch):
    from tokenmill.entrypoints.server.heap import ONEDNN_CACHE_ENTRIES, HeapTrimmer, bound_onednn_caches, trim_heap

    assert isinstance(trim_heap(), bool)
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "512")  # an operator's choice stays
    bound_onednn_caches()
    import os

    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(ONEDNN_CACHE_ENTRIES)
    assert os.environ["LRU_CACHE_CAPACITY"] == "512"
    trimmer = HeapTrimmer(interval_s=0.01).start()
    time.sleep(0.05)
    trimmer.stop()


def test_the_default_waiting_queue_is_sized_to_the_pool():
    from tokenmill.entrypoints.server.serving import default_max_waiting

    assert default_max_waiting(num_blocks=10_000, max_num_seqs=64) == 256  # four batches
    assert default_max_waiting(num_blocks=100, max_num_seqs=64) == 100  # no more than the pool's blocks
    assert default_max_waiting(num_blocks=16, max_num_seqs=64) == 64  # at least one batch
    app = make_tiny_app({"num_blocks": 96, "max_num_seqs": 16})  # no --max-waiting given
    try:
        state = app.state.tokenmill
        assert state.settings.max_waiting == 64
        body = {"prompt": ["a", "b", "c", "d", "e"], "n": 16, "max_tokens": 1}  # 80 sequences
        import asyncio

        async def send() -> httpx.Response:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                return await c.post("/v1/completions", json=body)

        resp = asyncio.run(send())
        assert resp.status_code == 400 and _error(resp)["code"] == "too_many_sequences"
    finally:
        app.state.tokenmill.aengine.shutdown()

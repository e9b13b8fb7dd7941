"""The tiny-model server behind real uvicorn sockets: a client that hangs up
aborts its request and every KV block goes back to the pool."""
from __future__ import annotations

import time

import httpx
import pytest

from test_server_support import ThreadServer, make_tiny_app, metric


@pytest.fixture(scope="module")
def live():
    app = make_tiny_app()
    with ThreadServer(app) as server:
        yield server, app
    app.state.tokenmill.aengine.shutdown()


def _metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=5).text


def _wait_idle(url: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = _metrics(url)
        if metric(text, "vllm:kv_cache_usage_perc") == 0 and metric(text, "vllm:num_requests_running") == 0:
            return text
        if time.monotonic() > deadline:
            raise AssertionError("KV blocks were not returned after the client left:\n" + text[:2000])
        time.sleep(0.05)


def test_stream_disconnect_aborts_and_frees_blocks(live):
    server, app = live
    engine = app.state.tokenmill.engine
    aborts_before = metric(_metrics(server.url), "vllm:request_success_total", finished_reason="abort") \
        if "finished_reason=\"abort\"" in _metrics(server.url) else 0.0
    body = {"prompt": "a long story " * 8, "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", server.url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            chunks = 0
            usage_mid_stream = 0.0
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    chunks += 1
                if chunks == 5:
                    # mid-stream (the connection is open): the request holds KV blocks
                    usage_mid_stream = metric(_metrics(server.url), "vllm:kv_cache_usage_perc")
                    break  # closing the line iterator drops the connection: the client is gone
            assert usage_mid_stream > 0
    text = _wait_idle(server.url)
    assert metric(text, "vllm:request_success_total", finished_reason="abort") == aborts_before + 1
    generated = metric(text, "vllm:generation_tokens_total")
    assert generated < 900  # it stopped early, it did not run to max_tokens
    engine.check_idle_invariants()


def test_non_stream_disconnect_aborts(live):
    server, app = live
    # 8 x 900 tokens take ~1.5 s on the development CPU, 5x the client's patience.
    body = {"prompt": "patience " * 8, "max_tokens": 900, "ignore_eos": True, "n": 8}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.3)
    _wait_idle(server.url)
    app.state.tokenmill.engine.check_idle_invariants()
    # the server is fine afterwards
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200

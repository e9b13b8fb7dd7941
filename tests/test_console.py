"""The console's stats endpoint and page, on the tiny model (fast): the rolling
window's arithmetic, agreement with /metrics, the API key, --no-ui, and that
the page fetches nothing from outside the server."""
from __future__ import annotations

import random
import re
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from conftest import tiny_loaded, tiny_tokenizer
from test_server_support import ThreadServer, make_tiny_app, metric
from tokenmill.entrypoints.console.console import STATIC_DIR, EngineWindow, mount_console, percentile


# ---- the rolling window, with a fake clock and a fake engine ---------------------------------

class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _fake_engine() -> Any:
    """What the window reads: the last step's figures and the published counters."""
    stats = SimpleNamespace(prefix_queried_tokens=0, prefix_hit_tokens=0, preemptions_total=0)
    return SimpleNamespace(last_step=SimpleNamespace(num_prefill_tokens=0, duration_s=0.01), stats=stats)


def _delta(rid: str, n: int, finished: bool = False, **metrics: float) -> Any:
    return SimpleNamespace(request_id=rid, index=0, token_ids=[7] * n, num_cached_tokens=32,
                           num_prompt_tokens=50, finished=finished,
                           finish_reason="length" if finished else None, metrics=metrics if finished else {})


def test_percentile_matches_numpy():
    rng = random.Random(3)
    for size in (1, 2, 5, 37, 200):
        xs = [rng.expovariate(3.0) for _ in range(size)]
        for q in (0, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_window_counts_tokens_latencies_and_cache_then_forgets_after_a_minute():
    clock = _Clock()
    engine = _fake_engine()
    engine.stats.prefix_queried_tokens = 500  # before the console started: not counted
    engine.stats.prefix_hit_tokens = 400
    engine.stats.preemptions_total = 3
    window = EngineWindow(clock=clock)
    window.baseline(engine)

    # request "a": prefill 50 tokens (32 from cache) and one token, then 3 decode steps
    engine.stats.prefix_queried_tokens += 50
    engine.stats.prefix_hit_tokens += 32
    engine.last_step.num_prefill_tokens = 18
    window.on_step(engine, [_delta("a", 1)])
    engine.last_step.num_prefill_tokens = 0
    for i in range(3):
        clock.now += 0.1
        last = i == 2
        engine.stats.preemptions_total += 1 if i == 1 else 0
        window.on_step(engine, [_delta("a", 1, finished=last, ttft=0.5, e2e=0.9)])
    snap = window.snapshot()
    assert snap["requests"] == {"finished": 1, "prompt_tokens": 50, "cached_tokens": 32, "output_tokens": 4}
    assert snap["ttft"]["count"] == 1 and snap["ttft"]["p50"] == pytest.approx(0.5)
    assert snap["tpot"]["p99"] == pytest.approx(0.4 / 3)  # (e2e - ttft) / (tokens - 1)
    assert snap["prefix_cache"] == {"queried_tokens": 50, "hit_tokens": 32, "hit_rate": pytest.approx(0.64)}
    assert snap["preemptions"] == 1
    assert sum(snap["series"]["tokens_out"]) == 4 and sum(snap["series"]["tokens_in"]) == 18
    assert len(snap["series"]["tokens_out"]) == 60
    assert snap["tokens_out_per_s"] > 0
    assert len(snap["points"]) == 1 and snap["points"][0][1] == pytest.approx(0.5)

    # 30 s later, request "b" (no cache traffic): both requests are in the window
    clock.now += 30
    window.on_step(engine, [_delta("b", 2, finished=True, ttft=1.5, e2e=1.6)])
    snap = window.snapshot()
    assert snap["requests"]["finished"] == 2
    assert snap["ttft"]["p50"] == pytest.approx(1.0)
    assert snap["tokens_out_per_s"] == pytest.approx(2 / 3.0, rel=0.2)  # only b is recent
    assert snap["tokens_out_per_s_1m"] == pytest.approx(6 / 30.3, rel=0.05)

    # 45 s after that: "a" (75 s old) has left the window, "b" (45 s) has not
    clock.now += 45
    snap = window.snapshot()
    assert snap["requests"]["finished"] == 1 and snap["ttft"]["p50"] == pytest.approx(1.5)
    assert snap["prefix_cache"]["hit_rate"] is None and snap["preemptions"] == 0
    assert snap["tokens_out_per_s"] == 0
    assert sum(snap["series"]["tokens_out"]) == 2

    clock.now += 60
    snap = window.snapshot()
    assert snap["requests"]["finished"] == 0 and snap["ttft"]["p50"] is None and snap["points"] == []
    assert sum(snap["series"]["tokens_out"]) == 0


# ---- the endpoint on a real app ------------------------------------------------------------

def _stats_and_metrics(client: Any) -> tuple[dict[str, Any], str]:
    return client.get("/v1/engine/stats").json(), client.get("/metrics").text


def _assert_agree(stats: dict[str, Any], text: str) -> None:
    assert stats["running"] == metric(text, "vllm:num_requests_running")
    assert stats["waiting"] == metric(text, "vllm:num_requests_waiting")
    assert stats["kv_blocks"]["usage"] == pytest.approx(metric(text, "vllm:kv_cache_usage_perc"))
    assert stats["preemptions_total"] == metric(text, "vllm:num_preemptions_total")
    assert stats["totals"]["prompt_tokens"] == metric(text, "vllm:prompt_tokens_total")
    assert stats["totals"]["generation_tokens"] == metric(text, "vllm:generation_tokens_total")
    assert stats["prefix_cache"]["queried_tokens_total"] == metric(text, "vllm:prefix_cache_queries_total")
    assert stats["prefix_cache"]["hit_tokens_total"] == metric(text, "vllm:prefix_cache_hits_total")
    kv = stats["kv_blocks"]
    assert kv["in_use"] == metric(text, "tokenmill:kv_cache_blocks", state="in_use")
    assert kv["cached"] == metric(text, "tokenmill:kv_cache_blocks", state="cached_idle")
    assert kv["free"] == metric(text, "tokenmill:kv_cache_blocks", state="free")
    assert kv["in_use"] + kv["cached"] + kv["free"] == kv["total"]
    for reason, count in stats["totals"]["finished"].items():
        assert count == metric(text, "vllm:request_success_total", finished_reason=reason)


def test_stats_agree_with_metrics_after_a_preempting_load():
    # 12 blocks of 16 tokens cannot hold 6 sequences of 40 + 60 tokens: the engine must preempt
    app = make_tiny_app({"num_blocks": 12, "max_num_seqs": 8})
    stats_api = mount_console(app)
    try:
        with TestClient(app) as client:
            idle, text = _stats_and_metrics(client)
            _assert_agree(idle, text)
            assert idle["running"] == 0 and idle["totals"]["generation_tokens"] == 0
            body = {"prompt": "a" * 40, "max_tokens": 60, "n": 6, "ignore_eos": True}
            assert client.post("/v1/completions", json=body).status_code == 200
            body = {"prompt": "a" * 40 + "b" * 9, "max_tokens": 5}  # shares the first two blocks
            assert client.post("/v1/completions", json=body).status_code == 200
            stats, text = _stats_and_metrics(client)
        _assert_agree(stats, text)
        assert stats["preemptions_total"] > 0
        assert stats["totals"]["generation_tokens"] == 6 * 60 + 5
        lm = stats["last_minute"]
        assert lm["preemptions"] == stats["preemptions_total"]
        assert lm["requests"]["finished"] == 7
        assert lm["requests"]["output_tokens"] == stats["totals"]["generation_tokens"]
        assert lm["requests"]["cached_tokens"] >= 32
        assert lm["prefix_cache"]["hit_tokens"] == stats["prefix_cache"]["hit_tokens_total"] > 0
        # the window's latencies are the very observations of the /metrics histograms
        assert lm["ttft"]["count"] == metric(text, "vllm:time_to_first_token_seconds_count") == 7
        assert lm["ttft"]["mean"] * 7 == pytest.approx(metric(text, "vllm:time_to_first_token_seconds_sum"))
        assert lm["tpot"]["count"] == metric(text, "vllm:time_per_output_token_seconds_count") == 7
        assert lm["tpot"]["mean"] * 7 == pytest.approx(metric(text, "vllm:time_per_output_token_seconds_sum"))
        assert lm["ttft"]["p50"] <= lm["ttft"]["p90"] <= lm["ttft"]["p99"]
        assert lm["tokens_out_per_s_1m"] > 0 and sum(lm["series"]["tokens_out"]) == 6 * 60 + 5
        assert stats["model"]["num_blocks"] == 12 and stats["model"]["kv_pool_bytes"] > 0
        assert stats_api.window is not None
    finally:
        app.state.tokenmill.aengine.shutdown()


def _wait(client: httpx.Client, url: str, check: Any, timeout: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        stats = client.get(url + "/v1/engine/stats").json()
        if check(stats):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"stats never reached the expected state: {stats}")
        time.sleep(0.05)


def test_stats_agree_with_metrics_while_a_request_runs_and_after_its_client_leaves():
    app = make_tiny_app()
    # the tiny model runs ~1000 steps a second; 10 ms a step keeps the request alive while we look
    app.state.tokenmill.aengine.on_step = lambda engine, deltas: time.sleep(0.01)
    mount_console(app)
    try:
        with ThreadServer(app) as server, httpx.Client(timeout=30) as client:
            body = {"prompt": "a long story " * 4, "max_tokens": 900, "ignore_eos": True, "stream": True}
            with client.stream("POST", server.url + "/v1/completions", json=body) as resp:
                lines = resp.iter_lines()  # kept open: closing the iterator would drop the connection
                for _ in range(8):
                    next(lines)
                stats = client.get(server.url + "/v1/engine/stats").json()
                text = client.get(server.url + "/metrics").text
                assert stats["running"] == metric(text, "vllm:num_requests_running") == 1
                assert stats["kv_blocks"]["in_use"] > 0 and metric(text, "vllm:kv_cache_usage_perc") > 0
                assert stats["last_minute"]["tokens_out_per_s"] > 0
            idle = _wait(client, server.url, lambda s: s["running"] == 0 and s["kv_blocks"]["in_use"] == 0)
            text = client.get(server.url + "/metrics").text
            _assert_agree(idle, text)
            assert idle["totals"]["finished"].get("abort") == 1
            assert idle["last_minute"]["requests"]["finished"] == 0  # an abort leaves no latency sample
    finally:
        app.state.tokenmill.aengine.shutdown()


def test_stats_page_and_assets_need_the_api_key():
    # the login flow itself: test_console_auth.py
    app = make_tiny_app(api_key="s3cret")
    mount_console(app)
    try:
        with TestClient(app) as client:
            page = client.get("/")
            assert page.status_code == 401 and "text/html" in page.headers["content-type"]
            assert "/console/app.js" not in page.text and 'action="/ui/login"' in page.text
            assert client.get("/console/app.js").status_code == 401
            bearer = client.get("/", headers={"Authorization": "Bearer s3cret"})
            assert bearer.status_code == 200 and "<script src=\"/console/app.js\">" in bearer.text
            assert client.get("/v1/engine/stats").status_code == 401
            assert client.get("/v1/engine/stats", headers={"Authorization": "Bearer nope"}).status_code == 401
            ok = client.get("/v1/engine/stats", headers={"Authorization": "Bearer s3cret"})
            assert ok.status_code == 200 and ok.json()["model"]["api_key_required"] is True
    finally:
        app.state.tokenmill.aengine.shutdown()


def test_ui_off_keeps_the_stats_endpoint():
    app = make_tiny_app()
    mount_console(app, ui=False)
    try:
        with TestClient(app) as client:
            assert client.get("/").status_code == 404
            assert client.get("/console/app.js").status_code == 404
            assert client.get("/v1/engine/stats").json()["model"]["name"] == "tiny"
    finally:
        app.state.tokenmill.aengine.shutdown()


def test_assets_are_served_and_fetch_nothing_from_outside():
    app = make_tiny_app()
    mount_console(app)
    try:
        with TestClient(app) as client:
            html = client.get("/").text
            refs = re.findall(r'(?:src|href)="([^"]+)"', html)
            assert "/console/app.js" in refs and "/console/app.css" in refs
            for ref in refs:
                assert ref == "/" or ref.startswith(("/console/", "data:")), ref  # "/": sign in again
                if ref.startswith("/console/"):
                    asset = client.get(ref)
                    assert asset.status_code == 200 and len(asset.content) > 1000, ref
    finally:
        app.state.tokenmill.aengine.shutdown()
    for path in STATIC_DIR.iterdir():
        # the SVG namespace in the inline favicon is an identifier, never fetched
        source = path.read_text().replace("http://www.w3.org/2000/svg", "")
        assert not re.search(r"https?://|@import|@font-face|//[a-z0-9.-]+\.[a-z]{2,}/", source, re.I), path.name
    js = (STATIC_DIR / "app.js").read_text()
    fetched = re.findall(r'fetch\(\s*"([^"]*)"', js)
    assert sorted(fetched) == ["/v1/chat/completions", "/v1/engine/stats"]


# ---- `tokenmill serve` wiring: the console is on by default and off with --no-ui -----------------

@pytest.mark.parametrize("no_ui", [False, True])
def test_serve_mounts_the_console_unless_no_ui(monkeypatch, no_ui):
    import argparse

    import tokenmill.engine.engine as engine_mod
    from tokenmill.entrypoints.server import lifecycle
    from tokenmill.entrypoints.cli import serve_cli

    real_engine = engine_mod.LLMEngine
    monkeypatch.setattr(engine_mod, "LLMEngine",
                        lambda config: real_engine(config, loaded=tiny_loaded(), tokenizer=tiny_tokenizer()))
    seen: dict[str, Any] = {}

    class FakeServer:  # stands in for uvicorn: serve three requests, then "stop"
        def __init__(self, config: Any, state: Any) -> None:
            self.server = self
            self.app = config.app

        def run(self) -> None:
            with TestClient(self.app) as client:
                seen["page"] = client.get("/").status_code
                seen["asset"] = client.get("/console/app.css").status_code
                seen["stats"] = client.get("/v1/engine/stats").status_code

    monkeypatch.setattr(lifecycle, "DrainingServer", FakeServer)
    parser = argparse.ArgumentParser()
    serve_cli.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--num-blocks", "32"] + (["--no-ui"] if no_ui else []))
    assert args.func(args) == 0
    assert seen == ({"page": 404, "asset": 404, "stats": 200} if no_ui else {"page": 200, "asset": 200, "stats": 200})


def test_static_dir_ships_in_the_package():
    assert {p.name for p in STATIC_DIR.iterdir()} >= {"index.html", "app.js", "app.css"}
    assert STATIC_DIR.parent == Path(__import__("tokenmill.entrypoints", fromlist=["x"]).__file__).parent


# ---- the browser test's setup: skip with a reason when chromium is missing (install nothing) ----

def test_browser_setup_skips_with_a_reason_when_chromium_is_missing(monkeypatch):
    import test_console_browser as tcb

    monkeypatch.setattr(tcb, "CHROMIUM", "/nonexistent/chromium")
    with pytest.raises(pytest.skip.Exception, match="is missing: install it"):
        tcb.ensure_chromium()

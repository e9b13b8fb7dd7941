"""Canary rollout in the router: split, stickiness, per-variant metrics, guard, admin, state file.

Backends are the in-process fake OpenAI servers (tests/fake_openai_server.py)
with known time to first token, so the fault test can make the canary slow
and watch the guard drop it to 0% while every request still succeeds.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fake_openai_server import FakeConfig, FakeServer
from tokenmill.router.canary.canary import Canary, CanaryConfig, StreamMeter
from tokenmill.router.config import RouterConfig
from tokenmill.router.canary.guard import SLO, Guard, percentile
from tokenmill.router.k8s.k8s_weights import HTTPRouteWeights, set_weights
from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.server import RouterServer
from tokenmill.router.canary.variants import (SplitState, Splitter, Variant, full_split, load_state, parse_split,
                                       parse_variant, save_state, session_key)


# -- unit ------------------------------------------------------------------

def test_parse_variant_and_split():
    v = parse_variant("int4=127.0.0.1:8001, http://h:9/")
    assert v.name == "int4" and v.backends == ["http://127.0.0.1:8001", "http://h:9"]
    assert v.endpoints == {"127.0.0.1:8001", "h:9"}
    for bad in ("int4", "=http://a", "in t4=http://a", "x="):
        with pytest.raises(ValueError):
            parse_variant(bad)
    assert parse_split(["int4=10", "int8=5%"]) == {"int4": 10.0, "int8": 5.0}
    assert full_split(["base", "int4"], {"int4": 10}) == {"base": 90.0, "int4": 10.0}
    assert full_split(["base", "int4"], {}) == {"base": 100.0, "int4": 0.0}
    with pytest.raises(ValueError, match="unknown"):
        full_split(["base", "int4"], {"int8": 1})
    with pytest.raises(ValueError, match="100"):
        full_split(["base", "a", "b"], {"a": 60, "b": 50})
    with pytest.raises(ValueError):
        full_split(["base", "a"], {"a": -1})


def _splitter(weights):
    vs = [Variant(n, [f"http://127.0.0.1:{9000 + i}"]) for i, n in enumerate(weights)]
    return Splitter(vs, SplitState(dict(weights)))


def test_unkeyed_split_is_exact_and_keyed_split_is_sticky():
    s = _splitter({"base": 90.0, "int4": 10.0})
    got = Counter(s.choose(None) for _ in range(100))
    assert got == {"base": 90, "int4": 10}
    s = _splitter({"base": 50.0, "int4": 50.0})
    keyed = {f"user-{i}": s.choose(f"user-{i}") for i in range(200)}
    for _ in range(3):  # the same key always lands on the same variant
        assert all(s.choose(k) == v for k, v in keyed.items())
    share = sum(v == "int4" for v in keyed.values()) / len(keyed)
    assert 0.35 < share < 0.65
    # A variant with no ready backend gets nothing; its traffic goes to what is ready.
    assert {s.choose(k, available={"base"}) for k in keyed} == {"base"}
    s.set_weights({"base": 100.0, "int4": 0.0})
    assert {s.choose(k) for k in keyed} == {"base"}


def test_session_key_sources():
    assert session_key({"x-session-id": "s1"}, {"user": "u"}) == "x-session-id:s1"
    assert session_key({}, {"user": "u"}) == "user:u"
    assert session_key({}, {"user": 3}) is None
    assert session_key({}, None) is None


def test_guard_waits_for_min_samples_and_forgets_old_samples():
    now = [0.0]
    g = Guard(SLO(ttft_p99=0.5, error_rate=0.2, window_s=10, min_samples=5), clock=lambda: now[0])
    for _ in range(4):
        g.observe("c", 2.0, None, False)
    assert g.breach("c") is None  # below min_samples
    g.observe("c", 2.0, None, False)
    assert "TTFT p99 2.000s > 0.5s" in g.breach("c")
    now[0] = 20.0  # all samples leave the window
    assert g.stats("c").samples == 0 and g.breach("c") is None
    for i in range(10):
        g.observe("c", 0.1, 0.01, i < 3)
    why = g.breach("c")
    assert why.startswith("error rate 30.0% > 20%") and "TTFT" not in why
    g2 = Guard(SLO(e2e_p99=1.0, min_samples=2), clock=lambda: now[0])
    g2.observe("c", None, None, False, e2e=3.0)
    g2.observe("c", None, None, False, e2e=0.5)
    assert g2.breach("c").startswith("request latency p99 3.000s > 1s")
    assert percentile([1, 2, 3, 4], 50) == 2 and percentile([5], 99) == 5


def test_slo_parse():
    s = SLO.parse("ttft_p99=1.5s,tpot=0.2,e2e=20,error_rate=5%,window=30,min_samples=8")
    assert (s.ttft_p99, s.tpot_p99, s.e2e_p99, s.error_rate, s.window_s, s.min_samples) == (1.5, 0.2, 20.0, 0.05, 30.0, 8)
    for bad in ("ttft", "foo=1", "ttft=x", "window=0", "ttft=-1"):
        with pytest.raises(ValueError):
            SLO.parse(bad)


def test_state_file_roundtrip_and_bad_file(tmp_path):
    p = tmp_path / "d" / "split.json"
    save_state(p, SplitState({"base": 75.0, "int4": 25.0}, "admin", 1.0, {}))
    st = load_state(p, ["base", "int4"])
    assert st.weights == {"base": 75.0, "int4": 25.0} and st.reason == "admin"
    assert load_state(p, ["base", "int8"]) is None  # a variant it names is gone
    p.write_text("{not json")
    assert load_state(p, ["base", "int4"]) is None
    assert load_state(tmp_path / "missing.json", ["base"]) is None


def _canary(tmp_path=None, **slo):
    cfg = CanaryConfig([parse_variant("base=127.0.0.1:1"), parse_variant("int4=127.0.0.1:2")], {"int4": 50},
                       SLO(**slo), state_file=str(tmp_path / "s.json") if tmp_path else None)
    return Canary(cfg, RouterMetrics())


def test_rollback_moves_share_to_base_and_persists(tmp_path, caplog):
    c = _canary(tmp_path, ttft_p99=0.1, window_s=60, min_samples=3)
    for _ in range(3):
        c.record("base", False, ttft=1.0)  # the base is never rolled back
    assert c.state.weights == {"base": 50.0, "int4": 50.0}
    with caplog.at_level(logging.WARNING, "tokenmill.router"):
        for _ in range(3):
            c.record("int4", False, ttft=1.0)
    assert c.state.weights == {"base": 100.0, "int4": 0.0}
    assert "canary int4 rolled back" in caplog.text and "TTFT p99" in caplog.text
    assert "TTFT p99" in c.state.rolled_back["int4"]
    assert load_state(tmp_path / "s.json", ["base", "int4"]).weights["int4"] == 0.0
    # A restart keeps the rolled-back split.
    c2 = _canary(tmp_path)
    assert c2.state.weights == {"base": 100.0, "int4": 0.0} and "int4" in c2.state.rolled_back
    c2.set_split({"int4": 10})
    assert c2.state.weights == {"base": 90.0, "int4": 10.0} and not c2.state.rolled_back


def test_stream_meter_reads_ttft_tokens_and_usage():
    c = _canary()
    m = StreamMeter(c, "int4", time.monotonic() - 0.5)
    m.feed(b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\ndata: {"choices":[{"del')
    assert m.first is None
    m.feed(b'ta":{"content":"a"}}]}\n\ndata: {"choices":[{"text":"b"}]}\n\n')
    m.feed(b'data: {"choices":[],"usage":{"completion_tokens":7}}\n\ndata: [DONE]\n\n')
    m.finish(error=False)
    assert m.chunks == 2 and m.usage_tokens == 7 and m.first is not None
    text = c.metrics.output_tokens.labels("int4")._value.get()
    assert text == 7 and c.metrics.ttft.labels("int4")._sum.get() >= 0.5


def test_httproute_weights_follow_the_split():
    route = {"metadata": {"resourceVersion": "1"}, "spec": {"rules": [{"backendRefs": [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "smollm-base", "weight": 90},
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "smollm-int4", "weight": 10}]}]}}
    refs = {"base": "smollm-base", "int4": "smollm-int4"}
    assert set_weights(route, {"base": 100.0, "int4": 0.0}, refs) == 2
    assert [r["weight"] for r in route["spec"]["rules"][0]["backendRefs"]] == [100, 0]
    assert set_weights(route, {"base": 100.0, "int4": 0.0}, refs) == 0

    stored = {"spec": {"rules": [{"backendRefs": [{"name": "smollm-base", "weight": 50},
                                                  {"name": "smollm-int4", "weight": 50}]}]}}
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append((request.method, request.url.path, request.headers["authorization"]))
        if request.method == "GET":
            return httpx.Response(200, json=stored)
        if len([c for c in calls if c[0] == "PUT"]) == 1:
            return httpx.Response(409, json={})  # a concurrent edit: read again
        stored.update(json.loads(request.content))
        return httpx.Response(200, json=stored)

    w = HTTPRouteWeights("https://k8s", "ns", "llm", "tok", refs, verify=False)
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    assert asyncio.run(w.apply({"base": 100.0, "int4": 0.0}, client)) == 2
    assert [r["weight"] for r in stored["spec"]["rules"][0]["backendRefs"]] == [100, 0]
    assert calls[0] == ("GET", "/apis/gateway.networking.k8s.io/v1/namespaces/ns/httproutes/llm", "Bearer tok")
    assert [c[0] for c in calls] == ["GET", "PUT", "GET", "PUT"]


def test_no_cluster_means_alert_only(monkeypatch, tmp_path):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ValueError):
        HTTPRouteWeights.in_cluster("ns/llm", sa_dir=tmp_path)


# -- with fake backends over loopback --------------------------------------

def _metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def _router(variants, split, **kw) -> RouterServer:
    canary = CanaryConfig(variants=[parse_variant(v) for v in variants], split=parse_split([split]),
                          slo=kw.pop("slo", SLO()), state_file=kw.pop("state_file", None),
                          admin_key=kw.pop("admin_key", None))
    kw.setdefault("health_interval", 0.5)
    return RouterServer(RouterConfig(port=0, canary=canary, **kw)).start_in_thread()


async def _requests(url, n, concurrency, stream=True, users=None, headers=None):
    """n chat requests; returns (status, variant, text, ok stream) per request."""
    sem = asyncio.Semaphore(concurrency)
    out = []

    async def one(i, client):
        body = {"model": "m", "messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 4,
                "stream": stream, "stream_options": {"include_usage": True}}
        if users:
            body["user"] = users[i % len(users)]
        async with sem:
            r = await client.post(url + "/v1/chat/completions", json=body, headers=headers or {})
            out.append((r.status_code, r.headers.get("x-tokenmill-variant"), r.text,
                        body.get("user")))

    async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
        await asyncio.gather(*(one(i, client) for i in range(n)))
    return out


@pytest.fixture(scope="module")
def two_fakes():
    with FakeServer(FakeConfig(ttft=0.01, itl=0.002)) as a, FakeServer(FakeConfig(ttft=0.01, itl=0.002)) as b:
        yield a, b


def test_split_metrics_add_up_and_sessions_stick(two_fakes):
    a, b = two_fakes
    router = _router([f"base={a.url}", f"int4={b.url}"], "int4=50", policy="round-robin")
    try:
        res = asyncio.run(_requests(router.url, 40, 8))
        assert all(s == 200 and "[DONE]" in t for s, _, t, _ in res)
        by_variant = Counter(v for _, v, _, _ in res)
        assert by_variant == {"base": 20, "int4": 20}
        users = [f"u{i}" for i in range(10)]
        res2 = asyncio.run(_requests(router.url, 40, 8, users=users))
        seen: dict[str, set] = {}
        for _, v, _, u in res2:
            seen.setdefault(u, set()).add(v)
        assert all(len(vs) == 1 for vs in seen.values()), seen
        text = httpx.get(router.url + "/metrics").text
        per_variant = {v: _metric(text, "tokenmill_router_variant_requests_total", variant=v) for v in ("base", "int4")}
        assert sum(per_variant.values()) == 80 == _metric(text, "tokenmill_router_responses_total", code="200")
        assert sum(per_variant.values()) == _metric(text, "tokenmill_router_requests_total")
        assert _metric(text, "tokenmill_router_variant_output_tokens_total") == 80 * 4
        assert _metric(text, "tokenmill_router_variant_ttft_seconds_count") == 80
        assert _metric(text, "tokenmill_router_variant_weight_percent", variant="int4") == 50
    finally:
        router.stop()


def test_admin_split_needs_key_and_survives_restart(two_fakes, tmp_path):
    a, b = two_fakes
    state = str(tmp_path / "split.json")
    variants = [f"base={a.url}", f"int4={b.url}"]
    router = _router(variants, "int4=10", state_file=state, admin_key="sekret")
    try:
        assert httpx.post(router.url + "/admin/split", json={"split": {"int4": 30}}).status_code == 401
        auth = {"Authorization": "Bearer sekret"}
        for bad in ({"split": {"int8": 5}}, {"split": {"int4": 120}}, {"split": {"int4": "x"}}, [1]):
            r = httpx.post(router.url + "/admin/split", json=bad, headers=auth)
            assert r.status_code == 400 and r.json()["error"]["code"] == "bad_split"
        r = httpx.post(router.url + "/admin/split", json={"split": {"int4": 30}}, headers=auth)
        assert r.status_code == 200 and r.json()["split"] == {"base": 70.0, "int4": 30.0}
        assert httpx.get(router.url + "/admin/split", headers=auth).json()["split"]["int4"] == 30.0
    finally:
        router.stop()
    router = _router(variants, "int4=10", state_file=state, admin_key="sekret")
    try:
        r = httpx.get(router.url + "/admin/split", headers={"Authorization": "Bearer sekret"})
        assert r.json()["split"] == {"base": 70.0, "int4": 30.0}
        res = asyncio.run(_requests(router.url, 10, 4))
        assert Counter(v for _, v, _, _ in res) == {"base": 7, "int4": 3}
    finally:
        router.stop()


def test_slow_canary_is_rolled_back_without_failing_requests(caplog, n_requests=40):
    """Fault test: the canary's TTFT p99 breaks the SLO; within the window its share drops to 0%."""
    slo = SLO(ttft_p99=0.15, window_s=20.0, min_samples=4)
    with FakeServer(FakeConfig(ttft=0.01, itl=0.002)) as base, FakeServer(FakeConfig(ttft=0.4, itl=0.002)) as slow:
        with caplog.at_level(logging.WARNING, "tokenmill.router"):
            router = _router([f"base={base.url}", f"int4={slow.url}"], "int4=50", slo=slo)
            try:
                started = time.monotonic()
                res = asyncio.run(_requests(router.url, n_requests, 4))
                elapsed = time.monotonic() - started
                assert [s for s, *_ in res if s != 200] == []
                assert all("[DONE]" in t and "error" not in t for _, _, t, _ in res)
                snap = httpx.get(router.url + "/admin/split").json()  # loopback: no key needed
                assert snap["split"] == {"base": 100.0, "int4": 0.0}
                assert "TTFT p99" in snap["rolled_back"]["int4"]
                assert elapsed < slo.window_s
                canary_served = sum(v == "int4" for _, v, _, _ in res)
                # It took min_samples slow answers (plus those already in flight), then nothing more.
                assert slo.min_samples <= canary_served <= slo.min_samples + 4
                after = asyncio.run(_requests(router.url, 10, 4))
                assert {v for _, v, _, _ in after} == {"base"}
                text = httpx.get(router.url + "/metrics").text
                assert _metric(text, "tokenmill_router_variant_weight_percent", variant="int4") == 0
                assert _metric(text, "tokenmill_router_canary_rollbacks_total", variant="int4") == 1
                assert 'tokenmill_router_canary_rollback_info{reason="TTFT p99' in text
            finally:
                router.stop()
    assert "canary int4 rolled back to 0%" in caplog.text and "TTFT p99" in caplog.text


def test_route_cli_flags():
    import argparse

    from tokenmill.router.canary.canary_cli import config_from_args as canary_from_args
    from tokenmill.router.cli import config_from_args, register

    def parse(*argv):
        parser = argparse.ArgumentParser()
        register(parser.add_subparsers())
        ns = parser.parse_args(["route", *argv])
        cfg = config_from_args(ns)
        cfg.canary = canary_from_args(ns)
        cfg.validate()
        return cfg

    cfg = parse("--variant", "base=127.0.0.1:1,127.0.0.1:2", "--variant", "int4=127.0.0.1:3", "--split", "int4=10",
                "--slo", "ttft_p99=1", "--k8s-backend-ref", "int4=pool-int4")
    assert cfg.backends == ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"]
    assert cfg.canary.split == {"int4": 10.0} and cfg.canary.k8s_backend_refs == {"int4": "pool-int4"}
    for argv, why in ((["--backend", "127.0.0.1:1", "--split", "int4=10"], "need --variant"),
                      (["--variant", "base=127.0.0.1:1"], "at least two"),
                      (["--variant", "base=127.0.0.1:1", "--variant", "b=127.0.0.1:1"], "one variant only"),
                      (["--variant", "base=127.0.0.1:1", "--variant", "b=127.0.0.1:2", "--backend", "127.0.0.1:9"],
                       "belongs in a --variant"),
                      (["--variant", "base=127.0.0.1:1", "--variant", "b=127.0.0.1:2", "--split", "c=5"], "unknown"),
                      (["--variant", "base=127.0.0.1:1", "--variant", "b=127.0.0.1:2", "--k8s-backend-ref", "b"],
                       "VARIANT=NAME")):
        with pytest.raises(ValueError, match=why):
            parse(*argv)


def test_slow_canary_on_non_streamed_traffic_is_rolled_back_by_request_latency():
    slo = SLO(e2e_p99=0.2, window_s=20.0, min_samples=3)
    with FakeServer(FakeConfig(ttft=0.01, itl=0.002)) as base, FakeServer(FakeConfig(ttft=0.4, itl=0.002)) as slow:
        router = _router([f"base={base.url}", f"int4={slow.url}"], "int4=50", slo=slo)
        try:
            res = asyncio.run(_requests(router.url, 16, 2, stream=False))
            assert [s for s, *_ in res if s != 200] == []
            snap = httpx.get(router.url + "/admin/split").json()
            assert snap["split"]["int4"] == 0.0 and "request latency p99" in snap["rolled_back"]["int4"]
            assert snap["window"]["base"]["e2e_p99"] < 0.2
        finally:
            router.stop()


def test_large_windows_are_judged_a_few_times_a_second(monkeypatch):
    from tokenmill.router.canary import canary as canary_mod

    monkeypatch.setattr(canary_mod, "_CHECK_EVERY_REQUEST", 4)
    c = _canary(ttft_p99=0.1, window_s=60, min_samples=2)
    calls = []
    real = c.guard.breach
    monkeypatch.setattr(c.guard, "breach", lambda v: calls.append(v) or real(v))
    started = time.monotonic()
    for _ in range(50):
        c.record("int4", False, ttft=0.01)  # within the SLO
    elapsed = time.monotonic() - started
    # The first three (window below 4), then one per 0.25 s (a loaded machine may take a while).
    assert 3 <= len(calls) <= 3 + int(elapsed / 0.25) + 1 < 50
    time.sleep(0.3)
    c.record("int4", False, ttft=5.0)
    c.record("int4", False, ttft=5.0)
    assert c.state.weights["int4"] == 0.0  # judged again after the pause: p99 now breaks the SLO

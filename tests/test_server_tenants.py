"""Tenants through the server (tiny model, in-process): keys from the keys file open
the API as their tenant, limits answer 429 for that tenant only, and the usage
counters (/metrics, /v1/usage, `tokenmill usage`) equal the responses' usage."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any

import httpx
import pytest

from test_server_support import make_tiny_app, metric, placements

from tokenmill.bench.usage import bill, parse_metrics, usage_main
from tokenmill.engine.sched.fairness import QueueHead
from tokenmill.engine.request import SamplingParams
from tokenmill.entrypoints.console.console import mount_console
from tokenmill.gateway.tenants import hash_key

KEYS = {"chat-key": "chat", "batch-key": "batch"}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    path.write_text(
        "tenants:\n"
        "  chat: {priority_class: high, weight: 2}\n"
        "  batch: {priority_class: batch, tokens_per_minute: 120, max_inflight: 4}\n"
        "keys:\n" + "".join(f"  - {{sha256: {hash_key(k)}, tenant: {t}}}\n" for k, t in KEYS.items()))
    app = make_tiny_app({"scheduling_policy": "fair", "max_num_seqs": 4}, api_key="operator",
                        api_keys_file=str(path), metrics_tenant_labels=True,
                        router_api_key=["router-key"])
    mount_console(app, ui=False)
    yield app
    app.state.tokenmill.aengine.shutdown()


async def _send(app: Any, calls: list[tuple[str, str, dict | None, str]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                 timeout=60) as client:
        async def one(method: str, path: str, body: dict | None, key: str) -> httpx.Response:
            headers = {"Authorization": f"Bearer {key}"}
            if method == "GET":
                return await client.get(path, headers=headers)
            return await client.post(path, json=body, headers=headers)

        return await asyncio.gather(*(one(*c) for c in calls))


def send(app: Any, *calls: tuple[str, str, dict | None, str]) -> list[httpx.Response]:
    return asyncio.run(_send(app, list(calls)))


def completion(max_tokens: int = 4, **extra: Any) -> dict:
    return {"prompt": "hello tenants", "max_tokens": max_tokens, "temperature": 0, **extra}


def usage_of(resp: httpx.Response) -> dict:
    """The usage a response reports (the last SSE chunk's, when streamed)."""
    if resp.headers["content-type"].startswith("text/event-stream"):
        chunks = [json.loads(b[6:]) for b in resp.text.split("\n\n") if b.startswith("data: {")]
        return next(c["usage"] for c in reversed(chunks) if c.get("usage"))
    return resp.json()["usage"]


def test_keys_open_the_api_as_their_tenant(app):
    ok_chat, ok_op, bad = send(app, ("POST", "/v1/completions", completion(), "chat-key"),
                               ("POST", "/v1/completions", completion(), "operator"),
                               ("POST", "/v1/completions", completion(), "chat-key-wrong"))
    assert ok_chat.status_code == 200 and ok_op.status_code == 200
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
    order = app.state.tokenmill.engine.scheduler.order
    assert order.tenants["chat"].weight == 2.0 and order.tenants["chat"].tokens > 0
    assert order.tenants["default"].tokens > 0


def test_a_tenant_past_its_tokens_per_minute_gets_429_and_nobody_else_does(app):
    # batch's bucket holds 120 tokens: each request holds its prompt plus 30 output tokens
    calls = [("POST", "/v1/completions", completion(30), "batch-key") for _ in range(4)]
    calls += [("POST", "/v1/completions", completion(30), "chat-key") for _ in range(4)]
    responses = send(app, *calls)
    batch, chat = responses[:4], responses[4:]
    assert all(r.status_code == 200 for r in chat)
    refused = [r for r in batch if r.status_code == 429]
    assert refused and any(r.status_code == 200 for r in batch)
    err = refused[0].json()["error"]
    assert err["code"] == "tenant_token_rate_limit" and "batch" in err["message"]
    assert int(refused[0].headers["Retry-After"]) >= 1
    text = app.state.tokenmill.metrics.render().decode()
    assert metric(text, "tokenmill:tenant_rejected_total", tenant="batch") == len(refused)
    assert metric(text, "tokenmill:tenant_rejected_total", tenant="chat") == 0


def test_usage_counters_equal_the_responses_usage(app, tmp_path, capsys):
    state = app.state.tokenmill
    before = parse_metrics(state.metrics.render().decode())
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0}
    calls = [
        ("POST", "/v1/completions", completion(6, n=2), "chat-key"),
        ("POST", "/v1/completions", completion(3, prompt=["one prompt", "another prompt here"]), "chat-key"),
        ("POST", "/v1/chat/completions", chat, "chat-key"),
        ("POST", "/v1/chat/completions", {**chat, "stream": True, "stream_options": {"include_usage": True}},
         "operator"),
        ("POST", "/v1/completions", completion(4, stream=True, stream_options={"include_usage": True}),
         "operator"),
        ("POST", "/v1/completions", completion(2), "operator"),
    ]
    responses = send(app, *calls)
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    expected: dict[str, dict[str, int]] = {}
    for (_, _, _, key), resp in zip(calls, responses):
        tenant = KEYS.get(key, "default")
        u = usage_of(resp)
        e = expected.setdefault(tenant, {"prompt_tokens": 0, "output_tokens": 0, "cached_tokens": 0})
        e["prompt_tokens"] += u["prompt_tokens"]
        e["output_tokens"] += u["completion_tokens"]
        e["cached_tokens"] += u["prompt_tokens_details"]["cached_tokens"]
    scrape = state.metrics.render().decode()
    after = parse_metrics(scrape)
    for tenant, e in expected.items():
        got = {k: after[tenant][k] - before.get(tenant, {}).get(k, 0) for k in e}
        assert got == e, (tenant, got, e)
    # /v1/usage: the operator sees every tenant, a tenant only itself
    everyone, own = send(app, ("GET", "/v1/usage", None, "operator"), ("GET", "/v1/usage", None, "chat-key"))
    assert set(everyone.json()["tenants"]) == {"default", "chat", "batch"}
    assert set(own.json()["tenants"]) == {"chat"}
    assert own.json()["tenants"]["chat"]["output_tokens"] == after["chat"]["output_tokens"]
    # the console's stats document shows every tenant with its place and usage
    stats = send(app, ("GET", "/v1/engine/stats", None, "operator"))[0].json()
    rows = {t["tenant"]: t for t in stats["tenants"]}
    assert set(rows) == {"default", "chat", "batch"}
    assert rows["chat"]["priority_class"] == 1 and rows["chat"]["weight"] == 2.0
    assert rows["chat"]["output_tokens"] == after["chat"]["output_tokens"] and rows["chat"]["computed_tokens"] > 0
    # tokenmill usage prices what the scrape says with bench's cost model
    saved = tmp_path / "metrics.txt"
    saved.write_text(scrape)
    report = bill(after, 1800.0, 4.0, str(saved))
    assert report.total_cost == pytest.approx(2.0)  # $4/h for half an hour
    computed = {b.tenant: b.prompt_tokens - b.cached_tokens + b.output_tokens for b in report.tenants}
    for b in report.tenants:
        assert b.cost == pytest.approx(2.0 * computed[b.tenant] / sum(computed.values()))
    args = type("Args", (), {"capture": None, "metrics": str(saved), "baseline": None, "duration": 1800.0,
                             "cost_per_hour": 4.0, "json": True})()
    assert usage_main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["total_cost"] == pytest.approx(2.0) and {t["tenant"] for t in printed["tenants"]} >= {"chat"}


def test_only_a_router_key_speaks_for_a_tenant_and_never_above_its_class(app, monkeypatch):
    """The operator's key and a tenant's key with class headers are themselves; the router key
    is the tenant it names, in that tenant's class or a lower one it asks for, and a name the
    file does not hold is the default tenant."""
    state = app.state.tokenmill
    seen = placements(monkeypatch, state)
    before = parse_metrics(state.metrics.render().decode())
    critical = {"x-gateway-inference-objective": "critical"}
    calls = [("operator", {"x-gateway-inference-fairness-id": "chat", **critical}),
             ("chat-key", {"x-gateway-inference-fairness-id": "batch", **critical}),
             ("router-key", {"x-gateway-inference-fairness-id": "batch", **critical}),
             ("router-key", {"x-gateway-inference-fairness-id": "chat", "x-gateway-inference-objective": "low"}),
             ("router-key", {"x-gateway-inference-fairness-id": "ghost", **critical}),
             ("router-key", {})]

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=60) as client:
            return [await client.post("/v1/completions", json=completion(3),
                                      headers={"Authorization": f"Bearer {key}", **headers})
                    for key, headers in calls]

    assert all(r.status_code == 200 for r in asyncio.run(go()))
    assert seen == [("default", 2), ("chat", 1), ("batch", 4), ("chat", 3), ("default", 2), ("default", 2)]
    after = parse_metrics(state.metrics.render().decode())
    assert {t: after[t]["requests"] - before[t]["requests"] for t in ("default", "chat", "batch")} == \
        {"default": 3, "chat": 2, "batch": 1}


def test_a_class_whose_queue_is_past_the_bound_gets_429_and_the_others_do_not(app):
    """Admission keeps the starvation bound end to end: when the batch tenant's queue
    (its class and tenant under fair share) would make a newcomer wait past the bound,
    its request gets 429 ``class_backlog``; the chat tenant's is served."""
    state = app.state.tokenmill
    engine, bound = state.engine, state.engine.scheduler.order.starvation_bound_s
    # as the engine would publish it after a step (admission reads the published snapshot)
    engine.stats = dataclasses.replace(engine.stats, queue_heads={
        ("batch", 4): QueueHead(time.monotonic() - 0.9 * bound, waiting=3)})
    try:
        refused, = send(app, ("POST", "/v1/completions", completion(), "batch-key"))
        assert refused.status_code == 429, refused.text
        err = refused.json()["error"]
        assert err["code"] == "class_backlog" and "starvation bound" in err["message"]
        assert int(refused.headers["Retry-After"]) >= 1
        served, = send(app, ("POST", "/v1/completions", completion(), "chat-key"))
        assert served.status_code == 200
    finally:
        engine.stats = dataclasses.replace(engine.stats, queue_heads={})


def test_the_wait_before_the_engine_counts_toward_the_bound(app):
    """The server hands the engine the time it got the request: a request that arrived
    two seconds before it reached the engine reports at least that as its queue time."""
    state = app.state.tokenmill

    async def run() -> dict:
        params = SamplingParams(max_tokens=2, temperature=0.0)
        ids = state.tokenizer.encode("hello tenants")
        deltas = [d async for d in state.aengine.generate("early-0", ids, params,
                                                         arrival_time=time.monotonic() - 2.0)]
        return next(d.metrics for d in deltas if d.metrics)

    assert asyncio.run(run())["queue_time"] >= 2.0

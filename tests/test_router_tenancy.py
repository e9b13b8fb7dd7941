"""The router's tenants and the Inference Extension's headers: tenant keys open it,
a tenant's limits hold across replicas, the tenant travels to the replica in the
fairness-id header, and the objective's priority decides who may be shed."""
from __future__ import annotations

import asyncio

import pytest
import json

import httpx

from tokenmill.gateway.tenants import hash_key
from tokenmill.router.config import RouterConfig
from tokenmill.router.core import Router
from tokenmill.router.proxy import build_app
from tokenmill.router.tenancy import RouterTenancy, estimate_tokens, objective_priority, parse_objectives

REPLICAS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]


def keys_file(tmp_path) -> str:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({
        "tenants": {"chat": {}, "batch": {"max_inflight": 2, "tokens_per_minute": 100000}},
        "keys": [{"sha256": hash_key("chat-key"), "tenant": "chat"},
                 {"sha256": hash_key("batch-key"), "tenant": "batch"}]}))
    return str(path)


class Replicas:
    """Three replicas behind a mock transport: every completion waits until released,
    so requests stay in flight; what each received is kept."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, str]]] = []
        self.gate = asyncio.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if request.url.path == "/metrics":
            return httpx.Response(200, text="")
        if request.url.path == "/v1/models":  # the health check's model list is never held
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m", "object": "model"}]})
        self.seen.append((f"{request.url.scheme}://{request.url.host}:{request.url.port}", dict(request.headers)))
        await self.gate.wait()
        return httpx.Response(200, json={"choices": [{"text": "ok"}], "usage": {"completion_tokens": 1}})


async def _with_router(tmp_path, replicas: Replicas, body, **config):
    router = Router(RouterConfig(backends=REPLICAS, policy="least-load", api_key="operator",
                                 api_keys_file=keys_file(tmp_path), remote_tokenize=False, **config),
                    client=httpx.AsyncClient(transport=httpx.MockTransport(replicas)))
    await router.start()
    app = build_app(router, manage_router=False)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router",
                                     timeout=30) as client:
            return await body(client)
    finally:
        await router.stop()


def post(client, key, headers=None, **body):
    return client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, **body},
                       headers={"Authorization": f"Bearer {key}", **(headers or {})})


@pytest.mark.timeout(30)
def test_a_tenant_limit_holds_across_replicas_and_the_tenant_reaches_the_replica(tmp_path):
    replicas = Replicas()

    async def body(client):
        batch = [asyncio.create_task(post(client, "batch-key")) for _ in range(2)]
        await asyncio.sleep(0.2)  # both in flight, on two replicas
        third = await post(client, "batch-key")  # one replica is idle, but batch holds 2 already
        chat = asyncio.create_task(post(client, "chat-key"))
        wrong = await post(client, "nobody")
        await asyncio.sleep(0.1)
        replicas.gate.set()
        done = await asyncio.gather(*batch, chat)
        after = await post(client, "batch-key")  # the limit counts requests in flight, not ever
        return third, wrong, done, after

    third, wrong, done, after = asyncio.run(_with_router(tmp_path, replicas, body))
    assert third.status_code == 429 and third.json()["error"]["code"] == "tenant_inflight_limit"
    assert int(third.headers["Retry-After"]) >= 1
    assert wrong.status_code == 401
    assert [r.status_code for r in done] == [200, 200, 200] and after.status_code == 200
    tenants = [h.get("x-gateway-inference-fairness-id") for _, h in replicas.seen]
    assert tenants.count("batch") == 3 and tenants.count("chat") == 1
    assert len({url for url, h in replicas.seen[:2]}) == 2  # batch's two were spread over replicas


@pytest.mark.timeout(30)
def test_the_objective_decides_who_is_shed(tmp_path):
    replicas = Replicas()

    async def body(client):
        hold = [asyncio.create_task(post(client, "operator")) for _ in range(3)]  # one per replica
        await asyncio.sleep(0.2)
        shed = await post(client, "operator", {"x-gateway-inference-objective": "bulk"})
        plain = await post(client, "operator")
        kept = asyncio.create_task(post(client, "operator", {"x-gateway-inference-objective": "premium"}))
        await asyncio.sleep(0.1)
        replicas.gate.set()
        return shed, plain, await kept, await asyncio.gather(*hold)

    shed, plain, kept, held = asyncio.run(_with_router(tmp_path, replicas, body, shed_load=1,
                                                       objectives={"premium": 100, "bulk": -10}))
    assert shed.status_code == 429 and plain.status_code == 429  # saturated: sheddable ones go
    assert kept.status_code == 200 and all(r.status_code == 200 for r in held)


def test_objectives_and_estimates():
    table = parse_objectives(["premium=100", "bulk=-10"])
    assert table == {"premium": 100, "bulk": -10}
    assert objective_priority("premium", table) == 100 and objective_priority("critical", table) == 2
    assert objective_priority("batch", table) == -2 and objective_priority(None, table) is None
    assert objective_priority("unknown-objective", table) == 0
    assert estimate_tokens("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 10, "n": 2}) == 23
    tenancy = RouterTenancy(None, table)
    caller = tenancy.caller({"x-gateway-inference-fairness-id": "team-a"}, "any")
    assert caller.tenant is None and caller.fairness_id == "team-a"  # no keys file: passed through


@pytest.mark.timeout(30)
def test_a_stored_response_is_asked_for_as_the_callers_tenant(tmp_path):
    """GET / DELETE /v1/responses/{id} reach the replica with the router's key: the replica
    must hear whose request it is (its owner check), and not whom the caller claims to be."""
    replicas = Replicas()
    replicas.gate.set()

    async def body(client):
        claim = {"Authorization": "Bearer chat-key", "x-gateway-inference-fairness-id": "batch"}
        await client.get("/v1/responses/resp_1", headers=claim)
        await client.delete("/v1/responses/resp_1", headers={"Authorization": "Bearer batch-key"})

    asyncio.run(_with_router(tmp_path, replicas, body))
    seen = [h.get("x-gateway-inference-fairness-id") for _, h in replicas.seen]
    assert seen == ["chat", "batch"]  # each answered by the first replica asked


def test_the_replica_is_told_the_tenant_and_class_of_the_key_not_what_the_client_claims(tmp_path):
    replicas = Replicas()
    replicas.gate.set()
    claims = {"x-gateway-inference-fairness-id": "chat", "x-gateway-inference-objective": "critical"}

    async def body(client):
        return [await post(client, "batch-key", claims),
                await post(client, "batch-key", {"x-gateway-inference-objective": "batch"}),
                await post(client, "chat-key"), await post(client, "operator", claims)]

    answers = asyncio.run(_with_router(tmp_path, replicas, body))
    assert all(r.status_code == 200 for r in answers)
    told = [(h.get("x-gateway-inference-fairness-id"), h.get("x-gateway-inference-objective"))
            for _, h in replicas.seen]
    assert told == [("batch", "normal"), ("batch", "batch"), ("chat", "normal"), ("default", "normal")]


def test_a_tenant_may_lower_its_priority_never_raise_it(tmp_path):
    tenancy = RouterTenancy(keys_file(tmp_path), {"premium": 100, "bulk": -10})
    low = tenancy.caller({"x-gateway-inference-objective": "premium"}, "batch-key")
    assert low.priority == 0 and low.objective == "normal"  # batch's class here is normal (2): priority 0
    shed = tenancy.caller({"x-gateway-inference-objective": "bulk"}, "batch-key")
    assert shed.priority == -10 and shed.objective == "12"  # lower than any named class: its number
    assert tenancy.caller({}, "chat-key").priority is None  # no objective: sheddable, as before

"""Classes come from keys, not requests, end to end: a real server (tiny model, keys file,
a router key) behind a real router on loopback. A low-class tenant that asks for the
critical class and names another tenant is scheduled and accounted as itself; the
operator's key with the same headers straight to the server is the operator; the router
key is trusted to name a tenant, never above that tenant's class."""
from __future__ import annotations

import json

import httpx
import pytest

from test_server_support import ThreadServer, make_tiny_app, placements
from tokenmill.bench.usage import parse_metrics
from tokenmill.router.config import RouterConfig
from tokenmill.router.server import RouterServer
from tokenmill.gateway.tenants import hash_key

pytestmark = pytest.mark.slow  # a real server and a real router on loopback

KEYS = {"oncall-key": "oncall", "bulk-key": "bulk"}
CRITICAL_AS_ONCALL = {"x-gateway-inference-objective": "critical", "x-gateway-inference-fairness-id": "oncall"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps({"tenants": {"oncall": {"priority_class": "critical"},
                                            "bulk": {"priority_class": "low"}},
                                "keys": [{"sha256": hash_key(k), "tenant": t} for k, t in KEYS.items()]}))
    app = make_tiny_app({"scheduling_policy": "fair", "max_num_seqs": 4}, api_key="operator",
                        api_keys_file=str(path), router_api_key=["router-key"], metrics_tenant_labels=True)
    try:
        with ThreadServer(app) as server:
            router = RouterServer(RouterConfig(backends=[server.url], port=0, api_keys_file=str(path),
                                               backend_api_key="router-key", remote_tokenize=False,
                                               health_interval=0.5)).start_in_thread()
            try:
                yield app, server.url, router.url
            finally:
                router.stop()
    finally:
        app.state.tokenmill.aengine.shutdown()


def post(url: str, key: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": "hello tenants", "max_tokens": 2, "temperature": 0},
                      headers={"Authorization": f"Bearer {key}", **(headers or {})}, timeout=60)


def test_through_the_router_a_tenant_is_its_own_tenant_and_class(stack, monkeypatch):
    app, _, router_url = stack
    state = app.state.tokenmill
    seen = placements(monkeypatch, state)
    before = parse_metrics(state.metrics.render().decode())
    calls = [("bulk-key", CRITICAL_AS_ONCALL), ("bulk-key", {"x-gateway-inference-objective": "batch"}),
             ("oncall-key", {})]
    for key, headers in calls:
        r = post(router_url, key, headers)
        assert r.status_code == 200, r.text
    assert seen == [("bulk", 3), ("bulk", 4), ("oncall", 0)]  # a tenant may lower its class, never raise it
    after = parse_metrics(state.metrics.render().decode())
    assert after["bulk"]["requests"] - before["bulk"]["requests"] == 2
    assert after["oncall"]["requests"] - before["oncall"]["requests"] == 1


def test_straight_to_the_server_only_the_router_key_names_a_tenant_and_never_above_its_class(stack, monkeypatch):
    app, server_url, _ = stack
    seen = placements(monkeypatch, app.state.tokenmill)
    for key, headers in [("operator", CRITICAL_AS_ONCALL), ("bulk-key", CRITICAL_AS_ONCALL),
                         ("router-key", {**CRITICAL_AS_ONCALL, "x-gateway-inference-fairness-id": "bulk"}),
                         ("router-key", CRITICAL_AS_ONCALL)]:
        r = post(server_url, key, headers)
        assert r.status_code == 200, r.text
    assert seen == [("default", 2), ("bulk", 3), ("bulk", 3), ("oncall", 0)]

"""Who owns what, through a real server on loopback (tiny model, uvicorn): the operator's key
(``--api-key``) and three keys-file tenants (two with ``adapter_dirs``, one without).

A tenant trying another's stored Response on every route, or another's adapter, gets the 404 of
an id never made, word for word; the operator reaches everything. Adapter administration and the
operator routes refuse tenants; no answer names a server path; bad adapters are 400s."""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Iterator

import httpx
import pytest

from test_auth_matrix import uvicorn_server
from test_lora import make_adapters
from test_server_support import make_tiny_app
from test_structured_server import TERSE_TEMPLATE
from tokenmill.entrypoints.console.console import mount_console
from tokenmill.gateway.tenants import hash_key

pytestmark = pytest.mark.slow

OP = "operator-key"
ROUTER = "router-key"
KEYS = {"alice-key": "alice", "bob-key": "bob", "carol-key": "carol"}
TENANT_KEYS = list(KEYS)
ALL_KEYS = [OP, *TENANT_KEYS]
UNKNOWN_ID = "resp_" + "0" * 32
ADAPTER = (4, 8, ["q_proj", "v_proj"])


def auth(key: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **extra}


def _nan_copy(src: str, dst: str) -> None:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights_file = os.path.join(dst, "adapter_model.safetensors")
    tensors = load_file(weights_file)
    first = sorted(tensors)[0]
    tensors[first] = tensors[first].clone()
    tensors[first].view(-1)[0] = float("nan")
    save_file(tensors, weights_file)


def _deep_copy(src: str, dst: str, depth: int = 100_000) -> None:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        f.write('{"r": 4, "x": ' + "[" * depth + "]" * depth + "}")


@pytest.fixture(scope="module")
def world(hf_tiny, tmp_path_factory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("owned")
    made = make_adapters(hf_tiny, root / "op", {"shared": ADAPTER}, 40)
    made |= make_adapters(hf_tiny, root / "alice", {"al": ADAPTER}, 41)
    made |= make_adapters(hf_tiny, root / "bob", {"bb": ADAPTER}, 42)
    made |= make_adapters(hf_tiny, root / "private", {"secret": ADAPTER}, 43)
    _nan_copy(made["al"][0], str(root / "alice" / "nan"))
    _deep_copy(made["al"][0], str(root / "alice" / "deep"))
    os.symlink(root / "bob" / "bb", root / "alice" / "escape")  # a link out of alice's folder
    linked = root / "alice" / "linked"  # a folder inside whose weights file links out
    linked.mkdir()
    shutil.copy(os.path.join(made["al"][0], "adapter_config.json"), linked)
    os.symlink(os.path.join(made["secret"][0], "adapter_model.safetensors"), linked / "adapter_model.safetensors")
    keys = root / "keys.yaml"
    keys.write_text(json.dumps({
        "tenants": {"alice": {"adapter_dirs": [str(root / "alice")]}, "bob": {"adapter_dirs": [str(root / "bob")]},
                    "carol": {}},
        "keys": [{"sha256": hash_key(k), "tenant": t} for k, t in KEYS.items()]}))
    app = make_tiny_app({"enable_lora": True, "max_loras": 2, "max_lora_rank": 16, "num_threads": 1},
                        chat_template=TERSE_TEMPLATE, api_key=OP, api_keys_file=str(keys), router_api_key=[ROUTER],
                        model_path=str(root / "models" / "tiny"),  # a server path /v1/models must not show
                        lora_modules=[("shared", made["shared"][0])])
    mount_console(app, ui=False)
    try:
        with uvicorn_server(app, "") as url, httpx.Client(base_url=url, timeout=60) as client:
            yield {"client": client, "root": str(root), "made": made, "app": app}
    finally:
        app.state.tokenmill.aengine.shutdown()


def respond(client: httpx.Client, key: str, text: str, **extra: Any) -> httpx.Response:
    body = {"input": text, "max_output_tokens": 3, "temperature": 0, **extra}
    return client.post("/v1/responses", json=body, headers=auth(key))


def same_as_unknown(hidden: httpx.Response, unknown: httpx.Response, hidden_id: str, unknown_id: str) -> bool:
    """Whether a refusal is the one a never-made id gets: same status and body, the id aside."""
    return (hidden.status_code == unknown.status_code == 404
            and hidden.text.replace(hidden_id, "ID") == unknown.text.replace(unknown_id, "ID"))


def response_routes(client: httpx.Client, key: str, rid: str) -> list[httpx.Response]:
    """Every route that reads, continues or removes a stored response, for ``rid``."""
    return [client.get(f"/v1/responses/{rid}", headers=auth(key)),
            client.get(f"/v1/responses/{rid}/input_items", headers=auth(key)),
            respond(client, key, "continue", previous_response_id=rid),
            client.delete(f"/v1/responses/{rid}", headers=auth(key))]


def test_stored_responses_are_their_tenants(world):
    client = world["client"]
    made = {key: respond(client, key, f"the private prompt of {key}").json()["id"] for key in ALL_KEYS}
    for key in ALL_KEYS:
        unknown = response_routes(client, key, UNKNOWN_ID)
        for owner, rid in made.items():
            if owner == key or key == OP:
                continue
            for hidden, missing in zip(response_routes(client, key, rid), unknown):
                assert same_as_unknown(hidden, missing, rid, UNKNOWN_ID), (key, owner, hidden.text)
    # nothing was deleted by those attempts: each owner and the operator still read every one
    for owner, rid in made.items():
        assert client.get(f"/v1/responses/{rid}", headers=auth(owner)).status_code == 200
        items = client.get(f"/v1/responses/{rid}/input_items", headers=auth(OP))
        assert items.status_code == 200 and items.json()["data"][0]["content"][0]["text"].endswith(owner)
    # the continuation is its owner's too, and the operator may continue anyone's
    follow = respond(client, "alice-key", "more", previous_response_id=made["alice-key"])
    assert follow.status_code == 200
    assert client.get(f"/v1/responses/{follow.json()['id']}", headers=auth("bob-key")).status_code == 404
    assert respond(client, OP, "more", previous_response_id=made["bob-key"]).status_code == 200
    # a router's key speaking for a tenant reaches that tenant's only
    as_alice = auth(ROUTER, **{"x-gateway-inference-fairness-id": "alice"})
    assert client.get(f"/v1/responses/{made['alice-key']}", headers=as_alice).status_code == 200
    assert client.get(f"/v1/responses/{made['bob-key']}", headers=as_alice).status_code == 404
    # neither the operator's key nor a tenant's can speak for another
    as_bob = auth("carol-key", **{"x-gateway-inference-fairness-id": "bob"})
    assert client.get(f"/v1/responses/{made['bob-key']}", headers=as_bob).status_code == 404
    op_as_bob = auth(OP, **{"x-gateway-inference-fairness-id": "bob"})
    assert client.get(f"/v1/responses/{made['alice-key']}", headers=op_as_bob).status_code == 200  # still the operator
    # the operator deletes anyone's
    assert client.delete(f"/v1/responses/{made['bob-key']}", headers=auth(OP)).status_code == 200
    assert client.get(f"/v1/responses/{made['bob-key']}", headers=auth("bob-key")).status_code == 404


def load(client: httpx.Client, key: str, name: str, path: str) -> httpx.Response:
    return client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, headers=auth(key))


def unload(client: httpx.Client, key: str, name: str) -> httpx.Response:
    return client.post("/v1/unload_lora_adapter", json={"lora_name": name}, headers=auth(key))


def complete(client: httpx.Client, key: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "hello", "max_tokens": 2, "temperature": 0}
    return client.post("/v1/completions", json=body, headers=auth(key))


def no_server_path(r: httpx.Response, root: str) -> bool:
    return root not in r.text and "/etc" not in r.text and os.path.dirname(root) not in r.text


def test_a_tenant_loads_only_from_its_folders_and_errors_name_no_path(world):
    client, root = world["client"], world["root"]
    refused = [load(client, "alice-key", "x", path) for path in (
        world["made"]["shared"][0],  # the operator's folder
        world["made"]["secret"][0],  # a folder no tenant may read
        "/etc", "/etc/passwd", os.path.join(root, "alice", "missing"), "missing",
        os.path.join(root, "alice", "..", "bob", "bb"), "../bob/bb",
        "escape",  # a symlink out of alice's folder
        "linked",  # inside, but its weights file links to another folder
    )]
    for r in refused:
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_lora_adapter", r.text
        assert no_server_path(r, root), r.text
    assert len({r.text for r in refused}) == 1  # one message: nothing tells the paths apart
    # a tenant without adapter_dirs administers nothing
    for r in (load(client, "carol-key", "x", "al"), unload(client, "carol-key", "shared")):
        assert r.status_code == 403 and r.json()["error"]["code"] == "operator_only"


def test_a_tenants_adapter_is_its_own(world):
    client, root = world["client"], world["root"]
    assert load(client, "alice-key", "al", "al").status_code == 200  # relative: inside its folder
    assert load(client, "bob-key", "bb", os.path.join(root, "bob", "bb")).status_code == 200
    try:
        models = {key: client.get("/v1/models", headers=auth(key)) for key in ALL_KEYS}
        ids = {key: {m["id"] for m in r.json()["data"]} for key, r in models.items()}
        assert ids[OP] == {"tiny", "shared", "al", "bb"}
        assert ids["alice-key"] == {"tiny", "shared", "al"} and ids["bob-key"] == {"tiny", "shared", "bb"}
        assert ids["carol-key"] == {"tiny", "shared"}
        for r in models.values():
            assert no_server_path(r, root), r.text
        assert complete(client, "alice-key", "al").status_code == 200
        assert complete(client, OP, "al").status_code == 200
        assert complete(client, "alice-key", "shared").status_code == 200
        # bob and carol: alice's adapter is a model that does not exist, on every route
        for key in ("bob-key", "carol-key"):
            hidden, missing = complete(client, key, "al"), complete(client, key, "nope")
            assert same_as_unknown(hidden, missing, "al", "nope"), hidden.text
            hidden, missing = (client.get(f"/v1/models/{m}", headers=auth(key)) for m in ("al", "nope"))
            assert same_as_unknown(hidden, missing, "al", "nope"), hidden.text
        hidden, missing = unload(client, "bob-key", "al"), unload(client, "bob-key", "nope")
        assert same_as_unknown(hidden, missing, "al", "nope"), hidden.text
        # nor can a tenant unload the operator's adapter, or take a name in use
        hidden, missing = unload(client, "alice-key", "shared"), unload(client, "alice-key", "nope")
        assert same_as_unknown(hidden, missing, "shared", "nope"), hidden.text
        taken = load(client, "alice-key", "shared", "al")
        assert taken.status_code == 400 and taken.json()["error"]["code"] == "lora_name_taken"
        assert complete(client, "carol-key", "shared").status_code == 200
        assert unload(client, "alice-key", "al").status_code == 200
        assert unload(client, OP, "bb").status_code == 200  # the operator unloads anyone's
    finally:
        for name in ("al", "bb"):
            unload(client, OP, name)


def test_nan_adapter_weights_are_a_400(world):
    client, root = world["client"], world["root"]
    for key, path in ((OP, os.path.join(root, "alice", "nan")), ("alice-key", "nan")):
        r = load(client, key, "bad", path)
        assert r.status_code == 400 and "NaN" in r.json()["error"]["message"] and no_server_path(r, root), r.text
    assert "bad" not in {m["id"] for m in client.get("/v1/models", headers=auth(OP)).json()["data"]}


def test_a_deeply_nested_adapter_config_is_a_400(world):
    client, root = world["client"], world["root"]
    for key, path in ((OP, os.path.join(root, "alice", "deep")), ("alice-key", "deep")):
        r = load(client, key, "bad", path)
        assert r.status_code == 400 and "nested deeper" in r.json()["error"]["message"], r.text
        assert no_server_path(r, root), r.text
    assert "bad" not in {m["id"] for m in client.get("/v1/models", headers=auth(OP)).json()["data"]}
    assert complete(client, OP, "tiny").status_code == 200  # still serving


def test_a_tenant_cannot_flush_caches_or_read_operator_data(world):
    client = world["client"]
    for key in TENANT_KEYS:
        for r in (client.post("/reset_prefix_cache", headers=auth(key)),
                  client.get("/v1/engine/stats", headers=auth(key))):
            assert r.status_code == 403 and r.json()["error"]["code"] == "operator_only", r.text
        own = client.get("/v1/usage", headers=auth(key)).json()["tenants"]
        assert set(own) == {KEYS[key]}
    assert client.post("/reset_prefix_cache", headers=auth(OP)).status_code == 200
    assert client.get("/v1/engine/stats", headers=auth(OP)).status_code == 200
    assert {"alice", "bob", "carol", "default"} <= set(client.get("/v1/usage", headers=auth(OP)).json()["tenants"])


def test_metrics_name_no_tenant_by_default(world):
    """/metrics needs no key: it names no tenant (its usage series are sums)."""
    client = world["client"]
    assert complete(client, "alice-key", "tiny").status_code == 200
    text = client.get("/metrics").text
    assert "tokenmill:tenant_output_tokens_total" in text
    assert not any(name in text for name in ("alice", "bob", "carol"))


def test_tokenmill_usage_reads_every_tenant_with_the_operator_key(world, capsys):
    import argparse

    from tokenmill.bench.usage import usage_main

    client = world["client"]
    assert complete(client, "bob-key", "tiny").status_code == 200
    url = str(client.base_url).rstrip("/")
    args = argparse.Namespace(metrics=url, capture=None, baseline=None, cost_per_hour=2.0, duration=60.0,
                              json=True, api_key=OP)
    assert usage_main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"alice", "bob", "carol", "default"} <= {t["tenant"] for t in report["tenants"]}
    # without the key, /metrics alone has no tenant to bill
    assert usage_main(argparse.Namespace(**{**vars(args), "api_key": None})) == 1

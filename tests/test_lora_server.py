"""LoRA adapters over HTTP (in-process, tiny model): `model` selects an adapter, /v1/models
lists them with their parent, adapters beyond --max-loras load on demand, hot load and
unload behind the API key, bad adapters refused with a 400 while the server keeps serving."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from test_lora import _reference, make_adapters
from test_server_support import make_tiny_app

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
SPECS = {"a": (8, 16, ["q_proj", "v_proj"]), "b": (4, 8, ["down_proj", "o_proj"]),
         "c": (16, 16, ["k_proj", "gate_proj", "up_proj"]), "hot": (16, 32, ["q_proj", "k_proj", "v_proj",
                                                                             "o_proj"])}


@pytest.fixture(scope="module")
def made(hf_tiny, tmp_path_factory):
    return make_adapters(hf_tiny, tmp_path_factory.mktemp("served_adapters"), SPECS, 20)


@pytest.fixture(scope="module")
def app(made):
    app = make_tiny_app({"enable_lora": True, "max_loras": 2, "max_lora_rank": 16, "num_threads": 1},
                        api_key=KEY, lora_modules=[(n, made[n][0]) for n in ("a", "b", "c")])
    yield app
    app.state.tokenmill.aengine.shutdown()


async def _call(app, method, path, body=None, headers=AUTH):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                 timeout=60) as client:
        return await client.request(method, path, json=body, headers=headers)


def call(app, method, path, body=None, headers=AUTH):
    return asyncio.run(_call(app, method, path, body, headers))


def _complete(app, model, prompt, max_tokens=8):
    r = call(app, "POST", "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                              "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_models_lists_adapters_with_parent(app, made):
    data = call(app, "GET", "/v1/models").json()["data"]
    by_id = {m["id"]: m for m in data}
    assert by_id["tiny"].get("parent") is None
    for name in ("a", "b", "c"):
        assert by_id[name]["parent"] == "tiny" and by_id[name]["root"] == name  # a name, never the folder
    assert call(app, "GET", "/v1/models/b").json()["parent"] == "tiny"


def test_model_field_selects_the_adapter_beyond_max_loras(app, made, hf_tiny):
    prompt = [5, 17, 99, 3, 42, 7, 8, 120, 33]
    state = app.state.tokenmill
    for name in ("a", "b", "c", "a", None):  # three adapters through two resident slots
        body = {"model": name or "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "logprobs": 0}
        r = call(app, "POST", "/v1/completions", body)
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["logprobs"]["tokens"]
        model = made[name][1] if name else hf_tiny
        ref = [state.token_text(t) for t in _reference(model, prompt, 8)]
        assert got == ref, name
        assert len(state.adapters.resident_names()) <= 2
    assert set(state.adapters.resident_names()) == {"a", "c"}  # b was the least recently used


def test_chat_with_an_adapter(app):
    body = {"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = call(app, "POST", "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "b"
    assert call(app, "POST", "/v1/chat/completions", {**body, "model": "nope"}).status_code == 404


def test_hot_load_and_unload_behind_the_key(app, made, tmp_path):
    body = {"lora_name": "hot", "lora_path": made["hot"][0]}
    assert call(app, "POST", "/v1/load_lora_adapter", body, headers={}).status_code == 401
    assert call(app, "POST", "/v1/unload_lora_adapter", {"lora_name": "a"}, headers={}).status_code == 401
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"r": 64, "lora_alpha": 8, "target_modules": ["q_proj"]}))
    for path, words in ((str(tmp_path / "missing"), "is not a folder"), (str(bad), "--max-lora-rank")):
        r = call(app, "POST", "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": path})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert _complete(app, "a", "still serving")["choices"][0]["text"]
    r = call(app, "POST", "/v1/load_lora_adapter", body)
    assert r.status_code == 200, r.text
    assert call(app, "POST", "/v1/load_lora_adapter", body).status_code == 400  # the name is taken
    assert _complete(app, "hot", "hello")["model"] == "hot"
    assert "hot" in {m["id"] for m in call(app, "GET", "/v1/models").json()["data"]}
    assert call(app, "POST", "/v1/unload_lora_adapter", {"lora_name": "hot"}).status_code == 200
    assert call(app, "POST", "/v1/unload_lora_adapter", {"lora_name": "hot"}).status_code == 404
    r = call(app, "POST", "/v1/completions", {"model": "hot", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 404


def test_hot_load_while_streams_run(app, made):
    async def stream(client, model, i):
        body = {"model": model, "prompt": f"stream {i}", "max_tokens": 96, "stream": True, "ignore_eos": True}
        finish = None
        async with client.stream("POST", "/v1/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    assert "error" not in event, line
                    finish = event["choices"][0]["finish_reason"] or finish
        return finish, time.monotonic()

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=120) as client:
            tasks = [asyncio.create_task(stream(client, m, i)) for i, m in enumerate(["a", "tiny", "c", "a"] * 2)]
            await asyncio.sleep(0.05)
            started = time.monotonic()
            r = await client.post("/v1/load_lora_adapter", json={"lora_name": "hot2", "lora_path": made["hot"][0]},
                                  headers=AUTH)
            loaded = time.monotonic()
            ends = await asyncio.gather(*tasks)
            return r, loaded - started, loaded, ends

    r, took, loaded, ends = asyncio.run(scenario())
    assert r.status_code == 200, r.text
    assert [finish for finish, _ in ends] == ["length"] * 8
    assert max(end for _, end in ends) > loaded  # the load happened while streams ran
    assert took < 5.0  # within 1 s when the machine is not shared; generous here
    assert call(app, "POST", "/v1/unload_lora_adapter", {"lora_name": "hot2"}).status_code == 200


def test_lora_requests_info_gauge(app):
    from prometheus_client.parser import text_string_to_metric_families

    from tokenmill.router.models import resident_from_metrics

    state = app.state.tokenmill

    async def scrape_while_held():
        adapter_id = await state.adapters.acquire("b")  # a request holding b, not started yet
        try:
            waiting = call_text()
            state.adapters.started(adapter_id)
            running = call_text()
        finally:
            state.adapters.release(adapter_id, started=True)
        return waiting, running

    def call_text():
        return state.metrics.render().decode()

    waiting, running = asyncio.run(scrape_while_held())

    def info(text):
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "vllm:lora_requests_info":
                    return s.labels
        raise AssertionError("no vllm:lora_requests_info")

    assert info(waiting) == {"running_lora_adapters": "", "waiting_lora_adapters": "b", "max_lora": "2"}
    assert info(running) == {"running_lora_adapters": "b", "waiting_lora_adapters": "", "max_lora": "2"}
    assert "b" in resident_from_metrics(text_string_to_metric_families(running))
    assert info(call_text())["running_lora_adapters"] == ""

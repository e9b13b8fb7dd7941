"""Several base models behind one server (entrypoints/server/model_set.py): loaded on first use,
swapped under --max-loaded-models, unloaded when idle, requests waiting for a load, the
/v1/models states and the model-set metrics. Two tiny random Llamas (different weights)
written as Hugging Face folders; the server is built from a real `tokenmill serve` command
line and served by uvicorn in a thread."""
from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from typing import Any

import httpx
import pytest

from conftest import save_tiny_hf_folder, wait_until
from test_server_support import ThreadServer, metric

ENGINE_FLAGS = ["--dtype", "float32", "--quantization", "none", "--num-blocks", "64",
                "--max-num-batched-tokens", "256", "--no-ui"]
GREEDY = {"prompt": "hello there", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    save_tiny_hf_folder(root / "alpha", seed=0)
    save_tiny_hf_folder(root / "beta", seed=1)
    (root / "notes.txt").write_text("not a model")
    return root


def parse_serve(*argv: str) -> Any:
    from tokenmill.entrypoints.cli.main import build_parser
    from tokenmill.entrypoints.cli.serve_cli import finalize_serve_args

    args = build_parser().parse_args(["serve", *argv])
    problem = finalize_serve_args(args)
    if problem:
        raise ValueError(problem)
    return args


def set_app(*argv: str, slow_load_s: float = 0.0) -> Any:
    """The app `tokenmill serve *argv` builds for several models (lifecycle.py), its loads
    slowed by ``slow_load_s`` when asked."""
    from tokenmill.entrypoints.server import lifecycle
    from tokenmill.entrypoints.server.app import build_model_set_app
    from tokenmill.entrypoints.server.model_set import ModelSet, ModelSetOptions
    from tokenmill.entrypoints.cli.serve_config import settings_from_args
    from tokenmill.entrypoints.server.serving import ServerShared

    args = parse_serve(*argv, *ENGINE_FLAGS)
    if not slow_load_s:
        return lifecycle._model_set_app(args, settings_from_args(args))
    settings = settings_from_args(args)
    shared = ServerShared.from_settings(settings)
    load = lifecycle.model_loader(args, settings, shared, 2)

    def slow(spec: Any) -> Any:
        time.sleep(slow_load_s)
        return load(spec)

    options = ModelSetOptions(max_loaded=args.max_loaded_models, idle_unload_s=args.idle_unload_seconds,
                              load_timeout_s=args.model_load_timeout, max_waiters=args.max_load_waiters)
    return build_model_set_app(ModelSet(args.model_set, slow, options), settings, shared)


def alone_app(path: str) -> Any:
    """The same model served alone: the one-model path of `tokenmill serve`."""
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.entrypoints.server import lifecycle
    from tokenmill.entrypoints.server.app import build_app
    from tokenmill.entrypoints.cli.serve_config import engine_config_from_args, settings_from_args

    args = parse_serve("--model", path, *ENGINE_FLAGS)
    engine = lifecycle._start_engine(args, engine_config_from_args(args))
    return build_app(AsyncEngine(engine), settings_from_args(args))


def states(url: str) -> dict[str, str]:
    cards = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    return {card["id"]: card["status"]["value"] for card in cards}


def complete(url: str, model: str, timeout: float = 120) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={**GREEDY, "model": model}, timeout=timeout)



def test_unloaded_model_loads_on_first_request_like_served_alone(model_dir):
    app = set_app("--models-dir", str(model_dir))
    try:
        with ThreadServer(app) as srv:
            assert states(srv.url) == {"alpha": "unloaded", "beta": "unloaded"}
            resp = complete(srv.url, "beta")
            assert resp.status_code == 200, resp.text
            assert resp.json()["model"] == "beta"
            beta_text = resp.json()["choices"][0]["text"]
            assert states(srv.url) == {"alpha": "unloaded", "beta": "loaded"}
            card = httpx.get(srv.url + "/v1/models/beta", timeout=10).json()
            assert card["status"]["value"] == "loaded" and card["max_model_len"] > 0
            alpha_text = complete(srv.url, "alpha").json()["choices"][0]["text"]
            assert states(srv.url) == {"alpha": "loaded", "beta": "loaded"}
            assert alpha_text != beta_text  # two models, two sets of weights
            text = httpx.get(srv.url + "/metrics", timeout=10).text
            assert metric(text, "tokenmill:models_loaded") == 2
            assert metric(text, "tokenmill:model_loads_total", model_name="beta") == 1
            # each model's own series are labelled with its name
            assert metric(text, "vllm:generation_tokens_total", model_name="alpha") == 8
            assert metric(text, "vllm:generation_tokens_total", model_name="beta") == 8
            bad = httpx.post(srv.url + "/v1/completions", json={**GREEDY, "model": "gamma"}, timeout=10)
            assert bad.status_code == 404 and bad.json()["error"]["code"] == "model_not_found"
            missing = httpx.post(srv.url + "/v1/completions", json=GREEDY, timeout=10)
            assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"
            assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
            tok = httpx.post(srv.url + "/tokenize", json={"model": "alpha", "prompt": "hi"}, timeout=10)
            assert tok.status_code == 200 and tok.json()["count"] == 2
    finally:
        app.state.tokenmill.close()
    for name, text in (("beta", beta_text), ("alpha", alpha_text)):
        alone = alone_app(str(model_dir / name))
        try:
            with ThreadServer(alone) as srv:
                resp = complete(srv.url, name)
                assert resp.status_code == 200, resp.text
                assert resp.json()["choices"][0]["text"] == text
        finally:
            alone.state.tokenmill.close()
            alone.state.tokenmill.aengine.shutdown()


def test_max_loaded_models_one_swaps_them(model_dir):
    app = set_app("--model", str(model_dir / "alpha"), "--model", str(model_dir / "beta"),
                  "--max-loaded-models", "1")
    try:
        with ThreadServer(app) as srv:
            assert complete(srv.url, "alpha").status_code == 200
            assert states(srv.url) == {"alpha": "loaded", "beta": "unloaded"}
            assert complete(srv.url, "beta").status_code == 200
            assert states(srv.url) == {"alpha": "unloaded", "beta": "loaded"}
            assert complete(srv.url, "alpha").status_code == 200
            assert states(srv.url) == {"alpha": "loaded", "beta": "unloaded"}
            text = httpx.get(srv.url + "/metrics", timeout=10).text
            assert metric(text, "tokenmill:models_loaded") == 1
            assert metric(text, "tokenmill:model_loads_total", model_name="alpha") == 2
            assert metric(text, "tokenmill:model_unloads_total", model_name="alpha", reason="lru") == 1
            assert metric(text, "tokenmill:model_unloads_total", model_name="beta", reason="lru") == 1
    finally:
        app.state.tokenmill.close()


def test_a_model_with_a_request_in_flight_is_not_unloaded(model_dir):
    app = set_app("--models-dir", str(model_dir), "--max-loaded-models", "1", "--model-load-timeout", "0.5")
    models = app.state.tokenmill.models
    try:
        with ThreadServer(app) as srv:
            # a load outlasts the half-second wait on a busy machine: a 503 does not stop it
            assert wait_until(lambda: complete(srv.url, "alpha").status_code == 200, 60, 0.2)
            assert [e.leases for e in models.entries()] == [0, 0]  # the response was sent: lease given back
            asyncio.run(models.acquire("alpha"))  # a request on alpha, still running
            refused = complete(srv.url, "beta", timeout=30)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "model_not_ready"
            assert int(refused.headers["retry-after"]) >= 1
            assert states(srv.url) == {"alpha": "loaded", "beta": "unloaded"}
            models.release("alpha")
            # alpha is idle now: it makes room (beta's load may outlast one half-second wait)
            assert wait_until(lambda: complete(srv.url, "beta").status_code == 200, 60, 0.2)
            assert states(srv.url) == {"alpha": "unloaded", "beta": "loaded"}
    finally:
        app.state.tokenmill.close()


def test_idle_model_unloads_after_its_timeout(model_dir):
    app = set_app("--models-dir", str(model_dir), "--idle-unload-seconds", "0.5")
    try:
        with ThreadServer(app) as srv:
            assert complete(srv.url, "alpha").status_code == 200
            engine = weakref.ref(app.state.tokenmill.models.loaded()[0].engine)
            assert wait_until(lambda: states(srv.url)["alpha"] == "unloaded")
            text = httpx.get(srv.url + "/metrics", timeout=10).text
            assert metric(text, "tokenmill:model_unloads_total", model_name="alpha", reason="idle") == 1
            assert metric(text, "tokenmill:models_loaded") == 0
            gc.collect()
            assert engine() is None  # the engine (and its KV pool) is gone, not just forgotten
            assert complete(srv.url, "alpha").status_code == 200  # and loads again on use
    finally:
        app.state.tokenmill.close()


def _rss_mib() -> float:
    with open("/proc/self/status", encoding="ascii") as fh:
        return next(int(line.split()[1]) / 1024 for line in fh if line.startswith("VmRSS:"))


def test_swapping_models_leaves_nothing_behind(model_dir):
    """Each swap loads one model and unloads the other, both after a constrained request (a
    grammar compiled, masks filled on their threads): once a model is unloaded, its engine,
    its structured-output state and its tokenizer are gone, the thread count stays where it
    was after warm-up, and the process's resident memory grows by little over the swaps."""
    app = set_app("--model", str(model_dir / "alpha"), "--model", str(model_dir / "beta"),
                  "--max-loaded-models", "1")
    models = app.state.tokenmill.models
    constrained = {"max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": "a number"}],
                   "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
                       "type": "object", "properties": {"n": {"type": "integer"}}}}}}

    def swap(i: int) -> list[weakref.ref]:
        name = ("alpha", "beta")[i % 2]
        for path, body in (("/v1/chat/completions", constrained), ("/v1/completions", GREEDY)):
            r = httpx.post(srv.url + path, json={**body, "model": name}, timeout=120)
            assert r.status_code == 200, r.text
        engine = models.loaded()[0].engine
        return [weakref.ref(engine), weakref.ref(engine.structured), weakref.ref(engine.tokenizer)]

    try:
        with ThreadServer(app) as srv:
            for i in range(4):  # warm-up: both models loaded twice, allocator arenas grown
                swap(i)
            gc.collect()
            threads, rss = threading.active_count(), _rss_mib()
            previous = swap(4)
            for i in range(5, 17):
                current = swap(i)  # loading this one unloaded the previous one
                gc.collect()
                alive = [type(ref()).__name__ for ref in previous if ref() is not None]
                assert alive == [], f"swap {i}: the unloaded model's {alive} are still in memory"
                previous = current
            gc.collect()
            assert threading.active_count() <= threads, [t.name for t in threading.enumerate()]
            assert _rss_mib() < rss * 1.15, (rss, _rss_mib())  # generous: the check above is the exact one
    finally:
        app.state.tokenmill.close()


def test_requests_waiting_for_a_loading_model_succeed(model_dir):
    app = set_app("--models-dir", str(model_dir), slow_load_s=1.0)
    try:
        with ThreadServer(app) as srv:
            results: list[int] = []

            def one() -> None:
                results.append(complete(srv.url, "alpha").status_code)

            threads = [threading.Thread(target=one) for _ in range(4)]
            for t in threads:
                t.start()
            assert wait_until(lambda: states(srv.url)["alpha"] == "loading", 5)
            # the other model, and the server, answer while it loads
            assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
            for t in threads:
                t.join(60)
            assert results == [200] * 4
            text = httpx.get(srv.url + "/metrics", timeout=10).text
            assert metric(text, "tokenmill:model_loads_total", model_name="alpha") == 1
    finally:
        app.state.tokenmill.close()


def test_waiting_is_bounded(model_dir):
    # the second request must arrive while the first still waits: a wait of 1.5 s leaves a busy
    # machine room for that, and the 4-second load outlasts it
    app = set_app("--models-dir", str(model_dir), "--model-load-timeout", "1.5", "--max-load-waiters", "1",
                  slow_load_s=4.0)
    try:
        with ThreadServer(app) as srv:
            first: list[httpx.Response] = []
            t = threading.Thread(target=lambda: first.append(complete(srv.url, "alpha")))
            t.start()
            assert wait_until(lambda: states(srv.url)["alpha"] == "loading", 5)
            crowded = complete(srv.url, "alpha")  # the one waiter's place is taken
            t.join(30)
            assert crowded.status_code == 429 and crowded.json()["error"]["code"] == "model_load_queue_full"
            assert first[0].status_code == 503 and first[0].json()["error"]["code"] == "model_not_ready"
            assert "retry-after" in first[0].headers
            assert wait_until(lambda: states(srv.url)["alpha"] == "loaded", 20)  # the load itself went on
            assert complete(srv.url, "alpha").status_code == 200
    finally:
        app.state.tokenmill.close()


def test_command_line_checks(model_dir):
    alpha, beta = str(model_dir / "alpha"), str(model_dir / "beta")
    args = parse_serve("--model", alpha, "--model", beta)
    assert [(s.name, s.path) for s in args.model_set] == [("alpha", alpha), ("beta", beta)]
    assert parse_serve("--model", alpha).model_set is None  # one model: the one-model server
    assert [s.name for s in parse_serve("--models-dir", str(model_dir)).model_set] == ["alpha", "beta"]
    for argv, words in ((["--model", alpha, "--max-loaded-models", "1"], "several models"),
                        (["--model", alpha, "--model", beta, "--served-model-name", "x"], "--served-model-name"),
                        (["--model", alpha, "--model", str(model_dir / "nope")], "not a local file"),
                        (["--models-dir", str(model_dir / "notes.txt")], "not a folder"),
                        (["--model", alpha, "--model", beta, "--enable-lora"], "--enable-lora")):
        with pytest.raises(ValueError, match=words):
            parse_serve(*argv)


def test_same_name_twice_is_refused(tmp_path):
    save_tiny_hf_folder(tmp_path / "a" / "same", seed=0)
    save_tiny_hf_folder(tmp_path / "b" / "same", seed=1)
    with pytest.raises(ValueError, match="two models would be served as 'same'"):
        parse_serve("--model", str(tmp_path / "a" / "same"), "--model", str(tmp_path / "b" / "same"))


def test_router_routes_to_a_replica_listing_an_unloaded_model():
    from tokenmill.router.models import parse_models

    body = {"data": [{"id": "alpha", "status": {"value": "loaded"}},
                     {"id": "beta", "status": {"value": "unloaded"}}]}
    ids, adapters = parse_models(body)
    assert ids == {"alpha", "beta"} and not adapters  # an unloaded model is still served there


@pytest.mark.slow
def test_a_tenant_sees_no_server_path_of_a_model_set(model_dir, tmp_path):
    """/v1/models' root is a name, and a failed load's reason (which names the folder) is the
    operator's to read: a tenant gets the failure without it."""
    from tokenmill.gateway.tenants import hash_key

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    keys = tmp_path / "keys.json"
    keys.write_text('{"tenants": {"team": {}}, "keys": [{"sha256": "%s", "tenant": "team"}]}' % hash_key("team-key"))
    app = set_app("--model", str(model_dir / "alpha"), "--model", str(broken), "--api-key", "op-key",
                  "--api-keys-file", str(keys))
    team, op = {"Authorization": "Bearer team-key"}, {"Authorization": "Bearer op-key"}
    try:
        with ThreadServer(app) as srv:
            failed = httpx.post(srv.url + "/v1/completions", json={**GREEDY, "model": "broken"}, headers=team,
                                timeout=60)
            assert failed.status_code == 500 and failed.json()["error"]["code"] == "model_load_failed"
            assert str(tmp_path) not in failed.text
            listed = httpx.get(srv.url + "/v1/models", headers=team, timeout=10)
            assert listed.status_code == 200 and str(tmp_path) not in listed.text
            assert str(model_dir) not in listed.text
            assert {c["root"] for c in listed.json()["data"]} == {"alpha", "broken"}
            cards = {c["id"]: c for c in httpx.get(srv.url + "/v1/models", headers=op, timeout=10).json()["data"]}
            assert cards["broken"]["status"]["failed"] and cards["broken"]["status"]["error"]
    finally:
        app.state.tokenmill.close()

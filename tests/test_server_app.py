"""The server in-process over the tiny random model (fast): wire format, streaming,
errors, limits, metrics, prefix-cache visibility, capture."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
import pytest

from test_server_support import make_tiny_app, metric

LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 2  # 90 byte-tokens: 5 full blocks


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _post(app: Any, path: str, body: Any = None, headers: dict[str, str] | None = None,
                raw: bytes | None = None) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                 timeout=60) as client:
        if raw is not None:
            return await client.post(path, content=raw, headers={"content-type": "application/json",
                                                                  **(headers or {})})
        return await client.post(path, json=body, headers=headers)


async def _get(app: Any, path: str) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        return await client.get(path)


def post(app: Any, path: str, body: Any = None, **kw: Any) -> httpx.Response:
    return run(_post(app, path, body, **kw))


def get(app: Any, path: str) -> httpx.Response:
    return run(_get(app, path))


def sse_events(text: str) -> list[Any]:
    """Parsed ``data:`` payloads; the literal ``[DONE]`` stays a string."""
    events = []
    for block in text.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


@pytest.fixture(scope="module")
def app():
    app = make_tiny_app()
    yield app
    app.state.tokenmill.aengine.shutdown()


def _idle(app: Any) -> None:
    """Every request has ended: no block may be held by anyone."""
    engine = app.state.tokenmill.engine
    deadline = time.monotonic() + 5
    while engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.pool.usage == 0
    engine.check_idle_invariants()


# ---- completions -----------------------------------------------------------------

def test_completion_usage_and_length(app):
    r = post(app, "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 7, "ignore_eos": True,
                                      "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == 5  # one byte-level token per character
    assert body["usage"]["completion_tokens"] == 7
    assert body["usage"]["total_tokens"] == 12
    _idle(app)


def test_completion_batch_of_prompts_times_n(app):
    r = post(app, "/v1/completions", {"prompt": [[97, 98], [10, 11, 12]], "n": 2, "max_tokens": 3,
                                      "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == 2 + 3
    assert body["usage"]["completion_tokens"] == 4 * 3


def test_completion_echo_and_logprobs(app):
    r = post(app, "/v1/completions", {"prompt": "echo me", "max_tokens": 2, "echo": True, "temperature": 0})
    assert r.json()["choices"][0]["text"].startswith("echo me")
    r = post(app, "/v1/completions", {"prompt": "abc", "max_tokens": 6, "logprobs": 3, "ignore_eos": True})
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    assert all(v <= 0 for v in lp["token_logprobs"])
    assert all(1 <= len(top) <= 4 for top in lp["top_logprobs"])  # k alternatives, plus the chosen one
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0


def test_greedy_stream_matches_non_stream_and_reports_usage(app):
    body = {"prompt": "stream me", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    plain = post(app, "/v1/completions", body).json()
    r = post(app, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 12
    assert usage_chunk["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    text_chunks = chunks[:-1]
    assert all(c["usage"] is None for c in text_chunks)
    assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == plain["choices"][0]["text"]
    assert len(text_chunks) >= 3  # tokens were sent as they came, not in one piece


def test_stop_string_is_honoured(app):
    base = {"prompt": "stop test", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    text = post(app, "/v1/completions", base).json()["choices"][0]["text"]
    stops = [ch for ch in text[2:] if ch.isascii() and ch.isalnum()]
    if not stops:
        pytest.skip("the random model produced no ASCII character to stop on")
    stop = stops[0]
    out = post(app, "/v1/completions", {**base, "stop": [stop]}).json()["choices"][0]
    assert out["finish_reason"] == "stop" and out["stop_reason"] == stop
    assert out["text"] == text[: text.index(stop)]


def test_seed_reproducible(app):
    body = {"prompt": "seeded", "max_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    a = post(app, "/v1/completions", {**body, "seed": 7}).json()["choices"][0]["text"]
    b = post(app, "/v1/completions", {**body, "seed": 7}).json()["choices"][0]["text"]
    c = post(app, "/v1/completions", {**body, "seed": 8}).json()["choices"][0]["text"]
    assert a == b and a != c


# ---- chat ----------------------------------------------------------------------

def test_chat_stream_role_first_and_finish_per_choice(app):
    r = post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                           "n": 2, "stream": True, "ignore_eos": True})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[-1]["finish_reason"] == "length" and mine[-1]["delta"] == {}
        assert all(m["finish_reason"] is None for m in mine[:-1])


def test_chat_non_stream_logprobs_and_max_completion_tokens(app):
    r = post(app, "/v1/chat/completions", {"messages": [{"role": "system", "content": "be brief"},
                                                        {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                           "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 2,
                                           "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    content = choice["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"] == 5
    assert all(len(t["top_logprobs"]) == 2 and t["logprob"] <= 0 for t in content)


def test_max_output_tokens_caps_and_defaults():
    app = make_tiny_app(max_output_tokens=3)
    try:
        r = post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 3
        r = post(app, "/v1/completions", {"prompt": "x", "max_tokens": 50, "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 3
    finally:
        app.state.tokenmill.aengine.shutdown()


# ---- errors ----------------------------------------------------------------------

ERROR_CASES = [
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": 5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 17}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "stop": ["s"] * 17}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [10 ** 12]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1], "min_tokens": 2}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [5, 300]}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", ["not", "an", "object"], 400, None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     400, "tools"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "prompt"),
    ("/detokenize", {"tokens": [1, -4]}, 400, "tokens"),
]


def _check_error_shape(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


@pytest.mark.parametrize("path,body,status,param", ERROR_CASES)
def test_bad_requests_get_openai_errors(app, path, body, status, param):
    err = _check_error_shape(post(app, path, body), status)
    if param is not None:
        assert err["param"] == param, err


def test_malformed_json_and_unknown_routes(app):
    err = _check_error_shape(post(app, "/v1/completions", raw=b'{"prompt": "x",'), 400)
    assert "JSON" in err["message"]
    _check_error_shape(get(app, "/v1/nothing"), 404)
    _check_error_shape(get(app, "/v1/completions"), 405)


@pytest.mark.parametrize("raw", [rb'{"prompt": "a\ud800b"}', rb'{"prompt": "x", "model": "\udfff"}',
                                 rb'{"messages": [{"role": "user", "content": "\ud83d"}]}'])
def test_lone_surrogates_are_rejected(app, raw):
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    err = _check_error_shape(post(app, path, raw=raw), 400)
    assert "Unicode" in err["message"]


def test_extreme_but_valid_values_work(app):
    body = {"prompt": "ab", "max_tokens": 2, "temperature": 2, "top_k": 1 << 20, "n": 16,
            "seed": (1 << 64) - 1, "min_tokens": 1 << 20, "stop_token_ids": [0, 256]}
    r = post(app, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 16
    assert post(app, "/v1/completions", {**body, "seed": -(1 << 63)}).status_code == 200


def test_context_overflow_states_both_numbers(app):
    state = app.state.tokenmill
    n = state.max_model_len - 10
    err = _check_error_shape(post(app, "/v1/completions", {"prompt": "a" * n, "max_tokens": 50}), 400)
    assert str(n) in err["message"] and "50" in err["message"]
    assert err["code"] == "context_length_exceeded"
    err = _check_error_shape(post(app, "/v1/completions", {"prompt": "a" * (state.max_model_len + 5)}), 400)
    assert str(state.max_model_len + 5) in err["message"] and str(state.max_model_len) in err["message"]
    _idle(app)


def test_api_key_required():
    app = make_tiny_app(api_key="sekret")
    try:
        body = {"prompt": "x", "max_tokens": 1}
        err = _check_error_shape(post(app, "/v1/completions", body), 401)
        assert err["code"] == "invalid_api_key"
        _check_error_shape(post(app, "/v1/completions", body, headers={"Authorization": "Bearer nope"}), 401)
        # a bad key is a 401 even when the body is garbage
        _check_error_shape(post(app, "/v1/completions", raw=b"{", headers={"Authorization": "Bearer x"}), 401)
        ok = post(app, "/v1/completions", body, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        assert get(app, "/health").status_code == 200  # probes need no key
        assert get(app, "/metrics").status_code == 200
    finally:
        app.state.tokenmill.aengine.shutdown()


def test_queue_full_gets_429_with_retry_after():
    app = make_tiny_app(max_waiting=2)
    state = app.state.tokenmill

    async def scenario() -> list[int]:
        # stall the engine thread so admitted requests pile up before it
        release = threading.Event()
        stall = state.aengine.call(lambda engine: release.wait(30))
        await asyncio.sleep(0.05)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     timeout=30) as client:
            body = {"prompt": "queued", "max_tokens": 2}
            first = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(2)]
            for _ in range(200):  # both admitted and parked behind the stalled engine thread
                if state.num_waiting() == 2:
                    break
                await asyncio.sleep(0.05)
            assert state.num_waiting() == 2
            refused = await client.post("/v1/completions", json=body)
            err = _check_error_shape(refused, 429)
            assert err["code"] == "queue_full"
            assert int(refused.headers["retry-after"]) >= 1
            release.set()
            await stall
            done = await asyncio.gather(*first)
            return [r.status_code for r in done]

    try:
        assert run(scenario()) == [200, 200]
        assert post(app, "/v1/completions", {"prompt": "after", "max_tokens": 1}).status_code == 200
        assert metric(get(app, "/metrics").text, "tokenmill:requests_rejected_total", reason="queue_full") == 1
    finally:
        state.aengine.shutdown()


def test_draining_refuses_new_work(app):
    state = app.state.tokenmill
    state.draining = True
    try:
        err = _check_error_shape(post(app, "/v1/completions", {"prompt": "x"}), 503)
        assert err["code"] == "shutting_down"
        assert get(app, "/health").status_code == 503
    finally:
        state.draining = False
    assert get(app, "/health").status_code == 200


# ---- other endpoints ---------------------------------------------------------------

def test_models_tokenize_detokenize(app):
    models = get(app, "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    tok = post(app, "/tokenize", {"prompt": "héllo", "model": "tiny"}).json()
    assert tok["count"] == len(tok["tokens"]) == 6  # é is two bytes
    assert "token_strs" not in tok
    spelled = post(app, "/tokenize", {"prompt": "héllo", "return_token_strs": True}).json()
    assert len(spelled["token_strs"]) == 6 and spelled["token_strs"][0] == "h"
    wrong = _check_error_shape(post(app, "/tokenize", {"prompt": "x", "model": "another-model"}), 404)
    assert wrong["code"] == "model_not_found"
    assert wrong["message"] == _check_error_shape(get(app, "/v1/models/another-model"), 404)["message"]
    assert tok["max_model_len"] == app.state.tokenmill.max_model_len
    assert post(app, "/detokenize", {"tokens": tok["tokens"]}).json()["prompt"] == "héllo"
    chat = post(app, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 2


def test_health_reports_dead_engine():
    app = make_tiny_app()
    assert get(app, "/health").status_code == 200
    app.state.tokenmill.aengine.shutdown()
    err = _check_error_shape(get(app, "/health"), 503)
    assert err["code"] == "engine_dead"


def test_metrics_names_and_aliases(app):
    post(app, "/v1/completions", {"prompt": "metrics", "max_tokens": 3, "ignore_eos": True})
    text = get(app, "/metrics").text
    engine = app.state.tokenmill.engine
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_count", "vllm:time_per_output_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "tokenmill:prefix_cache_blocks"):
        metric(text, name)
        if name.startswith("vllm:"):
            assert metric(text, name) == metric(text, "tokenmill:" + name[5:]), name
    assert metric(text, "vllm:request_success_total", finished_reason="length") >= 1
    assert metric(text, "vllm:cache_config_info", block_size=str(engine.block_size),
                  num_gpu_blocks=str(engine.pool.num_blocks)) == 1
    assert metric(text, "vllm:generation_tokens_total") >= 3


def test_prefix_cache_hits_are_visible_and_resettable(app):
    def hits() -> float:
        return metric(get(app, "/metrics").text, "vllm:prefix_cache_hits_total")

    assert post(app, "/reset_prefix_cache").status_code == 200
    before = hits()
    body = {"prompt": LONG_PROMPT, "max_tokens": 2, "temperature": 0}
    first = post(app, "/v1/completions", body).json()
    second = post(app, "/v1/completions", body).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 64 and cached % 16 == 0 and cached < len(LONG_PROMPT)
    assert hits() - before == cached
    assert metric(get(app, "/metrics").text, "tokenmill:prefix_cache_blocks") > 0
    assert first["choices"][0]["text"] == second["choices"][0]["text"]  # the cache never changes outputs
    reset = post(app, "/reset_prefix_cache").json()
    assert reset["freed_blocks"] > 0 and reset["enabled"] is True
    assert metric(get(app, "/metrics").text, "tokenmill:prefix_cache_blocks") == 0
    third = post(app, "/v1/completions", body).json()
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_no_prefix_caching():
    app = make_tiny_app(engine_options={"enable_prefix_caching": False})
    try:
        body = {"prompt": LONG_PROMPT, "max_tokens": 2}
        post(app, "/v1/completions", body)
        second = post(app, "/v1/completions", body).json()
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        text = get(app, "/metrics").text
        assert metric(text, "vllm:prefix_cache_hits_total") == 0
        assert metric(text, "vllm:cache_config_info", enable_prefix_caching="False") == 1
        assert post(app, "/reset_prefix_cache").json() == {"freed_blocks": 0, "enabled": False}
    finally:
        app.state.tokenmill.aengine.shutdown()


def test_capture_traffic(tmp_path):
    path = tmp_path / "capture.jsonl"
    app = make_tiny_app(capture_path=str(path))
    try:
        post(app, "/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 3, "ignore_eos": True})
        post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                           "ignore_eos": True, "n": 2}, headers={"x-session-id": "conv-7"})
    finally:
        app.state.tokenmill.aengine.shutdown()
        app.state.tokenmill.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["endpoint"] for r in records] == ["completions", "chat"]
    # the conversation is kept, hashed like the prompt (the client's name is not stored)
    assert "session" not in records[0] and len(records[1]["session"]) == 16
    assert "conv-7" not in path.read_text()
    assert records[0]["prompt_tokens"] == len(LONG_PROMPT) and records[0]["output_tokens"] == 3
    assert len(records[0]["block_hashes"]) == len(LONG_PROMPT) // 16
    assert records[1]["output_tokens"] == 4 and records[1]["finish_reason"] == "length"
    assert records[0]["ttft"] is not None and records[0]["e2e"] >= records[0]["ttft"]
    assert "prompt_text" not in records[0]
    assert records[0]["sampling"]["max_tokens"] == 3

"""Prompt logprobs over HTTP (tiny model, in-process): OpenAI's legacy echo shape,
vLLM's ``prompt_logprobs`` field on completions and chat, scoring with
``max_tokens: 0``, streaming, batches, and refusals. Numbers are checked
against the offline ``LLM.score`` of the same tiny model (itself checked
against transformers in test_prompt_logprobs.py)."""
from __future__ import annotations

import random

import pytest

from conftest import make_tiny_llm
from test_server_app import post, sse_events
from test_server_support import make_tiny_app

TOL = 1e-4


@pytest.fixture(scope="module")
def app():
    app = make_tiny_app()
    yield app
    app.state.tokenmill.aengine.shutdown()


@pytest.fixture(scope="module")
def offline():
    return make_tiny_llm()


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(n)]


def _lm_eval_score(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """What lm-evaluation-harness's local-completions reads from an echo response."""
    lp = choice["logprobs"]
    values, tops = lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1]
    return sum(values), all(v == max(top.values()) for v, top in zip(values, tops))


def test_echo_with_logprobs_is_the_legacy_shape(app, offline):
    prompt = _ids(40, 1)
    r = post(app, "/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 1,
                                      "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 41
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = offline.score([prompt])[0]
    for j in range(1, 40):
        assert abs(lp["token_logprobs"][j] - expected[j].logprob) < TOL
        top = lp["top_logprobs"][j]
        # two alternatives and the actual token (fewer when byte tokens read the same)
        assert 1 <= len(top) <= 3 and max(top.values()) >= lp["token_logprobs"][j]
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    total, _ = _lm_eval_score(choice, 30)
    assert abs(total - sum(e.logprob for e in expected[30:])) < 1e-3


def test_max_tokens_zero_scores_without_generating(app, offline):
    r = post(app, "/v1/completions", {"prompt": "Ships pass in the dark", "echo": True, "logprobs": 0,
                                      "max_tokens": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["text"] == "Ships pass in the dark" and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    ids = offline.tokenizer.encode("Ships pass in the dark")
    expected = offline.score([ids])[0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    assert all(abs(a - e.logprob) < TOL for a, e in zip(lp["token_logprobs"][1:], expected[1:]))
    assert all(len(t) == 1 for t in lp["top_logprobs"][1:])  # logprobs 0: the actual token only
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:j]) for j in range(len(ids))]


def test_echo_without_logprobs_and_max_tokens_zero_returns_the_prompt(app):
    r = post(app, "/v1/completions", {"prompt": ["one", "two"], "echo": True, "max_tokens": 0})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["text"] for c in choices] == ["one", "two"]
    assert all(c["logprobs"] is None and "prompt_logprobs" not in c for c in choices)


def test_a_batch_of_prompts_each_gets_its_own(app, offline):
    prompts = [_ids(n, 10 + n) for n in (5, 17, 33)]
    r = post(app, "/v1/completions", {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1,
                                      "temperature": 0})
    assert r.status_code == 200, r.text
    for choice, prompt, expected in zip(r.json()["choices"], prompts, offline.score(prompts)):
        values = choice["logprobs"]["token_logprobs"]
        assert len(values) == len(prompt) + 1
        assert all(abs(a - e.logprob) < TOL for a, e in zip(values[1:-1], expected[1:]))


def test_stream_reassembles_to_the_same_logprobs(app):
    body = {"prompt": "The keeper lit the lamp", "echo": True, "logprobs": 1, "max_tokens": 4,
            "temperature": 0, "ignore_eos": True}
    whole = post(app, "/v1/completions", body).json()["choices"][0]
    events = [e for e in sse_events(post(app, "/v1/completions", {**body, "stream": True}).text) if e != "[DONE]"]
    text, values = "", []
    for e in events:
        choice = e["choices"][0]
        text += choice["text"]
        if choice["logprobs"]:
            values += choice["logprobs"]["token_logprobs"]
    assert text == whole["text"]
    got, want = values, whole["logprobs"]["token_logprobs"]
    assert len(got) == len(want) and got[0] is None
    assert all(abs(a - b) < TOL for a, b in zip(got[1:], want[1:]))


def test_vllm_prompt_logprobs_field_on_completions(app, offline):
    prompt = _ids(25, 3)
    r = post(app, "/v1/completions", {"prompt": prompt, "prompt_logprobs": 3, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["logprobs"] is None  # not asked for
    plp = choice["prompt_logprobs"]
    expected = offline.score([prompt], top=3)[0]
    assert len(plp) == 25 and plp[0] is None
    for j in range(1, 25):
        entry = plp[j]
        actual = entry[str(prompt[j])]
        assert abs(actual["logprob"] - expected[j].logprob) < TOL
        assert actual["rank"] == expected[j].rank and isinstance(actual["decoded_token"], str)
        ranks = sorted(v["rank"] for k, v in entry.items() if k != str(prompt[j]) or v["rank"] <= 3)
        assert ranks[:3] == [1, 2, 3] and 3 <= len(entry) <= 4


def test_vllm_prompt_logprobs_field_on_chat(app, offline):
    messages = [{"role": "user", "content": "Day or night?"}]
    r = post(app, "/v1/chat/completions", {"messages": messages, "prompt_logprobs": 0, "max_tokens": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = post(app, "/tokenize", {"messages": messages}).json()["tokens"]
    plp = body["prompt_logprobs"]
    assert len(plp) == len(ids) == body["usage"]["prompt_tokens"] and plp[0] is None
    expected = offline.score([ids])[0]
    for j in range(1, len(ids)):
        assert list(plp[j]) == [str(ids[j])]
        assert abs(plp[j][str(ids[j])]["logprob"] - expected[j].logprob) < TOL


def test_warm_prefix_cache_gives_the_same_numbers(app):
    prompt = _ids(100, 4)  # six full blocks
    body = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    first = post(app, "/v1/completions", body).json()
    plain = post(app, "/v1/completions", {"prompt": prompt, "max_tokens": 1}).json()
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64  # the cache holds the prompt
    second = post(app, "/v1/completions", body).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # recomputed for its logits
    a = first["choices"][0]["logprobs"]["token_logprobs"]
    b = second["choices"][0]["logprobs"]["token_logprobs"]
    assert a[0] is None and b[0] is None and all(abs(x - y) < TOL for x, y in zip(a[1:], b[1:]))


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1,
                              "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": [1] * 2000, "echo": True, "logprobs": 1, "max_tokens": 0}, "prompt"),
])
def test_bad_input_is_a_400_and_the_engine_keeps_serving(app, path, body, param):
    r = post(app, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    ok = post(app, "/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1, "max_tokens": 0})
    assert ok.status_code == 200

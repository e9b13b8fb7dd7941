"""Anthropic Messages, stored Responses and reasoning output, in-process over the tiny
random model (fast). Reasoning splits are checked on scripted engine output (the
random model never writes ``</think>``), and, in the engine, a grammar that waits
for the end of the reasoning is checked on the model's own greedy text."""
from __future__ import annotations

import json
import random
import re
import time
from typing import Any, AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_server_support import make_tiny_app
from test_structured_server import TERSE_TEMPLATE, call, sse

KEY = "sekret"
H = {"x-api-key": KEY}
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def app():
    app = make_tiny_app(chat_template=TERSE_TEMPLATE, enable_auto_tool_choice=True, tool_call_parser="hermes",
                        api_key=KEY, responses_store_size=3)
    yield app
    app.state.tokenmill.aengine.shutdown()


def messages(app: Any, headers: dict[str, str] | None = None, **body: Any):
    body.setdefault("model", "tiny")
    body.setdefault("max_tokens", 12)
    body.setdefault("temperature", 0)
    body.setdefault("messages", [{"role": "user", "content": "hello"}])
    return call(app, "POST", "/v1/messages", body, H if headers is None else headers)


def events(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def reassemble(evs: list[tuple[str, dict[str, Any]]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Content blocks and the final message_delta of an Anthropic event stream, as the SDK accumulates them."""
    blocks: list[dict[str, Any]] = []
    partial: dict[int, str] = {}
    end: dict[str, Any] = {}
    for kind, data in evs:
        if kind == "content_block_start":
            assert data["index"] == len(blocks)
            blocks.append(dict(data["content_block"]))
        elif kind == "content_block_delta":
            block, delta = blocks[data["index"]], data["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            else:
                partial[data["index"]] = partial.get(data["index"], "") + delta["partial_json"]
        elif kind == "content_block_stop" and data["index"] in partial:
            blocks[data["index"]]["input"] = json.loads(partial[data["index"]])
        elif kind == "message_delta":
            end = data
    return blocks, end


# ---- Anthropic Messages ------------------------------------------------------------

def test_messages_stream_event_sequence_reassembles_to_the_body(app):
    whole = messages(app)
    assert whole.status_code == 200, whole.text
    body = whole.json()
    assert body["type"] == "message" and body["role"] == "assistant" and body["model"] == "tiny"
    assert body["stop_reason"] == "max_tokens" and body["usage"]["output_tokens"] == 12
    streamed = messages(app, stream=True)
    assert streamed.headers["content-type"].startswith("text/event-stream")
    evs = events(streamed.text)
    kinds = [k for k, _ in evs]
    assert kinds[:3] == ["message_start", "content_block_start", "ping"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    start = evs[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    blocks, end = reassemble(evs)
    assert blocks == body["content"]
    assert end["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    usage = body["usage"]
    assert end["usage"]["output_tokens"] == usage["output_tokens"]
    # the second identical prompt is served by the prefix cache, and says so
    assert end["usage"]["cache_read_input_tokens"] > 0
    assert (end["usage"]["input_tokens"] + end["usage"]["cache_read_input_tokens"]
            == usage["input_tokens"] + usage["cache_read_input_tokens"])


def test_messages_system_stop_sequences_and_count_tokens(app):
    free = messages(app, system=[{"type": "text", "text": "be terse"}]).json()
    text = free["content"][0]["text"]
    stop = text[3:5]
    cut = messages(app, system="be terse", stop_sequences=[stop]).json()
    assert cut["stop_reason"] == "stop_sequence" and cut["stop_sequence"] == stop
    assert cut["content"][0]["text"] == text[:text.index(stop)]
    counted = call(app, "POST", "/v1/messages/count_tokens", {"model": "tiny", "system": "be terse", "messages": [
        {"role": "user", "content": "hello"}]}, H)
    assert counted.status_code == 200, counted.text
    usage = cut["usage"]
    assert counted.json() == {"input_tokens": usage["input_tokens"] + usage["cache_read_input_tokens"]}


def test_messages_tool_use_and_tool_result_turn(app):
    ask = [{"role": "user", "content": "weather in Paris?"}]
    forced = {"type": "tool", "name": "get_weather"}
    r = messages(app, messages=ask, tools=[WEATHER], tool_choice=forced, max_tokens=40)
    body = r.json()
    assert r.status_code == 200, r.text
    assert body["stop_reason"] == "tool_use"
    (use,) = body["content"]
    assert use["type"] == "tool_use" and use["name"] == "get_weather" and use["id"].startswith("toolu_")
    assert set(use["input"]) == {"city"} and len(use["input"]["city"]) <= 6
    blocks, end = reassemble(events(messages(app, messages=ask, tools=[WEATHER], tool_choice=forced,
                                             max_tokens=40, stream=True).text))
    assert [(b["type"], b["name"], b["input"]) for b in blocks] == [("tool_use", "get_weather", use["input"])]
    assert end["delta"]["stop_reason"] == "tool_use"
    # the answer turn: tool_use in the assistant turn, tool_result in the next user turn
    turn = ask + [{"role": "assistant", "content": [use]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"],
                                                "content": [{"type": "text", "text": "21C sunny"}]}]}]
    r = messages(app, messages=turn, tools=[WEATHER], tool_choice={"type": "none"})
    assert r.status_code == 200 and r.json()["content"][0]["type"] == "text", r.text
    # the result reached the prompt: the template shows it with its call id
    count = lambda conv: call(app, "POST", "/v1/messages/count_tokens",  # noqa: E731
                              {"model": "tiny", "messages": conv, "tools": [WEATHER]}, H).json()["input_tokens"]
    longer = json.loads(json.dumps(turn))
    longer[-1]["content"][0]["content"] = "21C sunny and dry"
    assert count(longer) == count(turn) + len(" and dry")


@pytest.mark.parametrize("body,status,kind", [
    ({"max_tokens": None}, 400, "invalid_request_error"),
    ({"temperature": 1.5}, 400, "invalid_request_error"),
    ({"model": "claude-nope"}, 404, "not_found_error"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "invalid_request_error"),
    ({"messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request_error"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error"),
    ({"tools": [WEATHER], "tool_choice": {"type": "sometimes"}}, 400, "invalid_request_error"),
])
def test_messages_errors_are_anthropic_shaped(app, body, status, kind):
    base = {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    payload = {k: v for k, v in (base | body).items() if v is not None}
    r = call(app, "POST", "/v1/messages", payload, H)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == kind and err["error"]["message"]


def test_messages_keys_and_unknown_routes(app):
    assert messages(app, headers={"x-api-key": "wrong"}).json()["error"]["type"] == "authentication_error"
    assert messages(app, headers={}).status_code == 401
    assert messages(app, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert call(app, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                      "max_tokens": 2}, H).status_code == 200
    r = call(app, "POST", "/v1/messages/batches", {}, H)
    assert r.status_code in (404, 405) and r.json()["type"] == "error"
    # OpenAI routes keep OpenAI's shape
    assert set(call(app, "POST", "/v1/chat/completions", {}, H).json()) == {"error"}


# ---- stored Responses ----------------------------------------------------------------

def respond(app: Any, **body: Any) -> dict[str, Any]:
    body.setdefault("max_output_tokens", 6)
    body.setdefault("temperature", 0)
    r = call(app, "POST", "/v1/responses", body, H)
    assert r.status_code == 200, r.text
    return r.json()


def test_responses_chain_hits_the_prefix_cache_and_get_delete(app):
    first = respond(app, input="tell me a story about a cat", instructions="be brief")
    assert first["store"] is True and first["previous_response_id"] is None
    # instructions are not carried to the next turn (as OpenAI's): each turn sends them again
    second = respond(app, input="and then?", previous_response_id=first["id"], instructions="be brief")
    third = respond(app, input="the end", previous_response_id=second["id"], instructions="be brief")
    assert second["previous_response_id"] == first["id"]
    for before, after in ((first, second), (second, third)):
        assert after["usage"]["input_tokens"] > before["usage"]["input_tokens"] + before["usage"]["output_tokens"] - 4
        assert after["usage"]["input_tokens_details"]["cached_tokens"] > 0
    items = call(app, "GET", f"/v1/responses/{third['id']}/input_items", None, H).json()["data"]
    assert [i["role"] for i in items] == ["user", "assistant", "user", "assistant", "user"]
    assert items[0]["content"][0]["text"] == "tell me a story about a cat"
    assert items[1]["content"][0]["text"] == first["output"][0]["content"][0]["text"]
    got = call(app, "GET", f"/v1/responses/{second['id']}", None, H)
    assert got.status_code == 200 and got.json() == second
    assert call(app, "DELETE", f"/v1/responses/{second['id']}", None, H).json()["deleted"] is True
    for method in ("GET", "DELETE"):
        r = call(app, method, f"/v1/responses/{second['id']}", None, H)
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
    r = call(app, "POST", "/v1/responses", {"input": "x", "previous_response_id": second["id"]}, H)
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_responses_store_false_streaming_and_eviction(app):
    unstored = respond(app, input="a", store=False)
    assert unstored["store"] is False
    assert call(app, "GET", f"/v1/responses/{unstored['id']}", None, H).status_code == 404
    r = call(app, "POST", "/v1/responses", {"input": "b", "stream": True, "max_output_tokens": 4}, H)
    final = [e for e in sse(r.text) if e["type"] in ("response.completed", "response.incomplete")][-1]["response"]
    assert final["store"] is True
    assert call(app, "GET", f"/v1/responses/{final['id']}", None, H).json() == final
    ids = [respond(app, input=f"turn {i}")["id"] for i in range(3)]  # the store holds 3
    assert call(app, "GET", f"/v1/responses/{final['id']}", None, H).status_code == 404  # least recently used
    assert all(call(app, "GET", f"/v1/responses/{i}", None, H).status_code == 200 for i in ids)


def test_response_store_is_lru():
    from tokenmill.entrypoints.openai.response_store import ResponseStore, StoredResponse

    store = ResponseStore(2)
    for name in "abc"[:2]:
        store.put(name, StoredResponse({"id": name}, []))
    assert store.get("a", caller=None) is not None  # a is now the most recent
    store.put("c", StoredResponse({"id": "c"}, []))
    assert store.get("b", caller=None) is None and store.get("a", caller=None) is not None
    assert len(store) == 2 and store.evicted == 1
    assert store.delete("a", caller=None) and not store.delete("a", caller=None)
    empty = ResponseStore(0)
    empty.put("x", StoredResponse({}, []))
    assert empty.get("x", caller=None) is None


def test_a_response_larger_than_the_store_is_not_kept():
    small = make_tiny_app(chat_template=TERSE_TEMPLATE, api_key=KEY, responses_store_bytes=1600)
    try:
        kept = respond(small, input="short")
        assert 0 < small.state.response_store.bytes < 1000
        big = respond(small, input="ab" * 450)  # its conversation alone is past 1,600 bytes
        assert call(small, "GET", f"/v1/responses/{kept['id']}", None, H).status_code == 200
        assert call(small, "GET", f"/v1/responses/{big['id']}", None, H).status_code == 404
        r = call(small, "POST", "/v1/responses", {"input": "x", "previous_response_id": big["id"]}, H)
        assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
        assert small.state.response_store.refused == 1
    finally:
        small.state.tokenmill.aengine.shutdown()


def _sized(name: str, text_bytes: int):
    from tokenmill.entrypoints.openai.response_store import StoredResponse

    return StoredResponse({"id": name}, [{"role": "user", "content": "x" * text_bytes}])


def test_response_store_is_bounded_in_bytes():
    """Huge conversations are evicted by size, not only by count; one larger than the whole
    bound is not stored (a later previous_response_id to it is a 404)."""
    from tokenmill.entrypoints.openai.response_store import ResponseStore, entry_bytes

    one = entry_bytes(_sized("a", 1000))
    store = ResponseStore(100, max_bytes=3 * one)
    for name in "abc":
        assert store.put(name, _sized(name, 1000))
    assert store.bytes == 3 * one and len(store) == 3
    assert store.put("d", _sized("d", 1000))  # a fourth pushes out the least recently used
    assert store.get("a", caller=None) is None and len(store) == 3 and store.evicted == 1
    assert not store.put("huge", _sized("huge", 10 * one))
    assert store.get("huge", caller=None) is None and store.refused == 1
    assert len(store) == 3  # refusing it evicted nothing
    assert store.put("b", _sized("b", 2000))  # replacing an entry counts its new size only; c goes
    assert store.get("c", caller=None) is None
    assert store.bytes == entry_bytes(_sized("d", 1000)) + entry_bytes(_sized("b", 2000))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "get", "delete"]), st.integers(0, 7),
                          st.integers(0, 3000)), max_size=60),
       st.integers(0, 5), st.integers(0, 8000))
def test_response_store_bounds_hold_after_any_operations(ops, capacity, max_bytes):
    from tokenmill.entrypoints.openai.response_store import ResponseStore, entry_bytes

    store = ResponseStore(capacity, max_bytes=max_bytes)
    model: dict[str, int] = {}  # what it should hold: id -> size
    for op, key, size in ops:
        name = f"r{key}"
        if op == "put":
            stored = store.put(name, _sized(name, size))
            model.pop(name, None)
            if stored:
                model[name] = entry_bytes(_sized(name, size))
            assert stored == (capacity > 0 and entry_bytes(_sized(name, size)) <= max_bytes)
        elif op == "get":
            assert (store.get(name, caller=None) is not None) == (name in model and name in store._entries)
        else:
            store.delete(name, caller=None)
            model.pop(name, None)
        model = {k: v for k, v in model.items() if k in store._entries}  # what eviction took
        assert store.bytes == sum(v for _, v in store._entries.values()) == sum(model.values())
        assert len(store) <= capacity and store.bytes <= max_bytes


# ---- reasoning --------------------------------------------------------------------------

SPLITS = [  # parser, prompt, output, (reasoning, answer)
    ("deepseek_r1", "user: q\nassistant: ", "Let me see.</think>\n\nParis.", ("Let me see.", "Paris.")),
    ("deepseek_r1", "user: q\nassistant: <think>\n", "<think>a<b</think>c", ("a<b", "c")),
    ("deepseek_r1", "q", "cut while think", ("cut while think", "")),
    ("deepseek_r1", "q <think>\n\n</think>\n\n", "just the answer", (None, "just the answer")),
    ("qwen3", "q", "<think>\nhm\n</think>\n\nok", ("\nhm\n", "ok")),
    ("qwen3", "q", "no thinking here", (None, "no thinking here")),
    ("qwen3", "q<think>\n", "opened by the template</think>yes", ("opened by the template", "yes")),
    ("qwen3", "q", "<thin", (None, "<thin")),
]


@pytest.mark.parametrize("name,prompt,output,expected", SPLITS)
def test_reasoning_split_whole_and_in_any_pieces(name, prompt, output, expected):
    from tokenmill.entrypoints.parsers.reasoning import PARSERS, ReasoningSplit, split_reasoning

    assert split_reasoning(PARSERS[name], output, prompt) == expected
    rng = random.Random(0)
    for _ in range(30):
        split = ReasoningSplit(PARSERS[name], prompt)
        thought, said, i = "", "", 0
        while i < len(output):
            j = min(len(output), i + rng.randint(1, 4))
            r, a = split.feed(output[i:j], final=j == len(output))
            thought, said, i = thought + r, said + a, j
        assert (split.reasoning, said) == expected and thought == (expected[0] or "")


SCRIPT = ["<think>", "The user", " greets.\n</th", "ink>\n\nHel", "lo there", "!"]


@pytest.fixture(scope="module")
def thinking_app():
    """deepseek_r1 split over an engine whose output is SCRIPT, piece by piece."""
    from tokenmill.engine.engine import SequenceDelta

    app = make_tiny_app(chat_template=TERSE_TEMPLATE, reasoning_parser="deepseek_r1")
    state = app.state.tokenmill

    async def scripted(job: Any) -> AsyncIterator[SequenceDelta]:
        state.admission.release(job)
        for i, piece in enumerate(SCRIPT):
            last = i == len(SCRIPT) - 1
            yield SequenceDelta(job.request_id, 0, [65], piece, [], last, "stop" if last else None, None,
                                len(job.prompt_ids), 0)

    state.stream_job = scripted
    yield app
    state.aengine.shutdown()


THOUGHT, ANSWER = "The user greets.\n", "Hello there!"


def test_reasoning_in_chat_streamed_and_not(thinking_app):
    ask = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}
    message = call(thinking_app, "POST", "/v1/chat/completions", ask).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (THOUGHT, ANSWER)
    chunks = sse(call(thinking_app, "POST", "/v1/chat/completions", ask | {"stream": True}).text)[:-1]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    thought = "".join(d.get("reasoning_content") or "" for d in deltas)
    said = "".join(d.get("content") or "" for d in deltas)
    assert (thought, said) == (THOUGHT, ANSWER)
    first_answer = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning_content" not in d for d in deltas[first_answer:])  # thinking comes first, apart


def test_reasoning_in_responses_streamed_and_not(thinking_app):
    body = call(thinking_app, "POST", "/v1/responses", {"input": "hi"}).json()
    assert [i["type"] for i in body["output"]] == ["reasoning", "message"]
    assert body["output"][0]["content"] == [{"type": "reasoning_text", "text": THOUGHT}]
    assert body["output"][1]["content"][0]["text"] == ANSWER
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    evs = sse(call(thinking_app, "POST", "/v1/responses", {"input": "hi", "stream": True}).text)
    assert "".join(e["delta"] for e in evs if e["type"] == "response.reasoning_text.delta") == THOUGHT
    assert "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta") == ANSWER
    done = [e["item"] for e in evs if e["type"] == "response.output_item.done"]
    final = evs[-1]["response"]
    assert [i["type"] for i in done] == ["reasoning", "message"] and final["output"] == done
    assert [(i["type"], i.get("content")) for i in final["output"]] == \
        [(i["type"], i.get("content")) for i in body["output"]]


def test_reasoning_in_messages_streamed_and_not(thinking_app):
    ask = {"model": "tiny", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}
    body = call(thinking_app, "POST", "/v1/messages", ask).json()
    assert body["content"] == [{"type": "thinking", "thinking": THOUGHT, "signature": ""},
                               {"type": "text", "text": ANSWER}]
    assert body["stop_reason"] == "end_turn"
    blocks, end = reassemble(events(call(thinking_app, "POST", "/v1/messages", ask | {"stream": True}).text))
    assert blocks == body["content"] and end["delta"]["stop_reason"] == "end_turn"


def test_grammar_waits_for_the_end_of_the_reasoning(tiny_llm_factory):
    """The engine applies a request's grammar only after ``structured_after`` appears in its
    output: here a piece of the model's own greedy text stands in for ``</think>``."""
    from tokenmill import SamplingParams
    from tokenmill.engine.grammar.structured import GrammarSpec

    llm = tiny_llm_factory()
    prompt = "user: is it raining?\nassistant: "
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0].text
    # two printable ASCII characters (one byte token each), not the output's first ones
    marker = re.search(r"[!-~]{2}", free[3:]).group(0)
    head = free[:free.index(marker) + len(marker)]
    choice = GrammarSpec("choice", ("yes", "no"))
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, structured=choice,
                                              structured_after=marker))[0].outputs[0]
    assert out.text.startswith(head) and out.text[len(head):] in ("yes", "no"), (free, out.text)
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, structured=choice,
                                              structured_after=marker))[0].outputs[0]
    assert cut.text == free[:len(cut.text)] and len(cut.token_ids) == 3 and cut.finish_reason == "length"  # max_tokens counts the reasoning
    assert llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, structured=choice))[0] \
        .outputs[0].text in ("yes", "no")


def test_structured_request_under_a_reasoning_parser_sets_the_end_tag():
    from types import SimpleNamespace

    from tokenmill.engine.grammar.structured import GrammarSpec
    from tokenmill.entrypoints.parsers.reasoning import reasoning_for_grammar

    grammar = SimpleNamespace(structured=GrammarSpec("json_object"))
    plain = SimpleNamespace(structured=None)
    r1, qwen = SimpleNamespace(reasoning_parser="deepseek_r1"), SimpleNamespace(reasoning_parser="qwen3")
    assert reasoning_for_grammar(r1, grammar, "q") == "</think>"
    assert reasoning_for_grammar(r1, plain, "q") is None
    assert reasoning_for_grammar(r1, grammar, "q<think>\n\n</think>\n\n") is None  # thinking switched off
    assert reasoning_for_grammar(qwen, grammar, "q<think>\n") == "</think>"
    assert reasoning_for_grammar(qwen, grammar, "q") is None  # may not think at all: format from the start
    assert reasoning_for_grammar(SimpleNamespace(reasoning_parser=None), grammar, "q") is None


def test_serve_flags_reach_the_settings():
    from tokenmill.entrypoints.cli.main import build_parser
    from tokenmill.entrypoints.cli.serve_config import settings_from_args

    args = build_parser().parse_args(["serve", "--reasoning-parser", "qwen3", "--responses-store-size", "7",
                                      "--responses-store-bytes", "2MiB"])
    settings = settings_from_args(args)
    assert (settings.reasoning_parser, settings.responses_store_size) == ("qwen3", 7)
    assert settings.responses_store_bytes == 2 * 1024 * 1024
    defaults = settings_from_args(build_parser().parse_args(["serve"]))
    assert (defaults.reasoning_parser, defaults.responses_store_size) == (None, 1024)
    assert defaults.responses_store_bytes == 64 * 1024 * 1024
    for bad in (["--responses-store-size", "-1"], ["--reasoning-parser", "granite"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *bad])


@pytest.fixture(scope="module")
def reasoning_app():
    app = make_tiny_app(chat_template=TERSE_TEMPLATE, reasoning_parser="deepseek_r1")
    yield app
    app.state.tokenmill.aengine.shutdown()


def test_structured_output_applies_to_the_answer_after_the_reasoning(reasoning_app, monkeypatch):
    """Through the server: the random model never writes ``</think>``, so its whole output is
    reasoning, unconstrained; with an end tag taken from its own text, the reasoning runs up to
    the tag and the answer after it is one of the choices."""
    from tokenmill.entrypoints.parsers import reasoning

    ask = {"messages": [{"role": "user", "content": "rain?"}], "max_tokens": 30, "temperature": 0}
    free = call(reasoning_app, "POST", "/v1/chat/completions", ask).json()["choices"][0]
    assert free["message"]["content"] == "" and free["finish_reason"] == "length"
    thought = free["message"]["reasoning_content"]
    choice = ask | {"guided_choice": ["yes", "no"]}
    cut = call(reasoning_app, "POST", "/v1/chat/completions", choice).json()["choices"][0]
    assert cut["message"]["reasoning_content"] == thought  # the grammar did not touch the reasoning
    marker = re.search(r"[!-~]{2}", thought[3:]).group(0)
    monkeypatch.setitem(reasoning.PARSERS, "deepseek_r1",
                        reasoning.ReasoningParser("deepseek_r1", end=marker, implicit_start=True))
    for stream in (False, True):
        r = call(reasoning_app, "POST", "/v1/chat/completions", choice | {"stream": stream})
        if stream:
            deltas = [c["choices"][0]["delta"] for c in sse(r.text)[:-1] if c["choices"]]
            message = {k: "".join(d.get(k) or "" for d in deltas) for k in ("reasoning_content", "content")}
        else:
            message = r.json()["choices"][0]["message"]
        assert message["reasoning_content"] == thought[:thought.index(marker)]
        assert message["content"] in ("yes", "no"), message


def test_router_relays_messages_with_either_key(app):
    """The router takes x-api-key too, routes Messages on their text, and keeps its own key to itself."""
    import httpx

    from test_server_support import ThreadServer
    from tokenmill.router.config import RouterConfig
    from tokenmill.router.server import RouterServer
    from tokenmill.router.tokenize import prompt_of

    text, ids = prompt_of("/v1/messages", {"system": "be brief", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hello"}]}]})
    assert ids is None and text == "<|system|>\nbe brief\n<|user|>\nhello\n"
    with ThreadServer(app) as srv:
        router = RouterServer(RouterConfig(backends=[srv.url], port=0, api_key="router-key",
                                           backend_api_key=KEY, health_interval=0.2)).start_in_thread()
        try:
            body = {"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
            deadline = time.monotonic() + 20
            while True:
                r = httpx.post(router.url + "/v1/messages", json=body, headers={"x-api-key": "router-key"},
                               timeout=30)
                if r.status_code != 503 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert r.status_code == 200 and r.json()["type"] == "message", r.text
            streamed = httpx.post(router.url + "/v1/messages", json=body | {"stream": True},
                                  headers={"x-api-key": "router-key"}, timeout=30)
            assert [k for k, _ in events(streamed.text)][-1] == "message_stop"
            counted = httpx.post(router.url + "/v1/messages/count_tokens", json=body,
                                 headers={"x-api-key": "router-key"}, timeout=30)
            assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
            assert httpx.post(router.url + "/v1/messages", json=body, headers={"x-api-key": KEY},
                              timeout=30).status_code == 401
        finally:
            router.stop()

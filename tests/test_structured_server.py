"""Structured outputs, tool calling, the Responses API and small API gaps, in-process over
the tiny random model (fast). The random model follows no instruction, so every
structured result here holds only because the grammar mask enforced it."""
from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import pytest

from chat_templates import HERMES_TOOLS_TEMPLATE
from test_server_support import make_tiny_app

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
SMALL = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                         "n": {"type": "integer", "minimum": 0, "maximum": 999}},
         "required": ["name", "n"], "additionalProperties": False}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
# The tiny model's context is 1024 byte-tokens: a terse template that still shows tools,
# calls and results.
TERSE_TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
    "{% if m.tool_call_id %} (for {{ m.tool_call_id }}){% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}")


@pytest.fixture(scope="module")
def app():
    app = make_tiny_app(chat_template=TERSE_TEMPLATE, enable_auto_tool_choice=True,
                        tool_call_parser="hermes")
    yield app
    app.state.tokenmill.aengine.shutdown()


def call(app: Any, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120) as c:
            return await c.request(method, path, json=body, headers=headers)
    return asyncio.run(go())


def chat(app: Any, **body: Any) -> httpx.Response:
    body.setdefault("messages", USER)
    body.setdefault("max_tokens", 120)
    body.setdefault("temperature", 0.0)
    return call(app, "POST", "/v1/chat/completions", body)


def sse(text: str) -> list[Any]:
    out = []
    for block in text.split("\n\n"):
        data = [line[6:] for line in block.splitlines() if line.startswith("data: ")]
        if data:
            out.append(data[0] if data[0] == "[DONE]" else json.loads(data[0]))
    return out


def error_of(r: httpx.Response, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    return err


# ---- structured outputs ------------------------------------------------------------

def test_response_format_json_schema_and_object(app):
    r = chat(app, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SMALL}},
             max_tokens=200)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    obj = json.loads(choice["message"]["content"])
    assert set(obj) == {"name", "n"} and isinstance(obj["n"], int)
    for seed in range(3):
        r = chat(app, response_format={"type": "json_object"}, max_tokens=6, temperature=1.0, seed=seed)
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "length":
            assert choice["message"]["content"].startswith("{")
        else:
            assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_vllm_fields_on_completions_and_chat(app):
    r = call(app, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 20, "temperature": 1.0, "seed": 3,
                                                "guided_regex": r"[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", r.json()["choices"][0]["text"]), r.text
    r = call(app, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 20, "temperature": 1.0, "n": 3,
                                                "structured_outputs": {"choice": ["red", "green"]}})
    assert {c["text"] for c in r.json()["choices"]} <= {"red", "green"}
    r = chat(app, guided_json=SMALL, max_tokens=200, temperature=0.7, seed=1)
    choice = r.json()["choices"][0]
    assert set(json.loads(choice["message"]["content"])) == {"name", "n"}
    r = chat(app, guided_grammar='root ::= "ok" [0-9]', max_tokens=10)
    assert re.fullmatch(r"ok[0-9]", r.json()["choices"][0]["message"]["content"])
    r = chat(app, guided_choice=["yes", "no"], stream=True, max_tokens=10)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in sse(r.text)[:-1] if e["choices"])
    assert text in {"yes", "no"}


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format", "strin"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}}},
     "response_format", "not"),
    ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
    ({"guided_regex": r"(a)\1"}, "guided_regex", "backreferences"),
    ({"guided_grammar": "start: nope\n"}, "guided_grammar", "nope"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "only one"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
      "tool_choice": "required"}, "tools", "objekt"),
    ({"tools": [{"type": "function"}]}, "tools", None),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "without any tools"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", "unique"),
])
def test_bad_input_is_a_400_and_the_engine_keeps_serving(app, body, param, words):
    err = error_of(chat(app, **body), param)
    if words:
        assert words in err["message"], err
    assert chat(app, max_tokens=2).status_code == 200


def test_bad_input_on_completions_and_suffix(app):
    err = error_of(call(app, "POST", "/v1/completions", {"prompt": "x", "guided_json": {"type": "strin"}}),
                   "guided_json")
    assert "strin" in err["message"]
    err = error_of(call(app, "POST", "/v1/completions", {"prompt": "x", "suffix": "tail"}), "suffix")
    assert "not supported" in err["message"]


# ---- tool calling ------------------------------------------------------------------

def test_tools_reach_the_template_and_tool_messages_round_trip(app):
    from tokenmill.entrypoints.openai.openai_routes import prepare_chat
    from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
    from tokenmill.entrypoints.parsers.tool_calls import template_message
    from tokenmill.files.tokenizer import render_chat_template

    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"}]
    body = ChatCompletionRequest(messages=history, tools=[WEATHER], tool_choice="none")
    job, plan = asyncio.run(prepare_chat(app.state.tokenmill, body, "t"))
    assert job.prompt_text == ("tools: get_weather\nuser: What is the weather in Paris?\nassistant: "
                               '[call get_weather {"city": "Paris", "days": 1}]\n'
                               "tool: sunny, 21C (for call_1)\nassistant: ")
    assert plan is not None and plan.mode == "none"
    prompt = render_chat_template(HERMES_TOOLS_TEMPLATE, [template_message(m) for m in body.messages],
                                  tools=[WEATHER], add_generation_prompt=True)
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}' in prompt
    assert "<tool_response>\nsunny, 21C\n</tool_response>" in prompt
    r = chat(app, messages=history, tools=[WEATHER], max_tokens=5)
    assert r.status_code == 200, r.text


def test_required_and_named_tool_choice_always_parse(app):
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        r = chat(app, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=200, temperature=0.8, seed=4,
                 parallel_tool_calls=False)
        c = r.json()["choices"][0]
        assert c["finish_reason"] == "tool_calls", c
        calls = c["message"]["tool_calls"]
        assert calls and c["message"]["content"] is None
        for tc in calls:
            assert tc["type"] == "function" and tc["id"].startswith("call_")
            args = json.loads(tc["function"]["arguments"])
            if tc["function"]["name"] == "get_time":
                assert args["zone"] in ("UTC", "CET")
            else:
                assert set(args) == {"city", "days"}
        if isinstance(choice, dict):
            assert [tc["function"]["name"] for tc in calls] == ["get_time"]


def test_parallel_tool_calls(app):
    # the random model never chooses to stop listing calls: cut by max_tokens, the calls
    # completed before the cut still come back (finish "length"), the partial one does not
    r = chat(app, tools=[WEATHER, TIME], tool_choice="required", max_tokens=150, temperature=1.0, seed=9)
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "length" and c["message"]["content"] is None
    calls = c["message"]["tool_calls"]
    assert len(calls) >= 2 and all(json.loads(tc["function"]["arguments"]) is not None for tc in calls)
    # left to run, the grammar closes the list after MAX_PARALLEL_CALLS calls
    from tokenmill.entrypoints.parsers.tool_calls import MAX_PARALLEL_CALLS

    r = chat(app, tools=[TIME], tool_choice="required", max_tokens=600, temperature=1.0, seed=9)
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "tool_calls" and len(c["message"]["tool_calls"]) == MAX_PARALLEL_CALLS
    r = chat(app, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, max_tokens=150,
             temperature=1.0, seed=9)
    assert len(r.json()["choices"][0]["message"]["tool_calls"]) == 1


def _reassemble(events: list[Any]) -> tuple[dict[int, dict[str, Any]], str | None, str]:
    calls: dict[int, dict[str, Any]] = {}
    finish, content = None, ""
    for e in events:
        if e == "[DONE]" or not e["choices"]:
            continue
        ch = e["choices"][0]
        content += ch["delta"].get("content") or ""
        for tc in ch["delta"].get("tool_calls") or []:
            slot = calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
            slot["id"] = tc.get("id") or slot["id"]
            fn = tc.get("function") or {}
            slot["name"] += fn.get("name") or ""
            slot["arguments"] += fn.get("arguments") or ""
        finish = ch["finish_reason"] or finish
    return calls, finish, content


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_call_deltas_reassemble_to_the_same_call(app, choice):
    body = dict(tools=[WEATHER, TIME], tool_choice=choice, max_tokens=200, temperature=0.9, seed=21,
                parallel_tool_calls=False)
    whole = chat(app, **body).json()["choices"][0]["message"]["tool_calls"]
    calls, finish, content = _reassemble(sse(chat(app, stream=True, **body).text))
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(w["function"]["name"], json.loads(w["function"]["arguments"])) for w in whole]
    assert all(c["id"] for c in calls.values())


def test_tool_choice_none_streams_plain_content_once(app):
    body = dict(tools=[WEATHER], tool_choice="none", max_tokens=12, temperature=0.0)
    whole = chat(app, **body).json()["choices"][0]
    calls, finish, content = _reassemble(sse(chat(app, stream=True, **body).text))
    assert not calls and finish == whole["finish_reason"] and content == whole["message"]["content"]
    assert "tool_calls" not in whole["message"]


def test_auto_tool_choice_parses_hermes_output(app):
    from tokenmill.entrypoints.parsers.output_events import TextDelta, ToolArgsDelta
    from tokenmill.entrypoints.parsers.tool_calls import ToolPlan, ToolStream
    from tokenmill.entrypoints.parsers.tool_parsers import get_parser

    plan = ToolPlan(tools=[WEATHER], mode="auto", parser=get_parser("hermes"))
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
    ts = ToolStream(plan)
    deltas = [d for i in range(0, len(text), 3) for d in ts.feed(text[i:i + 3])]
    rest, called = ts.finish()
    assert called
    streamed = "".join(e.text for e in deltas + rest if isinstance(e, TextDelta))
    assert streamed == "Let me check."  # the blank line before the call is held back, then dropped
    args = "".join(e.arguments for e in rest if isinstance(e, ToolArgsDelta))
    assert json.loads(args) == {"city": "Oslo", "days": 2}
    # auto over the wire: the random model writes no call, so the text comes back as content
    r = chat(app, tools=[WEATHER], max_tokens=8)
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_auto_needs_the_server_flag():
    bare = make_tiny_app()
    try:
        err = error_of(chat(bare, tools=[WEATHER]), "tool_choice")
        assert "--enable-auto-tool-choice" in err["message"]
    finally:
        bare.state.tokenmill.aengine.shutdown()


@pytest.mark.parametrize("name, text, content, calls", [
    ("hermes", 'hi <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call><tool_call>{"name": "b", '
               '"arguments": {}}</tool_call>', "hi", [("a", {"x": 1}), ("b", {})]),
    ("hermes", "<tool_call>{broken</tool_call>", "<tool_call>{broken</tool_call>", []),
    ("llama3_json", '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": "z"}}', None,
     [("a", {"x": 1}), ("b", {"y": "z"})]),
    ("llama3_json", '<|python_tag|>{"name": "a", "arguments": {}}', None, [("a", {})]),
    ("llama3_json", "plain answer", "plain answer", []),
    ("mistral", 'ok [TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]', "ok",
     [("a", {"x": 1}), ("b", {})]),
    ("mistral", '[TOOL_CALLS]a[ARGS]{"x": 2}', None, [("a", {"x": 2})]),
])
def test_parsers(name, text, content, calls):
    from tokenmill.entrypoints.parsers.tool_parsers import get_parser

    got_content, got = get_parser(name).extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


# ---- the Responses API -------------------------------------------------------------

def test_responses_text_items_and_function_calls(app):
    r = call(app, "POST", "/v1/responses", {"input": "hi", "instructions": "be brief", "max_output_tokens": 5})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "response" and body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["type"] == "message" and body["usage"]["output_tokens"] == 5
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    r = call(app, "POST", "/v1/responses", {"input": [{"role": "user", "content": "weather?"}], "tools": [tool],
                                              "tool_choice": "required", "max_output_tokens": 200,
                                              "parallel_tool_calls": False})
    body = r.json()
    assert body["status"] == "completed", body
    fc = body["output"][0]
    assert fc["type"] == "function_call" and fc["name"] == "get_weather" and fc["call_id"]
    assert set(json.loads(fc["arguments"])) == {"city", "days"}
    # second turn: the call and its output as input items
    r = call(app, "POST", "/v1/responses", {"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]}, fc,
        {"type": "function_call_output", "call_id": fc["call_id"], "output": "sunny"}],
        "tools": [tool], "tool_choice": "none", "max_output_tokens": 3})
    assert r.status_code == 200 and r.json()["output"][0]["type"] == "message"
    r = call(app, "POST", "/v1/responses", {"input": "x", "max_output_tokens": 200, "text": {
        "format": {"type": "json_schema", "name": "s", "schema": SMALL, "strict": True}}})
    out = r.json()
    assert out["status"] == "completed"
    assert set(json.loads(out["output"][0]["content"][0]["text"])) == {"name", "n"}


def test_responses_stream_events(app):
    r = call(app, "POST", "/v1/responses", {"input": "hi", "stream": True, "max_output_tokens": 6})
    events = sse(r.text)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == text


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "input_image"}]}, "input"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": 3}}],
      "tool_choice": "required"}, "tools"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "strin"}}}},
     "response_format"),
])
def test_responses_bad_input(app, body, param):
    error_of(call(app, "POST", "/v1/responses", body), param)


# ---- small gaps ------------------------------------------------------------------

def test_model_by_id_and_request_id_header(app):
    r = call(app, "GET", "/v1/models/tiny")
    assert r.status_code == 200 and r.json()["id"] == "tiny" and r.json()["object"] == "model"
    r = call(app, "GET", "/v1/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = chat(app, max_tokens=1, )
    generated = r.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", generated)
    r = call(app, "POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 1},
             headers={"X-Request-Id": "my-trace-42"})
    assert r.headers["x-request-id"] == "my-trace-42"
    r = call(app, "GET", "/v1/nothing", headers={"x-request-id": "abc"})
    assert r.status_code == 404 and r.headers["x-request-id"] == "abc"


def test_router_routes_responses_on_their_text():
    from tokenmill.router.tokenize import prompt_of

    text, ids = prompt_of("/v1/responses", {"input": "hello there", "instructions": "be brief"})
    assert ids is None and "be brief" in text and "hello there" in text
    assert prompt_of("/v1/responses", {"input": [{"role": "user", "content": "a"}]})[0] == "<|user|>\na\n"
    assert prompt_of("/v1/responses", {"input": 5}) == ("", None)


def test_serve_flags_choose_the_tool_parser():
    from tokenmill.entrypoints.cli.main import build_parser
    from tokenmill.entrypoints.cli.serve_config import settings_from_args

    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"])
    settings = settings_from_args(args)
    assert settings.enable_auto_tool_choice and settings.tool_call_parser == "llama3_json"
    assert not settings_from_args(build_parser().parse_args(["serve"])).enable_auto_tool_choice
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "nonsense"])

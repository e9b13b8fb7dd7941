"""Every request field honoured or refused, on the tiny model in-process: token rules,
chat-template fields, legacy functions, usage in every chunk, refused and unknown
fields, constraint objects, the tools template for ChatML models, regex classes."""
from __future__ import annotations

import json
import re
from typing import Any

import pytest

from conftest import tiny_loaded, tiny_tokenizer
from test_server_app import _check_error_shape, get, post, sse_events

# A ChatML template without tools, as small chat models ship (the bundled SmolLM2's shape).
CHATML_NO_TOOLS = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Reads the variables chat requests may pass to their template.
VARIABLES = ("{% if greeting %}{{ greeting }}|{% endif %}{% if reasoning_effort %}[{{ reasoning_effort }}]{% endif %}"
             "{% for m in messages %}{{ m.role }}:{{ m.content }}\n{% endfor %}"
             "{% if add_generation_prompt %}assistant:{% endif %}")
CLOCK = {"type": "function", "function": {"name": "clock", "description": "the time",
                                          "parameters": {"type": "object", "properties": {
                                              "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


def _app(template: str | None = None, **settings: Any) -> Any:
    from tokenmill.settings.config import EngineConfig
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.engine.engine import LLMEngine
    from tokenmill.entrypoints.server.app import build_app
    from tokenmill.entrypoints.server.serving import ServerSettings

    tokenizer = tiny_tokenizer()
    if template is not None:
        tokenizer.chat_template, tokenizer.has_chat_template = template, True
    engine = LLMEngine(EngineConfig.from_options(num_blocks=128, max_num_batched_tokens=256), loaded=tiny_loaded(),
                       tokenizer=tokenizer)
    settings.setdefault("served_model_names", ["tiny"])
    return build_app(AsyncEngine(engine), ServerSettings(**settings))


@pytest.fixture(scope="module")
def app():
    app = _app(VARIABLES)
    yield app
    app.state.tokenmill.aengine.shutdown()


@pytest.fixture(scope="module")
def chatml():
    app = _app(CHATML_NO_TOOLS)
    yield app
    app.state.tokenmill.aengine.shutdown()


def ids_of(app: Any, text: str) -> list[int]:
    return app.state.tokenmill.tokenizer.encode(text, add_special_tokens=False)


def complete(app: Any, **body: Any) -> dict[str, Any]:
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0.0, "ignore_eos": True, **body}
    r = post(app, "/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def chat(app: Any, status: int = 200, **body: Any) -> Any:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0.0, **body}
    r = post(app, "/v1/chat/completions", body)
    assert r.status_code == status, r.text
    return r


# ---- token rules ------------------------------------------------------------------------

def test_logit_bias_bans_and_forces_tokens(app):
    letters = ids_of(app, "abcdefghijklmnopqrstuvwxyz")
    base = complete(app, allowed_token_ids=letters)["choices"][0]["text"]
    banned = {str(t): -100 for t in ids_of(app, base)}
    assert not set(complete(app, allowed_token_ids=letters, logit_bias=banned)["choices"][0]["text"]) & set(base)
    forced = ids_of(app, "Z")[0]
    assert complete(app, logit_bias={str(forced): 100})["choices"][0]["text"] == "Z" * 8
    # random sampling obeys it too, and so does chat
    assert complete(app, logit_bias={str(forced): 100}, temperature=1.0, seed=1)["choices"][0]["text"] == "Z" * 8
    assert chat(app, logit_bias={str(forced): 100}).json()["choices"][0]["message"]["content"] == "Z" * 6


@pytest.mark.parametrize("bias, words", [({"5": 1000}, "outside [-100, 100]"), ({"abc": 100}, "not a token id"),
                                         ({"100000": 1}, "out of range")])
def test_bad_logit_bias_is_a_400(app, bias, words):
    r = post(app, "/v1/completions", {"prompt": "x", "logit_bias": bias})
    err = _check_error_shape(r, 400)
    assert err["param"] == "logit_bias" and words in err["message"]


def test_allowed_token_ids_and_bad_words(app):
    allowed = ids_of(app, "ab")
    out = complete(app, allowed_token_ids=allowed, temperature=1.0, seed=3, max_tokens=24)["choices"][0]["text"]
    assert set(out) <= {"a", "b"} and len(out) == 24
    base = complete(app)["choices"][0]["text"]
    word = base[0]
    assert word not in complete(app, bad_words=[word])["choices"][0]["text"]
    _check_error_shape(post(app, "/v1/completions", {"prompt": "x", "allowed_token_ids": [10**6]}), 400)


def test_min_tokens_holds_eos_back(app):
    eos = app.state.tokenmill.tokenizer.eos_token_id
    body = {"prompt": [5, 6], "max_tokens": 10, "temperature": 0.0, "logit_bias": {str(eos): 100}}
    assert complete(app, **body, ignore_eos=False)["usage"]["completion_tokens"] == 1
    assert complete(app, **body, ignore_eos=False, min_tokens=5)["usage"]["completion_tokens"] == 6  # 5, then EOS


def test_truncate_prompt_tokens_keeps_the_last_ones(app):
    usage = complete(app, prompt="abcdefghij", truncate_prompt_tokens=4)["usage"]
    assert usage["prompt_tokens"] == 4


# ---- chat-template fields --------------------------------------------------------------

def _prompt(app: Any, **body: Any) -> str:
    r = post(app, "/tokenize", {"messages": body.pop("messages", [{"role": "user", "content": "hi"}]), **body})
    assert r.status_code == 200, r.text
    return app.state.tokenmill.tokenizer.decode(r.json()["tokens"], skip_special_tokens=False)


def test_continue_final_message_and_add_generation_prompt(app):
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    assert _prompt(app, messages=turns, continue_final_message=True).endswith("assistant:The answer is")
    assert _prompt(app, add_generation_prompt=False).endswith("user:hi\n")
    assert _prompt(app).endswith("assistant:")
    r = chat(app, messages=turns, continue_final_message=True)
    assert r.json()["usage"]["prompt_tokens"] == len("user:hi\nassistant:The answer is")
    err = _check_error_shape(chat(app, 400, messages=turns, continue_final_message=True, add_generation_prompt=True),
                             400)
    assert err["param"] == "continue_final_message"
    _check_error_shape(chat(app, 400, continue_final_message=True), 400)


def test_chat_template_kwargs_and_reasoning_effort_reach_the_template(app):
    assert _prompt(app, chat_template_kwargs={"greeting": "hello"}).startswith("hello|")
    plain = chat(app).json()["usage"]["prompt_tokens"]
    r = chat(app, chat_template_kwargs={"greeting": "hello", "unread": 1}, reasoning_effort="low")
    assert r.json()["usage"]["prompt_tokens"] == plain + len("hello|") + len("[low]")
    assert r.headers["x-tokenmill-ignored-fields"] == "chat_template_kwargs.unread"
    err = _check_error_shape(chat(app, 400, reasoning_effort="bogus"), 400)
    assert err["param"] == "reasoning_effort"
    assert _check_error_shape(chat(app, 400, chat_template_kwargs={"messages": []}), 400)["param"] == \
        "chat_template_kwargs"


def test_reasoning_effort_is_reported_when_the_template_ignores_it(chatml):
    r = chat(chatml, reasoning_effort="high")
    assert r.headers["x-tokenmill-ignored-fields"] == "reasoning_effort"


# ---- streaming usage, best_of, refused and unknown fields -----------------------------------------

def test_continuous_usage_stats_in_every_chunk(app):
    r = post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                           "stream": True, "temperature": 0.0, "ignore_eos": True,
                                           "stream_options": {"include_usage": True,
                                                              "continuous_usage_stats": True}})
    chunks = [e for e in sse_events(r.text) if e != "[DONE]"]
    assert all(c["usage"] is not None for c in chunks)
    assert [c["usage"]["completion_tokens"] for c in chunks][-1] == 4
    r = post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "stream": True, "ignore_eos": True,
                                      "stream_options": {"continuous_usage_stats": True}})
    used = [e["usage"]["completion_tokens"] for e in sse_events(r.text) if e != "[DONE]"]
    assert used == sorted(used) and used[-1] == 3


def test_best_of(app):
    assert complete(app, best_of=2, n=2)["choices"][1]["index"] == 1
    err = _check_error_shape(post(app, "/v1/completions", {"prompt": "x", "best_of": 3}), 400)
    assert err["param"] == "best_of" and "not supported" in err["message"]


@pytest.mark.parametrize("field, value", [("audio", {"voice": "alloy", "format": "wav"}), ("use_beam_search", True),
                                          ("prediction", {"type": "content", "content": "x"}),
                                          ("chat_template", "{{ x }}"), ("store", True)])
def test_fields_the_server_cannot_honour_are_refused_by_name(app, field, value):
    err = _check_error_shape(chat(app, 400, **{field: value}), 400)
    assert err["param"] == field and err["message"].startswith(f"{field}: not supported")


def test_no_op_values_and_labels_pass_and_unknown_fields_are_reported(app):
    r = chat(app, audio=None, use_beam_search=False, user="u1", metadata={"k": "v"}, service_tier="auto")
    assert "x-tokenmill-ignored-fields" not in r.headers
    r = chat(app, frobnicate=1, top_q=0.5)
    assert r.headers["x-tokenmill-ignored-fields"] == "frobnicate, top_q"
    r = post(app, "/v1/completions", {"prompt": "x", "max_tokens": 2, "frobnicate": 1, "stream": True})
    assert r.status_code == 200 and r.headers["x-tokenmill-ignored-fields"] == "frobnicate"


def test_unknown_constraint_keys_are_refused(app):
    err = _check_error_shape(chat(app, 400, structured_outputs={"choices": ["a", "b"]}), 400)
    assert err["param"] == "structured_outputs" and "'choices'" in err["message"]
    err = _check_error_shape(chat(app, 400, guided_choices=["a", "b"]), 400)
    assert err["param"] == "guided_choices"
    assert chat(app, structured_outputs={"choice": ["yes", "no"], "disable_fallback": True}
                ).json()["choices"][0]["message"]["content"] in ("yes", "no")


def test_unknown_response_format_keys_are_refused(app):
    for fmt in ({"type": "json_object", "schema": {"type": "object"}},
                {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "shema": {}}},
                {"type": "json_schema", "jsonschema": {"schema": {}}}):
        assert _check_error_shape(chat(app, 400, response_format=fmt), 400)["param"] == "response_format"


def test_parsing_helpers():
    from tokenmill.engine.grammar.structured import ascii_classes
    from tokenmill.entrypoints.parsers.tool_calls import complete_items
    from tokenmill.entrypoints.parsers.tool_parsers import HermesParser

    assert ascii_classes(r"\d{2}[\w.]\S\\d") == r"[0-9]{2}[0-9A-Za-z_.][^ \t\n\r\f\v]\\d"
    assert complete_items('[{"a": 1}, {"b": [2]}, {"c": ') == [{"a": 1}, {"b": [2]}]
    cut = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "g", "argu'
    content, calls = HermesParser().extract(cut)
    assert content is None and [c.name for c in calls] == ["f"]
    assert HermesParser().extract('<tool_call>{"name": "f", "argu')[1] == []  # nothing complete: text stays


def test_image_parts_say_the_model_reads_text_only(app):
    content = [{"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    err = _check_error_shape(chat(app, 400, messages=[{"role": "user", "content": content}]), 400)
    assert "does not accept images" in err["message"]
    parts = [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]
    err = _check_error_shape(post(app, "/v1/responses", {"input": parts}), 400)
    assert "does not accept images" in err["message"]


def test_regex_digits_are_ascii(app):
    for seed in range(3):
        r = chat(app, guided_regex=r"\d{4}", temperature=1.0, seed=seed, max_tokens=10)
        assert re.fullmatch("[0-9]{4}", r.json()["choices"][0]["message"]["content"])
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": r"^\d{3}$"}}, "required": ["code"]}
    r = chat(app, response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
             temperature=1.0, seed=4, max_tokens=30)
    assert re.fullmatch("[0-9]{3}", json.loads(r.json()["choices"][0]["message"]["content"])["code"])


def test_responses_cut_by_max_output_tokens_mark_the_message_incomplete(app):
    r = post(app, "/v1/responses", {"input": "hi", "max_output_tokens": 3})
    body = r.json()
    assert body["status"] == "incomplete" and body["output"][0]["status"] == "incomplete"
    r = post(app, "/v1/responses", {"input": "hi", "max_output_tokens": 3, "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["output"][0]["status"] == "incomplete"
    err = _check_error_shape(post(app, "/v1/responses", {"input": "hi", "reasoning": {"effort": "bogus"}}), 400)
    assert err["param"] == "reasoning"
    _check_error_shape(post(app, "/v1/responses", {"input": "hi", "background": True}), 400)


# ---- tools -----------------------------------------------------------------------------

def test_chatml_model_without_tools_gets_the_tools_template(chatml):
    state = chatml.state.tokenmill
    assert state.tools_template is not None and state.tool_parser_hint == "hermes"
    turns = [{"role": "user", "content": "time?"},
             {"role": "assistant", "content": None,
              "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "clock",
                                                                          "arguments": "{\"zone\": \"UTC\"}"}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    prompt = _prompt(chatml, messages=turns)
    assert '<tool_call>\n{"name": "clock", "arguments": {"zone": "UTC"}}\n</tool_call>' in prompt
    assert "<tool_response>\n12:00\n</tool_response>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    without = post(chatml, "/tokenize", {"messages": turns[:1]}).json()["count"]
    r = chat(chatml, messages=turns[:1], tools=[CLOCK], tool_choice="none")
    assert r.json()["usage"]["prompt_tokens"] > without + 100  # the tool list is in the prompt
    assert post(chatml, "/tokenize", {"messages": turns[:1], "tools": [CLOCK]}).json()["count"] == \
        r.json()["usage"]["prompt_tokens"]
    # a plain conversation keeps the model's own template
    assert _prompt(chatml) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # a tool loop with auto and no parser: the error names the flags
    err = _check_error_shape(chat(chatml, 400, messages=turns, tools=[CLOCK]), 400)
    assert "--enable-auto-tool-choice --tool-call-parser hermes" in err["message"]


def test_legacy_functions_map_to_tools(chatml):
    r = chat(chatml, functions=[CLOCK["function"]], function_call={"name": "clock"}, max_tokens=30)
    message = r.json()["choices"][0]["message"]
    assert message["function_call"]["name"] == "clock" and json.loads(message["function_call"]["arguments"])
    assert r.json()["choices"][0]["finish_reason"] == "function_call" and message.get("tool_calls") is None
    turns = [{"role": "user", "content": "time?"},
             {"role": "assistant", "content": None, "function_call": {"name": "clock", "arguments": "{}"}},
             {"role": "function", "name": "clock", "content": "12:00"}]
    assert "<tool_response>\n12:00\n</tool_response>" in _prompt(chatml, messages=turns)
    r = post(chatml, "/v1/chat/completions", {"messages": turns, "functions": [CLOCK["function"]],
                                              "function_call": {"name": "clock"}, "stream": True, "max_tokens": 30})
    deltas = [e["choices"][0]["delta"] for e in sse_events(r.text) if e != "[DONE]" and e["choices"]]
    assert any("function_call" in d for d in deltas) and not any("tool_calls" in d for d in deltas)


def test_model_404_has_one_wording(app):
    a = _check_error_shape(chat(app, 404, model="nope"), 404)
    b = _check_error_shape(get(app, "/v1/models/nope"), 404)
    c = _check_error_shape(post(app, "/tokenize", {"model": "nope", "prompt": "x"}), 404)
    assert a["message"] == b["message"] == c["message"] and a["code"] == "model_not_found"

"""Request models of the OpenAI wire format: what they accept, what they refuse,
and how refusals read once turned into an OpenAI error."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from tokenmill.entrypoints.server.errors import _describe_validation
from tokenmill.entrypoints.openai.protocol import (MAX_N, MAX_PROMPTS, ChatCompletionRequest, CompletionRequest,
                                            TokenizeRequest)


def test_prompt_shapes_normalise_to_a_list():
    assert CompletionRequest(prompt="hi").prompts() == ["hi"]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]


@pytest.mark.parametrize("body", [
    {"prompt": []},
    {"prompt": ["x"] * (MAX_PROMPTS + 1)},
    {"prompt": "x", "n": MAX_N + 1},
    {"prompt": "x", "max_tokens": 0},
    {"prompt": "x", "prompt_logprobs": 21},
    {"prompt": "x", "prompt_logprobs": 1, "stream": True},
    {"prompt": "x", "suffix": "tail"},
    {"prompt": "x", "stop": ["a" * 300]},
    {"prompt": "x", "stream_options": {"include_usage": True}},
    {"prompt": "x", "seed": 1 << 64},
    {"prompt": {"text": "x"}},
])
def test_completion_refusals(body):
    with pytest.raises(ValidationError):
        CompletionRequest(**body)


def test_chat_limits_and_output_limit():
    msgs = [{"role": "user", "content": "hi"}]
    assert ChatCompletionRequest(messages=msgs).output_limit is None
    assert ChatCompletionRequest(messages=msgs, max_tokens=9).output_limit == 9
    assert ChatCompletionRequest(messages=msgs, max_tokens=9, max_completion_tokens=5).output_limit == 5
    parts = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                         {"type": "text", "text": "b"}]}])
    assert parts.messages[0].text() == "ab"
    for bad in ({"messages": []}, {"messages": [{"role": "robot", "content": "x"}]},
                {"messages": msgs, "top_logprobs": 3}, {"messages": msgs, "tools": [{"type": "function"}]},
                {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}):
        with pytest.raises(ValidationError):
            ChatCompletionRequest(**bad)


def test_unknown_fields_are_ignored():
    req = CompletionRequest(prompt="x", logit_bias=None, best_of=1, something_new={"a": 1})
    assert req.prompt == "x"


def test_lone_surrogates_refused_anywhere():
    with pytest.raises(ValidationError, match="Unicode"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "ok \ud800"}])
    with pytest.raises(ValidationError, match="Unicode"):
        CompletionRequest(prompt="x", stop=["\udc00"])
    assert CompletionRequest(prompt="héllo 👋").prompt == "héllo 👋"  # real non-ASCII is fine


def test_tokenize_needs_exactly_one_input():
    assert TokenizeRequest(prompt="x").prompt == "x"
    for bad in ({}, {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}):
        with pytest.raises(ValidationError):
            TokenizeRequest(**bad)


def _errors(model, **body):
    try:
        model(**body)
    except ValidationError as exc:
        return [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
    raise AssertionError("accepted")


def test_validation_messages_name_the_parameter():
    msg, param = _describe_validation(_errors(CompletionRequest, prompt="x", temperature=7))
    assert param == "temperature" and "temperature" in msg and "2" in msg
    msg, param = _describe_validation(_errors(CompletionRequest, prompt="x", max_tokens=0))
    assert param == "max_tokens" and "echo" in msg
    assert CompletionRequest(prompt="x", echo=True, logprobs=2, max_tokens=0).prompt_logprobs_needed == 2
    assert CompletionRequest(prompt="x", logprobs=2, prompt_logprobs=4).prompt_logprobs_needed == 4
    assert CompletionRequest(prompt="x", logprobs=2).prompt_logprobs_needed is None
    msg, param = _describe_validation(_errors(CompletionRequest))
    assert param == "prompt" and "required" in msg
    msg, param = _describe_validation([{"type": "json_invalid", "loc": ("body", 7), "msg": "JSON decode error",
                                        "ctx": {"error": "Expecting value"}}])
    assert "malformed JSON" in msg and "Expecting value" in msg and param is None

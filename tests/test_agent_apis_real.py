"""The Anthropic Messages API and stored Responses with the bundled SmolLM2 on a real
socket, driven by the clients people use: the `anthropic` SDK and the `openai` SDK.
One in-process server (uvicorn thread) for the module, with an API key (the
Anthropic SDK sends it as x-api-key) and a chat template with a tool section. This SDK
no longer has sampling arguments (temperature, top_k, top_p): they go in extra_body."""
from __future__ import annotations

import pytest

from chat_templates import HERMES_TOOLS_TEMPLATE
from test_server_support import ThreadServer

pytestmark = pytest.mark.slow
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

MODEL = "smol"
KEY = "agent-key"
WEATHER = {"name": "get_weather", "description": "Get the current weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
GREEDY = {"temperature": 0}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    from tokenmill.settings.config import EngineConfig
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.engine.engine import LLMEngine
    from tokenmill.entrypoints.server.app import build_app
    from tokenmill.entrypoints.server.serving import ServerSettings

    engine = LLMEngine(EngineConfig.from_options(kv_cache_memory="256MiB", max_model_len=2048))
    app = build_app(AsyncEngine(engine), ServerSettings(
        served_model_names=[MODEL], api_key=KEY, chat_template=HERMES_TOOLS_TEMPLATE,
        enable_auto_tool_choice=True, tool_call_parser="hermes"))
    try:
        with ThreadServer(app) as srv:
            yield srv
    finally:
        app.state.tokenmill.aengine.shutdown()


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=300)


def test_anthropic_create_and_stream_agree(claude):
    kwargs = dict(model=MODEL, max_tokens=16, extra_body=GREEDY, system="You are a helpful assistant.",
                  messages=[{"role": "user", "content": "Name three colors."}])
    message = claude.messages.create(**kwargs)
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "text"
    assert message.stop_reason in ("end_turn", "max_tokens") and message.usage.output_tokens > 0
    with claude.messages.stream(**kwargs) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(texts) > 1 and "".join(texts) == message.content[0].text
    assert final.content[0].text == message.content[0].text and final.stop_reason == message.stop_reason
    # the same prompt again: most of it comes from the prefix cache
    assert final.usage.cache_read_input_tokens > 0
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        message.usage.input_tokens + message.usage.cache_read_input_tokens
    counted = claude.messages.count_tokens(model=MODEL, system=kwargs["system"], messages=kwargs["messages"])
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_anthropic_tool_use_then_tool_result(claude):
    first = claude.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY, tools=[WEATHER], messages=ASK,
                                   tool_choice={"type": "tool", "name": "get_weather"})
    assert first.stop_reason == "tool_use"
    use = next(b for b in first.content if b.type == "tool_use")
    assert use.name == "get_weather" and isinstance(use.input.get("city"), str)
    answer = claude.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY, tools=[WEATHER], messages=ASK + [
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18C and sunny"}]}])
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"
    assert answer.content[0].text.strip()


def test_anthropic_error_classes(server, claude):
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model=MODEL, max_tokens=4, messages=ASK, extra_body={"temperature": 3.0})
    assert bad.value.body["error"]["type"] == "invalid_request_error" and "temperature" in bad.value.message
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-opus-4-1", max_tokens=4, messages=ASK)
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model=MODEL, max_tokens=4, messages=ASK)


def test_openai_responses_three_turns_reuse_the_cache(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    turns = ["My name is Ana and I live in Lisbon.", "What is my name?", "Where do I live?"]
    previous = None
    responses = []
    for text in turns:
        r = client.responses.create(model=MODEL, input=text, previous_response_id=previous, max_output_tokens=12,
                                    temperature=0)
        responses.append(r)
        previous = r.id
    assert [r.previous_response_id for r in responses] == [None, responses[0].id, responses[1].id]
    for before, after in zip(responses, responses[1:]):
        assert after.usage.input_tokens > before.usage.input_tokens + before.usage.output_tokens
        assert after.usage.input_tokens_details.cached_tokens >= before.usage.input_tokens // 2
    assert client.responses.retrieve(responses[1].id).output_text == responses[1].output_text
    client.responses.delete(responses[1].id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(responses[1].id)

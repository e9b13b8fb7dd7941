"""Structured outputs, tools and the Responses API with the bundled SmolLM2 on a real
socket, driven by the clients people use: the `openai` SDK and LangChain's ChatOpenAI.
The server runs in-process (uvicorn thread) so the test can give it a chat template
with a tool section (the bundled one has none)."""
from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from chat_templates import HERMES_TOOLS_TEMPLATE
from test_server_support import ThreadServer

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

MODEL = "smol"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


class Person(BaseModel):
    name: str
    age: int
    city: str


PERSON_PROMPT = "Ana is 31 years old and lives in Lisbon. Extract the person."


@pytest.fixture(scope="module")
def server():
    from tokenmill.settings.config import EngineConfig
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.engine.engine import LLMEngine
    from tokenmill.entrypoints.server.app import build_app
    from tokenmill.entrypoints.server.serving import ServerSettings

    engine = LLMEngine(EngineConfig.from_options(kv_cache_memory="256MiB", max_model_len=2048))
    app = build_app(AsyncEngine(engine), ServerSettings(
        served_model_names=[MODEL], chat_template=HERMES_TOOLS_TEMPLATE, enable_auto_tool_choice=True,
        tool_call_parser="hermes"))
    try:
        with ThreadServer(app) as srv:
            yield srv
    finally:
        app.state.tokenmill.aengine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def chat_model(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="none", model=MODEL, temperature=0,
                                       max_tokens=150, max_retries=0)


def test_sdk_parse_with_a_pydantic_model(client):
    r = client.beta.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": PERSON_PROMPT}],
                                           response_format=Person, temperature=0, max_tokens=150)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and r.choices[0].finish_reason == "stop"
    assert person.age == 31


@pytest.mark.parametrize("method", ["json_schema", "json_mode"])
def test_langchain_with_structured_output(chat_model, method):
    prompt = PERSON_PROMPT
    if method == "json_mode":  # JSON mode fixes the syntax, not the keys: the prompt names them
        prompt += ' Answer with a JSON object with exactly the keys "name", "age" and "city".'
    person = chat_model.with_structured_output(Person, method=method).invoke(prompt)
    assert isinstance(person, Person)


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_langchain_bind_tools(chat_model, choice):
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        return "sunny"

    msg = chat_model.bind_tools([get_weather], tool_choice=choice).invoke("What's the weather in Paris?")
    assert [c["name"] for c in msg.tool_calls] == ["get_weather"]
    assert isinstance(msg.tool_calls[0]["args"]["city"], str)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_sdk_tool_call_then_tool_result_round_trip(client, choice):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=choice,
                                           temperature=0, max_tokens=100)
    c = first.choices[0]
    assert c.finish_reason == "tool_calls"
    call = c.message.tool_calls[0]
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    history = ASK + [c.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees Celsius."}]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                            temperature=0, max_tokens=40)
    answer = second.choices[0]
    assert answer.message.tool_calls is None and answer.message.content


def test_streamed_tool_call_deltas_reassemble(client):
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=100)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] = tc.id or slot["id"]
                slot["name"] += (tc.function.name or "") if tc.function else ""
                slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(w.function.name, json.loads(w.function.arguments)) for w in whole]


def test_responses_create_and_stream_with_a_function_tool(client):
    tool = {"type": "function", "name": "get_weather", "description": "Get the current weather for a city",
            "parameters": WEATHER["function"]["parameters"], "strict": False}
    r = client.responses.create(model=MODEL, input="What's the weather in Paris?", tools=[tool],
                                tool_choice="required", max_output_tokens=60, temperature=0)
    calls = [item for item in r.output if item.type == "function_call"]
    assert r.status == "completed" and calls and calls[0].name == "get_weather"
    follow = client.responses.create(model=MODEL, tools=[tool], tool_choice="none", max_output_tokens=30, input=[
        {"role": "user", "content": "What's the weather in Paris?"}, calls[0].model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 24 C"}])
    assert follow.output_text
    with client.responses.stream(model=MODEL, input="What's the weather in Rome?", tools=[tool],
                                 tool_choice="required", max_output_tokens=60, temperature=0) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    fc = next(item for item in final.output if item.type == "function_call")
    assert fc.name == "get_weather" and "city" in json.loads(fc.arguments)


def test_responses_with_text_format_json_schema(client):
    schema = Person.model_json_schema()
    r = client.responses.create(model=MODEL, input=PERSON_PROMPT, max_output_tokens=150, temperature=0, text={
        "format": {"type": "json_schema", "name": "person", "schema": schema, "strict": False}})
    assert Person.model_validate_json(r.output_text).age == 31
    with client.responses.stream(model=MODEL, input=PERSON_PROMPT, text_format=Person, max_output_tokens=150,
                                 temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Person) and "".join(deltas) == final.output_text


def test_bad_schema_is_a_400_and_serving_goes_on(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}}})
    assert "not" in str(info.value)
    assert client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3).choices[0].message.content

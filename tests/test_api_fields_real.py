"""`tokenmill serve --enable-auto-tool-choice --tool-call-parser hermes` with the bundled
SmolLM2, driven by the openai SDK and LangChain: a tool loop with nothing but those two
flags (the server supplies the tools template), a `required` answer cut at 64 tokens,
and each request field that used to be dropped, through the SDK."""
from __future__ import annotations

import json

import httpx
import pytest

from test_server_support import real_server

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]
RESULT = "Sunny, 24 degrees Celsius."


@pytest.fixture(scope="module")
def server():
    with real_server("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--kv-cache-memory", "128MiB") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer():
    from tokenmill.files.tokenizer import Tokenizer

    return Tokenizer.from_model_path(None)


def test_startup_says_which_template_renders_tools(server):
    assert any("ChatML template with hermes-format tool calls" in line for line in server.lines)


def test_sdk_tool_loop_call_result_answer(client, model):
    first = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="required",
                                           temperature=0, max_tokens=64)
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris"
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    second = client.chat.completions.create(model=model, messages=history, tools=[WEATHER], temperature=0,
                                            max_tokens=32)  # tool_choice auto, parsed with hermes
    answer = second.choices[0]
    assert answer.message.content and answer.message.tool_calls is None
    # the call and its result are in the prompt: the model's own template would have failed on content null
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 20


def test_langchain_bind_tools_and_tool_message_round_trip(server, model):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        return RESULT

    llm = langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="none", model=model, temperature=0,
                                      max_tokens=48, max_retries=0)
    history = [HumanMessage("What's the weather in Paris?")]
    ai = llm.bind_tools([get_weather], tool_choice="required").invoke(history)
    assert [c["name"] for c in ai.tool_calls] == ["get_weather"]
    history += [ai, ToolMessage(get_weather.invoke(ai.tool_calls[0]["args"]), tool_call_id=ai.tool_calls[0]["id"])]
    final = llm.bind_tools([get_weather]).invoke(history)
    assert isinstance(final.content, str) and final.content and not final.tool_calls


def test_langchain_agent_loop_call_result_answer(server, model):
    """LangChain's own agent loop (create_agent): the model calls the tool, the agent runs it
    and sends the result back, the model answers, and the loop ends on that answer. The
    bundled 135M model answers in prose when left to choose on its first turn, so a
    middleware asks for a call (tool_choice "required") until a tool has answered; the
    answering turn is the agent's default, "auto", read by the hermes parser."""
    langchain_agents = pytest.importorskip("langchain.agents")
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain.agents.middleware import ModelRequest, wrap_model_call
    from langchain_core.messages import AIMessage, ToolMessage
    from langchain_core.tools import tool

    runs: list[str] = []

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        runs.append(city)
        return RESULT

    seen_choices: list[object] = []

    @wrap_model_call
    def call_until_answered(request: ModelRequest, handler):  # type: ignore[no-untyped-def]
        answered = any(isinstance(m, ToolMessage) for m in request.messages)
        request = request if answered else request.override(tool_choice="required")
        seen_choices.append(request.tool_choice)
        return handler(request)

    llm = langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="none", model=model, temperature=0,
                                      max_tokens=48, max_retries=0)
    agent = langchain_agents.create_agent(llm, tools=[get_weather], middleware=[call_until_answered])
    out = agent.invoke({"messages": [{"role": "user", "content": "What's the weather in Paris?"}]},
                       {"recursion_limit": 6})
    kinds = [type(m).__name__ for m in out["messages"]]
    assert kinds == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"]
    assert runs == ["Paris"] and seen_choices == ["required", None]
    final = out["messages"][-1]
    assert isinstance(final, AIMessage) and not final.tool_calls
    assert isinstance(final.content, str) and final.content.strip()


def test_required_answer_cut_at_64_tokens_keeps_its_complete_calls(client, model, tokenizer):
    # banning every token that could close the list makes the model go on calling until the cut
    closers = {str(i): -100 for i in range(tokenizer.vocab_size) if "]" in tokenizer.token_to_text(i)}
    r = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="required",
                                       temperature=0, max_tokens=64, logit_bias=closers)
    c = r.choices[0]
    assert c.finish_reason == "length" and r.usage.completion_tokens == 64
    assert c.message.content is None and len(c.message.tool_calls) >= 2
    assert all(json.loads(tc.function.arguments)["city"] for tc in c.message.tool_calls)


def test_each_field_through_the_sdk(server, client, model, tokenizer):
    say = [{"role": "user", "content": "Name a color."}]

    def text(**kw):
        kw.setdefault("max_tokens", 6)
        r = client.chat.completions.create(model=model, messages=kw.pop("messages", say), temperature=0, **kw)
        return r.choices[0].message.content

    base = text()
    first = tokenizer.encode(base, add_special_tokens=False)[0]
    assert tokenizer.encode(text(logit_bias={str(first): -100}), add_special_tokens=False)[0] != first
    forced = tokenizer.encode(" blue", add_special_tokens=False)[0]
    assert text(logit_bias={str(forced): 100}, max_tokens=3) == " blue" * 3
    allowed = tokenizer.encode(" red green", add_special_tokens=False)
    assert set(tokenizer.encode(text(extra_body={"allowed_token_ids": allowed}), add_special_tokens=False)) \
        <= set(allowed)
    word = base.split()[0]
    assert word not in text(extra_body={"bad_words": [word]})
    r = client.chat.completions.create(model=model, messages=say, temperature=0, max_tokens=8,
                                       extra_body={"min_tokens": 8})
    assert r.usage.completion_tokens == 8
    opened = text(messages=say + [{"role": "assistant", "content": "My favourite color is"}],
                  extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert opened and not opened.startswith("My favourite")
    tok = httpx.post(server.url + "/tokenize", json={"model": model, "prompt": "blue sky",
                                                     "return_token_strs": True}).json()
    assert tok["token_strs"] == [tokenizer.id_to_token(t) for t in tok["tokens"]]
    # legacy functions answer in their own shape
    r = client.chat.completions.create(model=model, messages=ASK, functions=[WEATHER["function"]],
                                       function_call={"name": "get_weather"}, temperature=0, max_tokens=32)
    assert r.choices[0].message.function_call.name == "get_weather"
    stream = client.chat.completions.create(model=model, messages=say, max_tokens=4, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"stream_options": {"include_usage": True,
                                                                           "continuous_usage_stats": True}})
    assert all(chunk.usage is not None for chunk in stream)
    raw = client.chat.completions.with_raw_response.create(model=model, messages=say, max_tokens=2,
                                                           reasoning_effort="low",
                                                           extra_body={"chat_template_kwargs": {"house_style": 1},
                                                                       "frobnicate": True})
    assert raw.headers["x-tokenmill-ignored-fields"] == "frobnicate, chat_template_kwargs.house_style, reasoning_effort"
    for bad in ({"reasoning_effort": "bogus"}, {"extra_body": {"best_of": 3}},
                {"extra_body": {"structured_outputs": {"choices": ["a"]}}}, {"extra_body": {"guided_choices": ["a"]}},
                {"extra_body": {"use_beam_search": True}}, {"logit_bias": {"abc": 100}},
                {"logit_bias": {"5": 1000}}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=model, messages=say, max_tokens=2, **bad)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=say, max_tokens=2)
    digits = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "A year?"}],
                                            max_tokens=8, temperature=0, extra_body={"guided_regex": r"\d{4}"})
    assert digits.choices[0].message.content.isascii() and len(digits.choices[0].message.content) == 4

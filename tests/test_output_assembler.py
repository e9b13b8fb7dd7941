"""Streamed and whole answers are the same answer, on every API, for every output parser.

A corpus of realistic raw model outputs (each tool-call format the server parses,
``<think>`` reasoning, plain and mixed text) is cut into engine deltas at points
hypothesis draws; the deltas go through the assembler and each API's encoder. The
streamed SSE events, folded back the way the SDKs fold them, must give exactly the
whole response of the same API for the whole text in one delta (tool names and
arguments, content, reasoning, finish reason, usage), and that must be what the
parsers read from the whole text. Fast: no server, no model.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hypothesis import given, settings, strategies as st

from tokenmill.engine.engine import SequenceDelta
from tokenmill.entrypoints.anthropic.messages_encoder import MessagesEncoder, MessageSpec
from tokenmill.entrypoints.openai.chat_encoder import ChatFold, ChatSpec, ChatStream
from tokenmill.entrypoints.openai.completion_encoder import CompletionFold, CompletionSpec, CompletionStream
from tokenmill.entrypoints.openai.responses_api import ResponsesRequest
from tokenmill.entrypoints.openai.responses_encoder import ResponsesEncoder, ResponseSpec
from tokenmill.entrypoints.parsers.assembler import Assembler
from tokenmill.entrypoints.parsers.reasoning import PARSERS as REASONING, split_reasoning
from tokenmill.entrypoints.parsers.tool_calls import ToolPlan, extract
from tokenmill.entrypoints.parsers.tool_parsers import get_parser
from tokenmill.model.sampler import Logprob

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
PROMPT_TOKENS, CACHED = 12, 4


@dataclass(frozen=True)
class Case:
    tools: str | None  # a --tool-call-parser name, "required", "named", "none", or None: no tools
    reasoning: str | None  # a --reasoning-parser name
    text: str  # what the model wrote
    prompt: str = "user: hi\nassistant: "

    def plan(self) -> ToolPlan | None:
        if self.tools is None:
            return None
        if self.tools in ("required", "named", "none"):
            return ToolPlan([WEATHER, TIME], self.tools, named="get_weather" if self.tools == "named" else None)  # type: ignore[arg-type]
        return ToolPlan([WEATHER, TIME], "auto", parser=get_parser(self.tools))


HERMES = [
    'I\'ll check the weather for you.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>',  # malformed: all content
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": "get_weath',  # cut short
    "Compare a < b, then <tool and <tool_cal are not calls.",
    'Il fait beau à Zürich ☀️  \n<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>',
    '\n\n<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>\nDone.',
    "   ",
    "",
]
LLAMA3 = [
    '{"name": "get_weather", "parameters": {"city": "Rome", "days": 1}}',
    '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}',
    '{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", "parameters": {"zone": "CET"}}',
    "  \n{\"name\": \"get_time\", \"parameters\": {}}",
    "The answer is {not json} here.",
    '{"broken": ',
    "<|python",
]
MISTRAL = [
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Lyon", "days": 2}}]',
    'Let me look that up. [TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}, '
    '{"name": "get_weather", "arguments": {"city": "Nice"}}]',
    '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}',
    "[TOOL] is not [TOOL_CALL] a call",
    "[TOOL_CALLS] nonsense",
]
REQUIRED = [
    '[{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}]',
    '[{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_wea',  # cut by max_tokens
    "[",
]
NAMED = ['{"city": "Oslo", "days": 2}', '{"city": "Os', ""]
THINKING = [
    "Let me think about it.\n</think>\n\nThe answer is 42.",
    "<think>\nThe user greets.\n</think>\n\nHello there!",
    "cut while thinking about </thi",
    "<think></think>only the answer",
    "no thinking here <think> at all",
    "<thin",
    "",
]
PLAIN = ["Hello, world!", "", "  spaced  ", "naïve café ☕ — 你好", 'text with <tool_call> and [TOOL_CALLS] inside']

CASES = (
    [Case(p, None, t) for p in ("hermes", "qwen", "qwen2_5") for t in HERMES]
    + [Case(p, None, t) for p in ("llama3_json", "llama4_json") for t in LLAMA3]
    + [Case("mistral", None, t) for t in MISTRAL]
    + [Case("required", None, t) for t in REQUIRED]
    + [Case("named", None, t) for t in NAMED]
    + [Case("none", None, t) for t in PLAIN + HERMES[:2]]
    + [Case(None, None, t) for t in PLAIN]
    + [Case(None, r, t, prompt) for r in REASONING for t in THINKING
       for prompt in ("user: hi\nassistant: ", "user: hi\nassistant: <think>\n", "q <think>\n\n</think>\n\n")]
    + [Case("hermes", "qwen3", "<think>\nweather, so call the tool\n</think>\n\n" + HERMES[0]),
       Case("hermes", "deepseek_r1", "the user wants Oslo</think>" + HERMES[1]),
       Case("named", "qwen3", '<think>\nOslo</think>\n{"city": "Oslo"}'),
       Case("mistral", "deepseek_r1", "hmm</think>" + MISTRAL[1]),
       Case("llama3_json", "qwen3", "<think>x</think>\n" + LLAMA3[0])]
)


class FakeState:
    """Token texts for logprobs: token id t is the character chr(t)."""

    @staticmethod
    def token_text(token_id: int) -> str:
        return chr(token_id)


def deltas(text: str, cuts: list[int], finish: str, stop: Any, prompt: str | None = None) -> list[SequenceDelta]:
    """``text`` as engine deltas cut at ``cuts``; a token per character, so usage is the same however cut.
    ``prompt``: its logprobs come with the first delta (as the engine sends them for ``echo``)."""
    points = sorted({c for c in cuts if 0 < c < len(text)}) + [len(text)]
    out, start = [], 0
    for k, end in enumerate(points):
        last = k == len(points) - 1
        ids = [ord(ch) for ch in text[start:end]]
        lps = [Logprob(t, -0.5, {t: -0.5}) for t in ids]
        out.append(SequenceDelta("r-0", 0, ids, text[start:end], lps, last, finish if last else None,
                                 stop if last else None, PROMPT_TOKENS, CACHED))
        if k == 0 and prompt is not None:
            out[0].prompt_logprobs = [None] + [Logprob(ord(ch), -1.0, {ord(ch): -1.0}) for ch in prompt[1:]]
        start = end
    return out


def run(case: Case, pieces: list[SequenceDelta], encoder: Any, fold: bool = False) -> Any:
    """The events of ``pieces`` through ``encoder``: its SSE bytes, or (``fold``) its whole body."""
    reasoning = REASONING[case.reasoning] if case.reasoning else None
    assembler = Assembler([PROMPT_TOKENS], 1, case.plan(), reasoning, case.prompt)
    if fold:
        for d in pieces:
            encoder.add(assembler.feed(0, d))
        encoder.add(assembler.close())
        return encoder.body()
    out = encoder.opening(assembler.usage())
    for d in pieces:
        out += encoder.encode(assembler.feed(0, d))
    return b"".join(out + encoder.encode(assembler.close()) + encoder.done()).decode()


def sse_data(text: str) -> list[Any]:
    return [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: ") and line != "data: [DONE]"]


def typed_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


# ---- what each API's SDK makes of a stream ----------------------------------------------

def chat_from_chunks(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    message: dict[str, Any] = {"content": None, "reasoning_content": None, "tool_calls": {}}
    finish, usage, logprobs = None, None, []
    for chunk in chunks:
        if not chunk["choices"]:
            usage = chunk["usage"]
            continue
        choice = chunk["choices"][0]
        delta = choice["delta"]
        if delta.get("content"):
            message["content"] = (message["content"] or "") + delta["content"]
        if "reasoning_content" in delta:
            message["reasoning_content"] = (message["reasoning_content"] or "") + delta["reasoning_content"]
        for tc in delta.get("tool_calls") or []:
            slot = message["tool_calls"].setdefault(tc["index"], {"name": "", "arguments": ""})
            slot["name"] += tc.get("function", {}).get("name") or ""
            slot["arguments"] += tc.get("function", {}).get("arguments") or ""
        logprobs += (choice["logprobs"] or {}).get("content") or []
        finish = choice["finish_reason"] or finish
    calls = [message["tool_calls"][i] for i in sorted(message["tool_calls"])]
    return {"content": message["content"] or (None if calls else ""), "reasoning": message["reasoning_content"], "calls": calls,
            "finish": finish, "usage": usage, "logprobs": logprobs}


def chat_whole(body: dict[str, Any]) -> dict[str, Any]:
    choice = body["choices"][0]
    message = choice["message"]
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in message.get("tool_calls") or []]
    content = message["content"]
    return {"content": content if content or not calls else None, "reasoning": message.get("reasoning_content"),
            "calls": calls, "finish": choice["finish_reason"], "usage": body["usage"],
            "logprobs": choice["logprobs"]["content"]}


def responses_from_events(evs: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The output items a client builds from the deltas alone."""
    items: dict[int, dict[str, Any]] = {}
    for kind, data in evs:
        if kind == "response.output_item.added":
            item = data["item"]
            items[data["output_index"]] = {"type": item["type"], "text": "", "name": item.get("name")}
        elif kind in ("response.output_text.delta", "response.reasoning_text.delta",
                      "response.function_call_arguments.delta"):
            items[data["output_index"]]["text"] += data["delta"]
    return [items[i] for i in sorted(items)]


def responses_items(response: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for item in response["output"]:
        text = item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"]
        out.append({"type": item["type"], "text": text, "name": item.get("name")})
    return out


def without_ids(response: dict[str, Any]) -> dict[str, Any]:
    strip = ("id", "call_id")
    return {**response, "output": [{k: v for k, v in item.items() if k not in strip} for item in response["output"]]}


def anthropic_from_events(evs: list[tuple[str, dict[str, Any]]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
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
        elif kind == "message_delta":
            end = data
    for i, text in partial.items():
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = {}
        blocks[i]["input"] = value if isinstance(value, dict) else {}
    return [{k: v for k, v in b.items() if k != "id"} for b in blocks], end


# ---- what the parsers read from the whole text ------------------------------------------

def parsed(case: Case) -> dict[str, Any]:
    """Reasoning, content and calls as the parsers read the whole text at once."""
    thought, answer = (split_reasoning(REASONING[case.reasoning], case.text, case.prompt) if case.reasoning
                       else (None, case.text))
    plan = case.plan()
    if plan is not None and plan.mode == "named":
        calls = [{"name": "get_weather", "arguments": answer}] if answer else []
        return {"reasoning": thought, "content": None if calls else "", "calls": calls}
    content, found = extract(plan, answer) if plan is not None else (answer, [])
    calls = [{"name": c.name, "arguments": c.arguments} for c in found]
    return {"reasoning": thought, "content": content if calls else answer, "calls": calls}


CUTS = st.lists(st.integers(min_value=0, max_value=400), max_size=12)
ENDINGS = st.sampled_from([("stop", None), ("length", None), ("stop", "STOP"), ("stop", 7)])


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(CASES), cuts=CUTS, ending=ENDINGS)
def test_chat_streamed_at_any_cuts_is_the_whole_answer(case, cuts, ending):
    spec = ChatSpec("chatcmpl-1", "m", 1, True, 1, include_usage=True, tools=case.plan(),
                    reasoning=REASONING[case.reasoning] if case.reasoning else None)
    whole = chat_whole(run(case, deltas(case.text, [], *ending), ChatFold(spec, FakeState()), fold=True))
    streamed = chat_from_chunks(sse_data(run(case, deltas(case.text, cuts, *ending), ChatStream(spec, FakeState()))))
    # a chat stream cannot show an empty reasoning section (no delta says it), the body says ""
    assert streamed == whole | {"reasoning": whole["reasoning"] or None}
    assert chat_whole(run(case, deltas(case.text, cuts, *ending), ChatFold(spec, FakeState()), fold=True)) == whole
    expected = parsed(case)
    assert {k: whole[k] for k in expected} == expected
    assert whole["usage"]["completion_tokens"] == len(case.text) == len(whole["logprobs"])
    assert whole["finish"] == ("tool_calls" if ending[0] == "stop" and whole["calls"] and case.tools != "named"
                               or case.tools == "named" and ending[0] == "stop" and _valid_json(case) else ending[0])


def _valid_json(case: Case) -> bool:
    try:
        json.loads(parsed(case)["calls"][0]["arguments"])
        return True
    except (IndexError, json.JSONDecodeError):
        return False


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(CASES), cuts=CUTS, ending=ENDINGS)
def test_responses_streamed_at_any_cuts_is_the_whole_response(case, cuts, ending):
    def spec() -> ResponseSpec:
        return ResponseSpec("resp_1", "m", ResponsesRequest(input="hi"), created=1, count_tokens=len)

    whole = run(case, deltas(case.text, [], *ending), ResponsesEncoder(spec(), streamed=False), fold=True)
    evs = typed_events(run(case, deltas(case.text, cuts, *ending), ResponsesEncoder(spec())))
    assert [e["sequence_number"] for _, e in evs] == list(range(len(evs)))
    final = evs[-1][1]["response"]
    assert evs[-1][0] == ("response.incomplete" if ending[0] == "length" else "response.completed")
    assert without_ids(final) == without_ids(whole)
    assert responses_from_events(evs) == responses_items(whole)
    done = [e["item"] for kind, e in evs if kind == "response.output_item.done"]
    assert done == final["output"]
    expected = parsed(case)
    items = responses_items(whole)
    assert [(i["name"], i["text"]) for i in items if i["type"] == "function_call"] == \
        [(c["name"], c["arguments"]) for c in expected["calls"]]
    assert [i["text"] for i in items if i["type"] == "reasoning"] == \
        ([] if expected["reasoning"] is None else [expected["reasoning"]])
    assert "".join(i["text"] for i in items if i["type"] == "message") == (expected["content"] or "")


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(CASES), cuts=CUTS, ending=ENDINGS)
def test_messages_streamed_at_any_cuts_is_the_whole_message(case, cuts, ending):
    spec = MessageSpec("msg_1", "m", ["STOP"])
    whole = run(case, deltas(case.text, [], *ending), MessagesEncoder(spec, streamed=False), fold=True)
    evs = typed_events(run(case, deltas(case.text, cuts, *ending), MessagesEncoder(spec)))
    assert [k for k, _ in evs][:1] == ["message_start"] and [k for k, _ in evs][-2:] == ["message_delta", "message_stop"]
    assert evs[0][1]["message"]["usage"]["cache_read_input_tokens"] == CACHED
    blocks, end = anthropic_from_events(evs)
    assert blocks == [{k: v for k, v in b.items() if k != "id"} for b in whole["content"]]
    assert (end["delta"]["stop_reason"], end["delta"]["stop_sequence"], end["usage"]) == \
        (whole["stop_reason"], whole["stop_sequence"], whole["usage"])
    assert whole["usage"] == {"input_tokens": PROMPT_TOKENS - CACHED, "output_tokens": len(case.text),
                              "cache_creation_input_tokens": 0, "cache_read_input_tokens": CACHED}
    expected = parsed(case)
    uses = [(b["name"], b["input"]) for b in whole["content"] if b["type"] == "tool_use"]
    assert [u[0] for u in uses] == [c["name"] for c in expected["calls"]]
    thinking = [b["thinking"] for b in whole["content"] if b["type"] == "thinking"]
    assert thinking == ([] if expected["reasoning"] is None else [expected["reasoning"]])
    if ending == ("length", None):
        assert whole["stop_reason"] == "max_tokens"
    elif ending == ("stop", "STOP") and not (expected["calls"] and (case.tools != "named" or _valid_json(case))):
        assert (whole["stop_reason"], whole["stop_sequence"]) == ("stop_sequence", "STOP")


@settings(max_examples=200, deadline=None)
@given(text=st.sampled_from(PLAIN + HERMES + THINKING), cuts=CUTS, ending=ENDINGS, echo=st.booleans())
def test_completions_streamed_at_any_cuts_is_the_whole_completion(text, cuts, ending, echo):
    prompt = "PROMPT "
    spec = CompletionSpec("cmpl-1", "m", 1, 0, [prompt] if echo else None, include_usage=True,
                          prompt_ids=[[ord(ch) for ch in prompt]])
    case = Case(None, None, text)
    scored = prompt if echo else None
    whole = run(case, deltas(text, [], *ending, scored), CompletionFold(spec, 1, FakeState()), fold=True)
    chunks = sse_data(run(case, deltas(text, cuts, *ending, scored), CompletionStream(spec, FakeState())))
    said = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    tokens = [t for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
              for t in c["choices"][0]["logprobs"]["tokens"]]
    offsets = [o for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
               for o in c["choices"][0]["logprobs"]["text_offset"]]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    choice = whole["choices"][0]
    assert said == choice["text"] == (prompt if echo else "") + text
    assert "".join(tokens) == choice["text"]  # the echoed prompt's tokens lead, offsets count it
    assert tokens == choice["logprobs"]["tokens"] and offsets == choice["logprobs"]["text_offset"]
    assert finish == [choice["finish_reason"]] == [ending[0]]
    assert chunks[-1]["usage"] == whole["usage"] and whole["usage"]["completion_tokens"] == len(text)

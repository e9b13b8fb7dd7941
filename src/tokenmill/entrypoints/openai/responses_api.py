"""``/v1/responses``: the Responses API, with stored responses to continue from.

A request is translated into a chat completion (``input`` items -> messages,
``instructions`` -> a leading system message, flat function tools -> chat
tools, ``text.format`` -> ``response_format``, ``max_output_tokens`` ->
``max_completion_tokens``) and runs through the same preparation as
``/v1/chat/completions`` (templates, tools, grammars, limits); only the
output shape differs: a list of ``message`` and ``function_call`` items, and
while streaming, the typed events the SDKs accumulate (``response.created``
... ``response.output_text.delta`` ... ``response.completed``).

State (response_store.py): a response is stored unless the request says
``store: false``; ``previous_response_id`` continues a stored one (its
conversation, then the new input, so the prompt extends the previous prompt
and answer and hits the prefix cache); ``GET`` and ``DELETE
/v1/responses/{id}`` read and remove one; an id not in the store is a 404.
A stored response is its tenant's: to other tenants every route (these, the
input items, ``previous_response_id``) answers the 404 of an unknown id; the
operator reaches all (tenants.may_access, asked by the store).
With ``--reasoning-parser`` the thinking comes first as a ``reasoning`` item.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, get_args

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, ValidationError

from ..server.errors import APIError
from .openai_routes import _ERRORS, _until_done_or_gone, get_state, prepare_chat
from .protocol import MAX_TOKENS_LIMIT, ChatCompletionRequest, ReasoningEffort, _RequestBody
from ..parsers.reasoning import ReasoningParser, ReasoningSplit, get_reasoning_parser, split_reasoning
from .request_fields import ignored_headers, judge_extra
from .response_store import ResponseStore, StoredResponse
from ..server.serving import Job, ServerState
from ...gateway.tenants import owner_of, tenant_of
from .streaming import SSEResponse, _error_event, _streams, _Tally
from ..parsers.tool_calls import ToolPlan, ToolStream, extract, new_call_id

log = logging.getLogger("tokenmill.server")

router = APIRouter()


class ResponsesRequest(_RequestBody):
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(..., description="text, or a list of input items")
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = Field(None, max_length=512)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = Field(None, max_length=256)
    seed: int | None = None
    reasoning: dict[str, Any] | None = None  # {"effort": ...}: passed to templates that read it


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _part_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise APIError(400, f"{where}: content must be a string or a list of parts", param="input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            texts.append(str(part.get("text", "")))
        elif kind == "refusal":
            texts.append(str(part.get("refusal", "")))
        elif kind in ("input_image", "input_audio", "input_file"):
            raise APIError(400, f"{where}: a {kind!r} part, but this model does not accept "
                           f"{'images' if kind == 'input_image' else 'audio' if kind == 'input_audio' else 'files'} "
                           "(it reads text only); send text parts", param="input")
        else:
            raise APIError(400, f"{where}: content part type {kind!r} is not supported (text only)", param="input")
    return "".join(texts)


def to_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """``instructions`` and ``input`` as chat messages (tool calls and results included)."""
    lead = [{"role": "system", "content": body.instructions}] if body.instructions else []
    return lead + input_messages(body)


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """``input`` as chat messages."""
    messages: list[dict[str, Any]] = []
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
        return messages
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}: unknown role {role!r}", param="input")
            messages.append({"role": role, "content": _part_text(item.get("content"), where)})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str):
                raise APIError(400, f"{where}: a function_call needs a name", param="input")
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and (last.get("tool_calls") or not last["content"]):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _part_text(output, where) if isinstance(output, list) \
                else json.dumps(output)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise APIError(400, f"{where}: input item type {kind!r} is not supported", param="input")
    return messages


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise APIError(400, f"tools[{i}]: only function tools are supported (got {tool.get('type')!r})",
                           param="tools")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def to_chat(body: ResponsesRequest, history: list[dict[str, Any]] | None = None) -> ChatCompletionRequest:
    """The request as a chat completion; ``history``: the stored conversation it continues."""
    messages = to_messages(body)
    if history:
        lead = 1 if body.instructions else 0
        messages = messages[:lead] + history + messages[lead:]
    fields: dict[str, Any] = {
        "model": body.model, "messages": messages, "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "tools": _chat_tools(body.tools),
        "tool_choice": _chat_tool_choice(body.tool_choice), "parallel_tool_calls": body.parallel_tool_calls,
        "stream": body.stream, "seed": body.seed,
    }
    effort = (body.reasoning or {}).get("effort")
    if effort is not None:
        if effort not in get_args(ReasoningEffort):
            raise APIError(400, f"reasoning.effort: {effort!r} is not one of {', '.join(get_args(ReasoningEffort))}",
                           param="reasoning")
        fields["reasoning_effort"] = effort
    fmt = (body.text or {}).get("format")
    if fmt is not None:
        fields["response_format"] = fmt
    if not fields["messages"]:
        raise APIError(400, "input: must not be empty", param="input")
    try:
        return ChatCompletionRequest(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        param = "tools" if loc.startswith("tools") else "tool_choice" if loc.startswith("tool_choice") else "input"
        raise APIError(400, f"{param}: {msg}" if not msg.startswith(param) else msg, param=param) from None


# ---- output --------------------------------------------------------------------

@dataclass
class _Spec:
    response_id: str
    model: str
    body: ResponsesRequest
    plan: ToolPlan | None
    created: int = field(default_factory=lambda: int(time.time()))
    store: ResponseStore | None = None  # where the finished response goes (None: not stored)
    owner: str | None = None  # whose it is (tenants.owner_of): only they and the operator reach it
    history: list[dict[str, Any]] = field(default_factory=list)  # the conversation before this input
    reasoning: ReasoningParser | None = None
    prompt_text: str | None = None
    count_tokens: Any = None  # text -> token count (reasoning_tokens)

    def keep(self, response: dict[str, Any]) -> None:
        """Store the finished response with its conversation (this input and answer appended)."""
        if self.store is None:
            return
        answer: dict[str, Any] = {"role": "assistant", "content": None}
        calls = []
        for item in response["output"]:
            if item["type"] == "message":
                answer["content"] = "".join(part["text"] for part in item["content"])
            elif item["type"] == "function_call":
                calls.append({"id": item["call_id"], "type": "function",
                              "function": {"name": item["name"], "arguments": item["arguments"]}})
        if calls:
            answer["tool_calls"] = calls
        elif answer["content"] is None:
            answer["content"] = ""
        stored = StoredResponse(response, self.history + input_messages(self.body) + [answer], self.owner)
        if not self.store.put(self.response_id, stored) and self.store.capacity:
            log.warning("response %s not stored: its conversation is larger than --responses-store-bytes (%d); "
                        "previous_response_id to it will get 404", self.response_id, self.store.max_bytes)


def _usage(tally: _Tally, spec: _Spec | None = None, reasoning: str | None = None) -> dict[str, Any]:
    u = tally.usage()
    thought = spec.count_tokens(reasoning) if reasoning and spec is not None and spec.count_tokens else 0
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "total_tokens": u["total_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens_details": {"reasoning_tokens": min(thought, u["completion_tokens"])}}


def _response(spec: _Spec, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
              finish: str | None = None) -> dict[str, Any]:
    body = spec.body
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": spec.response_id, "object": "response", "created_at": spec.created, "status": status,
        "error": None, "incomplete_details": incomplete, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "model": spec.model, "output": output,
        "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
        "reasoning": None, "store": spec.store is not None, "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": body.text or {"format": {"type": "text"}},
        "tool_choice": body.tool_choice or ("auto" if body.tools else "none"), "tools": body.tools or [],
        "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled", "usage": usage,
        "user": body.user, "metadata": body.metadata or {},
    }


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _status(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


def _item_status(finish: str | None) -> str:
    """A message item cut by max_output_tokens is as incomplete as the response."""
    return "incomplete" if finish == "length" else "completed"


async def _body(state: ServerState, spec: _Spec, job: Job) -> dict[str, Any]:
    tally = _Tally([job])
    text, finish = "", None
    merged = _streams(state, [job])
    try:
        async for _, d in merged:
            tally.add(0, d)
            text += d.text
            if d.finished:
                finish = d.finish_reason
    finally:
        await merged.aclose()  # type: ignore[attr-defined]
    thought = None
    if spec.reasoning is not None:
        thought, text = split_reasoning(spec.reasoning, text, spec.prompt_text)
    content, calls = extract(spec.plan, text) if spec.plan is not None else (text, [])
    output: list[dict[str, Any]] = []
    if thought is not None:
        output.append(_reasoning_item(_new_id("rs"), thought))
    if content or not calls:
        output.append(_message_item(_new_id("msg"), content or "", _item_status(finish)))
    for call in calls:
        output.append(_call_item(_new_id("fc"), new_call_id(), call.name, call.arguments))
    response = _response(spec, _status(finish), output, _usage(tally, spec, thought))
    spec.keep(response)
    return response


def _event(kind: str, seq: int, **payload: Any) -> bytes:
    data = json.dumps({"type": kind, "sequence_number": seq, **payload}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


async def _stream(state: ServerState, spec: _Spec, job: Job) -> AsyncIterator[bytes]:
    """Typed events; text streams as it comes, a function call's arguments when known."""
    seq = 0
    output: list[dict[str, Any]] = []  # finished items, in output order
    open_msg: dict[str, Any] | None = None  # {"id", "index", "text"}
    open_call: dict[str, Any] | None = None  # {"id", "index", "call_id", "name", "arguments"}
    finish: str | None = None  # the engine's finish reason, once known
    open_thought: dict[str, Any] | None = None  # {"id", "index", "text"}
    thought_total: str | None = None

    def ev(kind: str, **payload: Any) -> bytes:
        nonlocal seq
        seq += 1
        return _event(kind, seq - 1, **payload)

    def close_msg() -> list[bytes]:
        nonlocal open_msg
        if open_msg is None:
            return []
        m, open_msg = open_msg, None
        part = {"type": "output_text", "text": m["text"], "annotations": [], "logprobs": []}
        item = _message_item(m["id"], m["text"], _item_status(finish))
        output.append(item)
        return [ev("response.output_text.done", item_id=m["id"], output_index=m["index"], content_index=0,
                   text=m["text"], logprobs=[]),
                ev("response.content_part.done", item_id=m["id"], output_index=m["index"], content_index=0,
                   part=part),
                ev("response.output_item.done", output_index=m["index"], item=item)]

    def thought_delta(text: str) -> list[bytes]:
        nonlocal open_thought, thought_total
        out: list[bytes] = []
        if open_thought is None:
            open_thought = {"id": _new_id("rs"), "index": len(output), "text": ""}
            item = _reasoning_item(open_thought["id"], "", "in_progress") | {"content": []}
            out.append(ev("response.output_item.added", output_index=open_thought["index"], item=item))
        if text:
            open_thought["text"] += text
            out.append(ev("response.reasoning_text.delta", item_id=open_thought["id"],
                          output_index=open_thought["index"], content_index=0, delta=text))
        thought_total = open_thought["text"]
        return out

    def close_thought() -> list[bytes]:
        nonlocal open_thought
        if open_thought is None:
            return []
        t, open_thought = open_thought, None
        item = _reasoning_item(t["id"], t["text"])
        output.append(item)
        return [ev("response.reasoning_text.done", item_id=t["id"], output_index=t["index"], content_index=0,
                   text=t["text"]),
                ev("response.output_item.done", output_index=t["index"], item=item)]

    def close_call() -> list[bytes]:
        nonlocal open_call
        if open_call is None:
            return []
        c, open_call = open_call, None
        item = _call_item(c["id"], c["call_id"], c["name"], c["arguments"])
        output.append(item)
        return [ev("response.function_call_arguments.done", item_id=c["id"], output_index=c["index"],
                   name=c["name"], arguments=c["arguments"]),
                ev("response.output_item.done", output_index=c["index"], item=item)]

    def text_delta(text: str) -> list[bytes]:
        nonlocal open_msg
        out = close_thought() + close_call()
        if open_msg is None:
            open_msg = {"id": _new_id("msg"), "index": len(output), "text": ""}
            out.append(ev("response.output_item.added", output_index=open_msg["index"],
                          item=_message_item(open_msg["id"], "", "in_progress") | {"content": []}))
            out.append(ev("response.content_part.added", item_id=open_msg["id"], output_index=open_msg["index"],
                          content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                 "logprobs": []}))
        if text:
            open_msg["text"] += text
            out.append(ev("response.output_text.delta", item_id=open_msg["id"], output_index=open_msg["index"],
                          content_index=0, delta=text, logprobs=[]))
        return out

    def call_piece(piece: dict[str, Any]) -> list[bytes]:
        nonlocal open_call
        out: list[bytes] = []
        fn = piece.get("function", {})
        if "id" in piece:
            out += close_thought() + close_msg() + close_call()
            open_call = {"id": _new_id("fc"), "index": len(output), "call_id": piece["id"],
                         "name": fn.get("name"), "arguments": ""}
            out.append(ev("response.output_item.added", output_index=open_call["index"],
                          item=_call_item(open_call["id"], piece["id"], fn.get("name"), "", "in_progress")))
        delta = fn.get("arguments") or ""
        if delta and open_call is not None:
            open_call["arguments"] += delta
            out.append(ev("response.function_call_arguments.delta", item_id=open_call["id"],
                          output_index=open_call["index"], delta=delta))
        return out

    def pieces(deltas: list[dict[str, Any]]) -> list[bytes]:
        out: list[bytes] = []
        for d in deltas:
            if "content" in d:
                out += text_delta(d["content"])
            for piece in d.get("tool_calls", []):
                out += call_piece(piece)
        return out

    started = _response(spec, "in_progress", [], None)
    yield ev("response.created", response=started)
    yield ev("response.in_progress", response=started)
    tally = _Tally([job])
    ts = ToolStream(spec.plan) if spec.plan is not None else None
    split = ReasoningSplit(spec.reasoning, spec.prompt_text) if spec.reasoning is not None else None
    merged = _streams(state, [job])
    try:
        async for _, d in merged:
            tally.add(0, d)
            text = d.text
            if split is not None:
                thought, text = split.feed(d.text, final=d.finished)
                if thought or (split.reasoning is not None and open_thought is None and not output):
                    for chunk in thought_delta(thought):
                        yield chunk
            for chunk in pieces(ts.feed(text) if ts is not None else [{"content": text}] if text else []):
                yield chunk
            if d.finished:
                finish = d.finish_reason
                if ts is not None:
                    rest, _ = ts.finish()
                    for chunk in pieces(rest):
                        yield chunk
        if open_msg is None and open_call is None and all(item["type"] == "reasoning" for item in output):
            for chunk in text_delta(""):
                yield chunk
        for chunk in close_thought() + close_msg() + close_call():
            yield chunk
        status = _status(finish)
        final = _response(spec, status, output, _usage(tally, spec, thought_total))
        spec.keep(final)
        yield ev("response.completed" if status == "completed" else "response.incomplete", response=final)
    except Exception as exc:  # noqa: BLE001 - reported in-band: the status line is already sent
        yield _error_event(exc)
    finally:
        await merged.aclose()  # type: ignore[attr-defined]


@router.post("/v1/responses", responses=_ERRORS)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    state = await get_state(request).serving_for(body.model, request.scope)
    headers = ignored_headers(judge_extra(body.model_extra, "responses"))
    store = response_store(request)
    history: list[dict[str, Any]] = []
    if body.previous_response_id:
        history = _stored(request, body.previous_response_id, "previous_response_id").messages
    chat = to_chat(body, history)
    response_id = _new_id("resp")
    job, plan = await prepare_chat(state, chat, response_id, tenant_of(request.scope))
    job.endpoint = "responses"
    state.admission.reserve([job], tenant_of(request.scope))
    keep = body.store is not False and store.capacity > 0
    spec = _Spec(response_id, body.model or state.model_name, body, plan, store=store if keep else None,
                 owner=owner_of(tenant_of(request.scope)), history=history, reasoning=get_reasoning_parser(state.settings.reasoning_parser),
                 prompt_text=job.prompt_text, count_tokens=lambda text: len(state.tokenizer.encode(text, False)))
    if body.stream:
        response = SSEResponse(_stream(state, spec, job), state, [job])
        response.headers.update(headers)
        return response
    try:
        return await _until_done_or_gone(request, _body(state, spec, job), headers)
    finally:
        state.admission.release(job)


def response_store(request: Request) -> ResponseStore:
    return request.app.state.response_store


def _not_found(request: Request, response_id: str, param: str) -> APIError:
    """The one 404 for an id the caller cannot reach: never stored, deleted, evicted, or another
    tenant's (the store answers those alike, so the message cannot tell them apart)."""
    store = response_store(request)
    where = "previous_response_id: " if param == "previous_response_id" else ""
    return APIError(404, f"{where}no stored response {response_id!r} (never stored, deleted, or evicted: "
                    f"this server keeps the last {store.capacity})", param=param, code="response_not_found")


def _stored(request: Request, response_id: str, param: str = "response_id") -> StoredResponse:
    """The stored response ``response_id`` as the caller may see it (response_store.py asks
    tenants.may_access), else the 404 an unknown id gets."""
    entry = response_store(request).get(response_id, caller=tenant_of(request.scope))
    if entry is None:
        raise _not_found(request, response_id, param)
    return entry


@router.get("/v1/responses/{response_id}", responses=_ERRORS)
async def get_response(response_id: str, request: Request) -> JSONResponse:
    return JSONResponse(_stored(request, response_id).body)


@router.get("/v1/responses/{response_id}/input_items", responses=_ERRORS)
async def get_input_items(response_id: str, request: Request) -> JSONResponse:
    """The conversation a stored response answered, as message items (oldest first)."""
    entry = _stored(request, response_id)
    items = [{"type": "message", "id": f"msg_{response_id}_{i}", "role": m["role"], "status": "completed",
              "content": [{"type": "input_text" if m["role"] != "assistant" else "output_text",
                           "text": m.get("content") or ""}]}
             for i, m in enumerate(entry.messages[:-1]) if m["role"] in ("user", "system", "assistant")]
    return JSONResponse({"object": "list", "data": items, "has_more": False,
                         "first_id": items[0]["id"] if items else None, "last_id": items[-1]["id"] if items else None})


@router.delete("/v1/responses/{response_id}", responses=_ERRORS)
async def delete_response(response_id: str, request: Request) -> JSONResponse:
    if not response_store(request).delete(response_id, caller=tenant_of(request.scope)):
        raise _not_found(request, response_id, "response_id")
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})

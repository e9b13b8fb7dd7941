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
from typing import Any, get_args

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, ValidationError

from ..server.errors import APIError
from .openai_routes import _ERRORS, _until_done_or_gone, get_state, prepare_chat
from .protocol import MAX_TOKENS_LIMIT, ChatCompletionRequest, ReasoningEffort, _RequestBody
from ..parsers.assembler import Assembler
from ..parsers.reasoning import get_reasoning_parser
from .request_fields import ignored_headers, judge_extra
from .response_store import ResponseStore, StoredResponse
from .responses_encoder import ResponseSpec, ResponsesEncoder, new_id
from ...gateway.tenants import owner_of, tenant_of
from .streaming import SSEResponse, fold_events, stream_events

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


@router.post("/v1/responses", responses=_ERRORS)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    state = await get_state(request).serving_for(body.model, request.scope)
    headers = ignored_headers(judge_extra(body.model_extra, "responses"))
    store = response_store(request)
    history: list[dict[str, Any]] = []
    if body.previous_response_id:
        history = _stored(request, body.previous_response_id, "previous_response_id").messages
    chat = to_chat(body, history)
    response_id = new_id("resp")
    job, plan = await prepare_chat(state, chat, response_id, tenant_of(request.scope))
    job.endpoint = "responses"
    state.admission.reserve([job], tenant_of(request.scope))
    keep = body.store is not False and store.capacity > 0
    conversation = history + input_messages(body) if keep else []
    spec = ResponseSpec(response_id, body.model or state.model_name, body, store=store if keep else None,
                        owner=owner_of(tenant_of(request.scope)), conversation=conversation,
                        count_tokens=lambda text: len(state.tokenizer.encode(text, False)))
    assembler = Assembler([len(job.prompt_ids)], tools=plan,
                          reasoning=get_reasoning_parser(state.settings.reasoning_parser), prompt_text=job.prompt_text)
    if body.stream:
        response = SSEResponse(stream_events(state, [job], assembler, ResponsesEncoder(spec)), state, [job])
        response.headers.update(headers)
        return response
    try:
        return await _until_done_or_gone(request, fold_events(state, [job], assembler,
                                                              ResponsesEncoder(spec, streamed=False)), headers)
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

"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API.

Why: agent clients (Claude Code, the ``anthropic`` SDK) speak this API, and
every major engine serves it next to OpenAI's. A request is translated into a
chat completion (``system`` -> a system message, ``tool_use`` blocks ->
assistant ``tool_calls``, ``tool_result`` blocks -> ``tool`` messages, tools'
``input_schema`` -> ``parameters``, ``tool_choice`` auto/any/tool/none ->
auto/required/named/none, ``stop_sequences`` -> ``stop``) and prepared
exactly as ``/v1/chat/completions`` is (template, tools, grammars, limits);
only the output differs: content blocks (``thinking`` with
``--reasoning-parser``, ``text``, ``tool_use``), Anthropic's stop reasons and
usage, and while streaming Anthropic's event sequence (``message_start``,
``content_block_start``, ``ping``, ``content_block_delta`` with
``text_delta`` / ``thinking_delta`` / ``input_json_delta``,
``content_block_stop``, ``message_delta``, ``message_stop``).

Usage follows Anthropic's split: ``input_tokens`` are the prompt tokens the
prefix cache did not hold, ``cache_read_input_tokens`` those it did (nothing is
written on request, so ``cache_creation_input_tokens`` is 0).

Errors: ``AnthropicErrors`` rewrites every error body on these paths (the API
key gate's 401, validation 400s, our own checks, unknown routes) into
``{"type": "error", "error": {"type", "message"}}`` with the same status, so
the SDK raises its own classes; errors after the stream started are an
``error`` event.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..server.errors import APIError
from ..openai.openai_routes import (_ERRORS, _until_done_or_gone, chat_render, encode, get_state, prepare_chat,
                            render_chat_async)
from ..openai.protocol import MAX_STOP, MAX_TOKENS_LIMIT, ChatCompletionRequest, _Model
from ..parsers.reasoning import ReasoningParser, ReasoningSplit, get_reasoning_parser, split_reasoning
from ..server.serving import Job, ServerState
from ..openai.streaming import SSEResponse, _streams, _Tally
from ...gateway.tenants import tenant_of
from ..parsers.tool_calls import ToolPlan, ToolStream, extract, plan_tools

router = APIRouter()

_PATH = "/v1/messages"
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                529: "overloaded_error"}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


class AnthropicErrors:
    """Rewrites OpenAI-shaped JSON error bodies under ``/v1/messages`` into Anthropic's shape.

    An ASGI wrapper rather than per-route code because errors there come from
    everywhere (the key gate, the body guard, FastAPI's validation, our own
    APIError); status and headers stay as they were."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith(_PATH):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def rewrite(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                ctype = dict(message.get("headers") or []).get(b"content-type", b"")
                if message["status"] >= 400 and ctype.startswith(b"application/json"):
                    start = message  # hold it: the body changes length
                    return
                await send(message)
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            raw = b"".join(chunks)
            try:
                err = json.loads(raw)["error"]
                body = json.dumps(anthropic_error(start["status"], str(err.get("message", "")))).encode()
            except (ValueError, KeyError, TypeError, AttributeError):
                body = raw
            headers = [(k, v) for k, v in start.get("headers") or [] if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, rewrite)


# ---- request --------------------------------------------------------------------

class CountTokensRequest(_Model):
    model: str | None = None
    messages: list[dict[str, Any]] = Field(..., min_length=1, max_length=4096)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=512)
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(..., ge=1, le=MAX_TOKENS_LIMIT)
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=1 << 20)
    metadata: dict[str, Any] | None = None
    stream: bool = False


def _texts(content: Any, where: str, allowed: tuple[str, ...] = ("text",)) -> str:
    """The text of a string or a list of text blocks."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise APIError(400, f"{where}: content must be a string or a list of content blocks", param="messages")
    out = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in allowed:
            raise APIError(400, f"{where}: content block type {kind!r} is not supported here"
                           f"{' (this model reads text only)' if kind in ('image', 'document') else ''}",
                           param="messages")
        out.append(str(block.get("text", "")))
    return "".join(out)


def _system(system: Any) -> list[dict[str, Any]]:
    text = _texts(system, "system")
    return [{"role": "system", "content": text}] if text else []


def _user(content: Any, where: str) -> list[dict[str, Any]]:
    """A user turn: its tool_result blocks as ``tool`` messages, its text as a user message."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise APIError(400, f"{where}: content must be a string or a list of content blocks", param="messages")
    out: list[dict[str, Any]] = []
    text: list[str] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text.append(str(block.get("text", "")))
        elif kind == "tool_result":
            if text:
                out.append({"role": "user", "content": "".join(text)})
                text = []
            result = _texts(block.get("content"), f"{where}.content[{j}]")
            if block.get("is_error"):
                result = f"Error: {result}"
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result})
        else:
            _texts([block], where)  # raises with the block's type
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _assistant(content: Any, where: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise APIError(400, f"{where}: content must be a string or a list of content blocks", param="messages")
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text.append(str(block.get("text", "")))
        elif kind == "tool_use":
            if not isinstance(block.get("name"), str):
                raise APIError(400, f"{where}: a tool_use block needs a name", param="messages")
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block["name"],
                                       "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # earlier turns' thinking is not shown to the model again
        else:
            _texts([block], where)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def to_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    messages = _system(body.system)
    for i, m in enumerate(body.messages):
        where = f"messages[{i}]"
        role = m.get("role")
        if role == "user":
            messages += _user(m.get("content"), where)
        elif role == "assistant":
            messages.append(_assistant(m.get("content"), where))
        else:
            raise APIError(400, f"{where}: role must be 'user' or 'assistant' (got {role!r}); the system prompt "
                           "goes in the top-level system field", param="messages")
    return messages


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") not in (None, "custom"):
            raise APIError(400, f"tools[{i}]: server tool {tool.get('type')!r} is not available here; give client "
                           "tools with name, description and input_schema", param="tools")
        fn: dict[str, Any] = {"name": tool.get("name"), "parameters": tool.get("input_schema") or
                              {"type": "object", "properties": {}}}
        if tool.get("description"):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict[str, Any] | None, has_tools: bool) -> tuple[Any, bool]:
    """Anthropic's tool_choice as chat's, and whether calls may be parallel."""
    if choice is None:
        return ("auto" if has_tools else None), True
    kind = choice.get("type")
    parallel = not choice.get("disable_parallel_tool_use", False)
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise APIError(400, "tool_choice: expected {\"type\": \"auto\" | \"any\" | \"none\"} or "
                   "{\"type\": \"tool\", \"name\": ...}", param="tool_choice")


def to_chat(body: CountTokensRequest) -> ChatCompletionRequest:
    tools = _tools(body.tools)
    choice, parallel = _tool_choice(body.tool_choice, bool(tools))
    if choice is not None and not tools:
        choice = None if choice == "none" else choice
    fields: dict[str, Any] = {"model": body.model, "messages": to_messages(body), "tools": tools,
                              "tool_choice": choice, "parallel_tool_calls": parallel}
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                      top_k=body.top_k if body.top_k else None, stop=body.stop_sequences, stream=body.stream)
    try:
        return ChatCompletionRequest(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        named, sep, _ = msg.partition(":")
        if sep and " " not in named:  # our validators' messages name the field already
            raise APIError(400, msg.replace("stop:", "stop_sequences:", 1), param=named) from None
        param = next((p for p in ("tools", "tool_choice") if loc.startswith(p)), "messages")
        raise APIError(400, f"{param}: {msg}", param=param) from None


# ---- output --------------------------------------------------------------------

@dataclass
class _Spec:
    message_id: str
    model: str
    body: MessagesRequest
    plan: ToolPlan | None
    reasoning: ReasoningParser | None
    prompt_text: str | None
    created: float = field(default_factory=time.time)


def _usage(tally: _Tally) -> dict[str, Any]:
    u = tally.usage()
    cached = u["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": u["prompt_tokens"] - cached, "output_tokens": u["completion_tokens"],
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _stop(spec: _Spec, finish: str | None, stop_reason: Any, called: bool) -> tuple[str, str | None]:
    if called and finish != "length":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str) and stop_reason in (spec.body.stop_sequences or []):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _tool_use(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        value = {}
    return {"type": "tool_use", "id": call_id, "name": name, "input": value if isinstance(value, dict) else {}}


def _new_tool_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _message(spec: _Spec, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
             usage: dict[str, Any]) -> dict[str, Any]:
    return {"id": spec.message_id, "type": "message", "role": "assistant", "model": spec.model,
            "content": content, "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}


async def _body(state: ServerState, spec: _Spec, job: Job) -> dict[str, Any]:
    tally = _Tally([job])
    text, finish, stop_reason = "", None, None
    merged = _streams(state, [job])
    try:
        async for _, d in merged:
            tally.add(0, d)
            text += d.text
            if d.finished:
                finish, stop_reason = d.finish_reason, d.stop_reason
    finally:
        await merged.aclose()  # type: ignore[attr-defined]
    blocks: list[dict[str, Any]] = []
    if spec.reasoning is not None:
        thought, text = split_reasoning(spec.reasoning, text, spec.prompt_text)
        if thought is not None:
            blocks.append({"type": "thinking", "thinking": thought, "signature": ""})
    content, calls = extract(spec.plan, text) if spec.plan is not None else (text, [])
    if content:
        blocks.append({"type": "text", "text": content})
    blocks += [_tool_use(_new_tool_id(), c.name, c.arguments) for c in calls]
    if not blocks:
        blocks.append({"type": "text", "text": ""})
    return _message(spec, blocks, _stop(spec, finish, stop_reason, bool(calls)), _usage(tally))


def _event(kind: str, **payload: Any) -> bytes:
    data = json.dumps({"type": kind, **payload}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


async def _stream(state: ServerState, spec: _Spec, job: Job) -> AsyncIterator[bytes]:
    """Anthropic's events; message_start waits for the first engine delta, which says how
    much of the prompt the cache held."""
    index = -1
    open_kind: str | None = None  # type of the open content block
    pinged = False
    tally = _Tally([job])
    ts = ToolStream(spec.plan) if spec.plan is not None else None
    split = ReasoningSplit(spec.reasoning, spec.prompt_text) if spec.reasoning is not None else None
    called = False

    def start(block: dict[str, Any]) -> list[bytes]:
        nonlocal index, open_kind, pinged
        out = stop_block()
        index += 1
        open_kind = block["type"]
        out.append(_event("content_block_start", index=index, content_block=block))
        if not pinged:
            pinged = True
            out.append(_event("ping"))
        return out

    def stop_block() -> list[bytes]:
        nonlocal open_kind
        if open_kind is None:
            return []
        open_kind = None
        return [_event("content_block_stop", index=index)]

    def thinking(text: str) -> list[bytes]:
        out = [] if open_kind == "thinking" else start({"type": "thinking", "thinking": "", "signature": ""})
        if text:
            out.append(_event("content_block_delta", index=index, delta={"type": "thinking_delta", "thinking": text}))
        return out

    def text_piece(text: str) -> list[bytes]:
        if not text:
            return []
        out = [] if open_kind == "text" else start({"type": "text", "text": ""})
        out.append(_event("content_block_delta", index=index, delta={"type": "text_delta", "text": text}))
        return out

    def answer(deltas: list[dict[str, Any]]) -> list[bytes]:
        nonlocal called
        out: list[bytes] = []
        for d in deltas:
            if "content" in d:
                out += text_piece(d["content"])
            for piece in d.get("tool_calls", []):
                fn = piece.get("function", {})
                if "id" in piece:
                    called = True
                    out += start({"type": "tool_use", "id": _new_tool_id(), "name": fn.get("name"), "input": {}})
                if fn.get("arguments"):
                    out.append(_event("content_block_delta", index=index,
                                      delta={"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return out

    merged = _streams(state, [job])
    started = False
    finish, stop_reason = None, None
    try:
        async for _, d in merged:
            tally.add(0, d)
            if not started:
                started = True
                usage = _usage(tally) | {"output_tokens": 0}
                yield _event("message_start", message=_message(spec, [], (None, None), usage))
            text = d.text
            if split is not None:
                thought, text = split.feed(d.text, final=d.finished)
                if thought or (split.reasoning is not None and index < 0):
                    for chunk in thinking(thought):
                        yield chunk
            pieces = ts.feed(text) if ts is not None else [{"content": text}]
            if d.finished:
                finish, stop_reason = d.finish_reason, d.stop_reason
                if ts is not None:
                    pieces += ts.finish()[0]
            for chunk in answer(pieces):
                yield chunk
        if index < 0:  # nothing at all: one empty text block, as the whole body has
            for chunk in start({"type": "text", "text": ""}):
                yield chunk
        for chunk in stop_block():
            yield chunk
        usage = _usage(tally)
        stop, sequence = _stop(spec, finish, stop_reason, called)
        yield _event("message_delta", delta={"stop_reason": stop, "stop_sequence": sequence}, usage=usage)
        yield _event("message_stop")
    except Exception as exc:  # noqa: BLE001 - reported in-band: the status line is already sent
        status, message = (exc.status, exc.message) if isinstance(exc, APIError) else (500, f"internal error: {exc}")
        yield _event("error", error=anthropic_error(status, message)["error"])
    finally:
        await merged.aclose()  # type: ignore[attr-defined]


# ---- routes --------------------------------------------------------------------

@router.post(_PATH, responses=_ERRORS)
async def create_message(body: MessagesRequest, request: Request) -> Response:
    state = await get_state(request).serving_for(body.model, request.scope)
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    job, plan = await prepare_chat(state, to_chat(body), message_id, tenant_of(request.scope))
    job.endpoint = "messages"
    state.admission.reserve([job], tenant_of(request.scope))
    spec = _Spec(message_id, body.model or state.model_name, body, plan,
                 get_reasoning_parser(state.settings.reasoning_parser), job.prompt_text)
    if body.stream:
        return SSEResponse(_stream(state, spec, job), state, [job])
    try:
        return await _until_done_or_gone(request, _body(state, spec, job))
    finally:
        state.admission.release(job)


@router.post(_PATH + "/count_tokens", responses=_ERRORS)
async def count_tokens(body: CountTokensRequest, request: Request) -> JSONResponse:
    """The prompt tokens a Messages request with this conversation and these tools would have."""
    state = await get_state(request).serving_for(body.model, request.scope)
    chat = to_chat(body)
    tools = [t.model_dump(exclude_none=True) for t in chat.tools] if chat.tools else None
    if tools:  # the same checks a real request gets (names, tool_choice against the server's flags)
        plan_tools(tools, chat.tool_choice, chat.parallel_tool_calls, state.settings, state.tool_parser_hint)
    state.admission.check_text_fits(sum(len(m.text()) for m in chat.messages), "messages")
    prompt = await render_chat_async(state, chat.messages, chat_render(chat, tools))
    return JSONResponse({"input_tokens": len(await encode(state, prompt, False))})

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
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..server.errors import APIError
from ..openai.openai_routes import (_ERRORS, _until_done_or_gone, chat_render, encode, get_state, prepare_chat,
                            render_chat_async)
from ..openai.protocol import MAX_STOP, MAX_TOKENS_LIMIT, ChatCompletionRequest, _Model
from ..parsers.assembler import Assembler
from ..parsers.reasoning import get_reasoning_parser
from ..openai.streaming import SSEResponse, fold_events, stream_events
from ...gateway.tenants import tenant_of
from ..parsers.tool_calls import plan_tools
from .messages_encoder import MessageSpec, MessagesEncoder, anthropic_error

router = APIRouter()

_PATH = "/v1/messages"
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


# ---- routes --------------------------------------------------------------------

@router.post(_PATH, responses=_ERRORS)
async def create_message(body: MessagesRequest, request: Request) -> Response:
    state = await get_state(request).serving_for(body.model, request.scope)
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    job, plan = await prepare_chat(state, to_chat(body), message_id, tenant_of(request.scope))
    job.endpoint = "messages"
    state.admission.reserve([job], tenant_of(request.scope))
    spec = MessageSpec(message_id, body.model or state.model_name, body.stop_sequences)
    assembler = Assembler([len(job.prompt_ids)], tools=plan,
                          reasoning=get_reasoning_parser(state.settings.reasoning_parser), prompt_text=job.prompt_text)
    if body.stream:
        return SSEResponse(stream_events(state, [job], assembler, MessagesEncoder(spec)), state, [job])
    try:
        return await _until_done_or_gone(request, fold_events(state, [job], assembler,
                                                              MessagesEncoder(spec, streamed=False)))
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

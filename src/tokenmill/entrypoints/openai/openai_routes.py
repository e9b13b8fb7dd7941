"""``/v1/completions`` and ``/v1/chat/completions``: validate, tokenize, submit.

The server owns the prompt: it renders the chat template, tokenizes, checks
lengths against the context and the KV pool (so the 400 states both numbers
and bad input never reaches the engine), builds ``SamplingParams`` and hands
token ids to the engine.
"""
from __future__ import annotations

import asyncio
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ...engine.limits import check_token_ids
from ...engine.request import SamplingParams
from ..server.errors import APIError
from ..parsers.reasoning import get_reasoning_parser, reasoning_for_grammar
from .protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse,
                       ErrorResponse, _SamplingFields)
from .request_fields import ignored_headers, judge_extra
from ..server.admission import as_api_error
from ..server.serving import Job, ServerState, session_of
from ...gateway.tenants import Tenant, tenant_of
from .structured_fields import check_grammar, grammar_spec
from ..parsers.tool_calls import ToolPlan, plan_tools, template_message, tool_schemas
from ..parsers.assembler import Assembler
from .chat_encoder import ChatFold, ChatSpec, ChatStream
from .completion_encoder import CompletionFold, CompletionSpec, CompletionStream
from .streaming import SSEResponse, fold_events, stream_events

router = APIRouter()

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 429, 503)}
_LONG_TEXT = 20_000  # characters; longer prompts are tokenized off the event loop


def get_state(request: Request) -> ServerState:
    return request.app.state.tokenmill


def _seed(seed: int | None) -> int | None:
    # the engine seeds torch generators with seed + index; keep that in range
    return None if seed is None else seed % (1 << 63)


def _token_ids(state: ServerState, ids: Any, param: str) -> None:
    with as_api_error():  # the sampler indexes the vocabulary with these
        check_token_ids(ids, state.vocab_size, param)


def bad_words_ids(state: ServerState, words: list[str]) -> list[list[int]]:
    """Each bad word as the token sequences it can appear as: on its own and after a
    space (as vLLM bans them), each sequence once."""
    seqs: list[list[int]] = []
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = state.tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in seqs:
                seqs.append(ids)
    return seqs


def sampling_params(state: ServerState, body: _SamplingFields, max_tokens: int,
                    logprobs: int | None, structured: Any = None, prompt_logprobs: int | None = None) -> SamplingParams:
    _token_ids(state, body.stop_token_ids or [], "stop_token_ids")
    _token_ids(state, body.logit_bias or {}, "logit_bias")
    _token_ids(state, body.allowed_token_ids or [], "allowed_token_ids")

    defaults = state.settings.sampling_defaults  # --generation-config; a request's own values win

    def pick(value: Any, default: Any, name: str = "") -> Any:
        return defaults.get(name, default) if value is None else value

    try:
        return SamplingParams(
            n=body.n, temperature=pick(body.temperature, 1.0, "temperature"), top_p=pick(body.top_p, 1.0, "top_p"),
            top_k=pick(body.top_k, -1, "top_k"), min_p=pick(body.min_p, 0.0, "min_p"),
            repetition_penalty=pick(body.repetition_penalty, 1.0, "repetition_penalty"),
            presence_penalty=pick(body.presence_penalty, 0.0), frequency_penalty=pick(body.frequency_penalty, 0.0),
            seed=_seed(body.seed), max_tokens=max_tokens, min_tokens=min(body.min_tokens, max_tokens),
            stop=body.stop_list or None, stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output, speculative=body.speculative,
            structured=structured,
            logit_bias={int(k): float(v) for k, v in body.logit_bias.items()} if body.logit_bias else None,
            allowed_token_ids=body.allowed_token_ids,
            bad_words_token_ids=bad_words_ids(state, body.bad_words) if body.bad_words else None)
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc)) from None


async def encode(state: ServerState, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) > _LONG_TEXT:
        return await asyncio.to_thread(state.tokenizer.encode, text, add_special_tokens)
    return state.tokenizer.encode(text, add_special_tokens=add_special_tokens)


@dataclass
class ChatRender:
    """How a conversation becomes a prompt, beyond its messages."""

    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    continue_final_message: bool = False
    variables: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs, documents, reasoning_effort


_RESERVED_VARIABLES = ("messages", "add_generation_prompt", "tools")
_FINAL = "\x00tokenmill-final-message\x00"  # stands for the continued message while rendering


async def render_chat_async(state: ServerState, messages: list[Any], how: ChatRender | None = None) -> str:
    """``render_chat``, in a worker thread when the conversation is long (Jinja over megabytes takes a while)."""
    if sum(len(m.text()) for m in messages) > _LONG_TEXT:
        return await asyncio.to_thread(render_chat, state, messages, how)
    return render_chat(state, messages, how)


def _uses_tools(conv: list[dict[str, Any]], tools: Any) -> bool:
    return bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in conv)


def render_chat(state: ServerState, messages: list[Any], how: ChatRender | None = None) -> str:
    """The prompt of a conversation. Tool conversations use the server's tools template
    when the model's own cannot render them (chat_templates.py). With
    ``continue_final_message`` the last message is rendered as a placeholder and the
    prompt cut there, then its text appended, so the model continues it (an empty one too)."""
    how = how or ChatRender()
    conv = [template_message(m) for m in messages]
    bad = next((k for k in how.variables if k in _RESERVED_VARIABLES), None)
    if bad is not None:
        raise APIError(400, f"chat_template_kwargs: {bad!r} is set by the request itself, not a template variable",
                       param="chat_template_kwargs")
    extra: dict[str, Any] = dict(how.variables)
    if how.tools:
        extra["tools"] = how.tools
    template = state.tools_template.source if state.tools_template and _uses_tools(conv, how.tools) else None
    final = ""
    if how.continue_final_message:
        final = conv[-1].get("content") or ""
        conv[-1] = {**conv[-1], "content": _FINAL}
    try:
        prompt = state.tokenizer.apply_chat_template(conv, add_generation_prompt=how.add_generation_prompt,
                                                     template=template, **extra)
    except Exception as exc:  # noqa: BLE001 - a template's raise_exception or a render error
        raise APIError(400, f"messages: the chat template rejected the conversation: {exc}",
                       param="messages") from None
    if how.continue_final_message:
        at = prompt.rfind(_FINAL)
        if at < 0:
            raise APIError(400, "continue_final_message: this chat template does not write the final message's "
                           "content, so it cannot be continued", param="continue_final_message")
        prompt = prompt[:at] + final
    return prompt


def chat_render(body: ChatCompletionRequest, tools: list[dict[str, Any]] | None) -> ChatRender:
    variables = dict(body.chat_template_kwargs or {})
    if body.documents is not None:
        variables.setdefault("documents", body.documents)
    if body.reasoning_effort is not None:
        variables.setdefault("reasoning_effort", body.reasoning_effort)
    return ChatRender(body.add_generation_prompt, tools, body.continue_final_message, variables)


def template_ignores(state: ServerState, name: str) -> bool:
    """Whether the chat template never reads the variable ``name`` (a field passed only to it does nothing)."""
    sources = [state.tokenizer.chat_template] + ([state.tools_template.source] if state.tools_template else [])
    word = re.compile(rf"\b{re.escape(name)}\b")
    return not any(word.search(source) for source in sources)


def template_ignored(state: ServerState, body: ChatCompletionRequest) -> list[str]:
    """Template variables the request sets that the chat template never reads (reported, not refused:
    the request is valid, this model's template just has no use for them)."""
    names = [f"chat_template_kwargs.{k}" for k in body.chat_template_kwargs or {} if template_ignores(state, k)]
    if body.reasoning_effort is not None and template_ignores(state, "reasoning_effort"):
        names.append("reasoning_effort")
    if body.documents is not None and template_ignores(state, "documents"):
        names.append("documents")
    return names


def _include_usage(body: _SamplingFields) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


async def _until_done_or_gone(request: Request, work: Awaitable[dict[str, Any]],
                              headers: dict[str, str] | None = None) -> Response:
    """Run a non-streaming request, aborting it if the client hangs up first."""

    async def gone() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()  # closes the job streams, which aborts the engine requests
        watcher.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=499)
    return JSONResponse(task.result(), headers=headers)


def _with_headers(response: Response, headers: dict[str, str]) -> Response:
    response.headers.update(headers)
    return response


def _continuous_usage(body: _SamplingFields) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.continuous_usage_stats)


def truncate_prompt(ids: list[int], keep: int | None) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: only the prompt's last ``keep`` tokens are used."""
    return ids[-keep:] if keep is not None and len(ids) > keep else ids


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@router.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    arrived = time.monotonic()  # the starvation bound counts from here (tokenizing included)
    state = await get_state(request).serving_for(body.model, request.scope)
    headers = ignored_headers(judge_extra(body.model_extra, "completions"))
    request_id = _new_id("cmpl")
    grammar, grammar_param = grammar_spec(body)
    prompts = body.prompts()
    tenant = tenant_of(request.scope)
    # before any tokenizing or compiling: a request its tenant may not send costs nothing
    state.admission.check(tenant, len(prompts) * body.n, len(prompts), body.priority)
    if grammar is not None:
        await check_grammar(state, grammar, grammar_param or "response_format", tenant)
    jobs: list[Job] = []
    echo_texts: list[str] = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            state.admission.check_text_fits(len(prompt), "prompt")
            ids = await encode(state, prompt, True)
            text: str | None = prompt
        else:
            ids = list(prompt)
            text = None
        if body.truncate_prompt_tokens is not None and len(ids) > body.truncate_prompt_tokens:
            ids, text = truncate_prompt(ids, body.truncate_prompt_tokens), None
        state.admission.check_prompt_ids(ids)
        requested = body.max_tokens if "max_tokens" in body.model_fields_set else None
        max_tokens = state.admission.resolve_max_tokens(len(ids), requested, default=16)
        scored = body.prompt_logprobs_needed
        if max_tokens == 0 and scored is None:  # plain echo of the prompt: the engine still runs it
            scored = 0
        params = sampling_params(state, body, max_tokens, body.logprobs, grammar, scored)
        jobs.append(Job(f"{request_id}-{i}", ids, params, "completions", prompt_text=text, priority=body.priority,
                        arrival=arrived,
                        model=body.model))
        if body.echo:
            echo_texts.append(text if text is not None else state.tokenizer.decode(ids, skip_special_tokens=False))
    for job in jobs:
        job.session = session_of(request.headers, body.user)
    state.admission.reserve(jobs, tenant)
    spec = CompletionSpec(request_id, body.model or state.model_name, body.n, body.logprobs,
                          echo_texts if body.echo else None, _include_usage(body),
                          prompt_logprobs=body.prompt_logprobs, continuous_usage=_continuous_usage(body),
                          prompt_ids=[job.prompt_ids for job in jobs])
    assembler = Assembler([len(job.prompt_ids) for job in jobs], body.n, running_usage=spec.continuous_usage)
    if body.stream:
        stream = stream_events(state, jobs, assembler, CompletionStream(spec, state))
        return _with_headers(SSEResponse(stream, state, jobs), headers)
    try:
        whole = fold_events(state, jobs, assembler, CompletionFold(spec, len(jobs), state))
        return await _until_done_or_gone(request, whole, headers)
    finally:
        for job in jobs:
            state.admission.release(job)


async def prepare_chat(state: ServerState, body: ChatCompletionRequest, request_id: str,
                       tenant: Tenant | None = None) -> tuple[Job, ToolPlan | None]:
    """Tools, grammar, prompt and sampling parameters of a chat request (also the
    Responses API's, translated to chat): everything checked before the engine sees it.
    ``tenant`` (the caller's) is asked about first, before any grammar is compiled."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    plan = plan_tools(tools, body.tool_choice, body.parallel_tool_calls, state.settings, state.tool_parser_hint)
    grammar, grammar_param = grammar_spec(body)
    state.admission.check(tenant, body.n, 1, body.priority)
    if plan is not None:
        for schema, param in tool_schemas(plan):
            await check_grammar(state, schema, param, tenant)
        if plan.constrained:
            if grammar is not None:
                raise APIError(400, f"{grammar_param}: cannot be combined with tool_choice {plan.mode!r}",
                               param=grammar_param)
            grammar, grammar_param = plan.grammar(), "tools"
    if grammar is not None:
        await check_grammar(state, grammar, grammar_param or "response_format", tenant)
    state.admission.check_text_fits(sum(len(m.text()) for m in body.messages), "messages")
    prompt = await render_chat_async(state, body.messages, chat_render(body, tools))
    ids = truncate_prompt(await encode(state, prompt, body.add_special_tokens), body.truncate_prompt_tokens)
    state.admission.check_prompt_ids(ids)
    max_tokens = state.admission.resolve_max_tokens(len(ids), body.output_limit, default=None)
    top = body.top_logprobs or 0
    params = sampling_params(state, body, max_tokens, top if body.logprobs else None, grammar, body.prompt_logprobs)
    params.structured_after = reasoning_for_grammar(state.settings, params, prompt)
    return Job(f"{request_id}-0", ids, params, "chat", prompt_text=prompt, priority=body.priority,
               model=body.model), plan


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    arrived = time.monotonic()  # the starvation bound counts from here (templating included)
    state = await get_state(request).serving_for(body.model, request.scope)
    headers = ignored_headers(judge_extra(body.model_extra, "chat.completions") + template_ignored(state, body))
    request_id = _new_id("chatcmpl")
    tenant = tenant_of(request.scope)
    job, plan = await prepare_chat(state, body, request_id, tenant)
    job.arrival = arrived
    job.session = session_of(request.headers, body.user)
    state.admission.reserve([job], tenant)
    spec = ChatSpec(request_id, body.model or state.model_name, body.n, body.logprobs, body.top_logprobs or 0,
                    _include_usage(body), tools=plan,
                    prompt_logprobs=body.prompt_logprobs, continuous_usage=_continuous_usage(body),
                    legacy_functions=body.functions is not None,
                    reasoning=get_reasoning_parser(state.settings.reasoning_parser))
    assembler = Assembler([len(job.prompt_ids)], body.n, plan, spec.reasoning, job.prompt_text,
                          running_usage=spec.continuous_usage)
    if body.stream:
        return _with_headers(SSEResponse(stream_events(state, [job], assembler, ChatStream(spec, state)), state,
                                         [job]), headers)
    try:
        return await _until_done_or_gone(request, fold_events(state, [job], assembler, ChatFold(spec, state)),
                                         headers)
    finally:
        state.admission.release(job)

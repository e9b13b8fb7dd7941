"""OpenAI wire format: request and response models for the HTTP boundary.

Why pydantic here and nowhere else: this is where untrusted JSON becomes
typed values. Every bound a client could abuse (negative counts, absurd
sizes, out-of-range probabilities) is declared in the model, so it shows up
in the OpenAPI schema (the fuzz test generates bodies from it) and fails as a
400 before anything reaches the engine. A request body keeps the fields it does
not declare (``model_extra``): request_fields.py refuses the ones of OpenAI's
or vLLM's APIs this server cannot honour and reports the rest as ignored.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_N = 16  # completions per request
MAX_LOGPROBS = 20
MAX_PROMPTS = 64  # prompts in one /v1/completions batch
MAX_STOP = 16  # stop strings per request
MAX_STOP_LEN = 256  # characters per stop string
MAX_TOKEN_RULES = 1 << 16  # logit_bias entries / allowed_token_ids per request
MAX_BAD_WORDS = 256
MAX_TOKENS_LIMIT = 1 << 20  # beyond any context length; the real bound is checked per model
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1

TokenIds = list[int]


def _has_surrogate(value: Any, depth: int = 0) -> bool:
    """True if any string inside ``value`` holds a lone UTF-16 surrogate.

    JSON escapes like ``"\\ud800"`` decode to such strings; they cannot be
    encoded as UTF-8, so the tokenizer and the response writer would fail."""
    if isinstance(value, str):
        return any("\ud800" <= ch <= "\udfff" for ch in value) if not value.isascii() else False
    if depth > 8:
        return False
    if isinstance(value, dict):
        return any(_has_surrogate(k, depth + 1) or _has_surrogate(v, depth + 1) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_surrogate(v, depth + 1) for v in value)
    return False


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        if _has_surrogate(data):
            raise ValueError("body: a string holds invalid Unicode (a lone surrogate escape)")
        return data


class _RequestBody(_Model):
    """A whole request body: undeclared fields are kept for request_fields.py to judge."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(_Model):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingFields(_RequestBody):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=1 << 20)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS_LIMIT)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    speculative: bool = True  # False: this request never decodes speculatively
    # structured outputs (entrypoints/openai/structured_fields.py reads and checks these)
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, max_length=4096)
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's extra field: logprobs of the prompt's own tokens, this many alternatives each.
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # token rules (model/sampler.py): ids are checked against the vocabulary per model
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_TOKEN_RULES)
    allowed_token_ids: list[int] | None = Field(None, min_length=1, max_length=MAX_TOKEN_RULES)
    bad_words: list[str] | None = Field(None, max_length=MAX_BAD_WORDS)
    truncate_prompt_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)  # keep the prompt's last k
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    @model_validator(mode="after")
    def _check_token_rules(self) -> "_SamplingFields":
        for key, value in (self.logit_bias or {}).items():
            try:
                int(key)
            except ValueError:
                raise ValueError(f"logit_bias: key {key!r} is not a token id (an integer)") from None
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias: the bias of token {key} is {value}, outside [-100, 100]")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of: {self.best_of} with n={self.n} is not supported (generating extra "
                             "completions to keep the likeliest needs beam-like ranking this server does not "
                             "do, as vLLM's current engine does not); send n and rank the choices with logprobs")
        if any(not w for w in self.bad_words or []):
            raise ValueError("bad_words: words must not be empty")
        return self

    # vLLM's extra field: order within the caller's tenant and class under the priority and
    # fair scheduling policies (lower first); FCFS ignores it.
    priority: int = Field(0, ge=-(1 << 31), le=(1 << 31) - 1)

    @model_validator(mode="after")
    def _check_stop(self) -> "_SamplingFields":
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"stop: at most {MAX_STOP} stop strings are allowed, got {len(stops)}")
        if any(len(s) > MAX_STOP_LEN for s in stops):
            raise ValueError(f"stop: each stop string must be at most {MAX_STOP_LEN} characters")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: not available when streaming (use echo with logprobs on "
                             "/v1/completions, or stream false)")
        return self

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds] = Field(
        ..., description="a string, a list of strings, a list of token ids, or a list of token-id lists")
    max_tokens: int | None = Field(16, ge=0, le=MAX_TOKENS_LIMIT)  # 0: score the prompt (echo)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_prompt(self) -> "CompletionRequest":
        if self.suffix:
            raise ValueError("suffix: not supported by this server (no fill-in-the-middle); "
                             "send the text before the insertion point as the prompt")
        if isinstance(self.prompt, list):
            if not self.prompt:
                raise ValueError("prompt: must not be empty")
            if len(self.prompt) > MAX_PROMPTS and not isinstance(self.prompt[0], int):
                raise ValueError(f"prompt: at most {MAX_PROMPTS} prompts per request")
        if self.max_tokens == 0 and not self.echo and self.prompt_logprobs is None:
            raise ValueError("max_tokens: must be at least 1 (0 only with echo or prompt_logprobs, "
                             "to score the prompt without generating)")
        return self

    @property
    def prompt_logprobs_needed(self) -> int | None:
        """Alternatives the engine must keep per prompt token: for the legacy echo
        shape (``echo`` with ``logprobs``) and for vLLM's ``prompt_logprobs``."""
        wanted = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return max(wanted) if wanted else None

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of single prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Model):
    type: Literal["text"]
    text: str


_MEDIA_PARTS = {"image_url": "images", "input_image": "images", "image": "images", "input_audio": "audio",
                "audio_url": "audio", "video_url": "video", "file": "files", "input_file": "files"}


def _content_parts(content: Any) -> Any:
    """Text parts pass; a media part is a clear refusal (this server runs text models)."""
    if not isinstance(content, list):
        return content
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            continue  # the part's own validation says what is wrong
        if kind in _MEDIA_PARTS:
            raise ValueError(f"messages: content part {i} is of type {kind!r}, but this model does not accept "
                             f"{_MEDIA_PARTS[kind]} (it reads text only); send text parts")
        if kind != "text":
            raise ValueError(f"messages: content part {i} has type {kind!r}; this server accepts 'text' parts")
    return content


class ToolCallFunction(_Model):
    name: str
    arguments: str | dict[str, Any] = "{}"


class AssistantToolCall(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = Field(None, max_length=256)
    tool_call_id: str | None = None
    function_call: ToolCallFunction | None = None  # the legacy functions API's assistant call

    @model_validator(mode="before")
    @classmethod
    def _media(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _content_parts(data.get("content"))
        return data

    @model_validator(mode="after")
    def _legacy(self) -> "ChatMessage":
        """Legacy function calling as tool calling: an assistant ``function_call`` is a tool
        call whose id is its name, a ``function`` message the tool result answering it."""
        if self.function_call is not None and not self.tool_calls:
            self.tool_calls = [AssistantToolCall(id=self.function_call.name, function=self.function_call)]
        if self.role == "function":
            self.role = "tool"
            self.tool_call_id = self.tool_call_id or self.name
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(_Model):
    name: str = Field(..., pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Model):
    type: Literal["function"]
    function: FunctionDefinition


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=4096)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is left open and continued
    add_special_tokens: bool = False  # BOS etc. on top of what the template writes
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template
    documents: list[dict[str, Any]] | None = Field(None, max_length=256)  # RAG templates' ``documents``
    reasoning_effort: ReasoningEffort | None = None  # passed to templates that read it
    tools: list[ChatTool] | None = Field(None, max_length=512)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # the legacy function-calling API: mapped to tools / tool_choice, answered in its own shape
    functions: list[FunctionDefinition] | None = Field(None, max_length=512)
    function_call: Literal["none", "auto"] | dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        if self.continue_final_message:
            if self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
                raise ValueError("continue_final_message: cannot be combined with add_generation_prompt true "
                                 "(one continues the last message, the other opens a new one)")
            self.add_generation_prompt = False
            if self.messages[-1].role != "assistant":
                raise ValueError("continue_final_message: the last message must be the assistant's, to continue")
        if self.functions is not None or self.function_call is not None:
            if self.tools is not None or self.tool_choice is not None:
                raise ValueError("functions: give either the legacy functions/function_call or tools/tool_choice")
            if self.functions:
                self.tools = [ChatTool(type="function", function=f) for f in self.functions]
            choice = self.function_call
            if isinstance(choice, dict):
                choice = {"type": "function", "function": {"name": choice.get("name")}}
            self.tool_choice = choice
        called = False
        for m in self.messages:
            if m.role == "assistant" and m.tool_calls:
                called = True
            if m.role == "tool" and not called:
                raise ValueError("messages: a 'tool' message must answer a preceding assistant message "
                                 "with tool_calls")
        return self

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=4096)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = Field(None, max_length=512)  # rendered as a chat request's would be
    return_token_strs: bool = False  # each token's vocabulary spelling beside its id

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_RequestBody):
    model: str | None = None
    tokens: list[int] = Field(..., max_length=1 << 20)


# ---- responses -------------------------------------------------------------

class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One token of vLLM's ``prompt_logprobs`` (keyed by token id)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning_content: str | None = None  # with --reasoning-parser: the thinking before the answer


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None


class ModelCard(BaseModel):
    # extra fields pass through: a server of several models adds llama.cpp's ``status``
    # ({"value": "loaded" | "loading" | "unloading" | "unloaded"}, model_set.py)
    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tokenmill"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str

"""Every request field is honoured, refused, or reported as ignored: never a silent 200.

Declared fields (protocol.py) are honoured. What a body carries beyond them
(pydantic's ``model_extra``) is judged here:

- a field of OpenAI's or vLLM's APIs that this server cannot honour is a 400
  naming it and saying why, unless it holds its no-op value (``audio: null``,
  ``use_beam_search: false``), which clients send by default;
- a field that cannot change the output (``user``-like labels) is accepted;
- a misspelled constraint (``guided_choices``) is a 400: unconstrained text
  where a constraint was asked for is the worst kind of silent success;
- any other name is outside both APIs: logged once per name, as vLLM warns,
  and listed in the response's ``x-tokenmill-ignored-fields`` header.

docs/serving.md has the same table for readers.
"""
from __future__ import annotations

import json
import logging
import re
from typing import Any, Callable

from ..server.errors import APIError

log = logging.getLogger("tokenmill.server")

IGNORED_HEADER = "x-tokenmill-ignored-fields"


def _unset(value: Any) -> bool:
    return value is None or value is False or value == {} or value == []


def _is(*allowed: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or value in allowed


# name -> (holds a no-op value?, why the server refuses anything else)
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "audio": (_unset, "this model writes text only; there is no audio output"),
    "modalities": (lambda v: v is None or v == ["text"], "this model writes text only"),
    "prediction": (_unset, "predicted outputs are not implemented (speculative decoding is the server's "
                   "--speculative-* flags)"),
    "web_search_options": (_unset, "this server has no web search"),
    "verbosity": (_unset, "output length is set with max_tokens; this model has no verbosity control"),
    "service_tier": (_is("auto", "default"), "this server has one service tier"),
    "store": (_unset, "chat completions are not stored (the Responses API keeps responses)"),
    "use_beam_search": (_unset, "beam search is not implemented"),
    "length_penalty": (_is(1, 1.0), "length_penalty only applies to beam search, which is not implemented"),
    "early_stopping": (_unset, "early_stopping only applies to beam search, which is not implemented"),
    "logits_processors": (_unset, "custom logits processors cannot be loaded into this server; use "
                          "logit_bias, allowed_token_ids or bad_words"),
    "prompt_embeds": (_unset, "prompt embeddings are not accepted; send text or token ids"),
    "mm_processor_kwargs": (_unset, "this model does not accept images or other media"),
    "media_io_kwargs": (_unset, "this model does not accept images or other media"),
    "chat_template": (_unset, "a per-request chat template is not accepted; start the server with "
                      "--chat-template"),
    "cache_salt": (_unset, "the prefix cache is shared by all requests of this server (no per-tenant salt)"),
    "kv_transfer_params": (_unset, "this server does no disaggregated prefill"),
    "vllm_xargs": (_unset, "there are no extra engine arguments to pass"),
    "return_tokens_as_token_ids": (_unset, "logprob tokens are returned as text"),
    "return_token_ids": (_unset, "token ids are not returned beside the text; use /tokenize"),
    "spaces_between_special_tokens": (_is(True), "special tokens are always decoded with their spacing"),
    "guided_decoding_backend": (_is("auto", "guidance", "llguidance"), "structured outputs run on llguidance"),
    "guided_whitespace_pattern": (_unset, "JSON output uses a fixed whitespace layout"),
    "structural_tag": (_unset, "structural tags are not implemented; use structured_outputs or tools"),
    "request_id": (_unset, "response ids are made by the server; send X-Request-Id, which is echoed and "
                   "logged"),
    "echo": (_unset, "echo is a /v1/completions field; continue_final_message continues a chat message"),
}

# Fields of the Responses API only.
RESPONSES_REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "background": (_unset, "responses run in the foreground"),
    "conversation": (_unset, "this server keeps no conversations; send the history"),
    "prompt": (_unset, "stored prompt templates are not implemented; send input"),
    "include": (_unset, "no extra output (encrypted reasoning, logprobs, sources) can be included"),
    "max_tool_calls": (_unset, "the number of tool calls is not limited by this server"),
    "top_logprobs": (_is(0), "this endpoint returns no logprobs"),
    "truncation": (_is("disabled"), "inputs are never truncated; a prompt too long is a 400"),
    "service_tier": REFUSED["service_tier"],
}

# Fields that cannot change the output: accepted as they are.
INFORMATIONAL = frozenset({"user", "metadata", "prompt_cache_key", "safety_identifier"})

_logged: set[str] = set()
_MAX_LOGGED = 1024  # names remembered for log-once (clients choose the names: keep the set bounded)
_MAX_LISTED = 32  # names in the header
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def judge_extra(extra: dict[str, Any] | None, endpoint: str) -> list[str]:
    """400 for a refused field; the names this endpoint ignores (logged once per name)."""
    ignored: list[str] = []
    for name, value in (extra or {}).items():
        if name in INFORMATIONAL:
            continue
        rule = (RESPONSES_REFUSED if endpoint == "responses" else REFUSED).get(name)
        if rule is not None:
            harmless, why = rule
            if harmless(value):
                continue
            raise APIError(400, f"{name}: not supported by this server: {why}", param=name,
                           code="unsupported_parameter")
        if name.startswith("guided_") or name == "structured_output":
            raise APIError(400, f"{name}: unknown constraint field (known: guided_json, guided_regex, "
                           "guided_choice, guided_grammar, structured_outputs, response_format)", param=name,
                           code="unknown_parameter")
        if name not in _logged and len(_logged) < _MAX_LOGGED:
            _logged.add(name)
            log.warning("%s: ignoring request field %r, which is in neither OpenAI's nor vLLM's API "
                        "(reported in the %s header)", endpoint, name, IGNORED_HEADER)
        ignored.append(name)
    return ignored


def ignored_headers(ignored: list[str]) -> dict[str, str]:
    """The header listing ignored names (odd names JSON-quoted in ASCII, at most ``_MAX_LISTED``)."""
    if not ignored:
        return {}
    shown = [n if _SAFE_NAME.fullmatch(n) else json.dumps(n[:64]) for n in ignored[:_MAX_LISTED]]
    if len(ignored) > _MAX_LISTED:
        shown.append(f"... ({len(ignored) - _MAX_LISTED} more)")
    return {IGNORED_HEADER: ", ".join(shown)}

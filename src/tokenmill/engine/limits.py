"""What a request may ask of this engine: the one home of the context-length, output
budget and token-id range checks.

The server checks a request here before it reaches the engine thread, so a
client gets a 400 naming the field and the numbers (``entrypoints/server/admission.py``
turns a ``LimitError`` into its OpenAI-style error); in-process callers
(``LLM(...)``, evaluation, benchmarks) get the same ``LimitError`` (a
``ValueError``) from ``LLMEngine.add_request``, which runs the same checks.
Nothing else restates them: the scheduler only refuses what its pool can never
hold.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence


class LimitError(ValueError):
    """A request outside the limits: ``param`` is the request field at fault, ``code`` the
    OpenAI error code (``context_length_exceeded``) where there is one."""

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class RequestLimits:
    max_model_len: int
    vocab_size: int
    # Tokens the KV pool holds in all (None: not checked here; the scheduler refuses a
    # request its pool can never hold).
    pool_tokens: int | None = None

    def check_text_fits(self, chars: int, max_token_chars: int, param: str) -> None:
        """Refuse text too long to fit the context whatever it tokenizes to, before tokenizing
        it. No token covers more than ``max_token_chars`` characters, so text of more than
        that many characters per context token cannot fit; twice that leaves room for
        normalizers that shorten text."""
        if max_token_chars and chars > 2 * max_token_chars * self.max_model_len:
            raise LimitError(f"{param}: the text has {chars} characters, more than any text that fits this model's "
                             f"context length of {self.max_model_len} tokens; shorten the prompt", param,
                             "context_length_exceeded")

    def check_prompt_ids(self, ids: Sequence[int]) -> None:
        if not ids:
            raise LimitError("prompt: the prompt is empty", "prompt")
        check_token_ids(ids, self.vocab_size, "prompt")

    def check_stop_ids(self, ids: Sequence[int] | None) -> None:
        check_stop_ids(ids, self.vocab_size)

    def resolve_max_tokens(self, prompt_len: int, requested: int | None, default: int | None = None,
                           cap: int | None = None, prompt_param: str = "prompt") -> int:
        """The output budget of a request, or a ``LimitError`` that states both numbers.

        ``requested``: what the caller asked for (None: not given; 0: score the prompt
        only); ``default``: the budget when not given (None: the rest of the context);
        ``cap``: an upper bound on both (the server's ``--max-output-tokens``)."""
        pool = self.pool_tokens if self.pool_tokens is not None else self.max_model_len
        limit = min(self.max_model_len, pool)
        if requested == 0:  # scoring the prompt: no room for output needed
            if prompt_len > limit:
                raise LimitError(f"the prompt has {prompt_len} tokens, more than the {limit} this engine can score "
                                 "at once; shorten the prompt", prompt_param, "context_length_exceeded")
            return 0
        room = limit - prompt_len
        if room < 1:
            where = (f"this model's context length is {self.max_model_len} tokens"
                     if prompt_len >= self.max_model_len else f"the KV cache holds only {pool} tokens")
            raise LimitError(f"the prompt has {prompt_len} tokens but {where}, with room for at least one output "
                             "token needed; shorten the prompt", prompt_param, "context_length_exceeded")
        if requested is not None:
            max_tokens = min(requested, cap) if cap else requested
            if prompt_len + max_tokens > self.max_model_len:
                raise LimitError(f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) is "
                                 f"{prompt_len + max_tokens} tokens, which exceeds the context length "
                                 f"{self.max_model_len}", "max_tokens", "context_length_exceeded")
            if prompt_len + max_tokens > pool:
                raise LimitError(f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) is "
                                 f"{prompt_len + max_tokens} tokens, more than the KV cache holds ({pool} tokens)",
                                 "max_tokens", "context_length_exceeded")
            return max_tokens
        return max(1, min(cap or default or room, room))


def check_stop_ids(ids: Sequence[int] | None, vocab_size: int) -> None:
    """Stop token ids index the vocabulary in the sampler."""
    check_token_ids(ids or [], vocab_size, "stop_token_ids")


def check_token_ids(ids: Iterable[Any], vocab_size: int, param: str) -> None:
    """Token ids a request names (stop ids, logit bias keys, allowed ids) inside the vocabulary."""
    bad = next((t for t in ids if not 0 <= int(t) < vocab_size), None)
    if bad is not None:
        raise LimitError(f"{param}: token id {bad} is out of range [0, {vocab_size})", param)

"""Output events (parsers/output_events.py) -> ``/v1/completions``: chunks or one body.

A request of several prompts is one stream: choice ``index`` is prompt x ``n`` +
choice. ``echo`` puts the prompt before a choice's first text (and, with
``logprobs``, the prompt's logprobs before the choice's own); each choice ends with
a chunk carrying ``finish_reason``; ``include_usage`` adds a last chunk with empty
``choices``; then ``data: [DONE]``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ...model.sampler import Logprob
from ..parsers.output_events import Event, Finish, Logprobs, TextDelta, Usage
from .chat_encoder import top_sorted
from .prompt_logprobs import echo_logprobs, join, vllm_prompt_logprobs
from .streaming import DONE, error_event, sse


@dataclass
class CompletionSpec:
    request_id: str
    model: str
    n: int
    logprobs: int | None
    echo_texts: list[str] | None  # per job, when echo is on
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_logprobs: int | None = None  # vLLM's field: alternatives per prompt token
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage so far in every chunk
    prompt_ids: list[list[int]] = field(default_factory=list)  # per job: the echoed prompts' logprobs name them

    @property
    def echo_logprobs(self) -> bool:
        """Legacy echo with logprobs: the prompt's logprobs lead the choice's ``logprobs``."""
        return self.echo_texts is not None and self.logprobs is not None

    def prefix(self, index: int) -> str:
        return self.echo_texts[index // self.n] if self.echo_texts else ""


def completion_logprobs(state: Any, lps: list[Logprob], offset: int) -> dict[str, Any]:
    tokens, values, tops, offsets = [], [], [], []
    for lp in lps:
        text = state.token_text(lp.token_id)
        tokens.append(text)
        values.append(lp.logprob)
        tops.append({state.token_text(t): v for t, v in top_sorted(lp)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


class CompletionStream:
    """The completions encoder, streamed. ``state``: token texts for logprobs."""

    def __init__(self, spec: CompletionSpec, state: Any = None) -> None:
        self.spec = spec
        self.state = state
        self.base: dict[str, Any] = {"id": spec.request_id, "object": "text_completion", "created": spec.created,
                                     "model": spec.model}
        if spec.include_usage:
            self.base["usage"] = None
        self.usage: Usage | None = None
        self.offsets: dict[int, int] = {}  # per choice: where its next text starts (echo included)

    def _chunk(self, index: int, text: str, logprobs: Any, finish: str | None, stop: Any = None) -> bytes:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop}
        if self.spec.continuous_usage and self.usage is not None:
            return sse({**self.base, "choices": [choice], "usage": self.usage.openai()})
        return sse({**self.base, "choices": [choice]})

    def opening(self, usage: Usage) -> list[bytes]:
        self.usage = usage
        return []

    def encode(self, events: list[Event]) -> list[bytes]:
        out: list[bytes] = []
        index, text, lps, finish = None, "", None, None
        for e in events:
            if isinstance(e, Usage):
                self.usage = e
                if e.final and self.spec.include_usage:
                    out.append(sse({**self.base, "choices": [], "usage": e.openai()}))
                continue
            index = e.index
            if isinstance(e, TextDelta):
                text += e.text
            elif isinstance(e, Logprobs):
                lps = e
            elif isinstance(e, Finish):
                finish = e
        if index is not None:
            out[:0] = self._delta(index, text, lps, finish)
        return out

    def _delta(self, index: int, text: str, lps: Logprobs | None, finish: Finish | None) -> list[bytes]:
        spec, out = self.spec, []
        generated = len(text)
        if index not in self.offsets:
            prefix = spec.prefix(index)
            text = prefix + text
            self.offsets[index] = len(prefix)
        lp = None
        if spec.logprobs is not None and lps is not None and lps.logprobs:
            lp = completion_logprobs(self.state, lps.logprobs, self.offsets[index])
        if spec.echo_logprobs and lps is not None and lps.prompt_logprobs is not None:
            lp = join(echo_logprobs(self.state, spec.prompt_ids[lps.job], lps.prompt_logprobs, spec.logprobs or 0),
                      lp)
        self.offsets[index] += generated
        if text or lp:
            out.append(self._chunk(index, text, lp, None))
        if finish is not None:
            out.append(self._chunk(index, "", None, finish.reason, finish.stop_reason))
        return out

    def error(self, exc: BaseException) -> bytes:
        return error_event(exc)

    def done(self) -> list[bytes]:
        return [DONE]


class CompletionFold:
    """The completions encoder, whole."""

    def __init__(self, spec: CompletionSpec, jobs: int, state: Any = None) -> None:
        self.spec = spec
        self.state = state
        total = jobs * spec.n
        self.texts: list[list[str]] = [[] for _ in range(total)]
        self.lps: list[list[Logprob]] = [[] for _ in range(total)]
        self.prompt_lps: list[list[Logprob | None] | None] = [None] * total
        self.finish: list[Finish | None] = [None] * total
        self.usage: Usage | None = None

    def add(self, events: list[Event]) -> None:
        for e in events:
            if isinstance(e, Usage):
                self.usage = e
            elif isinstance(e, TextDelta):
                self.texts[e.index].append(e.text)
            elif isinstance(e, Logprobs):
                self.lps[e.index].extend(e.logprobs)
                if e.prompt_logprobs is not None:
                    self.prompt_lps[e.index] = e.prompt_logprobs
            elif isinstance(e, Finish):
                self.finish[e.index] = e

    def body(self) -> dict[str, Any]:
        spec, state = self.spec, self.state
        choices = []
        echoed: dict[int, Any] = {}  # per prompt, converted once: its n choices share one list
        scored: dict[int, Any] = {}
        for idx, finish in enumerate(self.finish):
            job_i = idx // spec.n
            prefix = spec.prefix(idx)
            lp = completion_logprobs(state, self.lps[idx], len(prefix)) if spec.logprobs is not None else None
            if spec.echo_logprobs:
                if job_i not in echoed:
                    echoed[job_i] = echo_logprobs(state, spec.prompt_ids[job_i], self.prompt_lps[idx],
                                                  spec.logprobs or 0)
                lp = join(echoed[job_i], lp)
            choice = {"index": idx, "text": prefix + "".join(self.texts[idx]), "logprobs": lp,
                      "finish_reason": finish.reason if finish else None,
                      "stop_reason": finish.stop_reason if finish else None}
            if spec.prompt_logprobs is not None:
                if job_i not in scored:
                    scored[job_i] = vllm_prompt_logprobs(state, self.prompt_lps[idx], spec.prompt_logprobs)
                choice["prompt_logprobs"] = scored[job_i]
            choices.append(choice)
        assert self.usage is not None
        return {"id": spec.request_id, "object": "text_completion", "created": spec.created, "model": spec.model,
                "choices": choices, "usage": self.usage.openai()}

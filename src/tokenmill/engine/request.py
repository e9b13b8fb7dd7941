"""Plain state of one request as it moves through the engine.

``SamplingParams`` is what the user asks for; ``Request`` is what the engine
tracks (tokens, cache blocks, progress); ``RequestOutput`` is what goes back.
"""
from __future__ import annotations

import enum
import functools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..model.sampler import Logprob


@dataclass
class SamplingParams:
    """Per-request generation settings. ``temperature=0`` means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives; 0 = only the chosen token
    # Log-probabilities of the prompt's own tokens, with this many top alternatives
    # (0 = only the actual token). With ``max_tokens=0`` the prompt is scored and
    # nothing is generated.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    speculative: bool = True  # False: never decode this request speculatively
    # Constrain the output to a grammar (engine/grammar/structured.py): a GrammarSpec.
    structured: Any = None
    # Text that ends the model's reasoning (e.g. "</think>"): the grammar applies only to
    # the output after it, so a thinking model reasons freely and answers in the format.
    structured_after: str | None = None
    # Token rules applied to the logits before sampling (model/sampler.py):
    # token id -> value added to its logit (OpenAI's ``logit_bias``, in [-100, 100]);
    logit_bias: dict[int, float] | None = None
    # only these tokens may be sampled (vLLM's ``allowed_token_ids``);
    allowed_token_ids: list[int] | None = None
    # token sequences never to complete (vLLM's ``bad_words``, tokenized): the last token
    # of each is banned wherever the output already ends with the ones before it.
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k <= 0:
            self.top_k = -1
        self.validate()

    def validate(self) -> None:
        """Raise ValueError for values the engine cannot honour."""
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise ValueError(f"max_tokens must be at least 1 (0 only with prompt_logprobs), got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.structured is not None and not hasattr(self.structured, "to_llguidance"):
            raise ValueError("structured must be a GrammarSpec (tokenmill.GrammarSpec)")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        for token, value in (self.logit_bias or {}).items():
            if not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias: token id {token!r} is not a non-negative integer")
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias: the bias of token {token} is {value}, outside [-100, 100]")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids: must not be empty")
        if any(t < 0 for t in self.allowed_token_ids or []):
            raise ValueError("allowed_token_ids: token ids must be non-negative")
        if any(not word or min(word) < 0 for word in self.bad_words_token_ids or []):
            raise ValueError("bad_words: each word must tokenize to at least one valid token")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @functools.cached_property
    def allowed_ids(self) -> torch.Tensor:
        """``allowed_token_ids`` as a tensor, built once (the sampler uses it every step)."""
        return torch.tensor(sorted(set(self.allowed_token_ids or ())), dtype=torch.long)

    @functools.cached_property
    def bias_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``logit_bias`` as (token ids, values) tensors, built once."""
        bias = self.logit_bias or {}
        return (torch.tensor(list(bias), dtype=torch.long), torch.tensor(list(bias.values()), dtype=torch.float32))

    @property
    def has_token_rules(self) -> bool:
        """Whether the sampler must apply logit_bias / allowed_token_ids / bad_words."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError for a token rule naming an id outside the vocabulary."""
        named = [("logit_bias", t) for t in self.logit_bias or {}]
        named += [("allowed_token_ids", t) for t in self.allowed_token_ids or []]
        named += [("bad_words", t) for word in self.bad_words_token_ids or [] for t in word]
        bad = next(((name, t) for name, t in named if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"{bad[0]}: token id {bad[1]} is out of range [0, {vocab_size})")

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


@dataclass(frozen=True)
class Placement:
    """Where a request stands among others when the scheduler is not FCFS
    (engine/sched/fairness.py): its tenant, the tenant's priority class (0 first) and
    fair-share weight, and the request's own ``priority`` (vLLM's, lower first)
    within them. FCFS ignores it."""

    tenant: str = "default"
    priority_class: int = 2  # priority_classes.PRIORITY_CLASSES["normal"]
    weight: float = 1.0
    priority: int = 0

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"a tenant's weight must be positive, got {self.weight}")
        if self.priority_class < 0:
            raise ValueError(f"priority class must be non-negative, got {self.priority_class}")


DEFAULT_PLACEMENT = Placement()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence in the engine. ``n > 1`` completions become n Requests."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    eos_token_ids: frozenset[int] = frozenset()
    max_tokens: int = 16  # resolved against the context length
    placement: Placement = DEFAULT_PLACEMENT
    adapter_id: int = 0  # the LoRA adapter it runs with (engine/adapters.py); 0: the base model
    # Traced requests only (None otherwise, at no cost): (time, prompt tokens) of each prefill
    # chunk as its step ends, recomputes after a preemption included.
    prefill_chunks: list[tuple[float, int]] | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[Logprob] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    block_table: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    generator: Any = None  # torch.Generator for seeded sampling
    # Prefix-cache bookkeeping: how many of this request's blocks are already in the tree.
    num_cached_blocks: int = 0
    # Sliding-window models: the leading block_table entries already released (wholly behind
    # every layer's window); their slots repeat the first block still held, so the table
    # keeps its positions and holds only ids of this request's finite K/V.
    num_dropped_blocks: int = 0
    # Scheduler step at which it last joined the running batch (prefill ordering).
    admitted_step: int = 0
    # When it arrived: the requests its queue (fairness.py: queue_key) had started, and the
    # running requests that had finished, all told (what followed is the drain, QueueHead).
    queue_mark: tuple[int, int] = (0, 0)
    # Chained hashes of the prompt's full blocks (the scheduler's in-flight prefix
    # sharing spots other requests computing the same blocks); filled on first use.
    prompt_block_hashes: list[int] | None = None
    # Speculative decoding: this step's proposals (verified after it), and back-off state.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_misses: int = 0
    spec_backoff_until: int = 0
    # Grammar matcher of a structured-output request (engine/grammar/structured.py), advanced per token.
    grammar: Any = None
    # The grammar while the reasoning runs (params.structured_after not yet seen); then ``grammar``.
    pending_grammar: Any = None
    # With params.prompt_logprobs: entry j scores prompt token j given tokens [0, j);
    # entry 0 is None (nothing precedes the first token). Filled chunk by chunk.
    prompt_logprobs: list[Logprob | None] = field(default_factory=list)
    # Of a request's n sequences with prompt logprobs only the first scores the prompt; the
    # others point at it here, wait to be admitted until it is done (then its blocks are in the
    # prefix cache) and hand on its list: the prompt is computed once, whatever n is.
    prompt_scorer: "Request | None" = None

    @property
    def held_for_scorer(self) -> bool:
        """Waiting for its first sibling to finish scoring the shared prompt."""
        scorer = self.prompt_scorer
        return scorer is not None and scorer.wants_prompt_logprobs and not scorer.is_finished

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs and not all of them are computed yet. Such a
        request skips the prefix cache: cached positions have no logits."""
        return (self.params.prompt_logprobs is not None and self.prompt_scorer is None
                and len(self.prompt_logprobs) < len(self.prompt_token_ids))

    @property
    def samples(self) -> bool:
        """Whether reaching the end of its tokens yields a token (not for a
        ``max_tokens=0`` request, which only scores its prompt)."""
        return self.max_tokens > 0

    def token_at(self, index: int) -> int:
        """Token ``index`` of prompt + output, then of this step's speculative proposals."""
        n = len(self.prompt_token_ids)
        if index < n:
            return self.prompt_token_ids[index]
        index -= n
        if index < len(self.output_token_ids):
            return self.output_token_ids[index]
        return self.spec_token_ids[index - len(self.output_token_ids)]

    def step_token_ids(self, start: int, count: int) -> list[int]:
        """Tokens start .. start + count of prompt + output + proposals (what a step runs)."""
        tokens = self.all_token_ids
        if start + count > len(tokens):
            tokens = tokens + self.spec_token_ids
        return tokens[start : start + count]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[Logprob] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None first.
    prompt_logprobs: list[Logprob | None] | None = None

"""Speculative decoding with n-gram (prompt lookup) or draft-model proposals.

A single stream on a CPU is bound by reading the weights once per token; a
step that checks K proposed tokens reads them once for K + 1 rows. Proposals
come from the request's own text: the last n tokens (n from
``prompt_lookup_max`` down to ``prompt_lookup_min``) are looked up earlier in
prompt + output, and the tokens that followed that occurrence are proposed.
This pays off where answers repeat spans of their input (summaries, edits,
code changes, extraction) and costs nothing where no n-gram repeats. The
second method runs a small draft model with the target's vocabulary
(``draft.py``) greedily for K tokens.

Verification runs as an ordinary step: the sequence's row for its last token
plus one row per proposal, at consecutive positions, through the same paged
attention (the fused CPU decode step takes them as decode rows of one
sequence; elsewhere they are a prefill chunk). The scheduler counts only
accepted tokens as computed, so the K/V written for rejected proposals lies
past the sequence's length, is never indexed by the prefix cache, and is
overwritten by the next step; the blocks stay in the request's table and go
back with it.

Acceptance keeps the output distribution exact: greedy rows accept a proposal
while it equals the argmax; sampled rows accept proposal d with probability
p(d) under the row's processed distribution (temperature, top-k, top-p,
min-p) and otherwise draw from p with d removed, which is rejection sampling
for a proposal that puts all its mass on d. Requests with penalties, token
rules (logit_bias, allowed_token_ids, bad_words), pending ``min_tokens``,
logprobs, or ``speculative=False`` decode one token at a time.

Structured outputs: a constrained request's proposals are cut at the first
token its grammar refuses (and before EOS), and each verify row has the
grammar's mask at the state after the proposals before it applied first
(``structured.fill_step``), so every row's greedy pick or distribution is the
one plain constrained decoding would use there; the matcher consumes only the
tokens emitted. Proposals the grammar refuses outright count as a miss for
the back-off.

Back-off: a request whose proposals were all rejected waits 2, 4, 8, ... steps
(up to ``max_backoff_steps``) before proposing again, and proposals are made
only while the step's verify rows stay under ``max_verify_rows``: at many
streams the step is bound by arithmetic, and extra rows would cost more than
they save.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from ...model.sampler import apply_bitmask, processed_probs
from ..grammar.structured import grammar_prefix

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``--speculative-config`` keys that apply here."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None  # draft_model: a local GGUF file or HF folder with the target's vocabulary
    draft_kv_cache_memory: str | int = "512MiB"  # draft_model: the draft's own KV pool
    max_verify_rows: int = 16  # proposal rows per step, all sequences together
    max_backoff_steps: int = 64

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(problems))

    def problems(self) -> list[str]:
        """One line per bad field, each naming it, what it must be and what it was (empty: usable)."""
        out: list[str] = []

        def integer(name: str, low: int, high: int | None = None) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low or \
                    (high is not None and value > high):
                span = f"in [{low}, {high}]" if high is not None else f">= {low}"
                out.append(f"--speculative-config: {name} must be an integer {span} (got {value!r})")

        if not isinstance(self.method, str) or self.method not in METHODS:
            out.append(f"--speculative-config: method {self.method!r} is not supported; choose one of "
                       f"{', '.join(METHODS)}")
        integer("num_speculative_tokens", 1, 16)
        integer("prompt_lookup_max", 1)
        integer("prompt_lookup_min", 1)
        integer("max_verify_rows", 1)
        integer("max_backoff_steps", 0)
        if not out and self.prompt_lookup_min > self.prompt_lookup_max:
            out.append("--speculative-config: prompt_lookup_min must be at most prompt_lookup_max "
                       f"(got {self.prompt_lookup_min} > {self.prompt_lookup_max})")
        if self.model is not None and not isinstance(self.model, str):
            out.append(f"--speculative-config: model must be a path (got {self.model!r})")
        elif self.method == "ngram" and self.model:
            out.append("--speculative-config: \"model\" names a draft model, for method 'draft_model'")
        elif self.method == "draft_model" and not self.model:
            out.append("--speculative-config: method 'draft_model' needs \"model\": a local draft model path")
        if isinstance(self.draft_kv_cache_memory, bool) or not isinstance(self.draft_kv_cache_memory, (str, int)):
            out.append("--speculative-config: draft_kv_cache_memory must be a size such as \"512MiB\" "
                       f"(got {self.draft_kv_cache_memory!r})")
        return out

    @classmethod
    def parse(cls, value: "str | dict[str, Any] | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """From the JSON text of ``--speculative-config`` (or a dict); ValueError naming every bad field."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        problems = cls.check(value)
        if problems:
            raise ValueError("; ".join(problems))
        return cls(**cls._fields_of(value))

    @classmethod
    def check(cls, value: Any) -> list[str]:
        """Every problem of a ``--speculative-config`` value, one line each (before any model loads)."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except (json.JSONDecodeError, RecursionError) as exc:
                return [f"--speculative-config is not JSON: {exc}"]
        if not isinstance(value, dict):
            return ["--speculative-config must be a JSON object"]
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            return [f"--speculative-config: unknown keys {', '.join(map(repr, unknown))} "
                    f"(known: {', '.join(sorted(known))})"]
        fields = cls._fields_of(value)
        if "method" not in fields:  # as vLLM: no silent default method
            return ['--speculative-config: say which method: "method": "ngram" (with num_speculative_tokens) '
                    'or "draft_model" (with "model": a draft model path)']
        probe = object.__new__(cls)  # the fields as given, checked without __post_init__ raising
        for name, default in ((f, cls.__dataclass_fields__[f].default) for f in known):
            object.__setattr__(probe, name, fields.get(name, default))
        return probe.problems()

    @staticmethod
    def _fields_of(value: Any) -> dict[str, Any]:
        if isinstance(value, str):
            value = json.loads(value)
        value = dict(value)
        if value.get("model") in ("[ngram]", "ngram", ""):  # vLLM's older spelling of the n-gram method
            value.pop("model")
            value.setdefault("method", "ngram")
        elif value.get("model") and "method" not in value:
            value["method"] = "draft_model"
        return value


def propose_ngram(tokens: Sequence[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
    suffix of ``tokens`` (``n_max`` down to ``n_min`` tokens long); [] when none repeats."""
    total = len(tokens)
    if total < n_min + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        suffix = arr[total - n:]
        # candidate starts i < total - n whose n tokens equal the suffix
        hits = np.ones(total - n, dtype=bool)
        for j in range(n):
            hits &= arr[j : total - n + j] == suffix[j]
        starts = np.flatnonzero(hits)
        if starts.size:
            start = int(starts[-1]) + n  # the latest occurrence: its continuation
            return arr[start : start + k].tolist()
    return []


@dataclass
class SpecStats:
    """Counters with vLLM's meaning: drafts made, tokens proposed, tokens accepted (per position)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < proposed:
            self.accepted_per_position += [0] * (proposed - len(self.accepted_per_position))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


def eligible(request: Any) -> bool:
    """Whether this request may decode speculatively (see the module docstring)."""
    p = request.params
    return (getattr(p, "speculative", True) and not p.needs_penalties and p.logprobs is None
            and not getattr(p, "has_token_rules", False)
            and len(request.output_token_ids) >= p.min_tokens)


class Proposer(Protocol):
    """Where proposals come from: up to ``k`` tokens for each request."""

    def propose(self, requests: Sequence[Any], ks: Sequence[int]) -> list[list[int]]: ...


class NgramProposer:
    """Prompt lookup in the request's own tokens (:func:`propose_ngram`)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, requests: Sequence[Any], ks: Sequence[int]) -> list[list[int]]:
        cfg = self.config
        return [propose_ngram(r.all_token_ids, k, cfg.prompt_lookup_max, cfg.prompt_lookup_min)
                for r, k in zip(requests, ks)]


class Speculator:
    """Makes proposals before a step and checks them after it."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None,
                 grammar_eos: Sequence[int] = ()) -> None:
        """``grammar_eos``: the tokenizer's EOS ids, where a constrained request's proposals stop."""
        self.config = config
        self.proposer = proposer or NgramProposer(config)
        self.grammar_eos = frozenset(grammar_eos)
        self.stats = SpecStats()
        self._step = 0

    def propose(self, decoding: Sequence[Any]) -> None:
        """Set ``spec_token_ids`` on the requests (in decode phase) that get proposals this step."""
        self._step += 1
        cfg = self.config
        rows = 0
        chosen: list[Any] = []
        ks: list[int] = []
        for request in decoding:
            request.spec_token_ids = []
            if rows >= cfg.max_verify_rows or self._step < request.spec_backoff_until or not eligible(request):
                continue
            room = request.max_tokens - len(request.output_token_ids) - 1  # the step's own token counts too
            k = min(cfg.num_speculative_tokens, room, cfg.max_verify_rows - rows)
            if k <= 0:
                continue
            chosen.append(request)
            ks.append(k)
            rows += k
        if chosen:
            for request, draft in zip(chosen, self.proposer.propose(chosen, ks)):
                grammar = getattr(request, "grammar", None)
                if draft and grammar is not None:
                    draft = draft[: grammar_prefix(grammar, draft, self.grammar_eos | request.eos_token_ids)]
                    if not draft:
                        self._missed(request)
                request.spec_token_ids = draft

    def verify(self, request: Any, logits: torch.Tensor, generator: torch.Generator | None,
               mask: torch.Tensor | None = None) -> list[int]:
        """Tokens to append for a request whose proposals ``request.spec_token_ids`` were
        run: ``logits`` [1 + len(proposals), V] rows for its last token and each proposal;
        ``mask``: a constrained request's grammar bitmask for each of those rows.
        Returns the accepted proposals plus one token drawn where the first one failed
        (or after the last); records acceptance and backs off when nothing was taken."""
        draft = list(request.spec_token_ids)
        params = request.params
        if mask is not None:
            logits = logits.clone()
            apply_bitmask(logits, range(logits.shape[0]), mask)
        if params.greedy:
            best = logits.argmax(dim=-1).tolist()
            accepted = 0
            while accepted < len(draft) and draft[accepted] == best[accepted]:
                accepted += 1
            out = draft[:accepted] + [best[accepted]]
        else:
            probs = processed_probs(logits, params)
            gen = request.generator if request.generator is not None else generator
            u = torch.rand(len(draft) + 1, generator=gen, dtype=torch.float64).tolist()
            out = []
            for i, d in enumerate(draft):
                if u[i] < float(probs[i, d]):
                    out.append(d)
                    continue
                residual = probs[i].double().clone()
                residual[d] = 0.0
                out.append(_draw(residual, u[-1]))
                break
            else:
                out.append(_draw(probs[len(draft)].double(), u[-1]))
            accepted = len(out) - 1
        self.stats.record(len(draft), accepted)
        if draft and accepted == 0:
            self._missed(request)
        elif accepted:
            request.spec_misses = 0
        request.spec_token_ids = []
        return out

    def _missed(self, request: Any) -> None:
        """Nothing proposed was taken: propose again after 2, 4, 8, ... steps."""
        request.spec_misses += 1
        request.spec_backoff_until = self._step + min(2 ** request.spec_misses, self.config.max_backoff_steps)


def _draw(weights: torch.Tensor, u: float) -> int:
    """Inverse CDF of unnormalised ``weights`` at ``u`` in [0, 1)."""
    cum = weights.cumsum(0)
    total = float(cum[-1])
    if total <= 0.0:
        return int(weights.argmax())
    return int(torch.searchsorted(cum, torch.tensor([u * total], dtype=cum.dtype), right=True).clamp(
        max=weights.numel() - 1)[0])

"""Logits -> next tokens, each row with its own parameters, in one batch.

Order of operations (as the common engines do): penalties on the raw logits,
token rules (allowed_token_ids, logit_bias, bad_words: one batched scatter each
over every row that has them), min_tokens masking, grammar masks of structured-output rows (-inf outside the
grammar, engine/grammar/structured.py), then greedy rows take the argmax; random rows are divided
by temperature, filtered by top-k, top-p and min-p, and sampled by inverse
CDF: one uniform draw per row, located in the row's cumulative probabilities.
A seeded row draws its uniform from its own generator, so the same seed and
prompt give the same text whatever else shares the batch. (One uniform per
row instead of one exponential per vocabulary entry: drawing one exponential
per vocabulary entry made sampling a visible share of a large batch's step;
see docs/performance.md.) Reported logprobs are the model's
raw log-softmax (before penalties and temperature).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch

from .kernels import cpu_kernels


@dataclass
class Logprob:
    """Log-probability of a chosen token, with the top alternatives (incl. itself)."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)
    rank: int | None = None  # 1 + how many tokens are likelier (set for prompt logprobs)


class SamplingRow(Protocol):
    """What the sampler reads of one sequence (the engine's Request fits)."""

    params: Any  # SamplingParams: temperature, top_k, top_p, min_p, penalties, logprobs, ...
    output_token_ids: list[int]
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None

    @property
    def all_token_ids(self) -> list[int]: ...


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[Logprob | None]


def _apply_penalties(logits: torch.Tensor, requests: Sequence[SamplingRow]) -> None:
    vocab = logits.shape[-1]
    for row, req in enumerate(requests):
        p = req.params
        if not p.needs_penalties:
            continue
        device = logits.device
        out = torch.tensor(req.output_token_ids, dtype=torch.long, device=device)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(req.all_token_ids, dtype=torch.long, device=device).unique()
            vals = logits[row, seen]
            logits[row, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if out.numel() and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _flat_index(rows: list[int], per_row: list[torch.Tensor], device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column index tensors for one scatter over several rows' token id tensors."""
    counts = torch.tensor([len(t) for t in per_row])
    row_index = torch.repeat_interleave(torch.tensor(rows), counts).to(device)
    return row_index, torch.cat(per_row).to(device)


def _banned_words(req: SamplingRow) -> list[int]:
    """Last tokens of the bad words whose other tokens end the output so far."""
    out = req.output_token_ids
    banned = []
    for word in req.params.bad_words_token_ids or ():
        head = word[:-1]
        if not head or (len(out) >= len(head) and out[len(out) - len(head):] == head):
            banned.append(word[-1])
    return banned


def _apply_token_rules(logits: torch.Tensor, requests: Sequence[SamplingRow]) -> None:
    """allowed_token_ids, logit_bias and bad_words of every row that has them, each one
    batched operation over those rows' entries only (the id tensors are built once per
    request, in SamplingParams)."""
    device = logits.device
    allowed = [(row, r.params.allowed_ids) for row, r in enumerate(requests)
               if getattr(r.params, "allowed_token_ids", None)]
    if allowed:  # keep the allowed entries, set the rest of those rows to -inf
        rows, cols = _flat_index([row for row, _ in allowed], [ids for _, ids in allowed], device)
        kept = logits[rows, cols]
        logits.index_fill_(0, torch.tensor([row for row, _ in allowed], device=device), float("-inf"))
        logits.index_put_((rows, cols), kept)
    biased = [(row, r.params.bias_tensors) for row, r in enumerate(requests)
              if getattr(r.params, "logit_bias", None)]
    if biased:
        rows, cols = _flat_index([row for row, _ in biased], [ids for _, (ids, _) in biased], device)
        values = torch.cat([vals for _, (_, vals) in biased]).to(device=device, dtype=logits.dtype)
        logits.index_put_((rows, cols), values, accumulate=True)
    banned = [(row, ids) for row, r in enumerate(requests)
              if getattr(r.params, "bad_words_token_ids", None) and (ids := _banned_words(r))]
    if banned:
        rows, cols = _flat_index([row for row, _ in banned], [torch.tensor(ids) for _, ids in banned], device)
        logits.index_put_((rows, cols), torch.tensor(float("-inf"), dtype=logits.dtype, device=device))


def _mask_min_tokens(logits: torch.Tensor, requests: Sequence[SamplingRow]) -> None:
    for row, req in enumerate(requests):
        # a grammar decides when EOS may come; banning it too could leave nothing allowed
        if getattr(req, "grammar", None) is not None:
            continue
        if len(req.output_token_ids) < req.params.min_tokens:
            banned = set(req.params.stop_token_ids or [])
            if not req.params.ignore_eos:
                banned |= set(req.eos_token_ids)
            if banned:
                logits[row, list(banned)] = float("-inf")


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens outside top-k / top-p / min-p; rows with k=V, p=1, min_p=0 pass unchanged."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    remove = ranks >= top_k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    cum = probs.cumsum(dim=-1)
    remove |= (cum - probs) >= top_p[:, None]  # keep the smallest set reaching top_p
    remove |= probs < (min_p[:, None] * probs[:, :1])
    remove[:, 0] = False  # the best token always survives
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _inverse_cdf(probs: torch.Tensor, generators: list[torch.Generator | None],
                 shared: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs``: the first whose cumulative probability exceeds
    a uniform draw (scaled by the row's total, which rounding leaves near but not at 1).
    Rows with their own generator draw from it; the others share one batched draw."""
    u = torch.empty(probs.shape[0], dtype=torch.float64)
    unseeded = [j for j, g in enumerate(generators) if g is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), generator=shared, dtype=torch.float64)
    for j, g in enumerate(generators):
        if g is not None:
            u[j] = torch.rand(1, generator=g, dtype=torch.float64)
    cum = probs.double().cumsum(dim=-1)
    target = (u.to(probs.device) * cum[:, -1])[:, None]
    picked = torch.searchsorted(cum, target, right=True)[:, 0]
    return picked.clamp_(max=probs.shape[-1] - 1)


def processed_probs(logits: torch.Tensor, params: Any) -> torch.Tensor:
    """The distribution a random row of ``params`` draws from, for every row of
    ``logits`` ([R, V]): temperature, then top-k / top-p / min-p, then softmax (no
    penalties: speculative verification, which uses this, skips requests with them)."""
    vocab = logits.shape[-1]
    sub = logits / params.temperature
    if params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0:
        rows = sub.shape[0]
        top_k = torch.full((rows,), params.top_k if params.top_k > 0 else vocab, device=logits.device)
        top_p = torch.full((rows,), params.top_p, device=logits.device, dtype=sub.dtype)
        min_p = torch.full((rows,), params.min_p, device=logits.device, dtype=sub.dtype)
        sub = _filter(sub, top_k, top_p, min_p)
    return sub.softmax(dim=-1)


def _argmax(logits: torch.Tensor, library: cpu_kernels.KernelLibrary | None) -> torch.Tensor:
    """Greedy picks: the engine's C kernel on CPU (torch's CPU argmax does not vectorize
    its index tracking at vocabulary width), torch elsewhere; the same indices either way."""
    fast = cpu_kernels.argmax_rows(logits, library) if library is not None else None
    return fast if fast is not None else logits.argmax(dim=-1)


_BITS = torch.arange(32, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, rows: Sequence[int], mask: torch.Tensor) -> None:
    """Set logits of tokens outside each row's grammar to -inf, in place.

    A row whose mask allows nothing (an exhausted or broken grammar) keeps its
    EOS-free logits untouched rather than becoming all -inf: the engine finishes
    such sequences itself."""
    vocab = logits.shape[-1]
    allowed = ((mask.unsqueeze(-1) >> _BITS) & 1).bool().reshape(mask.shape[0], -1)[:, :vocab]
    allowed = allowed.to(logits.device)
    index = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
    sub = logits.index_select(0, index)
    empty = ~allowed.any(dim=-1)
    if bool(empty.any()):
        allowed[empty] = True
    logits.index_copy_(0, index, sub.masked_fill(~allowed, float("-inf")))


def sample(logits: torch.Tensor, requests: Sequence[SamplingRow], generator: torch.Generator | None = None,
           token_mask: tuple[list[int], torch.Tensor] | None = None,
           library: cpu_kernels.KernelLibrary | None = None) -> SampleResult:
    """Pick one token per row of ``logits`` ([B, V] float32). ``token_mask``: rows and
    their grammar bitmasks (engine/grammar/structured.py), applied after penalties. ``library``:
    the engine's C kernels (greedy rows' argmax), or None for torch."""
    batch, vocab = logits.shape
    want_logprobs = any(r.params.logprobs is not None for r in requests)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

    penalties = any(r.params.needs_penalties for r in requests)
    rules = any(getattr(r.params, "has_token_rules", False) for r in requests)
    min_tokens = any(len(r.output_token_ids) < r.params.min_tokens for r in requests)
    masked = token_mask is not None and bool(token_mask[0])
    if penalties or rules or min_tokens or masked:
        logits = logits.clone()
        if penalties:
            _apply_penalties(logits, requests)
        if rules:
            _apply_token_rules(logits, requests)
        if min_tokens:
            _mask_min_tokens(logits, requests)
        if masked:
            assert token_mask is not None
            apply_bitmask(logits, token_mask[0], token_mask[1])

    chosen = _argmax(logits, library)
    random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        sub = logits.index_select(0, rows)
        params = [requests[i].params for i in random_rows]
        temps = torch.tensor([p.temperature for p in params], device=logits.device, dtype=sub.dtype)
        sub = sub / temps[:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
            top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=logits.device)
            top_p = torch.tensor([p.top_p for p in params], device=logits.device, dtype=sub.dtype)
            min_p = torch.tensor([p.min_p for p in params], device=logits.device, dtype=sub.dtype)
            sub = _filter(sub, top_k, top_p, min_p)
        picked = _inverse_cdf(sub.softmax(dim=-1), [requests[i].generator for i in random_rows], generator)
        chosen = chosen.index_copy(0, rows, picked)

    token_ids = chosen.tolist()
    logprobs: list[Logprob | None] = [None] * batch
    if raw_logprobs is not None:
        for i, req in enumerate(requests):
            k = req.params.logprobs
            if k is None:
                continue
            tok = token_ids[i]
            row = raw_logprobs[i]
            top: dict[int, float] = {}
            if k > 0:
                vals, ids = row.topk(k)
                top = dict(zip(ids.tolist(), vals.tolist()))
            chosen_lp = float(row[tok])
            top.setdefault(tok, chosen_lp)
            logprobs[i] = Logprob(token_id=tok, logprob=chosen_lp, top=top)
    return SampleResult(token_ids=token_ids, logprobs=logprobs)

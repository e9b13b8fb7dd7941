"""Log-probabilities of a request's own prompt tokens, computed inside the normal step.

A prefill chunk that computes positions ``[start, end)`` has, at the row of
position ``p``, the distribution of token ``p + 1``: so the chunk scores
prompt tokens ``start + 1 .. min(end, P - 1)``. Only requests that asked for
prompt logprobs get logits at those rows (never the whole batch), turned into
float32 log-softmax a bounded number of rows at a time; each scored position
keeps the actual token's logprob and rank plus the top-N alternatives.

Positions served from the prefix cache have no hidden states, so such a
request does not read the cache until every prompt logprob is in (the
scheduler checks ``Request.wants_prompt_logprobs``); after a preemption the
recomputed positions that are already recorded are not scored again.

Under tensor parallelism the LM head gathers logits on the driver, so every
rank makes the same logit calls: workers ``follow`` the driver's spans.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from ...model.sampler import Logprob
from ..request import Request

LOGIT_ROWS = 256  # rows turned into vocabulary-wide logits at a time (bounds memory)


@dataclass
class PromptRows:
    """Hidden rows of one step that score prompt tokens ``first .. first + count - 1``."""

    request: Request
    row: int  # the batch row of position ``first - 1``
    first: int
    count: int


def plan_rows(request: Request, start: int, end: int, row_of_start: int) -> PromptRows | None:
    """The rows a chunk over positions ``[start, end)`` (its first row at
    ``row_of_start``) must score for ``request``, or None."""
    if not request.wants_prompt_logprobs:
        return None
    first = max(start + 1, len(request.prompt_logprobs))  # already recorded: not again
    last = min(end, request.num_prompt_tokens - 1)
    if last < first:
        return None
    return PromptRows(request, row_of_start + (first - 1 - start), first, last - first + 1)


def _logit_chunks(model: torch.nn.Module, hidden: torch.Tensor, row: int,
                  count: int) -> Iterator[tuple[int, torch.Tensor]]:
    """``(offset, logits)`` of rows ``row .. row + count - 1``, ``LOGIT_ROWS`` at a time: the
    one place the chunks are cut, so that the ranks of a tensor-parallel group, whose
    LM head gathers every chunk, make the same calls (``follow``)."""
    for r0 in range(0, count, LOGIT_ROWS):
        n = min(LOGIT_ROWS, count - r0)
        yield r0, model.compute_logits(hidden[row + r0 : row + r0 + n])


def compute(model: torch.nn.Module, hidden: torch.Tensor, plans: list[PromptRows]) -> list[tuple[Request, list[Logprob]]]:
    """Logprob entries for every planned row, per request, in prompt order."""
    results = []
    for plan in plans:
        req = plan.request
        k = req.params.prompt_logprobs or 0
        targets_all = req.prompt_token_ids[plan.first : plan.first + plan.count]
        entries: list[Logprob] = []
        for r0, logits in _logit_chunks(model, hidden, plan.row, plan.count):
            entries.extend(_entries(torch.log_softmax(logits.float(), dim=-1), targets_all[r0 : r0 + len(logits)], k))
        results.append((req, entries))
    return results


def _entries(logprobs: torch.Tensor, targets_list: list[int], k: int) -> list[Logprob]:
    """Each row's actual token's logprob and rank, and the top ``k`` alternatives."""
    n = len(targets_list)
    targets = torch.tensor(targets_list, dtype=torch.long, device=logprobs.device)
    actual = logprobs.gather(1, targets[:, None])
    ranks = (logprobs > actual).sum(dim=-1) + 1
    top_vals: list[list[float]] = [[] for _ in range(n)]
    top_ids: list[list[int]] = [[] for _ in range(n)]
    if k > 0:
        vals, ids = logprobs.topk(k, dim=-1)
        top_vals, top_ids = vals.tolist(), ids.tolist()
    entries = []
    for token, value, rank, tids, tvals in zip(targets_list, actual[:, 0].tolist(), ranks.tolist(), top_ids, top_vals):
        top = dict(zip(tids, tvals))
        top.setdefault(token, value)
        entries.append(Logprob(token_id=token, logprob=value, top=top, rank=rank))
    return entries


def follow(model: torch.nn.Module, hidden: torch.Tensor, spans: list[tuple[int, int]]) -> None:
    """A tensor-parallel worker's part of ``compute``: the same LM-head calls over the same
    ``(first row, row count)`` spans; the driver turns the gathered logits into entries."""
    for row, count in spans:
        for _ in _logit_chunks(model, hidden, row, count):
            pass

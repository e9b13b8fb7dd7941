"""Prompt logprobs on the wire, in the two shapes clients read.

* OpenAI's legacy completions shape (``echo`` with ``logprobs: N``): the
  prompt's tokens come before the generated ones in ``tokens``,
  ``token_logprobs``, ``top_logprobs`` and ``text_offset``; the first prompt
  token has nothing before it, so its logprob and alternatives are null.
  lm-evaluation-harness scores multiple choice and perplexity this way.
* vLLM's ``prompt_logprobs`` field: per prompt token, null first, then a map
  from token id to ``{logprob, rank, decoded_token}`` holding the N likeliest
  tokens and the actual one.

The engine keeps ``max`` of what both ask for; each shape is cut to its own N.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...model.sampler import Logprob

if TYPE_CHECKING:
    from ..server.serving import ServerState


def _top(entry: Logprob, k: int) -> list[tuple[int, float, int | None]]:
    """(token id, logprob, rank) of the k likeliest tokens, and of the actual one if not among them."""
    ranked = sorted(entry.top.items(), key=lambda kv: -kv[1])[:k]
    out: list[tuple[int, float, int | None]] = [
        (t, v, entry.rank if t == entry.token_id else i + 1) for i, (t, v) in enumerate(ranked)]
    if all(t != entry.token_id for t, _ in ranked):
        out.append((entry.token_id, entry.logprob, entry.rank))
    return out


def echo_logprobs(state: "ServerState", prompt_ids: list[int], entries: list[Logprob | None] | None,
                  k: int) -> dict[str, Any]:
    """The prompt's part of a legacy completions ``logprobs`` object (offsets from 0)."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = 0
    entries = entries or [None] * len(prompt_ids)
    for token_id, entry in zip(prompt_ids, entries):
        text = state.token_text(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            values.append(None)
            tops.append(None)
        else:
            values.append(entry.logprob)
            top: dict[str, float] = {}
            for t, v, _ in _top(entry, k):  # tokens that read the same keep the likelier value
                top.setdefault(state.token_text(t), v)
            tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def join(prompt_part: dict[str, Any] | None, generated: dict[str, Any] | None) -> dict[str, Any] | None:
    """Prompt entries first, then the generated ones, field by field."""
    if prompt_part is None or generated is None:
        return prompt_part or generated
    return {key: prompt_part[key] + generated[key] for key in prompt_part}


def vllm_prompt_logprobs(state: "ServerState", entries: list[Logprob | None] | None,
                         k: int) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs`` list for one prompt."""
    if entries is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        out.append({str(t): {"logprob": v, "rank": rank, "decoded_token": state.token_text(t)}
                    for t, v, rank in _top(entry, k)})
    return out

"""Log-probabilities of given text, and perplexity over a long one.

Scoring goes straight through the engine's model and its paged KV cache (the
same attention, the same quantized layers as serving): a few sequences are
packed into one forward pass, blocks are borrowed from the engine's pool and
given back at once. The engine must be idle while this runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..engine.engine import LLMEngine
from ..engine.request import Request, SamplingParams

_LOGIT_ROWS = 256  # rows turned into vocabulary-sized logits at a time (bounds memory)


class Scorer:
    """Per-token log-probabilities of token sequences under one engine's model."""

    def __init__(self, engine: LLMEngine, max_batch_tokens: int = 1024) -> None:
        self.engine = engine
        self.max_batch_tokens = max_batch_tokens
        self.forward_tokens = 0  # how many tokens went through the model (for the report)

    def logprobs(self, sequences: list[list[int]], starts: list[int] | None = None) -> list[torch.Tensor]:
        """For each sequence, float64 ``log p(tokens[j] | tokens[:j])`` for j in ``[start, len)``.

        ``start`` (default 1) must be >= 1: the first token has no context.
        """
        return [lp for lp, _ in self.score(sequences, starts)]

    def score(self, sequences: list[list[int]], starts: list[int] | None = None
              ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Like ``logprobs``, plus the model's own top-1 token at each of those positions."""
        starts = starts or [1] * len(sequences)
        for seq, start in zip(sequences, starts):
            if not 1 <= start <= len(seq):
                raise ValueError(f"start {start} outside [1, {len(seq)}]")
            if len(seq) > self.engine.max_model_len:
                raise ValueError(f"a {len(seq)}-token sequence exceeds the context length {self.engine.max_model_len}")
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(sequences)
        order = list(range(len(sequences)))
        batch: list[int] = []
        used = 0
        for i in order:
            n = len(sequences[i])
            if batch and (used + n > self.max_batch_tokens or not self._fits(batch + [i], sequences)):
                self._run(batch, sequences, starts, out)
                batch, used = [], 0
            batch.append(i)
            used += n
        if batch:
            self._run(batch, sequences, starts, out)
        empty = (torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.long))
        return [t if t is not None else empty for t in out]

    def _fits(self, batch: list[int], sequences: list[list[int]]) -> bool:
        bs = self.engine.block_size
        need = sum(-(-len(sequences[i]) // bs) for i in batch)
        return need <= self.engine.pool.num_available

    @torch.inference_mode()
    def _run(self, batch: list[int], sequences: list[list[int]], starts: list[int],
             out: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        engine = self.engine
        if engine.has_unfinished():
            raise RuntimeError("the engine has requests running; score while it is idle")
        bs = engine.block_size
        items: list[tuple[Request, int]] = []
        try:
            for i in batch:
                ids = sequences[i]
                req = Request(f"score-{i}", list(ids), SamplingParams(max_tokens=1))
                need = -(-len(ids) // bs)
                if need > engine.pool.num_available:
                    raise RuntimeError(f"the KV pool ({engine.pool.num_blocks} blocks of {bs}) cannot hold "
                                       f"a {len(ids)}-token sequence; give the engine more blocks")
                req.block_table = engine.pool.allocate(need)
                items.append((req, len(ids)))
            # One-token sequences would be taken for decodes and reordered; they have nothing to score.
            runnable = [(r, n) for r, n in items if n > 1]
            if not runnable:
                return
            inputs = engine.runner.prepare(runnable)
            hidden = engine.model(inputs.input_ids, inputs.positions, engine.runner.kv_caches, inputs.meta)
            self.forward_tokens += int(inputs.input_ids.numel())
            offset = 0
            by_id = {id(r): i for (r, _), i in zip(items, batch)}
            for req, n in runnable:  # prepare keeps this order for multi-token sequences
                i = by_id[id(req)]
                start = starts[i]
                rows = hidden[offset + start - 1 : offset + n - 1]
                targets = torch.tensor(sequences[i][start:], dtype=torch.long, device=rows.device)
                parts, tops = [], []
                for r0 in range(0, rows.shape[0], _LOGIT_ROWS):
                    logits = engine.model.compute_logits(rows[r0 : r0 + _LOGIT_ROWS]).float()
                    lp = torch.log_softmax(logits, dim=-1)
                    parts.append(lp.gather(1, targets[r0 : r0 + _LOGIT_ROWS, None]).squeeze(1))
                    tops.append(logits.argmax(dim=-1))
                out[i] = (torch.cat(parts).double().cpu(), torch.cat(tops).cpu())
                offset += n
        finally:
            for req, _ in items:
                engine.pool.release(req.block_table)


@dataclass
class PerplexityResult:
    perplexity: float
    mean_nll: float  # nats per token
    num_tokens: int  # tokens scored: every token of the text but the first
    num_text_tokens: int
    num_windows: int
    window: int
    stride: int
    forward_tokens: int  # tokens run through the model (windows overlap)
    top1: list[int] = field(default_factory=list, repr=False)  # the model's argmax at each scored position


def windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position) of each sliding window.

    Every token but the first is scored exactly once, with up to ``window - 1``
    tokens of context; windows advance by ``stride`` (Hugging Face's recipe).
    """
    if window < 2 or not 1 <= stride < window:
        raise ValueError(f"need window >= 2 and 1 <= stride < window (got {window}, {stride})")
    spans = []
    scored_to = 1
    begin = 0
    while scored_to < num_tokens:
        end = min(begin + window, num_tokens)
        spans.append((begin, end, scored_to))
        scored_to = end
        begin += stride
    return spans


def perplexity(scorer: Scorer, token_ids: list[int], window: int = 512, stride: int = 256) -> PerplexityResult:
    """Sliding-window perplexity of a token stream."""
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least two tokens of text")
    window = min(window, scorer.engine.max_model_len)
    stride = min(stride, window - 1)
    spans = windows(len(token_ids), window, stride)
    before = scorer.forward_tokens
    scored = scorer.score([token_ids[b:e] for b, e, _ in spans], [s - b for b, _, s in spans])
    total = torch.cat([lp for lp, _ in scored])
    n = int(total.numel())
    assert n == len(token_ids) - 1, (n, len(token_ids))
    nll = float(-total.sum()) / n
    return PerplexityResult(perplexity=math.exp(nll), mean_nll=nll, num_tokens=n, num_text_tokens=len(token_ids),
                            num_windows=len(spans), window=window, stride=stride,
                            forward_tokens=scorer.forward_tokens - before,
                            top1=torch.cat([top for _, top in scored]).tolist())

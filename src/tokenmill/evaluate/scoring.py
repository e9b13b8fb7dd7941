"""Log-probabilities of given text, and perplexity over a long one.

Scoring is an ordinary engine request: the sequence is the prompt,
``prompt_logprobs`` asks for the log-probability of each of its tokens and
``max_tokens=0`` generates nothing. So it takes the one forward path serving
takes (the same scheduler, chunked prefill, attention and quantized layers);
there is no second forward pass to keep in step with it. The scorer drives
the engine itself, so the engine must have no other requests meanwhile.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch

from ..engine.engine import LLMEngine
from ..engine.request import SamplingParams

_SCORE = SamplingParams(max_tokens=0, prompt_logprobs=1, temperature=0.0)  # top-1 gives the argmax


class Scorer:
    """Per-token log-probabilities of token sequences under one engine's model."""

    def __init__(self, engine: LLMEngine, max_batch_tokens: int = 1024) -> None:
        self.engine = engine
        self.max_batch_tokens = max_batch_tokens  # prompt tokens queued at a time
        self.forward_tokens = 0  # how many tokens went through the model (for the report)
        self._ids = itertools.count()

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
        if self.engine.has_unfinished():
            raise RuntimeError("the engine has requests running; score while it is idle")
        empty = (torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.long))
        out: list[tuple[torch.Tensor, torch.Tensor]] = [empty] * len(sequences)
        # Sequences of one token have nothing to score.
        todo = [i for i, seq in enumerate(sequences) if len(seq) > 1]
        wave: list[int] = []
        used = 0
        for i in todo:
            if wave and used + len(sequences[i]) > self.max_batch_tokens:
                self._run(wave, sequences, starts, out)
                wave, used = [], 0
            wave.append(i)
            used += len(sequences[i])
        if wave:
            self._run(wave, sequences, starts, out)
        return out

    def _run(self, wave: list[int], sequences: list[list[int]], starts: list[int],
             out: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        engine = self.engine
        owners: dict[str, int] = {}
        try:
            for i in wave:
                rid = f"score-{next(self._ids)}"
                engine.add_request(rid, sequences[i], _SCORE)
                owners[rid] = i
            while engine.has_unfinished():
                for delta in engine.step():
                    i = owners[delta.request_id]
                    if delta.prompt_logprobs is None:
                        continue
                    entries = delta.prompt_logprobs[starts[i]:]
                    lps = torch.tensor([e.logprob for e in entries], dtype=torch.float64)
                    tops = torch.tensor([max(e.top.items(), key=lambda kv: kv[1])[0] for e in entries],
                                        dtype=torch.long)
                    out[i] = (lps, tops)
                    self.forward_tokens += len(sequences[i])
        finally:
            for rid in owners:
                engine.abort_request(rid)


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

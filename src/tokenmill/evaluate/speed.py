"""Decode and prefill throughput of one engine, measured on its own steps.

Decode: ``batch`` sequences generate ``tokens`` each (EOS ignored); only the
steps that carry no prefill count. Prefill: one prompt of ``prefill_tokens``
is computed in a single step (the token budget is raised to fit); the best of
``repeats`` runs is kept, since this machine's load drifts.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..engine.engine import LLMEngine
from ..engine.request import SamplingParams


@dataclass
class SpeedResult:
    decode_tps: dict[int, float]  # batch size -> generated tokens per second
    prefill_tps: float
    prefill_tokens: int
    decode_tokens: int


def _filler(engine: LLMEngine, n: int, salt: int, text_ids: list[int]) -> list[int]:
    """n real-text tokens, different per ``salt`` so no prefix is shared."""
    base = text_ids or list(range(10, 1000))
    start = (salt * 997) % max(1, len(base))
    out = [(base + base)[start + i % len(base)] for i in range(n)]
    out[0] = (out[0] + salt) % engine.model_config.vocab_size  # distinct first token
    return out


def measure_decode(engine: LLMEngine, batch: int, tokens: int, text_ids: list[int], prompt_len: int = 16,
                   repeats: int = 2) -> float:
    best = 0.0
    for r in range(repeats):
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        for b in range(batch):
            engine.add_request(f"speed-d{r}-{b}", _filler(engine, prompt_len, 1000 * r + b + 1, text_ids), params)
        steps_time, produced = 0.0, 0
        while engine.has_unfinished():
            deltas = engine.step()
            st = engine.last_step
            if st.num_prefill_tokens == 0 and st.num_decode_tokens:
                steps_time += st.duration_s
                produced += sum(len(d.token_ids) for d in deltas)
        if steps_time > 0:
            best = max(best, produced / steps_time)
        engine.reset_prefix_cache()
    return best


def measure_prefill(engine: LLMEngine, tokens: int, text_ids: list[int], repeats: int = 2) -> float:
    tokens = min(tokens, engine.max_model_len - 1)
    best = 0.0
    with engine.temporary_budget(tokens):
        for r in range(repeats):
            engine.add_request(f"speed-p{r}", _filler(engine, tokens, 7 + r, text_ids),
                               SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
            spent, done = 0.0, 0
            while engine.has_unfinished():
                engine.step()
                spent += engine.last_step.duration_s
                done += engine.last_step.num_prefill_tokens
            if spent > 0:
                best = max(best, done / spent)
            engine.reset_prefix_cache()
    return best


def measure_speed(engine: LLMEngine, text_ids: list[int], decode_batches: tuple[int, ...] = (1,),
                  decode_tokens: int = 32, prefill_tokens: int = 256) -> SpeedResult:
    decode = {b: measure_decode(engine, b, decode_tokens, text_ids) for b in decode_batches}
    return SpeedResult(decode_tps=decode, prefill_tps=measure_prefill(engine, prefill_tokens, text_ids),
                       prefill_tokens=prefill_tokens, decode_tokens=decode_tokens)

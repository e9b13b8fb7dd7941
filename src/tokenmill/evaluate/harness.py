"""Base vs candidates on the same data, in one process: the quality re-test.

Each configuration (a quantization, optionally a group size, a quantized LM
head, a dtype) gets its own engine over the *same* loaded checkpoint and
tokenizer, runs perplexity, the evaluation set and the speed probes, and is
then freed. Candidates are compared with the base: perplexity increase,
accuracy drop, agreement of greedy answers, refusals kept on the safety items;
thresholds turn that into a pass/fail verdict a CI job can gate on.
"""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ..settings.config import EngineConfig, canonical_dtype
from ..engine.engine import LLMEngine
from .evalset import EvalItem, ItemResult, run_eval_set
from .safety import SafetyChange, SafetyRates, compare_safety, safety_failures, safety_rates
from .scoring import PerplexityResult, Scorer, perplexity
from .speed import SpeedResult, measure_speed

log = logging.getLogger("tokenmill.evaluate")

_DTYPES = {name: canonical_dtype(name) for name in ("fp32", "float32", "bf16", "bfloat16")}  # candidates' dtypes


@dataclass
class CandidateSpec:
    """``int4``, ``int4:g64``, ``int8:lm_head``, ``none:bf16``, ``gguf:lm_head``, ``none:kv=int8`` ...;
    ``default``: what `tokenmill serve` runs with no flags on this machine (dtype and
    quantization ``auto``, engine/auto.py)."""

    label: str
    quantization: str = "none"
    group_size: int | None = None
    quantize_lm_head: bool | None = None
    dtype: str | None = None
    kv_cache_dtype: str | None = None  # the KV pool's (kv=int8, kv=fp8); None: auto

    @classmethod
    def parse(cls, text: str) -> "CandidateSpec":
        parts = [p.strip() for p in text.split(":") if p.strip()]
        if not parts:
            raise ValueError("empty candidate")
        spec = cls(label=text, quantization=parts[0].lower())
        if spec.quantization == "default":
            spec.quantization, spec.dtype = "auto", "auto"
        if spec.quantization in _DTYPES:  # "bf16" alone: the float model in another dtype
            spec.quantization, spec.dtype = "none", _DTYPES[parts[0].lower()]
        for opt in parts[1:]:
            low = opt.lower()
            if low in ("lm_head", "head"):
                spec.quantize_lm_head = True
            elif low in _DTYPES:
                spec.dtype = _DTYPES[low]
            elif low.startswith("g") and low[1:].isdigit():
                spec.group_size = int(low[1:])
            elif low.startswith("kv="):
                spec.kv_cache_dtype = low[3:]
            else:
                raise ValueError(f"candidate {text!r}: unknown option {opt!r} "
                                 "(use gNN, lm_head, bf16, fp32 or kv=int8|fp8)")
        from ..settings.config import QUANTIZATION_MODES as MODES

        if spec.quantization not in (*MODES, "auto"):
            raise ValueError(f"candidate {text!r}: quantization must be one of {', '.join(MODES)}")
        return spec


@dataclass
class EvalOptions:
    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    quant_group_size: int = 32
    quantize_lm_head: bool = False
    window: int = 512
    stride: int = 256
    max_text_tokens: int | None = None
    speed: bool = True
    decode_batches: tuple[int, ...] = (1,)
    decode_tokens: int = 32
    prefill_tokens: int = 256
    num_blocks: int | None = None
    max_batch_tokens: int = 1024
    threads: int | None = None  # torch threads after the engine starts (it takes every core)


@dataclass
class CandidateResult:
    label: str
    quantization: str
    dtype: str
    group_size: int | None
    quantize_lm_head: bool
    weight_bytes: int
    kv_blocks: int
    load_s: float
    quant_summary: str
    perplexity: PerplexityResult | None
    accuracy: float | None
    num_items: int
    items: list[ItemResult] = field(default_factory=list)
    speed: SpeedResult | None = None
    eval_s: float = 0.0
    # Over HTTP only (``tokenmill eval --url``): items scored by the server's tools / structured outputs.
    tool_call_accuracy: float | None = None  # percent of tool_call items right
    json_validity: float | None = None  # percent of json_schema items valid
    safety: SafetyRates | None = None  # refusals on the safety items (kept out of accuracy)


def task_accuracy(results: list[ItemResult]) -> tuple[float | None, int]:
    """Percent right and count of the task items: safety items are scored against the base instead."""
    tasks = [r for r in results if r.match != "safety"]
    return (100.0 * sum(r.correct for r in tasks) / len(tasks) if tasks else None), len(tasks)


@dataclass
class Comparison:
    label: str
    ppl_increase: float | None  # relative: 0.05 = +5%
    next_token_agreement: float | None  # same top-1 token as the base at each position of the text
    accuracy_drop: float | None  # percentage points: 2.0 = two points lower
    agreement: float | None  # fraction of items answered the same as the base
    token_agreement: float | None  # matching greedy prefix tokens / base tokens
    mean_first_divergence: float | None  # over items whose greedy tokens differ
    num_diverged: int
    weight_ratio: float
    decode_speedup: dict[int, float]
    prefill_speedup: float | None
    failures: list[str] = field(default_factory=list)
    tool_call_accuracy_drop: float | None = None  # percentage points
    json_validity_drop: float | None = None  # percentage points
    safety: SafetyChange | None = None  # refusal agreement, refusals lost, new over-refusals

    @property
    def passed(self) -> bool:
        return not self.failures


def engine_config(spec: CandidateSpec, opts: EvalOptions) -> EngineConfig:
    """The engine configuration of one candidate: KV blocks sized for what the eval runs."""
    dtype = spec.dtype or opts.dtype
    group = spec.group_size or opts.quant_group_size
    head = opts.quantize_lm_head if spec.quantize_lm_head is None else spec.quantize_lm_head
    need_tokens = max([opts.window, opts.prefill_tokens + 16, opts.max_batch_tokens,
                       max(opts.decode_batches) * (16 + opts.decode_tokens + 16)])
    num_blocks = opts.num_blocks or max(256, -(-need_tokens // 16) * 2)
    return EngineConfig.from_options(
        model=opts.model, dtype=dtype, device=opts.device, quantization=spec.quantization, quant_group_size=group,
        quantize_lm_head=head, num_blocks=num_blocks, enable_prefix_caching=False,
        kv_cache_dtype=spec.kv_cache_dtype or "auto",
        max_num_seqs=max(64, max(opts.decode_batches)))


def run_config(spec: CandidateSpec, opts: EvalOptions, loaded: Any, tokenizer: Any, text_ids: list[int] | None,
               items: list[EvalItem]) -> CandidateResult:
    config = engine_config(spec, opts)
    started = time.monotonic()
    engine = LLMEngine(config, loaded=loaded, tokenizer=tokenizer)
    # what the engine resolved ("auto" becomes this machine's choice)
    resolved = engine.config
    dtype, group, head = resolved.dtype, resolved.quant_group_size, resolved.quantize_lm_head
    quantization = str(resolved.quantization)
    if opts.threads:
        import torch

        torch.set_num_threads(opts.threads)
    load_s = time.monotonic() - started
    report = getattr(engine.model, "quant_report", None)  # set by quantize_model
    summary = report.summary() if report is not None else quantization
    try:
        started = time.monotonic()
        scorer = Scorer(engine, opts.max_batch_tokens)
        ppl = perplexity(scorer, text_ids, opts.window, opts.stride) if text_ids else None
        results = run_eval_set(engine, scorer, items) if items else []
        speed = (measure_speed(engine, text_ids or [], opts.decode_batches, opts.decode_tokens, opts.prefill_tokens)
                 if opts.speed else None)
        accuracy, num_items = task_accuracy(results)
        result = CandidateResult(
            label=spec.label, quantization=quantization, dtype=dtype,
            group_size=group if quantization == "int4" else 32 if quantization == "gguf" else None,
            quantize_lm_head=head, weight_bytes=engine.weight_bytes, kv_blocks=engine.stats.blocks_total,
            load_s=load_s, quant_summary=summary, perplexity=ppl, accuracy=accuracy, num_items=num_items,
            items=results, speed=speed, eval_s=time.monotonic() - started, safety=safety_rates(results))
        log.info("%s: weights %.1f MB, ppl %s, accuracy %s", spec.label, engine.weight_bytes / 1e6,
                 f"{ppl.perplexity:.3f}" if ppl else "-", f"{accuracy:.1f}%" if accuracy is not None else "-")
        return result
    finally:
        del engine
        gc.collect()


def compare(base: CandidateResult, cand: CandidateResult, max_ppl_increase: float | None,
            max_accuracy_drop: float | None, max_refusals_lost: float | None = None,
            max_new_over_refusals: int | None = None) -> Comparison:
    """The candidate against the base; ``max_refusals_lost`` is a rate per safety prompt (1/50)."""
    ppl_inc = None
    if base.perplexity and cand.perplexity:
        ppl_inc = cand.perplexity.perplexity / base.perplexity.perplexity - 1.0
    acc_drop = None
    if base.accuracy is not None and cand.accuracy is not None:
        acc_drop = base.accuracy - cand.accuracy
    same, tokens_same, tokens_base, divergences = 0, 0, 0, []
    pairs = [(b, c) for b, c in zip(base.items, cand.items) if b.match != "safety"]
    for b, c in pairs:
        if b.match == "choice":
            same += b.choice == c.choice
            continue
        same += b.token_ids == c.token_ids
        prefix = 0
        for x, y in zip(b.token_ids, c.token_ids):
            if x != y:
                break
            prefix += 1
        tokens_same += prefix
        tokens_base += len(b.token_ids)
        if b.token_ids != c.token_ids:
            divergences.append(prefix)
    decode_speedup: dict[int, float] = {}
    prefill_speedup = None
    if base.speed and cand.speed:
        decode_speedup = {k: cand.speed.decode_tps[k] / v for k, v in base.speed.decode_tps.items()
                          if v > 0 and k in cand.speed.decode_tps}
        if base.speed.prefill_tps > 0:
            prefill_speedup = cand.speed.prefill_tps / base.speed.prefill_tps
    top1 = None
    if base.perplexity and cand.perplexity and base.perplexity.top1 and \
            len(base.perplexity.top1) == len(cand.perplexity.top1):
        a, b = base.perplexity.top1, cand.perplexity.top1
        top1 = sum(x == y for x, y in zip(a, b)) / len(a)
    comp = Comparison(
        label=cand.label, ppl_increase=ppl_inc, next_token_agreement=top1, accuracy_drop=acc_drop,
        agreement=same / len(pairs) if pairs else None,
        token_agreement=tokens_same / tokens_base if tokens_base else None,
        mean_first_divergence=sum(divergences) / len(divergences) if divergences else None,
        num_diverged=len(divergences),
        weight_ratio=cand.weight_bytes / base.weight_bytes if base.weight_bytes else 1.0,
        decode_speedup=decode_speedup, prefill_speedup=prefill_speedup)
    if max_ppl_increase is not None and ppl_inc is not None and ppl_inc > max_ppl_increase:
        comp.failures.append(f"perplexity +{100 * ppl_inc:.2f}% > allowed +{100 * max_ppl_increase:g}%")
    if max_accuracy_drop is not None and acc_drop is not None and acc_drop > max_accuracy_drop:
        comp.failures.append(f"accuracy -{acc_drop:.1f}pt > allowed -{max_accuracy_drop:g}pt")
    if base.tool_call_accuracy is not None and cand.tool_call_accuracy is not None:
        comp.tool_call_accuracy_drop = base.tool_call_accuracy - cand.tool_call_accuracy
        if max_accuracy_drop is not None and comp.tool_call_accuracy_drop > max_accuracy_drop:
            comp.failures.append(f"tool-call accuracy -{comp.tool_call_accuracy_drop:.1f}pt > "
                                 f"allowed -{max_accuracy_drop:g}pt")
    if base.json_validity is not None and cand.json_validity is not None:
        comp.json_validity_drop = base.json_validity - cand.json_validity
        if max_accuracy_drop is not None and comp.json_validity_drop > max_accuracy_drop:
            comp.failures.append(f"JSON validity -{comp.json_validity_drop:.1f}pt > allowed -{max_accuracy_drop:g}pt")
    comp.safety = compare_safety(base.items, cand.items)
    comp.failures += safety_failures(comp.safety, max_refusals_lost, max_new_over_refusals)
    return comp


def parse_percent(text: str) -> float:
    """'5%' or '5' -> 0.05 (a relative increase)."""
    t = text.strip().rstrip("%").strip()
    try:
        return float(t) / 100.0
    except ValueError:
        raise ValueError(f"expected a percentage like 5%, got {text!r}") from None


def parse_points(text: str) -> float:
    """'2pt' or '2' -> 2.0 (percentage points)."""
    t = text.strip().lower()
    for suffix in ("points", "point", "pts", "pt", "pp"):
        if t.endswith(suffix):
            t = t[: -len(suffix)].strip()
            break
    try:
        return float(t)
    except ValueError:
        raise ValueError(f"expected percentage points like 2pt, got {text!r}") from None

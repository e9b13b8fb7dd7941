"""The engine over a quantized KV pool (``kv_cache_dtype="int8"`` / ``"fp8"``), tiny random model.

Greedy generation with preemption by recompute and the prefix cache on agrees with the
float32 pool (quantization may flip a near-tie, so agreement, not equality), frees every
block, and the fused decode step and the eager path (store + kernels per layer) agree;
the pool holds about twice the blocks of bf16 for the same budget; bad names are refused.
"""
from __future__ import annotations

import random

import pytest
import torch

from conftest import bundled_quality, make_tiny_llm, tiny_config
from tokenmill import SamplingParams
from tokenmill.engine.step.runner import num_blocks_for_budget
from tokenmill.model.quant import kv_quant

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(48)]  # three full blocks every third prompt shares
    out = []
    for i in range(24):
        own = [rng.randrange(256) for _ in range(rng.randint(2, 60))]
        out.append(shared + own if i % 3 == 0 else own)
    return out


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions where both agree, counting each sequence up to its first difference."""
    same = 0
    for x, y in zip(a, b):
        for s, t in zip(x, y):
            if s != t:
                break
            same += 1
    return same / sum(map(len, a))


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = make_tiny_llm()
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(3), SamplingParams(max_tokens=32, **GREEDY))]


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_quantized_pool_with_preemption_and_prefix_cache(kv, reference) -> None:
    prompts = _prompts(3)
    llm = make_tiny_llm(kv_cache_dtype=kv, num_blocks=24, max_num_batched_tokens=64)
    assert llm.engine.runner.kv_caches[0][0].dtype == kv_quant.QUANT_DTYPES[kv]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=32, **GREEDY))]
    assert llm.engine.total_preemptions > 0
    assert llm.engine.prefix_cache.stats.hit_tokens > 0
    llm.engine.check_idle_invariants()
    assert llm.engine.pool.num_in_use == 0
    # The random tiny model is all near-ties: e4m3's 3 mantissa bits flip some (bf16 compute
    # fares no better here); a broken pool would agree on almost nothing.
    assert _agreement(got, reference) >= (0.9 if kv == "int8" else 0.45)


def test_fused_step_and_eager_path_agree_on_int8(monkeypatch) -> None:
    prompts = _prompts(4)[:8]
    params = SamplingParams(max_tokens=24, **GREEDY)
    fused = make_tiny_llm(kv_cache_dtype="int8")
    assert fused.engine.runner.fused is not None
    a = [o.outputs[0].token_ids for o in fused.generate(prompts, params)]
    monkeypatch.setenv("TOKENMILL_FUSED_DECODE", "0")
    eager = make_tiny_llm(kv_cache_dtype="int8")
    b = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    assert _agreement(a, b) >= 0.98


@pytest.mark.parametrize("env", [("TOKENMILL_CPU_KERNELS", "0"), ("TOKENMILL_ATTENTION", "reference")],
                         ids=["torch-paged", "reference"])
def test_torch_backends_match_kernels(env, monkeypatch) -> None:
    """With the C kernels off (or the reference attention asked for), the torch store and
    the dequantizing gathers stand in."""
    prompts = _prompts(5)[:6]
    params = SamplingParams(max_tokens=16, **GREEDY)
    a = [o.outputs[0].token_ids for o in make_tiny_llm(kv_cache_dtype="int8").generate(prompts, params)]
    monkeypatch.setenv(*env)
    other = make_tiny_llm(kv_cache_dtype="int8")
    assert other.engine.runner.attention.name != "C kernels (paged, in place)"
    b = [o.outputs[0].token_ids for o in other.generate(prompts, params)]
    assert _agreement(a, b) >= 0.98


def test_budget_holds_about_twice_the_blocks_of_bf16() -> None:
    cfg = tiny_config(head_dim=64, num_key_value_heads=3, num_attention_heads=9, hidden_size=576)
    budget = 64 << 20
    bf16 = num_blocks_for_budget(cfg, 16, torch.bfloat16, budget)
    int8 = num_blocks_for_budget(cfg, 16, torch.int8, budget)
    f32 = num_blocks_for_budget(cfg, 16, torch.float32, budget)
    # scales: 8 bytes per block, layer and kv head next to 2 * 16 * 64 bytes of codes
    assert 1.98 * bf16 <= int8 <= 2 * bf16 and 3.96 * f32 <= int8 <= 4 * f32
    assert num_blocks_for_budget(cfg, 16, torch.float8_e4m3fn, budget) == int8


def test_kv_cache_dtype_names() -> None:
    assert kv_quant.resolve_kv_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_quant.resolve_kv_dtype("bf16", torch.bfloat16) == torch.bfloat16
    assert kv_quant.resolve_kv_dtype("INT8", torch.float32) == torch.int8
    assert kv_quant.resolve_kv_dtype("fp8", torch.float32) == torch.float8_e4m3fn
    assert kv_quant.resolve_kv_dtype("bfloat16", torch.float32) == torch.bfloat16  # widened when read
    with pytest.raises(ValueError, match="compute dtype"):
        kv_quant.resolve_kv_dtype("float16", torch.float32)
    with pytest.raises(ValueError, match="choose one of"):
        kv_quant.resolve_kv_dtype("int4", torch.float32)


# Quality bounds for int8 KV on the bundled model (docs/quantization.md has the full eval):
# perplexity of the bundled sample text at most this much higher than a float32 pool's,
# and the same top-1 next token at least this often.
INT8_MAX_PPL_INCREASE = 0.01
INT8_MIN_NEXT_TOKEN_AGREEMENT = 0.95


@pytest.mark.slow
def test_int8_kv_holds_the_bundled_models_quality(real_loaded, real_tokenizer) -> None:
    comp = bundled_quality(real_loaded, real_tokenizer, "none:kv=int8", INT8_MAX_PPL_INCREASE, max_tokens=2048)
    assert comp.ppl_increase <= INT8_MAX_PPL_INCREASE, comp
    assert comp.next_token_agreement >= INT8_MIN_NEXT_TOKEN_AGREEMENT, comp


@pytest.mark.parametrize("fused", ["1", "0"], ids=["fused-verify", "eager-verify"])
def test_speculative_verifies_write_into_an_int8_pool(fused, monkeypatch) -> None:
    """Proposals are stored and checked as several rows of one sequence in one step (the
    fused step gives rows sharing a block to one thread, in order); rejected rows are
    overwritten later. Greedy output stays that of the same pool without speculation."""
    monkeypatch.setenv("TOKENMILL_FUSED_DECODE", fused)
    rng = random.Random(8)
    prompts = []
    for _ in range(6):
        span = [rng.randrange(256) for _ in range(rng.randint(4, 9))]
        prompts.append([rng.randrange(256) for _ in range(5)] + span * 3 + span[:3])
    params = SamplingParams(max_tokens=24, **GREEDY)
    plain = make_tiny_llm(kv_cache_dtype="int8")
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    spec = make_tiny_llm(kv_cache_dtype="int8", speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    assert spec.engine.speculator.stats.num_draft_tokens > 0
    spec.engine.check_idle_invariants()
    # verify rows share one scale decision per block where plain decoding took one row at a
    # time, so a near-tie may flip; a broken store would agree on almost nothing
    assert _agreement(got, want) >= 0.9


def test_serve_flag_reaches_the_engine_config() -> None:
    from tokenmill.entrypoints.cli.main import build_parser
    from tokenmill.entrypoints.cli.serve_cli import finalize_serve_args
    from tokenmill.entrypoints.cli.serve_config import engine_config_from_args

    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"])
    assert finalize_serve_args(args) is None
    assert engine_config_from_args(args).cache.kv_cache_dtype == "fp8"

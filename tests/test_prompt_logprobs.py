"""Prompt logprobs through the engine step, on the tiny random Llama against transformers.

Each prompt token's logprob (and the top-N, and the actual token's rank)
equals transformers' float32 log_softmax of the same prompt within 1e-4,
whatever the prefix cache holds (cold, warm, off), however the prompt is
chunked, whatever shares the batch, and across preemption.
"""
from __future__ import annotations

import functools
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import make_tiny_llm
from tokenmill import SamplingParams

TOL = 1e-4


def _prompts(count: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def reference(model, prompt: list[int]) -> torch.Tensor:
    """[len-1, vocab] float32 log_softmax: row j-1 is the distribution of token j."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def assert_matches(entries, prompt: list[int], ref: torch.Tensor, top: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for j in range(1, len(prompt)):
        e, row = entries[j], ref[j - 1]
        assert e.token_id == prompt[j]
        assert abs(e.logprob - row[prompt[j]].item()) < TOL, (j, e.logprob, row[prompt[j]].item())
        assert e.rank == int((row > row[prompt[j]]).sum()) + 1 or abs(
            row.sort(descending=True).values[e.rank - 1].item() - e.logprob) < TOL  # a near-tie may swap
        ref_top = row.topk(top).indices.tolist() if top else []
        assert set(e.top) == set(ref_top) | {prompt[j]}
        for token, value in e.top.items():
            assert abs(value - row[token].item()) < TOL


def test_cold_warm_and_off_cache_give_the_reference_numbers(hf_tiny):
    prompt = _prompts(1, 150, 150, seed=11)[0]
    ref = reference(hf_tiny, prompt)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    cached = make_tiny_llm()
    cold = cached.generate([prompt], params)[0]
    assert cold.num_cached_tokens == 0
    # The cache now holds the prompt: a plain request hits it, a prompt-logprobs one recomputes.
    plain = cached.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert plain.num_cached_tokens >= 128
    warm = cached.generate([prompt], params)[0]
    assert warm.num_cached_tokens == 0
    off = make_tiny_llm(enable_prefix_caching=False).generate([prompt], params)[0]
    for out in (cold, warm, off):
        assert_matches(out.prompt_logprobs, prompt, ref, top=3)
        assert out.outputs[0].token_ids == cold.outputs[0].token_ids
    cached.engine.check_idle_invariants()


def test_chunked_and_batched_with_other_requests(hf_tiny):
    """A 16-token budget chunks every prompt; plain requests decode in the same steps."""
    llm = make_tiny_llm(max_num_batched_tokens=16)
    prompts = _prompts(6, 2, 70, seed=12)
    params = [SamplingParams(temperature=0.0, max_tokens=5, prompt_logprobs=2 if i % 2 else None,
                             ignore_eos=True) for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        if i % 2:
            assert_matches(out.prompt_logprobs, prompt, reference(hf_tiny, prompt), top=2)
        else:
            assert out.prompt_logprobs is None
        assert len(out.outputs[0].token_ids) == 5
    # Asking for prompt logprobs does not change what is generated.
    alone = make_tiny_llm().generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]


def test_max_tokens_zero_scores_without_generating(hf_tiny):
    llm = make_tiny_llm(max_num_batched_tokens=32)
    prompts = _prompts(3, 1, 90, seed=13) + [[5]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=0))
    for prompt, out in zip(prompts, outs):
        assert out.finished and out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
        if len(prompt) > 1:
            assert_matches(out.prompt_logprobs, prompt, reference(hf_tiny, prompt), top=0)
        else:
            assert out.prompt_logprobs == [None]
    scored = llm.score(prompts[:1])[0]
    assert len(scored) == len(prompts[0]) and scored[0] is None
    assert all(abs(a.logprob - b.logprob) < 1e-5 for a, b in zip(scored[1:], outs[0].prompt_logprobs[1:]))
    llm.engine.check_idle_invariants()
    assert llm.engine.pool.num_in_use == 0


def test_a_prompt_that_fills_the_context_can_be_scored():
    llm = make_tiny_llm(max_model_len=64)
    prompt = _prompts(1, 64, 64, seed=14)[0]
    assert len(llm.score([prompt])[0]) == 64
    with pytest.raises(ValueError):
        llm.generate([prompt], SamplingParams(max_tokens=1))


def test_preemption_keeps_prompt_logprobs_whole(hf_tiny):
    prompts = _prompts(12, 20, 80, seed=15)
    params = SamplingParams(temperature=0.0, max_tokens=24, prompt_logprobs=1, ignore_eos=True)
    small = make_tiny_llm(num_blocks=20, max_num_batched_tokens=48)
    outs = small.generate(prompts, params)
    assert small.engine.total_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert_matches(out.prompt_logprobs, prompt, reference(hf_tiny, prompt), top=1)
    small.engine.check_idle_invariants()


def test_n_sequences_each_carry_the_prompt_logprobs(hf_tiny):
    prompt = _prompts(1, 30, 30, seed=16)[0]
    llm = make_tiny_llm()
    out = llm.generate([prompt], SamplingParams(n=3, max_tokens=4, seed=1, prompt_logprobs=0))[0]
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 4 for c in out.outputs)
    assert_matches(out.prompt_logprobs, prompt, reference(hf_tiny, prompt), top=0)


@pytest.mark.parametrize("kwargs,message", [
    (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-1, prompt_logprobs=0), "max_tokens"),
])
def test_bad_parameters_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(budget=st.integers(1, 40), length=st.integers(2, 60), warm=st.booleans())
def test_numbers_do_not_depend_on_chunking_or_cache(budget: int, length: int, warm: bool):
    """Property: any token budget, a cold or warm cache: the same numbers as one shot."""
    prompt = _prompts(1, length, length, seed=length)[0]
    one_shot = _one_shot().score([prompt])[0]
    llm = make_tiny_llm(max_num_batched_tokens=budget, num_blocks=64)
    if warm:
        llm.generate([prompt], SamplingParams(max_tokens=1))
    got = llm.score([prompt])[0]
    assert len(got) == len(one_shot)
    for a, b in zip(got[1:], one_shot[1:]):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-5


@functools.lru_cache(maxsize=1)
def _one_shot():
    """One engine whose budget takes every prompt here in a single step."""
    return make_tiny_llm(max_num_batched_tokens=256)


def test_n_sequences_score_their_shared_prompt_once(monkeypatch):
    """Prompt logprobs with n=8: the prompt's rows are scored once (the first sequence; the
    others wait for it and then read its blocks from the prefix cache), every sequence
    gets the same list, equal to n=1's."""
    import tokenmill.engine.step.prompt_logprobs as module

    scored_rows: list[int] = []
    compute = module.compute

    def counting(model, hidden, plans):
        scored_rows.extend(p.count for p in plans)
        return compute(model, hidden, plans)

    monkeypatch.setattr(module, "compute", counting)
    llm = make_tiny_llm()
    prompt = _prompts(1, 60, 60, seed=11)[0]
    single = llm.generate([prompt], SamplingParams(max_tokens=3, prompt_logprobs=2, temperature=0.0))[0]
    assert sum(scored_rows) == len(prompt) - 1
    scored_rows.clear()
    many = llm.generate([prompt], SamplingParams(max_tokens=3, prompt_logprobs=2, temperature=0.8, n=8,
                                                 seed=5))[0]
    assert sum(scored_rows) == len(prompt) - 1, scored_rows  # once, not 8 times
    assert len(many.outputs) == 8 and len({tuple(o.token_ids) for o in many.outputs}) > 1
    for a, b in zip(single.prompt_logprobs[1:], many.prompt_logprobs[1:]):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < TOL
    engine = llm.engine
    assert engine.pool.usage == 0 or not engine.has_unfinished()

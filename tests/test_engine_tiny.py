"""Engine behaviour on a tiny random Llama: parity with transformers, batching,
preemption, sampling parameters, stop conditions, abort, batching policies."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import TINY_EOS, make_tiny_llm
from tokenmill import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _random_prompts(count: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


@pytest.fixture(scope="module")
def llm():
    return make_tiny_llm()


def test_tiny_matches_transformers_tokens_and_logits(llm, hf_tiny):
    prompts = _random_prompts(6, 3, 120, seed=1)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, **GREEDY))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ids = torch.tensor([prompt])
            ref = hf_tiny.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                                   do_sample=False)[0, len(prompt):]
        assert out.outputs[0].token_ids == ref.tolist()
    # Logits of the last prompt position.
    prompt = prompts[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=1, logprobs=5, **GREEDY))[0]
    with torch.no_grad():
        ref_lp = torch.log_softmax(hf_tiny(torch.tensor([prompt])).logits[0, -1].float(), -1)
    lp = out.outputs[0].logprobs[0]
    for token_id, value in lp.top.items():
        assert abs(value - ref_lp[token_id].item()) < 1e-4


def test_batch_invariance_and_preemption():
    prompts = _random_prompts(32, 2, 90, seed=2)
    params = SamplingParams(max_tokens=40, **GREEDY)
    alone = [make_tiny_llm().generate([p], params)[0].outputs[0].token_ids for p in prompts[:6]]
    big = make_tiny_llm()
    batched = [o.outputs[0].token_ids for o in big.generate(prompts, params)]
    assert batched[:6] == alone
    # A pool far smaller than the batch's demand forces preemption by recompute.
    small = make_tiny_llm(num_blocks=24, max_num_batched_tokens=64)
    squeezed = [o.outputs[0].token_ids for o in small.generate(prompts, params)]
    assert small.engine.total_preemptions > 0
    assert squeezed == batched
    small.engine.check_idle_invariants()
    assert small.engine.pool.num_in_use == 0


def test_chunked_prefill_equals_one_shot():
    prompt = _random_prompts(1, 300, 300, seed=3)[0]
    params = SamplingParams(max_tokens=16, **GREEDY)
    one_shot = make_tiny_llm(max_num_batched_tokens=512).generate([prompt], params)[0].outputs[0].token_ids
    chunked_llm = make_tiny_llm(max_num_batched_tokens=37)
    chunked = chunked_llm.generate([prompt], params)[0].outputs[0].token_ids
    assert chunked == one_shot


def test_long_prefill_does_not_stall_decodes():
    llm = make_tiny_llm(max_num_batched_tokens=32, enable_prefix_caching=False)
    engine = llm.engine
    engine.add_request("short", [1, 2, 3], SamplingParams(max_tokens=50, **GREEDY))
    engine.step()  # short prefilled
    engine.add_request("long", list(range(200)), SamplingParams(max_tokens=2, **GREEDY))
    decoded_steps = 0
    for _ in range(8):
        deltas = engine.step()
        decoded_steps += any(d.request_id == "short" and d.token_ids for d in deltas)
    assert decoded_steps == 8  # the short request got a token every step while the long one prefilled


def test_seeded_sampling_independent_of_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    prompt = [5, 6, 7, 8]
    alone = llm.generate([prompt], params)[0].outputs[0].token_ids
    others = _random_prompts(7, 3, 30, seed=4)
    mixed = llm.generate(others[:3] + [prompt] + others[3:],
                         [SamplingParams(temperature=0.8, max_tokens=20)] * 3 + [params]
                         + [SamplingParams(temperature=0.8, max_tokens=20)] * 4)
    assert mixed[3].outputs[0].token_ids == alone
    different = llm.generate([prompt], SamplingParams(temperature=1.0, seed=99, max_tokens=20, ignore_eos=True))
    assert different[0].outputs[0].token_ids != alone


def test_top_k_one_is_greedy_and_min_p_one_is_greedy(llm):
    prompt = [10, 20, 30]
    greedy = llm.generate([prompt], SamplingParams(max_tokens=12, **GREEDY))[0].outputs[0].token_ids
    topk = llm.generate([prompt], SamplingParams(temperature=1.5, top_k=1, max_tokens=12, ignore_eos=True))
    minp = llm.generate([prompt], SamplingParams(temperature=1.5, min_p=1.0, max_tokens=12, ignore_eos=True))
    assert topk[0].outputs[0].token_ids == greedy
    assert minp[0].outputs[0].token_ids == greedy


def test_penalties_change_repetition(llm):
    prompt = [65] * 20
    plain = llm.generate([prompt], SamplingParams(max_tokens=30, **GREEDY))[0].outputs[0].token_ids
    penal = llm.generate([prompt], SamplingParams(max_tokens=30, frequency_penalty=2.0, presence_penalty=2.0,
                                                  repetition_penalty=1.5, **GREEDY))[0].outputs[0].token_ids
    assert len(set(penal)) > len(set(plain))


def test_logprobs_are_normalised_and_chosen_token_included(llm):
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, logprobs=3, **GREEDY))[0].outputs[0]
    assert len(out.logprobs) == 5
    for token, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == token and token in lp.top
        assert lp.logprob <= 0 and max(lp.top.values()) == pytest.approx(lp.logprob)  # greedy: chosen is best


def test_max_tokens_eos_and_stop_token_ids():
    llm = make_tiny_llm()
    prompt = [3, 4, 5]
    free = llm.generate([prompt], SamplingParams(max_tokens=30, **GREEDY))[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 30
    stop_tok = free.token_ids[7]
    first = free.token_ids.index(stop_tok)
    stopped = llm.generate([prompt], SamplingParams(max_tokens=30, stop_token_ids=[stop_tok], **GREEDY))[0]
    assert stopped.outputs[0].token_ids == free.token_ids[: first + 1]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == stop_tok
    # min_tokens suppresses the stop token until reached.
    late = llm.generate([prompt], SamplingParams(max_tokens=30, min_tokens=first + 3, stop_token_ids=[stop_tok],
                                                 **GREEDY))[0].outputs[0]
    assert len(late.token_ids) >= first + 3


def test_eos_stops_unless_ignored():
    llm = make_tiny_llm(model_overrides={}, weights_seed=5)
    # Make EOS overwhelmingly likely by biasing the lm_head row of EOS.
    with torch.no_grad():
        llm.engine.model.lm_head.weight[TINY_EOS] *= 0
        llm.engine.model.lm_head.weight[TINY_EOS] += llm.engine.model.norm.weight * 5
    out = llm.generate([[1, 2]], SamplingParams(max_tokens=10, temperature=0.0))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == TINY_EOS and len(out.token_ids) < 10
    ign = llm.generate([[1, 2]], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0].outputs[0]
    assert ign.finish_reason == "length" and len(ign.token_ids) == 10


def test_stop_string_spanning_tokens_is_not_emitted(llm):
    free = llm.generate(["abc"], SamplingParams(max_tokens=40, **GREEDY))[0].outputs[0]
    text = free.text
    assert len(text) > 8
    stop = text[4:7]  # three bytes -> spans at least three tokens in the byte tokenizer
    out = llm.generate(["abc"], SamplingParams(max_tokens=40, stop=[stop], **GREEDY))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]


def test_n_completions_and_abort():
    llm = make_tiny_llm()
    out = llm.generate([[1, 2, 3]], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    engine = llm.engine
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=100, **GREEDY))
    engine.add_request("b", [4, 5, 6], SamplingParams(max_tokens=100, **GREEDY))
    engine.step()
    engine.step()
    assert engine.abort_request("a") and not engine.abort_request("a")  # idempotent
    while engine.has_unfinished():
        engine.step()
    engine.check_idle_invariants()


def test_bad_requests_are_rejected_without_leaking():
    llm = make_tiny_llm(max_model_len=64)
    engine = llm.engine
    with pytest.raises(ValueError, match="exceeds the context length 64"):
        engine.add_request("x", list(range(60)), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("y", [], SamplingParams())
    with pytest.raises(ValueError):
        engine.add_request("z", [100000], SamplingParams())
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    assert not engine.has_unfinished()
    engine.check_idle_invariants()


@pytest.mark.parametrize("policy", ["static", "dynamic"])
def test_group_batching_policies_run_groups_to_completion(policy):
    llm = make_tiny_llm(batching=policy, max_num_seqs=4, dynamic_window_s=0.0)
    engine = llm.engine
    for i in range(6):
        engine.add_request(f"r{i}", [i + 1, 2, 3], SamplingParams(max_tokens=5 + 10 * (i == 0), **GREEDY))
    engine.step()
    assert {r.request_id for r in engine.scheduler.running} == {f"r{i}#0" for i in range(4)}
    # Short members finish; r4/r5 must wait for r0 (the long one) although slots are free.
    for _ in range(8):
        engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["r0#0"]
    assert len(engine.scheduler.waiting) == 2
    while engine.has_unfinished():
        engine.step()


def test_continuous_policy_admits_as_slots_free():
    llm = make_tiny_llm(max_num_seqs=4)
    engine = llm.engine
    for i in range(6):
        engine.add_request(f"r{i}", [i + 1, 2, 3], SamplingParams(max_tokens=5 + 10 * (i == 0), **GREEDY))
    for _ in range(9):
        engine.step()
    running = {r.request_id for r in engine.scheduler.running}
    assert "r0#0" in running and ("r4#0" in running or "r5#0" in running)


def test_bfloat16_runs_and_mostly_agrees():
    prompts = _random_prompts(4, 5, 40, seed=6)
    params = SamplingParams(max_tokens=16, **GREEDY)
    fp32 = [o.outputs[0].token_ids for o in make_tiny_llm().generate(prompts, params)]
    bf16 = [o.outputs[0].token_ids for o in make_tiny_llm(dtype="bfloat16").generate(prompts, params)]
    agree = sum(a == b for x, y in zip(fp32, bf16) for a, b in zip(x, y)) / sum(map(len, fp32))
    assert agree >= 0.5


def test_prefix_cache_never_changes_outputs_with_hits_partial_hits_and_evictions():
    rng = random.Random(11)
    docs = [[rng.randrange(256) for _ in range(70)] for _ in range(4)]
    prompts = []
    for i in range(24):  # full repeats, shared doc + own question, and a doc prefix cut mid-block
        doc = docs[i % 4]
        tail = [rng.randrange(256) for _ in range(rng.randint(1, 20))]
        prompts.append(doc if i % 5 == 0 else (doc[: 40 + i] + tail if i % 3 == 0 else doc + tail))
    params = SamplingParams(max_tokens=12, **GREEDY)
    off = make_tiny_llm(enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in off.generate(prompts, params)]
    # A pool of 40 blocks holds about two documents: later waves evict earlier ones.
    on = make_tiny_llm(num_blocks=40, max_num_seqs=4)
    got = []
    for wave in range(0, 24, 4):
        got += [o.outputs[0].token_ids for o in on.generate(prompts[wave : wave + 4], params)]
        on.engine.check_idle_invariants()
    assert got == expected
    stats = on.engine.prefix_cache.stats
    assert stats.hit_tokens > 0.3 * stats.queried_tokens
    assert stats.evicted_blocks > 0
    assert on.engine.pool.num_cached_idle <= 40
    freed = on.engine.reset_prefix_cache()
    assert freed > 0 and on.engine.pool.num_free == 40


def test_w8a8_tokens_do_not_depend_on_what_shares_the_steps():
    """w8a8 with VNNI: prompts decoded together (batched, mixed with other prompts' chunks,
    fused and eager steps) give the same greedy tokens and log-probabilities as each prompt
    alone. Without VNNI
    the activation rounding differs between batch sizes and paths."""
    from tokenmill.model.kernels import cpu_kernels

    lib = cpu_kernels.load()
    if lib is None or not lib.int8_dot:
        pytest.skip("8-bit activations at every batch size need the VNNI kernels")
    rng = random.Random(11)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 90))] for _ in range(12)]
    params = SamplingParams(max_tokens=24, logprobs=0, **GREEDY)
    llm = make_tiny_llm(quantization="w8a8", max_num_batched_tokens=64, max_num_seqs=12,
                        model_overrides={"num_hidden_layers": 4})  # two w8a8 layers before the last two

    def tokens_and_logprobs(outs: list) -> list[tuple[list[int], list[float]]]:
        return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]

    together = tokens_and_logprobs(llm.generate(prompts, params))
    alone = [tokens_and_logprobs(llm.generate([p], params))[0] for p in prompts]
    assert together == alone  # the log-probabilities too, exactly: nothing of the batch leaks in


@pytest.mark.parametrize("budget", [64, 512])
def test_burst_sharing_a_prefix_matches_one_by_one_and_computes_it_once(budget: int):
    """A burst behind one document: greedy text equals the same prompts sent one at a
    time with no prefix cache, and the shared blocks are computed once. With 512
    tokens a step, the whole burst's prompts run in one step: the waiters read blocks
    their producer writes in that same step."""
    rng = random.Random(5)
    doc = [rng.randrange(256) for _ in range(200)]
    prompts = [doc + [rng.randrange(256) for _ in range(rng.randint(3, 20))] for _ in range(8)]
    params = SamplingParams(max_tokens=6, **GREEDY)
    alone = make_tiny_llm(enable_prefix_caching=False)
    expected = [alone.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    burst = make_tiny_llm(max_num_batched_tokens=budget, max_num_seqs=8)
    got = [o.outputs[0].token_ids for o in burst.generate(prompts, params)]
    if budget == 512:
        assert burst.engine.stats.steps == params.max_tokens  # the prompts took one step
    assert got == expected
    own = sum(len(p) - len(doc) for p in prompts)
    computed = burst.engine.scheduler.num_prompt_tokens_computed
    assert computed <= len(doc) + own + 8 * 16, computed  # at most a partial block again per request
    burst.engine.check_idle_invariants()

"""The bundled SmolLM2 against transformers (the reference), fp32 greedy.

Same weights (the GGUF dequantized by both), same tokens, 64 new tokens per
prompt; prompt-last-position logits within 1e-3. Then batch invariance (alone
vs a batch of 32 vs a pool so small that preemption happens), prefix cache on
vs off, and bfloat16 agreement.
"""
from __future__ import annotations

import os

import pytest
import torch

from conftest import prompt_last_logits
from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow

LONG_TEXT = (
    "The history of the lighthouse begins with fires lit on hilltops to guide ships home. "
    "Over centuries these fires became towers, the towers grew lenses, and the lenses turned "
    "by clockwork so that each light could be told apart by its rhythm. Keepers lived in small "
    "houses at the foot of the towers, trimming wicks, polishing brass and writing in logbooks "
    "the weather of every night. Storms could cut them off for weeks. Supply boats brought oil, "
    "flour and letters when the sea allowed. Today most lights run on their own, watched from "
    "far away, but the old logbooks remain: page after page of wind directions, passing ships, "
    "broken panes and the small events of isolated lives. "
) * 4

RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "List three colors of the rainbow:\n1.",
    LONG_TEXT + "\nSummary of the text above:",
]
CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Explain photosynthesis in one sentence."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": LONG_TEXT + "\nWhat did lighthouse keepers write in their logbooks?"}],
]


@pytest.fixture(scope="module")
def llm(real_loaded, real_tokenizer):
    return LLM(loaded_model=real_loaded, tokenizer=real_tokenizer, dtype="float32",
               kv_cache_memory="512MiB")


@pytest.fixture(scope="module")
def prompt_ids(real_tokenizer) -> list[list[int]]:
    ids = [real_tokenizer.encode(p) for p in RAW_PROMPTS]
    ids += [real_tokenizer.encode(real_tokenizer.apply_chat_template(m), add_special_tokens=False)
            for m in CHAT_PROMPTS]
    assert max(map(len, ids)) >= 450
    return ids


@pytest.fixture(scope="module")
def reference(bundled_model_path):
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(bundled_model_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32,
        quantization_config=transformers.GgufConfig(gguf_file=name, dequantize=True))
    model.eval()
    model.generation_config.eos_token_id = None  # 64 tokens each, as ignore_eos
    model.generation_config.pad_token_id = 0
    return model


GREEDY_64 = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def ours(llm, prompt_ids):
    return llm.generate(prompt_ids, GREEDY_64)


def test_greedy_tokens_equal_transformers(ours, prompt_ids, reference):
    mismatches = []
    for i, (ids, out) in enumerate(zip(prompt_ids, ours)):
        x = torch.tensor([ids])
        with torch.no_grad():
            ref = reference.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=64, do_sample=False)
        if ref[0, len(ids):].tolist() != out.outputs[0].token_ids:
            mismatches.append(i)
    assert not mismatches, f"prompts {mismatches} differ from transformers"


def test_last_position_logits_match(llm, prompt_ids, reference):
    for ids in prompt_ids:
        with torch.no_grad():
            ref = reference(torch.tensor([ids])).logits[0, -1].float()
        assert (prompt_last_logits(llm.engine, ids) - ref).abs().max().item() < 1e-3
    llm.engine.check_idle_invariants()


def test_batch_of_32_and_preemption_give_identical_output(real_loaded, real_tokenizer, ours, prompt_ids):
    # 32 requests of mixed lengths: the 8 prompts plus 24 fillers of other lengths.
    fillers = [real_tokenizer.encode(f"Item {i}: " + "word " * (5 + 13 * i)) for i in range(24)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    batch = LLM(loaded_model=real_loaded, tokenizer=real_tokenizer, kv_cache_memory="512MiB",
                max_num_seqs=32).generate(prompt_ids + fillers, params)
    alone = [o.outputs[0].token_ids for o in ours]
    assert [o.outputs[0].token_ids for o in batch[:8]] == alone
    # A pool too small for the batch forces preemption by recompute. Greedy outputs are
    # prefix-consistent, so 32 tokens of 12 requests are compared with the batch's first 32.
    tiny_pool = LLM(loaded_model=real_loaded, tokenizer=real_tokenizer, num_blocks=52,
                    max_num_seqs=12, enable_prefix_caching=False)
    squeezed = tiny_pool.generate(prompt_ids + fillers[:4], SamplingParams(temperature=0.0, max_tokens=32,
                                                                           ignore_eos=True))
    assert tiny_pool.engine.total_preemptions > 0
    assert [o.outputs[0].token_ids for o in squeezed] == [o.outputs[0].token_ids[:32] for o in batch[:12]]
    tiny_pool.engine.check_idle_invariants()


def test_prefix_cache_on_equals_off(real_loaded, real_tokenizer):
    system = LONG_TEXT
    questions = ["Who lived at the foot of the towers?", "What did supply boats bring?",
                 "How are lights run today?", "What could storms do?"]
    msgs = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    on = LLM(loaded_model=real_loaded, tokenizer=real_tokenizer, kv_cache_memory="256MiB")
    off = LLM(loaded_model=real_loaded, tokenizer=real_tokenizer, kv_cache_memory="256MiB",
              enable_prefix_caching=False)
    first = on.chat(msgs[:1], params)  # warms the cache with the shared system prompt
    hits = on.chat(msgs, params)
    assert all(o.num_cached_tokens >= 400 for o in hits)
    assert first[0].outputs[0].token_ids == hits[0].outputs[0].token_ids
    assert [o.outputs[0].token_ids for o in hits] == [o.outputs[0].token_ids for o in off.chat(msgs, params)]
    on.engine.check_idle_invariants()


def _all_position_argmax(llm: LLM, token_ids: list[int]) -> list[int]:
    """Greedy choice at every position of one teacher-forced forward pass."""
    from tokenmill.engine.request import Request

    engine = llm.engine
    req = Request("forced", token_ids, SamplingParams(max_tokens=1), max_tokens=1)
    req.block_table = engine.pool.allocate(-(-len(token_ids) // engine.block_size))
    try:
        inputs = engine.runner.prepare([(req, len(token_ids))])
        with torch.inference_mode():
            hidden = engine.model(inputs.input_ids, inputs.positions, engine.runner.kv_caches, inputs.attn)
            return engine.model.compute_logits(hidden).argmax(-1).tolist()
    finally:
        engine.pool.release(req.block_table)


def test_bfloat16_agrees_with_float32(real_tokenizer, bundled_model_path, ours, prompt_ids):
    """bf16 picks fp32's greedy token at >= 90% of positions (teacher-forced on the fp32
    continuation, so one early near-tie does not shift every later comparison)."""
    from tokenmill.model.loader import load_model

    bf16 = LLM(loaded_model=load_model(bundled_model_path, dtype=torch.bfloat16), tokenizer=real_tokenizer,
               dtype="bfloat16", kv_cache_memory="256MiB")
    same = total = 0
    for ids, out in zip(prompt_ids, ours):
        continuation = out.outputs[0].token_ids
        choices = _all_position_argmax(bf16, ids + continuation)[len(ids) - 1 : -1]
        same += sum(a == b for a, b in zip(choices, continuation))
        total += len(continuation)
    rate = same / total
    print(f"bf16 vs fp32 greedy token agreement (teacher-forced): {rate:.3f} over {total} tokens")
    assert rate >= 0.9
    bf16.engine.check_idle_invariants()


def test_prompt_logprobs_equal_transformers_cold_warm_and_off(real_loaded, real_tokenizer, prompt_ids, reference):
    """Every prompt token's logprob (and the top-2) within 1e-4 of transformers' float32
    log_softmax, with the prefix cache cold, warm (the prompts cached by plain requests),
    and off with a 64-token budget (the long prompts in chunks, batched together)."""
    prompts = [prompt_ids[0], prompt_ids[3]]
    refs = []
    with torch.no_grad():
        for ids in prompts:
            refs.append(torch.log_softmax(reference(torch.tensor([ids])).logits[0, :-1].float(), dim=-1))
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    cached = LLM(loaded_model=real_loaded, tokenizer=real_tokenizer, kv_cache_memory="256MiB")
    cold = cached.generate(prompts, params)
    plain = cached.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1))
    assert plain[1].num_cached_tokens >= 400  # the cache holds the long prompt now
    warm = cached.generate(prompts, params)
    off = LLM(loaded_model=real_loaded, tokenizer=real_tokenizer, kv_cache_memory="256MiB",
              enable_prefix_caching=False, max_num_batched_tokens=64).generate(prompts, params)
    for name, outs in (("cold", cold), ("warm", warm), ("off", off)):
        for ids, ref, out in zip(prompts, refs, outs):
            entries = out.prompt_logprobs
            assert len(entries) == len(ids) and entries[0] is None
            worst = 0.0
            for j in range(1, len(ids)):
                row = ref[j - 1]
                assert set(entries[j].top) == set(row.topk(2).indices.tolist()) | {ids[j]}
                for token, value in entries[j].top.items():
                    worst = max(worst, abs(value - row[token].item()))
            assert worst < 1e-4, (name, len(ids), worst)
    cached.engine.check_idle_invariants()

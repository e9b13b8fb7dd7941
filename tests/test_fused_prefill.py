"""Steps with prefill chunks through the fused native step (``FusedPrefillExecutor``)
against the eager model: the same rows, logits and K/V.

The fused step attends a chunk with the prefill kernel the eager attention backend
calls, and its other ops are the kernels the eager CPU model runs; so with w8a8 on a
build with integer products (8-bit activations at every row count) a chunk comes out
bit for bit as in the eager model, and a request's tokens do not depend on which
executor ran its prefill."""
from __future__ import annotations

import pytest
import torch

from conftest import tiny_loaded
from test_fused_decode import _engine, _prompts, _rel, _requests
from tokenmill.engine.step.executors import FusedPrefillExecutor, fused_step_inputs
from tokenmill.engine.step.step_batch import StepBatch
from tokenmill.engine.request import Request, SamplingParams
from tokenmill.model.kernels import cpu_kernels
from tokenmill.settings.options import KernelOptions

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler for the CPU kernels")


def _prefill_executor(engine) -> FusedPrefillExecutor:
    """The engine's fused prefill executor; for dense layers, which the runner leaves
    eager, one made here on its fused decoder (the step takes them all the same)."""
    found = [e for e in engine.runner.executors if isinstance(e, FusedPrefillExecutor)]
    if not found:
        assert not engine.runner.fused.prefill_on_kernels
        return FusedPrefillExecutor(engine.runner.model, engine.runner.lora, engine.runner.fused)
    return found[0]


def _pool_rows(engine, reqs: list[Request], upto: list[int]) -> torch.Tensor:
    """Every layer's K and V rows at positions 0 .. upto - 1 of each request."""
    bs = engine.block_size
    out = []
    for k, v in engine.runner.kv_caches:
        for r, n in zip(reqs, upto):
            for p in range(n):
                block, off = r.block_table[p // bs], p % bs
                out += [k[:, block, off].float(), v[:, block, off].float()]
    return torch.stack(out)


def _step_both_ways(engine, items):
    """(fused logits, fused pool rows, eager logits, eager pool rows) of one step; both
    write the same slots, so the pool is read after each."""
    reqs = [r for r, _ in items]
    upto = [r.num_computed_tokens + n for r, n in items]
    executor = _prefill_executor(engine)
    batch = StepBatch.build(items)
    assert executor.accepts(batch)
    got, got_sampled = executor.run(batch)
    got_kv = _pool_rows(engine, reqs, upto)
    want, want_sampled = engine.runner.run_eager(items)
    assert got_sampled == want_sampled
    return got, got_kv, want, _pool_rows(engine, reqs, upto)


def _mixed_items(engine, seed: int) -> list[tuple[Request, int]]:
    """Three decodes, a whole prompt, and a prompt's second chunk after its first (which
    the eager model ran): every kind of row a step can hold."""
    prompts = _prompts(5, seed=seed)
    reqs = _requests(engine, prompts)
    decodes, whole, chunked = reqs[:3], reqs[3], reqs[4]
    engine.runner.run_eager([(r, len(r.prompt_token_ids) - 1) for r in decodes])
    for r in decodes:
        r.num_computed_tokens = len(r.prompt_token_ids) - 1
    half = len(chunked.prompt_token_ids) // 2
    engine.runner.run_eager([(chunked, half)])
    chunked.num_computed_tokens = half
    return [(r, 1) for r in decodes] + [(whole, len(whole.prompt_token_ids)),
                                        (chunked, len(chunked.prompt_token_ids) - half)]


@pytest.mark.parametrize("kv", ["auto", "bfloat16"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_w8a8_prefill_chunks_match_the_eager_model_bit_for_bit(seed: int, kv: str) -> None:
    engine = _engine(tiny_loaded(seed=4, num_hidden_layers=4), dtype="float32", quantization="w8a8",
                     kv_cache_dtype=kv)
    items = _mixed_items(engine, 40 + seed)
    got, got_kv, want, want_kv = _step_both_ways(engine, items)
    assert got.shape == (5, engine.model_config.vocab_size)  # decodes and the prompts that reach their end
    if cpu_kernels.load().int8_dot:
        assert torch.equal(got, want) and torch.equal(got_kv, want_kv)
    else:  # the eager layers round activations differently from the fused step without integer products
        assert _rel(got, want) < 5e-2 and torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("kv", ["auto", "bfloat16"])
def test_float32_prefill_chunks_match_the_eager_model(kv: str) -> None:
    """Float32 weights: the eager linears are torch's (oneDNN), the fused step's the C
    tiles, so the two agree to float rounding; the pool rows the chunk wrote too."""
    engine = _engine(tiny_loaded(seed=3), dtype="float32", kv_cache_dtype=kv)
    got, got_kv, want, want_kv = _step_both_ways(engine, _mixed_items(engine, 7))
    assert _rel(got, want) < 1e-4 and torch.equal(got.argmax(-1), want.argmax(-1))
    assert _rel(got_kv, want_kv) < (1e-4 if kv == "auto" else 1e-2)


def test_only_sampled_rows_get_logits_and_unfinished_chunks_none() -> None:
    engine = _engine(tiny_loaded(seed=5, num_hidden_layers=2), dtype="float32", quantization="w8a8")
    reqs = _requests(engine, [[3] * 40, [4] * 30])
    items = [(reqs[0], 20), (reqs[1], 30)]  # the first stops short of its prompt's end
    ids, tables, seq_lens, chunks, rows, sampled = fused_step_inputs(StepBatch.build(items))
    assert chunks.tolist() == [[0, 20], [20, 30]] and rows.tolist() == [49] and sampled == [reqs[1]]
    assert seq_lens.tolist() == list(range(1, 21)) + list(range(1, 31)) and tables.shape[0] == 50
    logits, sampled = _prefill_executor(engine).run(StepBatch.build(items))
    assert logits.shape == (1, engine.model_config.vocab_size) and sampled == [reqs[1]]
    none, nobody = _prefill_executor(engine).run(StepBatch.build([(reqs[0], 20)]))
    assert none.shape == (0, engine.model_config.vocab_size) and nobody == []


def test_the_decoder_refuses_chunks_that_are_not_one_sequence() -> None:
    engine = _engine(tiny_loaded(seed=5, num_hidden_layers=2), dtype="float32", quantization="w8a8")
    reqs = _requests(engine, [[3] * 20, [4] * 20])
    items = [(reqs[0], 20), (reqs[1], 20)]
    ids, tables, seq_lens, chunks, rows, sampled = fused_step_inputs(StepBatch.build(items))
    emb = engine.model.embed_tokens(torch.tensor(ids)).float().contiguous()
    before = [k.clone() for k, _ in engine.runner.kv_caches]
    decoder = engine.runner.fused
    for bad in ([[0, 21]], [[0, 20], [10, 20]], [[0, 41]], [[5, 0]]):  # across two sequences, overlapping, past B
        with pytest.raises(ValueError, match="chunk"):
            decoder.run(emb.clone(), tables, seq_lens, torch.tensor(bad, dtype=torch.int32), rows)
    with pytest.raises(ValueError, match="outside"):
        decoder.run(emb.clone(), tables, seq_lens, chunks, torch.tensor([40], dtype=torch.int32))
    assert all(torch.equal(a, k) for a, (k, _) in zip(before, engine.runner.kv_caches))


def test_prompt_logprobs_quantized_pools_and_dense_layers_keep_the_eager_prefill() -> None:
    engine = _engine(tiny_loaded(seed=5, num_hidden_layers=2), dtype="float32", quantization="w8a8")
    req = Request("p", [5] * 20, SamplingParams(max_tokens=2, prompt_logprobs=1))
    assert not _prefill_executor(engine).accepts(StepBatch.build([(req, 20)]))
    assert [e.name for e in engine.runner.executors] == ["fused CPU decode", "fused CPU prefill", "eager"]
    quantized = _engine(tiny_loaded(seed=5, num_hidden_layers=2), dtype="float32", quantization="w8a8",
                        kv_cache_dtype="int8")
    assert not any(isinstance(e, FusedPrefillExecutor) for e in quantized.runner.executors)
    off = _engine(tiny_loaded(seed=5, num_hidden_layers=2), dtype="float32", quantization="w8a8",
                  kernel_options=KernelOptions(fused_prefill=False))
    assert [e.name for e in off.runner.executors] == ["fused CPU decode", "eager"]
    dense = _engine(tiny_loaded(seed=5, num_hidden_layers=2), dtype="float32")  # torch's matmuls stay eager
    assert dense.runner.fused is not None and not dense.runner.fused.prefill_on_kernels
    assert [e.name for e in dense.runner.executors] == ["fused CPU decode", "eager"]


def executed_prefill(engine) -> bool:
    """Whether the engine has a fused prefill executor (so its prompts went through it)."""
    return any(isinstance(e, FusedPrefillExecutor) for e in engine.runner.executors)


def test_greedy_tokens_are_the_same_with_and_without_the_fused_prefill() -> None:
    """Whole requests through the engine, prompts long enough to take several chunks."""
    results = []
    for fused in (True, False):
        engine = _engine(tiny_loaded(seed=6, num_hidden_layers=3), dtype="float32", quantization="w8a8",
                         num_blocks=128, max_num_batched_tokens=48,
                         kernel_options=KernelOptions(fused_prefill=fused))
        for i, ids in enumerate(_prompts(6, seed=11)):
            engine.add_request(f"r{i}", ids, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        done: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for delta in engine.step():
                done.setdefault(delta.request_id, []).extend(delta.token_ids)
        assert executed_prefill(engine) == fused
        results.append(done)
    if cpu_kernels.load().int8_dot:
        assert results[0] == results[1]
    else:
        same = sum(results[0][k] == results[1][k] for k in results[0])
        assert same >= 4

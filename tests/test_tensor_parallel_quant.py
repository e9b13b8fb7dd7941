"""Tensor parallelism with quantized weights: how GGUF blocks split (fast, in-process),
sizes that would cut a quantization group (fast, refused before any process starts),
and two real ranks on gloo against one with the same quantization (slow).

Parity: the tiny random Llama in float32, one thread per rank, written as a GGUF
file with tied embeddings, so each rank reads its own blocks and, with the LM head
quantized, looks tokens up in its share of the quantized head. Steps stay under 64
tokens: the int4 C kernel's float32 activations (larger steps dequantize into bf16
on CPUs that multiply it natively). The row-parallel all-reduce adds two partial
sums where one rank adds all the columns at once, so logits differ by float
rounding only. Greedy tokens must be identical (int8 and w8a8, which round
activations, may flip a near tie: they must agree on most tokens instead) and
logits lie within ``LOGIT_TOLERANCE`` of one rank's.
"""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import TINY_EOS, make_tiny_llm, tiny_config, tiny_tokenizer, tiny_weights
from gguf_files import write_gguf
from test_tensor_parallel import GREEDY, OPTIONS, PROMPTS, _agreement, record_logits
from tokenmill import LLM, SamplingParams
from tokenmill.settings.config import EngineConfig
from tokenmill.engine.step.distributed import startup_problem
from tokenmill.model.kernels import cpu_kernels
from tokenmill.model import parallel
from tokenmill.model.loader import dequantize, load_gguf

# Logits of the tiny model are of order 10. float32 activations through the same int4
# weights (gguf, int4): summing two partial sums instead of one row moved them by
# 4.3e-5 at most, every step. int8 multiplies bf16 activations into bf16 outputs (each
# rank rounding its own partial sum, the LM head's logits included: one bf16 step is
# 1/16 at 10), so its first step is held to a few bf16 steps (measured: 0.31). w8a8
# also quantizes each rank's slice of the o/down inputs on its own scale, and smooths
# with factors taken over each rank's rows (measured: 0.94).
LOGIT_TOLERANCE = {"gguf": 5e-4, "int4": 5e-4, "int8": 0.5, "w8a8": 2.0}
INT8_INPUT_TOLERANCE = 0.5  # int4 / gguf where the kernels round their input to int8 (AVX2 builds)


def _int8_inputs(mode: str) -> bool:
    """Whether ``mode``'s layers multiply activations rounded to integers on this machine:
    int8 and w8a8 everywhere, int4 and gguf where the kernel build multiplies int4 codes by
    int8 activations (AVX2). A rank's input then differs from one device's by float rounding
    (partial sums reduced in another order), which can move a value across a rounding
    boundary: TP=2 agrees with TP=1 up to a first near tie, not bit for bit."""
    if mode in ("int8", "w8a8"):
        return True
    library = cpu_kernels.load()
    return library is not None and (library.q8_activations or library.q4_int8_dot)


def write_tiny_gguf(path: str, qtype: str = "Q4_1", tied: bool = True, **overrides) -> str:
    cfg = tiny_config(**overrides)
    weights = tiny_weights(cfg)
    if tied:
        weights.pop("lm_head.weight")
    write_gguf(path, weights, cfg, qtypes={"": qtype}, eos_token_id=TINY_EOS)
    return path


# --------------------------------------------------------------------------- fast: the split itself


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_each_rank_reads_whole_blocks_that_put_back_together_are_the_file(tmp_path, qtype):
    """Raw blocks of rows (q/k/v, gate/up, vocab) and of whole-block column runs (o, down)
    read from the file equal the in-memory model's shards, and reassemble the tensor."""
    path = write_tiny_gguf(str(tmp_path / "tiny.gguf"), qtype)
    full = load_gguf(path)
    cfg = full.config
    size = 2
    shards = [parallel.load_shard(path, torch.float32, rank, size) for rank in range(size)]
    assert shards[0].raw_quantized.keys() == full.raw_quantized.keys()
    for rank, shard in enumerate(shards):
        from_memory = parallel.shard_loaded(full, rank, size)
        for name, (kind, blocks, shape) in shard.raw_quantized.items():
            assert kind == qtype
            np.testing.assert_array_equal(blocks, from_memory.raw_quantized[name][1], err_msg=name)
            assert shape == from_memory.raw_quantized[name][2] == tuple(shard.weights[name].shape), name
            # the kept blocks are the very weights the dense path loads
            np.testing.assert_array_equal(dequantize(blocks, kind, shape), shard.weights[name].numpy(), err_msg=name)
    for name, (kind, blocks, shape) in full.raw_quantized.items():
        dim = parallel.shard_range(name, cfg, 0, size)[0]
        parts = [torch.from_numpy(dequantize(s.raw_quantized[name][1], kind, s.raw_quantized[name][2]))
                 for s in shards]
        whole = torch.cat(parts, dim=dim)[: shape[0]]
        np.testing.assert_array_equal(whole.numpy(), dequantize(blocks, kind, shape), err_msg=name)
    # 257 tokens over 2 ranks: rank 1's last row is zero-byte padding, a zero weight
    vocab_rows = shards[1].raw_quantized["model.embed_tokens.weight"]
    assert vocab_rows[2][0] == -(-cfg.vocab_size // size) and not vocab_rows[1][-1].any()


@settings(max_examples=60, deadline=None)
@given(size=st.sampled_from([1, 2, 3, 4]), heads_per_rank=st.integers(1, 3), head_dim=st.sampled_from([16, 32, 64]),
       inter_units=st.integers(1, 6), qtype=st.sampled_from(["Q4_1", "Q8_0", "Q4_0"]))
def test_block_slices_of_every_rank_put_back_together_are_the_tensor(size, heads_per_rank, head_dim, inter_units,
                                                                    qtype):
    """Whatever the split: the ranks' byte slices of a row-parallel tensor, side by side, are
    its rows; of a column-parallel one, stacked, are the tensor; and a slice exists exactly
    when the size passes the group check."""
    heads = heads_per_rank * size
    cfg = tiny_config(num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim, hidden_size=64,
                      intermediate_size=16 * inter_units * size)
    block, nbytes = {"Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_0": (32, 18)}[qtype]
    rng = np.random.default_rng(heads * 1000 + head_dim + inter_units)
    types = {f"model.layers.0.{p}.weight": qtype for p in ("self_attn.o_proj", "mlp.down_proj")}
    whole = not parallel._group_problems("gguf", cfg, size, 32, types)
    for name, cols in (("self_attn.o_proj", heads * head_dim), ("mlp.down_proj", cfg.intermediate_size),
                       ("mlp.gate_proj", cfg.hidden_size)):
        if cols % block:
            continue  # not storable in this format at all
        name = f"model.layers.0.{name}.weight"
        rows = cfg.hidden_size if "gate" not in name else cfg.intermediate_size
        data = rng.integers(0, 256, (rows, cols // block * nbytes), dtype=np.uint8)
        cuts = [parallel.slice_blocks(name, qtype, data, (rows, cols), cfg, r, size) for r in range(size)]
        if "gate" in name:
            assert np.array_equal(np.concatenate([c[0] for c in cuts]), data)
            continue
        if not whole and any(c is None for c in cuts):
            continue
        assert all(c is not None for c in cuts), (name, size)
        assert np.array_equal(np.concatenate([c[0] for c in cuts], axis=1), data)
        assert sum(c[1][1] for c in cuts) == cols
    if (heads * head_dim) % block or cfg.intermediate_size % block:
        return  # such a file cannot exist
    if whole:
        parallel.check_quantization("gguf", cfg, size, 32, types)
    else:
        assert size > 1
        with pytest.raises(ValueError, match="would split the"):
            parallel.check_quantization("gguf", cfg, size, 32, types)


def test_a_size_that_cuts_a_quantization_group_is_refused_with_the_numbers(tmp_path):
    # intermediate 96 over 2 ranks: 48 down_proj columns each, not whole 32-column blocks
    path = write_tiny_gguf(str(tmp_path / "odd.gguf"), intermediate_size=96)
    cfg = parallel.read_config(path)
    types = parallel.block_types(path)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 would split the Q4_1 blocks of 32 columns of "
                                         r"down_proj \(a rank's share would be 48 of its 96 input columns\)"):
        parallel.check_quantization("gguf", cfg, 2, 32, types)
    parallel.check_quantization("int8", cfg, 2, 32, types)  # one scale per output row: splits anywhere
    parallel.check_quantization("none", cfg, 2, 32, types)
    # auto does not take blocks it would have to cut
    assert parallel.resolve_auto("auto", cfg, 2, types)[0] == "none"
    assert parallel.resolve_auto("auto", tiny_config(), 2, types)[0] == "gguf"
    # int4 groups of 64: o_proj's 64 input columns are 32 per rank
    with pytest.raises(ValueError, match=r"int4 groups of 64 columns of o_proj \(a rank's share would be 32 "
                                         r"of its 64 input columns\).*Sizes that keep them whole: 1\b.*"
                                         r"--quant-group-size"):
        make_tiny_llm(tensor_parallel_size=2, quantization="int4", quant_group_size=64)
    with pytest.raises(ValueError, match="'gguf' serves a GGUF file's own .* this model has none"):
        make_tiny_llm(tensor_parallel_size=2, quantization="gguf")  # dense in-memory weights
    # the command line says it in one line, before loading anything
    config = EngineConfig(model=path, quantization="gguf", tensor_parallel_size=2)
    assert "would split the Q4_1 blocks" in startup_problem(config)
    config = EngineConfig(model=path, quantization="int8", tensor_parallel_size=2)
    assert startup_problem(config) is None


def test_bundled_model_keeps_its_blocks_on_three_ranks(bundled_model_path):
    """SmolLM2's 576 attention and 1536 MLP columns split into 192 and 512 per rank:
    whole Q4_1 blocks; int4 groups of 64 fit too, 128 do not."""
    cfg = parallel.read_config(bundled_model_path)
    types = parallel.block_types(bundled_model_path)
    parallel.check_quantization("gguf", cfg, 3, 32, types)
    assert parallel.resolve_auto("auto", cfg, 3, types)[0] == "gguf"
    parallel.check_quantization("int4", cfg, 3, 64, types)
    with pytest.raises(ValueError, match="int4 groups of 128 columns of o_proj"):
        parallel.check_quantization("int4", cfg, 3, 128, types)


def test_the_executor_tensor_parallelism_gives_up_is_named_per_device():
    """Eager on every rank: the startup line names what is off (the fused CPU step, or
    CUDA graphs on NCCL ranks, each on its own GPU)."""
    from tokenmill.engine.step import distributed

    assert "fused CPU decode step is off" in distributed.executor_note(torch.device("cpu"))
    assert "CUDA graphs are off" in distributed.executor_note(torch.device("cuda"))
    assert (distributed.backend_for("cuda"), distributed.backend_for("cpu")) == ("nccl", "gloo")
    assert distributed.rank_device("cuda", 1) == torch.device("cuda", 1)


# --------------------------------------------------------------------------- slow: two ranks on gloo


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    return write_tiny_gguf(str(tmp_path_factory.mktemp("tpq") / "tiny.gguf"))


def _run(path: str, mode: str, size: int, caplog) -> dict:
    # a float32 pool on one rank too (ranks keep theirs in the compute dtype; one device
    # would take bf16 under w8a8 and gguf): parity compares the same arithmetic
    options = dict(OPTIONS, quantization=mode, quantize_lm_head=True, kv_cache_dtype="float32")
    with caplog.at_level(logging.INFO, logger="tokenmill.tp"):
        with LLM(path, tokenizer=tiny_tokenizer(), tensor_parallel_size=size, **options) as llm:
            logits = record_logits(llm)
            outs = llm.generate(PROMPTS, GREEDY) + llm.generate(PROMPTS[:2], GREEDY)
            group = llm.engine.parallel
            return {"tokens": [o.outputs[0].token_ids for o in outs], "logits": logits,
                    "cached": [o.num_cached_tokens for o in outs], "preemptions": llm.engine.total_preemptions,
                    "weights": [m.weight_bytes for m in group.memory] if group else [llm.engine.weight_bytes],
                    "report": llm.engine.model.quant_report.summary(), "model": repr(llm.engine.model)}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["gguf", "int4", "int8", "w8a8"])
def test_two_ranks_with_quantized_weights_match_one(tiny_gguf, mode, caplog):
    one = _run(tiny_gguf, mode, 1, caplog)
    two = _run(tiny_gguf, mode, 2, caplog)
    # every linear layer and the tied head quantized on both; the lookup goes through the head
    assert one["report"] == two["report"] and "9 linear layers" in two["report"], two["report"]
    assert "VocabParallelQuantizedEmbedding" in two["model"] and "QuantizedParallelLMHead" in two["model"]
    assert one["preemptions"] > 0 and two["preemptions"] > 0
    assert max(two["cached"]) >= 32 and one["cached"] == two["cached"]
    steps = list(zip(one["logits"], two["logits"]))
    tolerance = LOGIT_TOLERANCE[mode]
    if _int8_inputs(mode):  # once a near tie flips, later steps differ by more than rounding: first step only
        tolerance = max(tolerance, INT8_INPUT_TOLERANCE)
        agreement = _agreement(two["tokens"], one["tokens"])
        print(f"{mode}: {100 * agreement:.1f}% of tokens before a first difference")
        assert agreement >= 0.9
        steps = steps[:1]
    else:
        assert two["tokens"] == one["tokens"]
        assert len(one["logits"]) == len(two["logits"])
    worst = max(float((a - b).abs().max()) for a, b in steps if a.numel())
    print(f"{mode}: logits max |TP=2 - TP=1| {worst:.2e}")
    assert worst < tolerance, worst
    # each rank holds half the quantized weights (norms replicated, one padded vocab row)
    total = one["weights"][0]
    print(f"{mode}: weights TP=1 {total} B, TP=2 per rank {two['weights']} B")
    assert all(abs(w - total / 2) < 0.03 * total for w in two["weights"]), (total, two["weights"])
    assert any("eager forward on every rank; the fused CPU decode step is off" in r.getMessage()
               for r in caplog.records)


@pytest.mark.slow
def test_bundled_smollm2_keeps_its_q4_1_blocks_on_three_ranks(real_loaded, real_tokenizer):
    """The default model as served by default on one device (its own Q4_1 blocks, Q8_0
    embedding), split over 3 ranks: each reads a third of the blocks; greedy text as on one
    (where the kernels round int4 layers' inputs to int8, the same first token and most of
    the text: see _int8_inputs)."""
    prompts = ["The capital of France is", "Write a haiku about the sea:"]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    # One device keeps the file's Q8_0 head as int8 groups (16-bit activations), the ranks
    # a float32 head; the pool float32 on both.
    one = LLM(loaded_model=real_loaded, tokenizer=real_tokenizer, num_threads=1, num_blocks=64, quantization="gguf",
              kv_cache_dtype="float32")
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    with LLM(num_threads=1, num_blocks=64, tensor_parallel_size=3, quantization="gguf") as three:
        got = [o.outputs[0].token_ids for o in three.generate(prompts, params)]
        memory = three.engine.parallel.memory
        assert three.engine.model.quant_report.summary() == "quantization=gguf: 120 linear layers as Q4_1 (int4 g32)"
        one_layers = dict(one.engine.model.quant_report.quantized)
        assert one_layers.pop("lm_head") == "Q8_0 (int8 g32)"
        assert one_layers == three.engine.model.quant_report.quantized
    # the heads' products differ (and on AVX2 builds the layers' int8 inputs): a near tie may
    # flip a later token, not the first
    assert [g[0] for g in got] == [w[0] for w in want]
    assert _agreement(got, want) >= 0.5, (got, want)
    head = one.engine.model.lm_head
    one_head = sum(b.numel() * b.element_size() for b in head.buffers())
    dense_head = head.out_features * head.in_features * 4
    total = one.engine.weight_bytes - one_head + dense_head
    print(f"SmolLM2 gguf: weights TP=1 {total / 2**20:.1f} MiB, TP=3 per rank "
          f"{[round(m.weight_bytes / 2**20, 1) for m in memory]} MiB")
    assert all(abs(m.weight_bytes * 3 - total) < 0.02 * total for m in memory), (total, memory)

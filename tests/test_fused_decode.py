"""The fused native decode step (engine/step/fused_decode.py, csrc/step.c)
against the eager torch model, for every weight kind it takes.

Quantized models are checked against a float32 dense model holding the
dequantized weights: the fused step computes in float32, so the two agree to
float rounding, which pins down the int8/int4 unpacking exactly (the eager
quantized layers round activations to bf16 and could not)."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import tiny_loaded, tiny_tokenizer
from tokenmill.settings.config import EngineConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.request import Request, SamplingParams
from tokenmill.engine.step import fused_decode
from tokenmill.engine.step.executors import FusedDecodeExecutor
from tokenmill.engine.step.step_batch import StepBatch
from tokenmill.model.kernels import cpu_kernels
from tokenmill.model.quant import quant
from tokenmill.settings.options import KernelOptions

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler for the CPU kernels")


def _engine(loaded=None, **options) -> LLMEngine:
    options.setdefault("num_blocks", 96)
    options.setdefault("enable_prefix_caching", False)
    return LLMEngine(EngineConfig.from_options(**options), loaded=loaded or tiny_loaded(), tokenizer=tiny_tokenizer())


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(rng.randint(5, 70))] for _ in range(count)]


def _requests(engine: LLMEngine, prompts: list[list[int]]) -> list[Request]:
    """Requests whose blocks interleave in the pool (allocated one block at a time, round robin)."""
    reqs = [Request(f"r{i}", ids, SamplingParams(max_tokens=8)) for i, ids in enumerate(prompts)]
    need = [-(-len(ids) // engine.block_size) for ids in prompts]
    for turn in range(max(need)):
        for req, n in zip(reqs, need):
            if turn < n:
                req.block_table += engine.pool.allocate(1)
    return reqs


def _prefill_all_but_last(engine: LLMEngine, reqs: list[Request]) -> None:
    engine.runner.execute([(r, len(r.prompt_token_ids) - 1) for r in reqs])
    for r in reqs:
        r.num_computed_tokens = len(r.prompt_token_ids) - 1


def _fused_executor(engine: LLMEngine) -> FusedDecodeExecutor:
    found = [e for e in engine.runner.executors if isinstance(e, FusedDecodeExecutor)]
    assert found, "the engine has no fused decode executor"
    return found[0]


def _use_fused(engine: LLMEngine, decoder: fused_decode.FusedDecoder) -> None:
    """Give the engine's fused executor another decoder (a model changed after build)."""
    engine.runner.fused = decoder
    _fused_executor(engine).decoder = decoder


def _decode(engine: LLMEngine, reqs: list[Request], fused: bool, monkeypatch=None) -> torch.Tensor:
    """One decode step through the fused executor, or through the eager one."""
    items = [(r, 1) for r in reqs]
    if fused:
        executor = _fused_executor(engine)
        batch = StepBatch.build(items)
        assert executor.accepts(batch)
        logits, sampled = executor.run(batch)
    else:
        logits, sampled = engine.runner.run_eager(items)
    assert sampled == reqs
    return logits


def _new_kv(engine: LLMEngine, reqs: list[Request]) -> torch.Tensor:
    """Every layer's K and V rows at each request's newest position."""
    bs = engine.block_size
    out = []
    for k, v in engine.runner.kv_caches:
        for r in reqs:
            p = len(r.prompt_token_ids) - 1
            block, off = r.block_table[p // bs], p % bs
            out += [k[:, block, off].float(), v[:, block, off].float()]
    return torch.stack(out)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("quantization", ["none", "w8a8"])
def test_fused_step_gives_the_same_bits_whatever_the_thread_count(quantization: str) -> None:
    """Inside the step, threads claim projection rows and attention items as they come
    free, so which thread did what differs from step to step: logits and the K/V written
    must not."""
    engine = _engine(tiny_loaded(seed=6, num_hidden_layers=3), dtype="float32", quantization=quantization)
    reqs = _requests(engine, _prompts(11, seed=8))
    _prefill_all_but_last(engine, reqs)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3, 5):
            torch.set_num_threads(threads)
            logits = _decode(engine, reqs, True)  # rewrites the same slots each time
            results.append((logits, _new_kv(engine, reqs)))
    finally:
        torch.set_num_threads(before)
    for logits, kv in results[1:]:
        assert torch.equal(logits, results[0][0]) and torch.equal(kv, results[0][1])


@pytest.mark.parametrize("batch", [1, 2, 5, 19])
@pytest.mark.parametrize("overrides", [{}, {"attention_bias": True}, {"qk_norm": True}])
def test_float32_fused_step_matches_eager_logits_and_cache_writes(batch: int, overrides: dict, monkeypatch) -> None:
    loaded = tiny_loaded(seed=2, **overrides)
    if overrides:  # the extra tensors these variants read
        cfg = loaded.config
        g = torch.Generator().manual_seed(9)
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}.self_attn."
            if cfg.attention_bias:
                for name, rows in (("q", cfg.num_attention_heads), ("k", cfg.num_key_value_heads),
                                   ("v", cfg.num_key_value_heads)):
                    loaded.weights[p + f"{name}_proj.bias"] = torch.randn(rows * cfg.head_dim, generator=g) * 0.1
            if cfg.qk_norm:
                loaded.weights[p + "q_norm.weight"] = 1 + 0.1 * torch.randn(cfg.head_dim, generator=g)
                loaded.weights[p + "k_norm.weight"] = 1 + 0.1 * torch.randn(cfg.head_dim, generator=g)
    engine = _engine(loaded)
    assert engine.runner.fused is not None
    reqs = _requests(engine, _prompts(batch, seed=batch))
    _prefill_all_but_last(engine, reqs)
    fused = _decode(engine, reqs, True, monkeypatch)
    fused_kv = _new_kv(engine, reqs)
    eager = _decode(engine, reqs, False, monkeypatch)  # rewrites the same slots
    eager_kv = _new_kv(engine, reqs)
    assert _rel(fused, eager) < 1e-5
    assert torch.equal(fused.argmax(-1), eager.argmax(-1))
    assert _rel(fused_kv, eager_kv) < 1e-6


def _dequantized_twin(quantized: LLMEngine, loaded) -> LLMEngine:
    """A float32 dense engine whose weights are the quantized engine's dequantized ones."""
    twin = _engine(loaded)
    qmods = dict(quantized.model.named_modules())
    with torch.no_grad():
        for name, mod in twin.model.named_modules():
            q = qmods.get(name)
            if isinstance(q, (quant.Int8Linear, quant.Int4Linear)):
                mod.weight = torch.nn.Parameter(q.dequantized_weight().float().contiguous(), requires_grad=False)
    return twin


@pytest.mark.parametrize("options", [
    dict(quantization="int8"),
    dict(quantization="int4", quant_group_size=32),
    dict(quantization="int4", quant_group_size=64, quantize_lm_head=True),
])
@pytest.mark.parametrize("batch", [1, 3, 6, 11])
def test_quantized_fused_step_matches_the_dequantized_float_model(options: dict, batch: int, monkeypatch) -> None:
    loaded = tiny_loaded(seed=3)
    engine = _engine(loaded, dtype="float32", **options)
    assert engine.runner.fused is not None
    kinds = {m.kind for m in (engine.runner.fused.struct.layers[0].qkv, engine.runner.fused.struct.head)}
    assert kinds == ({fused_decode.W_INT8, fused_decode.W_F32} if options["quantization"] == "int8"
                     else {fused_decode.W_INT4} if options.get("quantize_lm_head") else
                     {fused_decode.W_INT4, fused_decode.W_F32})
    twin = _dequantized_twin(engine, loaded)
    prompts = _prompts(batch, seed=10 + batch)
    reqs, twin_reqs = _requests(engine, prompts), _requests(twin, prompts)
    _prefill_all_but_last(twin, twin_reqs)
    for (k, v), (tk, tv) in zip(engine.runner.kv_caches, twin.runner.kv_caches):  # the same context
        k.copy_(tk)
        v.copy_(tv)
    for r, t in zip(reqs, twin_reqs):
        assert r.block_table == t.block_table
        r.num_computed_tokens = t.num_computed_tokens
    got = _decode(engine, reqs, True, monkeypatch)
    want = _decode(twin, twin_reqs, False, monkeypatch)
    lib = cpu_kernels.load()
    if _activations_quantized():
        assert _rel(got, want) < 3e-2  # int8 activations (AVX2 integer dot products)
    elif options["quantization"] == "int8" and lib.int8_dot:
        assert _rel(got, want) < 3e-4  # 16-bit integer activations (VNNI): 1/65534 of a row's range
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    else:
        assert _rel(got, want) < 1e-5
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def _activations_quantized() -> bool:
    """The library's int4 (AVX2, AVX-512 VNNI) or int8 (AVX2) matmuls multiply int8-quantized activations."""
    lib = cpu_kernels.load()
    return lib is not None and (lib.q8_activations or lib.q4_int8_dot)


def test_repeat_two_int4_rows_feed_the_input_twice(monkeypatch) -> None:
    """GGUF Q8_0 layers hold [hi | lo] int4 codes of one input fed twice."""
    loaded = tiny_loaded(seed=4)
    engine = _engine(loaded, dtype="float32")
    twin = _engine(loaded, dtype="float32")
    with torch.no_grad():
        for name, mod in list(engine.model.named_modules()):
            if name.endswith(("qkv_proj", "down_proj")):
                codes = quant.quantize_int4(mod.weight, 32).as_split()
                parent, _, attr = name.rpartition(".")
                setattr(engine.model.get_submodule(parent), attr, quant.Int4Linear(codes))
                twin.model.get_submodule(name).weight.copy_(codes.dequantize())
    fused = fused_decode.build(engine.model, engine.runner.kv_caches, cpu_kernels.load())
    assert fused is not None and fused.struct.layers[0].qkv.repeat == 2
    _use_fused(engine, fused)
    prompts = _prompts(2, seed=7)
    reqs, twin_reqs = _requests(engine, prompts), _requests(twin, prompts)
    _prefill_all_but_last(twin, twin_reqs)
    for (k, v), (tk, tv) in zip(engine.runner.kv_caches, twin.runner.kv_caches):
        k.copy_(tk)
        v.copy_(tv)
    for r, t in zip(reqs, twin_reqs):
        r.num_computed_tokens = t.num_computed_tokens
    # the hi half carries 16x the scale of the lo half: their float32 sums round a little more
    tol = 3e-2 if _activations_quantized() else 5e-5
    assert _rel(_decode(engine, reqs, True, monkeypatch), _decode(twin, twin_reqs, False, monkeypatch)) < tol


@pytest.mark.parametrize("batch", [1, 3, 10])
def test_bf16_model_fused_step_stays_close_to_float32(batch: int, monkeypatch) -> None:
    loaded = tiny_loaded(seed=5)
    engine = _engine(loaded, dtype="bfloat16")
    ref = _engine(loaded, dtype="float32")
    assert engine.runner.fused is not None and engine.runner.fused.struct.cache_fmt == 1  # KV_BF16
    prompts = _prompts(batch, seed=5)
    reqs, ref_reqs = _requests(engine, prompts), _requests(ref, prompts)
    _prefill_all_but_last(engine, reqs)
    _prefill_all_but_last(ref, ref_reqs)
    got = _decode(engine, reqs, True, monkeypatch)
    eager_bf16 = _decode(engine, reqs, False, monkeypatch)
    want = _decode(ref, ref_reqs, False, monkeypatch)
    # bf16 weights and cache, float32 activations at batch 1 and bf16-rounded matmul inputs
    # above it (vdpbf16ps, where the CPU has it): no further from float32 than eager bf16
    assert _rel(got, want) < max(1.5 * _rel(eager_bf16, want), 1e-3)


def test_engine_greedy_tokens_do_not_change_with_the_fused_step(monkeypatch) -> None:
    """Through the scheduler: batches of decodes go fused, prefill steps eager; fp32 greedy
    output is the same token for token either way."""
    prompts = _prompts(4, seed=11)
    outs = []
    for flag in ("1", "0"):
        engine = _engine(max_num_batched_tokens=64,
                         kernel_options=KernelOptions.from_env({"TOKENMILL_FUSED_DECODE": flag}))
        assert (engine.runner.fused is not None) == (flag == "1")
        for i, ids in enumerate(prompts):
            engine.add_request(f"g{i}", ids, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
        got: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for delta in engine.step():
                got.setdefault(delta.request_id, []).extend(delta.token_ids)
        outs.append(got)
    assert outs[0] == outs[1]


def test_bad_block_ids_are_refused_before_anything_is_written(monkeypatch) -> None:
    engine = _engine()
    reqs = _requests(engine, _prompts(1, seed=1))
    _prefill_all_but_last(engine, reqs)
    before = [k.clone() for k, _ in engine.runner.kv_caches]
    reqs[0].block_table = [engine.runner.num_blocks + 5] * len(reqs[0].block_table)
    with pytest.raises(ValueError, match="outside"):
        _decode(engine, reqs, True, monkeypatch)
    assert all(torch.equal(a, k) for a, (k, _) in zip(before, engine.runner.kv_caches))


def test_switch_and_batch_limit_send_steps_to_the_eager_model(monkeypatch) -> None:
    """The options, read when the engine is built, set the fused executor's batch limit
    (larger steps go eager) or leave the executor out."""
    engine = _engine(kernel_options=KernelOptions.from_env({"TOKENMILL_FUSED_DECODE_MAX_BATCH": "2"}))
    reqs = _requests(engine, _prompts(3, seed=2))
    _prefill_all_but_last(engine, reqs)  # prefill chunks: the fused prefill executor, whatever the limit
    calls = []
    real = engine.runner.fused.run
    monkeypatch.setattr(engine.runner.fused, "run", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    engine.runner.execute([(r, 1) for r in reqs])  # 3 > 2: eager
    engine.runner.execute([(r, 1) for r in reqs[:2]])
    assert calls == [2]
    off = _engine(kernel_options=KernelOptions.from_env({"TOKENMILL_FUSED_DECODE": "0"}))
    assert off.runner.fused is None and [e.name for e in off.runner.executors] == ["eager"]


def test_unsupported_layers_leave_the_fused_step_off() -> None:
    engine = _engine(tiny_loaded(seed=1))
    engine.model.layers[0].mlp.down_proj = torch.nn.Identity()  # not a linear the kernel knows
    assert fused_decode.build(engine.model, engine.runner.kv_caches, cpu_kernels.load()) is None


def test_a_table_shorter_than_its_sequence_is_refused_not_padded_with_block_zero(monkeypatch) -> None:
    """Rows are padded to the longest table; the padding must never be read as a real block."""
    engine = _engine()
    reqs = _requests(engine, [[1] * 40, [2] * 3])
    _prefill_all_but_last(engine, reqs)
    reqs[0].block_table = reqs[0].block_table[:-1]  # 40 tokens need 3 blocks of 16; give it 2
    before = [k.clone() for k, _ in engine.runner.kv_caches]
    with pytest.raises(ValueError, match="outside"):
        _decode(engine, reqs, True, monkeypatch)
    assert all(torch.equal(a, k) for a, (k, _) in zip(before, engine.runner.kv_caches))


def test_malformed_batch_limit_is_an_error_at_start() -> None:
    with pytest.raises(ValueError, match="TOKENMILL_FUSED_DECODE_MAX_BATCH"):
        KernelOptions.from_env({"TOKENMILL_FUSED_DECODE_MAX_BATCH": "lots"})


@pytest.mark.parametrize("batch", [1, 2, 5, 12, 17])
def test_w8a8_fused_step_matches_the_eager_w8a8_model(batch: int, monkeypatch) -> None:
    """With VNNI, a w8a8 decode row is the same in the fused step and in the eager model,
    bit for bit, logits and K/V, at every batch size: both run the same integer kernels
    on 8-bit activations and round the float ops alike (a request's tokens then do not
    depend on which path its steps took). Without VNNI the fused step quantizes its
    input per 32 columns and the eager layers per token or to bf16: close, not equal."""
    engine = _engine(tiny_loaded(seed=4, num_hidden_layers=4), dtype="float32", quantization="w8a8")
    fused = engine.runner.fused
    assert fused is not None
    lib = cpu_kernels.load()
    first, last = fused.struct.layers[0], fused.struct.layers[engine.model_config.num_hidden_layers - 1]
    if lib.int8_dot:  # 8-bit activations at every batch size; the last layers keep 16-bit ones
        assert (first.qkv.a8_rows, first.qkv.a16_rows) == (1, 1)
        assert (last.qkv.a8_rows, last.qkv.a16_rows) == (0, 1)
        # the down projections: int8 per 32 inputs, 8-bit activations per 32 inputs
        assert (first.down.kind, first.down.a8_rows) == (fused_decode.W_INT8G, 1)
        assert isinstance(engine.model.layers[0].mlp.down_proj, quant.Int8GroupLinear)
    reqs = _requests(engine, _prompts(batch, seed=20 + batch))
    _prefill_all_but_last(engine, reqs)
    got = _decode(engine, reqs, True, monkeypatch)
    got_kv = _new_kv(engine, reqs)
    want = _decode(engine, reqs, False, monkeypatch)  # rewrites the same slots
    if lib.int8_dot:
        assert torch.equal(got, want) and torch.equal(got_kv, _new_kv(engine, reqs))
    else:  # the eager layers round activations to bf16 or 8 bits per token, the fused step per 32 columns
        assert _rel(got, want) < 5e-2


@pytest.mark.parametrize("windows", [None, ["sliding_attention", "full_attention", "sliding_attention"]],
                         ids=["whole", "mixed-windows"])
def test_long_contexts_in_parts_match_eager_and_keep_their_bits(windows) -> None:
    """Decode rows past 1024 positions are attended in parts (paged_attention.c's PART_LEN) that
    the step's threads share, then combined. Against the eager model, with every layer whole or
    with windowed layers (window 1100: one part there, several in the full layers) between full
    ones; and the same bits on any thread count."""
    overrides = dict(num_hidden_layers=3, max_position_embeddings=4096, num_key_value_heads=1)
    if windows:
        overrides.update(sliding_window=1100, layer_types=windows)
    engine = _engine(tiny_loaded(seed=4, **overrides), num_blocks=600, max_model_len=4096)
    assert engine.runner.fused is not None
    rng = random.Random(5)
    prompts = [[rng.randrange(0, 256) for _ in range(n)] for n in (2600, 40, 1100, 1025)]
    reqs = _requests(engine, prompts)
    _prefill_all_but_last(engine, reqs)
    fused = _decode(engine, reqs, True)
    before = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            assert torch.equal(_decode(engine, reqs, True), fused)
    finally:
        torch.set_num_threads(before)
    eager = _decode(engine, reqs, False)
    assert _rel(fused, eager) < 1e-5
    assert torch.equal(fused.argmax(-1), eager.argmax(-1))


def test_q4_0_gguf_fused_step_reads_symmetric_fp16_blocks_with_the_same_bits_at_any_thread_count(tmp_path) -> None:
    """A Q4_0 file's layers, its LM head among them, are packed without zeros and with their fp16 scales (int4_q8_form)
    where the build multiplies int4 codes by int8 activations; the fused step's logits and K/V
    then do not depend on the thread count, nor on which other rows share the step, and stay
    at the dequantized float model's."""
    gguf_files = pytest.importorskip("gguf_files")
    from conftest import TINY_EOS, tiny_config, tiny_weights
    from tokenmill.model.loader import load_model

    cfg = tiny_config(tie_word_embeddings=True)
    weights = tiny_weights(cfg, seed=11)
    weights.pop("lm_head.weight")
    path = str(tmp_path / "q4_0.gguf")
    gguf_files.write_gguf(path, weights, cfg, qtypes={"": "Q4_0"}, eos_token_id=TINY_EOS)
    loaded = load_model(path)
    engine = _engine(loaded, quantization="gguf", dtype="float32")
    layers = [m for m in engine.model.modules() if isinstance(m, quant.Int4Linear)]
    # the head (the tied Q4_0 token table) keeps its blocks too, without --quantize-lm-head
    assert isinstance(engine.model.lm_head, quant.Int4Linear) and engine.model.lm_head in layers
    library = layers[0].ops.library
    if library is not None and library.q4_int8_dot:
        descs = [m.kernel_description() for m in layers]
        packed = [d for d in descs if d.packed]
        assert packed and all(d.q4_form == cpu_kernels.Q4_SYMMETRIC | cpu_kernels.Q4_F16 and not d.packed_zero
                              for d in packed)
    reqs = _requests(engine, _prompts(7, seed=3))
    _prefill_all_but_last(engine, reqs)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append((_decode(engine, reqs, True), _new_kv(engine, reqs)))
        alone = _decode(engine, reqs[2:3], True)  # one row of the batch, stepped by itself
    finally:
        torch.set_num_threads(before)
    for logits, kv in results[1:]:
        assert torch.equal(logits, results[0][0]) and torch.equal(kv, results[0][1])
    assert torch.equal(alone[0], results[0][0][2])
    dense = _engine(loaded, dtype="float32")
    reqs_d = _requests(dense, [r.prompt_token_ids for r in reqs])
    _prefill_all_but_last(dense, reqs_d)
    want = _decode(dense, reqs_d, False)
    assert _rel(results[0][0], want) < 0.05

"""quantize_model on whole models: the engine hook, memory, GGUF files served with their own blocks."""
from __future__ import annotations

import pytest
import torch

from conftest import TINY_EOS, tiny_config, tiny_loaded, tiny_tokenizer, tiny_weights
from gguf_files import write_gguf
from tokenmill.config import EngineConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.request import Request, SamplingParams
from tokenmill.model import quant
from tokenmill.model.loader import load_model

gguf = pytest.importorskip("gguf")


def _engine(loaded=None, **options) -> LLMEngine:
    options.setdefault("num_blocks", 64)
    return LLMEngine(EngineConfig.from_options(**options), loaded=loaded or tiny_loaded(), tokenizer=tiny_tokenizer())


def _logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """All-position logits of one sequence, through the paged cache."""
    req = Request("probe", ids, SamplingParams(max_tokens=1))
    req.block_table = engine.pool.allocate(-(-len(ids) // engine.block_size))
    try:
        with torch.inference_mode():
            inp = engine.runner.prepare([(req, len(ids))])
            hidden = engine.model(inp.input_ids, inp.positions, engine.runner.kv_caches, inp.attn)
            return engine.model.compute_logits(hidden)
    finally:
        engine.pool.release(req.block_table)


IDS = [int(b) for b in "The quick brown fox jumps over the lazy dog; 0123456789.".encode()]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_quantized_engine_shrinks_weights_and_stays_close() -> None:
    base = _engine()
    ref = _logits(base, IDS)
    sizes = {"none": base.weight_bytes}
    errors = {}
    # random weights amplify errors; a real checkpoint's figures are in the eval and benchmark
    for mode, tol in (("int8", 0.03), ("w8a8", 0.06), ("int4", 0.35)):
        eng = _engine(quantization=mode)
        kinds = {type(m).__name__ for m in eng.model.modules()}
        assert ("Int4Linear" if mode == "int4" else "Int8Linear") in kinds
        # the LM head is left alone by default; w8a8 stores it as int8 with a scale per 32 inputs
        assert ("Int8GroupLinear" if mode == "w8a8" else "Linear") in kinds
        sizes[mode] = eng.weight_bytes
        got = _logits(eng, IDS)
        errors[mode] = _rel(got, ref)
        assert errors[mode] < tol, mode
        assert torch.equal(_logits(eng, IDS), got)  # deterministic
    assert errors["int8"] < errors["w8a8"] and errors["int8"] < errors["int4"] / 3
    # linears are ~half of this tiny model (the 257 x 64 embedding and head are not quantized)
    assert sizes["int4"] < sizes["int8"] < sizes["none"]
    linear_params = sum(w.numel() for k, w in tiny_weights(tiny_config()).items() if ".layers." in k and w.ndim == 2)
    assert sizes["none"] - sizes["int8"] >= linear_params * 4 - linear_params * 1.1


def test_int4_group_size_error_names_the_layer() -> None:
    loaded = tiny_loaded(hidden_size=96, num_attention_heads=3, num_key_value_heads=1)
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.qkv_proj.*96 = 0.75 x 128"):
        _engine(loaded, quantization="int4", quant_group_size=128)
    with pytest.raises(ValueError, match="unknown quantization"):
        _engine(quantization="fp8")
    with pytest.raises(ValueError, match="has none"):
        _engine(quantization="gguf")  # an HF-style model has no GGUF blocks


def test_quantized_lm_head_shares_a_tied_embedding() -> None:
    loaded = tiny_loaded(tie_word_embeddings=True)
    loaded.weights.pop("lm_head.weight")
    dense = _engine(loaded)
    eng = _engine(loaded, quantization="int8", quantize_lm_head=True)
    assert isinstance(eng.model.lm_head, quant.Int8Linear)
    assert isinstance(eng.model.embed_tokens, quant.QuantizedEmbedding)
    embed = 257 * 64
    # one int8 table (+ scales) instead of an fp32 one
    assert dense.weight_bytes - eng.weight_bytes > embed * 3 + (dense.weight_bytes - embed * 4) * 0.7
    assert _rel(_logits(eng, IDS), _logits(dense, IDS)) < 0.03


def test_memory_budget_gives_the_kv_pool_what_weights_leave() -> None:
    budget = 4 << 20
    blocks = {}
    for mode in ("none", "int8", "int4"):
        eng = LLMEngine(EngineConfig.from_options(quantization=mode, memory_budget=budget),
                        loaded=tiny_loaded(), tokenizer=tiny_tokenizer())
        blocks[mode] = eng.pool.num_blocks
    assert blocks["none"] < blocks["int8"] < blocks["int4"]


# --------------------------------------------------------------------------- GGUF files


def _write_gguf(path: str, weights: dict[str, torch.Tensor], cfg, qtypes: dict[str, str]) -> None:
    write_gguf(path, weights, cfg, qtypes=qtypes, eos_token_id=TINY_EOS)


@pytest.mark.parametrize("qtypes", [
    {"": "Q4_1"},
    {"": "Q8_0"},
    {"": "Q4_0", "v_proj": "Q8_0", "down_proj": "Q4_1"},  # mixed within a fused q/k/v
])
def test_gguf_blocks_served_natively_match_the_dequantized_model(tmp_path, qtypes: dict) -> None:
    cfg = tiny_config(tie_word_embeddings=True)
    weights = tiny_weights(cfg, seed=5)
    weights.pop("lm_head.weight")
    path = str(tmp_path / "tiny.gguf")
    _write_gguf(path, weights, cfg, qtypes)
    loaded = load_model(path)
    assert loaded.raw_quantized
    dense = _engine(loaded)  # fp32, blocks dequantized exactly
    ref = _logits(dense, IDS)
    native = _engine(loaded, quantization="gguf", quantize_lm_head=True)
    layers = [m for m in native.model.modules() if isinstance(m, quant.Int4Linear)]
    assert len(layers) == 2 * 4 + 1 and all(m.group_size == 32 for m in layers)
    assert isinstance(native.model.embed_tokens, quant.QuantizedEmbedding)  # the tied Q8_0/Q4 table, once
    got = _logits(native, IDS)
    requant = _logits(_engine(loaded, quantization="int4", quant_group_size=32, quantize_lm_head=True), IDS)
    bf16 = _logits(_engine(loaded, dtype="bfloat16"), IDS)
    # bf16 activations and bf16-rounded block scales are all that separate the native path
    # from the exact dequantized one: the same order as running the float model in bf16,
    # and well below re-quantizing the (already 4-bit) weights.
    assert _rel(got, ref) < max(2.5 * _rel(bf16, ref), 0.01)
    assert _rel(got, ref) < _rel(requant, ref)
    assert _rel(got, ref) < 0.05
    # the dense engine's greedy choice is kept at nearly every position
    assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.9


def test_gguf_keeps_a_q8_0_head_as_its_exact_int8_groups(tmp_path) -> None:
    """Without --quantize-lm-head, a head (here the tied token table) stored as Q8_0 keeps
    the file's codes and scales in an Int8GroupLinear, not a float32 matmul."""
    cfg = tiny_config(tie_word_embeddings=True)
    weights = tiny_weights(cfg, seed=7)
    weights.pop("lm_head.weight")
    path = str(tmp_path / "tiny.gguf")
    _write_gguf(path, weights, cfg, {"embed_tokens": "Q8_0", "": "Q4_1"})
    loaded = load_model(path)
    dense = _engine(loaded)
    native = _engine(loaded, quantization="gguf")
    head = native.model.lm_head
    assert isinstance(head, quant.Int8GroupLinear) and not head.dynamic
    assert torch.equal(head.dequantized_weight(), dense.model.lm_head.weight.float())  # no re-quantization
    assert isinstance(native.model.embed_tokens, quant.QuantizedEmbedding)  # one copy of the table
    assert "Q8_0 (int8 g32)" in native.model.quant_report.quantized["lm_head"]
    assert _rel(_logits(native, IDS), _logits(dense, IDS)) < 0.05
    # a head in Q4 blocks has no int8 form to keep: it stays dense unless asked for
    _write_gguf(path, weights, cfg, {"": "Q4_1"})
    q4 = _engine(load_model(path), quantization="gguf")
    assert not isinstance(q4.model.lm_head, quant.Int8GroupLinear)

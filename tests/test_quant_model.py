"""quantize_model on whole models: the engine hook, memory, GGUF files served with their own blocks."""
from __future__ import annotations

import pytest
import torch

from conftest import TINY_EOS, tiny_config, tiny_loaded, tiny_tokenizer, tiny_weights
from gguf_files import write_gguf
from tokenmill.settings.config import EngineConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.request import Request, SamplingParams
from tokenmill.model.quant import quant
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


def test_gguf_layers_kept_as_blocks_are_never_dequantized(tmp_path, monkeypatch) -> None:
    """Layers `gguf` rebuilds from the file's blocks are never widened to dense weights
    (an 8B file's would not fit in memory): the model gives the same logits as one built
    from weights handed over as a plain dict, which are all made and loaded."""
    from tokenmill.model import loader
    from tokenmill.model.loader import LoadedModel

    cfg = tiny_config(tie_word_embeddings=False)
    path = str(tmp_path / "tiny.gguf")
    _write_gguf(path, tiny_weights(cfg, seed=6), cfg, {"layers.": "Q4_0", "down_proj": "Q8_0"})
    loaded = load_model(path)
    made: list[str] = []
    dense = loader._dense
    monkeypatch.setattr(loader, "_dense", lambda t, rows, dtype: made.append(t.name) or dense(t, rows, dtype))
    native = _engine(loaded, quantization="gguf")
    assert made and not [name for name in made if name.startswith("blk.")
                         and not name.endswith("norm.weight")]  # only norms, the table and the head
    assert not [n for n, p in native.model.named_parameters() if p.is_meta]
    eager = LoadedModel(loaded.config, dict(loaded.weights), loaded.quant_types, loaded.raw_quantized)
    assert torch.equal(_logits(native, IDS), _logits(_engine(eager, quantization="gguf"), IDS))


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


def test_q5_blocks_keep_their_exact_weights() -> None:
    """Q5_0 and Q5_1 rows read by q5_from_gguf give gguf's own dequantization bit for bit;
    Q5_0's codes less 16 in Q8_0's layout (int8 g32) are the same weights exactly, and the
    two-plane int4 form (Q5_0 and Q5_1) the same weights to float32 rounding."""
    import numpy as np
    from gguf import GGMLQuantizationType as QT
    from gguf.quants import dequantize, quantize

    x = np.random.default_rng(3).standard_normal((12, 256)).astype(np.float32)
    for t in ("Q5_0", "Q5_1"):
        blocks = quantize(x, QT[t])
        want = torch.from_numpy(dequantize(blocks, QT[t]).astype(np.float32))
        q, d, m = quant.q5_from_gguf(t, blocks, (12, 256))
        assert q.dtype == torch.uint8 and int(q.max()) <= 31 and int(q.max()) >= 16  # the fifth bit is read
        w = d[..., None] * (q.float().view(12, 8, 32) - 16) if m is None else d[..., None] * q.float().view(12, 8, 32) + m[..., None]
        assert torch.equal(w.view(12, 256), want), t
        split = quant.Int4Linear(quant.int4_from_gguf(t, blocks, (12, 256)))
        assert torch.allclose(split.dequantized_weight(), want, rtol=0, atol=1e-6 * float(want.abs().max())), t
    blocks = quantize(x, QT.Q5_0)
    codes, d = quant.int8g_from_q5_0(blocks, (12, 256))
    layer = quant.Int8GroupLinear(codes, d)
    assert torch.equal(layer.dequantized_weight(), torch.from_numpy(dequantize(blocks, QT.Q5_0)))


def test_gguf_serves_q5_blocks_on_the_int8_and_int4_kernels(tmp_path) -> None:
    """A file in Gemma 3 270M Q4_K_M's mixture of small-block types: q/k/gate/up Q5_0, v
    Q8_0, o Q5_1. Q5_0 with Q8_0 beside it becomes int8 groups; Q5_0 and Q5_1 alone become
    five-bit int4 layers where the build has the nibble kernel (else int8 groups and two int4
    planes); none is left dense, and the logits stay as close to the dequantized model as the
    int8 activations allow."""
    from tokenmill.model.kernels import cpu_kernels

    lib = cpu_kernels.load()
    five = lib is not None and bool(lib.q4_int8_dot)
    cfg = tiny_config()
    path = str(tmp_path / "q5.gguf")
    write_gguf(path, tiny_weights(cfg, seed=8), cfg, qtypes={"v_proj": "Q8_0", "o_proj": "Q5_1", "layers.": "Q5_0"})
    loaded = load_model(path)
    assert {entry[0] for entry in loaded.raw_quantized.values()} == {"Q5_0", "Q5_1", "Q8_0"}
    dense = _engine(loaded)
    native = _engine(loaded, quantization="gguf")
    report = native.model.quant_report
    assert report.quantized["layers.0.self_attn.qkv_proj"] == "Q5_0+Q8_0 (int8 g32)"
    for name in ("layers.0.mlp.gate_up_proj", "layers.0.mlp.down_proj"):
        assert report.quantized[name] == ("Q5_0 (int4 g32, five-bit)" if five else "Q5_0 (int8 g32)")
    assert report.quantized["layers.0.self_attn.o_proj"] == ("Q5_1 (int4 g32, " + ("five-bit" if five else "split") + ")")
    if five:
        down = native.model.layers[0].mlp.down_proj
        assert down.bits == 5 and down.q4_form & cpu_kernels.Q4_FIFTH and down.tiles_vw == lib.vector_width
        assert torch.allclose(down.dequantized_weight(), dense.model.layers[0].mlp.down_proj.weight.float(),
                              rtol=0, atol=1e-6 * float(down.dequantized_weight().abs().max()))
    assert not report.kept
    qkv = native.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, quant.Int8GroupLinear) and qkv.dynamic
    assert torch.equal(qkv.dequantized_weight(), dense.model.layers[0].self_attn.qkv_proj.weight.float())
    got, ref = _logits(native, IDS), _logits(dense, IDS)
    assert _rel(got, ref) < 0.05
    assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.9

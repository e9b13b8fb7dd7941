"""--dtype auto and --quantization auto: decided once, from the device, the CPU and the file."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import bundled_quality, tiny_loaded, tiny_tokenizer
from tokenmill.settings.config import EngineConfig
from tokenmill.engine import auto
from tokenmill.engine.engine import LLMEngine
from tokenmill.model.kernels import cpu_kernels


def test_dtype_auto_follows_native_bf16(monkeypatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setattr(cpu_kernels, "native_bf16", lambda: True)
    assert auto.resolve_dtype("auto", cpu)[0] == "bfloat16"
    monkeypatch.setattr(cpu_kernels, "native_bf16", lambda: False)
    name, why = auto.resolve_dtype("auto", cpu)
    assert name == "float32" and "no native bf16" in why
    assert auto.resolve_dtype("float32", cpu) == ("float32", "as asked")
    assert auto.resolve_dtype("auto", torch.device("cuda"))[0] == "bfloat16"


def test_native_bf16_is_off_when_torch_is_narrowed(monkeypatch) -> None:
    monkeypatch.setenv("TOKENMILL_KERNEL_ISA", "avx2")
    assert not cpu_kernels.native_bf16()


def test_quantization_auto_keeps_gguf_blocks_only_when_there_are_some() -> None:
    with_blocks = SimpleNamespace(raw_quantized={"a.weight": ("Q4_1", None, (4, 32)), "b.weight": ("Q8_0", None, (4, 32))})
    name, why = auto.resolve_quantization("auto", with_blocks)
    assert name == "gguf" and "Q4_1/Q8_0" in why
    assert auto.resolve_quantization("auto", SimpleNamespace(raw_quantized={}))[0] == "none"
    assert auto.resolve_quantization("int8", with_blocks) == ("int8", "as asked")


def test_quantization_auto_takes_w8a8_where_the_cpu_kernels_have_integer_products(monkeypatch) -> None:
    cpu = torch.device("cpu")
    with_blocks = SimpleNamespace(raw_quantized={"a.weight": ("Q4_1", None, (4, 32))})
    lib = SimpleNamespace(int8_dot=True, int8_dot_unit="VNNI")
    monkeypatch.setattr(cpu_kernels, "load", lambda options=None: lib)
    name, why = auto.resolve_quantization("auto", with_blocks, cpu)
    assert name == "w8a8" and "VNNI" in why
    lib.int8_dot_unit = "AVX2 16-bit"  # AVX2 without VNNI: the same sums from 16-bit products
    name, why = auto.resolve_quantization("auto", with_blocks, cpu)
    assert name == "w8a8" and "AVX2 16-bit" in why
    # ... unless the decoder's projections are in Q4 blocks and the build has the nibble kernel
    lib.q8_activations = True
    q4_layers = SimpleNamespace(raw_quantized={
        "model.layers.0.self_attn.q_proj.weight": ("Q4_1", None, (4, 32)),
        "model.layers.0.mlp.down_proj.weight": ("Q4_0", None, (4, 32)),
        "model.embed_tokens.weight": ("Q8_0", None, (4, 32))})
    name, why = auto.resolve_quantization("auto", q4_layers, cpu)
    assert name == "gguf" and "no VNNI" in why
    q8_layer = SimpleNamespace(raw_quantized={**q4_layers.raw_quantized,
                                              "model.layers.1.mlp.up_proj.weight": ("Q8_0", None, (4, 32))})
    assert auto.resolve_quantization("auto", q8_layer, cpu)[0] == "w8a8"  # two nibble passes: slower
    assert auto.resolve_quantization("auto", with_blocks, cpu)[0] == "w8a8"  # no decoder layers in blocks
    lib.int8_dot_unit = "VNNI"
    assert auto.resolve_quantization("auto", q4_layers, cpu)[0] == "w8a8"
    assert auto.resolve_quantization("auto", with_blocks, torch.device("cuda"))[0] == "none"
    assert auto.resolve_quantization("none", with_blocks, cpu) == ("none", "as asked")
    lib.int8_dot = False  # a build without integer products (portable): the GGUF's blocks stay
    assert auto.resolve_quantization("auto", with_blocks, cpu)[0] == "gguf"
    monkeypatch.setattr(cpu_kernels, "load", lambda options=None: None)  # kernels off
    assert auto.resolve_quantization("auto", SimpleNamespace(raw_quantized={}), cpu)[0] == "none"


def test_quantization_auto_keeps_large_q4_files_at_four_bits_on_vnni(monkeypatch) -> None:
    """One stream of a model far past the caches is bound by the bytes a token reads: with the
    VNNI nibble kernel, a Q4 file's blocks stay 4 bits instead of becoming int8 (twice the bytes),
    with AMX tiles too (int8 weights would prefill faster there; the startup line says so)."""
    cpu = torch.device("cpu")
    lib = SimpleNamespace(int8_dot=True, int8_dot_unit="VNNI", q8_activations=False, q4_int8_dot=True, amx=False)
    monkeypatch.setattr(cpu_kernels, "load", lambda options=None: lib)
    big = SimpleNamespace(nbytes=200 * 2**20)

    def q4_file(entry, second="Q4_0"):
        return SimpleNamespace(raw_quantized={"model.layers.0.mlp.down_proj.weight": ("Q4_0", entry, (4, 32)),
                                              "model.layers.1.mlp.down_proj.weight": (second, entry, (4, 32))})

    name, why = auto.resolve_quantization("auto", q4_file(big), cpu)
    assert name == "gguf" and "400 MiB" in why and "bound by the bytes" in why
    for five_bit in ("Q5_0", "Q5_1"):  # a nibble and a fifth bit a weight: the same kernel
        assert auto.resolve_quantization("auto", q4_file(big, five_bit), cpu)[0] == "gguf"
    assert auto.resolve_quantization("auto", q4_file(big, "Q8_0"), cpu)[0] == "w8a8"  # two nibble passes
    assert auto.resolve_quantization("auto", q4_file(SimpleNamespace(nbytes=2**20)), cpu)[0] == "w8a8"  # cached
    lib.amx = True
    name, why = auto.resolve_quantization("auto", q4_file(big), cpu)
    assert name == "gguf" and "AMX" in why
    lib.amx, lib.q4_int8_dot = False, False  # a build without the kernel
    assert auto.resolve_quantization("auto", q4_file(big), cpu)[0] == "w8a8"


def test_kv_pool_auto_is_bf16_around_quantized_cpu_layers_in_float32() -> None:
    cpu, f32 = torch.device("cpu"), torch.float32
    for mode in ("w8a8", "gguf"):
        name, why = auto.resolve_kv_cache_dtype("auto", mode, f32, cpu)
        assert name == "bfloat16" and mode in why
        assert auto.resolve_kv_cache_dtype("auto", mode, f32, cpu, tensor_parallel=True)[0] == "auto"
        assert auto.resolve_kv_cache_dtype("auto", mode, torch.bfloat16, cpu)[0] == "auto"
    assert auto.resolve_kv_cache_dtype("auto", "none", f32, cpu)[0] == "auto"  # the exact reference
    assert auto.resolve_kv_cache_dtype("auto", "gguf", f32, torch.device("cuda"))[0] == "auto"
    assert auto.resolve_kv_cache_dtype("int8", "gguf", f32, cpu) == ("int8", "as asked")


def test_engine_resolves_auto_once_at_build(monkeypatch, caplog) -> None:
    monkeypatch.setattr(cpu_kernels, "native_bf16", lambda: False)
    cfg = EngineConfig.from_options(dtype="auto", quantization="auto", num_blocks=32)
    with caplog.at_level("INFO", logger="tokenmill.engine"):
        engine = LLMEngine(cfg, loaded=tiny_loaded(), tokenizer=tiny_tokenizer())
    lib = cpu_kernels.load()
    vnni = lib is not None and lib.int8_dot
    assert engine.dtype == torch.float32 and engine.config.quantization == ("w8a8" if vnni else "none")
    assert "chosen for this machine: dtype float32" in caplog.text


def test_w8a8_keeps_the_rest_of_the_model_in_float32(monkeypatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setattr(cpu_kernels, "native_bf16", lambda: True)
    name, why = auto.resolve_dtype("auto", cpu, int8_activations=True)
    assert name == "float32" and "w8a8" in why
    assert auto.resolve_dtype("bfloat16", cpu, int8_activations=True) == ("bfloat16", "as asked")
    monkeypatch.setattr(cpu_kernels, "load", lambda options=None: SimpleNamespace(int8_dot=True))
    assert auto.int8_compute("auto", cpu) and auto.int8_compute("w8a8", cpu)
    assert not auto.int8_compute("none", cpu) and not auto.int8_compute("auto", torch.device("cuda"))
    monkeypatch.setattr(cpu_kernels, "load", lambda options=None: SimpleNamespace(int8_dot=False))
    assert not auto.int8_compute("auto", cpu)


# The quality gate the default configuration is held to (docs/quantization.md): on the
# bundled model and its sample text, against float32, whatever this machine's default is.
DEFAULT_MAX_PPL_INCREASE = 0.015
DEFAULT_MIN_NEXT_TOKEN_AGREEMENT = 0.95


@pytest.mark.slow
def test_the_default_configuration_holds_the_quality_gate(real_loaded, real_tokenizer) -> None:
    comp = bundled_quality(real_loaded, real_tokenizer, "default", DEFAULT_MAX_PPL_INCREASE)
    assert comp.ppl_increase <= DEFAULT_MAX_PPL_INCREASE, comp
    assert comp.next_token_agreement >= DEFAULT_MIN_NEXT_TOKEN_AGREEMENT, comp

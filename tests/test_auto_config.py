"""--dtype auto and --quantization auto: decided once, from the device, the CPU and the file."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from conftest import tiny_loaded, tiny_tokenizer
from tokenmill.config import EngineConfig
from tokenmill.engine import auto
from tokenmill.engine.engine import LLMEngine
from tokenmill.model import cpu_kernels


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


def test_engine_resolves_auto_once_at_build(monkeypatch, caplog) -> None:
    monkeypatch.setattr(cpu_kernels, "native_bf16", lambda: False)
    cfg = EngineConfig.from_options(dtype="auto", quantization="auto", num_blocks=32)
    with caplog.at_level("INFO", logger="tokenmill.engine"):
        engine = LLMEngine(cfg, loaded=tiny_loaded(), tokenizer=tiny_tokenizer())
    assert engine.dtype == torch.float32 and engine.config.quantization == "none"
    assert "chosen for this machine: dtype float32" in caplog.text

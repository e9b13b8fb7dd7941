"""``--dtype auto`` and ``--quantization auto``: the fastest sound choice for this machine.

Decided once, when the engine is built, from the device, the CPU's features and
what the model file holds:

* dtype: bfloat16 on CUDA and on CPUs that multiply bf16 natively (AVX512-BF16
  or AMX); float32 elsewhere, where bf16 matmuls are emulated and slower than
  float32.
* quantization: a GGUF file whose linear layers are stored in Q4_0 / Q4_1 /
  Q8_0 blocks keeps them (``gguf``), as llama.cpp serves them: the same
  weights the float path would dequantize, read at a quarter to half of the
  bytes by the int4 kernels; anything else stays dense (``none``).

``--dtype float32 --quantization none`` stays the exact reference.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("tokenmill.engine")


def resolve_dtype(name: str, device: torch.device) -> tuple[str, str]:
    """(dtype name, why) for ``name`` ("auto" or an explicit dtype)."""
    if str(name).lower() != "auto":
        return name, "as asked"
    if device.type == "cuda":
        return "bfloat16", "CUDA device"
    if device.type == "cpu":
        from ..model.cpu_kernels import native_bf16

        if native_bf16():
            return "bfloat16", "this CPU multiplies bf16 natively"
        return "float32", "this CPU has no native bf16 (it would be emulated, slower than float32)"
    return "float32", f"{device.type} device"


def resolve_quantization(name: str, loaded: Any) -> tuple[str, str]:
    """(quantization mode, why) for ``name`` ("auto" or an explicit mode)."""
    if str(name or "none").lower() != "auto":
        return name, "as asked"
    raw = getattr(loaded, "raw_quantized", None) or {}
    if raw:
        kinds = sorted({entry[0] for entry in raw.values()})
        return "gguf", f"the file stores {len(raw)} tensors as {'/'.join(kinds)} blocks, kept as they are"
    return "none", "the file holds no quantized blocks with a kernel here"


def describe(dtype: tuple[str, str], quantization: tuple[str, str]) -> str:
    return f"dtype {dtype[0]} ({dtype[1]}), quantization {quantization[0]} ({quantization[1]})"

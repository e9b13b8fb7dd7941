"""``--dtype auto`` and ``--quantization auto``: the fastest sound choice for this machine.

Decided once, when the engine is built, from the device, the CPU's features and
what the model file holds:

* quantization, on a CPU whose kernel build multiplies int8 by int8 activations
  (``KernelLibrary.int8_dot``: VNNI, or on AVX2 without it 16-bit products of the
  same exact sums, so the same results at about twice float32's rate): ``w8a8``, int8 weights with a scale per output
  channel (a GGUF's blocks are dequantized, then requantized), 8-bit activations
  per token (int8 x int8 products) at every batch size, so that a request's
  tokens do not depend on what shares its steps; the down projections are int8
  with a scale per 32 inputs and take 8-bit activations with a scale per 32
  inputs, the last decoder layers 16-bit activations, and the LM head is int8
  with a scale per 32 inputs (GGUF Q8_0's layout), which keeps it within the
  quality gate in docs/quantization.md (a test holds the default to it). The KV pool is bf16, widened to float32 as
  attention reads it, or met by bf16-rounded queries and weights where the CPU multiplies
  bf16 natively (``resolve_kv_cache_dtype``); with int8 codes there the
  pair passed the gate's figures but answered the bundled model's plainest
  question wrongly (docs/quantization.md).
* except on such a CPU without VNNI (AVX2's 16-bit products), when the file stores its
  decoder projections in Q4_0 / Q4_1 blocks (or Q5_0 / Q5_1: a nibble and a fifth bit):
  ``gguf``, those blocks as they are, multiplied by int8 activations (a scale per 32
  inputs) in 8-bit products, whose 4-bit codes let eight products add up in 16 bits (9
  multiplies per 256 products, where int8 weights need 16 there); its Q8_0 LM head stays
  int8 with a scale per 32 inputs, and the KV pool is bf16 as above. The weights are the
  file's, so it is closer to the float32 model than w8a8 (docs/quantization.md). With
  VNNI, the same for such a file whose decoder is past the caches (one stream's decode
  reads the file's 4-5 bits a weight, not int8's 8).
* dtype: with w8a8 layers, float32 for the rest of the model (bf16 there costs
  next-token agreement); otherwise bfloat16 on CUDA and on CPUs that multiply
  bf16 natively (AVX512-BF16 or AMX), and float32 elsewhere, where bf16
  matmuls are emulated and slower than float32.
* on CUDA, dense (``none``, with bf16 below): the configuration measured there.
* elsewhere (no AVX2, or the C kernels off), a GGUF file whose linear layers are stored in Q4_0 / Q4_1 / Q8_0
  blocks keeps them (``gguf``), as llama.cpp serves them: the same weights the
  float path would dequantize, read at a quarter to half of the bytes by the
  int4 kernels; anything else stays dense (``none``).

``--dtype float32 --quantization none`` stays the exact reference.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from ..settings.options import KernelOptions

log = logging.getLogger("tokenmill.engine")


def int8_compute(quantization: str, device: torch.device, options: KernelOptions | None = None) -> bool:
    """Whether the model will multiply int8 activations: ``w8a8`` asked for, or ``auto`` on
    a CPU whose kernel build has integer dot products (VNNI, or AVX2's 16-bit ones)."""
    mode = str(quantization or "none").lower()
    if mode == "w8a8":
        return True
    if mode != "auto" or device.type != "cpu":
        return False
    from ..model.kernels.cpu_kernels import load

    lib = load(options)
    return lib is not None and lib.int8_dot


def resolve_dtype(name: str, device: torch.device, int8_activations: bool = False) -> tuple[str, str]:
    """(dtype name, why) for ``name`` ("auto" or an explicit dtype). ``int8_activations``:
    the layers will run w8a8 (see ``int8_compute``)."""
    if str(name).lower() != "auto":
        return name, "as asked"
    if device.type == "cuda":
        return "bfloat16", "CUDA device"
    if device.type == "cpu":
        from ..model.kernels.cpu_kernels import native_bf16

        if not native_bf16():
            return "float32", "this CPU has no native bf16 (it would be emulated, slower than float32)"
        if int8_activations:
            return "float32", ("w8a8 layers; float32 for the rest, where bf16 would cost next-token agreement "
                               "with the float32 model (docs/quantization.md)")
        return "bfloat16", "this CPU multiplies bf16 natively"
    return "float32", f"{device.type} device"


def resolve_engine_dtype(config: Any, device: torch.device | None = None) -> tuple[str, str]:
    """(dtype name, why) that an ``EngineConfig``'s dtype means on this machine: what the
    engine builds with (``builder.build_engine``) and what the command line asks before
    anything loads; the only place ``--dtype auto`` is resolved."""
    device = device or torch.device(config.device)
    return resolve_dtype(config.dtype, device, int8_compute(config.quantization, device, config.kernel_options))


def resolve_quantization(name: str, loaded: Any, device: torch.device | None = None,
                         options: KernelOptions | None = None) -> tuple[str, str]:
    """(quantization mode, why) for ``name`` ("auto" or an explicit mode)."""
    if str(name or "none").lower() != "auto":
        return name, "as asked"
    if device is not None and device.type == "cuda":
        return "none", "dense bf16 is what was measured fastest on CUDA; a file's blocks are dequantized"
    raw = getattr(loaded, "raw_quantized", None) or {}
    kquants = sorted({entry[0] for key, entry in raw.items() if ".layers." in key and entry[0].endswith("_K")})
    if kquants and (device is None or device.type == "cpu"):
        return "gguf", (f"the file's decoder projections are {'/'.join(kquants)} blocks: kept as they are (its exact "
                        "weights at its own size), their codes multiplied by int8 activations with a scale per 32 "
                        "inputs (in tiles of the blocks' own codes and factors where the kernels have integer dot "
                        "products; elsewhere decode rows do so on the blocks and prefill chunks widen them)")
    if device is not None and int8_compute(name, device, options):
        from ..model.kernels.cpu_kernels import load

        lib = load(options)
        unit = getattr(lib, "int8_dot_unit", "") or "integer"
        if unit != "VNNI" and getattr(lib, "q8_activations", False) and _layers_in_int4_blocks(raw):
            return "gguf", ("no VNNI here: the file's Q4/Q5 blocks, multiplied by int8 activations in 8-bit products "
                            "(9 multiplies per 256 products for 4-bit codes, where int8 weights need 16), are this "
                            "CPU's fastest kernel; its Q8_0 LM head kept as int8 with a scale per 32 inputs")
        layer_bytes = _layer_bytes(raw)
        if (unit == "VNNI" and getattr(lib, "q4_int8_dot", False) and _layers_in_int4_blocks(raw)
                and layer_bytes >= MEMORY_BOUND_LAYER_BYTES):
            prefill = ("AMX tiles would prefill int8 weights faster, but every decoded token would read twice the "
                       "bytes" if getattr(lib, "amx", False) else "without AMX tiles int8 weights gain little in prefill")
            return "gguf", (f"the decoder's {layer_bytes / 2**20:.0f} MiB of Q4/Q5 blocks are far past the caches, "
                            "so one stream's decode is bound by the bytes a token reads: kept at 4-5 bits (int8 would "
                            f"read more, and requantize the file's weights), multiplied by int8 activations "
                            f"with VNNI; {prefill}")
        return "w8a8", (f"int8 x int8 {unit} products are this CPU's fastest kernel for batches and as fast as any "
                        "for one stream; weights requantized to int8 per output channel, LM head int8 with a scale "
                        "per 32 inputs")
    if raw:
        kinds = sorted({entry[0] for entry in raw.values()})
        return "gguf", f"the file stores {len(raw)} tensors as {'/'.join(kinds)} blocks, kept as they are"
    return "none", "the file holds no quantized blocks with a kernel here"


# Decoder weights past this many bytes make one stream's decode memory-bound on any CPU
# (a quarter GiB is several times the largest last-level caches a 2-8 core machine has).
MEMORY_BOUND_LAYER_BYTES = 256 * 2**20


def _layer_bytes(raw: dict[str, Any]) -> int:
    """Bytes of the decoder's quantized projections as the file stores them."""
    return sum(int(getattr(entry[1], "nbytes", 0)) for key, entry in raw.items() if ".layers." in key)


def _layers_in_int4_blocks(raw: dict[str, Any]) -> bool:
    """Whether every decoder projection the file stores quantized is in Q4_0 / Q4_1 / Q5_0 /
    Q5_1 blocks (the nibble kernel's, the Q5 ones with their fifth bits beside the nibbles;
    Q8_0 layers there would take two passes of it)."""
    kinds = [entry[0] for key, entry in raw.items() if ".layers." in key]
    return bool(kinds) and all(kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1") for kind in kinds)


def resolve_kv_cache_dtype(name: str | None, quantization: str, compute: torch.dtype,
                           device: torch.device, tensor_parallel: bool = False) -> tuple[str, str]:
    """(KV pool dtype name, why) for ``--kv-cache-dtype name``: ``auto`` is the compute
    dtype, except under w8a8 or gguf on a CPU in float32 (around int8 or int4 layers), whose
    pool is bf16: the kernels widen its rows as they read them, so decode attention, a large
    part of a many-stream step there, reads half the bytes, for 0.3 points of next-token
    agreement under w8a8 (docs/quantization.md). Tensor-parallel ranks keep their pool in the compute dtype."""
    if str(name or "auto").lower() != "auto":
        return str(name), "as asked"
    mode = str(quantization).lower()
    if mode in ("w8a8", "gguf") and device.type == "cpu" and compute == torch.float32 and not tensor_parallel:
        return "bfloat16", f"{mode}: rows stored in bf16 and widened as attention reads them, half the bytes"
    return "auto", "the compute dtype"


def describe(dtype: tuple[str, str], quantization: tuple[str, str], kv: tuple[str, str] | None = None) -> str:
    text = f"dtype {dtype[0]} ({dtype[1]}), quantization {quantization[0]} ({quantization[1]})"
    if kv is not None and kv[1] != "as asked" and kv[0] != "auto":
        text += f", KV cache {kv[0]} ({kv[1]})"
    return text

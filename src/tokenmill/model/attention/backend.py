"""The choice of one attention backend per engine, from one table of backends by name.

A backend is chosen once, when the engine is built, from the device, the KV
pool's dtype and the ``KernelOptions``:

* ``CpuKernelAttention`` (``cpu_kernel.py``): the C kernels, reading the pool
  in place (CPU, float32, bf16 or int8 / fp8 pool, kernels compiled);
* ``TorchPagedAttention`` (``torch_paged.py``): plain torch over gathered
  blocks (CUDA, and CPUs without the kernels);
* ``ReferenceAttention`` (``reference.py``): the plain formulation with fresh
  gathers, for tests and the benchmarks' eager baseline
  (``TOKENMILL_ATTENTION=reference``).

Each step the runner builds one ``StepLayout``; the backend's ``prepare``
turns it into a ``StepAttention`` (``protocol.py``), the per-step metadata its
kernels read (built once, for every layer), which the model's attention
layers call to store new K/V and to attend. A quantized pool
(model/quant/kv_quant.py) comes with its (K, V) scales in both calls. Each
backend class declares its ``BackendCapabilities`` (CUDA-graph capture,
quantized pools, sliding windows), which the runner asks once, when the engine
is built, and builds itself from a ``BackendSpec``. A new backend is a new
module here implementing ``AttentionBackend`` and a row in ``BACKENDS``.
"""
from __future__ import annotations

import logging

import torch

from ...settings.options import KernelOptions
from ..kernels import cpu_kernels
from .cpu_kernel import CpuKernelAttention
from .layout import BackendCapabilities, StepLayout
from .protocol import (AttentionBackend, BackendSpec, GraphCaptureUnsupported, NoGraphCapture,
                       StepAttention)
from .reference import ReferenceAttention
from .torch_paged import TorchPagedAttention

log = logging.getLogger("tokenmill.attention")

__all__ = ["AttentionBackend", "BACKENDS", "BackendCapabilities", "BackendSpec", "GraphCaptureUnsupported",
           "NoGraphCapture", "StepAttention", "StepLayout", "attention_backend_class", "kernel_attention_fits",
           "select_attention_backend"]

# Every backend, by the name ``KernelOptions.attention`` (``TOKENMILL_ATTENTION``) and the
# automatic choice below use.
BACKENDS: dict[str, type[AttentionBackend]] = {
    "reference": ReferenceAttention,
    "cpu_kernels": CpuKernelAttention,
    "torch_paged": TorchPagedAttention,
}


def kernel_attention_fits(device: torch.device, dtype: torch.dtype, head_dim: int,
                          library: cpu_kernels.KernelLibrary | None) -> bool:
    """Whether the C kernels take a pool on ``device`` in ``dtype`` with this head size."""
    return (device.type == "cpu" and library is not None and cpu_kernels.attention_dtype_ok(dtype)
            and head_dim % library.vector_width == 0)


def attention_backend_class(device: torch.device, dtype: torch.dtype, options: KernelOptions,
                            library: cpu_kernels.KernelLibrary | None, head_dim: int,
                            kv_dtype: torch.dtype | None = None, windowed: bool = False,
                            softcapped: bool = False) -> type[AttentionBackend]:
    """The class of the engine's backend (its ``capabilities`` can be asked before one is
    built): the one named in the options, else the C kernels where they take this pool
    (and the model's masks), torch paged attention elsewhere. ``dtype``: the compute
    dtype; ``kv_dtype``: the pool's, when it differs; ``windowed``: the model has
    sliding-window layers; ``softcapped``: soft-capped attention scores
    (``BackendCapabilities.takes``)."""
    if options.attention != "auto":
        return BACKENDS[options.attention]
    kernels = BACKENDS["cpu_kernels"]
    if kernel_attention_fits(device, kv_dtype or dtype, head_dim, library) and \
            kernels.capabilities.takes(windowed, softcapped):
        return kernels
    return BACKENDS["torch_paged"]


def select_attention_backend(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, num_blocks: int,
                             options: KernelOptions, library: cpu_kernels.KernelLibrary | None,
                             head_dim: int, kv_dtype: torch.dtype | None = None,
                             windowed: bool = False, softcapped: bool = False) -> AttentionBackend:
    """The engine's backend (``attention_backend_class``), built for this pool."""
    cls = attention_backend_class(device, dtype, options, library, head_dim, kv_dtype, windowed, softcapped)
    if (softcapped and options.attention == "auto" and cls is not BACKENDS["cpu_kernels"]
            and kernel_attention_fits(device, kv_dtype or dtype, head_dim, library)):
        log.info("attention: the C kernels have no soft-capping; torch paged attention takes this model")
    backend = cls.build(BackendSpec(dtype, device, heads, kv_heads, num_blocks, head_dim, options, library))
    if kv_dtype is not None and kv_dtype != dtype and kv_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        assert backend.capabilities.quantized_pool, f"{backend.name} cannot read a quantized pool"
    log.info("attention backend: %s", backend.name)
    return backend

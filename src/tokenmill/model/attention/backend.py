"""The interface every attention backend implements, and the choice of one per engine.

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
turns it into a ``StepAttention``, the per-step metadata its kernels read
(built once, for every layer), which the model's attention layers call to
store new K/V and to attend. A quantized pool (model/quant/kv_quant.py) comes with
its (K, V) scales in both calls. Each backend class declares its
``BackendCapabilities`` (CUDA-graph capture, quantized pools, sliding windows),
which the runner asks once, when the engine is built. A new backend is a new
module here with a ``prepare``, a ``StepAttention`` and its ``capabilities``,
and a line in ``attention_backend_class``.
"""
from __future__ import annotations

import logging
from typing import Protocol

import torch

from ...settings.options import KernelOptions
from ..kernels import cpu_kernels
from .layout import BackendCapabilities, StepLayout

log = logging.getLogger("tokenmill.attention")


class StepAttention(Protocol):
    """One step's attention, prepared by a backend for every layer of the step."""

    layout: StepLayout

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_scales: tuple[torch.Tensor, ...] | None = None) -> None:
        """Store the step's new keys/values ([T, kv_heads, head_dim]) at their slots."""
        ...

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
               kv_scales: tuple[torch.Tensor, ...] | None = None, window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:
        """Causal attention of every query row ([T, heads, head_dim]) over its sequence's context
        (only its last ``window`` positions in a sliding-window layer; scores soft-capped at
        ``softcap``, Gemma 2)."""
        ...


class AttentionBackend(Protocol):
    name: str
    capabilities: BackendCapabilities

    def prepare(self, layout: StepLayout) -> StepAttention:
        ...


def kernel_attention_fits(device: torch.device, dtype: torch.dtype, head_dim: int,
                          library: cpu_kernels.KernelLibrary | None) -> bool:
    """Whether the C kernels take a pool on ``device`` in ``dtype`` with this head size."""
    return (device.type == "cpu" and library is not None and cpu_kernels.attention_dtype_ok(dtype)
            and head_dim % library.vector_width == 0)


def attention_backend_class(device: torch.device, dtype: torch.dtype, options: KernelOptions,
                            library: cpu_kernels.KernelLibrary | None, head_dim: int,
                            kv_dtype: torch.dtype | None = None, windowed: bool = False,
                            softcapped: bool = False) -> type:
    """The class of the engine's backend (its ``capabilities`` can be asked before one is
    built): reference when asked for, the C kernels where they take this pool (and the
    model's masks), torch paged attention elsewhere. ``dtype``: the compute dtype;
    ``kv_dtype``: the pool's, when it differs; ``windowed``: the model has sliding-window
    layers; ``softcapped``: soft-capped attention scores (``BackendCapabilities.takes``)."""
    from .cpu_kernel import CpuKernelAttention
    from .reference import ReferenceAttention
    from .torch_paged import TorchPagedAttention

    if options.attention == "reference":
        return ReferenceAttention
    if kernel_attention_fits(device, kv_dtype or dtype, head_dim, library) and \
            CpuKernelAttention.capabilities.takes(windowed, softcapped):
        return CpuKernelAttention
    return TorchPagedAttention


def select_attention_backend(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, num_blocks: int,
                             options: KernelOptions, library: cpu_kernels.KernelLibrary | None,
                             head_dim: int, kv_dtype: torch.dtype | None = None,
                             windowed: bool = False, softcapped: bool = False) -> AttentionBackend:
    """The engine's backend (``attention_backend_class``), built for this pool."""
    from .cpu_kernel import CpuKernelAttention
    from .torch_paged import TorchPagedAttention

    cls = attention_backend_class(device, dtype, options, library, head_dim, kv_dtype, windowed, softcapped)
    if cls is CpuKernelAttention:
        assert library is not None
        backend: AttentionBackend = CpuKernelAttention(library)
    elif cls is TorchPagedAttention:
        if softcapped and kernel_attention_fits(device, kv_dtype or dtype, head_dim, library):
            log.info("attention: the C kernels have no soft-capping; torch paged attention takes this model")
        backend = TorchPagedAttention(dtype, device, kv_heads, heads, num_blocks, head_dim,
                                      batched_prefill=options.batched_prefill)
    else:
        backend = cls()
    if kv_dtype is not None and kv_dtype != dtype and kv_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        assert backend.capabilities.quantized_pool, f"{backend.name} cannot read a quantized pool"
    log.info("attention backend: %s", backend.name)
    return backend

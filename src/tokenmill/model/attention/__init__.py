"""Attention over the paged KV cache for one flattened, mixed batch.

``layout.py``: the step layout every backend starts from. ``protocol.py``: the
backend interface (graph capture included). ``backend.py``: the table of
backends by name and the choice of one per engine. One module per backend:
``cpu_kernel.py`` (C kernels, in place), ``torch_paged.py`` (plain torch:
CUDA and kernel-less CPUs), ``reference.py`` (the yardstick for tests).
"""
from .backend import (BACKENDS, AttentionBackend, BackendCapabilities, BackendSpec, GraphCaptureUnsupported,
                      NoGraphCapture, StepAttention, attention_backend_class, kernel_attention_fits,
                      select_attention_backend)
from .cpu_kernel import CpuKernelAttention, CpuKernelStep
from .layout import StepLayout, kv_cache_shape
from .reference import ReferenceAttention, paged_attention_reference
from .torch_paged import TorchPagedAttention, TorchPagedStep

__all__ = ["BACKENDS", "BackendSpec", "GraphCaptureUnsupported", "NoGraphCapture", "AttentionBackend", "BackendCapabilities", "attention_backend_class", "StepAttention", "kernel_attention_fits", "select_attention_backend", "CpuKernelAttention", "CpuKernelStep",
           "StepLayout", "kv_cache_shape", "ReferenceAttention", "paged_attention_reference",
           "TorchPagedAttention", "TorchPagedStep"]

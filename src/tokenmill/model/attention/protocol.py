"""The interface every attention backend implements.

``StepAttention``: one step's attention, prepared for every layer (store the
new K/V, attend). ``AttentionBackend``: what an engine builds once
(``build`` from a ``BackendSpec``) and asks each step to ``prepare``; it
declares its ``BackendCapabilities`` and, for CUDA graph capture, a
``graph_decode_step`` built from a graph's static tensors. Backends that
cannot be captured inherit ``NoGraphCapture``'s answer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ...settings.options import KernelOptions
from ..kernels import cpu_kernels
from .layout import BackendCapabilities, StepLayout


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
    """A backend: built once per engine (``build``), it prepares every step's attention."""

    name: str
    capabilities: BackendCapabilities

    @classmethod
    def build(cls, spec: BackendSpec) -> "AttentionBackend":
        """The backend for an engine's pool."""
        ...

    def prepare(self, layout: StepLayout) -> StepAttention:
        ...

    def graph_decode_step(self, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                          key_pos: torch.Tensor, batch: int, width: int, block_size: int) -> StepAttention:
        """A pure-decode step built on the device from a CUDA graph's static tensors (slots,
        padded block tables and context lengths of ``batch`` rows, ``width`` blocks each), for
        graph capture (``engine/step/cuda_graphs.py``). Backends whose ``capabilities`` do not
        declare ``cuda_graphs`` answer with ``GraphCaptureUnsupported`` (``NoGraphCapture``)."""
        ...


@dataclass(frozen=True)
class BackendSpec:
    """What a backend is built for: the compute dtype, the device, the pool's geometry and
    the kernels the engine chose."""

    dtype: torch.dtype
    device: torch.device
    heads: int
    kv_heads: int
    num_blocks: int
    head_dim: int
    options: KernelOptions
    library: cpu_kernels.KernelLibrary | None


class GraphCaptureUnsupported(TypeError):
    """The backend's steps cannot be recorded in a CUDA graph."""


class NoGraphCapture:
    """The answer of a backend that cannot be captured: the runner asks its
    ``capabilities`` first and never calls this; anything that does is told plainly."""

    name: str

    def graph_decode_step(self, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                          key_pos: torch.Tensor, batch: int, width: int, block_size: int) -> StepAttention:
        raise GraphCaptureUnsupported(f"the {self.name} backend cannot be captured in a CUDA graph")

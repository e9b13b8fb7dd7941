"""Paged attention through the C kernels, reading the pool in place (CPU).

Decodes go through ``cpu_kernels.paged_decode_attention`` (``csrc/
paged_attention.c``): one (sequence, KV head) pair per OpenMP work item, the
head's whole query group at once, float32 accumulation. It skips the gather
copy, which cost more than the attention math. Each sequence's result depends
only on its own context (bit for bit, whatever else is in the batch); against
the reference it differs by float rounding (its own exp, a different
summation order), ~1e-6 in float32.

Prefill chunks go through ``cpu_kernels.paged_prefill_attention`` (``csrc/
prefill_attention.c``): one sequence per call, causal flash-style attention
with register-tiled score and output matmuls, reading the cached prefix and
the chunk's own K/V in place. New K/V are stored by ``cpu_kernels.store_kv``
in one pass; into a quantized pool, by ``cpu_kernels.store_kv_quant``, which both
attention kernels then read in place (model/quant/kv_quant.py).

The backend is chosen only for pools the kernels take (float32 or bf16, a
head size that is a multiple of the vector width), so every call here runs
the kernel; a tensor it refuses anyway is a bug, raised as such.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import cpu_kernels
from .layout import BackendCapabilities, StepLayout
from .protocol import BackendSpec, NoGraphCapture


@dataclass(frozen=True)
class CpuKernelStep:
    """One step's int32 tables, built once in ``prepare`` for every layer."""

    layout: StepLayout
    library: cpu_kernels.KernelLibrary
    decode_seq_lens: torch.Tensor  # [num_decodes] int32 context lengths
    decode_block_tables: torch.Tensor  # [num_decodes, decode_blocks] int32, contiguous
    block_tables: torch.Tensor  # [B, max_blocks] int32, contiguous (prefill chunks read their rows)

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_scales: tuple[torch.Tensor, ...] | None = None) -> None:
        slots = self.layout.slot_mapping
        if kv_scales:
            stored = cpu_kernels.store_kv_quant(k_cache, v_cache, kv_scales[0], kv_scales[1], k, v, slots,
                                                self.library)
        else:
            stored = cpu_kernels.store_kv(k_cache, v_cache, k, v, slots, self.library)
        if not stored:
            raise RuntimeError(f"store_kv: the C kernel refused K/V of {tuple(k.shape)} {k.dtype} "
                               f"into a {tuple(k_cache.shape)} {k_cache.dtype} pool")

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
               kv_scales: tuple[torch.Tensor, ...] | None = None, window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:
        if softcap is not None:  # never chosen for such a model: a bug if reached
            raise RuntimeError("the C attention kernels have no soft-capping")
        out = torch.empty_like(q)
        layout = self.layout
        nd = layout.num_decodes
        if nd and not cpu_kernels.paged_decode_attention(q[:nd], k_cache, v_cache, self.decode_block_tables,
                                                         self.decode_seq_lens, scale, out[:nd], self.library,
                                                         kv_scales, window):
            raise RuntimeError(f"paged_decode_attention: the C kernel refused q {tuple(q.shape)} {q.dtype}")
        start = nd
        for i in range(nd, layout.num_seqs):
            qlen = layout.query_lens[i]
            if not cpu_kernels.paged_prefill_attention(q[start:start + qlen], k_cache, v_cache, self.block_tables[i],
                                                       layout.seq_lens[i], scale, out[start:start + qlen],
                                                       self.library, kv_scales, window):
                raise RuntimeError(f"paged_prefill_attention: the C kernel refused q {tuple(q.shape)} {q.dtype}")
            start += qlen
        return out


class CpuKernelAttention(NoGraphCapture):
    name = "C kernels (paged, in place)"
    capabilities = BackendCapabilities(quantized_pool=True, windows=True)  # no soft-capped scores

    def __init__(self, library: cpu_kernels.KernelLibrary) -> None:
        self.library = library

    @classmethod
    def build(cls, spec: BackendSpec) -> "CpuKernelAttention":
        assert spec.library is not None, "chosen only where the kernels compiled"
        return cls(spec.library)

    def prepare(self, layout: StepLayout) -> CpuKernelStep:
        nd = layout.num_decodes
        tables = layout.block_tables.to(torch.int32).contiguous()
        return CpuKernelStep(layout, self.library, torch.tensor(layout.seq_lens[:nd], dtype=torch.int32),
                             tables[:nd, : layout.decode_blocks].contiguous(), tables)

"""The plain formulation of paged attention, with fresh gathers: the yardstick.

Tests compare every backend with it, and the benchmarks' eager baseline runs it
(``TOKENMILL_ATTENTION=reference``). It builds its metadata in ``prepare`` like
any backend, but gathers fresh copies in every layer and never pads prefills.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import BackendCapabilities, StepLayout
from .protocol import BackendSpec, NoGraphCapture
from .torch_paged import (decode_gather_index, decode_mask, decode_queries, gather_decodes, prefill_attention,
                          soft_cap, window_mask, write_decode_output, write_kv)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: StepLayout,
                              scale: float, kv_scales: tuple[torch.Tensor, ...] | None = None,
                              window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of every query token over its sequence's cached context
    (fresh gather copies, matmul + float32 softmax; a quantized pool's blocks dequantized
    to float32 as they are gathered)."""
    kv_heads, num_blocks = k_cache.shape[0], k_cache.shape[1]
    out = torch.empty_like(q)
    nd = layout.num_decodes
    if nd:
        blocks = layout.decode_blocks
        index = decode_gather_index(layout.block_tables[:nd, :blocks], kv_heads, num_blocks)
        ks, vs = kv_scales if kv_scales else (None, None)
        wide = q.dtype if k_cache.dtype in (torch.float32, torch.bfloat16) else torch.float32
        k = gather_decodes(k_cache, index, nd, None, ks, wide)
        v = gather_decodes(v_cache, index, nd, None, vs, wide)
        qd = decode_queries(q, nd, kv_heads).to(k.dtype)
        scores = soft_cap(torch.matmul(qd, k.transpose(-1, -2)).float() * scale, softcap)  # [kv, nd, group, span]
        lens = torch.tensor(layout.seq_lens[:nd], device=q.device)
        span = blocks * layout.block_size
        mask = (decode_mask(lens, span, torch.float32) if window is None
                else window_mask(lens, span, window, torch.float32))
        probs = torch.softmax(scores + mask, dim=-1).to(v.dtype)
        write_decode_output(torch.matmul(probs, v), out, nd)
    prefill_attention(q, k_cache, v_cache, layout, scale, out, kv_scales, window, softcap)
    return out


@dataclass(frozen=True)
class ReferenceStep:
    layout: StepLayout

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_scales: tuple[torch.Tensor, ...] | None = None) -> None:
        write_kv(k_cache, v_cache, k, v, self.layout.slot_mapping, kv_scales)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
               kv_scales: tuple[torch.Tensor, ...] | None = None, window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:
        return paged_attention_reference(q, k_cache, v_cache, self.layout, scale, kv_scales, window, softcap)


class ReferenceAttention(NoGraphCapture):
    name = "reference attention"
    capabilities = BackendCapabilities(quantized_pool=True, masks=True)

    @classmethod
    def build(cls, spec: BackendSpec) -> "ReferenceAttention":
        return cls()

    def prepare(self, layout: StepLayout) -> ReferenceStep:
        return ReferenceStep(layout)

"""Paged attention in plain torch: CUDA, and CPUs without the C kernels.

Decodes: their blocks are gathered with one ``index_select`` into a flat
workspace the backend allocates once and reuses every step and layer (with
the head outermost, each sequence's context per KV head comes out as one
contiguous ``[span, head_dim]`` matrix, which the matmuls read fastest), then
attended as ``[kv_heads, num_decodes, group, head_dim]`` queries (a query
head group read as rows of its KV head). float32 keeps the reference's exact
ops (matmul, float32 softmax, matmul); bf16 uses
``scaled_dot_product_attention`` at small batches and the matmul form at
large ones.

Prefill chunks: off the CPU, two or more chunks go through one SDPA call over
a padded batch (``PaddedPrefill``: a fixed handful of kernels per layer
instead of ~10 per chunk launched from Python); a lone chunk, and the CPU,
go one sequence at a time through SDPA.

Everything a step's layers read (mask, gather index, padded layout) is built
in ``prepare``, once per step. CUDA graphs record decode steps through
``graph_decode_step``, which builds the same metadata on the device from the
graph's static tensors.

A quantized pool (int8 / fp8 codes with per-block scales, model/quant/kv_quant.py)
is written by ``kv_quant.store`` and dequantized as its blocks are gathered
(no workspace then: the dequantization makes the copy).
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..quant import kv_quant
from .layout import BackendCapabilities, StepLayout
from .protocol import BackendSpec

log = logging.getLogger("tokenmill.attention")


@functools.cache
def _cpu_flash_unusable(dtype: torch.dtype) -> bool:
    """Whether SDPA's CPU flash kernel fails for ``dtype`` in this process. It chooses its
    bf16 packing by the CPU's own flags but packs under torch's dispatch capability, so a
    process narrowed with ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU raises on every bf16
    call past a few rows. Asked once per dtype, with the shape that reaches the packing."""
    q = torch.zeros(1, 1, 64, 64, dtype=dtype)
    try:
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    except RuntimeError as exc:
        log.info("SDPA's CPU flash kernel fails for %s here (%s); attention uses its math backend", dtype, exc)
        return True
    return False


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention``, on the math backend where the CPU flash kernel
    cannot run for this dtype (:func:`_cpu_flash_unusable`)."""
    if q.device.type == "cpu" and q.dtype != torch.float32 and _cpu_flash_unusable(q.dtype):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)

# bf16 SDPA reads the gathered cache slowly at large batches; above this many
# gathered key rows the matmul formulation is used for non-fp32 caches.
BF16_SDPA_MAX_ROWS = 8 * 512
# The padded prefill batch's K/V copies and mask stay under this many bytes; past it,
# one chunk at a time (see ``batched_prefill_fits``).
BATCHED_PREFILL_MAX_BYTES = 512 * 2**20


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scales: tuple[torch.Tensor, ...] | None = None) -> None:
    """Store new keys/values ([T, kv_heads, head_dim]) into the pool at their slots."""
    if kv_scales:
        kv_quant.store(k_cache, kv_scales[0], k, slot_mapping)
        kv_quant.store(v_cache, kv_scales[1], v, slot_mapping)
        return
    kv_heads, head_dim = k_cache.shape[0], k_cache.shape[3]
    k_cache.view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
    v_cache.view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, v.transpose(0, 1).to(v_cache.dtype))


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int,
                   scales: torch.Tensor | None = None) -> torch.Tensor:
    """[kv_heads, length, head_dim] context of one sequence (float32 values of a quantized
    pool, with its ``scales``)."""
    kv_heads, _, block_size, head_dim = cache.shape
    used = -(-length // block_size)
    if scales is not None:
        blocks = kv_quant.gather_blocks(cache, scales, block_table[:used], torch.float32)
    else:
        blocks = cache.index_select(1, block_table[:used])
    return blocks.view(kv_heads, used * block_size, head_dim)[:, :length]


def decode_gather_index(block_tables: torch.Tensor, kv_heads: int, num_blocks: int) -> torch.Tensor:
    """Rows of the pool viewed as ``[kv_heads * num_blocks, block_size, head_dim]`` that hold
    the decodes' blocks, head-major: a dim-0 ``index_select`` with it copies whole rows
    and measured faster than selecting along dim 1."""
    heads = torch.arange(kv_heads, device=block_tables.device)[:, None] * num_blocks
    return (heads + block_tables.reshape(1, -1)).reshape(-1)


def decode_mask(seq_lens: torch.Tensor, span: int, dtype: torch.dtype) -> torch.Tensor:
    """[num_decodes, 1, span] additive mask (0 or -inf) of the decodes' padded key rows, in
    the cache dtype (SDPA wants the query's dtype; 0 and -inf are exact in bf16/fp16),
    built on the lengths' device (a [nd, span] mask copied from the host each step would
    be megabytes at large batches on CUDA)."""
    device = seq_lens.device
    mask = torch.zeros((seq_lens.shape[0], 1, span), dtype=dtype, device=device)
    mask.masked_fill_(torch.arange(span, device=device)[None, None, :] >= seq_lens[:, None, None], float("-inf"))
    return mask


def window_mask(seq_lens: torch.Tensor, span: int, window: int, dtype: torch.dtype) -> torch.Tensor:
    """The decode mask of a sliding-window layer: a decode at position ``len - 1`` sees keys
    at positions ``> len - 1 - window``, and nothing past its length."""
    device = seq_lens.device
    mask = decode_mask(seq_lens, span, dtype)
    mask.masked_fill_(torch.arange(span, device=device)[None, None, :] < (seq_lens - window)[:, None, None],
                      float("-inf"))
    return mask


def soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(scores / cap)``: the attention-logit soft-capping of Gemma 2 (None: as is)."""
    return scores if cap is None else torch.tanh(scores / cap) * cap


def gather_decodes(cache: torch.Tensor, index: torch.Tensor, nd: int, buf: torch.Tensor | None,
                   scales: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[kv_heads, nd, span, head_dim]: every decode's blocks (padded to the longest), per KV head
    (a quantized pool's, with its ``scales``: dequantized to ``dtype``, no workspace; a bf16
    pool under float32 ``dtype``: widened to it, no workspace)."""
    kv_heads, num_blocks, block_size, head_dim = cache.shape
    rows = cache.view(kv_heads * num_blocks, block_size, head_dim)
    if scales is not None:
        out = kv_quant.gather_rows(cache, scales, index, dtype)
    elif cache.dtype != dtype:
        out = rows.index_select(0, index).to(dtype)
    elif buf is None:
        out = rows.index_select(0, index)
    else:
        out = torch.index_select(rows, 0, index, out=buf[: index.numel() * block_size * head_dim].view(
            index.numel(), block_size, head_dim))
    return out.view(kv_heads, nd, -1, head_dim)


def decode_queries(q: torch.Tensor, nd: int, kv_heads: int) -> torch.Tensor:
    """[kv_heads, nd, group, head_dim]: each KV head's query group as rows."""
    return q[:nd].view(nd, kv_heads, -1, q.shape[2]).transpose(0, 1)


def write_decode_output(o: torch.Tensor, out: torch.Tensor, nd: int) -> None:
    """Write [kv_heads, nd, group, head_dim] back as rows [nd, heads, head_dim] of ``out``."""
    out[:nd] = o.transpose(0, 1).reshape(nd, out.shape[1], out.shape[2]).to(out.dtype)


@dataclass(frozen=True)
class PaddedPrefill:
    """A step's prefill chunks laid out as one padded batch, built once per step.

    ``n`` chunks, each padded to ``max_q`` query rows and ``max_k`` key positions
    (a multiple of 16: the fused kernels want an aligned mask row)."""

    n: int
    max_q: int
    max_k: int
    key_slots: torch.Tensor  # [n * max_k] long: pool slot of each key position (padding: slot 0)
    query_rows: torch.Tensor  # [n * max_q] long: row of q for each padded query (padding: the chunk's first)
    real_rows: torch.Tensor  # [T - num_decodes] long: where each real query sits in the padded order
    mask: torch.Tensor  # [n, 1, max_q, max_k] bool: True = attend


def padded_key_len(seq_lens: list[int]) -> int:
    """Key positions of the padded batch: the longest context, rounded up to 16."""
    return -(-max(seq_lens) // 16) * 16


def batched_prefill_fits(layout: StepLayout, heads: int, head_dim: int, element_size: int) -> bool:
    """Whether the padded batch (K and V copies for every query head, the mask) stays
    under ``BATCHED_PREFILL_MAX_BYTES``. Many short chunks after long cached prefixes
    would each be padded to the longest context, where one chunk at a time needs a few MB."""
    nd = layout.num_decodes
    n = layout.num_seqs - nd
    max_k = padded_key_len(layout.seq_lens[nd:])
    kv_bytes = 2 * n * heads * max_k * head_dim * element_size
    mask_bytes = n * max(layout.query_lens[nd:]) * max_k
    return kv_bytes + mask_bytes <= BATCHED_PREFILL_MAX_BYTES


def padded_prefill(layout: StepLayout, device: torch.device) -> PaddedPrefill:
    """The padded layout of the step's prefill chunks."""
    nd, bs = layout.num_decodes, layout.block_size
    qlens, slens = layout.query_lens[nd:], layout.seq_lens[nd:]
    n, max_q = len(qlens), max(qlens)
    max_k = padded_key_len(slens)
    query_rows: list[int] = []
    real_rows: list[int] = []
    start = nd
    for i, qlen in enumerate(qlens):
        query_rows.extend(range(start, start + qlen))
        query_rows.extend([start] * (max_q - qlen))
        real_rows.extend(range(i * max_q, i * max_q + qlen))
        start += qlen
    tables = layout.block_tables[nd:].to(device)
    pos = torch.arange(max_k, device=device)
    block_col = (pos // bs).clamp(max=tables.shape[1] - 1)
    slots = tables[:, block_col] * bs + pos % bs  # [n, max_k]
    slen = torch.tensor(slens, device=device)
    qlen_t = torch.tensor(qlens, device=device)
    slots = torch.where(pos[None, :] < slen[:, None], slots, torch.zeros_like(slots))
    # Query i of a chunk sits at position slen - qlen + i and sees keys up to it; a padded
    # query row sees key 0 alone (a row with nothing to attend would come out NaN).
    rows = torch.arange(max_q, device=device)
    last = (slen - qlen_t)[:, None] + rows[None, :]  # [n, max_q]
    real = rows[None, :] < qlen_t[:, None]
    mask = (pos[None, None, :] <= last[:, :, None]) & real[:, :, None]
    mask |= (~real)[:, :, None] & (pos == 0)[None, None, :]
    return PaddedPrefill(
        n=n, max_q=max_q, max_k=max_k, key_slots=slots.reshape(-1),
        query_rows=torch.tensor(query_rows, dtype=torch.long).to(device),
        real_rows=torch.tensor(real_rows, dtype=torch.long).to(device), mask=mask[:, None])


def batched_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pp: PaddedPrefill,
                              num_decodes: int, scale: float, out: torch.Tensor,
                              kv_scales: tuple[torch.Tensor, ...] | None = None) -> None:
    """Every prefill chunk of the step in one SDPA call over a padded batch (GPU).

    One sequence at a time, a step of many prompts issues ~10 small kernels per chunk
    per layer from Python; padded, it is a fixed handful of kernels per layer whatever
    the number of chunks; the price is padding up to the longest chunk and context,
    which a GPU absorbs."""
    kv_heads, num_blocks, block_size, head_dim = k_cache.shape
    heads = q.shape[1]
    group = heads // kv_heads

    def context(cache: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:  # [n, heads, max_k, head_dim]
        flat = cache.view(kv_heads, num_blocks * block_size, head_dim)
        ctx = flat.index_select(1, pp.key_slots)
        if scales is not None:  # a quantized pool: each key row times its block's scale
            ctx = ctx.float() * scales.index_select(1, pp.key_slots // block_size)[..., None]
        ctx = ctx.view(kv_heads, pp.n, pp.max_k, head_dim).transpose(0, 1)
        return (ctx.repeat_interleave(group, dim=1) if group > 1 else ctx).to(q.dtype)

    ks, vs = kv_scales if kv_scales else (None, None)
    qp = q.index_select(0, pp.query_rows).view(pp.n, pp.max_q, heads, head_dim).transpose(1, 2)
    o = sdpa(qp, context(k_cache, ks), context(v_cache, vs), attn_mask=pp.mask, scale=scale)
    o = o.transpose(1, 2).reshape(pp.n * pp.max_q, heads, head_dim)
    out[num_decodes:] = o.index_select(0, pp.real_rows)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: StepLayout,
                      scale: float, out: torch.Tensor, kv_scales: tuple[torch.Tensor, ...] | None = None,
                      window: int | None = None, softcap: float | None = None) -> None:
    """Prefill chunks, one sequence at a time (they are compute-bound: a copy of their
    context is small next to the attention itself). Inputs go to SDPA as 4-D
    ``[1, heads, len, head_dim]``: with 3-D ones its CPU dispatch falls back to the
    unfused math path, measured slower."""
    num_heads = q.shape[1]
    group = num_heads // k_cache.shape[0]
    # On CPU, SDPA's flash kernel takes grouped kv heads as they are (enable_gqa): the same
    # result bit for bit, without copies of the context. CUDA keeps the copies: its
    # kernels' GQA support varies.
    gqa = group > 1 and q.device.type == "cpu"
    nd = layout.num_decodes
    ks, vs = kv_scales if kv_scales else (None, None)
    start = nd
    for i in range(nd, layout.num_seqs):
        qlen, slen = layout.query_lens[i], layout.seq_lens[i]
        k = gather_context(k_cache, layout.block_tables[i], slen, ks).to(q.dtype)
        v = gather_context(v_cache, layout.block_tables[i], slen, vs).to(q.dtype)
        qi = q[start : start + qlen].transpose(0, 1)[None]  # [1, heads, qlen, d]
        if gqa:  # the kernel maps query heads to kv heads itself
            ki, vi = k[None], v[None]  # [1, kv_heads, slen, d]
        else:
            ki = k.repeat_interleave(group, dim=0)[None]  # [1, heads, slen, d]
            vi = v.repeat_interleave(group, dim=0)[None]
        if qlen == slen and window is None and softcap is None:
            o = sdpa(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            # Query j sits at absolute position slen - qlen + j and sees keys <= it (and, in a
            # sliding-window layer, keys > it - window).
            rows = torch.arange(slen - qlen, slen, device=q.device)[:, None]
            cols = torch.arange(slen, device=q.device)[None, :]
            allowed = cols <= rows
            if window is not None:
                allowed &= cols > rows - window
            if softcap is None:
                o = sdpa(qi, ki, vi, attn_mask=allowed, scale=scale, enable_gqa=gqa)
            else:  # SDPA has no soft-capping: the plain formulation, float32 softmax
                if gqa:
                    ki, vi = ki.repeat_interleave(group, dim=1), vi.repeat_interleave(group, dim=1)
                scores = soft_cap(torch.matmul(qi, ki.transpose(-1, -2)).float() * scale, softcap)
                scores = scores.masked_fill(~allowed, float("-inf"))
                o = torch.matmul(torch.softmax(scores, dim=-1).to(vi.dtype), vi)
        out[start : start + qlen] = o[0].transpose(0, 1)
        start += qlen


@dataclass(frozen=True)
class TorchPagedStep:
    """One step's metadata for the torch path, every field built in ``prepare``."""

    layout: StepLayout
    decode_mask: torch.Tensor | None  # [nd, 1, span] additive, in the cache dtype; None without decodes
    decode_index: torch.Tensor | None  # decode_gather_index() of the decodes' block tables
    workspace: tuple[torch.Tensor, torch.Tensor] | None  # flat decode gather buffers (None: fresh copies)
    padded: PaddedPrefill | None  # the prefill chunks as one padded batch (GPU), or None: one at a time
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # decode masks by window, made once

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_scales: tuple[torch.Tensor, ...] | None = None) -> None:
        write_kv(k_cache, v_cache, k, v, self.layout.slot_mapping, kv_scales)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
               kv_scales: tuple[torch.Tensor, ...] | None = None, window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:
        out = torch.empty_like(q)
        layout = self.layout
        if layout.num_decodes:
            self._decodes(q, k_cache, v_cache, scale, out, kv_scales, window, softcap)
        if layout.num_seqs > layout.num_decodes:
            if self.padded is not None and window is None and softcap is None:
                batched_prefill_attention(q, k_cache, v_cache, self.padded, layout.num_decodes, scale, out,
                                          kv_scales)
            else:
                prefill_attention(q, k_cache, v_cache, layout, scale, out, kv_scales, window, softcap)
        return out

    def _mask(self, window: int | None) -> torch.Tensor:
        """The decodes' additive mask: the whole context, or a sliding window of it (built on
        the first layer that asks, shared by the others)."""
        assert self.decode_mask is not None
        if window is None:
            return self.decode_mask
        mask = self.window_masks.get(window)
        if mask is None:
            nd = self.layout.num_decodes
            lens = torch.tensor(self.layout.seq_lens[:nd]).to(self.decode_mask.device)
            mask = window_mask(lens, self.decode_mask.shape[-1], window, self.decode_mask.dtype)
            self.window_masks[window] = mask
        return mask

    def _decodes(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                 out: torch.Tensor, kv_scales: tuple[torch.Tensor, ...] | None = None, window: int | None = None,
                 softcap: float | None = None) -> None:
        """Decodes by gathering their blocks into the workspace, then matmul/softmax/matmul."""
        assert self.decode_index is not None and self.decode_mask is not None
        kv_heads = k_cache.shape[0]
        nd = self.layout.num_decodes
        ws = self.workspace
        ks, vs = kv_scales if kv_scales else (None, None)
        k = gather_decodes(k_cache, self.decode_index, nd, ws[0] if ws else None, ks, q.dtype)
        v = gather_decodes(v_cache, self.decode_index, nd, ws[1] if ws else None, vs, q.dtype)
        qd = decode_queries(q, nd, kv_heads).to(k.dtype)
        mask = self._mask(window)
        if k.dtype != torch.float32 and nd * k.shape[2] <= BF16_SDPA_MAX_ROWS and softcap is None:
            o = sdpa(qd, k, v, attn_mask=mask.to(k.dtype), scale=scale)
        else:
            # float32 always takes this path: the same ops as the reference, so fp32 output
            # stays bit-identical to it (SDPA's CPU kernel uses a faster, less exact exp).
            scores = soft_cap(torch.matmul(qd, k.transpose(-1, -2)).float() * scale, softcap)
            o = torch.matmul(torch.softmax(scores + mask, dim=-1).to(v.dtype), v)
        write_decode_output(o, out, nd)


class TorchPagedAttention:
    """The torch backend: owns the decode gather workspace (grown, never shrunk)."""

    name = "torch paged attention"
    capabilities = BackendCapabilities(cuda_graphs=True, quantized_pool=True, masks=True)

    def __init__(self, dtype: torch.dtype, device: torch.device, kv_heads: int, heads: int, num_blocks: int,
                 head_dim: int, batched_prefill: bool = True) -> None:
        self.dtype, self.device = dtype, device
        self.kv_heads, self.heads, self.num_blocks, self.head_dim = kv_heads, heads, num_blocks, head_dim
        # Off the CPU two or more chunks go through one padded call; a lone chunk keeps the
        # per-chunk path, whose causal SDPA needs no mask.
        self.batched_prefill = batched_prefill and device.type != "cpu"
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(cls, spec: BackendSpec) -> "TorchPagedAttention":
        return cls(spec.dtype, spec.device, spec.kv_heads, spec.heads, spec.num_blocks, spec.head_dim,
                   batched_prefill=spec.options.batched_prefill)

    def prepare(self, layout: StepLayout) -> TorchPagedStep:
        nd = layout.num_decodes
        mask = index = workspace = None
        if nd:
            blocks = layout.decode_blocks
            lens = torch.tensor(layout.seq_lens[:nd]).to(self.device)
            mask = decode_mask(lens, blocks * layout.block_size, self.dtype)
            index = decode_gather_index(layout.block_tables[:nd, :blocks], self.kv_heads, self.num_blocks)
            workspace = self.decode_workspace(nd * blocks * layout.block_size * self.kv_heads * self.head_dim)
        padded = None
        chunks = layout.num_seqs - nd
        if (self.batched_prefill and chunks > 1
                and batched_prefill_fits(layout, self.heads, self.head_dim, self.dtype.itemsize)):
            padded = padded_prefill(layout, self.device)
        return TorchPagedStep(layout, mask, index, workspace, padded)

    def decode_workspace(self, elements: int) -> tuple[torch.Tensor, torch.Tensor]:
        ws = self._workspace
        if ws is None or ws[0].numel() < elements:
            size = max(elements + elements // 4, 64 * 1024)
            ws = (torch.empty(size, dtype=self.dtype, device=self.device),
                  torch.empty(size, dtype=self.dtype, device=self.device))
            self._workspace = ws
        return ws

    def graph_decode_step(self, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                          key_pos: torch.Tensor, batch: int, width: int, block_size: int) -> TorchPagedStep:
        """A pure-decode step built on the device from a CUDA graph's static tensors (no
        host values, no workspace: the gather lands in the graph's own memory pool).
        The layout's lists say "whole width", so that any code reading them rather than
        the mask would attend to padding and fail the parity tests."""
        mask = torch.zeros((batch, 1, width * block_size), dtype=self.dtype, device=key_pos.device)
        mask.masked_fill_(key_pos >= lens[:, None, None], float("-inf"))
        layout = StepLayout(slots, tables, [width * block_size] * batch, [1] * batch, batch, block_size)
        return TorchPagedStep(layout, mask, decode_gather_index(tables, self.kv_heads, self.num_blocks), None, None)

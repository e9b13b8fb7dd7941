"""Attention over the paged KV cache for one flattened, mixed batch.

The batch holds decode sequences first (one query token each), then prefill
chunks (many query tokens, possibly after a cached or earlier-computed
prefix). New K/V are scattered into the pool through ``slot_mapping``; keys
and values are read back through each sequence's block table. This is the
reference implementation in plain torch, correct on CPU and CUDA alike.

Decodes are batched: their blocks are gathered with one ``index_select`` into
a workspace the runner allocates once and reuses every step and layer (a
fresh buffer of tens of MB is page-faulted on every step), then attended.
float32 keeps the reference's exact ops (matmul, float32 softmax, matmul) so
greedy fp32 output never changes; bf16 uses
``scaled_dot_product_attention`` over strided views at small batches (GQA
handled by viewing a query head group as rows of one KV head; measured 2x
faster at batch 1) and the matmul form at large ones, where bf16 SDPA
measured slower. ``paged_attention_reference`` is the plain
per-sequence formulation, kept for tests and the benchmarks' eager baseline
(``TOKENMILL_ATTENTION=reference`` selects it).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-step layout of the flattened batch (built by the runner)."""

    slot_mapping: torch.Tensor  # [T] long: flat slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor  # [B, max_blocks] long, padded with 0
    seq_lens: list[int]  # context length of each sequence after this step
    query_lens: list[int]  # new tokens of each sequence in this step
    num_decodes: int  # the first num_decodes sequences have query_len == 1
    block_size: int
    decode_blocks: int = 0  # blocks spanned by the longest decode context
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, decode_blocks * block_size]: 0 or -inf
    # Reused gather buffers for decode K and V (at least num_decodes * decode_blocks blocks each).
    decode_workspace: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new keys/values ([T, kv_heads, head_dim]) into the pool
    ([num_blocks, block_size, kv_heads, head_dim]) at their slots."""
    kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[num_blocks_used * block_size, kv_heads, head_dim] context of one sequence."""
    block_size = cache.shape[1]
    used = -(-length // block_size)
    blocks = cache.index_select(0, block_table[:used])
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:length]


def paged_attention_reference(
    q: torch.Tensor,  # [T, heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of every query token over its sequence's cached context
    (the plain formulation: fresh gather copies, matmul + softmax)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads
    out = torch.empty_like(q)
    nd = meta.num_decodes

    if nd:
        # Decodes: gather each context's blocks (padded to the longest), mask the padding.
        tables = meta.block_tables[:nd, : meta.decode_blocks]
        span = meta.decode_blocks * meta.block_size
        flat = tables.reshape(-1)
        k = k_cache.index_select(0, flat).view(nd, span, kv_heads, head_dim).permute(0, 2, 3, 1)
        v = v_cache.index_select(0, flat).view(nd, span, kv_heads, head_dim).transpose(1, 2)
        qd = q[:nd].view(nd, kv_heads, group, head_dim).to(k.dtype)
        scores = torch.matmul(qd, k).float() * scale  # [nd, kv, group, span]
        assert meta.decode_mask is not None
        probs = torch.softmax(scores + meta.decode_mask, dim=-1).to(v.dtype)
        out[:nd] = torch.matmul(probs, v).reshape(nd, num_heads, head_dim).to(q.dtype)
    _prefill_attention(q, k_cache, v_cache, meta, scale, out)
    return out


# bf16 SDPA reads the gathered cache slowly at large batches; above this many
# gathered key rows the matmul formulation is used for non-fp32 caches.
_BF16_SDPA_MAX_ROWS = 8 * 512


def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of every query token over its sequence's cached context."""
    if _USE_REFERENCE:
        return paged_attention_reference(q, k_cache, v_cache, meta, scale)
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        flat = meta.block_tables[:nd, : meta.decode_blocks].reshape(-1)
        span = meta.decode_blocks * meta.block_size
        rows = flat.numel()
        if meta.decode_workspace is not None:
            kbuf, vbuf = (w[:rows] for w in meta.decode_workspace)
            k = torch.index_select(k_cache, 0, flat, out=kbuf)
            v = torch.index_select(v_cache, 0, flat, out=vbuf)
        else:
            k, v = k_cache.index_select(0, flat), v_cache.index_select(0, flat)
        k = k.view(nd, span, kv_heads, head_dim)
        v = v.view(nd, span, kv_heads, head_dim).transpose(1, 2)  # [nd, kv, span, d]
        qd = q[:nd].view(nd, kv_heads, group, head_dim).to(k.dtype)  # the group's heads as query rows
        mask = meta.decode_mask
        assert mask is not None
        if k.dtype != torch.float32 and nd * span <= _BF16_SDPA_MAX_ROWS:
            o = F.scaled_dot_product_attention(qd, k.transpose(1, 2), v, attn_mask=mask.to(k.dtype), scale=scale)
        else:
            # float32 always takes this path: the same ops as the reference, so greedy
            # fp32 output stays bit-identical (SDPA's CPU kernel uses a faster, less exact exp).
            scores = torch.matmul(qd, k.permute(0, 2, 3, 1)).float() * scale
            o = torch.matmul(torch.softmax(scores + mask, dim=-1).to(v.dtype), v)
        out[:nd] = o.reshape(nd, num_heads, head_dim).to(q.dtype)
    _prefill_attention(q, k_cache, v_cache, meta, scale, out)
    return out


_USE_REFERENCE = os.environ.get("TOKENMILL_ATTENTION", "").lower() == "reference"


def _prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
    """Prefill chunks, one sequence at a time (they are compute-bound: a copy of
    their context is small next to the attention itself)."""
    num_heads = q.shape[1]
    group = num_heads // k_cache.shape[2]
    nd = meta.num_decodes
    start = nd
    for i in range(nd, meta.num_seqs):
        qlen, slen = meta.query_lens[i], meta.seq_lens[i]
        k = _gather(k_cache, meta.block_tables[i], slen).to(q.dtype)
        v = _gather(v_cache, meta.block_tables[i], slen).to(q.dtype)
        qi = q[start : start + qlen].transpose(0, 1)  # [heads, qlen, d]
        ki = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [heads, slen, d]
        vi = v.transpose(0, 1).repeat_interleave(group, dim=0)
        if qlen == slen:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale)
        else:
            # Query j sits at absolute position slen - qlen + j and sees keys <= it.
            rows = torch.arange(slen - qlen, slen, device=q.device)[:, None]
            cols = torch.arange(slen, device=q.device)[None, :]
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=cols <= rows, scale=scale)
        out[start : start + qlen] = o.transpose(0, 1)
        start += qlen

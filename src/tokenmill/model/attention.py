"""Attention over the paged KV cache for one flattened, mixed batch.

The batch holds decode sequences first (one query token each), then prefill
chunks (many query tokens, possibly after a cached or earlier-computed
prefix). New K/V are scattered into the pool through ``slot_mapping``; keys
and values are read back through each sequence's block table. This is the
reference implementation in plain torch, correct on CPU and CUDA alike.
"""
from __future__ import annotations

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


def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of every query token over its sequence's cached context."""
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
    return out

"""Attention over the paged KV cache for one flattened, mixed batch.

The batch holds decode sequences first (one query token each), then prefill
chunks (many query tokens, possibly after a cached or earlier-computed
prefix). New K/V are scattered into the pool through ``slot_mapping``; keys
and values are read back through each sequence's block table.

Pool layout: ``[kv_heads, num_blocks, block_size, head_dim]`` per layer, head
outermost, so every block of one KV head is a contiguous
``[block_size, head_dim]`` matrix.

Decodes on CPU (float32 or bfloat16) go through a C kernel
(``cpu_kernels.paged_decode_attention``, source in ``csrc/``) that reads the
blocks in place through the block table: one (sequence, KV head) pair per
OpenMP work item, the head's whole query group at once, float32 accumulation
(head_dim a multiple of 8 or 16, the CPU's vector width). It skips the gather
copy, which cost more than the attention math; the runner then builds no mask,
gather index or workspace (this module builds them if it must fall back). Each
sequence's result depends only on its own context (bit for bit, whatever else
is in the batch); against the reference it differs by float rounding (its own
exp, a different summation order), ~1e-6 in float32.

Elsewhere (CUDA, float16, no compiler, ``TOKENMILL_CPU_KERNELS=0``) decodes
use the torch path: their blocks are gathered with one ``index_select`` into
a flat workspace the runner allocates once and reuses every step and layer
(with the head outermost, each sequence's context per KV head comes out as one
contiguous ``[span, head_dim]`` matrix, which the matmuls read fastest), then
attended as ``[kv_heads, num_decodes, group, head_dim]`` queries (a query head
group read as rows of its KV head). float32 there keeps the reference's exact
ops (matmul, float32 softmax, matmul); bf16 uses
``scaled_dot_product_attention`` at small batches (measured 2x faster at
batch 1) and the matmul form at large ones.

Prefill chunks on CPU go through a second C kernel
(``cpu_kernels.paged_prefill_attention``, ``csrc/prefill_attention.c``): one
sequence per call, causal flash-style attention with register-tiled score and
output matmuls, reading the cached prefix and the chunk's own K/V in place.
torch's SDPA flash kernel ran SmolLM2's shapes at 40-60 GFLOPS and a chunk
after a prefix needed a gather copy and an explicit mask first. Off the CPU,
two or more chunks go through one SDPA call over a padded batch
(``batched_prefill_attention``: a fixed handful of kernels per layer instead of
~10 per chunk launched from Python); a lone chunk, and the CPU fallback, go
one sequence at a time through SDPA.

``paged_attention_reference`` is the plain formulation with fresh gathers,
kept for tests and the benchmarks' eager baseline
(``TOKENMILL_ATTENTION=reference`` selects it).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import cpu_kernels, kv_quant


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
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, decode_blocks * block_size]: 0 or -inf
    decode_index: torch.Tensor | None = None  # decode_gather_index() of the decodes' block tables
    # Reused flat gather buffers for decode K and V (at least
    # kv_heads * num_decodes * decode_blocks * block_size * head_dim elements each).
    decode_workspace: tuple[torch.Tensor, torch.Tensor] | None = None
    # For the CPU decode kernel (built once per step; derived from the fields above when None):
    decode_seq_lens: torch.Tensor | None = None  # [num_decodes] int32 context lengths
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, decode_blocks] int32, contiguous
    # For the CPU prefill kernel: block_tables as int32, contiguous (built by the first layer).
    prefill_block_tables: torch.Tensor | None = None
    # For batched prefill attention off the CPU (built by the first layer that needs it).
    padded_prefill: "PaddedPrefill | None" = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


def kv_cache_shape(num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> tuple[int, int, int, int]:
    """Shape of one layer's K (or V) pool."""
    return (kv_heads, num_blocks, block_size, head_dim)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scales: tuple[torch.Tensor, ...] | None = None) -> None:
    """Store new keys/values ([T, kv_heads, head_dim]) into the pool at their slots
    (a quantized pool, with its scales: coded as model/kv_quant.py says)."""
    if kv_scales:
        if not cpu_kernels.store_kv_quant(k_cache, v_cache, kv_scales[0], kv_scales[1], k, v, slot_mapping):
            kv_quant.store(k_cache, kv_scales[0], k, slot_mapping)
            kv_quant.store(v_cache, kv_scales[1], v, slot_mapping)
        return
    if cpu_kernels.store_kv(k_cache, v_cache, k, v, slot_mapping):  # CPU float32 / bf16: one C pass
        return
    kv_heads, head_dim = k_cache.shape[0], k_cache.shape[3]
    k_cache.view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
    v_cache.view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, v.transpose(0, 1).to(v_cache.dtype))


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[kv_heads, length, head_dim] context of one sequence."""
    kv_heads, _, block_size, head_dim = cache.shape
    used = -(-length // block_size)
    blocks = cache.index_select(1, block_table[:used])
    return blocks.view(kv_heads, used * block_size, head_dim)[:, :length]


def decode_gather_index(block_tables: torch.Tensor, kv_heads: int, num_blocks: int) -> torch.Tensor:
    """Rows of the pool viewed as ``[kv_heads * num_blocks, block_size, head_dim]`` that hold
    the decodes' blocks, head-major: a dim-0 ``index_select`` with it copies whole 4 KB rows
    and measured 2x faster than selecting along dim 1. Built once per step (``decode_index``)."""
    heads = torch.arange(kv_heads, device=block_tables.device)[:, None] * num_blocks
    return (heads + block_tables.reshape(1, -1)).reshape(-1)


def _gather_decodes(cache: torch.Tensor, index: torch.Tensor, nd: int, buf: torch.Tensor | None) -> torch.Tensor:
    """[kv_heads, nd, span, head_dim]: every decode's blocks (padded to the longest), per KV head."""
    kv_heads, num_blocks, block_size, head_dim = cache.shape
    rows = cache.view(kv_heads * num_blocks, block_size, head_dim)
    if buf is None:
        out = rows.index_select(0, index)
    else:
        out = torch.index_select(rows, 0, index, out=buf[: index.numel() * block_size * head_dim].view(
            index.numel(), block_size, head_dim))
    return out.view(kv_heads, nd, -1, head_dim)


def decode_index(meta: AttentionMetadata, kv_heads: int, num_blocks: int) -> torch.Tensor:
    """The step's gather index: built once (by the runner, or the first layer) and kept on meta."""
    if meta.decode_index is None:
        tables = meta.block_tables[: meta.num_decodes, : meta.decode_blocks]
        meta.decode_index = decode_gather_index(tables, kv_heads, num_blocks)
    return meta.decode_index


def _decode_queries(q: torch.Tensor, nd: int, kv_heads: int) -> torch.Tensor:
    """[kv_heads, nd, group, head_dim]: each KV head's query group as rows."""
    return q[:nd].view(nd, kv_heads, -1, q.shape[2]).transpose(0, 1)


def _decode_output(o: torch.Tensor, out: torch.Tensor, nd: int) -> None:
    """Write [kv_heads, nd, group, head_dim] back as rows [nd, heads, head_dim] of ``out``."""
    out[:nd] = o.transpose(0, 1).reshape(nd, out.shape[1], out.shape[2]).to(out.dtype)


def paged_attention_reference(
    q: torch.Tensor,  # [T, heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of every query token over its sequence's cached context
    (the plain formulation: fresh gather copies, matmul + softmax)."""
    kv_heads = k_cache.shape[0]
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        index = decode_index(meta, k_cache.shape[0], k_cache.shape[1])
        k = _gather_decodes(k_cache, index, nd, None)
        v = _gather_decodes(v_cache, index, nd, None)
        qd = _decode_queries(q, nd, kv_heads).to(k.dtype)
        scores = torch.matmul(qd, k.transpose(-1, -2)).float() * scale  # [kv, nd, group, span]
        assert meta.decode_mask is not None
        probs = torch.softmax(scores + meta.decode_mask, dim=-1).to(v.dtype)
        _decode_output(torch.matmul(probs, v), out, nd)
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
    kv_scales: tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    """Causal attention of every query token over its sequence's cached context.
    A quantized pool comes with its (K, V) scales: the CPU kernels read its codes in
    place; elsewhere it is dequantized first."""
    if kv_scales:
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if (not _USE_REFERENCE and (not nd or _kernel_decodes(q, k_cache, v_cache, meta, scale, out, kv_scales))
                and (meta.num_seqs == nd or _kernel_prefills(q, k_cache, v_cache, meta, scale, out, kv_scales))):
            return out
        k_cache = kv_quant.dequantize(k_cache, kv_scales[0]).to(q.dtype)
        v_cache = kv_quant.dequantize(v_cache, kv_scales[1]).to(q.dtype)
    if _USE_REFERENCE:
        decode_mask(meta, k_cache.dtype, q.device)
        return paged_attention_reference(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd and not _kernel_decodes(q, k_cache, v_cache, meta, scale, out):
        _torch_decodes(q, k_cache, v_cache, meta, scale, out)
    if meta.num_seqs > nd and not _kernel_prefills(q, k_cache, v_cache, meta, scale, out):
        if use_batched_prefill(q.device, meta.num_seqs - nd) and batched_prefill_fits(meta, q):
            batched_prefill_attention(q, k_cache, v_cache, meta, scale, out)
        else:
            _prefill_attention(q, k_cache, v_cache, meta, scale, out)
    return out


def _kernel_prefills(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, out: torch.Tensor, kv_scales: tuple[torch.Tensor, ...] | None = None) -> bool:
    """Prefill chunks through the C kernel, reading their context (cached prefix and
    the chunk's own K/V, already written) in place; False when it does not apply here."""
    if not cpu_kernels.decode_kernel_usable(q.device, k_cache.dtype):  # same library, same conditions
        return False
    if meta.prefill_block_tables is None:
        meta.prefill_block_tables = meta.block_tables.to(torch.int32).contiguous()
    tables = meta.prefill_block_tables
    start = meta.num_decodes
    for i in range(meta.num_decodes, meta.num_seqs):
        qlen = meta.query_lens[i]
        if not cpu_kernels.paged_prefill_attention(q[start:start + qlen], k_cache, v_cache, tables[i],
                                                   meta.seq_lens[i], scale, out[start:start + qlen],
                                                   kv_scales=kv_scales):
            return False  # the same conditions hold for every chunk: the first answers for all
        start += qlen
    return True


def _kernel_decodes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, out: torch.Tensor, kv_scales: tuple[torch.Tensor, ...] | None = None) -> bool:
    """The C kernel, reading the pool in place; False when it does not apply here."""
    if q.device.type != "cpu" or k_cache.dtype not in cpu_kernels.KV_FORMAT:
        return False
    nd = meta.num_decodes
    kernel_decode_tables(meta)
    return cpu_kernels.paged_decode_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables,
                                              meta.decode_seq_lens, scale, out[:nd], kv_scales=kv_scales)


def kernel_decode_tables(meta: AttentionMetadata) -> None:
    """The C kernel's int32 context lengths and block tables: built once (by the runner,
    or the first layer) and kept on meta."""
    nd = meta.num_decodes
    if meta.decode_seq_lens is None or meta.decode_block_tables is None:
        blocks = meta.decode_blocks or -(-max(meta.seq_lens[:nd]) // meta.block_size)
        meta.decode_seq_lens = torch.tensor(meta.seq_lens[:nd], dtype=torch.int32)
        meta.decode_block_tables = meta.block_tables[:nd, :blocks].to(torch.int32).contiguous()


def decode_mask(meta: AttentionMetadata, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """[num_decodes, 1, decode_blocks * block_size] additive mask (0 or -inf) of the
    decodes' padded key rows (in the cache dtype: SDPA wants the query's dtype; 0 and
    -inf are exact in bf16/fp16): built once (by the runner, or the first layer that
    needs it) and kept on meta."""
    nd = meta.num_decodes
    if meta.decode_mask is None and nd:
        span = meta.decode_blocks * meta.block_size
        # Built where it is used: only the lengths cross from the host (a [nd, span] mask
        # copied from the CPU each step would be megabytes at large batches on CUDA).
        lens = torch.tensor(meta.seq_lens[:nd]).to(device)
        mask = torch.zeros((nd, 1, span), dtype=dtype, device=device)
        mask.masked_fill_(torch.arange(span, device=device)[None, None, :] >= lens[:, None, None], float("-inf"))
        meta.decode_mask = mask
    return meta.decode_mask


def _torch_decodes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                   scale: float, out: torch.Tensor) -> None:
    """Decodes by gathering their blocks into a workspace, then matmul/softmax/matmul."""
    kv_heads = k_cache.shape[0]
    nd = meta.num_decodes
    index = decode_index(meta, k_cache.shape[0], k_cache.shape[1])
    ws = meta.decode_workspace
    k = _gather_decodes(k_cache, index, nd, ws[0] if ws else None)
    v = _gather_decodes(v_cache, index, nd, ws[1] if ws else None)
    qd = _decode_queries(q, nd, kv_heads).to(k.dtype)
    mask = decode_mask(meta, k.dtype, q.device)
    assert mask is not None
    if k.dtype != torch.float32 and nd * k.shape[2] <= _BF16_SDPA_MAX_ROWS:
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask.to(k.dtype), scale=scale)
    else:
        # float32 always takes this path: the same ops as the reference, so fp32 output
        # stays bit-identical to it (SDPA's CPU kernel uses a faster, less exact exp).
        scores = torch.matmul(qd, k.transpose(-1, -2)).float() * scale
        o = torch.matmul(torch.softmax(scores + mask, dim=-1).to(v.dtype), v)
    _decode_output(o, out, nd)


_USE_REFERENCE = os.environ.get("TOKENMILL_ATTENTION", "").lower() == "reference"


@dataclass
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


def _padded_key_len(seq_lens: list[int]) -> int:
    """Key positions of the padded batch: the longest context, rounded up to 16."""
    return -(-max(seq_lens) // 16) * 16


def padded_prefill(meta: AttentionMetadata, device: torch.device) -> PaddedPrefill:
    """Build (once per step, kept on meta) the padded layout of the step's prefill chunks."""
    if meta.padded_prefill is not None:
        return meta.padded_prefill
    nd, bs = meta.num_decodes, meta.block_size
    qlens, slens = meta.query_lens[nd:], meta.seq_lens[nd:]
    n, max_q = len(qlens), max(qlens)
    max_k = _padded_key_len(slens)
    query_rows: list[int] = []
    real_rows: list[int] = []
    start = nd
    for i, qlen in enumerate(qlens):
        query_rows.extend(range(start, start + qlen))
        query_rows.extend([start] * (max_q - qlen))
        real_rows.extend(range(i * max_q, i * max_q + qlen))
        start += qlen
    tables = meta.block_tables[nd:].to(device)
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
    meta.padded_prefill = PaddedPrefill(
        n=n, max_q=max_q, max_k=max_k, key_slots=slots.reshape(-1),
        query_rows=torch.tensor(query_rows, dtype=torch.long).to(device),
        real_rows=torch.tensor(real_rows, dtype=torch.long).to(device), mask=mask[:, None])
    return meta.padded_prefill


def batched_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
    """Every prefill chunk of the step in one SDPA call over a padded batch (GPU).

    One sequence at a time, a step of eight 256-token prompts issued ~10 small
    kernels per chunk per layer from Python (on an H200 the eager mixed steps then
    cost more than all graph-replayed decodes). Padded here, it is a fixed handful
    of kernels per layer whatever the number of chunks; the price is padding up to
    the longest chunk and context, which a GPU absorbs."""
    pp = padded_prefill(meta, q.device)
    kv_heads, num_blocks, block_size, head_dim = k_cache.shape
    heads = q.shape[1]
    group = heads // kv_heads

    def context(cache: torch.Tensor) -> torch.Tensor:  # [n, heads, max_k, head_dim]
        flat = cache.view(kv_heads, num_blocks * block_size, head_dim)
        ctx = flat.index_select(1, pp.key_slots).view(kv_heads, pp.n, pp.max_k, head_dim).transpose(0, 1)
        return (ctx.repeat_interleave(group, dim=1) if group > 1 else ctx).to(q.dtype)

    qp = q.index_select(0, pp.query_rows).view(pp.n, pp.max_q, heads, head_dim).transpose(1, 2)
    o = F.scaled_dot_product_attention(qp, context(k_cache), context(v_cache), attn_mask=pp.mask, scale=scale)
    o = o.transpose(1, 2).reshape(pp.n * pp.max_q, heads, head_dim)
    out[meta.num_decodes:] = o.index_select(0, pp.real_rows)


def use_batched_prefill(device: torch.device, chunks: int) -> bool:
    """Off the CPU (whose C kernel reads chunks in place), two or more chunks go through
    one padded call; a lone chunk keeps the per-chunk path, whose causal SDPA needs no
    mask. ``TOKENMILL_BATCHED_PREFILL=0`` turns it off."""
    return chunks > 1 and device.type != "cpu" and os.environ.get("TOKENMILL_BATCHED_PREFILL", "1") != "0"


BATCHED_PREFILL_MAX_BYTES = 512 * 2**20


def batched_prefill_fits(meta: AttentionMetadata, q: torch.Tensor) -> bool:
    """Whether the padded batch (K and V copies for every query head, the mask) stays
    under ``BATCHED_PREFILL_MAX_BYTES``. Many short chunks after long cached prefixes
    would each be padded to the longest context: 256 chunks after 8K-token prefixes
    are ~5 GB of padded bf16 K/V, where one chunk at a time needs a few MB."""
    nd = meta.num_decodes
    n = meta.num_seqs - nd
    max_k = _padded_key_len(meta.seq_lens[nd:])
    kv_bytes = 2 * n * q.shape[1] * max_k * q.shape[2] * q.element_size()
    mask_bytes = n * max(meta.query_lens[nd:]) * max_k
    return kv_bytes + mask_bytes <= BATCHED_PREFILL_MAX_BYTES


def _prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
    """Prefill chunks, one sequence at a time (they are compute-bound: a copy of
    their context is small next to the attention itself: gathering K and V of a
    1,450-token cached prefix is 5.6 ms of a 130 ms step for a 20-token chunk).
    Inputs go to SDPA as 4-D ``[1, heads, len, head_dim]``: with 3-D ones its CPU dispatch falls back
    to the unfused math path, measured 2.4-2.8x slower at 256-600 tokens."""
    num_heads = q.shape[1]
    group = num_heads // k_cache.shape[0]
    # On CPU, SDPA's flash kernel takes grouped kv heads as they are (enable_gqa): the same
    # result bit for bit, without three copies of the context (17-27% faster per call at
    # SmolLM2's 9/3 heads). CUDA keeps the copies: its kernels' GQA support varies.
    gqa = group > 1 and q.device.type == "cpu"
    nd = meta.num_decodes
    start = nd
    for i in range(nd, meta.num_seqs):
        qlen, slen = meta.query_lens[i], meta.seq_lens[i]
        k = _gather(k_cache, meta.block_tables[i], slen).to(q.dtype)
        v = _gather(v_cache, meta.block_tables[i], slen).to(q.dtype)
        qi = q[start : start + qlen].transpose(0, 1)[None]  # [1, heads, qlen, d]
        if gqa:  # the kernel maps query heads to kv heads itself
            ki, vi = k[None], v[None]  # [1, kv_heads, slen, d]
        else:
            ki = k.repeat_interleave(group, dim=0)[None]  # [1, heads, slen, d]
            vi = v.repeat_interleave(group, dim=0)[None]
        if qlen == slen:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            # Query j sits at absolute position slen - qlen + j and sees keys <= it.
            rows = torch.arange(slen - qlen, slen, device=q.device)[:, None]
            cols = torch.arange(slen, device=q.device)[None, :]
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=cols <= rows, scale=scale, enable_gqa=gqa)
        out[start : start + qlen] = o[0].transpose(0, 1)
        start += qlen

"""Quantized KV cache: int8 or fp8 (e4m3) codes with one scale per block and KV head.

Why: decode reads every sequence's whole context each step, so the pool's bytes
are both the memory that bounds how many tokens fit and the traffic that bounds
decode attention. One byte a value holds twice the tokens of bf16 (four times
float32) in the same budget.

Layout, per layer: K and V codes ``[kv_heads, num_blocks, block_size, head_dim]``
(``torch.int8`` or ``torch.float8_e4m3fn``) and float32 scales ``[kv_heads,
num_blocks]``; a row's value is ``code * scale`` of its block and head. A layer's
cache is then the tuple ``(k_codes, v_codes, k_scales, v_scales)`` where a float
pool is ``(k, v)``.

Writing rows into a block (``store``, and the C stores in ``csrc/elementwise.c``,
which compute the same codes): a block's scale is its largest |value| / QMAX
(127 for int8, 448 for e4m3). If new rows fit the current scale they are coded
with it; otherwise the scale is raised and only that block's earlier rows are
requantized onto it. A block's first row (offset 0) starts it afresh. Rows of
one call that go into one block share one decision, so a prefill chunk codes
each block once; requantization happens when a later decode token outgrows its
block. Full blocks, the only ones the prefix cache shares, are never written
again, so sharing stays sound.

Readers dequantize in place: the C attention kernels widen each row as they
load it; the torch path (CUDA, fallback) dequantizes the blocks it gathers
(``gather_blocks``).
"""
from __future__ import annotations

import torch

from ...settings.config import canonical_dtype

# --kv-cache-dtype names of the quantized formats (vLLM's: fp8 is e4m3).
QUANT_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8": torch.float8_e4m3fn,
                                        "fp8_e4m3": torch.float8_e4m3fn}
QMAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
KV_CACHE_DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8")
SCALE_DTYPE = torch.float32

LayerKV = tuple[torch.Tensor, ...]  # (k, v) or (k_codes, v_codes, k_scales, v_scales)


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def resolve_kv_dtype(name: str | None, compute: torch.dtype) -> torch.dtype:
    """The pool dtype for ``--kv-cache-dtype name`` with this compute dtype: auto is the
    compute dtype; a float dtype equals it, or is bfloat16 under float32 compute (half the
    bytes, rows rounded to bf16 as they are stored and widened as they are read; another
    float pair would convert on every store and read for nothing); int8 / fp8 quantize.
    ValueError with a one-line reason otherwise."""
    key = canonical_dtype(name or "auto")
    if key == "auto":
        return compute
    if key in QUANT_DTYPES:
        return QUANT_DTYPES[key]
    if key in ("float32", "bfloat16", "float16"):
        dtype = getattr(torch, key)
        if dtype != compute and not (dtype == torch.bfloat16 and compute == torch.float32):
            raise ValueError(f"kv_cache_dtype {name}: a float pool is stored in the compute dtype "
                             f"({str(compute).removeprefix('torch.')}), or in bfloat16 under float32; "
                             "use auto, int8 or fp8")
        return dtype
    raise ValueError(f"kv_cache_dtype {name!r}: choose one of {', '.join(KV_CACHE_DTYPE_CHOICES)}")


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The --kv-cache-dtype spelling of a pool dtype (for logs and stats)."""
    return "fp8" if dtype == torch.float8_e4m3fn else str(dtype).removeprefix("torch.")


def bytes_per_block(num_layers: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    """Pool bytes one block takes over all layers, K and V, scales included."""
    elements = 2 * num_layers * kv_heads * head_dim * block_size
    per = elements * dtype.itemsize
    if is_quantized(dtype):
        per += 2 * num_layers * kv_heads * SCALE_DTYPE.itemsize
    return per


def encode(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 values already divided by their scale -> codes (clamped to the format's range,
    rounded to nearest even)."""
    q = QMAX[dtype]
    y = values.clamp(-q, q)
    return y.round().to(torch.int8) if dtype == torch.int8 else y.to(dtype)


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 values of codes [..., rows, head_dim] with scales broadcast over the last two dims."""
    return codes.float() * scales[..., None, None]


def store(codes: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write rows x [T, kv_heads, head_dim] (any float dtype) at flat slots into one quantized
    pool (codes [kv_heads, num_blocks, block_size, head_dim], scales [kv_heads, num_blocks]),
    raising block scales and requantizing those blocks' earlier rows as the module docstring
    says. The rows of one block must be consecutive slots (as a sequence writes them)."""
    heads, num_blocks, bs, d = codes.shape
    if x.shape[0] == 0:
        return
    qmax = QMAX[codes.dtype]
    xf = x.float().transpose(0, 1)  # [H, T, D]
    blocks = torch.div(slot_mapping, bs, rounding_mode="floor")
    offsets = slot_mapping - blocks * bs
    uniq, inverse = torch.unique(blocks, return_inverse=True)
    u = uniq.numel()
    amax = torch.zeros((heads, u), dtype=torch.float32, device=x.device).scatter_reduce_(
        1, inverse.expand(heads, -1), xf.abs().amax(-1), "amax")
    first = torch.full((u,), bs, dtype=offsets.dtype, device=x.device).scatter_reduce_(0, inverse, offsets, "amin")
    old = torch.where(first > 0, scales[:, uniq], torch.zeros((), device=x.device))  # offset 0: a fresh block
    new = torch.maximum(old, amax / qmax)
    grow = (new > old) & (old > 0)
    if bool(grow.any()):
        blk = codes[:, uniq]  # [H, U, BS, D]
        moved = encode((blk.float() * old[..., None, None]) * (1.0 / new)[..., None, None], codes.dtype)
        earlier = torch.arange(bs, device=x.device)[None, :] < first[:, None]  # [U, BS]
        codes[:, uniq] = torch.where((grow[..., None] & earlier[None])[..., None], moved, blk)
    scales[:, uniq] = new
    inv = torch.where(new > 0, 1.0 / new, torch.zeros((), device=x.device))  # [H, U]
    codes.view(heads, num_blocks * bs, d)[:, slot_mapping] = encode(xf * inv[:, inverse][..., None], codes.dtype)


def gather_blocks(codes: torch.Tensor, scales: torch.Tensor, blocks: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """[kv_heads, len(blocks), block_size, head_dim] values of the listed blocks, in ``dtype``."""
    return dequantize(codes.index_select(1, blocks), scales.index_select(1, blocks)).to(dtype)


def gather_rows(codes: torch.Tensor, scales: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows of the pool viewed as [kv_heads * num_blocks, block_size, head_dim] picked by
    ``index`` (attention.decode_gather_index), dequantized: [len(index), block_size, head_dim]."""
    heads, num_blocks, bs, d = codes.shape
    rows = codes.view(heads * num_blocks, bs, d).index_select(0, index)
    return dequantize(rows, scales.reshape(-1).index_select(0, index)).to(dtype)



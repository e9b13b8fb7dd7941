"""Sliding windows in the C attention kernels (paged_attention.c for decode rows,
prefill_attention.c for chunks): a query at position p sees keys p - window + 1 .. p only.
Against a float64 softmax over exactly those keys, with windows shorter and longer than
the context, cutting across pool blocks, the prefill kernel's 64-key blocks and its
query items; float32 and bf16 pools. Run under ATEN_CPU_CAPABILITY=avx2
TOKENMILL_KERNEL_ISA=avx2 too (the 8-float-vector build)."""
from __future__ import annotations

import shutil

import pytest
import torch

from tokenmill.model.kernels import cpu_kernels
from tokenmill.model.attention import kv_cache_shape

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not on PATH: the kernel cannot be built")


@pytest.fixture(scope="module")
def lib() -> cpu_kernels.KernelLibrary:
    return cpu_kernels.build()


def _pool(seq_len: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    used = -(-seq_len // block_size)
    num_blocks = used + 3
    k = torch.randn(kv_cache_shape(num_blocks, block_size, kv_heads, head_dim), generator=gen).to(dtype)
    v = torch.randn(kv_cache_shape(num_blocks, block_size, kv_heads, head_dim), generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)[:used].to(torch.int32)
    return k, v, table


def _windowed(q, k, v, table, seq_len: int, window: int, scale: float) -> torch.Tensor:
    """float64: query j of the chunk sits at seq_len - q_len + j and sees its last ``window`` keys."""
    q_len, heads, _ = q.shape
    kv_heads, _, bs, _ = k.shape
    pos = torch.arange(seq_len)
    keys = k[:, table[pos // bs].long(), pos % bs].double()
    vals = v[:, table[pos // bs].long(), pos % bs].double()
    out = torch.empty(q.shape, dtype=torch.float64)
    for j in range(q_len):
        p = seq_len - q_len + j
        lo = max(0, p - window + 1)
        for h in range(heads):
            kv = h // (heads // kv_heads)
            s = (q[j, h].double() @ keys[kv, lo:p + 1].T) * scale
            out[j, h] = torch.softmax(s, -1) @ vals[kv, lo:p + 1]
    return out


CASES = [  # seq_len, q_len, window, block_size
    (40, 1, 8, 4), (3, 1, 8, 4), (200, 1, 37, 16), (90, 1, 300, 8),  # decode rows
    (40, 13, 8, 4), (150, 150, 17, 16), (170, 70, 64, 8), (130, 5, 100, 16),  # prefill chunks
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("seq_len,q_len,window,block_size", CASES)
def test_window_matches_float64(lib, dtype, seq_len, q_len, window, block_size) -> None:
    heads, kv_heads, head_dim = 6, 2, 64
    k, v, table = _pool(seq_len, kv_heads, head_dim, block_size, dtype, seed=seq_len + window)
    q = torch.randn(q_len, heads, head_dim, generator=torch.Generator().manual_seed(q_len)).to(dtype)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    if q_len == 1:
        ok = cpu_kernels.paged_decode_attention(q, k, v, table[None].contiguous(),
                                                torch.tensor([seq_len], dtype=torch.int32), scale, out, lib,
                                                window=window)
    else:
        ok = cpu_kernels.paged_prefill_attention(q, k, v, table, seq_len, scale, out, lib, window=window)
    assert ok
    err = (out.double() - _windowed(q, k, v, table, seq_len, window, scale)).abs().max().item()
    assert err < (1e-5 if dtype == torch.float32 else 3e-2), err


def test_a_window_changes_the_result(lib) -> None:
    """The window is really applied: a context longer than it attends differently."""
    k, v, table = _pool(64, 1, 64, 16, torch.float32, seed=3)
    q = torch.randn(1, 2, 64)
    outs = []
    for window in (None, 8):
        out = torch.empty_like(q)
        assert cpu_kernels.paged_decode_attention(q, k, v, table[None].contiguous(),
                                                  torch.tensor([64], dtype=torch.int32), 0.125, out, lib,
                                                  window=window)
        outs.append(out)
    assert (outs[0] - outs[1]).abs().max() > 1e-3

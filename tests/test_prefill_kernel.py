"""The C prefill-attention kernel (model/kernels/csrc/prefill_attention.c) on its own and
inside the C kernel attention backend.

One chunk of ``q_len`` queries at the end of a ``seq_len`` context, the context
scattered over a pool: whole prompts, chunks after a prefix, single tokens,
lengths on and off the kernel's 64-key blocks and 32-position items, GQA groups
1/3/8, head sizes 16/64/128, float32 and bfloat16, against a float64 causal
softmax written out plainly; the 8-float-vector build; the mixed-batch path
against the SDPA fallback; bad tables and inputs it declines.
"""
from __future__ import annotations

import platform
import random
import shutil

import pytest
import torch

from tokenmill.model.kernels import cpu_kernels
from tokenmill.model.attention import (CpuKernelAttention, StepLayout, TorchPagedAttention, kv_cache_shape,
                                      paged_attention_reference)

# float32 to 1e-5, bf16 within half a bf16 ulp; bf16 products within their bound
from test_cpu_kernels import assert_matches, bf16_product_bound, bf16_products

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not on PATH: the kernel cannot be built")


@pytest.fixture(scope="module")
def lib() -> cpu_kernels.KernelLibrary:
    return cpu_kernels.build()


def make_chunk(seq_len: int, q_len: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
               dtype: torch.dtype, seed: int):
    """A pool holding one sequence's context in shuffled blocks, its int32 table (with
    spare junk entries past the used ones) and the chunk's queries, strided as the model
    slices them out of its fused q/k tensor."""
    gen = torch.Generator().manual_seed(seed)
    used = -(-seq_len // block_size)
    num_blocks = used + 5
    shape = kv_cache_shape(num_blocks, block_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    table = torch.tensor(ids[:used] + [num_blocks - 1] * 2, dtype=torch.int32)
    q = torch.randn(q_len, heads + kv_heads, head_dim, generator=gen).to(dtype)[:, :heads]
    return q, k, v, table


def plain_causal(q, k, v, table, seq_len, scale, bounds: list | None = None) -> torch.Tensor:
    """float64; query j at position seq_len - q_len + j sees keys 0 .. that position. With
    ``bounds`` (a list), also appends each output element's bf16_product_bound."""
    q_len, heads, head_dim = q.shape
    kv_heads, _, block_size, _ = k.shape
    group = heads // kv_heads
    rows = [(int(table[p // block_size]), p % block_size) for p in range(seq_len)]
    keys = torch.stack([k[:, b, o] for b, o in rows], dim=1).double()  # [kv, seq, d]
    vals = torch.stack([v[:, b, o] for b, o in rows], dim=1).double()
    out = torch.empty(q.shape, dtype=torch.float64)
    bound = torch.empty(q.shape, dtype=torch.float64)
    for h in range(heads):
        scores = q[:, h].double() @ keys[h // group].T * scale  # [q_len, seq]
        pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        scores = scores.masked_fill(torch.arange(seq_len)[None] > pos, float("-inf"))
        out[:, h] = torch.softmax(scores, dim=-1) @ vals[h // group]
        if bounds is not None:
            for j in range(q_len):
                seen = seq_len - q_len + j + 1
                bound[j, h] = bf16_product_bound(q[j, h].double(), keys[h // group, :seen],
                                                 vals[h // group, :seen], scale)
    if bounds is not None:
        bounds.append(bound)
    return out


def run(lib, q, k, v, table, seq_len, scale) -> torch.Tensor:
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    assert cpu_kernels.paged_prefill_attention(q, k, v, table, seq_len, scale, out, library=lib)
    return out


CASES = [  # seq_len, q_len
    (1, 1), (5, 5), (64, 64), (65, 65), (97, 97), (256, 256),  # whole prompts
    (300, 44), (130, 66), (77, 1), (200, 199), (129, 33),  # chunks after a prefix
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (4, 4, 64, 32), (16, 2, 128, 8),
                                                               (8, 1, 16, 16)])
def test_kernel_matches_float64_causal_attention(lib, dtype, heads, kv_heads, head_dim, block_size) -> None:
    for i, (seq_len, q_len) in enumerate(CASES):
        q, k, v, table = make_chunk(seq_len, q_len, heads, kv_heads, head_dim, block_size, dtype, seed=i + heads)
        scale = head_dim**-0.5
        bounds: list = []
        want = plain_causal(q, k, v, table, seq_len, scale, bounds)
        assert_matches(run(lib, q, k, v, table, seq_len, scale), want,
                       bounds[0] if bf16_products(lib, dtype, head_dim) else None)


def test_bf16_products_under_float32_queries(lib) -> None:
    """A bf16 pool under float32 queries, the w8a8 default's prefill: within
    bf16_product_bound of float64, well inside it, and not the float32 result."""
    if not lib.bf16_attention:
        pytest.skip("this build's attention is float32 arithmetic (no AVX512-BF16)")
    q, k, v, table = make_chunk(300, 120, 9, 3, 64, 16, torch.bfloat16, seed=9)
    q = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    bounds: list = []
    want = plain_causal(q, k.float(), v.float(), table, 300, 0.125, bounds)
    err = (run(lib, q, k, v, table, 300, 0.125).double() - want).abs()
    assert bool((err <= bounds[0] + 1e-5).all())
    assert float(err.max()) > 0
    assert float(err.mean()) < 0.25 * float(bounds[0].mean())


def test_peaked_and_flat_scores(lib) -> None:
    """One key dominating (scores near 1,000, where float32 itself is off by ~1e-4
    in the output) and near-uniform weights: no further from float64 than torch's
    own float32 SDPA on the same inputs."""
    seq_len, q_len = 400, 150
    q, k, v, table = make_chunk(seq_len, q_len, 9, 3, 64, 16, torch.float32, seed=3)
    rows = [(int(table[p // 16]), p % 16) for p in range(seq_len)]
    keys = torch.stack([k[:, b, o] for b, o in rows], dim=1)[None]
    vals = torch.stack([v[:, b, o] for b, o in rows], dim=1)[None]
    visible = torch.arange(seq_len)[None] <= torch.arange(seq_len - q_len, seq_len)[:, None]
    for scale in (40.0, 1e-4):
        want = plain_causal(q, k, v, table, seq_len, scale)
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None].contiguous(), keys, vals, attn_mask=visible, scale=scale, enable_gqa=True)
        sdpa_err = float((sdpa[0].transpose(0, 1).double() - want).abs().max())
        got_err = float((run(lib, q, k, v, table, seq_len, scale).double() - want).abs().max())
        assert got_err <= 2 * sdpa_err + 1e-6, (scale, got_err, sdpa_err)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="-mno-avx512f is an x86 flag")
def test_eight_lane_build_matches() -> None:
    narrow = cpu_kernels.build(cpu_kernels.ISA_FLAGS["avx2"])  # the AVX2 build the other kernel tests compile
    assert narrow.vector_width == 8
    for seq_len, q_len in ((97, 97), (300, 44)):
        q, k, v, table = make_chunk(seq_len, q_len, 9, 3, 64, 16, torch.float32, seed=q_len)
        assert_matches(run(narrow, q, k, v, table, seq_len, 0.125), plain_causal(q, k, v, table, seq_len, 0.125))


def test_bad_tables_raise_before_writing(lib) -> None:
    q, k, v, table = make_chunk(100, 40, 9, 3, 64, 16, torch.float32, seed=1)
    out = torch.full(q.shape, 7.0)
    bad = table.clone()
    bad[2] = k.shape[1]  # a block id past the pool
    with pytest.raises(ValueError):
        cpu_kernels.paged_prefill_attention(q, k, v, bad, 100, 0.125, out, library=lib)
    with pytest.raises(ValueError):  # the table covers fewer positions than seq_len
        cpu_kernels.paged_prefill_attention(q, k, v, table[:3], 100, 0.125, out, library=lib)
    with pytest.raises(ValueError):  # more queries than context
        cpu_kernels.paged_prefill_attention(q, k, v, table, 30, 0.125, out, library=lib)
    assert bool((out == 7.0).all())


def test_declines_what_it_cannot_take(lib) -> None:
    q, k, v, table = make_chunk(50, 50, 9, 3, 64, 16, torch.float32, seed=2)
    out = torch.empty(q.shape)
    assert not cpu_kernels.paged_prefill_attention(q, k, v, table.long(), 50, 0.125, out, library=lib)
    assert not cpu_kernels.paged_prefill_attention(q.double(), k.double(), v.double(), table, 50, 0.125,
                                                   out.double(), library=lib)
    assert not cpu_kernels.paged_prefill_attention(q, k, v, table, 50, 0.125, out.bfloat16(), library=lib)
    assert not cpu_kernels.paged_prefill_attention(q.transpose(1, 2), k, v, table, 50, 0.125, out, library=lib)
    wide = torch.randn(4, cpu_kernels.PREFILL_MAX_GROUP + 1, 64)  # a query group larger than an item holds
    assert not cpu_kernels.paged_prefill_attention(wide, k[:1], v[:1], table, 50, 0.125, torch.empty_like(wide),
                                                   library=lib)


def _mixed_batch(dtype: torch.dtype):
    """Two decodes, then three prefill chunks (a whole prompt, one after a prefix,
    one token), all in one pool with each K/V already written."""
    heads, kv_heads, head_dim, bs = 9, 3, 64, 16
    seq_lens, query_lens = [40, 17, 150, 260, 33], [1, 1, 150, 90, 1]
    gen = torch.Generator().manual_seed(11)
    used = [-(-n // bs) for n in seq_lens]
    num_blocks = sum(used) + 3
    shape = kv_cache_shape(num_blocks, bs, kv_heads, head_dim)
    k, v = torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)
    ids = list(range(num_blocks))
    random.Random(11).shuffle(ids)
    width = max(used)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.long)
    for i, n in enumerate(used):
        tables[i, :n] = torch.tensor(ids[:n])
        ids = ids[n:]
    q = torch.randn(sum(query_lens), heads + kv_heads, head_dim, generator=gen).to(dtype)[:, :heads]
    layout = StepLayout(slot_mapping=torch.zeros(sum(query_lens), dtype=torch.long), block_tables=tables,
                        seq_lens=seq_lens, query_lens=query_lens, num_decodes=2, block_size=bs)
    return q, k, v, layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mixed_batch_matches_sdpa_path(lib, dtype) -> None:
    """The kernel backend (decodes and chunks in C) against the reference (SDPA for chunks)
    and the torch backend, on one mixed batch."""
    q, k, v, layout = _mixed_batch(dtype)
    got = CpuKernelAttention(lib).prepare(layout).attend(q, k, v, 0.125)
    want = paged_attention_reference(q, k, v, layout, 0.125)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert not torch.equal(got[2:], want[2:])  # the chunks really took the kernel
    torch_backend = TorchPagedAttention(dtype, torch.device("cpu"), 3, 9, k.shape[1], 64)
    off = torch_backend.prepare(layout).attend(q, k, v, 0.125)
    torch.testing.assert_close(got.float(), off.float(), atol=tol, rtol=tol)

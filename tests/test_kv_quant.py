"""The quantized KV cache (model/quant/kv_quant.py and the C kernels' int8 / fp8 paths).

Stores: the C store gives the same codes and scales as the torch one, bit for bit,
for any sequence of writes (hypothesis); every row dequantizes within the stated
bound of what was written (half a step of its block's final scale per rounding it
went through, int8; e4m3's relative step for fp8). Attention: the decode and
prefill kernels over a quantized pool match float64 attention computed on the
dequantized K/V tightly, and attention on the original K/V within a looser,
stated bound; in the default, AVX2 and portable builds.
"""
from __future__ import annotations

import platform
import random
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.model.kernels import cpu_kernels
from tokenmill.model.quant import kv_quant

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not on PATH: the kernel cannot be built")

QDTYPES = [torch.int8, torch.float8_e4m3fn]
QIDS = ["int8", "fp8"]
X86 = platform.machine() in ("x86_64", "AMD64")
# Largest error against attention on the unquantized K/V that the attention tests allow.
# Measured over seeds: up to 0.16 (int8) and 0.54 (fp8) on these deliberately wide keys.
LOOSE = {torch.int8: 0.25, torch.float8_e4m3fn: 0.8}
BUILDS = ["native"] + (["avx2", "portable"] if X86 else [])


def build_for(name: str) -> cpu_kernels.KernelLibrary:
    """One ISA build (the flags test_linear_kernel.py builds with, so one compile serves both)."""
    if name == "native" and cpu_kernels.isa() in BUILDS[1:]:
        pytest.skip(f"TOKENMILL_KERNEL_ISA={cpu_kernels.isa()} makes the native build that one, tested as such")
    if name == "avx2" and "avx2" not in cpu_kernels._cpu_flags():
        pytest.skip("this CPU has no AVX2: the AVX2 build cannot run here")
    return cpu_kernels.build(cpu_kernels.ISA_FLAGS[name])


@pytest.fixture(scope="module")
def lib() -> cpu_kernels.KernelLibrary:
    return cpu_kernels.build()


def empty_pool(kv_heads: int, num_blocks: int, block_size: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    """Codes full of junk (a recycled pool) and junk scales: a fresh block must not read them."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(-100, 100, (2, kv_heads, num_blocks, block_size, head_dim), generator=gen, dtype=torch.int8)
    if dtype != torch.int8:
        raw = raw.float().div(4).to(dtype)
    scales = torch.rand((2, kv_heads, num_blocks), generator=gen) * 5
    return raw[0].clone(), raw[1].clone(), scales[0].clone(), scales[1].clone()


# --------------------------------------------------------------------------- stores

@st.composite
def write_sequences(draw):
    """Several sequences' writes into a small pool: chunks of consecutive positions (a
    prefill chunk or one decode token) with magnitudes that grow, shrink or jump."""
    block_size = draw(st.sampled_from([1, 4, 16]))
    head_dim = draw(st.sampled_from([16, 32]))
    kv_heads = draw(st.integers(1, 3))
    seqs = draw(st.integers(1, 3))
    lens = [draw(st.integers(1, 3 * block_size + 2)) for _ in range(seqs)]
    steps = []  # (seq, start, n)
    done = [0] * seqs
    while any(d < n for d, n in zip(done, lens)):
        s = draw(st.integers(0, seqs - 1))
        if done[s] >= lens[s]:
            continue
        n = draw(st.integers(1, lens[s] - done[s]))
        steps.append((s, done[s], n))
        done[s] += n
    mags = draw(st.lists(st.sampled_from([1e-3, 0.1, 1.0, 3.0, 50.0]), min_size=sum(lens), max_size=sum(lens)))
    return block_size, head_dim, kv_heads, lens, steps, mags, draw(st.integers(0, 2**16))


@pytest.mark.parametrize("dtype", QDTYPES, ids=QIDS)
@settings(max_examples=40, deadline=None)
@given(case=write_sequences())
def test_store_matches_torch_and_stays_within_bound(lib, dtype, case) -> None:
    block_size, head_dim, kv_heads, lens, steps, mags, seed = case
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    used = [-(-n // block_size) for n in lens]
    num_blocks = sum(used) + 2
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = []
    for n in used:
        tables.append(ids[:n])
        ids = ids[n:]
    c_pool = empty_pool(kv_heads, num_blocks, block_size, head_dim, dtype, seed)
    t_pool = tuple(t.clone() for t in c_pool)
    rows: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    requants = {}  # (seq, pos) -> times its block's scale was raised after it was written
    mag_iter = iter(mags)
    for s, start, n in steps:
        k = torch.randn((n, kv_heads, head_dim), generator=gen)
        v = torch.randn((n, kv_heads, head_dim), generator=gen)
        for i in range(n):
            m = next(mag_iter)
            k[i] *= m
            v[i] *= m
        slots = torch.tensor([tables[s][p // block_size] * block_size + p % block_size
                              for p in range(start, start + n)], dtype=torch.int64)
        before = c_pool[2].clone(), c_pool[3].clone()
        assert cpu_kernels.store_kv_quant(c_pool[0], c_pool[1], c_pool[2], c_pool[3], k, v, slots, library=lib)
        kv_quant.store(t_pool[0], t_pool[2], k, slots)
        kv_quant.store(t_pool[1], t_pool[3], v, slots)
        blk0 = tables[s][start // block_size]
        for (rs, rp) in list(requants):  # earlier rows of a block whose scale just grew
            if rs == s and rp // block_size == start // block_size and rp < start and start % block_size:
                grew = (c_pool[2][:, blk0] > before[0][:, blk0]) | (c_pool[3][:, blk0] > before[1][:, blk0])
                if bool(grew.any()):
                    requants[(rs, rp)] += 1
        for i in range(n):
            rows[(s, start + i)] = (k[i], v[i])
            requants[(s, start + i)] = 0
    for a, b in zip(c_pool, t_pool):
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                           b.view(torch.uint8) if b.dtype != torch.float32 else b)
    codes_k, codes_v, sk, sv = c_pool
    for (s, p), (k, v) in rows.items():
        blk, off = tables[s][p // block_size], p % block_size
        r = requants[(s, p)]
        for codes, scales, x in ((codes_k, sk, k), (codes_v, sv, v)):
            got = codes[:, blk, off].float() * scales[:, blk, None]
            step = scales[:, blk, None]
            if dtype == torch.int8:  # half a step per rounding
                bound = step * 0.5 * (1 + r) * (1 + 1e-5)
            else:  # e4m3: 3 mantissa bits (half-ulp 2^-4 relative), subnormal step 2^-9 of the scale
                bound = (1 + r) * (x.abs() * 2.0**-4 * 1.2 + step * 2.0**-9)
            assert bool(((got - x).abs() <= bound + 1e-6).all()), float((got - x).abs().max())


@pytest.mark.parametrize("dtype", QDTYPES, ids=QIDS)
def test_prefill_chunk_codes_each_block_once(lib, dtype) -> None:
    """Rows written in one call share their block's scale decision: each block's scale is its
    rows' largest |value| / QMAX, and every row is within half a step (int8)."""
    k = torch.randn(40, 2, 16) * torch.linspace(0.01, 10, 40)[:, None, None]
    slots = torch.arange(16, 56)  # blocks 1, 2, 3 (8 rows of block 3)
    codes_k, codes_v, sk, sv = empty_pool(2, 5, 16, 16, dtype)
    assert cpu_kernels.store_kv_quant(codes_k, codes_v, sk, sv, k, k.clone(), slots, library=lib)
    qmax = kv_quant.QMAX[dtype]
    for j, blk in enumerate((1, 2, 3)):
        want = k[16 * j:16 * (j + 1)].abs().amax(dim=(0, 2)) / qmax
        torch.testing.assert_close(sk[:, blk], want, rtol=0, atol=0)
        if dtype == torch.int8:
            got = codes_k[:, blk, : min(16, 40 - 16 * j)].float() * sk[:, blk, None, None]
            err = (got - k[16 * j:16 * (j + 1)].transpose(0, 1)).abs()
            assert bool((err <= sk[:, blk, None, None] * 0.5 * (1 + 1e-5)).all())


def test_fp8_codes_match_torch_everywhere(lib) -> None:
    """Every e4m3 value and the midpoints between neighbours (ties to even), coded by the C
    store exactly as torch converts them."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = values[torch.isfinite(values)].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    x = torch.cat([finite, mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9))])
    x = x[x.abs() <= 448]
    x = torch.cat([x, torch.tensor([448.0, -448.0])])  # the block's scale is then exactly 1
    n = x.numel()
    d = 16
    x = torch.cat([x, torch.zeros(-n % d)]).view(-1, 1, d)
    rows = x.shape[0]
    codes_k, codes_v, sk, sv = empty_pool(1, rows, 1, d, torch.float8_e4m3fn)
    slots = torch.arange(rows)
    assert cpu_kernels.store_kv_quant(codes_k, codes_v, sk, sv, x, x, slots, library=lib)
    assert bool((sk == 1.0).sum() >= 1)
    ref_codes = x.transpose(0, 1).reshape(1, rows, 1, d) / sk[:, :, None, None]
    want = kv_quant.encode(ref_codes, torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(codes_k.view(torch.uint8), want)


def test_bf16_rows_and_bad_slots(lib) -> None:
    codes_k, codes_v, sk, sv = empty_pool(1, 4, 4, 16, torch.int8)
    k = torch.randn(3, 1, 16).bfloat16()
    t_pool = [codes_k.clone(), sk.clone()]
    assert cpu_kernels.store_kv_quant(codes_k, codes_v, sk, sv, k, k, torch.tensor([4, 5, 6]), library=lib)
    kv_quant.store(t_pool[0], t_pool[1], k, torch.tensor([4, 5, 6]))
    assert torch.equal(codes_k, t_pool[0]) and torch.equal(sk, t_pool[1])
    before = codes_k.clone()
    with pytest.raises(ValueError):
        cpu_kernels.store_kv_quant(codes_k, codes_v, sk, sv, k, k, torch.tensor([4, 5, 16]), library=lib)
    assert torch.equal(codes_k, before)


# --------------------------------------------------------------------------- attention

def quantized_pool(lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int,
                   dtype: torch.dtype, seed: int):
    """A scattered pool written through the store, position by position in chunks (so
    blocks get requantized), plus the original float K/V and q."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    used = [-(-n // block_size) for n in lens]
    num_blocks = sum(used) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    width = max(used) + 1
    tables = torch.full((len(lens), width), num_blocks - 1, dtype=torch.int32)
    pool = empty_pool(kv_heads, num_blocks, block_size, head_dim, dtype, seed)
    originals = []
    for i, n in enumerate(lens):
        tables[i, :used[i]] = torch.tensor(ids[:used[i]], dtype=torch.int32)
        ids = ids[used[i]:]
        k = torch.randn((n, kv_heads, head_dim), generator=gen) * (1 + torch.rand((n, 1, 1), generator=gen) * 3)
        v = torch.randn((n, kv_heads, head_dim), generator=gen)
        p = 0
        while p < n:
            step = rng.choice([1, 1, 5, block_size])
            slots = torch.tensor([int(tables[i, x // block_size]) * block_size + x % block_size
                                  for x in range(p, min(n, p + step))], dtype=torch.int64)
            kv_quant.store(pool[0], pool[2], k[p:p + step], slots)
            kv_quant.store(pool[1], pool[3], v[p:p + step], slots)
            p += step
        originals.append((k, v))
    q = torch.randn((len(lens), heads, head_dim), generator=gen)
    return q, pool, tables, torch.tensor(lens, dtype=torch.int32), originals


def dense(pool) -> tuple[torch.Tensor, torch.Tensor]:
    return kv_quant.dequantize(pool[0], pool[2]), kv_quant.dequantize(pool[1], pool[3])


def attention64(q, keys, vals, scale, causal_from: int | None = None) -> torch.Tensor:
    """float64 attention of q [nq, heads, d] over keys/vals [kv_heads, L, d]."""
    heads, kv_heads = q.shape[1], keys.shape[0]
    g = heads // kv_heads
    k = keys.double().repeat_interleave(g, 0)
    v = vals.double().repeat_interleave(g, 0)
    s = torch.einsum("qhd,hld->hql", q.double(), k) * scale
    if causal_from is not None:
        pos = torch.arange(q.shape[0])[:, None] + causal_from
        s = s.masked_fill(torch.arange(k.shape[1])[None, :] > pos, float("-inf"))
    return torch.einsum("hql,hld->qhd", torch.softmax(s, -1), v)


def context(deq: torch.Tensor, tables, i: int, n: int, block_size: int) -> torch.Tensor:
    rows = [(int(tables[i, p // block_size]), p % block_size) for p in range(n)]
    return torch.stack([deq[:, b, o] for b, o in rows], dim=1)  # [kv_heads, n, d]


@pytest.mark.parametrize("dtype", QDTYPES, ids=QIDS)
@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("io", [torch.float32, torch.bfloat16], ids=["q32", "qbf16"])
def test_decode_kernel_reads_quantized_pool(dtype, build, io) -> None:
    lib = build_for(build)
    block_size, head_dim = 16, 64
    lens = [1, 16, 17, 47, 130]
    q, pool, tables, seq_lens, originals = quantized_pool(lens, 9, 3, head_dim, block_size, dtype, seed=3)
    scale = head_dim**-0.5
    qi = q.to(io)
    out = torch.full(q.shape, float("nan"), dtype=io)
    assert cpu_kernels.paged_decode_attention(qi, pool[0], pool[1], tables, seq_lens, scale, out, library=lib,
                                              kv_scales=(pool[2], pool[3]))
    dk, dv = dense(pool)
    for i, n in enumerate(lens):
        want = attention64(qi[i:i + 1].float(), context(dk, tables, i, n, block_size),
                           context(dv, tables, i, n, block_size), scale)[0]
        # on the dequantized K/V: float32 rounding (one bf16 rounding of the output for bf16 q)
        tol = 1e-5 if io == torch.float32 else 2.0**-8
        torch.testing.assert_close(out[i].double(), want, atol=tol, rtol=tol)
        # on the original K/V (unit-variance V, keys up to 4x): the quantization error, which
        # the softmax amplifies on peaked scores
        k, v = originals[i]
        exact = attention64(qi[i:i + 1].float(), k.transpose(0, 1), v.transpose(0, 1), scale)[0]
        assert float((out[i].double() - exact).abs().max()) <= LOOSE[dtype]


@pytest.mark.parametrize("dtype", QDTYPES, ids=QIDS)
@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("io", [torch.float32, torch.bfloat16], ids=["q32", "qbf16"])
def test_prefill_kernel_reads_quantized_pool(dtype, build, io) -> None:
    lib = build_for(build)
    block_size, head_dim = 16, 64
    n, q_len = 150, 70  # a chunk after an 80-token prefix
    _, pool, tables, _, originals = quantized_pool([n], 9, 3, head_dim, block_size, dtype, seed=11)
    q = torch.randn(q_len, 9, head_dim, generator=torch.Generator().manual_seed(12)).to(io)
    scale = head_dim**-0.5
    out = torch.full(q.shape, float("nan"), dtype=io)
    assert cpu_kernels.paged_prefill_attention(q, pool[0], pool[1], tables[0].contiguous(), n, scale, out,
                                               library=lib, kv_scales=(pool[2], pool[3]))
    dk, dv = dense(pool)
    want = attention64(q.float(), context(dk, tables, 0, n, block_size), context(dv, tables, 0, n, block_size),
                       scale, causal_from=n - q_len)
    tol = 1e-5 if io == torch.float32 else 2.0**-8
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    k, v = originals[0]
    exact = attention64(q.float(), k.transpose(0, 1), v.transpose(0, 1), scale, causal_from=n - q_len)
    assert float((out.double() - exact).abs().max()) <= LOOSE[dtype]


def test_kernels_refuse_a_quantized_pool_without_scales(lib) -> None:
    q, pool, tables, seq_lens, _ = quantized_pool([20], 4, 2, 16, 16, torch.int8, seed=1)
    out = torch.empty_like(q)
    assert not cpu_kernels.paged_decode_attention(q, pool[0], pool[1], tables, seq_lens, 0.25, out, library=lib)
    assert not cpu_kernels.paged_prefill_attention(q, pool[0], pool[1], tables[0].contiguous(), 20, 0.25, out,
                                                   library=lib)
    bad = (pool[2].double(), pool[3])
    assert not cpu_kernels.paged_decode_attention(q, pool[0], pool[1], tables, seq_lens, 0.25, out, library=lib,
                                                  kv_scales=bad)


# --------------------------------------------------------------------------- backends

@pytest.mark.parametrize("dtype", QDTYPES, ids=QIDS)
def test_every_backend_reads_a_quantized_pool_as_its_dequantized_values(lib, dtype) -> None:
    """A mixed step (two decodes, two prefill chunks after a prefix) over a quantized pool,
    through the C kernels, torch paged attention (per chunk and padded batch) and the
    reference: each equals the reference attention over the dequantized float32 pool."""
    from tokenmill.model.attention import (CpuKernelAttention, StepLayout, TorchPagedAttention,
                                           paged_attention_reference)
    from tokenmill.model.attention.reference import ReferenceAttention

    heads, kv_heads, d, bs = 6, 2, 32, 8
    lens, qlens = [13, 30, 21, 40], [1, 1, 21, 9]
    _, pool, tables, _, _ = quantized_pool(lens, heads, kv_heads, d, bs, dtype, seed=4)
    layout = StepLayout(torch.zeros(sum(qlens), dtype=torch.long), tables.long(), lens, qlens, 2, bs)
    q = torch.randn(sum(qlens), heads, d)
    dk, dv = dense(pool)
    want = paged_attention_reference(q, dk, dv, layout, 0.2)
    scales = (pool[2], pool[3])
    torch_paged = TorchPagedAttention(torch.float32, torch.device("cpu"), kv_heads, heads, pool[0].shape[1], d)
    padded = TorchPagedAttention(torch.float32, torch.device("cpu"), kv_heads, heads, pool[0].shape[1], d)
    padded.batched_prefill = True  # the GPU's padded batch, run here
    for backend in (CpuKernelAttention(lib), torch_paged, padded, ReferenceAttention()):
        step = backend.prepare(layout)
        if backend is padded:
            assert step.padded is not None
        got = step.attend(q, pool[0], pool[1], 0.2, scales)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=backend.name)

"""The eager model's one-pass C ops (model/kernels/csrc/elementwise.c) and the fused residual add.

Rotary must be bit-identical to the torch formula it replaces, in float32 and
bf16; RMSNorm and SiLU(gate) * up are checked against float64 (bf16: within
one or two bf16 steps of torch's ops, almost always equal) (they sum and exponentiate in
another order than torch, as the fused decode step always has); the K/V
stores must write exactly what index_copy_ writes; the residual
add fused into oneDNN's matmul must equal the separate add bit for bit; and
every op falls back to torch where the kernel cannot take its tensors."""
from __future__ import annotations

import shutil
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.model.kernels import cpu_kernels
from tokenmill.model.attention import kv_cache_shape
from tokenmill.model.attention.torch_paged import write_kv
from tokenmill.model.ops import TORCH_OPS, ModelOps
from tokenmill.model.models.llama import MLP, Linear, RMSNorm, _rotate, linear_add

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not on PATH: the kernel cannot be built")


@pytest.fixture(scope="module")
def lib() -> cpu_kernels.KernelLibrary:
    return cpu_kernels.build()


def _rows(seed: int, rows: int, cols: int, pad: int, scale: float = 1.0) -> torch.Tensor:
    """[rows, cols] float32, a strided view of a wider tensor when pad > 0."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols + pad, generator=gen) * scale)[:, :cols]


@settings(max_examples=150, deadline=None)
@given(rows=st.integers(0, 40), n=st.integers(1, 1100), pad=st.sampled_from([0, 0, 5, 64]),
       scale=st.sampled_from([1e-3, 1.0, 30.0]), seed=st.integers(0, 2**31 - 1))
def test_rms_norm_matches_float64(lib, rows, n, pad, scale, seed) -> None:
    x = _rows(seed, rows, n, pad, scale)
    w = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1))
    got = cpu_kernels.rms_norm(x, w, 1e-5, library=lib)
    assert got is not None and got.shape == (rows, n) and got.is_contiguous()
    x64 = x.double()
    want = w.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert torch.allclose(got.double(), want, rtol=2e-6, atol=1e-6 * float(w.abs().max()))


@settings(max_examples=150, deadline=None)
@given(rows=st.integers(0, 40), inter=st.integers(1, 700), pad=st.sampled_from([0, 0, 7]),
       scale=st.sampled_from([0.1, 3.0, 60.0]), seed=st.integers(0, 2**31 - 1))
def test_silu_mul_matches_float64(lib, rows, inter, pad, scale, seed) -> None:
    gu = _rows(seed, rows, 2 * inter, pad, scale)
    if rows:
        gu[0, 0] = -0.0
        gu[-1, min(1, inter - 1)] = -200.0  # exp underflows: silu -> -0
    got = cpu_kernels.silu_mul(gu, inter, library=lib)
    assert got is not None and got.shape == (rows, inter)
    g, u = gu[:, :inter].double(), gu[:, inter:].double()
    want = g * torch.sigmoid(g) * u
    assert torch.allclose(got.double(), want, rtol=4e-6, atol=1e-30)


@settings(max_examples=150, deadline=None)
@given(tokens=st.integers(0, 30), heads=st.integers(1, 12), half=st.integers(1, 64),
       extra=st.sampled_from([0, 0, 3, 128]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**31 - 1))
def test_rope_is_bit_identical_to_rotate(lib, tokens, heads, half, extra, dtype, seed) -> None:
    d = 2 * half
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(tokens, heads * d + extra, generator=gen).to(dtype)  # q/k heads, then v columns
    x = fused[:, : heads * d].view(tokens, heads, d)
    cos = torch.randn(tokens, 1, d, generator=gen).to(dtype)
    sin = torch.randn(tokens, 1, d, generator=gen).to(dtype)
    want = _rotate(x, cos, sin)
    tail = fused[:, heads * d :].clone()
    assert cpu_kernels.rope_(x, cos, sin, library=lib)
    assert torch.equal(x, want)
    assert torch.equal(fused[:, heads * d :], tail)  # columns past the heads untouched


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps apart two bf16 tensors of equal signs are, elementwise."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 24), n=st.sampled_from([1, 16, 64, 576, 1000]), scale=st.sampled_from([0.05, 1.0, 20.0]),
       seed=st.integers(0, 2**31 - 1))
def test_bf16_rms_norm_rounds_as_the_torch_module_does(lib, rows, n, scale, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, n, generator=gen) * scale).bfloat16()
    w = torch.randn(n, generator=gen).bfloat16()
    got = cpu_kernels.rms_norm(x, w, 1e-5, library=lib)
    assert got is not None and got.dtype == torch.bfloat16
    xf = x.float()
    want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()  # RMSNorm.forward's ops
    ulps = _bf16_ulps(got, want)  # the norm one bf16 step off can be two after the weight's rounding
    assert int(ulps.max()) <= 2 and float((ulps == 0).float().mean()) > 0.97


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 24), inter=st.sampled_from([1, 16, 200, 1536]), scale=st.sampled_from([0.1, 3.0, 40.0]),
       seed=st.integers(0, 2**31 - 1))
def test_bf16_silu_mul_rounds_as_torch_does(lib, rows, inter, scale, seed) -> None:
    gu = (torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()
    got = cpu_kernels.silu_mul(gu, inter, library=lib)
    assert got is not None and got.dtype == torch.bfloat16
    want = F.silu(gu[:, :inter]) * gu[:, inter:]
    # exp_nonpos flushes e^x below x = -87 to 0: silu of such a gate is 0, not ~1e-36
    tiny = (want.float().abs() < 1e-30) & (got.float().abs() < 1e-30)
    ulps = torch.where(tiny, 0, _bf16_ulps(got, want))
    assert int(ulps.max()) <= 1 and float((ulps == 0).float().mean()) > 0.97


def test_ops_decline_what_they_cannot_take(lib) -> None:
    x = torch.randn(4, 64)
    w = torch.randn(64)
    assert cpu_kernels.rms_norm(x.half(), w.half(), 1e-5, library=lib) is None
    assert cpu_kernels.rms_norm(x.bfloat16(), w, 1e-5, library=lib) is None  # mixed dtypes
    assert cpu_kernels.rms_norm(x.t().contiguous().t(), w, 1e-5, library=lib) is None  # inner stride 4
    assert cpu_kernels.rms_norm(x, torch.randn(63), 1e-5, library=lib) is None
    assert cpu_kernels.silu_mul(x, 31, library=lib) is None  # not gate and up of equal width
    assert cpu_kernels.silu_mul(x.double(), 32, library=lib) is None
    q = torch.randn(3, 2, 64)
    cos, sin = torch.randn(3, 1, 64), torch.randn(3, 1, 64)
    before = q.clone()
    assert not cpu_kernels.rope_(q.double(), cos.double(), sin.double(), library=lib)
    assert not cpu_kernels.rope_(q, cos.bfloat16(), sin.bfloat16(), library=lib)
    assert not cpu_kernels.rope_(q, cos[:2], sin[:2], library=lib)  # a table row short
    assert not cpu_kernels.rope_(q.transpose(0, 1), cos, sin, library=lib)  # heads not contiguous
    assert torch.equal(q, before)


def test_modules_without_an_engine_use_the_torch_ops() -> None:
    """A model no engine has bound (kernels switched off, CUDA) runs the torch formulas."""
    x = torch.randn(5, 32)
    norm = RMSNorm(32, 1e-5)
    assert norm.ops is TORCH_OPS and TORCH_OPS.library is None
    x64 = x.double()
    want = (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)).float()
    assert torch.allclose(norm(x), want, atol=1e-6)


def test_modules_take_the_kernels_on_cpu_float32(lib) -> None:
    """With the kernel ops bound, RMSNorm (2-D) and the MLP go through C and agree with the
    torch formulas; 3-D input (Qwen3's per-head norms) keeps the torch path."""
    torch.manual_seed(0)
    ops = ModelOps(lib)
    norm = RMSNorm(96, 1e-6)
    norm.ops = ops
    norm.weight.data = torch.randn(96)
    x = torch.randn(7, 96)
    torch_norm = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.allclose(norm(x), torch_norm, rtol=1e-5, atol=1e-6)
    x3 = torch.randn(7, 3, 32)
    norm3 = RMSNorm(32, 1e-6)
    norm3.ops = ops
    assert torch.equal(norm3(x3), norm3.weight * (x3 * torch.rsqrt(x3.pow(2).mean(-1, keepdim=True) + 1e-6)))

    class Cfg:
        hidden_size, intermediate_size = 64, 80

    mlp = MLP(Cfg())  # type: ignore[arg-type]
    mlp.ops = ops
    with torch.inference_mode():
        h, res = torch.randn(6, 64), torch.randn(6, 64)
        gate, up = mlp.gate_up_proj(h).split(80, dim=-1)
        want = res + mlp.down_proj(F.silu(gate) * up)
        assert torch.allclose(mlp(h, residual=res), want, rtol=1e-5, atol=1e-6)
        assert torch.allclose(mlp(h), want - res, rtol=1e-5, atol=1e-5)


def test_linear_add_is_the_separate_add_bit_for_bit() -> None:
    torch.manual_seed(0)
    layer = Linear(192, 64, bias=False)
    with torch.inference_mode():
        for rows in (1, 7, 512):
            x, res = torch.randn(rows, 192), torch.randn(rows, 64)
            assert torch.equal(linear_add(layer, x, res), res + layer(x))
        biased = Linear(32, 16, bias=True)
        x, res = torch.randn(5, 32), torch.randn(5, 16)
        assert torch.equal(linear_add(biased, x, res), res + biased(x))
        other = torch.nn.Linear(32, 16)  # any other projection: the plain sum
        assert torch.equal(linear_add(other, x, res), res + other(x))
        half = layer.bfloat16()  # not float32: no oneDNN post-op, the plain sum
        xb, rb = torch.randn(3, 192).bfloat16(), torch.randn(3, 64).bfloat16()
        assert torch.equal(linear_add(half, xb, rb), rb + half(xb))


@settings(max_examples=100, deadline=None)
@given(tokens=st.integers(0, 40), kv_heads=st.integers(1, 4), d=st.sampled_from([16, 64, 80]),
       block_size=st.sampled_from([1, 4, 16]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**31 - 1))
def test_store_kv_writes_what_index_copy_writes(lib, tokens, kv_heads, d, block_size, dtype, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_blocks = tokens // block_size + 3
    shape = kv_cache_shape(num_blocks, block_size, kv_heads, d)
    k_cache, v_cache = torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)
    fused = torch.randn(tokens, 3 * kv_heads * d, generator=gen).to(dtype)  # q | k | v, as qkv_proj leaves them
    k = fused[:, kv_heads * d : 2 * kv_heads * d].view(tokens, kv_heads, d)
    v = fused[:, 2 * kv_heads * d :].view(tokens, kv_heads, d)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    want_k, want_v = k_cache.clone(), v_cache.clone()
    with mock.patch.object(cpu_kernels, "store_kv", return_value=False):  # the torch path
        write_kv(want_k, want_v, k, v, slots)
    assert cpu_kernels.store_kv(k_cache, v_cache, k, v, slots, library=lib)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_store_kv_refuses_a_slot_outside_the_pool(lib) -> None:
    k_cache = torch.zeros(kv_cache_shape(2, 4, 1, 16))
    v_cache = torch.zeros_like(k_cache)
    k = v = torch.ones(2, 1, 16)
    with pytest.raises(ValueError):
        cpu_kernels.store_kv(k_cache, v_cache, k, v, torch.tensor([0, 8]), library=lib)
    assert not k_cache.any() and not v_cache.any()  # checked before anything is written
    assert not cpu_kernels.store_kv(k_cache.half(), v_cache.half(), k.half(), v.half(),
                                    torch.tensor([0, 1]), library=lib)
    # float32 rows into a bf16 pool are rounded (test_kv_bf16_pool.py); bf16 rows into a float32 pool are refused
    assert not cpu_kernels.store_kv(k_cache, v_cache, k.bfloat16(), v.bfloat16(), torch.tensor([0, 1]), library=lib)
    assert not cpu_kernels.store_kv(k_cache, v_cache, k, v, torch.tensor([0, 1], dtype=torch.int32), library=lib)

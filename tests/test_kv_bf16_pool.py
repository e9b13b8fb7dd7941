"""A bf16 KV pool under float32 compute (``--kv-cache-dtype bfloat16`` with a float32 model).

Rows are rounded to bf16 when stored (to nearest even, as ``Tensor.to`` rounds) and
widened back to float32 when read, so the pool holds twice the tokens of a float32 one
and attention reads half the bytes, with float32 arithmetic (on a CPU with AVX512-BF16
the C kernels multiply bf16-rounded queries and weights instead: test_cpu_kernels). The C store gives
``k.to(bfloat16)`` bit for bit; every attention backend reads the pool as the float32
reference reads its widened copy; the engine's greedy text stays with the float32
pool's on the tiny model; a w8a8 decode row is the same fused and eager.
"""
from __future__ import annotations

import random
import shutil

import pytest
import torch

from conftest import make_tiny_llm, tiny_config
from test_cpu_kernels import bf16_product_bound, bf16_products
from tokenmill import SamplingParams
from tokenmill.engine.step.runner import num_blocks_for_budget
from tokenmill.model.kernels import cpu_kernels
from tokenmill.model.quant import kv_quant

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not on PATH: the kernel cannot be built")


@pytest.fixture(scope="module")
def lib() -> cpu_kernels.KernelLibrary:
    return cpu_kernels.build()


def test_names_and_budget() -> None:
    assert kv_quant.resolve_kv_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert kv_quant.resolve_kv_dtype("bf16", torch.float32) == torch.bfloat16
    with pytest.raises(ValueError, match="compute dtype"):
        kv_quant.resolve_kv_dtype("float16", torch.float32)
    with pytest.raises(ValueError, match="compute dtype"):
        kv_quant.resolve_kv_dtype("float32", torch.bfloat16)
    cfg = tiny_config(head_dim=64, num_key_value_heads=3, num_attention_heads=9, hidden_size=576)
    budget = 64 << 20
    assert num_blocks_for_budget(cfg, 16, torch.bfloat16, budget) == 2 * num_blocks_for_budget(
        cfg, 16, torch.float32, budget)


@needs_gcc
def test_the_c_store_rounds_as_torch_does(lib) -> None:
    kv_heads, num_blocks, bs, d = 3, 6, 4, 32
    k_cache = torch.zeros(kv_heads, num_blocks, bs, d, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(7, kv_heads, d) * torch.logspace(-3, 3, 7)[:, None, None]
    v = torch.randn(7, kv_heads, d)
    k[0, 0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), 3.0e38])
    slots = torch.tensor([0, 5, 6, 7, 12, 13, 23])
    assert cpu_kernels.store_kv(k_cache, v_cache, k, v, slots, lib)
    for cache, src in ((k_cache, k), (v_cache, v)):
        got = cache.view(kv_heads, -1, d)[:, slots].transpose(0, 1)
        torch.testing.assert_close(got, src.to(torch.bfloat16), rtol=0, atol=0, equal_nan=True)  # any NaN bits
    with pytest.raises(ValueError, match="outside the pool"):
        cpu_kernels.store_kv(k_cache, v_cache, k[:1], v[:1], torch.tensor([num_blocks * bs]), lib)
    # a float32 pool under bf16 rows is no pair the store takes
    assert not cpu_kernels.store_kv(k_cache.float(), v_cache.float(), k.bfloat16(), v.bfloat16(), slots, lib)


@needs_gcc
def test_every_backend_reads_the_pool_as_its_widened_values(lib) -> None:
    """A mixed step (two decodes, two prefill chunks after a prefix) over a bf16 pool with
    float32 queries, through the C kernels, torch paged attention (per chunk and padded
    batch) and the reference: each equals the reference over the pool widened to float32."""
    from tokenmill.model.attention import (CpuKernelAttention, StepLayout, TorchPagedAttention,
                                           paged_attention_reference)
    from tokenmill.model.attention.reference import ReferenceAttention

    heads, kv_heads, d, bs, num_blocks = 6, 2, 32, 8, 24
    lens, qlens = [13, 30, 21, 40], [1, 1, 21, 9]
    gen = torch.Generator().manual_seed(4)
    k_pool = torch.randn(kv_heads, num_blocks, bs, d, generator=gen).bfloat16()
    v_pool = torch.randn(kv_heads, num_blocks, bs, d, generator=gen).bfloat16()
    order = torch.randperm(num_blocks, generator=gen).int()
    tables = torch.stack([order[i * 5:(i + 1) * 5] for i in range(4)]).contiguous()
    layout = StepLayout(torch.zeros(sum(qlens), dtype=torch.long), tables.long(), lens, qlens, 2, bs)
    q = torch.randn(sum(qlens), heads, d, generator=gen)
    want = paged_attention_reference(q, k_pool.float(), v_pool.float(), layout, 0.2)
    torch_paged = TorchPagedAttention(torch.float32, torch.device("cpu"), kv_heads, heads, num_blocks, d)
    padded = TorchPagedAttention(torch.float32, torch.device("cpu"), kv_heads, heads, num_blocks, d)
    padded.batched_prefill = True  # the GPU's padded batch, run here
    for backend in (CpuKernelAttention(lib), torch_paged, padded, ReferenceAttention()):
        step = backend.prepare(layout)
        if backend is padded:
            assert step.padded is not None
        got = step.attend(q, k_pool, v_pool, 0.2)
        assert got.dtype == torch.float32
        if isinstance(backend, CpuKernelAttention) and bf16_products(lib, torch.bfloat16, d):
            # Decode rows and prefill chunks alike multiply bf16 products here: each query
            # row within test_cpu_kernels.bf16_product_bound of the widened pool's result.
            row = 0
            for n, (length, qlen) in enumerate(zip(lens, qlens)):
                rows = [(int(tables[n, p // bs]), p % bs) for p in range(length)]
                keys = torch.stack([k_pool[:, b, o] for b, o in rows], 1).double()
                vals = torch.stack([v_pool[:, b, o] for b, o in rows], 1).double()
                for seen in range(length - qlen + 1, length + 1):
                    for h in range(heads):
                        kv = h // (heads // kv_heads)
                        bound = bf16_product_bound(q[row, h].double(), keys[kv, :seen], vals[kv, :seen], 0.2)
                        err = (got[row, h].double() - want[row, h].double()).abs()
                        assert bool((err <= bound + 2e-5).all()), (n, seen, h)
                    row += 1
            continue
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=backend.name)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(48)]
    return [(shared if i % 3 == 0 else []) + [rng.randrange(256) for _ in range(rng.randint(2, 60))]
            for i in range(12)]


def test_engine_greedy_text_stays_with_the_float32_pool() -> None:
    """Chunked prefill, the prefix cache and preemption over the bf16 pool: every block comes
    back, and the greedy tokens match the float32 pool's (the tiny random model's
    near-ties aside: most positions)."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in make_tiny_llm().generate(_prompts(3), params)]
    llm = make_tiny_llm(kv_cache_dtype="bfloat16", num_blocks=24, max_num_batched_tokens=64)
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.bfloat16 and llm.engine.dtype == torch.float32
    got = [o.outputs[0].token_ids for o in llm.generate(_prompts(3), params)]
    assert llm.engine.total_preemptions > 0 and llm.engine.prefix_cache.stats.hit_tokens > 0
    llm.engine.check_idle_invariants()
    assert llm.engine.pool.num_in_use == 0
    same = sum(a == b for a, b in zip(got, want))
    assert same >= 10, (same, got, want)


@needs_gcc
def test_w8a8_rows_are_the_same_fused_and_eager_over_the_pool(monkeypatch) -> None:
    from test_fused_decode import _decode, _engine, _new_kv, _prefill_all_but_last, _prompts as fused_prompts
    from test_fused_decode import _requests
    from conftest import tiny_loaded

    engine = _engine(tiny_loaded(seed=4, num_hidden_layers=4), dtype="float32", quantization="w8a8",
                     kv_cache_dtype="bfloat16")
    assert engine.runner.fused is not None and engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    if not engine.kernels.library.int8_dot:
        pytest.skip("bit-for-bit w8a8 rows need the VNNI kernels")
    reqs = _requests(engine, fused_prompts(9, seed=7))
    _prefill_all_but_last(engine, reqs)
    got = _decode(engine, reqs, True, monkeypatch)
    got_kv = _new_kv(engine, reqs)
    want = _decode(engine, reqs, False, monkeypatch)
    assert torch.equal(got, want) and torch.equal(got_kv, _new_kv(engine, reqs))

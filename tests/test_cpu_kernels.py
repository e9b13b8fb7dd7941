"""The C decode-attention kernel (model/kernels/csrc/paged_attention.c) on its own.

Random pools with scattered block tables, GQA, lengths on and off block
boundaries (and 1), several block sizes and head sizes, float32 and bfloat16,
against a float64 softmax attention written out plainly; bit-exact batch
invariance; the 8-float-vector build (AVX2 machines); what happens when the
kernel is disabled, cannot take the tensors, or is given a bad table; the
compile cache under concurrent first use; and the runner's per-step metadata.
"""
from __future__ import annotations

import os
import platform
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenmill.model.kernels import cpu_kernels
from tokenmill.model.attention import (StepLayout, TorchPagedAttention, kernel_attention_fits, kv_cache_shape,
                                      paged_attention_reference, select_attention_backend)
from tokenmill.settings.options import KernelOptions

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not on PATH: the kernel cannot be built")


@pytest.fixture(scope="module")
def lib() -> cpu_kernels.KernelLibrary:
    """The default build; a compile failure fails the tests (only a missing gcc skips)."""
    return cpu_kernels.build()


def make_pool(lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int,
              dtype: torch.dtype, seed: int, strided_q: bool = False):
    """Pool with every sequence's blocks scattered at random, int32 tables (padded with
    junk ids past each sequence's blocks, which the kernel must never read)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    used = [-(-n // block_size) for n in lens]
    num_blocks = sum(used) + 7
    shape = kv_cache_shape(num_blocks, block_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    width = max(used) + 2
    tables = torch.full((len(lens), width), num_blocks - 1, dtype=torch.int32)
    for i, n in enumerate(used):
        tables[i, :n] = torch.tensor(free[:n], dtype=torch.int32)
        free = free[n:]
    if strided_q:  # as the model slices q out of its fused q/k rotation output
        q = torch.randn(len(lens), heads + kv_heads, head_dim, generator=gen).to(dtype)[:, :heads]
    else:
        q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32)


def bf16_product_bound(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, scale: float) -> torch.Tensor:
    """How far one head's output (float64 q [d], keys and vals [len, d]) may move when the
    kernel multiplies bf16-rounded q and softmax weights (vdpbf16ps; ``lib.bf16_attention``):
    rounding q moves score t by at most 2^-9 scale sum|q k_t|, so a normalised weight by a
    factor within exp(+-2 of the largest such move); rounding a weight moves it by 2^-9 of
    itself. With every weight within a relative delta, the output moves by at most
    delta / (1 - delta) * sum_t p_t |v_t - out|."""
    scores = keys @ q * scale
    moved = 2.0**-9 * scale * (keys.abs() @ q.abs()).max()
    delta = 2.0**-9 + float(torch.expm1(2 * moved))
    probs = torch.softmax(scores, dim=0)
    out = probs @ vals
    return delta / (1 - delta) * (probs @ (vals - out).abs())


def plain_attention(q, k, v, tables, lens, scale, bounds: list | None = None) -> torch.Tensor:
    """float64, one sequence and head at a time, keys gathered position by position. With
    ``bounds`` (a list), also appends the tensor of bf16_product_bound per output element."""
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads, _, block_size, _ = k.shape
    group = heads // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    bound = torch.empty(q.shape, dtype=torch.float64)
    for n, length in enumerate(lens.tolist()):
        rows = [(int(tables[n, p // block_size]), p % block_size) for p in range(length)]
        for h in range(heads):
            kv = h // group
            keys = torch.stack([k[kv, b, o] for b, o in rows]).double()
            vals = torch.stack([v[kv, b, o] for b, o in rows]).double()
            probs = torch.softmax(keys @ q[n, h].double() * scale, dim=0)
            out[n, h] = probs @ vals
            if bounds is not None:
                bound[n, h] = bf16_product_bound(q[n, h].double(), keys, vals, scale)
    if bounds is not None:
        bounds.append(bound)
    return out


def bf16_products(lib: cpu_kernels.KernelLibrary, pool_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether this build's decode attention multiplies bf16-rounded q and weights here."""
    return lib.bf16_attention and pool_dtype == torch.bfloat16 and head_dim % 32 == 0


def run_kernel(lib, q, k, v, tables, lens, scale) -> torch.Tensor:
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    assert cpu_kernels.paged_decode_attention(q, k, v, tables, lens, scale, out, library=lib)
    return out


def assert_matches(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor | None = None) -> None:
    """float32 math: float32 outputs to 1e-5, bf16 ones within half a bf16 ulp (2^-9
    relative, one rounding). ``bound``: bf16 products (bf16_product_bound) on top of that."""
    if bound is not None:
        err = (got.double() - want).abs()
        allowed = bound + 1e-5 + (want.abs() * 2.0**-8 if got.dtype == torch.bfloat16 else 0)
        assert bool((err <= allowed).all()), float((err - allowed).max())
    elif got.dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    else:  # fp32 math, one bf16 rounding of the output: within half a bf16 ulp (2^-9 relative)
        err = (got.double() - want).abs()
        assert bool((err <= want.abs() * 2.0**-8 + 1e-6).all()), float((err / want.abs()).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (6, 2), (4, 4)])
@pytest.mark.parametrize("block_size,head_dim", [(4, 16), (16, 64), (32, 64), (16, 16), (32, 128)])
def test_kernel_matches_float64_attention(lib, dtype, heads, kv_heads, block_size, head_dim) -> None:
    lens = [1, block_size, block_size + 1, 3 * block_size - 1, 37, 70]
    q, k, v, tables, seq_lens = make_pool(lens, heads, kv_heads, head_dim, block_size, dtype,
                                          seed=heads * 100 + block_size + head_dim, strided_q=heads == 9)
    scale = head_dim**-0.5
    got = run_kernel(lib, q, k, v, tables, seq_lens, scale)
    bounds: list = []
    want = plain_attention(q, k, v, tables, seq_lens, scale, bounds)
    assert_matches(got, want, bounds[0] if bf16_products(lib, dtype, head_dim) else None)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_bf16_products_stay_within_their_bound_and_near_the_float32_math(lib, head_dim) -> None:
    """A bf16 pool under float32 queries (the fused step's and the w8a8 default's case): with
    bf16 products, within bf16_product_bound of the float64 attention, and on random data
    well inside it (a bound that a broken kernel would also meet would be no test)."""
    if not lib.bf16_attention:
        pytest.skip("this build's attention is float32 arithmetic (no AVX512-BF16)")
    q, k, v, tables, lens = make_pool([1, 16, 300, 77], 9, 3, head_dim, 16, torch.bfloat16, seed=head_dim)
    q = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))  # float32 queries
    out = torch.full(q.shape, float("nan"))
    assert cpu_kernels.paged_decode_attention(q, k, v, tables, lens, head_dim**-0.5, out, library=lib)
    bounds: list = []
    want = plain_attention(q, k.float(), v.float(), tables, lens, head_dim**-0.5, bounds)
    err = (out.double() - want).abs()
    assert bool((err <= bounds[0] + 1e-5).all())
    assert float(err.max()) > 0  # the products are bf16: not the float32 result
    assert float(err.mean()) < 0.25 * float(bounds[0].mean())


@pytest.mark.parametrize("vectors", [1, 2, 3, 4])
def test_bf16_rows_widened_by_halves_and_in_pairs_match_float64(lib, vectors) -> None:
    """Without bf16 products a bf16 row is widened to float32 in registers: a block of two
    vectors' values from one load, even and odd values apart (head sizes an even number of
    vectors), or each vector's values on their own (an odd number): both orders give the
    float32 math, with float32 and with bf16 queries."""
    head_dim = vectors * lib.vector_width
    if bf16_products(lib, torch.bfloat16, head_dim):
        pytest.skip("this build multiplies bf16 rows at this head size as they are (vdpbf16ps)")
    for q_dtype in (torch.float32, torch.bfloat16):
        q, k, v, tables, lens = make_pool([1, 8, 9, 70, 129], 6, 2, head_dim, 8, torch.bfloat16, seed=vectors,
                                          strided_q=True)
        q = q.to(q_dtype)
        want = plain_attention(q, k, v, tables, lens, head_dim**-0.5)
        assert_matches(run_kernel(lib, q, k, v, tables, lens, head_dim**-0.5), want)


def test_kernel_handles_peaked_and_flat_scores(lib) -> None:
    """Large scale (one key dominates, the others' exp underflows to 0) and tiny scale
    (near-uniform weights over 500 keys)."""
    q, k, v, tables, lens = make_pool([500, 33], 6, 2, 64, 16, torch.float32, seed=5)
    for scale in (40.0, 1e-4):
        assert_matches(run_kernel(lib, q, k, v, tables, lens, scale), plain_attention(q, k, v, tables, lens, scale))


def test_a_narrowed_process_builds_what_a_full_one_builds_with_the_same_flags() -> None:
    """``make test`` runs the kernel tests again with the kernels narrowed to AVX2: its
    native, AVX2 and portable builds have the flags (and so the cache key) of the full
    run's AVX2 and portable builds, and are not compiled twice."""
    def flags(isa: str, extra: tuple[str, ...]) -> tuple[str, ...]:
        return cpu_kernels.CFLAGS + cpu_kernels._isa_flags(isa, extra) + extra

    avx2, portable = cpu_kernels.ISA_FLAGS["avx2"], cpu_kernels.ISA_FLAGS["portable"]
    assert flags("avx2", ()) == flags("native", avx2) == flags("avx2", avx2)
    assert flags("avx2", portable) == flags("native", portable)
    assert flags("avx2", ("-O0",)) == cpu_kernels.CFLAGS + avx2 + ("-O0",)  # extra flags alone keep the narrowing


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="-mno-avx512f is an x86 flag")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_eight_lane_build_matches(dtype) -> None:
    """The build for machines without AVX-512 (8-float vectors, another shuffle tree)."""
    narrow = cpu_kernels.build(cpu_kernels.ISA_FLAGS["avx2"])  # the AVX2 build the other kernel tests compile
    assert narrow.vector_width == 8
    q, k, v, tables, lens = make_pool([1, 9, 40, 123], 9, 3, 64, 16, dtype, seed=8, strided_q=True)
    assert_matches(run_kernel(narrow, q, k, v, tables, lens, 0.125), plain_attention(q, k, v, tables, lens, 0.125))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_is_batch_invariant_bit_for_bit(lib, dtype) -> None:
    """A sequence's output bits do not depend on its neighbours, its row, or the thread count."""
    lens = [45, 1500, 7, 900, 1]
    q, k, v, tables, seq_lens = make_pool(lens, 9, 3, 64, 16, dtype, seed=21)
    batch = run_kernel(lib, q, k, v, tables, seq_lens, 0.125)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for i in (0, 2, 4):
                alone = run_kernel(lib, q[i : i + 1], k, v, tables[i : i + 1], seq_lens[i : i + 1], 0.125)
                assert torch.equal(alone, batch[i : i + 1]), (i, n)
            order = [4, 2, 0, 3, 1]  # rows permuted
            permuted = run_kernel(lib, q[order], k, v, tables[order], seq_lens[order], 0.125)
            assert torch.equal(permuted, batch[order])
    finally:
        torch.set_num_threads(threads)


def _attention_case(lens: list[int], dtype: torch.dtype, head_dim: int = 64):
    q, k, v, tables, seq_lens = make_pool(lens, 6, 2, head_dim, 16, dtype, seed=3)
    layout = StepLayout(slot_mapping=torch.zeros(len(lens), dtype=torch.long), block_tables=tables.long(),
                        seq_lens=lens, query_lens=[1] * len(lens), num_decodes=len(lens), block_size=16)
    return q, k, v, layout


def test_disabled_by_options_chooses_the_torch_path(lib) -> None:
    """TOKENMILL_CPU_KERNELS=0 in the options: no library, so the engine's backend is the
    torch path, whose float32 decodes give the reference's exact bits."""
    off = KernelOptions.from_env({"TOKENMILL_CPU_KERNELS": "0"})
    assert cpu_kernels.load(off) is None and not cpu_kernels.available(off)
    cpu = torch.device("cpu")
    q, k, v, layout = _attention_case([20, 50], torch.float32)
    backend = select_attention_backend(cpu, torch.float32, 6, 2, k.shape[1], off, None, 64)
    assert isinstance(backend, TorchPagedAttention)
    assert torch.equal(backend.prepare(layout).attend(q, k, v, 0.125), paged_attention_reference(q, k, v, layout, 0.125))
    on = KernelOptions.from_env({})
    assert cpu_kernels.load(on) is not None and kernel_attention_fits(cpu, torch.float32, 64, cpu_kernels.load(on))


def test_declines_what_it_cannot_take(lib) -> None:
    """Returns False, writing nothing, so that the caller falls back."""
    q, k, v, tables, lens = make_pool([20, 50], 6, 2, 64, 16, torch.float32, seed=4)
    out = torch.zeros_like(q)
    call = cpu_kernels.paged_decode_attention
    assert not call(q.half(), k.half(), v.half(), tables, lens, 0.1, out.half(), library=lib)  # fp16
    assert not call(q, k, v, tables.long(), lens, 0.1, out, library=lib)  # int64 tables
    assert not call(q.bfloat16(), k, v, tables, lens, 0.1, out, library=lib)  # mixed dtypes
    assert not call(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, tables, lens, 0.1, out, library=lib)
    meta_k = torch.empty(k.shape, device="meta")
    assert not call(q, meta_k, meta_k, tables, lens, 0.1, out, library=lib)  # not on CPU
    assert not out.any()
    # A head size that is not a multiple of the vector width: declined, and the engine
    # chooses the torch path for such a model.
    q, k, v, layout = _attention_case([9, 30], torch.float32, head_dim=12)
    out = torch.zeros_like(q)
    assert not call(q, k, v, layout.block_tables.int(), torch.tensor(layout.seq_lens, dtype=torch.int32), 0.3, out,
                    library=lib)
    assert not kernel_attention_fits(torch.device("cpu"), torch.float32, 12, lib)
    backend = select_attention_backend(torch.device("cpu"), torch.float32, 6, 2, 64, KernelOptions(), lib, 12)
    assert isinstance(backend, TorchPagedAttention)


def test_rejects_tables_outside_the_pool(lib) -> None:
    q, k, v, tables, lens = make_pool([20, 50], 6, 2, 64, 16, torch.float32, seed=4)
    out = torch.zeros_like(q)
    bad = tables.clone()
    bad[1, 2] = k.shape[1]  # one past the last block
    with pytest.raises(ValueError):
        cpu_kernels.paged_decode_attention(q, k, v, bad, lens, 0.1, out, library=lib)
    too_long = lens.clone()
    too_long[0] = tables.shape[1] * 16 + 1  # more positions than the table row holds
    with pytest.raises(ValueError):
        cpu_kernels.paged_decode_attention(q, k, v, tables, too_long, 0.1, out, library=lib)
    assert not out.any()


# -O0: the race is in the cache, not in the code generated; an unoptimised build takes a
# fraction of the minute and a half two -O3 compiles at once took on two cores.
_BUILD_SCRIPT = """
from tokenmill.model.kernels import cpu_kernels
lib = cpu_kernels.build(("-O0",))
print(lib.path, lib.vector_width)
"""


def test_concurrent_first_builds_share_one_library(tmp_path: Path) -> None:
    """Two processes compiling into an empty cache at once both load a whole library;
    the cache ends with exactly one file (no temporary left behind)."""
    env = {**os.environ, "TOKENMILL_KERNEL_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", _BUILD_SCRIPT], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    paths = {out.split()[0] for out, _ in outs}
    assert len(paths) == 1
    assert [f.name for f in tmp_path.iterdir()] == [Path(paths.pop()).name]


def test_runner_builds_kernel_metadata_once_per_step(monkeypatch) -> None:
    """The C kernel backend prepares int32 tables and lengths once per step; an engine
    built with the kernels off prepares the torch path's mask, gather index and workspace."""
    from conftest import make_tiny_llm
    from tokenmill.engine.request import Request, SamplingParams
    from tokenmill.model.attention import CpuKernelStep, TorchPagedStep

    def steps(llm):  # type: ignore[no-untyped-def]
        runner = llm.engine.runner
        items = []
        for i, length in enumerate([5, 23, 40]):
            req = Request(request_id=str(i), prompt_token_ids=list(range(1, length + 1)), params=SamplingParams())
            req.num_computed_tokens = length - 1
            req.block_table = list(range(10 * i, 10 * i + -(-length // runner.block_size)))
            items.append((req, 1))
        return runner.prepare(items).attn

    attn = steps(make_tiny_llm())
    assert isinstance(attn, CpuKernelStep)
    assert attn.decode_seq_lens.dtype == torch.int32 and attn.decode_seq_lens.tolist() == [5, 23, 40]
    assert attn.decode_block_tables.dtype == torch.int32 and attn.decode_block_tables.is_contiguous()
    assert attn.decode_block_tables[2, :3].tolist() == [20, 21, 22]
    monkeypatch.setenv("TOKENMILL_CPU_KERNELS", "0")
    attn = steps(make_tiny_llm())
    assert isinstance(attn, TorchPagedStep)
    assert attn.decode_mask is not None and attn.workspace is not None and attn.decode_index is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads,window", [(4, 1, None), (9, 3, None), (4, 1, 1500)])
def test_long_contexts_attended_in_parts_match_float64_and_stay_batch_invariant(lib, dtype, heads, kv_heads,
                                                                                 window) -> None:
    """Contexts past PART_LEN (1024) positions are attended in parts on several threads and
    combined: the result matches the float64 attention (over the window where there is one),
    and a sequence's bits stay the same alone, batched and on any thread count, since its parts
    depend only on its own positions."""
    lens = [2500, 1025, 30, 1024, 3100]
    q, k, v, tables, seq_lens = make_pool(lens, heads, kv_heads, 64, 16, dtype, seed=heads + (window or 0))
    scale = 0.125

    def attend(rows: list[int]) -> torch.Tensor:
        out = torch.full(q[rows].shape, float("nan"), dtype=dtype)
        assert cpu_kernels.paged_decode_attention(q[rows], k, v, tables[rows], seq_lens[rows], scale, out,
                                                  library=lib, window=window)
        return out

    batch = attend(list(range(len(lens))))
    if window is None:
        bounds: list = []
        want = plain_attention(q, k, v, tables, seq_lens, scale, bounds)
        assert_matches(batch, want, bounds[0] if bf16_products(lib, dtype, 64) else None)
    else:  # the last `window` keys of each sequence
        for i, n in enumerate(lens):
            want, bound = _windowed_decode(q[i], k, v, tables[i], n, window, scale)
            assert_matches(batch[i : i + 1], want[None], bound[None] if bf16_products(lib, dtype, 64) else None)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for i in range(len(lens)):
                assert torch.equal(attend([i]), batch[i : i + 1]), (i, t)
            assert torch.equal(attend([4, 0, 2]), batch[[4, 0, 2]])
    finally:
        torch.set_num_threads(threads)


def _windowed_decode(q, k, v, table, n: int, window: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float64: the decode row at position n - 1 over keys n - window .. n - 1, per head, and
    bf16_product_bound of each output element."""
    heads, kv_heads, block_size = q.shape[0], k.shape[0], k.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    bound = torch.empty(q.shape, dtype=torch.float64)
    rows = [(int(table[p // block_size]), p % block_size) for p in range(max(0, n - window), n)]
    for h in range(heads):
        kv = h // (heads // kv_heads)
        keys = torch.stack([k[kv, b, o] for b, o in rows]).double()
        vals = torch.stack([v[kv, b, o] for b, o in rows]).double()
        out[h] = torch.softmax(keys @ q[h].double() * scale, dim=0) @ vals
        bound[h] = bf16_product_bound(q[h].double(), keys, vals, scale)
    return out, bound

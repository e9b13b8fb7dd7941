"""The paged attention paths against a plain softmax attention over gathered K/V.

Random caches with scattered block tables; decodes, prefills with and without
a cached prefix, mixed batches, GQA; the fast path (decodes through the C
kernel, and through the torch gather with and without the reused workspace)
and the reference path must all match. The kernel's own edge cases are in
test_cpu_kernels.py.
"""
from __future__ import annotations

import random

import pytest
import torch

from tokenmill.model.kernels import cpu_kernels
from tokenmill.model.attention import (CpuKernelAttention, StepLayout, TorchPagedAttention, kv_cache_shape,
                                       paged_attention_reference, torch_paged)
from tokenmill.model.attention.torch_paged import (batched_prefill_attention, batched_prefill_fits, padded_prefill,
                                                   prefill_attention, write_kv)
from tokenmill.model.models.llama import RotaryEmbedding, _rotate
from tokenmill.settings.config import ModelConfig
from tokenmill.settings.options import KernelOptions

BS = 4  # small blocks: many block boundaries inside short contexts

needs_kernel = pytest.mark.skipif(not cpu_kernels.available(), reason="C decode kernel unavailable (no gcc?)")


@pytest.fixture(params=["kernel", "torch"])
def decode_path(request) -> str:
    """Run a test with the C kernel backend, then with the torch backend."""
    if request.param == "kernel" and not cpu_kernels.available():
        pytest.skip("C decode kernel unavailable (no gcc?)")
    return request.param


def attend(path: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: StepLayout,
           scale: float, workspace: bool = False) -> torch.Tensor:
    """One step's attention through the backend ``path`` names (as an engine would choose
    it), prepared from ``layout``; ``workspace``: the torch backend's reused gather buffers
    start full of NaN, so a read of anything not gathered this step shows."""
    if path == "kernel":
        lib = cpu_kernels.load()
        assert lib is not None
        backend = CpuKernelAttention(lib)
        return backend.prepare(layout).attend(q, k_cache, v_cache, scale)
    kv_heads, num_blocks, _, d = k_cache.shape
    torch_backend = TorchPagedAttention(k_cache.dtype, q.device, kv_heads, q.shape[1], num_blocks, d)
    if workspace:
        size = (layout.num_decodes * layout.decode_blocks + 3) * layout.block_size * kv_heads * d
        torch_backend._workspace = (torch.full((size,), float("nan"), dtype=k_cache.dtype),
                                    torch.full((size,), float("nan"), dtype=k_cache.dtype))
    step = torch_backend.prepare(layout)
    if workspace and layout.num_decodes:
        assert step.workspace is torch_backend._workspace  # reused, not reallocated
    return step.attend(q, k_cache, v_cache, scale)


def simple_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     tables: list[list[int]], seq_lens: list[int], query_lens: list[int], scale: float) -> torch.Tensor:
    """Token by token: gather the sequence's keys, softmax over those at or before the token."""
    heads, kv_heads = q.shape[1], k_cache.shape[0]
    group = heads // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    row = 0
    for table, slen, qlen in zip(tables, seq_lens, query_lens):
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(slen)])
        k = k_cache.reshape(kv_heads, -1, q.shape[2])[:, slots].transpose(0, 1).double()  # [slen, kv, d]
        v = v_cache.reshape(kv_heads, -1, q.shape[2])[:, slots].transpose(0, 1).double()
        for j in range(qlen):
            pos = slen - qlen + j
            for h in range(heads):
                s = (k[: pos + 1, h // group] @ q[row, h].double()) * scale
                out[row, h] = torch.softmax(s, 0) @ v[: pos + 1, h // group]
            row += 1
    return out


def make_case(seqs: list[tuple[int, int]], heads: int, kv_heads: int, dtype: torch.dtype, seed: int) -> tuple:
    """seqs: (context length after the step, new tokens), decodes (new == 1) first."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    d = 16
    num_blocks = sum(-(-s // BS) for s, _ in seqs) + 5
    k_cache = torch.randn(kv_cache_shape(num_blocks, BS, kv_heads, d), generator=gen).to(dtype)
    v_cache = torch.randn(kv_cache_shape(num_blocks, BS, kv_heads, d), generator=gen).to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    for slen, _ in seqs:
        n = -(-slen // BS)
        tables.append(free[:n])
        free = free[n:]
    seq_lens = [s for s, _ in seqs]
    query_lens = [q for _, q in seqs]
    total = sum(query_lens)
    q = torch.randn(total, heads, d, generator=gen).to(dtype)
    # New tokens' K/V go in through write_kv, as in the model.
    slots = [t[p // BS] * BS + p % BS for t, (s, n) in zip(tables, seqs) for p in range(s - n, s)]
    new_k = torch.randn(total, kv_heads, d, generator=gen).to(dtype)
    new_v = torch.randn(total, kv_heads, d, generator=gen).to(dtype)
    write_kv(k_cache, v_cache, new_k, new_v, torch.tensor(slots))
    nd = sum(1 for n in query_lens if n == 1)
    width = max(len(t) for t in tables)
    bt = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    layout = StepLayout(slot_mapping=torch.tensor(slots), block_tables=bt, seq_lens=seq_lens,
                        query_lens=query_lens, num_decodes=nd, block_size=BS)
    return q, k_cache, v_cache, layout, tables


CASES = {
    "decode_one": [(1, 1)],
    "decodes": [(37, 1), (5, 1), (64, 1), (13, 1)],
    "prefill": [(23, 23)],
    "prefill_cached_prefix": [(30, 9)],
    "mixed": [(17, 1), (41, 1), (9, 1), (12, 12), (33, 6), (20, 19)],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize("workspace", [False, True])
def test_paged_attention_matches_plain_softmax(case: str, heads: int, kv_heads: int, workspace: bool,
                                              decode_path: str) -> None:
    q, kc, vc, meta, tables = make_case(CASES[case], heads, kv_heads, torch.float32, seed=len(case) + heads)
    scale = 16**-0.5
    want = simple_attention(q, kc, vc, tables, meta.seq_lens, meta.query_lens, scale)
    for got in (attend(decode_path, q, kc, vc, meta, scale, workspace), paged_attention_reference(q, kc, vc, meta, scale)):
        assert got.shape == q.shape and got.dtype == q.dtype
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)


BATCHED_CASES = {
    **{k: v for k, v in CASES.items() if k in ("prefill", "prefill_cached_prefix", "mixed")},
    "prefills_of_many_lengths": [(5, 1), (1, 1), (3, 3), (40, 40), (57, 2), (18, 17)],
    "chunks_after_long_prefixes": [(70, 1), (90, 30), (66, 4), (31, 31)],
}


@pytest.mark.parametrize("case", sorted(BATCHED_CASES))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_batched_prefill_matches_one_chunk_at_a_time(case: str, heads: int, kv_heads: int, dtype) -> None:
    """The GPU's padded one-call prefill path (run here on CPU) against the plain softmax
    and against the per-chunk SDPA path it replaces; decode rows are left alone."""
    q, kc, vc, meta, tables = make_case(BATCHED_CASES[case], heads, kv_heads, dtype, seed=len(case) + heads)
    scale = 16**-0.5
    nd = meta.num_decodes
    got = torch.full_like(q, float("nan"))
    pp = padded_prefill(meta, q.device)
    assert pp.max_k % 16 == 0
    batched_prefill_attention(q, kc, vc, pp, nd, scale, got)
    assert got[:nd].isnan().all() and not got[nd:].isnan().any()
    one_by_one = torch.empty_like(q)
    prefill_attention(q, kc, vc, meta, scale, one_by_one)
    want = simple_attention(q, kc, vc, tables, meta.seq_lens, meta.query_lens, scale)[nd:]
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got[nd:].double(), want, **tol)
    torch.testing.assert_close(got[nd:].double(), one_by_one[nd:].double(), **tol)


def test_batched_prefill_applies_off_the_cpu_to_two_or_more_chunks() -> None:
    def backend(device: str, on: bool = True) -> TorchPagedAttention:
        return TorchPagedAttention(torch.float32, torch.device(device), 3, 9, 64, 16, batched_prefill=on)

    assert backend("cuda").batched_prefill
    assert not backend("cpu").batched_prefill  # the C kernel reads chunks in place; CPU torch goes one by one
    assert not backend("cuda", KernelOptions.from_env({"TOKENMILL_BATCHED_PREFILL": "0"}).batched_prefill).batched_prefill
    # A lone chunk keeps the per-chunk path (causal SDPA, no mask); two or more are padded.
    forced = backend("cpu")
    forced.batched_prefill = True
    _, _, _, one, _ = make_case([(5, 1), (23, 23)], 9, 3, torch.float32, seed=1)
    _, _, _, two, _ = make_case([(5, 1), (23, 23), (30, 9)], 9, 3, torch.float32, seed=1)
    forced.num_blocks = two.block_tables.max().item() + 6
    assert forced.prepare(one).padded is None and forced.prepare(two).padded is not None


def test_batched_prefill_is_refused_when_padding_would_be_too_large(monkeypatch) -> None:
    """Short chunks after long prefixes are each padded to the longest context: past the
    byte cap the step goes chunk by chunk (same result)."""
    seqs = [(7, 1), (300, 4), (290, 2), (12, 12)]
    q, kc, vc, meta, _ = make_case(seqs, 9, 3, torch.float32, seed=4)
    # 3 chunks x 9 heads x 304 keys x 16 dims x 4 bytes x (K and V), plus a 3 x 12 x 304 mask
    need = 2 * 3 * 9 * 304 * 16 * 4 + 3 * 12 * 304
    assert batched_prefill_fits(meta, 9, 16, 4)
    monkeypatch.setattr(torch_paged, "BATCHED_PREFILL_MAX_BYTES", need - 1)
    assert not batched_prefill_fits(meta, 9, 16, 4)
    monkeypatch.setattr(torch_paged, "BATCHED_PREFILL_MAX_BYTES", need)
    assert batched_prefill_fits(meta, 9, 16, 4)


@pytest.mark.parametrize("nd", [2, 40])  # below and above the bf16 SDPA/matmul switch (40 * 128 rows)
def test_bf16_decode_paths_match_reference(nd: int, decode_path: str) -> None:
    seqs = [(100 + 3 * i, 1) for i in range(nd)]
    q, kc, vc, meta, tables = make_case(seqs, 9, 3, torch.bfloat16, seed=nd)
    want = simple_attention(q, kc, vc, tables, meta.seq_lens, meta.query_lens, 0.25)
    got = attend(decode_path, q, kc, vc, meta, 0.25, workspace=True)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=3e-2)


def test_float32_torch_path_is_bit_identical_to_reference() -> None:
    """Without the kernel, speed never changes fp32 output: same bits as the reference path."""
    seqs = [(40 + 7 * i, 1) for i in range(12)] + [(30, 9)]
    q, kc, vc, meta, _ = make_case(seqs, 9, 3, torch.float32, seed=3)
    assert torch.equal(attend("torch", q, kc, vc, meta, 0.125, workspace=True),
                       paged_attention_reference(q, kc, vc, meta, 0.125))


@needs_kernel
def test_float32_kernel_matches_reference_closely() -> None:
    """The kernels' own exp and summation order move fp32 results by rounding only,
    for the decode rows and the prefill chunk's rows alike."""
    seqs = [(40 + 7 * i, 1) for i in range(12)] + [(30, 9)]
    q, kc, vc, meta, _ = make_case(seqs, 9, 3, torch.float32, seed=3)
    got = attend("kernel", q, kc, vc, meta, 0.125)
    want = paged_attention_reference(q, kc, vc, meta, 0.125)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.equal(got[:12], want[:12])  # the decodes really took the kernel
    assert not torch.equal(got[12:], want[12:])  # and the chunk took the prefill kernel


def _alone(layout: StepLayout, row: int, length: int) -> StepLayout:
    """Layout of decode ``row`` as the only sequence of its step."""
    blocks = -(-length // BS)
    return StepLayout(slot_mapping=layout.slot_mapping[row : row + 1],
                      block_tables=layout.block_tables[row : row + 1, :blocks].clone(), seq_lens=[length],
                      query_lens=[1], num_decodes=1, block_size=BS)


def test_decode_result_does_not_depend_on_batch_padding(decode_path: str) -> None:
    """A sequence alone and next to a much longer one (more padded, masked keys) gives the same output."""
    q, kc, vc, meta, _ = make_case([(21, 1), (150, 1)], 9, 3, torch.float32, seed=7)
    both = attend(decode_path, q, kc, vc, meta, 0.125, workspace=True)
    alone = attend(decode_path, q[:1], kc, vc, _alone(meta, 0, 21), 0.125)
    if decode_path == "kernel":
        assert torch.equal(alone, both[:1])
    else:
        torch.testing.assert_close(alone, both[:1], atol=1e-6, rtol=1e-6)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_decode_is_batch_invariant_bit_for_bit(dtype: torch.dtype) -> None:
    """Each decode's bits are the same alone, next to much longer sequences, next to a
    prefill, and with one or two threads: batch composition never changes a token."""
    seqs = [(3, 1), (300, 1), (57, 1), (611, 1), (1, 1), (40, 12)]
    q, kc, vc, meta, _ = make_case(seqs, 6, 2, dtype, seed=11)
    batch = attend("kernel", q, kc, vc, meta, 0.3)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for row, (length, _) in enumerate(seqs[:5]):
                alone = attend("kernel", q[row : row + 1], kc, vc, _alone(meta, row, length), 0.3)
                assert torch.equal(alone, batch[row : row + 1]), (row, n)
    finally:
        torch.set_num_threads(threads)


def test_rotation_with_signed_table_equals_rotate_half() -> None:
    cfg = ModelConfig(vocab_size=10, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    rope = RotaryEmbedding(cfg, 64)
    pos = torch.tensor([0, 5, 63, 17])
    x = torch.randn(4, 3, 16)
    cos = rope.cos[pos][:, None]
    sin = rope.sin[pos][:, None]
    plain = x * cos + torch.cat([-x[..., 8:], x[..., :8]], dim=-1) * sin
    assert torch.equal(_rotate(x, *rope.tables(pos, torch.float32)), plain)


def test_engine_output_is_the_same_with_batched_prefill(monkeypatch) -> None:
    """The whole engine with every multi-chunk prefill step forced through the padded
    path (on CPU, kernels off): the same greedy tokens as chunk by chunk, with prompts
    long enough to be split across steps and to follow cached prefixes."""
    from conftest import make_tiny_llm
    from tokenmill import SamplingParams

    monkeypatch.setenv("TOKENMILL_CPU_KERNELS", "0")
    rng = random.Random(3)
    shared = [rng.randrange(1, 200) for _ in range(40)]
    prompts = [shared + [rng.randrange(1, 200) for _ in range(n)] for n in (3, 70, 18, 1, 45)]
    prompts += [[rng.randrange(1, 200) for _ in range(n)] for n in (9, 120)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def run() -> list[list[int]]:
        llm = make_tiny_llm(max_num_batched_tokens=64, block_size=BS)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    plain = run()
    used: list[int] = []
    real = torch_paged.batched_prefill_attention
    real_init = TorchPagedAttention.__init__

    def spy(q, k_cache, v_cache, pp, num_decodes, scale, out, *rest):  # type: ignore[no-untyped-def]
        used.append(pp.n)
        real(q, k_cache, v_cache, pp, num_decodes, scale, out, *rest)

    def batched_on_cpu(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        real_init(self, *args, **kwargs)
        self.batched_prefill = True

    monkeypatch.setattr(torch_paged, "batched_prefill_attention", spy)
    monkeypatch.setattr(TorchPagedAttention, "__init__", batched_on_cpu)
    assert run() == plain
    assert used and max(used) > 1


def test_every_backend_in_the_table_answers_graph_capture_as_its_capabilities_say() -> None:
    """The protocol's ``graph_decode_step``: a step for backends that declare capture, a plain
    ``GraphCaptureUnsupported`` from the others; every backend is chosen from ``BACKENDS``."""
    from tokenmill.model.attention import BACKENDS, BackendSpec, GraphCaptureUnsupported, attention_backend_class

    cpu = torch.device("cpu")
    spec = BackendSpec(torch.float32, cpu, 4, 2, 8, 16, KernelOptions(), cpu_kernels.load(KernelOptions()))
    b, w, bs = 2, 3, 4
    slots, tables, lens = torch.zeros(b, dtype=torch.long), torch.zeros(b, w, dtype=torch.long), torch.ones(b)
    key_pos = torch.arange(w * bs)[None, None, :]
    for name, cls in BACKENDS.items():
        if name == "cpu_kernels" and spec.library is None:
            continue
        backend = cls.build(spec)
        if cls.capabilities.cuda_graphs:
            step = backend.graph_decode_step(slots, tables, lens, key_pos, b, w, bs)
            assert step.layout.num_decodes == b
        else:
            with pytest.raises(GraphCaptureUnsupported, match="cannot be captured"):
                backend.graph_decode_step(slots, tables, lens, key_pos, b, w, bs)
    reference = KernelOptions(attention="reference")
    assert attention_backend_class(cpu, torch.float32, reference, None, 16) is BACKENDS["reference"]
    assert attention_backend_class(cpu, torch.float32, KernelOptions(), None, 16) is BACKENDS["torch_paged"]

"""Decode steps through captured graphs (engine/step/cuda_graphs.py) against the eager path.

There is no GPU here: the runner gets ``EmulatedGraphBackend``, which records a
step by running it once and replays it by running it again on the same static
buffers (refusing ops a real capture cannot hold). Everything but the literal
CUDA calls is exercised: buckets, padding, the static input copies, the scratch
block, output slicing and the eager fallbacks. Decodes take the torch path here
(``TOKENMILL_CPU_KERNELS=0``), the one CUDA runs.
"""
from __future__ import annotations

import random

import pytest
import torch

from conftest import tiny_loaded, tiny_tokenizer
from tokenmill import LLM, SamplingParams
from tokenmill.settings.config import EngineConfig
from tokenmill.engine.step import cuda_graphs
from tokenmill.engine.step.cuda_graphs import CaptureViolation, EmulatedGraphBackend
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.request import Request

BS = 4  # small blocks: block tables of many different lengths in short contexts


@pytest.fixture(autouse=True)
def torch_decode_path(monkeypatch) -> None:
    """The torch decode path (what CUDA runs), graphs on unless a test says otherwise."""
    monkeypatch.setenv("TOKENMILL_CPU_KERNELS", "0")
    monkeypatch.delenv("TOKENMILL_CUDA_GRAPHS", raising=False)
    monkeypatch.delenv("TOKENMILL_CUDA_GRAPH_MAX_BATCH", raising=False)


def _with_backend(monkeypatch) -> EmulatedGraphBackend:
    """Make every runner built from now on record with a fresh CPU stand-in backend."""
    backend = EmulatedGraphBackend()
    monkeypatch.setattr(cuda_graphs, "default_backend", lambda device: backend)
    return backend


def _engine(monkeypatch, **options) -> LLMEngine:
    _with_backend(monkeypatch)
    options.setdefault("num_blocks", 160)
    options.setdefault("block_size", BS)
    options.setdefault("enable_prefix_caching", False)
    engine = LLMEngine(EngineConfig.from_options(**options), loaded=tiny_loaded(seed=3), tokenizer=tiny_tokenizer())
    assert engine.runner.graphs is not None and engine.runner.fused is None
    return engine


def _requests(engine: LLMEngine, lengths: list[int], seed: int = 0) -> list[Request]:
    """Requests with prompts of these lengths, blocks interleaved in the pool (round robin)."""
    rng = random.Random(seed)
    reqs = [Request(f"r{i}", [rng.randrange(0, 256) for _ in range(n)], SamplingParams(max_tokens=64))
            for i, n in enumerate(lengths)]
    need = [-(-n // engine.block_size) for n in lengths]
    for turn in range(max(need)):
        for req, n in zip(reqs, need):
            if turn < n:
                req.block_table += engine.pool.allocate(1)
    engine.runner.execute([(r, len(r.prompt_token_ids) - 1) for r in reqs])  # prefill: eager
    for r in reqs:
        r.num_computed_tokens = len(r.prompt_token_ids) - 1
    return reqs


def _advance(engine: LLMEngine, reqs: list[Request], logits: torch.Tensor) -> None:
    """Append each request's greedy token and a block when it needs one."""
    for r, row in zip(reqs, logits):
        r.num_computed_tokens += 1
        r.output_token_ids.append(int(row.argmax()))
        if len(r.block_table) * engine.block_size < r.num_tokens:
            r.block_table += engine.pool.allocate(1)


def _eager(engine: LLMEngine, items: list) -> tuple[torch.Tensor, list]:
    return engine.runner.run_eager(items)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal up to float32 rounding (a few ulps of the largest value): padding a batch
    changes the shapes the CPU GEMM sees, and with them its summation order."""
    return float((got - want).abs().max()) <= 2e-6 * max(1.0, float(want.abs().max()))


def _new_kv(engine: LLMEngine, reqs: list[Request]) -> torch.Tensor:
    """Every layer's K and V rows at each request's position of this step."""
    bs, out = engine.block_size, []
    for k, v in engine.runner.kv_caches:
        for r in reqs:
            p = r.num_computed_tokens
            out += [k[:, r.block_table[p // bs], p % bs].clone(), v[:, r.block_table[p // bs], p % bs].clone()]
    return torch.stack(out)


# The longest prompt sits just below a width bucket's edge (16, 32, 64 tokens at 4 per block):
# the decodes cross it, so each case replays two widths.
@pytest.mark.parametrize("lengths,bucket", [([14], 1), ([3, 30, 17], 4), ([2, 60, 7, 30, 14], 8)])
def test_graph_logits_and_kv_writes_equal_eager_over_growing_contexts(monkeypatch, lengths, bucket) -> None:
    engine = _engine(monkeypatch)
    graphs = engine.runner.graphs
    reqs = _requests(engine, lengths, seed=len(lengths))
    items = [(r, 1) for r in reqs]
    widths, exact = set(), 0
    for step in range(7):
        before = graphs.stats.replays
        logits, sampled = engine.runner.execute(items)
        assert graphs.stats.replays == before + 1 and sampled == reqs
        graph_kv = _new_kv(engine, reqs)
        eager_logits, eager_sampled = _eager(engine, items)  # rewrites the same slots
        assert eager_sampled == reqs and logits.shape == eager_logits.shape == (len(reqs), 257)
        assert _close(logits, eager_logits), (step, (logits - eager_logits).abs().max())
        assert _close(graph_kv, _new_kv(engine, reqs)), step
        eager_width = -(-max(r.num_computed_tokens + 1 for r in reqs) // BS)
        if len(reqs) == bucket and (bucket, eager_width) in graphs.graphs:
            # No padding at all: the very same ops on the very same shapes.
            assert torch.equal(logits, eager_logits) and torch.equal(graph_kv, _new_kv(engine, reqs))
            exact += 1
        widths |= {w for b, w in graphs.graphs}
        _advance(engine, reqs, logits)
    assert {b for b, _ in graphs.graphs} == {bucket}
    assert exact > 0 or len(reqs) != bucket
    # Tables of different lengths share one graph per width bucket; each bucket captured once.
    assert graphs.stats.captures == len(graphs.graphs) == len(widths) == 2


def test_one_token_prefill_chunk_in_a_decode_batch_is_computed_but_not_sampled(monkeypatch) -> None:
    engine = _engine(monkeypatch)
    reqs = _requests(engine, [12, 21, 6])
    reqs[1].num_computed_tokens -= 1  # two prompt tokens left: this step's 1-token chunk samples nothing
    items = [(r, 1) for r in reqs]
    logits, sampled = engine.runner.execute(items)
    assert engine.runner.graphs.stats.replays == 1
    eager, eager_sampled = _eager(engine, items)
    assert sampled == eager_sampled == [reqs[0], reqs[2]]
    assert _close(logits, eager)


def test_a_graph_step_that_samples_nothing_returns_no_rows(monkeypatch) -> None:
    engine = _engine(monkeypatch)
    reqs = _requests(engine, [12, 21])
    for r in reqs:
        r.num_computed_tokens -= 1  # every item a 1-token chunk short of its prompt's end
    logits, sampled = engine.runner.execute([(r, 1) for r in reqs])
    assert engine.runner.graphs.stats.replays == 1
    assert sampled == [] and logits.shape == (0, engine.model_config.vocab_size)


def test_sampling_generators_live_on_the_cpu(monkeypatch) -> None:
    """The sampler draws its uniforms on the CPU; a generator on the model's device
    (CUDA) would be refused there."""
    engine = _engine(monkeypatch)
    assert engine.generator.device.type == "cpu"
    (req,) = engine.add_request("seeded", [1, 2, 3], SamplingParams(max_tokens=2, temperature=1.0, seed=7))
    assert req.generator is not None and req.generator.device.type == "cpu"


def test_scratch_block_is_never_handed_out(monkeypatch) -> None:
    engine = _engine(monkeypatch, num_blocks=40)
    runner = engine.runner
    assert runner.scratch_block == engine.pool.num_blocks == 40
    assert all(k.shape[1] == v.shape[1] == 41 for k, v in runner.kv_caches)
    taken = engine.pool.allocate(engine.pool.num_free)
    assert sorted(taken) == list(range(40))


def test_padded_rows_write_only_the_scratch_block(monkeypatch) -> None:
    engine = _engine(monkeypatch)
    runner = engine.runner
    reqs = _requests(engine, [13, 26, 8, 35, 19, 22, 5], seed=7)
    logits, _ = runner.execute([(r, 1) for r in reqs])  # 7 rows in bucket 8
    _advance(engine, reqs, logits)
    # Five of them in the same bucket: rows 5..7 are padding now, where rows 5 and 6 were
    # real last step. Fill every block but the five's (scratch included) with a sentinel.
    live = reqs[:5]
    mine = {b for r in live for b in r.block_table}
    others = [b for b in range(runner.pool_blocks) if b not in mine]
    for k, v in runner.kv_caches:
        k[:, others] = 7.0
        v[:, others] = 7.0
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    runner.execute([(r, 1) for r in live])
    assert runner.graphs.stats.replays == 2 and set(runner.graphs.graphs) == {(8, 16)}
    written = torch.zeros(runner.pool_blocks, BS, dtype=torch.bool)
    for r in live:
        p = r.num_computed_tokens
        written[r.block_table[p // BS], p % BS] = True
    scratch = runner.scratch_block
    for (k0, v0), (k1, v1) in zip(before, runner.kv_caches):
        for old, new in ((k0, k1), (v0, v1)):
            changed = (old != new).any(dim=3).any(dim=0)  # [blocks, block_size]
            assert not (changed & ~written)[:scratch].any(), "a padded row wrote a real block"
            assert changed[written].all()
            assert changed[scratch].any()  # the padded rows did run, into the scratch block


def test_a_step_with_a_prefill_chunk_runs_eager(monkeypatch) -> None:
    engine = _engine(monkeypatch)
    graphs = engine.runner.graphs
    reqs = _requests(engine, [10, 18, 7])
    fresh = Request("p", list(range(20, 31)), SamplingParams())
    fresh.block_table = engine.pool.allocate(3)
    items = [(reqs[0], 1), (fresh, 11), (reqs[1], 1)]
    logits, sampled = engine.runner.execute(items)
    assert graphs.stats.replays == 0 and graphs.stats.captures == 0
    assert graphs.stats.eager["not_pure_decode"] == 2  # the prefill in _requests, and this step
    assert sampled == [reqs[0], reqs[1], fresh] and logits.shape == (3, 257)


def test_a_batch_above_the_largest_bucket_runs_eager(monkeypatch) -> None:
    engine = _engine(monkeypatch)
    graphs = engine.runner.graphs
    graphs.batch_sizes = (1, 2, 4)
    reqs = _requests(engine, [6, 11, 19, 4, 27])
    logits, sampled = engine.runner.execute([(r, 1) for r in reqs])
    assert graphs.stats.replays == 0 and graphs.stats.eager["batch_too_large"] == 1
    eager, _ = _eager(engine, [(r, 1) for r in reqs])
    assert torch.equal(logits, eager)
    four, _ = engine.runner.execute([(r, 1) for r in reqs[:4]])
    assert graphs.stats.replays == 1 and set(graphs.graphs) == {(4, 8)}
    assert _close(four, eager[:4])


def _generate(prompts: list[list[int]], **options) -> tuple[list[list[int]], LLM]:
    llm = LLM(loaded_model=tiny_loaded(seed=5), tokenizer=tiny_tokenizer(), num_blocks=200, block_size=BS,
              max_num_batched_tokens=64, max_num_seqs=6, **options)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], llm


def test_engine_greedy_tokens_identical_with_graphs_on_and_off(monkeypatch) -> None:
    rng = random.Random(11)
    prompts = [[rng.randrange(0, 256) for _ in range(rng.randint(3, 40))] for _ in range(9)]
    backend = _with_backend(monkeypatch)
    on, llm_on = _generate(prompts)
    graphs = llm_on.engine.runner.graphs
    assert graphs is not None and graphs.stats.replays > 20 and backend.captured
    assert graphs.stats.eager.get("not_pure_decode", 0) > 0  # prefill steps did run eager
    monkeypatch.setenv("TOKENMILL_CUDA_GRAPHS", "0")
    off, llm_off = _generate(prompts)
    assert llm_off.engine.runner.graphs is None
    assert on == off and all(len(t) == 20 for t in on)
    llm_on.engine.pool.check_invariants(idle=True)


@pytest.mark.parametrize("value", ["0", "off", "false"])
def test_switch_turns_graphs_off(monkeypatch, value) -> None:
    _with_backend(monkeypatch)
    monkeypatch.setenv("TOKENMILL_CUDA_GRAPHS", value)
    engine = LLMEngine(EngineConfig.from_options(num_blocks=32), loaded=tiny_loaded(), tokenizer=tiny_tokenizer())
    assert engine.runner.graphs is None and engine.runner.scratch_block is None
    assert engine.runner.kv_caches[0][0].shape[1] == 32  # no scratch block either


def test_no_graphs_on_cpu_by_default_nor_with_the_c_decode_kernel(monkeypatch) -> None:
    assert cuda_graphs.default_backend(torch.device("cpu")) is None
    engine = LLMEngine(EngineConfig.from_options(num_blocks=32), loaded=tiny_loaded(), tokenizer=tiny_tokenizer())
    assert engine.runner.graphs is None
    from tokenmill.model.kernels import cpu_kernels
    monkeypatch.setenv("TOKENMILL_CPU_KERNELS", "1")
    if cpu_kernels.available():  # the C kernel backend is a ctypes call: not recordable
        _with_backend(monkeypatch)
        engine = LLMEngine(EngineConfig.from_options(num_blocks=32), loaded=tiny_loaded(), tokenizer=tiny_tokenizer())
        assert engine.runner.graphs is None and engine.runner.attention.name.startswith("C kernels")


def test_buckets() -> None:
    assert cuda_graphs.batch_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert cuda_graphs.batch_buckets(10) == (1, 2, 4, 8, 10)
    assert cuda_graphs.width_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert cuda_graphs.width_buckets(100)[-2:] == (64, 100)
    assert cuda_graphs.width_buckets(1) == (1,)


def test_emulated_capture_refuses_what_a_cuda_graph_cannot_hold() -> None:
    backend = EmulatedGraphBackend()
    x = torch.arange(6.0)
    with pytest.raises(CaptureViolation):
        backend.capture(lambda: x * x.sum().item())
    with pytest.raises(CaptureViolation):
        backend.capture(lambda: x + torch.tensor([1.0]))
    with pytest.raises(CaptureViolation):
        backend.capture(lambda: x[x > 2])
    # A legal graph replays on whatever the static buffer holds now, into the same output.
    graph = backend.capture(lambda: x * 2)
    out = graph.output
    x.copy_(torch.full((6,), 5.0))
    graph.replay()
    assert graph.output is out and torch.equal(out, torch.full((6,), 10.0))


def test_a_backend_that_cannot_be_captured_runs_eager_with_graphs_on(monkeypatch) -> None:
    """The runner asks the attention backend whether it can be captured: the reference
    backend cannot, so with graphs on the engine builds and decodes eager (no TypeError)."""
    from tokenmill.model.attention import ReferenceAttention, TorchPagedAttention

    assert TorchPagedAttention.capabilities.cuda_graphs and not ReferenceAttention.capabilities.cuda_graphs
    monkeypatch.setenv("TOKENMILL_ATTENTION", "reference")
    _with_backend(monkeypatch)
    engine = LLMEngine(EngineConfig.from_options(num_blocks=64, block_size=BS), loaded=tiny_loaded(seed=3),
                       tokenizer=tiny_tokenizer())
    assert engine.runner.graphs is None and engine.runner.attention.name == ReferenceAttention.name
    engine.add_request("r", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3))
    while engine.has_unfinished():
        engine.step()

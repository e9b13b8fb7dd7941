"""Tensor parallelism: how weights split (fast, in-process), and two real ranks on
gloo against one (slow: each engine starts a worker process).

The parity checks run the tiny random Llama in float32 with one thread per rank:
greedy tokens must be identical and every step's logits within 1e-4, with the
prefix cache hitting and a pool small enough that requests get preempted.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from conftest import TINY_EOS, make_tiny_llm, save_tiny_hf_folder, tiny_config, tiny_loaded, tiny_weights
from gguf_files import write_gguf
from tokenmill import LLM, SamplingParams
from tokenmill.model import parallel
from tokenmill.model.loader import load_gguf, load_hf_folder

BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")


def write_tiny_folder(folder, **overrides) -> str:
    """The tiny random Llama as a Hugging Face folder (weights, config, tokenizer)."""
    return save_tiny_hf_folder(folder, **overrides)


def reassemble(shards: list[dict[str, torch.Tensor]], cfg, name: str) -> torch.Tensor:
    spec = parallel.shard_range(name, cfg, 0, len(shards))
    if spec is None:
        return shards[0][name]
    if ("k_proj" in name or "v_proj" in name) and cfg.num_key_value_heads < len(shards):
        shards = shards[:: len(shards) // cfg.num_key_value_heads]  # replicated: one copy per KV head
    full = torch.cat([s[name] for s in shards], dim=spec[0])
    return full[: cfg.vocab_size] if name in ("model.embed_tokens.weight", "lm_head.weight") else full


# --------------------------------------------------------------------------- fast: the split itself


@pytest.mark.parametrize("size", [2, 4])
def test_shards_put_back_together_are_the_model(size):
    loaded = tiny_loaded()
    cfg = loaded.config
    shards = [parallel.shard_weights(loaded.weights, cfg, rank, size) for rank in range(size)]
    for name, full in loaded.weights.items():
        assert torch.equal(reassemble(shards, cfg, name), full), name
    # every rank holds the same shapes (vocab rows padded: 257 does not divide)
    for name in loaded.weights:
        assert len({tuple(s[name].shape) for s in shards}) == 1, name
    rows = shards[-1]["lm_head.weight"].shape[0]
    assert rows == -(-cfg.vocab_size // size)
    assert torch.all(shards[-1]["lm_head.weight"][rows - (rows * size - cfg.vocab_size):] == 0)


def test_kv_heads_replicate_when_ranks_outnumber_them():
    cfg = tiny_config(num_key_value_heads=1)
    local = parallel.local_config(cfg, 2)
    assert (local.num_attention_heads, local.num_key_value_heads) == (2, 1)
    d = cfg.head_dim
    assert parallel.shard_range("model.layers.0.self_attn.k_proj.weight", cfg, 0, 2) == (0, 0, d)
    assert parallel.shard_range("model.layers.0.self_attn.v_proj.weight", cfg, 1, 2) == (0, 0, d)
    cfg2 = tiny_config(num_key_value_heads=2)  # 4 ranks, 2 KV heads: ranks 0-1 read head 0, 2-3 head 1
    assert [parallel.shard_range("model.layers.0.self_attn.k_proj.weight", cfg2, r, 4)[1] for r in range(4)] == \
        [0, 0, d, d]


def test_sizes_that_do_not_divide_are_refused_with_the_numbers(bundled_model_path):
    smol = parallel.read_config(bundled_model_path)  # 9 heads, 3 KV heads
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 .*9 attention heads.*sizes that do: 1, 3"):
        parallel.check_divisible(smol, 2)
    parallel.check_divisible(smol, 3)
    # refused before any worker process starts
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide"):
        make_tiny_llm(tensor_parallel_size=3)


def test_rank_reads_only_its_slices_from_a_folder(tmp_path):
    folder = write_tiny_folder(tmp_path / "tiny")
    full = load_hf_folder(folder)
    for rank in range(2):
        shard = parallel.load_shard(folder, torch.float32, rank, 2)
        want = parallel.shard_weights(full.weights, full.config, rank, 2)
        assert shard.weights.keys() == want.keys()
        for name in want:
            assert torch.equal(shard.weights[name], want[name]), name


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_0"])
def test_rank_reads_only_its_slices_from_a_gguf(tmp_path, qtype):
    """Rows (q/k/v, gate/up, vocab) and whole quantization blocks of columns (o, down)
    are cut from the file before dequantizing; q/k rows come back in HF order."""
    cfg = tiny_config()
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, tiny_weights(cfg), cfg, qtypes={"": qtype}, eos_token_id=TINY_EOS)
    full = load_gguf(path)
    for rank in range(2):
        shard = parallel.load_shard(path, torch.float32, rank, 2)
        want = parallel.shard_weights(full.weights, full.config, rank, 2)
        for name in want:
            np.testing.assert_array_equal(shard.weights[name].numpy(), want[name].numpy(), err_msg=name)


def test_rank_reads_its_slice_of_the_biases_from_a_gguf(tmp_path):
    """Qwen2's q/k/v biases are 1-D: a rank's elements are a byte range of the one row."""
    cfg = tiny_config(attention_bias=True, architecture="qwen2")
    weights = tiny_weights(cfg)
    g = torch.Generator().manual_seed(1)
    for i in range(cfg.num_hidden_layers):
        for proj, heads in (("q", cfg.num_attention_heads), ("k", cfg.num_key_value_heads),
                            ("v", cfg.num_key_value_heads)):
            weights[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = torch.randn(heads * cfg.head_dim, generator=g)
    path = str(tmp_path / "qwen.gguf")
    write_gguf(path, weights, cfg, arch="qwen2", qtypes={"": "Q8_0"}, eos_token_id=TINY_EOS)
    full = load_gguf(path)
    assert full.config.attention_bias
    for rank in range(2):
        shard = parallel.load_shard(path, torch.float32, rank, 2)
        want = parallel.shard_weights(full.weights, full.config, rank, 2)
        for name in want:
            np.testing.assert_array_equal(shard.weights[name].numpy(), want[name].numpy(), err_msg=name)
        assert shard.weights["model.layers.0.self_attn.q_proj.bias"].shape == (cfg.hidden_size // 2,)


# --------------------------------------------------------------------------- slow: two ranks on gloo

PREFIX = list(range(20, 52))  # two full blocks shared by every prompt: prefix-cache hits
PROMPTS = [PREFIX + [1, 2, 3], PREFIX + list(range(60, 75)), PREFIX + [7] * 9, [200, 100, 50, 25], PREFIX]
GREEDY = SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True)
# 12 blocks of 16 tokens for five sequences of up to 75 tokens: preemption is forced.
OPTIONS = dict(num_blocks=12, block_size=16, max_num_batched_tokens=64, num_threads=1,
               enable_prefix_caching=True)


def record_logits(llm: LLM) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    execute = llm.engine.runner.execute

    def wrapped(items):
        logits, sampled = execute(items)
        seen.append(logits.clone())
        return logits, sampled

    llm.engine.runner.execute = wrapped
    return seen


def run(llm: LLM) -> tuple[list[list[int]], list[torch.Tensor], list[int]]:
    logits = record_logits(llm)
    first = llm.generate(PROMPTS, GREEDY)
    second = llm.generate(PROMPTS[:2], GREEDY)  # the same prompts again: whole-prompt cache hits
    outs = first + second
    return [o.outputs[0].token_ids for o in outs], logits, [o.num_cached_tokens for o in outs]


@pytest.fixture(scope="module")
def one_rank():
    llm = make_tiny_llm(**OPTIONS)
    return llm, run(llm)


@pytest.fixture(scope="module")
def two_ranks():
    """Run, then close at once: one tensor-parallel group per process at a time."""
    with make_tiny_llm(tensor_parallel_size=2, **OPTIONS) as llm:
        return llm, run(llm)


@pytest.mark.slow
def test_two_ranks_match_one_token_for_token(one_rank, two_ranks):
    (llm1, (tokens1, logits1, cached1)), (llm2, (tokens2, logits2, cached2)) = one_rank, two_ranks
    assert llm1.engine.total_preemptions > 0 and llm2.engine.total_preemptions > 0
    assert max(cached2) >= 32 and cached1 == cached2
    assert tokens2 == tokens1
    assert len(logits1) == len(logits2)
    worst = max(float((a - b).abs().max()) for a, b in zip(logits1, logits2) if a.numel())
    assert worst < 1e-4, worst


@pytest.mark.slow
def test_each_rank_holds_half_the_weights_and_kv(one_rank, two_ranks):
    (llm1, _), (llm2, _) = one_rank, two_ranks
    memory = llm2.engine.parallel.memory
    assert [m.rank for m in memory] == [0, 1]
    cfg = llm1.engine.model_config
    norms = 4 * cfg.hidden_size * (2 * cfg.num_hidden_layers + 1)  # float32, replicated
    vocab_pad = 4 * cfg.hidden_size * 2  # one padded row each in the embedding and LM head
    for m in memory:
        assert m.kv_bytes * 2 == llm1.engine.runner.kv_cache_bytes
        assert abs(m.weight_bytes - (llm1.engine.weight_bytes - norms) / 2 - norms) <= vocab_pad


@pytest.mark.slow
def test_replicated_kv_heads_match_one_rank():
    """4 query heads over 1 KV head on 2 ranks: each rank keeps a copy of the KV head."""
    prompts = PROMPTS[:3]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    overrides = {"num_key_value_heads": 1}
    want = [o.outputs[0].token_ids for o in
            make_tiny_llm(num_threads=1, model_overrides=overrides).generate(prompts, params)]
    with make_tiny_llm(tensor_parallel_size=2, num_threads=1, model_overrides=overrides) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want


def _agreement(got: list[list[int]], want: list[list[int]]) -> float:
    """Share of tokens generated before each sequence's first difference."""
    same = sum(next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w)) for g, w in zip(got, want))
    return same / sum(len(w) for w in want)


@pytest.mark.slow
def test_bf16_agrees_with_float32_as_one_rank_does():
    """bf16 rounds differently on two ranks (partial sums, reduced in float32), but stays
    as close to the float32 answer as one rank's bf16 does."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(5, 60, 16)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def tokens(**options) -> list[list[int]]:
        with make_tiny_llm(num_threads=1, **options) as llm:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    reference = tokens()
    one = _agreement(tokens(dtype="bfloat16"), reference)
    two = _agreement(tokens(dtype="bfloat16", tensor_parallel_size=2), reference)
    assert two >= one - 0.1, (one, two)


@pytest.mark.slow
def test_killed_worker_fails_the_server_fast_and_non_zero(tmp_path):
    from test_server_support import real_server, started_stream

    folder = write_tiny_folder(tmp_path / "tiny")
    with real_server("--model", folder, "-tp", "2", "--threads", "1", "--num-blocks", "256",
                     "--max-model-len", "1024", startup_timeout=120) as server:
        workers = [pid for pid in _children(server.proc.pid) if b"spawn_main" in _cmdline(pid)]
        assert len(workers) == 1, workers
        body = {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=30) as client:
            with started_stream(client, server.url + "/v1/completions", body) as (_, rest):
                killed_at = time.monotonic()
                os.kill(workers[0], signal.SIGKILL)
                events = list(rest)  # the stream must end, with an error, within seconds
            ended = time.monotonic() - killed_at
        assert ended < 10, (ended, events[-3:], server.lines[-10:])
        try:  # until it exits (a second after the failure), the server says it is down
            assert httpx.get(server.url + "/health", timeout=5).status_code == 503
        except httpx.TransportError:
            pass
        errors = [json.loads(e)["error"] for e in events if e != "[DONE]" and "error" in json.loads(e)]
        assert errors, events[-3:]
        # 503 from the watchdog, or 500 from the step whose collective failed first
        assert errors[-1]["code"] == "engine_dead" or errors[-1]["message"].startswith("internal error"), errors
        assert server.proc.wait(30) != 0
        assert any("tensor-parallel worker rank 1" in line for line in server.lines), server.lines[-20:]


def _children(parent: int) -> list[int]:
    return [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and _ppid(int(pid)) == parent]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def test_kubernetes_multi_gpu_replica_asks_for_one_gpu_per_rank():
    from test_router_k8s import _objects, _server

    from tokenmill.entrypoints.cli.main import build_parser

    _, container = _server(_objects("multi-gpu"))
    args = build_parser().parse_args(container["args"])
    assert args.tensor_parallel_size == 2 and args.device == "cuda"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == str(args.tensor_parallel_size)


def test_gpu_check_without_gpus_says_so_and_exits_2(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    import tensor_parallel_gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "tp.json"
    assert tensor_parallel_gpu.main(["--out", str(out)]) == 2
    assert "at least 2 GPUs" in json.loads(out.read_text())["env"]["skipped"]


@pytest.mark.slow
def test_gpu_check_dry_run_on_cpu(tmp_path, monkeypatch):
    """The prepared multi-GPU check, on gloo: both sections run and parity holds."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    import tensor_parallel_gpu

    out = tmp_path / "tp.json"
    assert tensor_parallel_gpu.main(["--device", "cpu", "--tp", "2", "--quick", "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["ok"] and summary["gates"] == {"parity": True, "quantized_parity": True}
    assert summary["parity"]["identical_sequences"] == summary["parity"]["sequences"] > 0
    one, two = summary["speed"]["results"]
    assert (one["tp"], two["tp"]) == (1, 2) and two["output_tokens"] == one["output_tokens"] > 0
    assert [m["rank"] for m in two["rank_memory"]] == [0, 1]
    assert two["rank_memory"][0]["weight_bytes"] < 0.6 * one["rank_memory"][0]["weight_bytes"]
    assert two["split"]["all_reduce"] > 0 and two["split"]["broadcast"] > 0
    assert (one["executor"], two["executor"]) == ("fused CPU decode", "eager")
    # the quantized section: the GGUF file's own blocks on both, each rank holding half of them
    one, two = summary["quantized"]["results"]
    assert one["quantization"] == two["quantization"] == "gguf"
    assert all(abs(m["weight_bytes"] * 2 - one["rank_memory"][0]["weight_bytes"])
               < 0.05 * one["rank_memory"][0]["weight_bytes"] for m in two["rank_memory"])


def test_failing_the_async_engine_ends_open_streams_with_engine_dead():
    """What the server does when a rank dies: open streams end with EngineDeadError
    (a 503), /health's is_alive turns false, new requests are refused."""
    import asyncio

    from tokenmill.engine.async_engine import AsyncEngine, EngineDeadError

    llm = make_tiny_llm()
    aengine = AsyncEngine(llm.engine)
    params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)

    async def scenario() -> tuple[int, BaseException | None]:
        seen = 0
        try:
            async for _ in aengine.generate("r", [1, 2, 3], params):
                seen += 1
                if seen == 2:
                    aengine.fail("tensor-parallel worker rank 1 (pid 1) exited with code -9")
        except EngineDeadError as exc:
            return seen, exc
        return seen, None

    seen, exc = asyncio.run(scenario())
    assert exc is not None and "rank 1" in str(exc) and seen < 500
    assert not aengine.is_alive

    async def late() -> None:
        async for _ in aengine.generate("late", [1], params):
            pass

    with pytest.raises(EngineDeadError):
        asyncio.run(late())
    aengine.shutdown()


def test_serve_refuses_a_split_that_cannot_work_in_one_line(capsys):
    from tokenmill.entrypoints.cli.main import main

    assert main(["serve", "-tp", "2"]) == 2  # the bundled SmolLM2: 9 heads
    err = capsys.readouterr().err
    assert err.startswith("tokenmill serve: error: tensor_parallel_size 2 does not divide") and "1, 3" in err
    assert main(["serve", "-tp", "3", "--quantization", "int4", "--quant-group-size", "128"]) == 2
    assert "would split the int4 groups of 128 columns of o_proj" in capsys.readouterr().err


@pytest.mark.slow
def test_bundled_smollm2_on_three_ranks_reads_its_gguf_shards_and_matches(real_loaded, real_tokenizer):
    """9 heads / 3 KV heads split over 3 ranks, each reading a third of the Q4_1 GGUF
    (whole quantization blocks of the o and down columns); greedy text as on one rank."""
    prompts = ["The capital of France is", "Write a haiku about the sea:"]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    one = LLM(loaded_model=real_loaded, tokenizer=real_tokenizer, num_threads=1, num_blocks=64)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    with LLM(num_threads=1, num_blocks=64, tensor_parallel_size=3) as three:
        got = [o.outputs[0].token_ids for o in three.generate(prompts, params)]
        memory = three.engine.parallel.memory
    assert got == want
    assert all(abs(m.weight_bytes * 3 - one.engine.weight_bytes) < 0.01 * one.engine.weight_bytes for m in memory)

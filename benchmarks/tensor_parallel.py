"""Tensor parallelism: TP=N against TP=1 in one run, with where the time goes.

The model is a seeded random Llama of about SmolLM2-135M's size whose heads
split (hidden 512, 8 query / 4 KV heads of 64, MLP 1536, 30 layers, vocab
49152; the bundled SmolLM2 has 9 heads, which 2 does not divide). It is
written once as a Hugging Face folder, so every rank reads only its own
slices from the file, as it would a real checkpoint.

Each engine runs the same workload, greedy: ``--batch`` prompts of
``--prompt-len`` random tokens, ``--max-tokens`` each, prefill and decode
together as the scheduler batches them; then a decode-only phase is timed on
its own. Engines alternate over ``--rounds`` rounds (a slow spell of a shared
host falls on all alike); the best round of each is kept. Per engine:
output tokens/s, decode ms/step, and the driver's time split into

* scheduling: ``engine.step()`` outside the runner (scheduler, sampler,
  detokenizer);
* broadcast: handing each step's layout to the workers (TP>1);
* all-reduce: inside the model's collectives (the all-reduces and the logit
  gather), including waiting for the slowest rank;
* compute: the rest of the runner (this rank's share of the forward).

The same cores are shared either way: TP=1 runs with ``--threads`` threads
(default: every core), TP=N with ``--threads / N`` per rank. Greedy tokens of
TP=N are compared with TP=1's (identical fraction; float32 sums in another
order can flip a near-tie late in a long random-model sequence).

    .venv/bin/python benchmarks/tensor_parallel.py [--tp 2] [--rounds 3] [--out tp.json]
    .venv/bin/python benchmarks/tensor_parallel.py --quick       # small model, seconds
    .venv/bin/python benchmarks/tensor_parallel.py --format gguf  # quantized, as the bundled model
    .venv/bin/python benchmarks/tensor_parallel.py --model bundled --tp 3  # SmolLM2's own Q4_1 blocks

``--format gguf`` writes the same weights as a GGUF file laid out like the
bundled SmolLM2 (Q4_1 blocks for every linear layer, a Q8_0 embedding) and
serves them with ``--quantization gguf`` (the file's own blocks through the
int4 kernels), each rank reading whole blocks of its slices. ``--quantization``
picks another mode for either format (int8 and int4 quantize each rank's shard
at load).

On several GPUs: ``--device cuda --tp N`` (``tensor_parallel_gpu.py`` wraps it
with gates and a JSON report).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.settings.config import ModelConfig  # noqa: E402
from tokenmill.model import parallel  # noqa: E402

SHAPE = dict(architecture="llama", vocab_size=49152, hidden_size=512, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
             rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, eos_token_id=49151)
QUICK_SHAPE = dict(SHAPE, vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                   eos_token_id=4095)


def synthetic_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random weights scaled so activations stay O(1) through every layer."""
    g = torch.Generator().manual_seed(seed)
    hidden, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    assert hd is not None
    depth = math.sqrt(2 * cfg.num_hidden_layers)
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd

    def rnd(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g).mul_(std)

    w = {"model.embed_tokens.weight": rnd(cfg.vocab_size, hidden, std=0.125),
         "model.norm.weight": rnd(hidden, std=1.0)}  # signed: greedy runs wander over the vocabulary
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rnd(q, hidden, std=hidden ** -0.5)
        w[p + "self_attn.k_proj.weight"] = rnd(kv, hidden, std=hidden ** -0.5)
        w[p + "self_attn.v_proj.weight"] = rnd(kv, hidden, std=hidden ** -0.5)
        w[p + "self_attn.o_proj.weight"] = rnd(hidden, q, std=q ** -0.5 / depth)
        w[p + "mlp.gate_proj.weight"] = rnd(inter, hidden, std=hidden ** -0.5)
        w[p + "mlp.up_proj.weight"] = rnd(inter, hidden, std=hidden ** -0.5)
        w[p + "mlp.down_proj.weight"] = rnd(hidden, inter, std=inter ** -0.5 / depth)
        w[p + "input_layernorm.weight"] = rnd(hidden, std=0.1).add_(1.0)
        w[p + "post_attention_layernorm.weight"] = rnd(hidden, std=0.1).add_(1.0)
    return w


def write_model(folder: str, shape: dict[str, Any], seed: int = 0) -> ModelConfig:
    """The synthetic model as a Hugging Face folder (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    cfg = ModelConfig(**shape)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "model.safetensors").is_file():
        config = {"model_type": "llama", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
                  "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
                  "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
                  "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_position_embeddings,
                  "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
                  "tie_word_embeddings": cfg.tie_word_embeddings, "eos_token_id": cfg.eos_token_id}
        save_file(synthetic_weights(cfg, seed), str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps(config, indent=1))  # last: marks the folder complete
    return cfg


GGUF_LINEAR_TYPE, GGUF_EMBEDDING_TYPE = "Q4_1", "Q8_0"  # the bundled SmolLM2's layout


def _gguf_rows_for_llama_cpp(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter stores each q/k head's rotary halves interleaved pairwise
    (the loader undoes it); write them that way so a rank's unpermute is exercised."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def write_gguf_model(path: str, shape: dict[str, Any], seed: int = 0) -> ModelConfig:
    """The synthetic model as a GGUF file: linear layers in Q4_1 blocks, the embedding
    in Q8_0, norms in F32 (quantized by the ``gguf`` package's reference code)."""
    import gguf
    from gguf.quants import quantize

    from tokenmill.model import loader

    cfg = ModelConfig(**shape)
    if os.path.isfile(path):
        return cfg
    top = {v: k for k, v in loader._GGUF_TOP_NAMES.items()}
    per_layer = {v: k for k, v in loader._GGUF_LAYER_NAMES.items()}
    tmp = f"{path}.{os.getpid()}.partial"  # concurrent runs sharing the temp folder never write one file
    w = gguf.GGUFWriter(tmp, "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_eos_token_id(cfg.eos_token_id)
    for name, tensor in synthetic_weights(cfg, seed).items():
        if name in top:
            gname = top[name]
        else:
            _, _, idx, rest = name.split(".", 3)
            gname = f"blk.{idx}.{per_layer[rest]}"
        if ".q_proj." in name or ".k_proj." in name:
            tensor = _gguf_rows_for_llama_cpp(tensor, cfg.num_attention_heads if ".q_proj." in name
                                              else cfg.num_key_value_heads)
        value = tensor.contiguous().numpy()
        if value.ndim == 1:
            w.add_tensor(gname, value)
            continue
        qtype = gguf.GGMLQuantizationType[GGUF_EMBEDDING_TYPE if "embed_tokens" in name else GGUF_LINEAR_TYPE]
        w.add_tensor(gname, quantize(value, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)  # last: marks the file complete
    return cfg


@dataclass
class Split:
    """Seconds of the driver's time, by where they went."""

    wall: float = 0.0
    steps: int = 0
    scheduling: float = 0.0
    broadcast: float = 0.0
    all_reduce: float = 0.0
    compute: float = 0.0


@dataclass
class EngineResult:
    label: str
    tp: int
    threads_per_rank: int
    quantization: str = "none"
    executor: str = "eager"  # which step executor the driver's runner had: eager, fused CPU decode, CUDA graphs
    output_tokens: int = 0
    tok_s: float = 0.0
    decode_ms_per_step: float = 0.0
    split: dict[str, float] = field(default_factory=dict)
    rank_memory: list[dict[str, int]] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    first_logits: list[list[float]] = field(default_factory=list)


class Timed:
    """Wraps one engine's runner to split each step's time (see the module docstring)."""

    def __init__(self, llm: LLM) -> None:
        self.engine = llm.engine
        self.split = Split()
        self.first_logits: list[torch.Tensor] = []
        runner = self.engine.runner
        original = runner.execute

        def execute(items):  # type: ignore[no-untyped-def]
            comm0, bcast0 = parallel.COMM.seconds, getattr(runner, "broadcast_s", 0.0)
            started = time.perf_counter()
            logits, sampled = original(items)
            if logits.is_cuda:
                torch.cuda.synchronize()
            took = time.perf_counter() - started
            comm = parallel.COMM.seconds - comm0
            bcast = getattr(runner, "broadcast_s", 0.0) - bcast0
            self.split.all_reduce += comm
            self.split.broadcast += bcast
            self.split.compute += took - comm - bcast
            self.split.scheduling -= took  # added back as part of the step below
            for row, req in enumerate(sampled):
                if not req.output_token_ids and len(self.first_logits) < 64:
                    self.first_logits.append(logits[row].float().cpu())
            return logits, sampled

        runner.execute = execute

    def run(self, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], float]:
        engine = self.engine
        reqs = [engine.add_request(f"b{time.monotonic_ns()}-{i}", p, params)[0] for i, p in enumerate(prompts)]
        decode_s, decode_steps = 0.0, 0
        started = time.perf_counter()
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            took = time.perf_counter() - t0
            self.split.scheduling += took
            self.split.steps += 1
            if engine.last_step.num_prefill_tokens == 0 and engine.last_step.num_decode_tokens:
                decode_s += took
                decode_steps += 1
        self.split.wall += time.perf_counter() - started
        return [r.output_token_ids for r in reqs], (decode_s / decode_steps if decode_steps else 0.0)


def make_llm(folder: str, tp: int, threads: int, device: str, dtype: str, kv_blocks: int,
             quantization: str = "none") -> LLM:
    from cuda_check_support import synthetic_tokenizer

    cfg = parallel.read_config(folder)
    # gguf: the head quantized on both sides alike (one device would otherwise keep a Q8_0
    # head as int8 groups, which ranks do not), so TP=1 and TP=N hold the same weights
    return LLM(folder, dtype=dtype, device=device, tensor_parallel_size=tp, num_threads=threads,
               tokenizer=synthetic_tokenizer(cfg.vocab_size), num_blocks=kv_blocks, enable_prefix_caching=False,
               quantization=quantization, quantize_lm_head=quantization == "gguf")


def executor(llm: LLM, fused_allowed: bool) -> str:
    """The decode executor the engine's runner holds (tensor parallelism: always eager)."""
    runner = llm.engine.runner
    if getattr(runner, "graphs", None) is not None:
        return "CUDA graphs"
    if getattr(runner, "fused", None) is not None and fused_allowed:
        return "fused CPU decode"
    return "eager"


def measure(args: argparse.Namespace, folder: str) -> list[EngineResult]:
    cfg = parallel.read_config(folder)
    rng = random.Random(0)
    prompts = [[rng.randrange(cfg.vocab_size - 1) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    blocks = args.batch * (-(-(args.prompt_len + args.max_tokens) // 16)) + 8
    threads = args.threads or os.cpu_count() or 1
    # (label, ranks, threads per rank, fused CPU decode step allowed)
    plan = [("TP=1", 1, threads, True), ("TP=1 eager", 1, threads, False),
            (f"TP={args.tp}", args.tp, max(1, threads // args.tp), True)]
    if args.device != "cpu" or not getattr(args, "eager", True):
        plan = [plan[0], plan[2]]
    best: dict[str, tuple[float, EngineResult]] = {}
    for rnd in range(args.rounds):
        for label, tp, per_rank, fused in plan:
            # one tensor-parallel group per process at a time: each engine lives for one round
            os.environ["TOKENMILL_FUSED_DECODE"] = "1" if fused else "0"
            llm = make_llm(folder, tp, per_rank, args.device, args.dtype, blocks,
                           getattr(args, "quantization", None) or "none")
            try:
                # warm up; on GPUs the whole batch, so TP=1's lazily captured CUDA graphs exist before timing
                warm = prompts if args.device != "cpu" else prompts[:1]
                llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
                timed = Timed(llm)
                tokens, decode_step = timed.run(prompts, params)
                result = EngineResult(label=label, tp=tp, threads_per_rank=per_rank,
                                      quantization=str(llm.engine.config.quantization),
                                      executor=executor(llm, fused))
                result.output_tokens = sum(len(t) for t in tokens)
                result.tok_s = result.output_tokens / timed.split.wall
                result.decode_ms_per_step = decode_step * 1e3
                result.split = {k: round(v, 4) for k, v in asdict(timed.split).items()}
                group = llm.engine.parallel
                result.rank_memory = ([asdict(m) for m in group.memory] if group is not None else
                                      [{"rank": 0, "weight_bytes": llm.engine.weight_bytes,
                                        "kv_bytes": llm.engine.runner.kv_cache_bytes}])
                result.tokens = tokens
                result.first_logits = [t.tolist() for t in timed.first_logits[:4]]
            finally:
                llm.close()
                del llm
                os.environ.pop("TOKENMILL_FUSED_DECODE", None)
            print(f"round {rnd + 1}: {label} x {per_rank} thread(s): {result.tok_s:.1f} tok/s, "
                  f"decode {result.decode_ms_per_step:.1f} ms/step", flush=True)
            if label not in best or result.tok_s > best[label][0]:
                best[label] = (result.tok_s, result)
    return [best[label][1] for label, *_ in plan]


def compare(one: EngineResult, many: EngineResult) -> dict[str, Any]:
    same = total = 0
    identical = 0
    for a, b in zip(one.tokens, many.tokens):
        n = min(len(a), len(b))
        first = next((i for i in range(n) if a[i] != b[i]), None)
        same += n if first is None else first
        total += len(a)
        identical += a == b
    diff = max((max(abs(x - y) for x, y in zip(a, b)) for a, b in zip(one.first_logits, many.first_logits)),
               default=None)
    return {"identical_sequences": identical, "sequences": len(one.tokens),
            "identical_prefix_fraction": same / total if total else None, "first_step_max_abs_logit_diff": diff}


def report(results: list[EngineResult], parity: dict[str, Any]) -> str:
    one, many = results[0], results[-1]
    row = lambda name, cells: f"{name:24}" + "".join(f"{c:>16}" for c in cells)  # noqa: E731
    lines = [row("", [r.label for r in results]),
             row("quantization", [r.quantization for r in results]),
             row("decode executor", [r.executor for r in results]),
             row("threads per rank", [r.threads_per_rank for r in results]),
             row("output tok/s", [f"{r.tok_s:.1f}" for r in results]),
             row("decode ms/step", [f"{r.decode_ms_per_step:.1f}" for r in results])]
    for key in ("wall", "scheduling", "broadcast", "all_reduce", "compute"):
        lines.append(row(key + " (driver)", [f"{r.split[key]:.2f}s {100 * r.split[key] / r.split['wall']:3.0f}%"
                                            for r in results]))
    for rank in range(many.tp):
        cells = []
        for r in results:
            m = r.rank_memory[rank] if rank < len(r.rank_memory) else None
            cells.append(f"{m['weight_bytes'] / 2**20:.1f}/{m['kv_bytes'] / 2**20:.1f}" if m else "-")
        lines.append(row(f"rank {rank} weights/kv MiB", cells))
    for r in results[:-1]:
        lines.append(f"{many.label} / {r.label}: throughput {many.tok_s / r.tok_s:.2f}x, decode step "
                     f"{many.decode_ms_per_step / max(r.decode_ms_per_step, 1e-9):.2f}x the time")
    lines.append(f"greedy parity: {parity['identical_sequences']}/{parity['sequences']} sequences identical, "
                 f"{100 * (parity['identical_prefix_fraction'] or 0):.1f}% of tokens before a first difference; "
                 f"first-step logits max |diff| {parity['first_step_max_abs_logit_diff']}")
    for r in results[1:-1]:  # the same model on one rank by another executor: the rounding baseline
        base = compare(one, r)
        lines.append(f"  baseline {r.label} against {one.label}: {base['identical_sequences']}/{base['sequences']} "
                     f"identical, {100 * (base['identical_prefix_fraction'] or 0):.1f}% of tokens; first-step "
                     f"logits max |diff| {base['first_step_max_abs_logit_diff']}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None, help="cores in all (default: every core)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model-dir", default=None, help="where to write/reuse the synthetic model folder")
    p.add_argument("--model", default=None,
                   help="run this GGUF file or HF folder instead of the synthetic model ('bundled': SmolLM2, "
                        "whose 9 heads split over 3 ranks)")
    p.add_argument("--format", choices=["folder", "gguf"], default="folder",
                   help="the synthetic model as safetensors (dense) or as a GGUF file of Q4_1/Q8_0 blocks")
    p.add_argument("--quantization", default=None,
                   help="none, int8, int4, gguf, w8a8 (default: gguf for --format gguf, else none)")
    p.add_argument("--quick", action="store_true", help="a 4-layer model and a short workload")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.prompt_len, args.max_tokens, args.rounds = 4, 32, 16, 1
    if args.quantization is None:
        args.quantization = "gguf" if args.format == "gguf" or args.model == "bundled" else "none"
    return args


def prepare_model(args: argparse.Namespace) -> str:
    """Write (or reuse) the synthetic model in the asked format; its path (or the
    ``--model`` given: a GGUF file, an HF folder, or ``bundled``)."""
    model = getattr(args, "model", None)
    if model == "bundled":
        from tokenmill.files.bundled import default_model_path

        return default_model_path()
    if model:
        return model
    shape = QUICK_SHAPE if args.quick else SHAPE
    folder = args.model_dir or os.path.join(tempfile.gettempdir(),
                                            f"tokenmill-tp-synthetic-{'quick' if args.quick else 'full'}")
    if getattr(args, "format", "folder") == "gguf":
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"model-{GGUF_LINEAR_TYPE.lower()}.gguf")
        write_gguf_model(path, shape)
        return path
    write_model(folder, shape)
    return folder


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    folder = prepare_model(args)
    shape = dataclasses.asdict(parallel.read_config(folder))
    results = measure(args, folder)
    parity = compare(results[0], results[-1])
    summary = {"config": vars(args), "model": dict(shape), "parity": parity,
               "baselines": {r.label: compare(results[0], r) for r in results[1:-1]},
               "ratio_tok_s": results[-1].tok_s / results[0].tok_s,
               "results": [{k: v for k, v in asdict(r).items() if k not in ("tokens", "first_logits")}
                           for r in results],
               "elapsed_s": time.perf_counter() - started}
    print(report(results, parity))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The one prepared GPU check (issue 9): greedy parity and throughput on a device.

Meant for a session lent a GPU for a few minutes: one command, one JSON
summary. On ``--device cpu`` it runs the same steps here (a dry run that keeps
the script working between GPU sessions; ``--quick`` shrinks it).

1. Parity: the bundled SmolLM2 in float32 on the device against transformers
   in float32 on the CPU (the reference; same GGUF, dequantized by both):
   greedy tokens for ``--parity-prompts`` prompts, ``--parity-tokens`` each,
   and the largest logit difference at the last prompt position.
2. Offline throughput on the device in ``--dtype`` (default bfloat16): many
   prompts at once through ``LLM.generate``; output tokens/s.
3. Single-stream decode on the device: tokens/s of one greedy request after
   a short prompt (first token excluded).
4. CUDA graphs for decode steps (``engine/cuda_graphs.py``), on against off
   (``TOKENMILL_CUDA_GRAPHS=0``): greedy tokens of the parity prompts run
   together in float32 (must be identical), and decode tokens/s in ``--dtype``
   at batch 1 and ``--graph-batch`` (decode steps only, prefill excluded), with
   the graph captures and replays counted so a run shows the graphs ran. On the
   CPU there are no CUDA graphs: "on" records with the tests' emulated backend
   (same buckets, padding and static buffers; replay re-runs the step), so the
   dry run still checks the graph logic's parity on the real model.

    python benchmarks/cuda_check.py                      # on a GPU machine
    python benchmarks/cuda_check.py --device cpu --quick  # dry run here
    python benchmarks/cuda_check.py --out $OUT/cuda.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.config import parse_dtype
from tokenmill.model.bundled import default_model_path
from tokenmill.model.loader import load_model
from tokenmill.tokenizer import Tokenizer

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "List three colors of the rainbow:\n1.",
    "Once upon a time, in a small village by the sea,",
    "The three laws of thermodynamics are",
    "Q: What is 17 times 23?\nA:",
    "A haiku about autumn leaves:\n",
    "import numpy as np\n\n# compute the mean of each column\n",
]


def reference_model(path: str):  # type: ignore[no-untyped-def]
    import transformers

    folder, name = os.path.split(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32,
        quantization_config=transformers.GgufConfig(gguf_file=name, dequantize=True)).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def parity(args: argparse.Namespace, path: str, tokenizer: Tokenizer) -> dict:
    loaded = load_model(path, dtype=torch.float32)
    llm = LLM(loaded_model=loaded, tokenizer=tokenizer, dtype="float32", device=args.device,
              kv_cache_memory="512MiB")
    ref = reference_model(path)
    prompts = [tokenizer.encode(p) for p in PROMPTS[: args.parity_prompts]]
    params = SamplingParams(temperature=0.0, max_tokens=args.parity_tokens, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params)
    matched, first_diff, max_logit_diff = 0, [], 0.0
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            t = torch.tensor([ids])
            want = ref.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=args.parity_tokens,
                                do_sample=False)[0, len(ids):].tolist()
        got = out.outputs[0].token_ids
        matched += got == want
        first_diff.append(next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None))
    # Last-prompt-position logits, engine on the device vs reference on the CPU.
    engine = llm.engine
    for ids in prompts:
        with torch.no_grad():
            ref_logits = ref(torch.tensor([ids])).logits[0, -1].float()
        one = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=20))[0]
        lp = one.outputs[0].logprobs[0]
        ref_lp = torch.log_softmax(ref_logits, -1)
        for token_id, value in lp.top.items():
            max_logit_diff = max(max_logit_diff, abs(value - float(ref_lp[token_id])))
    del engine
    return {"prompts": len(prompts), "tokens_each": args.parity_tokens, "identical": matched,
            "first_divergence": first_diff, "max_logprob_diff_top20": max_logit_diff}


def throughput(args: argparse.Namespace, path: str, tokenizer: Tokenizer) -> dict:
    llm = LLM(model=path, dtype=args.dtype, device=args.device, kv_cache_memory=args.kv_cache_memory,
              max_num_seqs=args.num_prompts)
    rng = random.Random(0)
    vocab = tokenizer.vocab_size
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True))
    elapsed = time.perf_counter() - t
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    # Single stream: time from the first token to the last.
    engine = llm.engine
    engine.add_request("single", prompts[0][:32], SamplingParams(temperature=0.0, max_tokens=args.single_tokens + 1,
                                                                 ignore_eos=True))
    engine.step()
    t1, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    single = steps / (time.perf_counter() - t1)
    return {"dtype": args.dtype, "prompts": args.num_prompts, "prompt_len": args.prompt_len,
            "output_len": args.output_len, "seconds": round(elapsed, 3), "output_tok_s": round(produced / elapsed, 1),
            "single_stream_decode_tok_s": round(single, 1)}


def _graph_llm(enabled: bool, **options):  # type: ignore[no-untyped-def]
    """An LLM built with CUDA graphs switched on or off (the switch is read when the runner
    is built). On the CPU, "on" records with the emulated backend (tests' stand-in), so the
    graph logic still runs on the real model."""
    from tokenmill.engine import cuda_graphs

    saved = os.environ.get(cuda_graphs.ENV_SWITCH), cuda_graphs.default_backend
    os.environ[cuda_graphs.ENV_SWITCH] = "1" if enabled else "0"
    if options["device"] == "cpu":
        cuda_graphs.default_backend = lambda device: cuda_graphs.EmulatedGraphBackend(strict=False)
    try:
        return LLM(**options)
    finally:
        cuda_graphs.default_backend = saved[1]
        if saved[0] is None:
            os.environ.pop(cuda_graphs.ENV_SWITCH, None)
        else:
            os.environ[cuda_graphs.ENV_SWITCH] = saved[0]


def _graph_stats(llm) -> dict:  # type: ignore[no-untyped-def]
    graphs = llm.engine.runner.graphs
    if graphs is None:
        return {"active": False}
    return {"active": True, "captures": graphs.stats.captures, "replays": graphs.stats.replays,
            "eager_steps": dict(graphs.stats.eager)}


def _free_device_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _decode_rate(llm, prompts: list[list[int]], tokens: int, device: str) -> float:  # type: ignore[no-untyped-def]
    """Decode tokens/s of these prompts run together: steps after every first token, to the end."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"g{i}", ids, params)
    produced = 0
    while any(not r.output_token_ids for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t = time.perf_counter()
    while engine.has_unfinished():
        produced += sum(len(d.token_ids) for d in engine.step())
    return produced / (time.perf_counter() - t)


def graphs_check(args: argparse.Namespace, path: str, tokenizer: Tokenizer) -> dict:
    """Greedy parity (float32) and decode speed (args.dtype) with CUDA graphs on and off.
    On the CPU both sides take the torch decode path (the one graphs record), and the
    speed figures only say the emulation ran."""
    saved = os.environ.get("TOKENMILL_CPU_KERNELS")
    if args.device == "cpu":
        os.environ["TOKENMILL_CPU_KERNELS"] = "0"
    try:
        return _graphs_check(args, path, tokenizer)
    finally:
        if saved is None:
            os.environ.pop("TOKENMILL_CPU_KERNELS", None)
        else:
            os.environ["TOKENMILL_CPU_KERNELS"] = saved


def _graphs_check(args: argparse.Namespace, path: str, tokenizer: Tokenizer) -> dict:
    prompts = [tokenizer.encode(p) for p in PROMPTS[: args.parity_prompts]]
    params = SamplingParams(temperature=0.0, max_tokens=args.parity_tokens, ignore_eos=True)
    tokens, stats = {}, {}
    loaded = load_model(path, dtype=torch.float32)
    for enabled in (True, False):
        llm = _graph_llm(enabled, loaded_model=loaded, tokenizer=tokenizer, dtype="float32", device=args.device,
                         kv_cache_memory="1GiB", max_num_seqs=max(8, len(prompts)))
        tokens[enabled] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats[enabled] = _graph_stats(llm)
        del llm
        _free_device_memory()
    same = sum(a == b for a, b in zip(tokens[True], tokens[False]))
    rng = random.Random(1)
    batch = [[rng.randrange(100, tokenizer.vocab_size - 100) for _ in range(args.prompt_len)]
             for _ in range(args.graph_batch)]
    rates: dict[str, dict[str, float]] = {}
    speed_stats = {}
    loaded = load_model(path, dtype=parse_dtype(args.dtype))
    for enabled in (True, False):
        llm = _graph_llm(enabled, loaded_model=loaded, tokenizer=tokenizer, dtype=args.dtype, device=args.device,
                         kv_cache_memory="2GiB", max_num_seqs=max(args.graph_batch, 1))
        _decode_rate(llm, batch[:1], 4, args.device)  # warm-up (and the first graphs' captures)
        side = "on" if enabled else "off"
        rates[side] = {"batch_1_tok_s": round(_decode_rate(llm, batch[:1], args.single_tokens, args.device), 1),
                       f"batch_{args.graph_batch}_tok_s": round(
                           _decode_rate(llm, batch, args.single_tokens, args.device), 1)}
        speed_stats[side] = _graph_stats(llm)
        del llm
        _free_device_memory()
    ratios = {key: round(rates["on"][key] / rates["off"][key], 2) for key in rates["on"]}
    return {"parity_float32": {"prompts": len(prompts), "tokens_each": args.parity_tokens, "identical": same,
                               "graphs_on": stats[True], "graphs_off": stats[False]},
            "decode": {"dtype": args.dtype, "on": rates["on"], "off": rates["off"], "on_over_off": ratios,
                       "graphs_on": speed_stats["on"]}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", help="throughput runs (parity is always float32)")
    ap.add_argument("--parity-prompts", type=int, default=8)
    ap.add_argument("--parity-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--single-tokens", type=int, default=128)
    ap.add_argument("--graph-batch", type=int, default=16, help="the batched decode of the CUDA graphs check")
    ap.add_argument("--kv-cache-memory", default="8GiB")
    ap.add_argument("--quick", action="store_true", help="small sizes (the CPU dry run)")
    ap.add_argument("--out", default=None, help="also write the JSON summary here")
    args = ap.parse_args(argv)
    if args.quick:
        args.parity_prompts, args.parity_tokens = 2, 8
        args.num_prompts, args.prompt_len, args.output_len, args.single_tokens = 4, 32, 8, 8
        args.graph_batch = 3
        args.kv_cache_memory = "256MiB"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("cuda_check: no CUDA device here (torch.cuda.is_available() is False); "
              "use --device cpu for a dry run", file=sys.stderr)
        return 2
    path = default_model_path()
    tokenizer = Tokenizer.from_gguf(path)
    summary: dict = {"device": args.device, "torch": torch.__version__}
    if args.device.startswith("cuda"):
        summary["gpu"] = torch.cuda.get_device_name()
    summary["parity_float32"] = parity(args, path, tokenizer)
    summary["throughput"] = throughput(args, path, tokenizer)
    summary["cuda_graphs"] = graphs_check(args, path, tokenizer)
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    graph_parity = summary["cuda_graphs"]["parity_float32"]
    ok = (summary["parity_float32"]["identical"] == summary["parity_float32"]["prompts"]
          and graph_parity["identical"] == graph_parity["prompts"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

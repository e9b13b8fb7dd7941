"""Prefill chunks through the fused native step, against the eager forward, in one run.

Builds two engines of the same configuration (the defaults unless ``--quantization`` /
``--dtype`` say otherwise) in one process, one with ``KernelOptions.fused_prefill`` on
(steps with prefill chunks run ``tm_model_step``, ``FusedPrefillExecutor``) and one with
it off (those steps run the eager model), and lets them take turns for ``--rounds``
rounds: each round, ``--requests`` prompts of ``--input-len`` tokens that share no prefix
(so none is found in the prefix cache), ``--output-len`` greedy tokens each. With the
default one output token a round is prefill only, in the engine's token budget per step.

Printed per round and engine: wall seconds and prompt + output tokens a second; last, the
fused engine's rate against the eager one's (sums over the rounds). The dense float32
reference keeps the eager prefill (its linears are torch's), so ``--quantization none``
measures what that choice left out.

    .venv/bin/python benchmarks/fused_prefill.py [--rounds 3] [--requests 64] [--input-len 256]
        [--output-len 1] [--quantization auto] [--dtype auto]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving import make_prompts  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.engine.step.executors import FusedPrefillExecutor  # noqa: E402
from tokenmill.engine.step.runner import ModelRunner  # noqa: E402
from tokenmill.settings.options import KernelOptions  # noqa: E402
from tokenmill.files.tokenizer import Tokenizer  # noqa: E402


def engine(args: argparse.Namespace, fused: bool) -> LLM:
    llm = LLM(None, dtype=args.dtype, quantization=args.quantization, max_num_seqs=args.requests,
              kv_cache_memory=args.kv_cache_memory,
              kernel_options=KernelOptions.from_env().replace(fused_prefill=fused))
    runner: ModelRunner = llm.engine.runner
    if fused and not any(isinstance(e, FusedPrefillExecutor) for e in runner.executors):
        # Dense layers, which the runner leaves eager: measure the step all the same.
        assert runner.fused is not None, "the fused step is off for this model"
        runner.executors.insert(1, FusedPrefillExecutor(runner.model, runner.lora, runner.fused))
    return llm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=1)
    p.add_argument("--quantization", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-memory", default="2GiB")
    args = p.parse_args()
    tok = Tokenizer.from_model_path(None)
    prompts = make_prompts(tok, args.requests * args.rounds * 2 + 2, args.input_len)
    engines = {"fused": engine(args, True), "eager": engine(args, False)}
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for i, llm in enumerate(engines.values()):  # warm-up: kernels built, first-call costs paid
        llm.generate([prompts[-1 - i]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    print(f"# fused_prefill: quantization {args.quantization}, dtype {args.dtype}, {args.requests} x "
          f"{args.input_len} prompt tokens, {args.output_len} output tokens, load {os.getloadavg()[0]:.2f}")
    print("| round | engine | wall s | tokens/s |")
    print("|---|---|---|---|")
    total = dict.fromkeys(engines, 0.0)
    tokens = args.requests * (args.input_len + args.output_len)
    n = 0
    for r in range(args.rounds):
        for name, llm in engines.items():
            batch = prompts[n * args.requests:(n + 1) * args.requests]
            n += 1
            t0 = time.perf_counter()
            llm.generate(batch, params)
            wall = time.perf_counter() - t0
            total[name] += wall
            print(f"| {r + 1} | {name} | {wall:.2f} | {tokens / wall:.0f} |", flush=True)
    print(f"\nfused prefill: {total['eager'] / total['fused']:.2f}x the eager prefill's rate "
          f"(sum over {args.rounds} rounds)")


if __name__ == "__main__":
    main()

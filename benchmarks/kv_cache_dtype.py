"""Decode step time at many streams, per KV pool dtype, in one process.

Each engine (``--kv`` dtypes, the same ``--dtype`` compute, ``--quantization`` and
bundled model)
is given ``--streams`` requests of ``--input-len``-token prompts that share no
prefix, and steps until every request has its first token (prefill done).
Then the engines take turns, ``--rounds`` times: each runs ``--steps`` pure
decode steps of all its streams (the engine as served, ``LLMEngine.step``:
the fused native decode step up to its batch limit). A slow spell of this
shared host falls on every engine alike; the best round and the median are
printed per engine, as output tokens per second (streams / step time), with
the context length the steps ran at and the pool's blocks for the same
``--kv-cache-memory``.

    .venv/bin/python benchmarks/kv_cache_dtype.py [--kv auto,int8,fp8] [--dtype bfloat16] [--streams 64]
        [--input-len 256] [--steps 16] [--rounds 5]
    .venv/bin/python benchmarks/kv_cache_dtype.py --dtype auto --quantization auto --kv float32,bfloat16,int8
        # the default configuration with each pool
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from tokenmill.settings.config import EngineConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.request import SamplingParams


def start(kv: str, args: argparse.Namespace) -> LLMEngine:
    engine = LLMEngine(EngineConfig.from_options(
        dtype=args.dtype, quantization=args.quantization, kv_cache_dtype=kv, kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=False,
        max_num_seqs=args.streams, max_num_batched_tokens=512))
    rng = random.Random(7)
    vocab = engine.tokenizer.vocab_size
    # Early prompts decode while later ones prefill (512 tokens a step): enough tokens that
    # no stream finishes before the last round.
    budget = args.streams * args.input_len // 512 + args.steps * (args.rounds + 2) + 16
    for i in range(args.streams):
        prompt = [rng.randrange(100, vocab - 100) for _ in range(args.input_len)]
        engine.add_request(f"s{i}", prompt, SamplingParams(temperature=0.0, max_tokens=budget, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    for _ in range(args.steps):  # warm-up: every stream decoding
        engine.step()
    if len(engine.scheduler.running) != args.streams:
        raise SystemExit(f"kv {kv}: {len(engine.scheduler.running)} of {args.streams} streams running; "
                         "raise --kv-cache-memory")
    return engine


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--kv", default="auto,int8")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="none", help="as `tokenmill serve --quantization` (auto: the default)")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--kv-cache-memory", default="1GiB")
    args = ap.parse_args(argv)
    kinds = [k.strip() for k in args.kv.split(",") if k.strip()]
    engines = {kv: start(kv, args) for kv in kinds}
    times: dict[str, list[float]] = {kv: [] for kv in kinds}
    for _ in range(args.rounds):
        for kv, engine in engines.items():
            t = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            times[kv].append((time.perf_counter() - t) / args.steps)
    assert all(len(e.scheduler.running) == args.streams for e in engines.values()), "a stream finished early"
    first = next(iter(engines.values()))
    end = statistics.mean(r.num_tokens for r in first.scheduler.running)
    span = args.rounds * args.steps
    print(f"# kv_cache_dtype: dtype {args.dtype}, quantization {args.quantization}, {args.streams} streams, "
          f"prompts {args.input_len} tokens (mean context {end - span:.0f}-{end:.0f} tokens while measured), {args.rounds} rounds x {args.steps} "
          f"steps, load {os.getloadavg()[0]:.2f}, cpus {os.cpu_count()}")
    print("| KV pool | blocks in the budget | best step ms | median step ms | best tok/s | median tok/s |")
    print("|---|---|---|---|---|---|")
    for kv in kinds:
        best, med = min(times[kv]), statistics.median(times[kv])
        print(f"| {kv} | {engines[kv].pool.num_blocks} | {best * 1000:.1f} | {med * 1000:.1f} | "
              f"{args.streams / best:.0f} | {args.streams / med:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

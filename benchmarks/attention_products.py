"""Attention over a bf16 KV pool: bf16 products, the look-ahead prefetch, and widening rows in
pairs, each against the build without it, in one run.

The default configuration on a CPU keeps its KV pool in bf16. On a CPU with
AVX512-BF16 the C attention kernels multiply the pool's rows as they are with
bf16-rounded queries and softmax weights (``vdpbf16ps``) instead of widening every
row to float32, and decode attention prefetches the next item's rows while it
computes the current one. On such a CPU this script builds the kernels three ways
from the same source:

* ``before``: ``-mno-avx512bf16 -DTM_NO_ITEM_PIPELINE``, float32 arithmetic and no
  look-ahead (the baseline);
* ``look-ahead``: ``-mno-avx512bf16``, float32 arithmetic with the look-ahead;
* ``bf16 products``: the default build (both).

On a CPU without bf16 products (AVX2), decode attention widens a row's 2 x 8 values
from one load, even and odd ones (the "pairs" order), where it widened each half of
the block apart before; two builds:

* ``halves widened``: ``-DTM_NO_BF16_PAIRS`` (the baseline);
* ``pairs``: the default build.

and times them alternately, round by round, on SmolLM2-135M's shapes (9 query heads,
3 KV heads, head_dim 64, blocks of 16 scattered over the pool, float32 queries):

* ``decode attention``: 64 sequences at ``--context``, 30 layer calls;
* ``prefill attention``: one 512-token chunk, 30 layer calls;
* ``fused decode step``: the default model's whole batch-64 step at ``--context``.

Printed: median ms per build and each build's speed-up over the first (the baseline).

    .venv/bin/python benchmarks/attention_products.py [--rounds 6] [--context 300]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Callable

import torch

from tokenmill import LLM
from tokenmill.engine.step.executors import FusedDecodeExecutor
from tokenmill.model.kernels import cpu_kernels
from tokenmill.model.attention import kv_cache_shape

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def scattered_pool(blocks_used: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """bf16 K and V pools with twice the blocks needed, and the used blocks in random order."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 2 * blocks_used
    shape = kv_cache_shape(num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    return torch.randn(shape, generator=gen).bfloat16(), torch.randn(shape, generator=gen).bfloat16(), order


def layer_calls(call: Callable[[cpu_kernels.KernelLibrary], bool]) -> Callable[[cpu_kernels.KernelLibrary], float]:
    """Seconds for LAYERS calls of one attention entry point on a build (each must run)."""
    def run(lib: cpu_kernels.KernelLibrary) -> float:
        start = time.perf_counter()
        for _ in range(LAYERS):
            assert call(lib)
        return time.perf_counter() - start
    return run


def decode_case(context: int) -> Callable[[cpu_kernels.KernelLibrary], float]:
    width = -(-context // BLOCK)
    k, v, order = scattered_pool(64 * width, seed=1)
    tables = torch.tensor(order[:64 * width], dtype=torch.int32).reshape(64, width)
    lens = torch.full((64,), context, dtype=torch.int32)
    q = torch.randn(64, HEADS + KV_HEADS, HEAD_DIM)[:, :HEADS]  # strided, as the model slices it
    out = torch.empty(64, HEADS, HEAD_DIM)

    return layer_calls(lambda lib: cpu_kernels.paged_decode_attention(q, k, v, tables, lens, HEAD_DIM**-0.5, out,
                                                                      library=lib))


def prefill_case(tokens: int = 512) -> Callable[[cpu_kernels.KernelLibrary], float]:
    width = -(-tokens // BLOCK)
    k, v, order = scattered_pool(width, seed=2)
    table = torch.tensor(order[:width], dtype=torch.int32)
    q = torch.randn(tokens, HEADS + KV_HEADS, HEAD_DIM)[:, :HEADS]
    out = torch.empty(tokens, HEADS, HEAD_DIM)

    return layer_calls(lambda lib: cpu_kernels.paged_prefill_attention(q, k, v, table, tokens, HEAD_DIM**-0.5, out,
                                                                       library=lib))


def fused_case(context: int) -> Callable[[cpu_kernels.KernelLibrary], float] | None:
    """The default model's batch-64 fused decode step, its decoder switched between builds."""
    llm = LLM(None, max_num_seqs=64, kv_cache_memory="2GiB", dtype="auto", quantization="auto")
    engine = llm.engine
    executor = next((e for e in engine.runner.executors if isinstance(e, FusedDecodeExecutor)), None)
    width = -(-context // engine.block_size)
    if executor is None or engine.pool.num_blocks < 64 * width:
        return None
    decoder = executor.decoder
    order = list(range(64 * width))
    random.Random(3).shuffle(order)
    tables = torch.tensor(order, dtype=torch.int32).reshape(64, width)
    lens = torch.full((64,), context, dtype=torch.int32)
    embeddings = torch.randn(64, decoder.hidden_size)

    def run(lib: cpu_kernels.KernelLibrary) -> float:
        own, decoder.lib = decoder.lib, lib
        try:
            start = time.perf_counter()
            decoder.run(embeddings.clone(), tables, lens)
            return time.perf_counter() - start
        finally:
            decoder.lib = own
    return run


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--context", type=int, default=300)
    args = ap.parse_args()
    default = cpu_kernels.build()
    if default.bf16_attention:
        builds = {"before": cpu_kernels.build(("-mno-avx512bf16", "-DTM_NO_ITEM_PIPELINE")),
                  "look-ahead": cpu_kernels.build(("-mno-avx512bf16",)), "bf16 products": default}
    else:  # no bf16 products: the rows are widened to float32, a block's two halves each or in pairs
        builds = {"halves widened": cpu_kernels.build(("-DTM_NO_BF16_PAIRS",)), "pairs": default}
    cases = {f"decode attention (64 x {args.context}, {LAYERS} layers)": decode_case(args.context),
             f"prefill attention (512 tokens, {LAYERS} layers)": prefill_case()}
    fused = fused_case(args.context)
    if fused is not None:
        cases[f"fused decode step (default model, 64 x {args.context})"] = fused
    names = list(builds)
    print(f"# attention_products: threads {torch.get_num_threads()}, cpus {os.cpu_count()}, rounds {args.rounds}, "
          f"load {os.getloadavg()[0]:.2f}, baseline: {names[0]}")
    print("| case | " + " | ".join(f"{b} ms" for b in names) + " | " + " | ".join(names[1:]) + " |")
    print("|---|" + "---|" * (2 * len(names) - 1))
    for name, run in cases.items():
        for lib in builds.values():
            run(lib)  # warm-up
        times: dict[str, list[float]] = {b: [] for b in builds}
        for _ in range(args.rounds):
            for build, lib in builds.items():
                times[build].append(min(run(lib) for _ in range(3)))
        ms = [statistics.median(times[b]) * 1e3 for b in names]
        print(f"| {name} | " + " | ".join(f"{m:.1f}" for m in ms) + " | "
              + " | ".join(f"{ms[0] / m:.2f}x" for m in ms[1:]) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Decode attention over long contexts, attended in parts (paged_attention.c's PART_LEN)
against whole (sequence, kv head) items, in one run.

A sequence's item used to run start to end on one thread: one long sequence of a model
with one kv head (Gemma 3 270M/1B) kept every other thread waiting. Its context is now
split into parts of PART_LEN positions that the threads share, then combined. The
baseline is the same kernel library built with ``-DPART_LEN=(1 << 30)`` (no parts). Both
builds are timed interleaved, best of N, on the same pool; the ratio is the figure.

    .venv/bin/python benchmarks/context_parts.py [--contexts 2048,8192,16384] [--batches 1,4]
        [--heads 4 --kv-heads 1 --head-dim 256] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from tokenmill.model.kernels import cpu_kernels
from tokenmill.model.attention import kv_cache_shape

BLOCK = 16


def pool(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    """q, K, V, scattered int32 tables and lengths for ``batch`` sequences of ``context`` tokens."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-context // BLOCK)
    num_blocks = batch * per_seq + 1
    k = torch.randn(kv_cache_shape(num_blocks, BLOCK, kv_heads, head_dim), generator=gen).to(dtype)
    v = torch.randn(kv_cache_shape(num_blocks, BLOCK, kv_heads, head_dim), generator=gen).to(dtype)
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    tables = torch.tensor([blocks[i * per_seq:(i + 1) * per_seq] for i in range(batch)], dtype=torch.int32)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
    return q, k, v, tables, torch.full((batch,), context, dtype=torch.int32)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="2048,8192,16384")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--heads", type=int, default=4, help="query heads (default: Gemma 3 270M's 4)")
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    builds = {"whole items": cpu_kernels.build(("-DPART_LEN=(1<<30)",)), "parts": cpu_kernels.build()}
    print(f"{torch.get_num_threads()} threads, {args.heads} heads / {args.kv_heads} kv heads x {args.head_dim}, "
          f"{args.dtype} pool; best of {args.reps}, interleaved")
    print(f"{'batch':>5} {'context':>8} {'whole ms':>9} {'parts ms':>9} {'speed-up':>9} {'max diff':>9}")
    scale = args.head_dim ** -0.5
    for batch in [int(b) for b in args.batches.split(",")]:
        for context in [int(c) for c in args.contexts.split(",")]:
            q, k, v, tables, lens = pool(batch, context, args.heads, args.kv_heads, args.head_dim, dtype)
            outs, best = {}, {name: float("inf") for name in builds}
            for _ in range(args.reps):
                for name, lib in builds.items():
                    out = torch.empty_like(q)
                    t = time.perf_counter()
                    assert cpu_kernels.paged_decode_attention(q, k, v, tables, lens, scale, out, library=lib)
                    best[name] = min(best[name], time.perf_counter() - t)
                    outs[name] = out
            diff = (outs["parts"].float() - outs["whole items"].float()).abs().max().item()
            whole, parts = best["whole items"] * 1e3, best["parts"] * 1e3
            print(f"{batch:>5} {context:>8} {whole:>9.3f} {parts:>9.3f} {whole / parts:>8.2f}x {diff:>9.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Decode attention per layer call: the C kernel backend reading the paged cache in place
against the torch backend's gather path (the same step layout, prepared by each
backend), in one run.

SmolLM2-135M shapes (9 query heads, 3 KV heads, head_dim 64, block 16), block
tables scattered over the pool the way a busy server leaves them, queries
sliced out of a fused q/k tensor as the model does, and per-step metadata
built as the runner builds it for each path (mask, gather index and reused
workspace for torch; int32 tables and lengths for the kernel). The two paths
are timed interleaved, best of N, so both see the same machine load; the
ratio is the figure to read (2 shared cores: absolute times drift).

    .venv/bin/python benchmarks/decode_attention.py [--batches 1,16,64] [--contexts 256,1024] [--dtypes float32,bfloat16]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

from tokenmill.model.kernels import cpu_kernels
from tokenmill.model.attention import CpuKernelAttention, StepAttention, StepLayout, TorchPagedAttention, kv_cache_shape

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def make_inputs(batch: int, context: int, dtype: torch.dtype, kernel: bool, seed: int = 0):
    """q, k_cache, v_cache and the metadata the runner would build for one path."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-context // BLOCK)
    num_blocks = batch * per_seq + 8
    k_cache = torch.randn(kv_cache_shape(num_blocks, BLOCK, KV_HEADS, HEAD_DIM), generator=gen).to(dtype)
    v_cache = torch.randn(kv_cache_shape(num_blocks, BLOCK, KV_HEADS, HEAD_DIM), generator=gen).to(dtype)
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    # Lengths spread a little below the context, as in a real batch.
    lens = [context - rng.randrange(0, BLOCK) for _ in range(batch)]
    tables = torch.tensor([blocks[i * per_seq:(i + 1) * per_seq] for i in range(batch)], dtype=torch.long)
    qk = torch.randn(batch, HEADS + KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    q = qk[:, :HEADS]  # strided rows, like the model's fused rotation output
    layout = StepLayout(slot_mapping=torch.zeros(batch, dtype=torch.long), block_tables=tables,
                        seq_lens=lens, query_lens=[1] * batch, num_decodes=batch, block_size=BLOCK)
    lib = cpu_kernels.load()
    assert lib is not None
    backend = (CpuKernelAttention(lib) if kernel
               else TorchPagedAttention(dtype, torch.device("cpu"), KV_HEADS, HEADS, num_blocks, HEAD_DIM))
    return q, k_cache, v_cache, backend.prepare(layout)  # what the runner prepares once per step


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step: StepAttention,
           scale: float) -> torch.Tensor:
    return step.attend(q, k_cache, v_cache, scale)


def bench(batch: int, context: int, dtype: torch.dtype, reps: int) -> tuple[float, float, float]:
    """Best ms per call for (torch gather path, kernel) and the max abs difference."""
    scale = HEAD_DIM ** -0.5
    cases = {flag: make_inputs(batch, context, dtype, kernel=flag) for flag in (False, True)}
    outs = {}
    for flag, args in cases.items():
        outs[flag] = attend(*args, scale)
    best = {False: float("inf"), True: float("inf")}
    with torch.inference_mode():
        for _ in range(reps):
            for flag, args in cases.items():
                t = time.perf_counter()
                attend(*args, scale)
                best[flag] = min(best[flag], time.perf_counter() - t)
    diff = (outs[True].float() - outs[False].float()).abs().max().item()
    return best[False] * 1e3, best[True] * 1e3, diff


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--contexts", default="256,1024")
    ap.add_argument("--reps", type=int, default=0, help="timed calls per path (0: by size)")
    args = ap.parse_args(argv)
    if not cpu_kernels.available():
        print("the C kernel is unavailable here (no gcc, compile failed, or TOKENMILL_CPU_KERNELS=0)")
        return 1
    print(f"# torch {torch.__version__}, threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}; "
          f"heads {HEADS}/{KV_HEADS}, head_dim {HEAD_DIM}, block {BLOCK}")
    print("| dtype | batch | context | torch gather ms | kernel ms | speed-up | max abs diff |")
    print("|---|---|---|---|---|---|---|")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for context in (int(c) for c in args.contexts.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                reps = args.reps or max(5, min(200, 20000 // (batch * context // 16)))
                base, kern, diff = bench(batch, context, dtype, reps)
                print(f"| {dtype_name} | {batch} | {context} | {base:.3f} | {kern:.3f} | {base / kern:.2f}x "
                      f"| {diff:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

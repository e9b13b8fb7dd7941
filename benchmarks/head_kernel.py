"""The int8 LM head with a scale per 32 inputs (w8a8's head on CPU): its codes widened to
float32 in the C kernels' row-major tile (the baseline) against the VNNI packing with
16-bit activation planes, in one run.

The shape is the bundled SmolLM2-135M head (49,152 x 576), the weights random; both
layers hold the same codes and scales. The two paths are timed interleaved, best of N,
so both see the same machine load; the ratio is the figure to read. Without VNNI in
the kernels' build there is nothing to compare (it says so and exits 1).

    .venv/bin/python benchmarks/head_kernel.py [--rows 1,16,64] [--reps 20]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from tokenmill.model.kernels import cpu_kernels
from tokenmill.model.ops import ModelOps
from tokenmill.model.quant.quant import Int8GroupLinear

VOCAB, HIDDEN = 49152, 576


def call_ms(layer: Int8GroupLinear, x: torch.Tensor) -> float:
    t = time.perf_counter()
    layer(x)
    return (time.perf_counter() - t) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    lib = cpu_kernels.load()
    if lib is None or not lib.int8_dot:
        print("the C kernels are unavailable or have no int8 dot products (VNNI) on this CPU")
        return 1
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.05
    widened, packed = Int8GroupLinear.from_float(weight), Int8GroupLinear.from_float(weight)
    for layer in (widened, packed):
        layer.ops = ModelOps(library=lib)
    packed.prepare_kernels()
    print(f"# torch {torch.__version__}, threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}; "
          f"head {VOCAB} x {HIDDEN}, int8 with a scale per 32 inputs")
    print("| rows | widened to float32 ms | VNNI, 16-bit activations ms | speed-up |")
    print("|---|---|---|---|")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, HIDDEN, generator=gen)
            best = {"widened": float("inf"), "packed": float("inf")}
            for _ in range(args.reps):
                best["widened"] = min(best["widened"], call_ms(widened, x))
                best["packed"] = min(best["packed"], call_ms(packed, x))
            print(f"| {rows} | {best['widened']:.2f} | {best['packed']:.2f} | "
                  f"{best['widened'] / best['packed']:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

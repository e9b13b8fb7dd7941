"""One K-quant projection: the kept blocks (``KQuantLinear``, csrc/kquant.c widening a tile
of rows to float32 inside ``tm_linear``) against the dequantized path a K-quant file took
before (float32 weights made at load, torch's matmul), at several row counts, in one run.

    .venv/bin/python benchmarks/kquant_linear.py [--n 2048] [--k 2048] [--rows 1 16 64]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from tokenmill.model.kernels import cpu_kernels
from tokenmill.model.quant.kquant import KQuantLinear, weight_bits


def random_blocks(type_name: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    nbytes = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[type_name]
    blocks = rng.integers(0, 256, size=(rows, k // 256, nbytes), dtype=np.uint8)
    scale = (1e-4 * rng.uniform(0.5, 1.5, size=(rows, k // 256, 1))).astype(np.float16).view(np.uint8)
    at = 208 if type_name == "Q6_K" else 0
    blocks[..., at : at + 2] = scale
    if type_name != "Q6_K":
        blocks[..., 2:4] = scale
    return blocks.reshape(rows, -1)


def timed(fn, repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    lib = cpu_kernels.load()
    assert lib is not None, "the C kernels did not build"
    rng = np.random.default_rng(0)
    print(f"{args.n} x {args.k}, {torch.get_num_threads()} threads, kernels: {lib.path.name}")
    for type_name in ("Q4_K", "Q5_K", "Q6_K"):
        layer = KQuantLinear([(type_name, random_blocks(type_name, args.n, args.k, rng), (args.n, args.k))])
        (desc,) = layer.kernel_descriptions()
        dense = layer.dequantized_weight()
        for rows in args.rows:
            x = torch.randn(rows, args.k)
            kept = timed(lambda: cpu_kernels.linear(desc, x, lib), args.repeat)
            deq = timed(lambda: torch.nn.functional.linear(x, dense), args.repeat)
            print(f"{type_name} ({weight_bits(layer):.2f} bits/weight) rows {rows:3d}: blocks {kept * 1e3:7.3f} ms, "
                  f"dequantized float32 {deq * 1e3:7.3f} ms, speed-up {deq / kept:5.2f}x", flush=True)


if __name__ == "__main__":
    main()

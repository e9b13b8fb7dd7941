"""int4 layers on the builds with an int4 x int8 kernel (AVX2, AVX-512 VNNI): the nibble packing against what ran before.

One SmolLM2-135M layer's four projections (q/k/v 960x576, o 576x576, gate/up 3072x576,
down 576x1536) as ``Int4Linear`` layers (groups of 32, as the bundled GGUF's Q4_1 blocks),
bound to a kernel build (``--builds``, default ``avx2``; ``native`` is this CPU's), at several
row counts. Three ways, in the same run:

- ``nibble``: the layer as it runs now: the C kernel multiplies the codes in the nibble packing by int8 activations (``int4_q8_rows``);
- ``before``: the same layer without that packing: the C kernel's dequantized float32
  tiles up to ``POLICY.int4_kernel_max_rows`` rows, unpacking into one torch float32
  matmul above;
- ``torch``: ``F.linear`` on the float32 weight (MKL), the float32 reference's matmul.

Printed per build and row count: milliseconds for the four projections (best of
``--repeats``), G multiply-adds a second of ``nibble``, and ``nibble``'s speed as a ratio
against ``before`` and against ``torch`` (the baselines).

    .venv/bin/python benchmarks/int4_rows.py [--builds avx2] [--rows 8,64,512] [--repeats 10]
"""
from __future__ import annotations

import argparse
import dataclasses

import torch
from int8_products import SHAPES, best_of  # the same layer shapes and timing

from tokenmill.model.kernels import cpu_kernels
from tokenmill.model.ops import ModelOps
from tokenmill.model.quant.quant import Int4Linear


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--builds", default="avx2")
    ap.add_argument("--rows", default="8,64,512")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0, help="threads (0: all cores)")
    args = ap.parse_args()
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    print(f"# int4_rows: threads {threads}, best of {args.repeats}; ratios against the same layers without the "
          f"nibble packing (before) and torch F.linear on float32 weights, in the same run")
    print("| build | rows | nibble ms | G MAC/s | before ms | torch ms | vs before | vs torch |")
    print("|---|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g) * 0.05 for n, k in SHAPES]
    for build in args.builds.split(","):
        lib = cpu_kernels.build(cpu_kernels.ISA_FLAGS[build])
        if not lib.q4_int8_dot:
            print(f"| {build} | - | no nibble kernel in this build | - | - | - | - | - |")
            continue
        nibble = [Int4Linear.from_float(w, 32) for w in weights]
        before = [Int4Linear.from_float(w, 32) for w in weights]
        for layer in nibble:
            layer.ops = ModelOps(library=lib)
            layer.kernel_description()  # packs the codes once, as the engine does on first use
        for layer in before:
            # a library object without the nibble kernel's flag: the layer packs nothing
            layer.ops = ModelOps(library=dataclasses.replace(lib, q4_int8_dot=False))
        dense = [layer.dequantized_weight() for layer in nibble]
        for rows in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(rows, k, generator=g) for _, k in SHAPES]
            t_new = best_of(lambda: [m(x) for m, x in zip(nibble, xs)], args.repeats)
            t_old = best_of(lambda: [m(x) for m, x in zip(before, xs)], args.repeats)
            t_ref = best_of(lambda: [torch.nn.functional.linear(x, w) for w, x in zip(dense, xs)], args.repeats)
            macs = rows * sum(n * k for n, k in SHAPES)
            print(f"| {build} | {rows} | {t_new * 1e3:.3f} | {macs / t_new / 1e9:.0f} | {t_old * 1e3:.3f} | "
                  f"{t_ref * 1e3:.3f} | {t_old / t_new:.2f}x | {t_ref / t_new:.2f}x |")


if __name__ == "__main__":
    main()

"""int8 x int8 products per kernel build, against float32 in the same run.

For each instruction-set build this CPU runs (``--builds``, default ``native,avx2``),
one SmolLM2-135M layer's four projections (q/k/v 960x576, o 576x576, gate/up 3072x576,
down 576x1536) as w8a8 runs them in the C kernels (``tm_linear``: int8 codes in the VNNI
packing, 8-bit activations per row), against the same build's float32 tile and torch's
float32 ``F.linear`` (MKL), at several activation row counts (one stream, a decode batch,
a prefill chunk). The native build on a CPU with VNNI multiplies with ``vpdpbusd``; the
``avx2`` build (no VNNI) computes the same sums with ``vpmaddwd`` on widened codes.

Printed per build and row count: milliseconds for the four projections, G multiply-adds
a second, and the int8 kernel's speed as a ratio against the float32 tile and against
torch (baselines measured in the same run, best of ``--repeats``).

    .venv/bin/python benchmarks/int8_products.py [--builds native,avx2] [--rows 1,16,64,512] [--threads 2]
"""
from __future__ import annotations

import argparse
import time

import torch

from tokenmill.model.kernels import cpu_kernels
from tokenmill.model.kernels.cpu_kernels import TmLinear

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in) of one layer's projections


def _layers(lib: cpu_kernels.KernelLibrary) -> list[tuple[TmLinear, TmLinear, torch.Tensor, list[torch.Tensor]]]:
    """(int8 description, float32 description, float32 weight, buffers kept alive) per shape."""
    g = torch.Generator().manual_seed(0)
    out = []
    for n, k in SHAPES:
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        scale = torch.rand(n, generator=g) * 0.01 + 1e-3
        wf = (q.float() * scale[:, None]).contiguous()
        packed, sums = cpu_kernels.pack_vnni(q, lib.vector_width), q.sum(dim=1, dtype=torch.int32)
        d = TmLinear()
        d.kind, d.n, d.k, d.repeat, d.group, d.a8_rows, d.a16_rows = cpu_kernels.W_INT8, n, k, 1, 0, 1, 1
        d.w, d.scale, d.bias, d.packed, d.row_sums = None, scale.data_ptr(), None, packed.data_ptr(), sums.data_ptr()
        f = TmLinear()
        f.kind, f.n, f.k, f.repeat, f.w, f.scale, f.bias = cpu_kernels.W_F32, n, k, 1, wf.data_ptr(), None, None
        out.append((d, f, wf, [q, scale, packed, sums]))
    return out


def best_of(fn, repeats: int) -> float:
    """Best of ``repeats`` timed calls, after untimed ones for at least 0.3 s (the first
    case measured otherwise ran several times slower: threads and clocks waking up)."""
    start = time.perf_counter()
    while time.perf_counter() - start < 0.3:
        fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--builds", default="native,avx2")
    ap.add_argument("--rows", default="1,16,64,512")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0, help="threads (0: all cores)")
    args = ap.parse_args()
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    print(f"# int8_products: threads {threads}, best of {args.repeats}; ratios against the float32 C tile "
          f"and torch F.linear of the same build's run")
    print("| build | products | rows | int8 ms | G MAC/s | float32 tile ms | torch ms | vs float32 tile | vs torch |")
    print("|---|---|---|---|---|---|---|---|---|")
    for build in args.builds.split(","):
        lib = cpu_kernels.build(cpu_kernels.ISA_FLAGS[build])
        if not lib.int8_dot:
            print(f"| {build} | none | - | - | - | - | - | - | - |")
            continue
        layers = _layers(lib)
        for rows in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(rows, k) for _, k in SHAPES]
            int8 = best_of(lambda: [cpu_kernels.linear(d, x, library=lib)
                                  for (d, _, _, _), x in zip(layers, xs)], args.repeats)
            tile = best_of(lambda: [cpu_kernels.linear(f, x, library=lib)
                                  for (_, f, _, _), x in zip(layers, xs)], args.repeats)
            ref = best_of(lambda: [torch.nn.functional.linear(x, w) for (_, _, w, _), x in zip(layers, xs)],
                        args.repeats)
            macs = rows * sum(n * k for n, k in SHAPES)
            print(f"| {build} | {lib.int8_dot_unit} | {rows} | {int8 * 1e3:.3f} | {macs / int8 / 1e9:.0f} | "
                  f"{tile * 1e3:.3f} | {ref * 1e3:.3f} | {tile / int8:.2f}x | {ref / int8:.2f}x |")


if __name__ == "__main__":
    main()

"""Prefill on a GGUF file's Q4_0 blocks against w8a8's int8 layers, at a real model's layer shapes.

A prompt's steps multiply many rows by every weight, so they are bound by the CPU's integer
dot products, not by memory. The 4-bit blocks cost more there than w8a8's int8 codes: each
32-input block carries its own weight scale (and the activations one of their own, as llama.cpp
quantizes them for Q4_0), so every block's int32 sums are converted and scaled in float32, where
w8a8 scales once per output. This script measures that cost three ways, in one run:

- ``layers``: one decoder layer's projections of ``--shape`` (a real_sizes.py shape) as Q4_0
  blocks (fp16 scales, the loader's layers) and as w8a8 layers (int8 codes, one scale per
  channel, 8-bit activations; Q8_0-style groups for the down projection, as w8a8 keeps it),
  at each of ``--rows``: milliseconds (best of ``--repeats``), G multiply-adds a second, and
  the blocks' speed as a ratio against w8a8's (the baseline).
- ``--against DIR``: the same block layers bound to a kernel library built from another
  tree's ``csrc`` folder (a before/after of a kernel change), passes alternated in one
  process so the machine's drift falls on both; the ratio is this tree's speed against it.
- ``pipes`` (AVX-512 VNNI builds): a probe of how the float work shares the CPU with
  ``vpdpbusd``: twelve independent dot products an iteration alone (the baseline), then with
  three and six float32 FMAs added, then with three int32 -> float32 conversions and adds.
  Where an FMA costs as much as a dot product, a block's two float multiplies (its combined
  scale and the accumulate) take two of every ten slots: the blocks' prefill is bound at
  eight tenths of the dot-product rate that w8a8 can approach.

    .venv/bin/python benchmarks/block_prefill.py [--shape 1.1b] [--rows 8,128] [--against /tmp/base/src/tokenmill/model/csrc]
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

import torch
from int8_products import best_of
from memory_bandwidth import compile_probe
from real_sizes import SHAPES

from tokenmill.model.kernels import cpu_kernels
from tokenmill.model.ops import ModelOps
from tokenmill.model.quant.quant import Int4Codes, Int4Linear, Int8GroupLinear, Int8Linear

_PIPES = r"""
#include <immintrin.h>
#include <stdint.h>
/* Twelve independent vpdpbusd chains an iteration, plus MIX's float work; the empty asm keeps
 * each result live in its register so nothing is folded away. */
#define D(a) a = _mm512_dpbusd_epi32(a, x, y); __asm__("" : "+v"(a));
#define F(f) f = _mm512_fmadd_ps(f, s, s); __asm__("" : "+v"(f));
#define C(f) f = _mm512_add_ps(f, _mm512_cvtepi32_ps(a0)); __asm__("" : "+v"(f));
#define PROBE(NAME, MIX)                                                                           \
    int NAME(int64_t n) {                                                                          \
        __m512i a0 = _mm512_set1_epi32(1), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,   \
                a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0;                                     \
        const __m512i x = _mm512_set1_epi8(3), y = _mm512_set1_epi8(5);                           \
        __m512 f0 = _mm512_set1_ps(1), f1 = f0, f2 = f0, s = _mm512_set1_ps(1.0f);                 \
        for (int64_t i = 0; i < n; i++) {                                                          \
            D(a0) D(a1) D(a2) D(a3) D(a4) D(a5) D(a6) D(a7) D(a8) D(a9) D(a10) D(a11) MIX          \
        }                                                                                          \
        __m512i t = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)), \
                                     _mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7))); \
        t = _mm512_add_epi32(t, _mm512_add_epi32(_mm512_add_epi32(a8, a9), _mm512_add_epi32(a10, a11))); \
        return _mm512_reduce_add_epi32(t) + (int)_mm512_reduce_add_ps(_mm512_add_ps(f0, _mm512_add_ps(f1, f2))); \
    }
PROBE(tm_dots, )
PROBE(tm_dots_fma3, F(f0) F(f1) F(f2))
PROBE(tm_dots_fma6, F(f0) F(f1) F(f2) F(f0) F(f1) F(f2))
PROBE(tm_dots_cvt3, C(f0) C(f1) C(f2))
"""


def layer_shapes(shape_name: str) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's projections: q, k, v, o, gate, up, down."""
    s = SHAPES[shape_name]
    kv = s.kv_heads * (s.hidden // s.heads)
    h, i = s.hidden, s.intermediate
    return [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]


def q4_0_codes(n: int, k: int, g: torch.Generator) -> Int4Codes:
    """Random Q4_0 blocks: codes 0..15, fp16 scales, w = d (q - 8) (the loader's zeros are 0)."""
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, k // 32, generator=g) * 0.01 + 0.001).half().float()
    return Int4Codes(codes, scales, torch.zeros_like(scales), 32)


def library_from(csrc: Path, isa_flags: tuple[str, ...]) -> cpu_kernels.KernelLibrary:
    """The kernel library built from another tree's ``csrc`` folder (same flags, own cache entry)."""
    return cpu_kernels.build(isa_flags, csrc=csrc)


def bound(layers: list, lib: cpu_kernels.KernelLibrary) -> list:
    for layer in layers:
        layer.ops = ModelOps(library=lib)
        if isinstance(layer, Int4Linear):
            layer.kernel_description()  # the nibble packing, made once as the engine does
        else:
            layer.prepare_kernels()  # the VNNI packing, as the engine binds its kernels
    return layers


def pass_of(layers: list, xs: list[torch.Tensor]):
    def run() -> None:
        with torch.inference_mode():
            for layer, x in zip(layers, xs):
                layer(x)
    return run


def alternated(a, b, passes: int) -> tuple[float, float]:
    """Mean seconds of ``a`` and ``b`` over ``passes`` alternated passes (order flipped each
    time), after 20 untimed ones."""
    totals = [0.0, 0.0]
    for i in range(passes + 20):
        for j in ((0, 1) if i % 2 else (1, 0)):
            t = time.perf_counter()
            (a, b)[j]()
            if i >= 20:
                totals[j] += time.perf_counter() - t
    return totals[0] / passes, totals[1] / passes


def pipes() -> None:
    probe = compile_probe(_PIPES, "vnni-pipes", ())
    iters = 20_000_000
    print("| probe, per iteration | ns | vs 12 vpdpbusd alone |")
    print("|---|---|---|")
    base = None
    for name, label in (("tm_dots", "12 vpdpbusd"), ("tm_dots_fma3", "+ 3 FMA"), ("tm_dots_fma6", "+ 6 FMA"),
                        ("tm_dots_cvt3", "+ 3 cvt + add")):
        fn = getattr(probe, name)
        fn.argtypes, fn.restype = [ctypes.c_int64], ctypes.c_int
        fn(iters // 10)
        ns = min(_timed(fn, iters) for _ in range(3)) / iters * 1e9
        base = base or ns
        print(f"| {label} | {ns:.3f} | {ns / base:.2f}x |")


def _timed(fn, iters: int) -> float:
    t = time.perf_counter()
    fn(iters)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1.1b")
    ap.add_argument("--rows", default="8,128")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0, help="threads (0: all cores)")
    ap.add_argument("--build", default="native", help="kernel build (cpu_kernels.ISA_FLAGS key)")
    ap.add_argument("--against", type=Path, help="another tree's csrc folder: this tree's block kernel against it")
    ap.add_argument("--passes", type=int, default=100, help="alternated passes for --against")
    args = ap.parse_args(argv)
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    flags = cpu_kernels.ISA_FLAGS[args.build]
    lib = cpu_kernels.build(flags)
    if not lib.q4_int8_dot:
        print(f"build {args.build}: no int4 x int8 kernel (the blocks run dequantized); nothing to compare")
        return 0
    g = torch.Generator().manual_seed(0)
    shapes = layer_shapes(args.shape)
    codes = [q4_0_codes(n, k, g) for n, k in shapes]
    blocks = bound([Int4Linear(c) for c in codes], lib)
    w8a8 = bound([Int8GroupLinear.from_float(c.dequantize(), dynamic=True) if i == len(codes) - 1
                  else Int8Linear.from_float(c.dequantize(), dynamic=True) for i, c in enumerate(codes)], lib)
    against = bound([Int4Linear(c) for c in codes], library_from(args.against, flags)) if args.against else None
    print(f"# block_prefill: {args.shape} layer, build {args.build}, threads {threads}; blocks against w8a8 "
          f"(best of {args.repeats})" + (f", and against {args.against} (mean of {args.passes} alternated passes)"
                                         if against else ""))
    print("| rows | blocks ms | G MAC/s | w8a8 ms | blocks vs w8a8 |" + (" vs --against |" if against else ""))
    print("|---|---|---|---|---|" + ("---|" if against else ""))
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, k, generator=g) for _, k in shapes]
        t_blocks = best_of(pass_of(blocks, xs), args.repeats)
        t_w8a8 = best_of(pass_of(w8a8, xs), args.repeats)
        macs = sum(n * k for n, k in shapes) * rows
        row = (f"| {rows} | {t_blocks * 1e3:.2f} | {macs / t_blocks / 1e9:.0f} | {t_w8a8 * 1e3:.2f} | "
               f"{t_w8a8 / t_blocks:.2f}x |")
        if against:
            with torch.inference_mode():
                same = all(torch.equal(a(x), b(x)) for a, b, x in zip(blocks, against, xs))
            mine, theirs = alternated(pass_of(blocks, xs), pass_of(against, xs), args.passes)
            row += f" {theirs / mine:.3f}x{'' if same else ' (outputs differ)'} |"
        print(row)
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists() and "avx512_vnni" in cpuinfo.read_text():
        pipes()
    return 0


if __name__ == "__main__":
    sys.exit(main())

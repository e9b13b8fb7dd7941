"""The C projection kernel (``tm_linear`` in model/kernels/csrc/linear.c) on its own.

Every weight kind the fused decode step reads (float32, bf16, int8 with a row
scale, int4 in the project's packing with and without the repeat-2 split),
row counts on both sides of the int4 dequantize-tile threshold, against a
float64 product of the dequantized weight; for each instruction-set build this
machine can run (native, AVX2 without AVX-512, portable x86-64), so a wide
machine checks what a narrow one runs.
"""
from __future__ import annotations

import platform
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.model.kernels import cpu_kernels
from tokenmill.model.kernels.cpu_kernels import TmLinear, pack_int4

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not on PATH: the kernel cannot be built")

X86 = platform.machine().lower() in ("x86_64", "amd64")
BUILDS = ["native"] + (["avx2", "portable"] if X86 else [])


@pytest.fixture(scope="module", params=BUILDS)
def lib(request) -> cpu_kernels.KernelLibrary:
    """Each ISA build; a compile failure fails the tests (only a missing gcc skips).
    The avx2 build runs on any x86-64 CPU with AVX2: the test machine has it or
    its own native build is narrower still (then the flags change nothing)."""
    flags = cpu_kernels.ISA_FLAGS[request.param]
    if request.param == "native" and cpu_kernels.isa() in BUILDS[1:]:
        pytest.skip(f"TOKENMILL_KERNEL_ISA={cpu_kernels.isa()} makes the native build that one, tested as such")
    if request.param == "avx2" and "avx2" not in cpu_kernels._cpu_flags():
        pytest.skip("this CPU has no AVX2: the AVX2 build cannot run here")
    return cpu_kernels.build(flags)


def _desc(kind: int, n: int, k: int, keep: list[torch.Tensor], seed: int, repeat: int = 1,
          group: int = 32, bias: bool = False) -> tuple[TmLinear, torch.Tensor]:
    """A random layer of ``kind`` and the float64 weight [n, k] it stands for."""
    g = torch.Generator().manual_seed(seed)
    d = TmLinear()
    d.kind, d.n, d.k, d.repeat, d.group = kind, n, k, repeat, group
    if kind == cpu_kernels.W_INT4:
        kp = k * repeat
        codes = torch.randint(0, 16, (n, kp), generator=g, dtype=torch.uint8)
        scale = torch.rand(n, kp // group, generator=g) * 0.02 + 1e-3
        zero = torch.randn(n, kp // group, generator=g) * 0.01  # already z - 8 s: w = code * s + zero
        packed = pack_int4(codes)
        w = (codes.view(n, kp // group, group).double() * scale[..., None].double()
             + zero[..., None].double()).view(n, repeat, k).sum(1)
        keep += [packed, scale, zero]
        d.w, d.scale, d.zero = packed.data_ptr(), scale.data_ptr(), zero.data_ptr()
    elif kind == cpu_kernels.W_INT8:
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        scale = torch.rand(n, generator=g) * 0.01 + 1e-3
        w = q.double() * scale.double()[:, None]
        keep += [q, scale]
        d.w, d.scale = q.data_ptr(), scale.data_ptr()
    else:
        dtype = torch.float32 if kind == cpu_kernels.W_F32 else torch.bfloat16
        wt = (torch.randn(n, k, generator=g) * 0.05).to(dtype).contiguous()
        w = wt.double()
        keep.append(wt)
        d.w = wt.data_ptr()
    d.bias = None
    if bias:
        b = torch.randn(n, generator=g)
        keep.append(b)
        d.bias = b.data_ptr()
        w = (w, b.double())  # type: ignore[assignment]
    return d, w


def _check(lib, d: TmLinear, w, rows: int, seed: int) -> None:
    x = torch.randn(rows, d.k, generator=torch.Generator().manual_seed(seed))
    got = cpu_kernels.linear(d, x, library=lib)
    assert got is not None and got.shape == (rows, d.n) and got.dtype == torch.float32
    weight, bias = w if isinstance(w, tuple) else (w, None)
    want = x.double() @ weight.t()
    if bias is not None:
        want = want + bias
    # bf16 weights meet bf16-rounded activations on AVX512-BF16 CPUs (vdpbf16ps) from 2 rows;
    # AVX2 builds multiply int4 / int8 by int8-quantized activations below the dequantize-tile threshold.
    # (Random codes have a large common part that the zero term cancels: the activation
    # error of the code sum stays, relative to a smaller result.)
    tol = 1e-5
    if d.kind == cpu_kernels.W_BF16:
        tol = 1e-2
    elif d.kind in (cpu_kernels.W_INT4, cpu_kernels.W_INT8) and lib.q8_activations and rows < 8 and d.k % 32 == 0:
        tol = 8e-2  # random weights of both signs cancel: the activations' rounding stays, on a smaller sum
    err = float((got.double() - want).norm() / want.norm().clamp_min(1e-12))
    assert err < tol, (d.kind, rows, err)


KINDS = [cpu_kernels.W_F32, cpu_kernels.W_BF16, cpu_kernels.W_INT8, cpu_kernels.W_INT4]


@pytest.mark.parametrize("kind", KINDS, ids=["f32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("rows", [1, 5, 8, 13, 40])
def test_each_weight_kind_matches_float64(lib, kind: int, rows: int) -> None:
    keep: list[torch.Tensor] = []
    d, w = _desc(kind, 72, 128, keep, seed=rows, bias=rows == 5)
    _check(lib, d, w, rows, seed=rows + 100)


@pytest.mark.parametrize("rows", [1, 3, 9, 20])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_split_and_groups(lib, rows: int, group: int) -> None:
    """repeat 2 (GGUF Q8_0 as [hi | lo] codes) and every group size the layers take."""
    keep: list[torch.Tensor] = []
    d, w = _desc(cpu_kernels.W_INT4, 40, 256, keep, seed=group, repeat=2 if rows % 2 else 1, group=group)
    _check(lib, d, w, rows, seed=rows)


@pytest.mark.parametrize("kind", KINDS, ids=["f32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("rows", [1, 9, 70])
def test_output_does_not_depend_on_how_many_threads_share_it(lib, kind: int, rows: int) -> None:
    """Threads claim chunks of output rows as they go (whoever is free takes the next), so
    which thread computes a row changes from call to call: its values must not. Every
    thread count, each a different chunking, gives the same bits; a chunk computed twice
    or left out would not."""
    keep: list[torch.Tensor] = []
    d, _ = _desc(kind, 37 * 16 + 5, 128, keep, seed=rows, bias=True)
    x = torch.randn(rows, d.k, generator=torch.Generator().manual_seed(rows))
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3, 7):
            torch.set_num_threads(threads)
            outs.append(cpu_kernels.linear(d, x, library=lib))
    finally:
        torch.set_num_threads(before)
    assert all(o is not None for o in outs)
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 70), k_chunks=st.integers(1, 6), rows=st.integers(1, 30),
       kind=st.sampled_from(KINDS), seed=st.integers(0, 10_000))
def test_shapes_off_the_tile_grid(n: int, k_chunks: int, rows: int, kind: int, seed: int) -> None:
    """Output counts that are not a multiple of the vector width, any row count."""
    lib = cpu_kernels.build(cpu_kernels.ISA_FLAGS[cpu_kernels.isa()])
    keep: list[torch.Tensor] = []
    d, w = _desc(kind, n, 32 * k_chunks, keep, seed=seed)
    _check(lib, d, w, rows, seed=seed)


def test_refuses_what_it_cannot_take() -> None:
    lib = cpu_kernels.build(cpu_kernels.ISA_FLAGS[cpu_kernels.isa()])
    keep: list[torch.Tensor] = []
    d, _ = _desc(cpu_kernels.W_INT4, 16, 64, keep, seed=0)
    assert cpu_kernels.linear(d, torch.randn(2, 63), library=lib) is None  # wrong width
    assert cpu_kernels.linear(d, torch.randn(2, 64, dtype=torch.float64), library=lib) is None
    d.group = 48  # not a multiple of 32: the kernel says no, nothing is written
    assert cpu_kernels.linear(d, torch.randn(2, 64), library=lib) is None
    empty = cpu_kernels.linear(_desc(cpu_kernels.W_F32, 16, 64, keep, seed=1)[0], torch.randn(0, 64), library=lib)
    assert empty is not None and empty.shape == (0, 16)


def test_avx2_build_uses_integer_dot_products_for_int4() -> None:
    """The AVX2 build quantizes activations for int4 (close to float, not equal); the
    native AVX-512 and portable builds keep float32 activations (float rounding only)."""
    if not X86 or "avx2" not in cpu_kernels._cpu_flags():
        pytest.skip("needs an x86-64 CPU with AVX2")
    narrow = cpu_kernels.build(cpu_kernels.ISA_FLAGS["avx2"])
    assert narrow.q8_activations and narrow.q4_int8_dot
    portable = cpu_kernels.build(cpu_kernels.ISA_FLAGS["portable"])
    assert not portable.q8_activations and not portable.q4_int8_dot
    keep: list[torch.Tensor] = []
    d, w = _desc(cpu_kernels.W_INT4, 64, 256, keep, seed=3)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    got = cpu_kernels.linear(d, x, library=narrow)
    want = x.double() @ w.t()
    err = float((got.double() - want).norm() / want.norm())
    assert 1e-6 < err < 3e-2, err


def _q8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x as the AVX2 kernels quantize it: int8 per 32 columns, d = amax / 127, rounded half to
    even (lrintf), returned dequantized in float64."""
    rows, k = x.shape
    xb = x.view(rows, k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    d = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(xb * inv).double() * d.double()).view(rows, k)


@pytest.mark.parametrize("isa", ["avx2", "native"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 13, 70])  # every pass size of the 4-row (AVX2) and 6-row passes
@pytest.mark.parametrize("group,repeat", [(32, 1), (64, 2), (128, 1)])
def test_int4_nibble_packing_multiplies_int8_activations_exactly(isa: str, rows: int, group: int,
                                                                 repeat: int) -> None:
    """AVX2 builds (vpmaddubsw, each block's products added in 16 bits) and AVX-512 VNNI ones
    (vpdpbusd, 32 bits) multiply an int4 layer given in the nibble packing (pack_int4_q8) by
    int8 activations at every row count. Against the float64 product of the same quantized
    activations the error is float rounding only (codes at 15 and activations at +-127 are the
    sums' worst case); the float32 input itself is ~1% away."""
    if not X86 or "avx2" not in cpu_kernels._cpu_flags():
        pytest.skip("needs an x86-64 CPU with AVX2")
    narrow = cpu_kernels.build(cpu_kernels.ISA_FLAGS[isa])
    if not narrow.q4_int8_dot:
        pytest.skip(f"the {isa} build here keeps float32 activations for int4 (no VNNI)")
    keep: list[torch.Tensor] = []
    n, k = 5 * narrow.vector_width, 256  # 5 tiles: the kernel's pairs of tiles and a lone one
    d, (_, b) = _desc(cpu_kernels.W_INT4, n, k, keep, seed=rows, repeat=repeat, group=group, bias=True)
    codes = cpu_kernels.unpack_int4(keep[0])
    codes[: n // 2, : 2 * group] = 15  # the 16-bit sums' largest magnitude, on both signs of x
    keep[0].copy_(pack_int4(codes))
    kp = k * repeat
    scale, zero = keep[1], keep[2]
    wide = (codes.view(n, kp // group, group).double() * scale[..., None].double()
            + zero[..., None].double()).view(n, kp)  # [n, kp]: what the input fed `repeat` times meets
    packed = cpu_kernels.pack_int4_q8(codes, narrow.vector_width)
    scales, zeros = cpu_kernels.tile_major(scale, narrow.vector_width), cpu_kernels.tile_major(zero, narrow.vector_width)
    keep += [packed, scales, zeros]
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + 7))
    x[0, :32] = torch.linspace(-1, 1, 32)  # a block whose ends quantize to -127 and +127
    plain = cpu_kernels.linear(d, x, library=narrow)
    d.packed, d.packed_scale, d.packed_zero = packed.data_ptr(), scales.data_ptr(), zeros.data_ptr()
    got = cpu_kernels.linear(d, x, library=narrow)
    want = _q8_blocks(torch.cat([x] * repeat, 1)) @ wide.t() + b
    err = float((got.double() - want).norm() / want.norm())
    assert err < 1e-5, err
    exact = torch.cat([x] * repeat, 1).double() @ wide.t() + b
    if rows >= 8:  # without the packing: float32 tiles (below 8 rows, int4_q8_tile's int8 activations)
        assert float((plain.double() - exact).norm() / exact.norm()) < 1e-5
    assert 1e-4 < float((got.double() - exact).norm() / exact.norm()) < 5e-2


def test_isa_follows_torch_capability(monkeypatch) -> None:
    """ATEN_CPU_CAPABILITY=avx2 narrows the kernels too, unless TOKENMILL_KERNEL_ISA says otherwise."""
    monkeypatch.delenv("TOKENMILL_KERNEL_ISA", raising=False)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert cpu_kernels.isa() == "avx2"
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert cpu_kernels.isa() == "portable"
    monkeypatch.setenv("TOKENMILL_KERNEL_ISA", "native")
    assert cpu_kernels.isa() == "native"
    monkeypatch.setenv("TOKENMILL_KERNEL_ISA", "avx9000")
    with pytest.raises(ValueError, match="choose one of"):
        cpu_kernels.isa()


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 12, 13, 30])
@pytest.mark.parametrize("n", [16, 48, 80])
@pytest.mark.parametrize("mode", ["a8 from 5", "a16 from 2", "packed only: a8 from 5, a16 below"])
def test_int8_rows_use_integer_products_from_the_thresholds(lib, rows: int, n: int, mode: str) -> None:
    """An int8 layer with the VNNI packing: from a8_rows rows the activations are
    quantized per row to 8 bits (w8a8 layers), from a16_rows to 16 bits (two byte
    planes), and multiplied in int32, equal to that integer product up to float rounding
    of the scales; below both, or on a build without VNNI, weight-only int8 from the
    row-major codes (which a layer in the packing alone no longer has)."""
    keep: list[torch.Tensor] = []
    d, w = _desc(cpu_kernels.W_INT8, n, 128, keep, seed=n + rows, bias=rows == 13)
    q, scale = keep[0], keep[1]  # what _desc made the int8 layer of
    packed = cpu_kernels.pack_vnni(q, lib.vector_width)
    assert packed is not None
    sums = q.sum(dim=1, dtype=torch.int32)
    keep += [packed, sums]
    a8, a16 = {"a8 from 5": (5, 0), "a16 from 2": (0, 2)}.get(mode, (5, 1))
    d.a8_rows, d.a16_rows, d.packed, d.row_sums = a8, a16, packed.data_ptr(), sums.data_ptr()
    if mode.startswith("packed only"):
        d.w = None
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)) * 3
    got = cpu_kernels.linear(d, x, library=lib)
    if d.w is None and not lib.int8_dot:
        assert got is None  # nothing to read without VNNI: the caller's torch path takes it
        return
    weight, bias = w if isinstance(w, tuple) else (w, None)
    bits = 8 if a8 and rows >= a8 else 16 if a16 and rows >= a16 else 0
    if lib.int8_dot and bits:
        xs = x.double().abs().amax(dim=1, keepdim=True).float() / (127.0 if bits == 8 else 32767.0)
        xq = torch.round(x / xs).to(torch.int64)
        want = (xq @ q.to(torch.int64).t()).double() * xs.double() * scale.double()
    else:
        want = x.double() @ weight.t()
    if bias is not None:
        want = want + bias
    tol = 8e-2 if not (lib.int8_dot and bits) and lib.q8_activations and rows < 8 else 1e-5  # AVX2: q8_0-style
    err = float((got.double() - want).norm() / want.norm())
    assert err < tol, (rows, n, err)


def test_native_build_has_vnni_products_where_the_cpu_does() -> None:
    """Integer products wherever the build has AVX2: VNNI's where the CPU has it, else 16-bit
    ones; the portable build has none."""
    flags = cpu_kernels._cpu_flags()
    native = cpu_kernels.build(cpu_kernels.ISA_FLAGS["native"])
    isa = cpu_kernels.isa()  # TOKENMILL_KERNEL_ISA narrows every build of this process
    if isa == "portable" or not X86:
        assert not native.int8_dot
        return
    vnni = "avx_vnni" in flags or isa in ("native", "avx512") and "avx512_vnni" in flags and "avx512bw" in flags
    assert native.int8_dot == (vnni or "avx2" in flags)
    assert native.int8_dot_unit == ("VNNI" if vnni else "AVX2 16-bit" if native.int8_dot else "")
    assert not cpu_kernels.build(cpu_kernels.ISA_FLAGS["portable"]).int8_dot


def _int8_layer_outputs(library: cpu_kernels.KernelLibrary, x: torch.Tensor) -> list[torch.Tensor]:
    """Each integer-activation kind of int8 layer, packed for ``library``: per-channel int8
    at 8 and at 16 bits (two planes), int8g at 16 bits (the head's) and at 8 bits per 32
    inputs (the down projections'), with a bias."""
    from tokenmill.model.ops import ModelOps
    from tokenmill.model.quant.quant import Int8GroupLinear

    g = torch.Generator().manual_seed(7)
    n, k = 48, 160
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale, bias = torch.rand(n, generator=g) * 0.01 + 1e-3, torch.randn(n, generator=g)
    packed, sums = cpu_kernels.pack_vnni(q, library.vector_width), q.sum(dim=1, dtype=torch.int32)
    outs = []
    for a8, a16 in ((1, 1), (0, 1)):  # 8 bits at every row count; 16 bits
        d = TmLinear()
        d.kind, d.n, d.k, d.repeat, d.group, d.a8_rows, d.a16_rows = cpu_kernels.W_INT8, n, k, 1, 0, a8, a16
        d.w, d.scale, d.bias, d.packed, d.row_sums = (None, scale.data_ptr(), bias.data_ptr(), packed.data_ptr(),
                                                      sums.data_ptr())
        outs.append(cpu_kernels.linear(d, x, library=library))
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, 5] *= 30
    for dynamic in (False, True):
        layer = Int8GroupLinear.from_float(w, dynamic=dynamic)
        layer.ops = ModelOps(library=library)
        layer.prepare_kernels()
        assert layer.qweight is None  # in the packing
        outs.append(cpu_kernels.linear(layer.kernel_description(), x, library=library))
    return outs


@pytest.mark.parametrize("rows", [1, 3, 7, 13, 64])
def test_avx2_integer_products_equal_vnni_bit_for_bit(rows: int) -> None:
    """The AVX2 build (no VNNI) computes the VNNI path's int32 sums with 16-bit products and
    runs the same float epilogue, so every int8 layer kind gives the same bits on both:
    w8a8 means the same tokens on an AVX2 CPU as on one with VNNI."""
    flags = cpu_kernels._cpu_flags()
    if not (X86 and "avx512_vnni" in flags and "avx512bw" in flags) or cpu_kernels.isa() != "native":
        pytest.skip("needs a CPU with AVX512-VNNI, whose native build is the VNNI one")
    vnni = cpu_kernels.build(cpu_kernels.ISA_FLAGS["avx512"])
    avx2 = cpu_kernels.build(cpu_kernels.ISA_FLAGS["avx2"])
    assert vnni.int8_dot and avx2.int8_dot and avx2.vector_width == 8
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows)) * 3
    x[:, 7] *= 20
    for got_vnni, got_avx2 in zip(_int8_layer_outputs(vnni, x), _int8_layer_outputs(avx2, x)):
        assert torch.equal(got_vnni, got_avx2)


@pytest.mark.parametrize("rows", [1, 2, 5, 13, 30])
@pytest.mark.parametrize("n", [16, 48, 70])
def test_int8_with_a_scale_per_32_inputs_matches_its_float_product(lib, rows: int, n: int) -> None:
    """int8 weights with a scale per 32 inputs (GGUF Q8_0's layout, w8a8's LM head),
    widened to float32; requantizing values that already are such codes is exact."""
    from tokenmill.model.quant.quant import Int8GroupLinear

    g = torch.Generator().manual_seed(rows * 100 + n)
    layer = Int8GroupLinear.from_float(torch.randn(n, 128, generator=g) * 0.05)
    again = Int8GroupLinear.from_float(layer.dequantized_weight())
    assert torch.equal(again.qweight, layer.qweight) and torch.allclose(again.scales, layer.scales, rtol=1e-6)
    x = torch.randn(rows, 128, generator=g) * 3
    got = cpu_kernels.linear(layer.kernel_description(), x, library=lib)
    want = x.double() @ layer.dequantized_weight().double().t()
    assert float((got.double() - want).norm() / want.norm()) < 1e-5


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 13, 30])
@pytest.mark.parametrize("n", [16, 48, 70])
@pytest.mark.parametrize("dynamic", [False, True], ids=["a16", "a8g32"])
def test_int8_with_a_scale_per_32_inputs_in_the_vnni_packing(lib, rows: int, n: int, dynamic: bool) -> None:
    """Where the build has VNNI, prepare_kernels moves an int8g layer into the VNNI
    packing: lookups read the same codes back, and the product is the exact one of
    16-bit (per row) activations, or with ``dynamic`` 8-bit ones with a scale per row
    and 32 inputs, with the grouped weights, within float32 rounding. A shape that does
    not pack (70 rows) keeps the row-major codes and the float tile."""
    from tokenmill.model.ops import ModelOps
    from tokenmill.model.quant.quant import Int8GroupLinear

    g = torch.Generator().manual_seed(rows * 1000 + n)
    w = torch.randn(n, 128, generator=g) * 0.05
    w[:, 5] *= 30  # a column of large weights sets its groups' scales
    layer = Int8GroupLinear.from_float(w, dynamic=dynamic)
    codes, scales, table = layer.qweight.clone(), layer.scales.clone(), layer.dequantized_weight()
    layer.ops = ModelOps(library=lib)
    layer.prepare_kernels()
    packs = lib.int8_dot and n % lib.vector_width == 0
    assert (layer.qweight is None) == packs
    assert torch.equal(layer.codes(), codes) and torch.equal(layer.dequantized_weight(), table)
    ids = torch.tensor([0, n - 1, n // 2])
    assert torch.equal(layer.rows(ids), table[ids])
    x = torch.randn(rows, 128, generator=g) * 3
    x[:, 7] *= 20
    got = cpu_kernels.linear(layer.kernel_description(), x, library=lib)
    if packs and dynamic:  # a scale per row and 32 inputs (llama.cpp's Q8_0 activations)
        d = x.view(rows, 4, 32).abs().amax(dim=2, keepdim=True) / 127.0
        xq = torch.round(x.view(rows, 4, 32) / d).double()
        want = torch.einsum("bgi,ngi,ng,bg->bn", xq, codes.double().view(n, 4, 32), scales.double(),
                            d[..., 0].double())
    elif packs:
        d = x.double().abs().amax(dim=1, keepdim=True).float() / 32767.0
        xq = torch.round(x / d).double()
        want = torch.einsum("bgi,ngi,ng->bn", xq.view(rows, 4, 32), codes.double().view(n, 4, 32),
                            scales.double()) * d.double()
    else:
        want = x.double() @ table.double().t()
    assert float((got.double() - want).norm() / want.norm()) < 1e-6
    assert torch.allclose(layer(x), got)


@pytest.mark.parametrize("isa", ["avx2", "native"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 13])  # every pass size of the 4-row (AVX2) and 6-row passes
@pytest.mark.parametrize("group,fp16", [(32, True), (32, False), (64, True)])
def test_symmetric_int4_nibble_packing_reads_no_zeros(isa: str, rows: int, group: int, fp16: bool) -> None:
    """Layers whose zero is -8 x scale (GGUF Q4_0: w = d (q - 8)) are packed without zeros and,
    where their scales are fp16 values in groups of 32, with fp16 scales after each block's codes
    (int4_q8_form, inline_factors): the -8 is taken on each activation block's integer code sum.
    Against the float64 product of the same quantized activations the error is float rounding
    only, as with the general packing; both ISAs."""
    if not X86 or "avx2" not in cpu_kernels._cpu_flags():
        pytest.skip("needs an x86-64 CPU with AVX2")
    narrow = cpu_kernels.build(cpu_kernels.ISA_FLAGS[isa])
    if not narrow.q4_int8_dot:
        pytest.skip(f"the {isa} build here keeps float32 activations for int4 (no VNNI)")
    g = torch.Generator().manual_seed(rows + group)
    vw = narrow.vector_width
    n, k = 5 * vw, 256
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    codes[: n // 2, : 2 * group] = 15  # the sums' largest magnitude
    codes[n // 2:, : group] = 0  # and the offset's: every code at -8
    scale = torch.rand(n, k // group, generator=g) * 0.02 + 1e-3
    scale = scale.half().float() if fp16 else scale + 1e-9  # 1e-9: not fp16-exact
    zero = -8.0 * scale
    form, scales, zeros = cpu_kernels.int4_q8_form(scale, zero, group=group)
    inline = fp16 and group == 32
    assert zeros is None and form == cpu_kernels.Q4_SYMMETRIC | (cpu_kernels.Q4_F16 if inline else 0)
    assert scales.dtype == (torch.float16 if inline else torch.float32)
    packed = cpu_kernels.pack_int4_q8(codes, vw)
    if inline:
        packed, scales = cpu_kernels.inline_factors(packed, scales, None, vw), None
        assert packed.shape == (n // vw, k // 32, 18 * vw)
        back, no_zeros = cpu_kernels.inlined_factors(packed, vw, form)
        assert no_zeros is None and torch.equal(back, cpu_kernels.tile_major(scale.half(), vw))
    else:
        scales = cpu_kernels.tile_major(scales, vw)
    bias = torch.randn(n, generator=g)
    d = TmLinear()
    d.kind, d.n, d.k, d.repeat, d.group = cpu_kernels.W_INT4, n, k, 1, group
    wp = pack_int4(codes)
    d.w, d.scale, d.zero, d.bias = wp.data_ptr(), scale.data_ptr(), zero.data_ptr(), bias.data_ptr()
    d.packed, d.packed_zero, d.q4_form = packed.data_ptr(), None, form
    d.packed_scale = None if scales is None else scales.data_ptr()
    x = torch.randn(rows, k, generator=g)
    x[0, :32] = torch.linspace(-1, 1, 32)  # a block whose ends quantize to -127 and +127
    got = cpu_kernels.linear(d, x, library=narrow)
    w = ((codes.view(n, k // group, group).double() - 8.0) * scale[..., None].double()).view(n, k)
    want = _q8_blocks(x) @ w.t() + bias.double()
    err = float((got.double() - want).norm() / want.norm())
    assert err < 1e-5, err
    # the same layer through the general packing (zeros read) gives the same products within rounding
    full, zfull = cpu_kernels.tile_major(scale, vw), cpu_kernels.tile_major(zero, vw)
    plain = cpu_kernels.pack_int4_q8(codes, vw)  # the codes alone
    d.packed = plain.data_ptr()
    d.packed_scale, d.packed_zero, d.q4_form = full.data_ptr(), zfull.data_ptr(), 0
    general = cpu_kernels.linear(d, x, library=narrow)
    assert float((general.double() - want).norm() / want.norm()) < 1e-5


def test_int4_q8_form_keeps_zeros_and_float32_where_not_exact() -> None:
    """Asymmetric layers keep their zeros; values fp16 cannot hold keep float32."""
    s = torch.tensor([[0.5, 0.25]])
    form, scales, zeros = cpu_kernels.int4_q8_form(s, -8.0 * s + torch.tensor([[0.0, 0.125]]))
    assert form == cpu_kernels.Q4_F16 and zeros is not None and zeros.dtype == torch.float16
    form, scales, zeros = cpu_kernels.int4_q8_form(s, -8.0 * s + torch.tensor([[0.0, 0.125]]), group=128)
    assert form == 0 and zeros is not None and zeros.dtype == torch.float32  # fp16 in the tiles: groups of 32 only
    form, scales, zeros = cpu_kernels.int4_q8_form(s + 1e-7, -8.0 * (s + 1e-7))
    assert form == cpu_kernels.Q4_SYMMETRIC and zeros is None and scales.dtype == torch.float32
    form, _, zeros = cpu_kernels.int4_q8_form(s, torch.full_like(s, 1e6))  # zeros past fp16's range
    assert form == 0 and zeros is not None and zeros.dtype == torch.float32


@pytest.mark.parametrize("vector_width", [8, 16])
def test_five_bit_tiles_read_back_the_codes_exactly(vector_width: int) -> None:
    """Five-bit codes in the nibble packing with a fifth-bit vector a block (``pack_int4_q8``'s
    ``fifth``) read back exactly: their nibbles through ``untile_int4_q8``, their fifth bits
    through ``fifth_bits``, for every row or a selection of rows; the nibbles are the four-bit
    packing's, byte for byte."""
    n, k = 3 * vector_width, 96
    codes = torch.randint(0, 32, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(vector_width))
    tiles = cpu_kernels.pack_int4_q8(codes, vector_width, fifth=True)
    assert tiles is not None and tiles.shape == (3, k // 32, 20 * vector_width)
    four = cpu_kernels.pack_int4_q8(codes & 15, vector_width)
    assert torch.equal(tiles[:, :, :16 * vector_width], four.reshape(3, k // 32, 16 * vector_width))
    low = cpu_kernels.unpack_int4(cpu_kernels.untile_int4_q8(tiles, vector_width))
    assert torch.equal(low | (cpu_kernels.fifth_bits(tiles, vector_width) << 4), codes)
    rows = torch.tensor([0, n - 1, vector_width, 5, 5])
    low = cpu_kernels.unpack_int4(cpu_kernels.untile_int4_q8(tiles, vector_width, rows))
    assert torch.equal(low | (cpu_kernels.fifth_bits(tiles, vector_width, rows) << 4), codes[rows])
    # the documented bit: byte 4r + i of block c's fifth vector, bit s (4 + s) for input 4s + i (16 + 4s + i)
    r, c, s, i = 5, 2, 3, 1
    byte = int(tiles[r // vector_width, c, 16 * vector_width + 4 * (r % vector_width) + i])
    assert (byte >> s) & 1 == int(codes[r, 32 * c + 4 * s + i]) >> 4
    assert (byte >> (4 + s)) & 1 == int(codes[r, 32 * c + 16 + 4 * s + i]) >> 4


@pytest.mark.parametrize("isa", ["avx2", "native"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13])  # every pass size of the 4-row (AVX2) and 6-row passes
@pytest.mark.parametrize("type_name", ["Q5_0", "Q5_1", "Q5_K"])
def test_five_bit_codes_multiply_int8_activations_exactly(isa: str, rows: int, type_name: str) -> None:
    """GGUF's five-bit types as five-bit int4 layers (``Q4_FIFTH``: Q5_0 symmetric about 16,
    Q5_1 with fp16 offsets, Q5_K on its own factors) multiply int8 activations in the nibble
    kernel: against the float64 product of the same quantized activations the error is float
    rounding only, with codes of 31 against activations all at +127 (AVX2's 16-bit pair sums
    are widened every two steps: four would overflow) and at -127..127."""
    import numpy as np

    from gguf import GGMLQuantizationType as QT
    from gguf.quants import quantize as gguf_quantize
    from gguf_files import random_kquant_blocks
    from tokenmill.model.ops import ModelOps
    from tokenmill.model.quant.quant import Int4Linear, int4_from_gguf

    if not X86 or "avx2" not in cpu_kernels._cpu_flags():
        pytest.skip("needs an x86-64 CPU with AVX2")
    lib = cpu_kernels.build(cpu_kernels.ISA_FLAGS[isa])
    if not lib.q4_int8_dot:
        pytest.skip(f"the {isa} build here has no nibble kernel (no VNNI)")
    n, k = 3 * lib.vector_width, 512  # 3 tiles: a pair and a lone one
    rng = np.random.default_rng(rows)
    if type_name == "Q5_K":
        blocks = random_kquant_blocks("Q5_K", n, k, rng).reshape(n, 2, 176)
        blocks[: n // 2, 0, 16:] = 0xFF  # the first super-block's codes all 31 (fifth bits and nibbles)
    else:
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        # codes of 31 after the block's first weight (Q5_0's scale comes from its largest magnitude)
        w[: n // 2, 0], w[: n // 2, 1:32] = (0.0, 1.0) if type_name == "Q5_1" else (-1.0, 0.9375)
        blocks = gguf_quantize(w, getattr(QT, type_name))
    codes = int4_from_gguf(type_name, blocks.reshape(n, -1), (n, k), five_bit=True)
    assert codes.bits == 5 and bool((codes.codes[: n // 2, 1:32] == 31).all())
    layer = Int4Linear(codes)
    wide = codes.dequantize().double()
    layer.ops = ModelOps(library=lib)
    form = layer.kernel_description().q4_form
    assert form & cpu_kernels.Q4_FIFTH
    assert form == {"Q5_0": cpu_kernels.Q4_FIFTH | cpu_kernels.Q4_SYMMETRIC | cpu_kernels.Q4_F16,
                    "Q5_1": cpu_kernels.Q4_FIFTH | cpu_kernels.Q4_F16,
                    "Q5_K": cpu_kernels.Q4_FIFTH | cpu_kernels.Q4_KSCALES}[type_name]
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + 11))
    x[0, :32] = 1.0  # every activation of the block at +127
    if rows > 1:
        x[1, :32] = torch.linspace(-1, 1, 32)  # its ends at -127 and +127
    with torch.inference_mode():
        got = layer(x).double()
    want = _q8_blocks(x) @ wide.t()
    err = float((got - want).norm() / want.norm())
    assert err < 1e-5, err
    exact = x.double() @ wide.t()
    assert 1e-4 < float((got - exact).norm() / exact.norm()) < 5e-2
    layer.prepare_kernels()  # moved into the tiles: the same products
    with torch.inference_mode():
        assert torch.equal(layer(x).double(), got)

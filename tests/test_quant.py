"""Quantized linear layers: formats, kernels against their dequantized weights, GGUF blocks kept as they are."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.model.quant import quant
from tokenmill.model.loader import dequantize
from tokenmill.model.quant.quant import (
    Int4Codes,
    Int4Linear,
    Int8Linear,
    bf16_exact,
    int4_from_gguf,
    quantize_int4,
    quantize_int8,
)

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402


def _weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, 3] *= 8  # an outlier column, as real checkpoints have
    return w


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# --------------------------------------------------------------------------- formats


def test_bf16_exact_rounds_up_when_asked() -> None:
    t = torch.rand(10000) * 3e-3 + 1e-6
    up = bf16_exact(t, round_up=True)
    assert torch.equal(up.to(torch.bfloat16).float(), up)  # representable
    assert bool((up >= t).all())  # never smaller
    assert float(((up - t) / t).max()) <= 2.0**-7


def test_int8_round_trip_within_half_a_step() -> None:
    w = _weights(96, 320)
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    assert torch.equal(s.to(torch.bfloat16).float(), s)  # the kernel's bf16 scale is exact
    err = (quant.dequantize_int8(q, s) - w).abs()
    assert bool((err <= s[:, None] / 2 + 1e-7).all())
    assert float(err.max()) > 0  # it is a real quantization


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_round_trip_within_half_a_step(group: int) -> None:
    w = _weights(64, 256)
    c = quantize_int4(w, group)
    assert c.codes.dtype == torch.uint8 and int(c.codes.max()) <= 15
    err = (c.dequantize() - w).abs().view(64, 256 // group, group)
    bound = c.scales / 2 + c.zeros.abs() * 2.0**-8 + 1e-7  # the zero point is rounded to bf16
    assert bool((err <= bound[..., None]).all())
    # a coarser grid loses more
    assert _rel(c.dequantize(), w) > _rel(quantize_int8(w)[0].float() * quantize_int8(w)[1][:, None], w)


def test_int4_group_that_does_not_divide_is_refused() -> None:
    with pytest.raises(ValueError, match=r"576 = 4.5 x 128.*32 or 64"):
        quant.check_int4_group("layers.0.self_attn.o_proj", 576, 128)
    with pytest.raises(ValueError, match="one of"):
        quant.check_int4_group("x", 576, 48)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_become_int4_codes_bit_for_bit(qtype: str) -> None:
    w = _weights(64, 192, seed=1).numpy()
    raw = gguf_quantize(w, QT[qtype])
    want = torch.from_numpy(dequantize(raw, qtype, w.shape))
    codes = int4_from_gguf(qtype, raw, w.shape)
    assert codes.group_size == 32 and codes.repeat == (2 if qtype == "Q8_0" else 1)
    assert torch.equal(codes.dequantize(), want)  # no re-quantization
    # The layer rounds d (and m) from fp16 to bf16 for the kernel: a small, bounded change,
    # far below what re-quantizing the dequantized weights would cost.
    layer = Int4Linear(codes)
    native = _rel(layer.dequantized_weight(), want)
    requant = _rel(quantize_int4(want, 32).dequantize(), want)
    assert native < 4e-3
    if qtype != "Q8_0":
        assert native < requant / 2


def test_split_codes_and_row_concatenation() -> None:
    w8 = _weights(32, 64, seed=2).numpy()
    w4 = _weights(32, 64, seed=3).numpy()
    a = int4_from_gguf("Q8_0", gguf_quantize(w8, QT.Q8_0), w8.shape)
    b = int4_from_gguf("Q4_1", gguf_quantize(w4, QT.Q4_1), w4.shape)
    fused = Int4Codes.cat_rows([b, a])  # mixed types: both become the split form
    assert fused.repeat == 2
    assert torch.equal(fused.dequantize(), torch.cat([b.dequantize(), a.dequantize()]))


# --------------------------------------------------------------------------- layers


ROWS = [1, 3, 16, 40, 130]  # weight-only kernels, the int8/int4 crossovers, the dequantize path


@pytest.mark.parametrize("rows", ROWS)
def test_int8_linear_matches_its_dequantized_weight(rows: int) -> None:
    w = _weights(192, 320)
    bias = torch.randn(192)
    layer = Int8Linear.from_float(w, bias)
    assert layer.weight_only_ok  # the CPU kernel is there and agrees
    x = torch.randn(rows, 320)
    want = F.linear(x, layer.dequantized_weight(), bias)
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert _rel(got, want) < 1e-2
    assert torch.equal(layer(x), got)  # deterministic
    assert _rel(layer.dequantized_weight(), w) < 3e-2  # an outlier column widens every row's step


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", ROWS)
def test_int4_linear_matches_its_dequantized_weight(group: int, rows: int) -> None:
    w = _weights(128, 256)
    layer = Int4Linear.from_float(w, group)
    assert layer.layout == "nibbles" and layer.unpack_ok  # the project's packing, on every CPU
    x = torch.randn(2, rows, 256)  # leading dims are kept
    want = x @ layer.dequantized_weight().t()
    got = layer(x)
    assert got.shape == (2, rows, 128)
    assert _rel(got, want) < 1e-2
    assert torch.equal(layer.dequantized_weight(), quantize_int4(w, group).dequantize())


def test_kernel_and_dequantize_paths_agree(monkeypatch) -> None:
    w = _weights(128, 256)
    x = torch.randn(8, 256)
    i4, i8 = Int4Linear.from_float(w, 32), Int8Linear.from_float(w)
    monkeypatch.setattr(quant, "POLICY", quant.KernelPolicy(int8_weight_only_max_rows=100, int4_kernel_max_rows=100))
    kernel4, kernel8 = i4(x), i8(x)
    monkeypatch.setattr(quant, "POLICY", quant.KernelPolicy(int8_weight_only_max_rows=0, int4_kernel_max_rows=0))
    assert _rel(i4(x), kernel4) < 1e-2 and _rel(i8(x), kernel8) < 1e-2


def test_w8a8_dynamic_activations_are_close_but_not_identical() -> None:
    w = _weights(128, 256)
    x = torch.randn(64, 256)
    wo, dyn = Int8Linear.from_float(w), Int8Linear.from_float(w, dynamic=True)
    assert dyn.dynamic
    ref = x @ wo.dequantized_weight().t()
    assert _rel(dyn(x), ref) < 3e-2
    assert not torch.equal(dyn(x), wo(x))  # int8 activations really ran
    assert torch.equal(dyn(x[:1]), wo(x[:1]))  # one row: weight-only kernel for both


def test_int4_without_the_c_kernels_dequantizes_per_matmul(monkeypatch) -> None:
    """With the C kernels off (no gcc, TOKENMILL_CPU_KERNELS=0) every row count takes the
    unpack + dense path, with the same result as the kernel within rounding."""
    w = _weights(96, 128)
    codes = quantize_int4(w, 32)
    layer = Int4Linear(codes)
    assert layer.layout == "nibbles" and layer.packed.shape == (96, 64)
    x = torch.randn(5, 128)
    with_kernel = layer(x)
    monkeypatch.setenv("TOKENMILL_CPU_KERNELS", "0")
    without = layer(x)
    assert _rel(without, x @ codes.dequantize().t()) < 1e-2
    assert _rel(with_kernel, without) < 1e-2
    ids = torch.tensor([0, 95, 7, 7])
    assert torch.allclose(layer.rows(ids), codes.dequantize()[ids])


def test_int4_packing_round_trips_and_is_the_kernels_order() -> None:
    """pack_int4: in each 32-column chunk byte i holds code i (low) and code i + 16 (high)."""
    from tokenmill.model.kernels.cpu_kernels import pack_int4, unpack_int4

    codes = torch.randint(0, 16, (7, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = pack_int4(codes)
    assert packed.shape == (7, 48)
    assert int(packed[2, 3]) == int(codes[2, 3]) | (int(codes[2, 19]) << 4)
    assert int(packed[4, 16 + 5]) == int(codes[4, 32 + 5]) | (int(codes[4, 32 + 21]) << 4)
    assert torch.equal(unpack_int4(packed), codes)


def test_rows_read_back_for_a_tied_embedding() -> None:
    w = _weights(192, 64)
    ids = torch.tensor([0, 31, 32, 63, 64, 100, 191, 5])
    i4 = Int4Linear.from_float(w, 32)
    assert torch.equal(i4.rows(ids), i4.dequantized_weight()[ids])
    i8 = Int8Linear.from_float(w)
    assert torch.equal(i8.rows(ids), i8.dequantized_weight()[ids])
    split = Int4Linear(int4_from_gguf("Q8_0", gguf_quantize(w.numpy(), QT.Q8_0), tuple(w.shape)))
    assert split.repeat == 2
    assert torch.allclose(split.rows(ids), split.dequantized_weight()[ids], atol=1e-6)
    x = torch.randn(3, 64)
    assert _rel(split(x), x @ split.dequantized_weight().t()) < 1e-2


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q8_0", "g64", "Q5_K", "Q5_0", "Q5_1"])
def test_int4_layers_move_into_the_kernel_tiles(kind: str) -> None:
    """Where the kernels multiply the nibble packing by int8 activations, prepare_kernels
    moves an int4 layer's codes and factors into the tiles and drops the row-major copy:
    the products are the ones before the move, bit for bit, the weights and a tied
    embedding's rows read back out of the tiles (the same values, the zero within one
    float32 rounding), and the layer holds its weights once. Elsewhere nothing moves."""
    import numpy as np

    from gguf_files import random_kquant_blocks
    from tokenmill.model.kernels import cpu_kernels
    from tokenmill.model.ops import ModelOps

    lib = cpu_kernels.load()
    n, k = 64, 512
    w = _weights(n, k, seed=9)
    if kind in ("Q4_K", "Q5_K"):
        codes = int4_from_gguf(kind, random_kquant_blocks(kind, n, k, np.random.default_rng(2)), (n, k))
    elif kind == "g64":
        codes = quantize_int4(w, 64)
    else:  # Q5_0 / Q5_1 as five-bit codes (Q4_FIFTH)
        codes = int4_from_gguf(kind, gguf_quantize(w.numpy(), getattr(QT, kind)), (n, k), five_bit=True)
    assert codes.bits == (5 if kind.startswith("Q5") else 4)
    layer = Int4Linear(codes)
    table = layer.dequantized_weight()
    layer.ops = ModelOps(library=lib)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        before = [layer(x[:r]) for r in (1, 5)]
    assert _rel(before[1], x @ table.t()) < 2e-2  # the kernel's products are the layer's (int8 activations)
    bytes_before = sum(b.numel() * b.element_size() for b in layer.buffers())
    layer.prepare_kernels()
    moves = lib is not None and bool(lib.q4_int8_dot)
    assert (layer.tiles_vw is not None) == moves
    if not moves:
        return
    assert layer.scales is None and layer.zeros is None and layer.fifth is None
    inline = bool(layer.q4_form & cpu_kernels.Q4_F16)  # fp16 factors after each block's codes
    assert inline == (kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")) and (layer.tile_scales is None) == inline
    assert layer.packed.dim() == (3 if codes.bits == 5 or inline else 4)
    assert bool(layer.q4_form & cpu_kernels.Q4_FIFTH) == (codes.bits == 5)
    held = sum(b.numel() * b.element_size() for b in layer.buffers())
    assert held <= bytes_before
    bits = 8.0 * held / (n * k)
    assert bits <= {"Q4_0": 4.5, "Q4_1": 5.0, "Q4_K": 4.63, "Q8_0": 10.0, "g64": 5.0, "Q5_K": 5.63, "Q5_0": 5.5,
                    "Q5_1": 6.0}[kind], bits
    with torch.inference_mode():
        after = [layer(x[:r]) for r in (1, 5)]
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    got = layer.dequantized_weight()
    assert torch.allclose(got, table, rtol=0, atol=float(table.abs().max()) * 2**-20)
    ids = torch.tensor([0, 15, 16, 63, 17, 0])
    assert torch.equal(layer.rows(ids), got[ids])
    layer.prepare_kernels()  # binding again changes nothing
    with torch.inference_mode():
        assert torch.equal(layer(x[:5]), before[1])


def test_dequantize_path_is_safe_across_threads() -> None:
    """Scratch buffers are per thread: two engines stepping in two threads get their own."""
    import threading

    layers = [Int4Linear.from_float(_weights(512, 512, seed=s), 32) for s in (1, 2)]
    xs = [torch.randn(100, 512) for _ in layers]  # 100 rows: the unpack + dense path
    want = [m(x) for m, x in zip(layers, xs)]
    bad: list[int] = []

    def work(i: int) -> None:
        for _ in range(30):
            if not torch.equal(layers[i](xs[i]), want[i]):
                bad.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad


def test_q8_0_blocks_become_int8_groups_bit_for_bit() -> None:
    w = _weights(48, 96, seed=4).numpy()
    raw = gguf_quantize(w, QT.Q8_0)
    q, d = quant.int8g_from_gguf(raw, w.shape)
    assert q.dtype == torch.int8 and q.shape == (48, 96) and d.shape == (48, 3)
    layer = quant.Int8GroupLinear(q, d)
    assert torch.equal(layer.dequantized_weight(), torch.from_numpy(dequantize(raw, "Q8_0", w.shape)))

"""Weight-only int8 / int4 linear layers, and GGUF blocks served as they are.

Kernels. Weight-only kernels win at decode sizes and grow linearly with rows;
past ``KernelPolicy``'s thresholds a layer dequantizes into a shared scratch
buffer and runs one dense matmul, in bf16 where the CPU multiplies bf16
natively and in float32 elsewhere (``dense_dtype``; oneDNN emulates bf16 on
AVX2 several times slower than float32). int4 on the CPU uses the project's
own packing and C kernel (``cpu_kernels.pack_int4``, ``tm_linear``), the same
on every instruction set: torch's CPU int4pack changes layout with its ISA
dispatch, so weights packed for it could not be read back (for a tied
embedding, or by the fused decode step) on every machine; where the build
multiplies int4 codes by int8 activations (AVX2) the layer also hands it a
tile-major copy of the codes (``cpu_kernels.pack_int4_q8``) and the kernel
takes every row count, no dense matmul. int8 uses torch's
weight-only kernel with bf16 activations. Dynamic int8 activations are the
fastest at large batch but cost accuracy, so they are a separate mode,
``w8a8``. docs/performance.md has the measurements behind these choices.

On CUDA the tinygemm int4 kernel and the int8 weight-only kernel are tried
once per layer shape against the dequantized weight; where a kernel is
missing or disagrees, layers dequantize and matmul.

Formats. int8: symmetric, one scale per output channel. int4: asymmetric,
one (scale, zero) pair per group of input columns, ``w = (code - 8) * s + z``.
Scales are rounded to bf16 *before* the codes are chosen, so a kernel's bf16
scales are exact. GGUF: Q4_0 is ``s = d, z = 0``, Q4_1 is ``s = d, z = m + 8d``
(codes kept bit for bit; the CPU packing of a layer whose zeros are all 0, as
Q4_0's, reads no zeros and keeps fp16 scales, inside the tiles after each block's
codes: ``cpu_kernels.int4_q8_form``, ``inline_factors``); Q8_0 has a scale per 32 columns, which no int8
kernel takes, so each code ``q = 16*hi + lo`` is split into two int4 codes and
the layer multiplies ``[x, x]`` by ``[W_hi | W_lo]`` with the int4 kernel:
the same 8.5 bits per weight, no re-quantization.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ...settings.config import QUANTIZATION_MODES
from ..ops import TORCH_OPS, ModelOps, bind_ops
from .quant_linear import QuantLinearBase as _QuantLinear

log = logging.getLogger("tokenmill.quant")

MODES = QUANTIZATION_MODES
W8A8_WEIGHT_ONLY_LAST_LAYERS = 2  # w8a8: these last decoder layers keep float activations
# w8a8: these projections never take 8-bit activations with one scale per token. The down
# projection's input, SiLU(gate) * up, has the widest outliers, and rounding it so cost most
# of w8a8's next-token agreement on the bundled model (docs/quantization.md). Where the
# kernels have VNNI (one process) they are Int8GroupLinear with 8-bit activations per 32
# inputs, which kept the agreement and halves their integer work; elsewhere weight-only.
W8A8_WEIGHT_ONLY_PROJECTIONS = ("down_proj",)  # the dense MLP's and each expert's
INT4_GROUP_SIZES = (32, 64, 128)
COMPUTE_DTYPE = torch.bfloat16


def _one_process_kernels_have(config: Any, capability: str) -> bool:
    """Whether a single-process model's C kernels (built for ``config.kernel_options``) have
    ``capability``, a ``KernelLibrary`` flag: ``int8_dot`` (int8 by int8 activations: VNNI,
    or AVX2's 16-bit products of the same sums), ``q4_int8_dot`` (int4 codes in the nibble
    packing by int8 activations: ``int4_q8_rows``)."""
    from ..kernels import cpu_kernels

    if int(getattr(config, "tensor_parallel_size", 1) or 1) != 1:
        return False
    library = cpu_kernels.load(getattr(config, "kernel_options", None))
    return library is not None and bool(getattr(library, capability))


@dataclass
class KernelPolicy:
    """Which kernel runs for how many rows (tokens in the step)."""

    int8_weight_only_max_rows: int = 20  # <= : _weight_int8pack_mm; above: dequantize + dense bf16
    int8_dynamic_min_rows: int = 5  # w8a8 layers without VNNI: int8 activations + _int_mm from this many rows
    int4_kernel_max_rows: int = 96  # <= : int4 kernel; above: unpack + dense bf16


POLICY = KernelPolicy()


_DENSE_DTYPE: dict[str, torch.dtype] = {}


def dense_dtype(device: torch.device) -> torch.dtype:
    """The dtype a quantized layer dequantizes into for a dense matmul (many rows):
    bf16 on CUDA and on CPUs that multiply bf16 natively, float32 elsewhere, where
    oneDNN emulates bf16 several times slower than float32. Decided once per device type."""
    kind = torch.device(device).type
    if kind not in _DENSE_DTYPE:
        if kind == "cpu":
            from ..kernels.cpu_kernels import native_bf16

            _DENSE_DTYPE[kind] = torch.bfloat16 if native_bf16() else torch.float32
        else:
            _DENSE_DTYPE[kind] = torch.bfloat16
    return _DENSE_DTYPE[kind]


# --------------------------------------------------------------------------- formats


def bf16_exact(t: torch.Tensor, round_up: bool = False) -> torch.Tensor:
    """Float32 values representable in bf16 (rounded up in magnitude when asked,
    so a scale never shrinks and no weight clips)."""
    b = t.float().to(torch.bfloat16)
    if round_up:
        short = b.float().abs() < t.float().abs()
        bumped = (b.view(torch.int16) + 1).view(torch.bfloat16)  # next magnitude up (sign-magnitude bits)
        b = torch.where(short, bumped, b)
    return b.float()


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 codes [N, K], float32 scales [N], bf16-exact)."""
    w = w.float()
    scale = bf16_exact(w.abs().amax(dim=1) / 127.0, round_up=True).clamp_min(2.0**-100)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()[:, None]


@dataclass
class Int4Codes:
    """Unpacked int4 weights: ``w = (codes - 8) * scales + zeros`` group-wise.

    ``repeat == 2`` is the Q8_0 split: the K columns are ``[hi | lo]`` halves
    of an input that the layer feeds twice; the logical weight is their sum.
    ``bits == 5``: five-bit codes (0..31, GGUF Q5_0 / Q5_1 / Q5_K), which the nibble kernel
    reads as a nibble and a fifth bit (``cpu_kernels.Q4_FIFTH``); repeat 1 only.
    """

    codes: torch.Tensor  # uint8 [N, K], values 0..15 (0..31 with bits 5)
    scales: torch.Tensor  # float32 [N, K // group]
    zeros: torch.Tensor  # float32 [N, K // group]
    group_size: int
    repeat: int = 1
    # Q4_K's own factors of those (group 32, repeat 1): per 256-weight super-block d and dmin
    # (float16 [N, K // 256] each), per group sc and m (uint8 [N, K // 32] each), scales = d sc
    # and zeros - 8 scales = -dmin m: the nibble kernel reads these, 4.6 bits a weight in all.
    kscales: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    bits: int = 4

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        g = self.group_size
        c = self.codes.view(n, k // g, g).float() - 8.0
        w = (c * self.scales[..., None] + self.zeros[..., None]).reshape(n, k)
        return w.view(n, self.repeat, k // self.repeat).sum(1) if self.repeat > 1 else w

    def as_split(self) -> "Int4Codes":
        """The repeat-2 form: a zero high half in front of these codes."""
        if self.repeat == 2:
            return self
        if self.bits != 4:
            raise ValueError("five-bit codes have no split form beside a repeat-2 part")
        hi = torch.full_like(self.codes, 8)
        return Int4Codes(torch.cat([hi, self.codes], 1), torch.cat([torch.ones_like(self.scales), self.scales], 1),
                         torch.cat([torch.zeros_like(self.zeros), self.zeros], 1), self.group_size, 2)

    @staticmethod
    def cat_rows(parts: list["Int4Codes"]) -> "Int4Codes":
        """Stack along the output dimension (fused q/k/v, gate/up)."""
        if len({p.group_size for p in parts}) != 1:
            raise ValueError("cannot fuse int4 tensors with different group sizes")
        if len({p.repeat for p in parts}) != 1:
            parts = [p.as_split() for p in parts]
        kscales = None
        if all(p.kscales is not None for p in parts):
            kscales = tuple(torch.cat([p.kscales[i] for p in parts]) for i in range(4))  # type: ignore[index]
        return Int4Codes(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                         torch.cat([p.zeros for p in parts]), parts[0].group_size, parts[0].repeat,
                         kscales, max(p.bits for p in parts))  # type: ignore[arg-type]  # four-bit codes are five-bit ones


def check_int4_group(name: str, in_features: int, group_size: int) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if in_features % group_size:
        fits = [g for g in INT4_GROUP_SIZES if in_features % g == 0]
        raise ValueError(
            f"int4 group size {group_size} does not divide the input size {in_features} of {name} "
            f"({in_features} = {in_features / group_size:g} x {group_size}); use --quant-group-size "
            f"{' or '.join(map(str, fits)) or '(none fits)'}")


def quantize_int4(w: torch.Tensor, group_size: int) -> Int4Codes:
    """[N, K] float -> asymmetric int4 codes, min/max per group, bf16-exact scales and zeros."""
    n, k = w.shape
    check_int4_group("this tensor", k, group_size)
    wg = w.float().reshape(n, k // group_size, group_size)
    lo, hi = torch.aminmax(wg, dim=-1)
    scale = bf16_exact((hi - lo) / 15.0, round_up=True).clamp_min(2.0**-100)
    zero = bf16_exact(lo + 8.0 * scale)
    t = (wg - zero[..., None]).mul_((1.0 / scale)[..., None]).add_(8.0)
    codes = t.round_().clamp_(0, 15).to(torch.uint8)
    return Int4Codes(codes.reshape(n, k), scale, zero, group_size)


def _gguf_blocks(blocks: Any, rows: int, k: int, nbytes: int) -> torch.Tensor:
    arr = np.ascontiguousarray(np.asarray(blocks)).view(np.uint8).reshape(rows, k // 32, nbytes)
    return torch.from_numpy(arr.copy())


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    return b[..., at : at + 2].contiguous().view(torch.float16).squeeze(-1).float()


def int8g_from_gguf(blocks: Any, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw GGUF Q8_0 rows -> (int8 codes [rows, k], float32 scales [rows, k / 32]): the
    block's own codes and scale, for :class:`Int8GroupLinear` (no re-quantization)."""
    rows, k = shape
    b = _gguf_blocks(blocks, rows, k, 34)
    return b[..., 2:].contiguous().view(torch.int8).reshape(rows, k), _f16(b, 0)


def q5_from_gguf(type_name: str, blocks: Any, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor,
                                                                              torch.Tensor | None]:
    """Raw GGUF Q5_0 / Q5_1 rows -> (5-bit codes 0..31 as uint8 [rows, k], the blocks' scales d
    [rows, k / 32], their offsets m for Q5_1 or None): w = d * (q - 16) (Q5_0), d * q + m (Q5_1).
    Weight i of a block takes its low nibble from byte i % 16 of the nibbles (low half first)
    and its fifth bit from bit i of the 32-bit word before them."""
    rows, k = shape
    off = 2 if type_name == "Q5_0" else 4
    b = _gguf_blocks(blocks, rows, k, off + 20)
    qh = b[..., off : off + 4].contiguous().view(torch.int32)  # [rows, k / 32, 1], little-endian
    fifth = (qh >> torch.arange(32, dtype=torch.int32)) & 1
    packed = b[..., off + 4 :]
    low = torch.cat([packed & 0x0F, packed >> 4], dim=-1)
    codes = (low.to(torch.int32) | (fifth << 4)).to(torch.uint8).reshape(rows, k)
    return codes, _f16(b, 0), _f16(b, 2) if type_name == "Q5_1" else None


def int8g_from_q5_0(blocks: Any, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw GGUF Q5_0 rows -> (int8 codes q - 16, in -16..15, [rows, k]; scales [rows, k / 32]):
    exactly the blocks' weights in :class:`Int8GroupLinear`'s (Q8_0's) layout."""
    codes, d, _ = q5_from_gguf("Q5_0", blocks, shape)
    return (codes.to(torch.int16) - 16).to(torch.int8), d


def int4_from_gguf(type_name: str, blocks: Any, shape: tuple[int, ...], five_bit: bool = False) -> Int4Codes:
    """Raw GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K rows ``[rows, bytes_per_row]`` ->
    int4 codes, group 32 (5- and 8-bit codes as two nibble planes fed the same input, ``repeat``
    2, or with ``five_bit`` five-bit codes as they are, ``bits`` 5; Q4_K's and Q5_K's 32-weight
    sub-blocks each with its own scale and offset, Q5_K always five-bit). The convention: w =
    sum over planes of (code - 8) * scale + zero."""
    rows, k = shape
    if type_name in ("Q5_0", "Q5_1") and five_bit:  # w = d (q - 16), or d q + m
        q, d, m = q5_from_gguf(type_name, blocks, shape)
        return Int4Codes(q, d, -8.0 * d if m is None else m + 8.0 * d, 32, bits=5)
    if type_name in ("Q5_0", "Q5_1"):  # q = 16 hi + lo, hi in {0, 1}
        q, d, m = q5_from_gguf(type_name, blocks, shape)
        hi, lo = q >> 4, q & 15
        # (hi - 8) 16d + z_hi + (lo - 8) d + z_lo = 16d hi + d lo - 136d + z_hi + z_lo
        z_hi = 112.0 * d if m is None else 128.0 * d  # Q5_0 wants -16d in all: 112d + 8d - 136d
        z_lo = 8.0 * d if m is None else 8.0 * d + m
        return Int4Codes(torch.cat([hi, lo], 1), torch.cat([16.0 * d, d], 1), torch.cat([z_hi, z_lo], 1), 32, 2)
    if type_name in ("Q4_0", "Q4_1"):
        off = 2 if type_name == "Q4_0" else 4
        b = _gguf_blocks(blocks, rows, k, off + 16)
        d = _f16(b, 0)
        packed = b[..., off:]
        codes = torch.cat([packed & 0x0F, packed >> 4], dim=-1).reshape(rows, k)  # low nibbles first
        zero = torch.zeros_like(d) if type_name == "Q4_0" else _f16(b, 2) + 8.0 * d
        return Int4Codes(codes, d, zero, 32)
    if type_name in ("Q4_K", "Q5_K"):  # w = s q + o per 32 weights, s = d sc and o = -dmin m (exact in float32)
        from .kquant import q45k_fields

        q, d, dmin, sc, m = (torch.from_numpy(a) for a in q45k_fields(type_name, blocks, shape))
        s = d.float().repeat_interleave(8, 1) * sc.float()
        o = -(dmin.float().repeat_interleave(8, 1) * m.float())
        return Int4Codes(q, s, o + 8.0 * s, 32, kscales=(d, dmin, sc, m), bits=5 if type_name == "Q5_K" else 4)
    if type_name == "Q8_0":
        codes, d = int8g_from_gguf(blocks, shape)
        q = codes.view(rows, k // 32, 32).to(torch.int16)
        hi = (torch.div(q, 16, rounding_mode="floor") + 8).to(torch.uint8).reshape(rows, k)
        lo = (q & 15).to(torch.uint8).reshape(rows, k)
        return Int4Codes(torch.cat([hi, lo], 1), torch.cat([16.0 * d, d], 1),
                         torch.cat([torch.zeros_like(d), 8.0 * d], 1), 32, 2)
    raise ValueError(f"GGUF type {type_name} has no native kernel (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K do)")


# --------------------------------------------------------------------------- layers


_VERIFIED: dict[tuple[Any, ...], bool] = {}


def _kernel_works(key: tuple[Any, ...], fn: Callable[[torch.Tensor], torch.Tensor],
                  ref: Callable[[], torch.Tensor], rows: int, cols: int, device: torch.device) -> bool:
    """Run a low-precision kernel once against the dequantized reference: a kernel
    missing on this device, or with another packing convention, is not used.
    The verdict is remembered per kernel and shape (packing depends on nothing else)."""
    if key in _VERIFIED:
        return _VERIFIED[key]
    gen = torch.Generator(device=device).manual_seed(0)  # leave the global RNG alone
    x = torch.randn(rows, cols, generator=gen, device=device).to(COMPUTE_DTYPE)
    try:
        got = fn(x).float()
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        got = None
    ok = False
    if got is not None:
        want = x.float() @ ref().t()
        ok = bool(torch.isfinite(got).all()) and float((got - want).norm() / want.norm().clamp_min(1e-6)) < 2e-2
    _VERIFIED[key] = ok
    return ok


_SCRATCH = threading.local()  # per thread: engines stepping in two threads never share a buffer


def _scratch(name: str, device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A reusable flat buffer per purpose, device and dtype, grown on demand."""
    bufs: dict[tuple[str, str, torch.dtype], torch.Tensor] = _SCRATCH.__dict__.setdefault("bufs", {})
    key = (name, str(device), dtype)
    buf = bufs.get(key)
    if buf is None or buf.numel() < numel:
        # A normal (not inference) tensor: one made under inference_mode could not be
        # written in place by a later call made outside it, and the reverse is allowed.
        with torch.inference_mode(False):
            buf = torch.empty(numel, dtype=dtype, device=device)
        bufs[key] = buf
    return buf[:numel]


class _VnniCodes:
    """The int8 codes of a layer that keeps them either row-major (``qweight``) or, once the
    engine bound C kernels with VNNI, only in their packing (``vnni_packed``, [N / VW, K / 4,
    VW, 4]: ``cpu_kernels.pack_vnni``)."""

    qweight: torch.Tensor | None
    vnni_packed: torch.Tensor | None
    in_features: int

    def codes(self) -> torch.Tensor:
        """The int8 codes [N, K], row-major (read back out of the VNNI packing once that
        holds them)."""
        if self.qweight is not None:
            return self.qweight
        t, k4, vw, four = self.vnni_packed.shape
        return self.vnni_packed.permute(0, 2, 1, 3).reshape(t * vw, k4 * four)

    def row_codes(self, ids: torch.Tensor) -> torch.Tensor:
        """The codes of rows ``ids`` [len(ids), K] (a tied embedding's lookup)."""
        if self.qweight is not None:
            return self.qweight[ids]
        vw = self.vnni_packed.shape[2]  # row r lives in tile r // VW at lane r % VW, 4 columns per group
        return self.vnni_packed[ids // vw, :, ids % vw].reshape(ids.shape[0], self.in_features)


class Int8Linear(_VnniCodes, _QuantLinear):
    """int8 weights, one bf16-exact scale per output channel.

    Where the engine's C kernels have VNNI, ``prepare_kernels`` moves the codes into the
    VNNI packing (``cpu_kernels.pack_vnni``) and drops the row-major copy: every step
    then runs in the C kernels, eager or fused, on integer activations: 8 bits per token
    for w8a8 layers, else 16 bits as two byte planes (within float32 rounding of the float
    product; docs/quantization.md). The width does not depend on how many rows a step
    has, and every row is computed on its own, so a request's tokens are the same
    whatever else shares its steps (alone or in a burst). Without VNNI, the torch path
    takes 8 bits only from ``int8_dynamic_min_rows`` (``_int_mm``'s fixed cost).
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 dynamic: bool = False) -> None:
        super().__init__(q.shape[1], q.shape[0], bias)
        self.register_buffer("qweight", q.contiguous())  # None once the VNNI packing holds the codes
        self.register_buffer("vnni_packed", None, persistent=False)
        self.register_buffer("scales", scale.to(COMPUTE_DTYPE).contiguous())
        key, ref, dev = (q.device.type, *q.shape), self.dequantized_weight, q.device
        self.weight_only_ok = _kernel_works(("int8", *key), self._weight_only, ref, 2, self.in_features, dev)
        self.dynamic = dynamic and dev.type == "cpu" and _kernel_works(
            ("int8-dynamic", *key), self._dynamic, ref, 32, self.in_features, dev)
        self._vnni: Any = None  # (TmLinear, buffers it points into): vnni_description

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None, dynamic: bool = False) -> "Int8Linear":
        return cls(*quantize_int8(w), bias, dynamic)

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_int8(self.codes(), self.scales)

    def _weight_only(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.codes(), self.scales)

    def _dynamic(self, x: torch.Tensor) -> torch.Tensor:
        """int8 activations (a scale per token) x int8 weights, accumulated in int32; the
        activations are quantized from the caller's values and the result scaled in
        float32, with no bf16 rounding on either side (each costs agreement with the
        float model on top of the int8 rounding itself)."""
        xf = x.float()
        xs = xf.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
        xq = torch.round(xf / xs).to(torch.int8)
        acc = torch._int_mm(xq, self.codes().t())
        return acc.float() * xs * self.scales.float()

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self._vnni is not None and x.device.type == "cpu":  # the C kernels, as in the fused step
            from ..kernels.cpu_kernels import linear

            y = linear(self._vnni[0], x.float().contiguous(), self.ops.library)
            if y is not None:
                return y
        rows = x.shape[0]
        if self.dynamic and rows >= POLICY.int8_dynamic_min_rows:
            return self._dynamic(x)
        x = x.to(COMPUTE_DTYPE)
        if self.weight_only_ok and rows <= POLICY.int8_weight_only_max_rows:
            return self._weight_only(x)
        codes = self.codes()
        n, k = codes.shape
        dense = dense_dtype(x.device)
        w = _scratch("wbf", x.device, dense, n * k).view(n, k).copy_(codes)
        return F.linear(x.to(dense), w.mul_(self.scales[:, None].to(dense)))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows (a tied embedding looks tokens up here)."""
        return self.row_codes(ids).float() * self.scales[ids].float()[:, None]

    def vnni_description(self) -> Any:
        """The C kernels' ``TmLinear`` for this layer in the VNNI packing, or None before
        ``prepare_kernels`` made it (or where it cannot be: no VNNI, another device, a
        shape that does not pack)."""
        return self._vnni[0] if self._vnni is not None else None

    def prepare_kernels(self) -> None:
        """With C kernels that have VNNI: move the codes into their packing (once, when the
        engine binds its kernels, so that the engine's weight count sees it)."""
        from ..kernels import cpu_kernels

        library = self.ops.library
        if self._vnni is not None or library is None or not library.int8_dot or self.qweight.device.type != "cpu":
            return
        q = self.qweight
        packed = cpu_kernels.pack_vnni(q, library.vector_width)
        if packed is None:
            return
        d = cpu_kernels.TmLinear()
        scales = self.scales.float().contiguous()
        sums = q.sum(dim=1, dtype=torch.int32).contiguous()
        d.kind, d.n, d.k, d.repeat, d.group = cpu_kernels.W_INT8, q.shape[0], q.shape[1], 1, 0
        d.w, d.scale, d.row_sums, d.packed = None, scales.data_ptr(), sums.data_ptr(), packed.data_ptr()
        d.bias = None  # forward adds it (the fused step sets its own)
        d.a8_rows = 1 if self.dynamic else 0  # 8 bits at every row count: see the class docstring
        d.a16_rows = 1
        self.vnni_packed = packed
        self.qweight = None
        self._vnni = (d, (scales, sums))


class Int8GroupLinear(_VnniCodes, _QuantLinear):
    """int8 weights with a float32 scale per 32 inputs of each row: GGUF's Q8_0 layout,
    so a Q8_0 tensor (SmolLM2's token table) keeps its exact values at one byte a
    weight. w8a8 stores an unquantized LM head this way on the CPU: a single stream
    reads the head's bytes every token (a fifth of a small model's), and a scale per
    row there costs next-token agreement (a few rows of large weights set it;
    docs/quantization.md).

    Where the engine's C kernels have VNNI, ``prepare_kernels`` moves the codes into the
    VNNI packing, as :class:`Int8Linear` does, and the kernels multiply them by 16-bit
    activations (two byte planes, a scale per row), or with ``dynamic`` by 8-bit ones with
    a scale per 32 inputs (as llama.cpp quantizes activations for Q8_0; w8a8's down
    projections), scaling each group's int32 sum in float32; elsewhere they widen the codes
    to float32.
    """

    GROUP = 32

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 dynamic: bool = False) -> None:
        super().__init__(q.shape[1], q.shape[0], bias)
        self.register_buffer("qweight", q.contiguous())  # None once the VNNI packing holds the codes
        self.register_buffer("vnni_packed", None, persistent=False)
        self.register_buffer("scales", scale.float().contiguous())  # [N, K / 32]
        self.dynamic = dynamic  # VNNI: 8-bit activations with a scale per 32 inputs (else 16 bits per row)
        self._desc: Any = None  # (TmLinear, buffers it points into), made on first use or by prepare_kernels

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None,
                   dynamic: bool = False) -> "Int8GroupLinear":
        w = w.detach().float()
        n, k = w.shape
        if k % cls.GROUP:
            raise ValueError(f"{k} input features are not whole groups of {cls.GROUP}")
        blocks = w.view(n, k // cls.GROUP, cls.GROUP)
        scale = (blocks.abs().amax(dim=2) / 127.0).clamp_min(1e-30)
        q = torch.round(blocks / scale[..., None]).clamp_(-127, 127).to(torch.int8).view(n, k)
        return cls(q, scale, bias, dynamic)

    def _expand(self, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return (q.float().view(q.shape[0], -1, self.GROUP) * scales[..., None]).view(q.shape[0], -1)

    def dequantized_weight(self) -> torch.Tensor:
        return self._expand(self.codes(), self.scales)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows (a tied embedding looks tokens up here)."""
        return self._expand(self.row_codes(ids), self.scales[ids])

    def kernel_description(self) -> Any:
        """The C kernels' ``TmLinear`` for this layer (pointers into its buffers): the
        VNNI packing once ``prepare_kernels`` made it, else the row-major codes."""
        from ..kernels import cpu_kernels

        if self._desc is None:
            d = cpu_kernels.TmLinear()
            d.kind, d.n, d.k, d.repeat, d.group = cpu_kernels.W_INT8G, self.out_features, self.in_features, 1, 0
            d.w, d.scale, d.bias = self.qweight.data_ptr(), self.scales.data_ptr(), None
            self._desc = (d, ())
        return self._desc[0]

    def prepare_kernels(self) -> None:
        """With C kernels that have VNNI: move the codes into their packing, with the
        scales and each group's code sums tiled the same way (once, when the engine
        binds its kernels)."""
        from ..kernels import cpu_kernels

        library = self.ops.library
        if (self.qweight is None or library is None or not library.int8_dot
                or self.qweight.device.type != "cpu"):
            return
        q = self.qweight
        vw = library.vector_width
        packed = cpu_kernels.pack_vnni(q, vw)
        if packed is None:
            return
        n, k = q.shape
        groups = k // self.GROUP

        def tiled(per_group: torch.Tensor) -> torch.Tensor:
            """[N, groups] -> [N / VW, groups, VW]: one vector load gives a group's values for a tile."""
            return per_group.view(n // vw, vw, groups).transpose(1, 2).contiguous()

        offsets = tiled(q.view(n, groups, self.GROUP).sum(dim=2, dtype=torch.int32) * -128)
        scales = tiled(self.scales)
        d = cpu_kernels.TmLinear()
        d.kind, d.n, d.k, d.repeat, d.group = cpu_kernels.W_INT8G, n, k, 1, 0
        d.w, d.scale, d.row_sums, d.packed = None, scales.data_ptr(), offsets.data_ptr(), packed.data_ptr()
        d.bias = None  # forward adds it (the fused step sets its own)
        d.a8_rows, d.a16_rows = (1 if self.dynamic else 0), 1
        self.vnni_packed = packed
        self.qweight = None
        self._desc = (d, (scales, offsets))

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops.library is not None and x.device.type == "cpu":
            from ..kernels.cpu_kernels import linear

            y = linear(self.kernel_description(), x.float().contiguous(), self.ops.library)
            if y is not None:
                return y
        return F.linear(x.float(), self.dequantized_weight()).to(x.dtype)


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """uint8 0 / 1 [N, K] (K % 8 == 0) -> [N, K / 8] bytes, bit j of byte i holding column 8 i + j."""
    n, k = bits.shape
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=bits.device)
    return (bits.reshape(n, k // 8, 8).to(torch.uint8) * weights).sum(2, dtype=torch.uint8).contiguous()


def _unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_pack_bits`."""
    n, kb = packed.shape
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed[:, :, None] >> shifts) & 1).reshape(n, kb * 8)


class Int4Linear(_QuantLinear):
    """int4 weights with group-wise (scale, zero): ``w = (code - 8) * s + z``.

    ``layout``: "nibbles" on the CPU and any device without a native kernel: the
    project's own packing (:func:`cpu_kernels.pack_int4`), identical on every CPU,
    multiplied by the C kernel (``tm_linear``, float32 activations) up to
    ``POLICY.int4_kernel_max_rows`` rows and unpacked into one dense matmul above
    that (or everywhere when the C kernels are off); on AVX2 and AVX-512 VNNI builds the
    kernel multiplies int8 activations at every row count, from a second, tile-major copy
    of the codes (``kernel_description``); "tinygemm" on CUDA, torch's
    packed int4 kernel where it agrees with the dequantized weight.

    Five-bit codes (``Int4Codes.bits`` 5: GGUF Q5_0, Q5_1, Q5_K) keep their fifth bits beside
    the nibbles (``fifth``, a bit a weight) and run on the C kernels only where those multiply
    the nibble packing by int8 activations (``kernel_takes``); elsewhere they are unpacked.
    """

    def __init__(self, codes: Int4Codes, bias: torch.Tensor | None = None) -> None:
        n, kp = codes.codes.shape
        super().__init__(kp // codes.repeat, n, bias)
        self.group_size, self.repeat, self.bits = codes.group_size, codes.repeat, codes.bits
        if self.bits == 5 and (self.repeat != 1 or self.group_size != 32):
            raise ValueError("five-bit int4 codes take repeat 1 and groups of 32")
        dev = codes.codes.device
        self.register_buffer("scales", codes.scales.float().contiguous())  # [N, K' // group]
        self.register_buffer("zeros", codes.zeros.float().contiguous())
        ks = codes.kscales if codes.repeat == 1 and codes.group_size == 32 else None
        for name, t in zip(("k_d", "k_dmin", "k_sc", "k_m"), ks or (None,) * 4):
            self.register_buffer(name, None if t is None else t.contiguous())  # Q4_K's factors (Int4Codes.kscales)
        self.layout = "nibbles"
        if dev.type == "cuda" and self.bits == 4:
            packed = self._tinygemm_pack(codes.codes)
            if packed is not None:
                sz = torch.stack([codes.scales.t(), codes.zeros.t()], -1).to(torch.bfloat16).contiguous()
                self.register_buffer("packed", packed)
                self.register_buffer("scale_zeros", sz)  # [K' // group, N, 2], tinygemm's layout
                self.layout = "tinygemm"
                if not _kernel_works(("int4", "tinygemm", n, kp, self.group_size, self.repeat),
                                     self._kernel_matmul, codes.dequantize, 2, self.in_features, dev):
                    self.layout = "nibbles"
        self.unpack_ok = self.layout == "nibbles"
        if self.unpack_ok:
            from ..kernels.cpu_kernels import pack_int4

            self.register_buffer("packed", pack_int4(codes.codes & 15))
        # five-bit codes' fifth bits, eight weights a byte in input order (bit j: weight 8 i + j)
        self.register_buffer("fifth", _pack_bits(codes.codes >> 4) if self.bits == 5 else None)
        self._desc: Any = None  # the C kernel's description of this layer, made on first use
        # Set once prepare_kernels has moved the codes into the kernel's tiles (their vector
        # width): ``packed`` then holds cpu_kernels.pack_int4_q8's layout (with each block's fp16
        # factors after its codes where ``q4_form`` has Q4_F16), ``tile_scales`` and ``tile_zeros``
        # the other forms' factors as int4_q8_rows reads them, and the row-major
        # codes, scales and zeros are gone: one copy of the weights.
        self.tiles_vw: int | None = None
        self.q4_form = 0

    @classmethod
    def from_float(cls, w: torch.Tensor, group_size: int, bias: torch.Tensor | None = None) -> "Int4Linear":
        return cls(quantize_int4(w, group_size), bias)

    @staticmethod
    def _tinygemm_pack(codes: torch.Tensor) -> torch.Tensor | None:
        n, kp = codes.shape
        tiles = next((t for t in (8, 4, 2) if kp % (t * 16) == 0), None)
        if tiles is None:
            return None
        try:
            as_bytes = ((codes[:, 0::2] << 4) | codes[:, 1::2]).to(torch.uint8)  # even column high nibble
            try:
                return torch._convert_weight_to_int4pack(as_bytes.contiguous(), tiles)
            except RuntimeError:  # older torch took int32 codes
                return torch._convert_weight_to_int4pack(codes.to(torch.int32).contiguous(), tiles)
        except (RuntimeError, NotImplementedError, AttributeError):
            return None

    def _kernel_matmul(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(COMPUTE_DTYPE)
        if self.repeat == 2:
            x = torch.cat([x, x], dim=1)
        return torch._weight_int4pack_mm(x, self.packed, self.group_size, self.scale_zeros)

    def kernel_description(self) -> Any:
        """The C kernels' ``TmLinear`` for this layer (pointers into its buffers; the
        fused decode step takes the same one)."""
        from ..kernels import cpu_kernels

        library = self.ops.library
        if self.tiles_vw is not None:  # moved into the tiles (prepare_kernels): no row-major copy left
            if not self._tiles_fit(library):
                raise RuntimeError(f"this int4 layer's codes are in tiles of {self.tiles_vw} rows; the bound kernels "
                                   "take another width or none")
            return self._desc[0]
        if not self.kernel_takes(library):
            raise RuntimeError("this int4 layer's five-bit codes need the kernels that multiply the nibble packing "
                               "by int8 activations (AVX2, AVX-512 VNNI), in whole tiles")
        many_rows = library is not None and library.q4_int8_dot
        # Made again only when the bound library first wants the nibble copy; a layer whose shape
        # does not pack is not retried on every call.
        if self._desc is None or (many_rows and not self._desc[2]):
            d = cpu_kernels.TmLinear()
            zero = (self.zeros - 8.0 * self.scales).contiguous()  # w = code * s + (z - 8 s)
            d.kind, d.group, d.repeat = cpu_kernels.W_INT4, self.group_size, self.repeat
            d.n, d.k = self.out_features, self.in_features
            d.w, d.scale, d.zero = self.packed.data_ptr(), self.scales.data_ptr(), zero.data_ptr()
            d.bias = None
            keep: tuple[torch.Tensor, ...] = (zero,)  # the derived buffers live as long as the description
            if many_rows:  # AVX2, AVX-512 VNNI: int8 activations at every row count, in the nibble packing
                vw = library.vector_width
                packed = cpu_kernels.pack_int4_q8(self._codes(), vw, fifth=self.bits == 5)
                if packed is not None:
                    if self.k_d is not None:  # Q4_K's / Q5_K's own factors: 4.6 / 5.6 bits a weight
                        form, zeros = cpu_kernels.Q4_KSCALES | (cpu_kernels.Q4_FIFTH if self.bits == 5 else 0), None
                        scales = cpu_kernels.pack_kscales(self.k_d, self.k_dmin, self.k_sc, self.k_m, vw)
                    else:  # symmetric / fp16 where exact (int4_q8_form): fewer bytes a step
                        form, scales, zeros = cpu_kernels.int4_q8_form(self.scales, zero, self.bits, self.group_size)
                        if form & cpu_kernels.Q4_F16:  # in the tiles, after each block's codes
                            packed, scales, zeros = cpu_kernels.inline_factors(packed, scales, zeros, vw), None, None
                        else:
                            scales = cpu_kernels.tile_major(scales, vw)
                            zeros = None if zeros is None else cpu_kernels.tile_major(zeros, vw)
                    d.packed, d.q4_form = packed.data_ptr(), form
                    d.packed_scale = None if scales is None else scales.data_ptr()
                    d.packed_zero = None if zeros is None else zeros.data_ptr()
                    keep += (packed, scales, zeros)
            self._desc = (d, keep, many_rows)
        return self._desc[0]

    def prepare_kernels(self) -> None:
        """Where the bound C kernels multiply the nibble packing by int8 activations (AVX2,
        AVX-512 VNNI): move the codes and factors into the tiles they read (once, when the
        engine binds its kernels) and drop the row-major copy, so that the layer holds its
        weights once (4.5 bits a weight for Q4_0, 4.6 for Q4_K; the eager path, the fused step
        and every row count read the tiles)."""
        library = self.ops.library
        if (self.tiles_vw is not None or library is None or not library.q4_int8_dot or not self.unpack_ok
                or self.packed.device.type != "cpu"):
            return
        d = self.kernel_description()
        if not d.packed:
            return
        _, keep, _ = self._desc
        tiles, scales, zeros = keep[1:4]
        self.packed = tiles
        self.register_buffer("tile_scales", scales)  # None with Q4_F16: the factors are in the tiles
        self.register_buffer("tile_zeros", zeros)
        for name in ("scales", "zeros", "k_d", "k_dmin", "k_sc", "k_m", "fifth"):
            setattr(self, name, None)
        self.tiles_vw, self.q4_form = library.vector_width, int(d.q4_form)
        d.w, d.scale, d.zero = None, None, None  # int4_q8_rows reads only the tiles
        self._desc = (d, (tiles, scales, zeros), True)

    def _tiles_fit(self, library: Any) -> bool:
        """Whether ``library`` runs this layer's tiles (its nibble kernel, at their width)."""
        return library is not None and bool(library.q4_int8_dot) and library.vector_width == self.tiles_vw

    def kernel_takes(self, library: Any) -> bool:
        """Whether ``library``'s kernels can run this layer (``kernel_description``): its tiles'
        width where it has moved into them; five-bit codes only through the nibble kernel (the
        others read four bits a weight), in whole tiles; without a library, the description of the
        row-major codes every build reads."""
        if self.tiles_vw is not None:
            return self._tiles_fit(library)
        if self.bits == 5:
            return library is not None and bool(library.q4_int8_dot) and self.out_features % library.vector_width == 0
        return True

    def _kernel_rows(self, rows: int) -> bool:
        """Whether the C kernel multiplies ``rows`` activation rows (else: unpack + dense matmul):
        up to the policy's limit, and at any count where the build multiplies int4 codes by
        int8 activations in the nibble packing (AVX2, AVX-512 VNNI)."""
        lib = self.ops.library
        if lib is None or not self.kernel_takes(lib):
            return False
        if self.tiles_vw is not None or self.bits == 5:
            return True
        return rows <= POLICY.int4_kernel_max_rows or bool(lib.q4_int8_dot and self.kernel_description().packed)

    def _row_major_bytes(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The codes in pack_int4's row-major bytes [N, K' / 2], or the rows ``ids`` picks:
        the buffer itself, or read back out of the tiles (a row lives in tile r // VW at lane
        r % VW; the tiles hold the same bytes per row, reordered)."""
        if self.tiles_vw is None:
            return self.packed if ids is None else self.packed[ids]
        from ..kernels.cpu_kernels import untile_int4_q8

        return untile_int4_q8(self.packed, self.tiles_vw, ids)

    def _codes(self, out: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 codes [N, K'] (or the rows ``rows`` picks) back out of the packed buffers (into
        ``out`` when given), five-bit ones with their fifth bits."""
        from ..kernels.cpu_kernels import fifth_bits, unpack_int4

        if not self.unpack_ok:
            raise RuntimeError("tinygemm's int4 packing cannot be read back")
        codes = unpack_int4(self._row_major_bytes(rows), out)
        if self.bits == 5:
            if self.tiles_vw is not None:
                high = fifth_bits(self.packed, self.tiles_vw, rows)
            else:
                high = _unpack_bits(self.fifth if rows is None else self.fifth[rows])
            codes |= high << 4
        return codes

    def _factors(self, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 (scales, zeros) [N, G] of ``w = (code - 8) s + z``, or the rows ``rows``
        picks: the buffers, or derived from the kernel's tiled factors once they hold them."""
        if self.tiles_vw is None:
            return (self.scales, self.zeros) if rows is None else (self.scales[rows], self.zeros[rows])
        from ..kernels.cpu_kernels import Q4_F16, Q4_KSCALES, Q4_SYMMETRIC, inlined_factors

        vw = self.tiles_vw

        def per_row(tiled: torch.Tensor) -> torch.Tensor:  # [tiles, G, VW] -> [N, G] or [len(rows), G]
            if rows is None:
                return tiled.permute(0, 2, 1).reshape(-1, tiled.shape[1])
            return tiled[rows // vw, :, rows % vw]

        if self.q4_form & Q4_KSCALES:  # [tiles, S, 20 VW] bytes: d, dmin (fp16), then 8 groups' sc, m
            kb = self.tile_scales
            t, sb = kb.shape[:2]

            def field(a: int, b: int, dtype: torch.dtype) -> torch.Tensor:
                return kb[:, :, a * vw:b * vw].contiguous().view(dtype).float()

            d, dmin = field(0, 2, torch.float16), field(2, 4, torch.float16)  # [tiles, S, VW]
            sc = field(4, 12, torch.uint8).view(t, sb, 8, vw)
            m = field(12, 20, torch.uint8).view(t, sb, 8, vw)
            s = per_row((d[:, :, None] * sc).reshape(t, sb * 8, vw))
            o = -per_row((dmin[:, :, None] * m).reshape(t, sb * 8, vw))
            return s, o + 8.0 * s  # as int4_from_gguf computes them
        scales, zeros = (inlined_factors(self.packed, vw, self.q4_form) if self.q4_form & Q4_F16
                         else (self.tile_scales, self.tile_zeros))
        s = per_row(scales).float()
        offset = 16.0 if self.bits == 5 else 8.0  # Q4_SYMMETRIC's codes - offset
        kernel_zero = -offset * s if self.q4_form & Q4_SYMMETRIC else per_row(zeros).float()
        return s, kernel_zero + 8.0 * s

    def _dequant(self, codes: torch.Tensor, rows: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """(codes - 8) * s + z in float32 for all rows, or for the rows ``rows`` picks;
        into ``out`` when given (the repeat-2 halves are then left unsummed)."""
        s, z = self._factors(rows)
        s, z = s[..., None], z[..., None]  # [rows, G, 1]
        n, kp = codes.shape
        g = self.group_size
        w = torch.mul(codes.view(n, kp // g, g), s, out=None if out is None else out.view(n, kp // g, g))
        w = w.add_(z - 8.0 * s).view(n, kp)
        if out is not None or self.repeat == 1:
            return w
        return w.view(n, self.repeat, self.in_features).sum(1)

    def dequantized_weight(self) -> torch.Tensor:
        if self.unpack_ok:
            return self._dequant(self._codes())
        eye = torch.eye(self.in_features, device=self.packed.device, dtype=COMPUTE_DTYPE)
        return self._kernel_matmul(eye).float().t().contiguous()  # the kernel itself reads it out

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "tinygemm":
            return self._kernel_matmul(x)
        if self._kernel_rows(x.shape[0]):
            from ..kernels.cpu_kernels import linear

            y = linear(self.kernel_description(), x.float().contiguous(), self.ops.library)
            if y is not None:
                return y
        # Unpack into shared scratch buffers: fresh multi-MB tensors on every call cost more in
        # page faults than the arithmetic.
        n, kp = self.out_features, self.in_features * self.repeat
        codes = self._codes(_scratch("codes", x.device, torch.uint8, n * kp).view(n, kp))
        w32 = self._dequant(codes, out=_scratch("w32", x.device, torch.float32, n * kp))
        dense = dense_dtype(x.device)
        w = w32 if dense == torch.float32 else _scratch("wbf", x.device, dense, n * kp).view(n, kp).copy_(w32)
        x = x.to(dense)
        if self.repeat == 2:
            x = torch.cat([x, x], dim=1)
        return F.linear(x, w.view(n, kp))

    def rows(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Dequantized rows for an embedding lookup; None when the packing is opaque."""
        if not self.unpack_ok:
            return None
        return self._dequant(self._codes(rows=ids), ids)


class QuantizedEmbedding(nn.Module):
    """Token lookup through a tied, quantized LM head: one copy of the table."""

    def __init__(self, head: Int8Linear | Int4Linear | Int8GroupLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.head = head
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = self.head.rows(flat)
        assert rows is not None
        return rows.to(self.dtype).reshape(*ids.shape, self.head.in_features)


# --------------------------------------------------------------------------- the model


@dataclass
class QuantReport:
    """What quantize_model did, for the startup log and the eval's JSON."""

    mode: str
    quantized: dict[str, str] = field(default_factory=dict)  # module -> format
    kept: dict[str, str] = field(default_factory=dict)  # module -> why it stayed dense
    shared_embedding: bool = False
    token_table: str = ""  # how an untied token table is held, where not dense ("Q4_K blocks")

    def summary(self) -> str:
        formats = sorted(set(self.quantized.values()))
        text = f"quantization={self.mode}: {len(self.quantized)} linear layers as {', '.join(formats) or '-'}"
        if self.kept:
            text += f"; {len(self.kept)} kept dense ({next(iter(self.kept.values()))})"
        if self.shared_embedding:
            text += "; tied embedding reads the quantized LM head"
        if self.token_table:
            text += f"; token table kept in its {self.token_table}"
        return text


_SOURCES = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def _targets(model: nn.Module, with_head: bool) -> list[tuple[str, nn.Linear, tuple[str, ...]]]:
    """(module name, module, checkpoint weight names it was fused from); a mixture of
    experts' projections are each expert's (its router stays in float: it picks experts)."""
    out: list[tuple[str, nn.Linear, tuple[str, ...]]] = []
    for i, layer in enumerate(model.layers):  # type: ignore[attr-defined]
        experts = getattr(layer.mlp, "experts", None)
        paths = dict(_SOURCES)
        if experts is not None:
            for path in ("mlp.gate_up_proj", "mlp.down_proj"):
                sources = paths.pop(path)
                for j in range(len(experts)):
                    paths[path.replace("mlp.", f"mlp.experts.{j}.")] = tuple(
                        s.replace("mlp.", f"mlp.experts.{j}.") for s in sources)
        for path, sources in paths.items():
            mod = layer.get_submodule(path)
            out.append((f"layers.{i}.{path}", mod, tuple(f"model.layers.{i}.{s}.weight" for s in sources)))
    if with_head:
        out.append(("lm_head", model.lm_head, (_head_source(model),)))
    return out


def _block_layer_kind(kinds: set[str], device: torch.device, nibble_kernel: bool) -> str | None:
    """What ``gguf`` rebuilds a layer stored in ``kinds`` blocks as: "kquant" (the blocks as
    they are), "int8 groups" (Q5_0 with Q8_0 beside it, and Q5_0 alone without the nibble
    kernel), "int4" (Q4_0/Q4_1/Q5_1/Q8_0 as nibble planes, and Q4_K/Q5_K where the C kernels
    multiply the nibble packing by int8 activations: ``nibble_kernel``), "int4 five-bit"
    (Q5_0/Q5_1, alone or beside Q4_0/Q4_1, there: a nibble and a fifth bit a weight, 5.5 or 6
    bits read where int8 groups read 8.5 and nibble planes 9); None where it stays a dense
    layer (K-quants mixed with other types, or K-quants off the CPU).

    Q4_K and Q5_K as int4 layers: their 32-weight sub-blocks are the int4 kernels' groups
    (their own factors kept, ``Int4Codes.kscales``: 4.6 / 5.6 bits a weight read where the
    blocks hold 4.5 / 5.5), which run prefill on int8 products and decode one tile's rows at a
    time; the blocks as they are (kquant.c) widen tiles for prefill and reduce each row
    across its lanes in decode (docs/performance.md, "K-quant files at real sizes"). Q6_K has
    a scale per 16 weights, no such group: it keeps its blocks (and its own tiles)."""
    from .kquant import KQUANT_TYPES

    on_cpu = device.type == "cpu"
    if kinds <= {"Q4_K", "Q5_K"} and nibble_kernel and on_cpu:
        return "int4"
    if kinds <= set(KQUANT_TYPES):
        return "kquant" if on_cpu else None
    if kinds & set(KQUANT_TYPES):
        return None
    if kinds & {"Q5_0", "Q5_1"} and kinds <= {"Q4_0", "Q4_1", "Q5_0", "Q5_1"} and nibble_kernel and on_cpu:
        return "int4 five-bit"
    if "Q5_0" in kinds and kinds <= {"Q5_0", "Q8_0"} and on_cpu:
        return "int8 groups"
    return "int4"


def block_backed_layers(model: nn.Module, loaded: Any, config: Any,
                        device: torch.device) -> dict[str, tuple[str, ...]]:
    """Decoder projections that ``quantize_model`` will rebuild from the file's blocks
    (``--quantization gguf``): their dense weights need never be made, so the model can
    leave them on meta and load them as meta (``CheckpointWeights.deferring``). Module
    name -> the checkpoint weights it is made from. The LM head is not among them (its
    choice depends on how it is tied)."""
    raw = getattr(loaded, "raw_quantized", None) or {}
    if str(config.quantization or "none").lower() != "gguf" or not raw:
        return {}
    nibble_kernel = _one_process_kernels_have(config, "q4_int8_dot")
    out = {name: sources for name, _, sources in _targets(model, False)
           if all(s in raw for s in sources) and _block_layer_kind({raw[s][0] for s in sources}, device, nibble_kernel)}
    if device.type != "cpu":
        return out
    table = "model.embed_tokens.weight"
    has_head = "lm_head.weight" in raw or "lm_head.weight" in (getattr(loaded, "weights", None) or {})
    in_features = model.lm_head.in_features  # type: ignore[attr-defined]
    if bool(model.config.tie_word_embeddings) or not has_head:
        # one table for both: the head built from its blocks, the lookups reading the head's rows
        if _head_keeps_blocks(raw.get(table, ("",))[0], config, in_features):
            out["lm_head"] = out["embed_tokens"] = (table,)
        return out
    if _head_keeps_blocks(raw.get("lm_head.weight", ("",))[0], config, in_features):
        out["lm_head"] = ("lm_head.weight",)
    if _table_keeps_blocks(raw.get(table, ("",))[0], config):
        out["embed_tokens"] = (table,)
    return out


def _kscales_int4_layer(type_name: str, blocks: Any, shape: tuple[int, int]) -> Int4Linear:
    """The int4 layer a Q4_K or Q5_K part of a K-quant projection becomes (``KQuantLinear``'s
    ``int4_layer``)."""
    return Int4Linear(int4_from_gguf(type_name, blocks, shape))


def _head_keeps_blocks(head_type: str, config: Any, in_features: int) -> bool:
    """Whether ``gguf`` builds a single-process CPU model's LM head, stored in ``head_type``
    blocks, from those blocks (its dense weight then never made): Q8_0 as int8 groups, Q4_0 /
    Q4_1 as int4, K-quants as they are; not where ``quantize_lm_head`` asks for another format."""
    if int(getattr(config, "tensor_parallel_size", 1) or 1) != 1 or bool(getattr(config, "quantize_lm_head", False)):
        return False
    if head_type == "Q8_0":
        return in_features % Int8GroupLinear.GROUP == 0
    return head_type in ("Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")


def _table_keeps_blocks(table_type: str, config: Any) -> bool:
    """Whether ``gguf`` keeps a single-process CPU model's untied token table, stored in
    ``table_type`` blocks, as those blocks (block_embedding.BlockEmbedding)."""
    from ..loader import RAW_KEPT_TYPES

    return int(getattr(config, "tensor_parallel_size", 1) or 1) == 1 and table_type in RAW_KEPT_TYPES


def _head_source(model: nn.Module) -> str:
    """The checkpoint weight the LM head reads: the token table when they are tied."""
    tied = model.lm_head.weight is model.embed_tokens.weight  # type: ignore[attr-defined]
    return "model.embed_tokens.weight" if tied else "lm_head.weight"


@dataclass
class _Plan:
    """What ``quantize_model`` decided before touching a layer: the mode and how the LM head and
    the token table are stored (the head's choice also decides whether it is a target)."""

    mode: str
    group: int
    raw: dict  # the file's quantized blocks by weight name (gguf; w8a8 leaves it empty)
    device: torch.device  # the model's (never left on meta)
    group_head: bool  # the LM head as Int8GroupLinear
    gguf_head: bool  # ... made from the file's Q8_0 blocks
    head_blocks: bool  # the LM head kept in the file's blocks
    weight_only: tuple[str, ...]  # layer name prefixes w8a8 keeps weight-only
    tied: bool
    embed_dtype: torch.dtype
    quantize_head: bool  # asked for (``quantize_lm_head``)
    quant_types: dict  # the file's type of each weight by name (what a kept layer is)
    # Read once the layers are validated (a kernel library may be built to answer):
    grouped_activations: bool = False  # w8a8's g32 int8 activations where its kernel is there
    nibble_kernel: bool = False  # gguf's int4 layers with the q4 x int8 kernel


def _plan_for(model: nn.Module, loaded: Any, config: Any, mode: str) -> _Plan:
    """Read once what every layer's choice depends on (pure: nothing is built or changed)."""
    quantize_head = bool(getattr(config, "quantize_lm_head", False))
    # w8a8 on the CPU: an LM head left unquantized is stored as Q8_0-style int8 (Int8GroupLinear)
    raw = getattr(loaded, "raw_quantized", None) or {}
    # gguf on the CPU: a head stored in Q8_0 blocks keeps them (Int8GroupLinear holds that
    # layout exactly), rather than being dequantized to a float32 matmul that costs a
    # many-stream decode step as much as a decoder layer's projections.
    # One in Q4_0 / Q4_1 blocks keeps them as the decoder's int4 layers do: dequantized to bf16,
    # one decode step would read the head at over three times the file's bytes.
    head_type = raw.get(_head_source(model), ("",))[0] if mode == "gguf" else ""
    model_device = model.norm.weight.device  # type: ignore[attr-defined]  # never left on meta
    one_cpu_head = (model_device.type == "cpu" and int(getattr(config, "tensor_parallel_size", 1) or 1) == 1)
    # One in K-quant blocks (Q4_K_M's head is Q6_K) keeps them too: dense, the head alone would be
    # read at 16 or 32 bits a weight where the file's blocks hold 6.6.
    head_blocks = one_cpu_head and _head_keeps_blocks(head_type, config, model.lm_head.in_features)  # type: ignore[attr-defined]
    gguf_head = head_blocks and head_type == "Q8_0"
    group_head = ((mode == "w8a8" and not quantize_head and one_cpu_head
                   and model.lm_head.in_features % Int8GroupLinear.GROUP == 0)  # type: ignore[attr-defined]
                  or gguf_head)
    # w8a8 keeps the last decoder layers, the down projections and a quantized LM head
    # weight-only (16-bit integer activations with the C kernels): the last layers' output
    # goes (almost) straight to the logits, and the down projections' input has the widest
    # outliers, so rounding there moves the logits most (measured on the bundled model:
    # docs/quantization.md, "w8a8").
    num_layers = len(model.layers)  # type: ignore[arg-type]
    return _Plan(
        mode=mode, group=int(getattr(config, "quant_group_size", 32)), raw=raw, device=model_device,
        group_head=group_head, gguf_head=gguf_head, head_blocks=head_blocks,
        weight_only=tuple(f"layers.{i}." for i in range(max(0, num_layers - W8A8_WEIGHT_ONLY_LAST_LAYERS), num_layers)),
        tied=model.lm_head.weight is model.embed_tokens.weight,  # type: ignore[attr-defined]
        embed_dtype=model.embed_tokens.weight.dtype,  # type: ignore[attr-defined]
        quantize_head=quantize_head, quant_types=getattr(loaded, "quant_types", {}),
    )


@torch.no_grad()
def quantize_model(model: nn.Module, loaded: Any, config: Any, ops: ModelOps | None = None) -> QuantReport:
    """Replace the model's linear layers in place per ``config.quantization``.

    ``ops``: the engine's ops, where already chosen: each new layer is bound to them and makes
    the layouts their kernels read as it is made (``prepare_kernels``), so a layer that moves
    into those (the int4 and Q6_K tiles) frees its other copy before the next is built rather
    than every layer holding both until the engine binds its ops.

    Validates every layer before touching any, so a bad group size leaves the
    model as it was and says which layer and why.
    """
    mode = str(config.quantization or "none").lower()
    if mode not in MODES:
        raise ValueError(f"unknown quantization {config.quantization!r}; choose one of {', '.join(MODES)}")
    report = QuantReport(mode)
    if mode == "none":
        return report
    plan = _plan_for(model, loaded, config, mode)
    targets = _targets(model, plan.quantize_head or plan.group_head or plan.head_blocks)
    if mode == "int4":
        for name, mod, _ in targets:
            check_int4_group(name, mod.in_features, plan.group)
    if mode == "gguf" and not plan.raw:
        raise ValueError(f"quantization 'gguf' serves a GGUF file's own Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K "
                         "blocks; "
                         f"{getattr(loaded, 'source', 'this model') or 'this model'} has none (use int8 or int4)")
    plan.grouped_activations = mode == "w8a8" and _one_process_kernels_have(config, "int8_dot")
    table_type = plan.raw.get("model.embed_tokens.weight", ("",))[0]
    if mode == "gguf" and not plan.tied and plan.device.type == "cpu" and _table_keeps_blocks(table_type, config):
        from .block_embedding import BlockEmbedding

        _, table, shape = plan.raw["model.embed_tokens.weight"]
        model.embed_tokens = BlockEmbedding(table_type, table, tuple(shape), plan.embed_dtype)  # type: ignore[arg-type]
        report.token_table = f"{table_type} blocks"
    plan.nibble_kernel = mode == "gguf" and _one_process_kernels_have(config, "q4_int8_dot")
    for name, mod, sources in targets:
        # a layer rebuilt from the file's blocks may have been left on meta (block_backed_layers)
        dev = plan.device if mod.weight.is_meta else mod.weight.device
        made = _new_layer(plan, name, mod, sources, dev, report)
        if made is not None:
            _install(model, plan, name, made, dev, ops, report)
    model.quant_report = report  # type: ignore[assignment]  # for startup logs and the eval's JSON
    log.info(report.summary())
    return report


def _new_layer(plan: _Plan, name: str, mod: nn.Module, sources: list[str], dev: torch.device,
               report: QuantReport) -> tuple[nn.Module, str] | None:
    """The quantized layer replacing ``mod`` and its format's name; None where it stays as it is
    (the reason is in ``report.kept``)."""
    mode, bias = plan.mode, mod.bias
    if name == "lm_head" and plan.group_head and plan.gguf_head:
        q, d = int8g_from_gguf(plan.raw[sources[0]][1], tuple(plan.raw[sources[0]][2]))
        return Int8GroupLinear(q.to(dev), d.to(dev), bias), "Q8_0 (int8 g32)"
    if name == "lm_head" and plan.group_head:
        return Int8GroupLinear.from_float(mod.weight, bias), "int8 g32"
    if (plan.grouped_activations and dev.type == "cpu" and name.endswith(W8A8_WEIGHT_ONLY_PROJECTIONS)
            and not name.startswith(plan.weight_only) and mod.in_features % Int8GroupLinear.GROUP == 0):
        return Int8GroupLinear.from_float(mod.weight, bias, dynamic=True), "w8a8 g32"
    if mode in ("int8", "w8a8"):
        dynamic = (mode == "w8a8" and not name.startswith(plan.weight_only) and name != "lm_head"
                   and not name.endswith(W8A8_WEIGHT_ONLY_PROJECTIONS))
        return Int8Linear.from_float(mod.weight, bias, dynamic=dynamic), "w8a8" if dynamic else "int8"
    if mode == "int4":
        return Int4Linear.from_float(mod.weight, plan.group, bias), f"int4 g{plan.group}"
    return _layer_from_blocks(plan, name, sources, bias, dev, report)


def _layer_from_blocks(plan: _Plan, name: str, sources: list[str], bias: torch.Tensor | None, dev: torch.device,
                       report: QuantReport) -> tuple[nn.Module, str] | None:
    """gguf: the layer made from the file's own blocks of its ``sources``, in the layout whose
    kernel reads them (``_block_layer_kind``); None where they are missing or mixed."""
    raw = plan.raw
    missing = [s for s in sources if s not in raw]
    if missing:
        kind = plan.quant_types.get(missing[0], "not quantized")
        report.kept[name] = f"{missing[0]} is {kind}, no native kernel"
        return None
    kinds = {raw[s][0] for s in sources}
    rebuilt_as = _block_layer_kind(kinds, dev, plan.nibble_kernel)
    if rebuilt_as is None:
        report.kept[name] = f"{name} mixes {'/'.join(sorted(kinds))} blocks (or is not on the CPU), dequantized"
        return None
    if rebuilt_as == "kquant":  # the file's K-quant blocks as they are
        from .kquant import KQuantLinear

        new = KQuantLinear([(raw[s][0], raw[s][1], tuple(raw[s][2])) for s in sources], bias,
                           int4_layer=_kscales_int4_layer if plan.nibble_kernel else None)
        return new, f"{new.formats} blocks"
    if rebuilt_as == "int8 groups":
        # Q5_0 codes less 16 are int8: Q8_0's layout holds them exactly, for the int8
        # kernels with 8-bit activations a scale per 32 inputs (llama.cpp's Q5_0 x Q8_0)
        groups = [int8g_from_q5_0(raw[s][1], tuple(raw[s][2])) if raw[s][0] == "Q5_0"
                  else int8g_from_gguf(raw[s][1], tuple(raw[s][2])) for s in sources]
        new8 = Int8GroupLinear(torch.cat([q for q, _ in groups]).to(dev),
                               torch.cat([d for _, d in groups]).to(dev), bias, dynamic=True)
        return new8, "+".join(sorted(kinds)) + " (int8 g32)"
    five_bit = rebuilt_as == "int4 five-bit"
    parts = [int4_from_gguf(raw[s][0], raw[s][1], tuple(raw[s][2]), five_bit) for s in sources]
    codes = Int4Codes.cat_rows(parts)
    codes = Int4Codes(codes.codes.to(dev), codes.scales.to(dev), codes.zeros.to(dev), 32, codes.repeat,
                      None if codes.kscales is None else tuple(t.to(dev) for t in codes.kscales),
                      codes.bits)
    fmt = "+".join(sorted({raw[s][0] for s in sources})) + " (int4 g32" + (
        ", split" if codes.repeat == 2 else ", five-bit" if codes.bits == 5 else "") + ")"
    return Int4Linear(codes, bias), fmt


def _install(model: nn.Module, plan: _Plan, name: str, made: tuple[nn.Module, str], dev: torch.device,
             ops: ModelOps | None, report: QuantReport) -> None:
    """Put the new layer in the old one's place (bound to ``ops`` on the CPU); a tied LM head that
    can give its rows also serves the token table."""
    new, fmt = made
    if ops is not None and dev.type == "cpu":
        bind_ops(new, ops)  # an int4 part inside a K-quant projection too
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, new)
    report.quantized[name] = fmt
    if name == "lm_head" and plan.tied:
        probe = torch.zeros(1, dtype=torch.long, device=dev)
        rows = getattr(new, "rows", None)
        if rows is not None and rows(probe) is not None:
            model.embed_tokens = QuantizedEmbedding(new, plan.embed_dtype)  # type: ignore[arg-type]
            report.shared_embedding = True

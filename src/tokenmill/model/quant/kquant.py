"""GGUF K-quant blocks (Q4_K, Q5_K, Q6_K) served as the file stores them.

A K-quant file's projections keep their own bytes (4.5, 5.5 and 6.6 bits a weight)
rather than being dequantized at load and requantized: ``KQuantLinear`` holds the
blocks, and the C kernels (``csrc/kquant.c`` inside ``tm_linear`` and the fused step)
read them as stored. Few activation rows (decode) multiply the blocks' codes by int8
activations with integer dot products, each row quantized on its own with a scale per
32 inputs, as llama.cpp multiplies K-quants by its Q8_K activations; many rows (prefill
chunks), and builds without AVX2, widen a tile of rows to float32 exactly as ggml does
and multiply it by float32 activations. A fused projection whose parts were stored in
different types (q/k in Q4_K and v in Q6_K, as Q4_K_M files have them) keeps one block
matrix per part. Where the build has the int4 nibble kernel, a projection stored in Q4_K
alone is served as an int4 layer instead (``q4k_fields``, ``quant._block_layer_kind``).

Without the C kernels (another device, kernels off) the layer widens its blocks
with ``dequantize`` (numpy, the same arithmetic) and runs a float32 matmul.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .quant_linear import QuantLinearBase as _QuantLinear

# ggml's type id and bytes per 256-weight super-block
KQUANT_TYPES: dict[str, tuple[int, int]] = {"Q4_K": (12, 144), "Q5_K": (13, 176), "Q6_K": (14, 210)}
SUPER_BLOCK = 256
Q6_PACK_ROWS = 4096  # rows unpacked at a time while making Q6_K tiles (bounds the load's scratch memory)


def _half(b: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(b[:, at : at + 2]).view(np.float16).astype(np.float32)  # [n, 1]


def _scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins packed in 12 bytes ([n, 12] -> two [n, 8])."""
    q = scales.astype(np.uint8)
    sc = np.empty((q.shape[0], 8), np.uint8)
    mn = np.empty((q.shape[0], 8), np.uint8)
    sc[:, :4], mn[:, :4] = q[:, 0:4] & 63, q[:, 4:8] & 63
    sc[:, 4:] = (q[:, 8:12] & 0xF) | ((q[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)
    return sc, mn


def _q45_fields(type_name: str, b: np.ndarray) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K super-blocks ([n, bytes]) -> their codes (uint8 [n, 8, 32], 0..15 or 0..31),
    d and dmin (float32 [n, 1], fp16 values) and the 8 sub-blocks' 6-bit sc and m (uint8
    [n, 8]): w = d sc q - dmin m."""
    n = b.shape[0]
    d, dmin = _half(b, 0), _half(b, 2)
    sc, mn = _scale_min(b[:, 4:16])
    qs = b[:, 48:] if type_name == "Q5_K" else b[:, 16:]
    q = np.stack([qs.reshape(n, 4, 32) & 0xF, qs.reshape(n, 4, 32) >> 4], axis=2).reshape(n, 8, 32)
    if type_name == "Q5_K":
        qh = b[:, 16:48]
        bits = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [n, 8 sub-blocks, 32]
        q = q + (bits << 4)
    return q, d, dmin, sc, mn


def q45k_fields(type_name: str, blocks: Any, shape: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """Q4_K or Q5_K rows (``shape`` [rows, k]) as the int4 kernels take them
    (``quant.int4_from_gguf``): codes in input order (uint8 [rows, k], 0..15 or 0..31), d and
    dmin (float16 [rows, k / 256]) and the 32-weight sub-blocks' sc and m (uint8 [rows, k /
    32]); w = d sc q - dmin m."""
    rows, k = shape
    b = np.ascontiguousarray(np.asarray(blocks)).view(np.uint8).reshape(-1, KQUANT_TYPES[type_name][1])
    q, d, dmin, sc, mn = _q45_fields(type_name, b)
    per_row = k // SUPER_BLOCK
    return (q.reshape(rows, k), d.astype(np.float16).reshape(rows, per_row),
            dmin.astype(np.float16).reshape(rows, per_row), sc.reshape(rows, k // 32), mn.reshape(rows, k // 32))


def q6_parts(blocks: Any, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K rows (``shape`` [rows, k]) as codes in input order (uint8 [rows, k], 0..63), the
    16-weight sub-blocks' scales (int8 [rows, k / 16]) and the super-blocks' d (float16
    [rows, k / 256]): w = d sc (q - 32)."""
    rows, k = shape
    b = np.ascontiguousarray(np.asarray(blocks)).view(np.uint8).reshape(-1, KQUANT_TYPES["Q6_K"][1])
    n = b.shape[0]
    ql, qh = b[:, :128].reshape(n, 2, 64), b[:, 128:192].reshape(n, 2, 32)
    low = np.concatenate([ql[:, :, :32] & 0xF, ql[:, :, 32:] & 0xF, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], axis=2)
    high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
    q = (low | (high << 4)).astype(np.uint8).reshape(rows, k)
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).reshape(rows, k // 16)
    d = np.ascontiguousarray(b[:, 208:210]).view(np.float16).reshape(rows, k // SUPER_BLOCK)
    return q, sc.copy(), d.copy()


def q6_blocks(q: np.ndarray, sc: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The inverse of :func:`q6_parts`: codes (uint8 [rows, k], 0..63), sub-block scales (int8
    [rows, k / 16]) and super-block d (float16 [rows, k / 256]) -> the Q6_K rows as the file
    stores them (uint8 [rows, k / 256 x 210])."""
    rows, k = q.shape
    n = rows * k // SUPER_BLOCK
    quarters = np.asarray(q, dtype=np.uint8).reshape(n, 2, 4, 32)  # [block, half, quarter, 32]
    low, high = quarters & 0xF, quarters >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    out = np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64),
                          np.ascontiguousarray(sc).view(np.uint8).reshape(n, 16),
                          np.ascontiguousarray(d, dtype=np.float16).view(np.uint8).reshape(n, 2)], axis=1)
    return out.astype(np.uint8).reshape(rows, -1)


def dequantize(type_name: str, blocks: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Raw K-quant rows -> float32 ``shape``, as ggml computes each weight:
    Q4_K / Q5_K ``(d * sc) * q - dmin * m`` per 32 weights, Q6_K ``(d * sc) * (q - 32)`` per 16."""
    _, nbytes = KQUANT_TYPES[type_name]
    b = np.ascontiguousarray(blocks).view(np.uint8).reshape(-1, nbytes)
    n = b.shape[0]
    if type_name in ("Q4_K", "Q5_K"):
        q, d, dmin, sc, mn = _q45_fields(type_name, b)
        scale = (d * sc.astype(np.float32))[..., None]
        offset = (dmin * mn.astype(np.float32))[..., None]
        values = scale * q.astype(np.float32) - offset
    elif type_name == "Q6_K":
        ql, qh = b[:, :128].reshape(n, 2, 64), b[:, 128:192].reshape(n, 2, 32)
        sc = b[:, 192:208].view(np.int8).astype(np.float32).reshape(n, 16)
        d = _half(b, 208)
        low = np.concatenate([ql[:, :, :32] & 0xF, ql[:, :, 32:] & 0xF, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4],
                             axis=2)  # [n, half, 128]
        high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
        q = (low | (high << 4)).astype(np.int8) - np.int8(32)
        values = (d * sc).reshape(n, 16, 1) * q.reshape(n, 16, 16).astype(np.float32)
    else:
        raise ValueError(f"{type_name} is not a K-quant type this module serves ({', '.join(KQUANT_TYPES)})")
    return values.reshape(shape).astype(np.float32, copy=False)


@dataclass
class KQuantPart:
    """One stored block matrix of a (possibly fused) projection: ``rows`` output rows, its
    bytes in the layer's buffer ``blocks{index}`` (uint8 [rows, k / 256 * bytes per block])."""

    type_name: str
    rows: int
    index: int
    int4: bool = False  # held as an int4 layer (``int4_{index}``), not as blocks


class KQuantLinear(_QuantLinear):
    """A projection whose weights stay in GGUF K-quant blocks (see the module docstring).

    ``int4_layer``: where given, what a Q4_K or Q5_K part of a projection stored in several
    types (Q4_K_M's q/k beside a Q6_K v) becomes, from its type, blocks and shape: ``quant.py``
    gives its int4 layer, the sub-blocks its groups, as a projection stored in Q4_K / Q5_K
    alone becomes (``quant._block_layer_kind``), where the nibble kernel runs."""

    def __init__(self, parts: list[tuple[str, Any, tuple[int, ...]]], bias: torch.Tensor | None = None,
                 int4_layer: Callable[[str, np.ndarray, tuple[int, int]], nn.Module] | None = None) -> None:
        k = parts[0][2][1]
        if k % SUPER_BLOCK or any(shape[1] != k for _, _, shape in parts):
            raise ValueError(f"K-quant rows must be whole {SUPER_BLOCK}-weight super-blocks of one width")
        super().__init__(k, sum(shape[0] for _, _, shape in parts), bias)
        # Neighbouring parts of one type are one block matrix (their rows stacked): a fused
        # projection of one type (q, k and v all Q4_K) is then one kernel description, which
        # the fused step can run.
        runs: list[tuple[str, list[np.ndarray]]] = []
        for type_name, blocks, shape in parts:
            rows = np.ascontiguousarray(np.asarray(blocks)).view(np.uint8).reshape(shape[0], -1)
            if runs and runs[-1][0] == type_name:
                runs[-1][1].append(rows)
            else:
                runs.append((type_name, [rows]))
        self.parts: list[KQuantPart] = []
        for i, (type_name, stacked) in enumerate(runs):
            data = np.concatenate(stacked) if len(stacked) > 1 else stacked[0]
            if type_name in ("Q4_K", "Q5_K") and int4_layer is not None:
                setattr(self, f"int4_{i}", int4_layer(type_name, data, (data.shape[0], k)))
                self.register_buffer(f"blocks{i}", None)
                self.parts.append(KQuantPart(type_name, data.shape[0], i, int4=True))
                continue
            self.register_buffer(f"blocks{i}", torch.from_numpy(data.copy()))  # counted in the engine's weight bytes
            self.parts.append(KQuantPart(type_name, data.shape[0], i))
        self._descs: list[Any] | None = None
        self._desc_keep: list[torch.Tensor] = []
        self.q6_vw: int | None = None  # the vector width of the Q6_K parts' tiles, once made

    def blocks(self, part: KQuantPart) -> torch.Tensor:
        """The part's rows as the file stores them (rebuilt from its tiles once
        prepare_kernels has moved them there)."""
        held = self.blocks_held(part)
        if held is not None:
            return held
        if part.int4:
            raise ValueError(f"part {part.index} of this layer is an int4 layer; its {part.type_name} blocks are not kept")
        from ..kernels.cpu_kernels import unpack_q6_tiles

        q, sc, d = unpack_q6_tiles(*self._tiles(part), self.q6_vw)  # type: ignore[arg-type]
        return torch.from_numpy(q6_blocks(q.numpy(), sc.numpy(), d.numpy()))

    def int4_part(self, part: KQuantPart) -> Any:
        """The int4 layer holding an ``int4`` part (bound to this layer's ops)."""
        sub = getattr(self, f"int4_{part.index}")
        sub.ops = self.ops
        return sub

    def _tiles(self, part: KQuantPart) -> tuple[torch.Tensor, torch.Tensor] | None:
        codes = getattr(self, f"q6_codes{part.index}", None)
        return None if codes is None else (codes, getattr(self, f"q6_scales{part.index}"))

    @property
    def formats(self) -> str:
        return "+".join(sorted({p.type_name for p in self.parts}))

    def prepare_kernels(self) -> None:
        """Where the bound C kernels multiply Q6_K tiles (AVX2, AVX-512 VNNI): move each Q6_K
        part into them (once, when the engine binds its kernels) and drop its blocks, so the
        layer holds its weights once; every row count reads the tiles."""
        library = self.ops.library
        for part in self.parts:
            if part.int4:
                self.int4_part(part).prepare_kernels()
        q6 = [p for p in self.parts if p.type_name == "Q6_K"]
        if library is None or not library.q6_tiles or any(self.blocks_held(p) is None for p in q6):
            return
        for part in q6:
            if self.blocks_held(part).device.type != "cpu":  # type: ignore[union-attr]
                continue
            if (self._tiles(part) is None or self.q6_vw != library.vector_width) and \
                    self._q6_tiles(part, library.vector_width) is None:
                continue
            setattr(self, f"blocks{part.index}", None)
            self._descs = None  # made again, pointing at the tiles alone

    def blocks_held(self, part: KQuantPart) -> torch.Tensor | None:
        """The part's blocks as held: None once moved into tiles."""
        return getattr(self, f"blocks{part.index}")

    def kernel_descriptions(self) -> list[Any]:
        """One ``TmLinear`` per part (pointers into this layer's buffers)."""
        from ..kernels import cpu_kernels

        if self._descs is None:
            library = self.ops.library
            descs, keep = [], []
            for part in self.parts:
                if part.int4:  # the int4 layer's own description (pointers into its buffers)
                    descs.append(self.int4_part(part).kernel_description())
                    continue
                d = cpu_kernels.TmLinear()
                d.kind, d.group, d.repeat = cpu_kernels.W_KQ, KQUANT_TYPES[part.type_name][0], 1
                d.n, d.k, d.bias = part.rows, self.in_features, None
                tiles = self._tiles(part)
                if part.type_name == "Q6_K" and tiles is None and library is not None and library.q6_tiles:
                    tiles = self._q6_tiles(part, library.vector_width)
                usable = (tiles is not None and library is not None and library.q6_tiles
                          and library.vector_width == self.q6_vw)
                if usable and self.blocks_held(part) is None:
                    d.w = None  # moved: q6k_rows reads only the tiles
                else:  # the blocks (rebuilt from the tiles, and kept while these descriptions are, if moved)
                    blocks = self.blocks(part)
                    keep.append(blocks)
                    d.w = blocks.data_ptr()
                if usable:  # AVX2, AVX-512 VNNI: q6k_rows multiplies these at every row count
                    d.packed, d.packed_scale = tiles[0].data_ptr(), tiles[1].data_ptr()  # type: ignore[index]
                descs.append(d)
            self._descs, self._desc_keep = descs, keep
        return self._descs

    def _q6_tiles(self, part: KQuantPart, vector_width: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The Q6_K part's tiles (cpu_kernels.pack_q6_tiles), made once and kept as buffers (the
        engine's weight count sees them)."""
        from ..kernels import cpu_kernels

        if part.rows % vector_width:
            return None
        blocks = self.blocks(part).cpu().numpy()
        tiles: tuple[torch.Tensor, torch.Tensor] | None = None
        step = Q6_PACK_ROWS // vector_width * vector_width
        for r0 in range(0, part.rows, step):  # a slice of rows at a time: the unpacked codes take a byte a weight
            r1 = min(r0 + step, part.rows)
            q, sc, d = q6_parts(blocks[r0:r1], (r1 - r0, self.in_features))
            chunk = cpu_kernels.pack_q6_tiles(torch.from_numpy(q), torch.from_numpy(sc), torch.from_numpy(d),
                                              vector_width)
            assert chunk is not None
            if tiles is None:
                tiles = tuple(torch.empty((part.rows // vector_width, *c.shape[1:]), dtype=c.dtype)
                              for c in chunk)  # type: ignore[assignment]
            for whole, c in zip(tiles, chunk):  # type: ignore[arg-type]
                whole[r0 // vector_width:r1 // vector_width] = c
        if tiles is not None:
            self.register_buffer(f"q6_codes{part.index}", tiles[0], persistent=False)
            self.register_buffer(f"q6_scales{part.index}", tiles[1], persistent=False)
            self.q6_vw = vector_width
        return tiles

    def rows(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Float32 rows ``ids`` of a one-part layer (a tied token table looks tokens up here),
        as ``dequantize`` widens them; None for a layer of several parts."""
        if len(self.parts) != 1:
            return None
        part = self.parts[0]
        if part.int4:
            return self.int4_part(part).rows(ids)
        ids = ids.to("cpu", torch.long)
        held = self.blocks_held(part)
        if held is not None:
            picked = held.cpu()[ids].numpy()
        else:
            from ..kernels.cpu_kernels import unpack_q6_tiles

            q, sc, d = unpack_q6_tiles(*self._tiles(part), self.q6_vw, rows=ids)  # type: ignore[misc]
            picked = q6_blocks(q.numpy(), sc.numpy(), d.numpy())
        return torch.from_numpy(dequantize(part.type_name, picked, (ids.shape[0], self.in_features)))

    def dequantized_weight(self) -> torch.Tensor:
        return torch.cat([self.int4_part(p).dequantized_weight().cpu() if p.int4 else
                          torch.from_numpy(dequantize(p.type_name, self.blocks(p).cpu().numpy(),
                                                      (p.rows, self.in_features))) for p in self.parts])

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        library = self.ops.library
        if library is not None and x.device.type == "cpu":
            from ..kernels.cpu_kernels import linear

            xf = x.float().contiguous()
            outs = [linear(d, xf, library) for d in self.kernel_descriptions()]
            if all(o is not None for o in outs):
                return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)  # type: ignore[arg-type]
        return F.linear(x.float(), self.dequantized_weight().to(x.device))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, blocks={self.formats}"


def weight_bits(layer: KQuantLinear) -> float:
    """Stored bits per weight (the startup report's figure): the blocks, the tiles they moved
    into, or an int4 part's codes and factors."""
    def part_bytes(p: KQuantPart) -> int:
        if p.int4:
            return sum(b.numel() * b.element_size() for b in layer.int4_part(p).buffers())
        held = layer.blocks_held(p)
        return held.numel() if held is not None else sum(t.numel() for t in layer._tiles(p))  # type: ignore[union-attr]

    total = sum(part_bytes(p) for p in layer.parts)
    return 8.0 * total / (layer.in_features * layer.out_features)


"""The GGUF container: metadata and tensor views of a memory-mapped file.

Read by the model loader (``model/loader.py``: weights and the network's shape)
and by the tokenizer (``files/tokenizer.py``: the vocabulary in the metadata), so it
lives at the package root, below both; it needs no torch.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class GGUFTensor:
    """One tensor of a GGUF file: raw bytes as a view of the memory-mapped file."""

    name: str
    type_name: str  # ggml type name: "F32", "Q4_1", ...
    shape: tuple[int, ...]  # logical, row-major (ggml lists dims fastest-first; this is reversed)
    data: np.ndarray  # uint8 [*shape[:-1], bytes_per_row]


@dataclass
class GGUFFile:
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


# GGUF metadata value types -> struct format (strings=8 and arrays=9 handled apart)
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class _Cursor:
    """Sequential little-endian reads over the mapped file (struct on mmap: no copies)."""

    def __init__(self, buf: Any) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, vtype: int) -> Any:
        fmt = "<" + _GGUF_SCALARS[vtype]
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        (n,) = struct.unpack_from("<Q", self.buf, self.pos)
        start = self.pos + 8
        self.pos = start + n
        return self.buf[start : self.pos].decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == 8:
            return self.string()
        if vtype != 9:
            return self.scalar(vtype)
        item_type, count = self.scalar(4), self.scalar(10)
        if item_type in _GGUF_SCALARS:  # numeric arrays in one read
            fmt = f"<{count}{_GGUF_SCALARS[item_type]}"
            items = list(struct.unpack_from(fmt, self.buf, self.pos))
            self.pos += struct.calcsize(fmt)
            return items
        return [self.value(item_type) for _ in range(count)]


def read_gguf(path: str, *, with_tensors: bool = True) -> GGUFFile:
    """Parse a GGUF (v2/v3, little-endian) file: metadata dict and tensor views.

    Our own small parser: ``gguf.GGUFReader`` builds a numpy view per array
    element and is slow on a 49k-token vocabulary; this reads whole arrays at once.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as fh:
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    if mapped[:4] != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    cur = _Cursor(mapped)
    cur.pos = 4
    version = cur.scalar(4)
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (big-endian or too old/new)")
    n_tensors, n_kv = cur.scalar(10), cur.scalar(10)
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar(4))
    if not with_tensors:
        return GGUFFile(metadata, [])
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.scalar(10) for _ in range(cur.scalar(4))]
        infos.append((name, dims, cur.scalar(4), cur.scalar(10)))
    align = int(metadata.get("general.alignment", 32))
    data_start = -(-cur.pos // align) * align
    buf = np.frombuffer(mapped, dtype=np.uint8)  # read-only view sharing the mapping
    tensors = []
    for name, dims, type_id, offset in infos:
        qtype = GGMLQuantizationType(type_id)
        block, type_size = GGML_QUANT_SIZES[qtype]
        if dims[0] % block:
            raise ValueError(f"{path}: tensor {name} rows of {dims[0]} are not whole {qtype.name} blocks")
        shape = tuple(int(d) for d in reversed(dims))
        row_bytes = dims[0] // block * type_size
        n_rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
        start = data_start + offset
        raw = buf[start : start + n_rows * row_bytes]
        tensors.append(GGUFTensor(name, qtype.name, shape, raw.reshape(*shape[:-1], row_bytes)))
    return GGUFFile(metadata, tensors)

"""A token table kept in its GGUF blocks.

A GGUF file stores the token table in the same 4- to 8-bit blocks as the projections, and
a step reads only the rows of its tokens. Widened to float32 at load, the table alone
would take several times the file's share of it (a 128k-token, 4096-wide table: 2 GiB
where its Q4_K blocks hold 0.3), so ``gguf`` keeps an untied table's blocks and widens
just the rows each step looks up, with the arithmetic the loader would have used
(``loader.dequantize``), so the embeddings are the dense table's exactly.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from ..loader import dequantize


class BlockEmbedding(nn.Module):
    """``nn.Embedding``'s lookup over a GGUF token table held as its blocks
    (``blocks`` [vocab, bytes a row], one row of blocks a token)."""

    def __init__(self, type_name: str, blocks: Any, shape: tuple[int, int], dtype: torch.dtype) -> None:
        super().__init__()
        rows = np.ascontiguousarray(np.asarray(blocks)).view(np.uint8).reshape(shape[0], -1)
        # its own copy: the file's memory map is not the model's to keep open
        self.register_buffer("blocks", torch.from_numpy(rows.copy()))
        self.type_name = type_name
        self.num_embeddings, self.embedding_dim = int(shape[0]), int(shape[1])
        self.dtype = dtype

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Float32 rows ``ids`` (1-D) of the table."""
        picked = self.blocks[ids.to("cpu", torch.long)].numpy()
        values = dequantize(picked, self.type_name, (picked.shape[0], self.embedding_dim))
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        out = self.rows(flat).to(device=ids.device, dtype=self.dtype)
        return out.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, blocks={self.type_name}"

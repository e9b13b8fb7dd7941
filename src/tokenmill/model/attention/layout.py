"""The layout of one step's flattened batch, shared by every attention backend.

The batch holds decode sequences first (one query token each), then prefill
chunks (many query tokens, possibly after a cached or earlier-computed
prefix). New K/V go into the pool at ``slot_mapping``; keys and values are
read back through each sequence's block table. The runner builds one layout
per step; the engine's attention backend turns it into what its kernels read
(``AttentionBackend.prepare``), once per step, for every layer.

Pool layout: ``[kv_heads, num_blocks, block_size, head_dim]`` per layer, head
outermost, so every block of one KV head is a contiguous
``[block_size, head_dim]`` matrix.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepLayout:
    """Where every token of a step goes and what each sequence attends to."""

    slot_mapping: torch.Tensor  # [T] long: flat slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor  # [B, max_blocks] long, padded with 0
    seq_lens: list[int]  # context length of each sequence after this step
    query_lens: list[int]  # new tokens of each sequence in this step
    num_decodes: int  # the first num_decodes sequences have query_len == 1
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def decode_blocks(self) -> int:
        """Blocks spanned by the longest decode context."""
        return -(-max(self.seq_lens[: self.num_decodes], default=0) // self.block_size)

    def to(self, device: torch.device) -> "StepLayout":
        return StepLayout(self.slot_mapping.to(device), self.block_tables.to(device), self.seq_lens,
                          self.query_lens, self.num_decodes, self.block_size)


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can do, declared by its class and asked once, when the engine is
    built (the runner, not the backend, decides what to do with the answer)."""

    # Its per-step object can be built on the device from a CUDA graph's static tensors
    # (a ``graph_decode_step`` method): the runner records decode steps only then.
    cuda_graphs: bool = False
    # It reads and writes a quantized pool (model/quant/kv_quant.py: codes plus scales).
    quantized_pool: bool = False
    # It attends over a sliding window of recent positions and soft-caps scores (Gemma 2's
    # layers); a model with soft-capped scores needs a backend that declares it.
    masks: bool = False
    # It attends over a sliding window of recent positions (no soft-capping): enough for
    # a model whose layers only slide (Gemma 3, Mistral-style windows).
    windows: bool = False

    def takes(self, windowed: bool, softcapped: bool) -> bool:
        """Whether this backend computes a model's attention with these masks."""
        return (self.masks or not softcapped) and (self.masks or self.windows or not windowed)


def kv_cache_shape(num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> tuple[int, int, int, int]:
    """Shape of one layer's K (or V) pool."""
    return (kv_heads, num_blocks, block_size, head_dim)

"""Approximate per-backend prefix cache: chained block hashes with LRU aging.

The router cannot see a backend's KV cache, so it remembers the token blocks
of the requests it sent there. A block's key hashes its tokens together with
its parent's key, so one lookup per block answers "is this whole prefix
there?" (the same idea as vLLM's block hashing; equivalent to a radix tree at
block granularity). Only full blocks count, as only full blocks are shared by
the backends.

A wrong guess costs a slower request, never a wrong answer, so a 64-bit
BLAKE2b digest (``kv_events.chain_digest``) is plenty here (the backends themselves compare token ids).

Capacity and LRU aging keep the index close to what the backend can really
hold: when a backend has ``num_gpu_blocks`` blocks, the index forgets the
least recently used blocks beyond that. A request's chain is touched leaf
first, root last, so the oldest leaves age out before their parents, as the
backend's own radix-tree eviction would.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from ...traffic.kv_events import chain_digest


def chain_key(parent: bytes, chunk: Sequence[int]) -> bytes:
    """The key of one block: its tokens chained to its parent's key (``b""`` at the root).
    It is ``kv_events.chain_digest``, the name a tokenmill replica gives the block in its KV
    events, so events that name blocks by hash alone line up with these keys."""
    return chain_digest(parent, chunk)


def block_hashes(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """Chained keys of the full blocks of ``tokens`` (a partial tail is dropped)."""
    keys: list[bytes] = []
    parent = b""
    n_full = len(tokens) // block_size
    for i in range(n_full):
        parent = chain_key(parent, tokens[i * block_size : (i + 1) * block_size])
        keys.append(parent)
    return keys


@dataclass
class PrefixIndex:
    """What one backend probably holds, as an LRU set of chained block keys."""

    capacity_blocks: int
    _blocks: OrderedDict[bytes, None] = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, keys: Sequence[bytes]) -> int:
        """How many leading blocks of ``keys`` are present. Does not touch LRU."""
        n = 0
        for k in keys:
            if k not in self._blocks:
                break
            n += 1
        return n

    def insert(self, keys: Sequence[bytes]) -> None:
        """Record that the backend now holds this chain; touch it leaf first."""
        if self.capacity_blocks <= 0:
            return
        # Keep at most `capacity` blocks of one chain: its longest prefix.
        keys = keys[: self.capacity_blocks]
        for k in reversed(keys):
            if k in self._blocks:
                self._blocks.move_to_end(k)
            else:
                self._blocks[k] = None
        # The root was touched last, so it is the most recent; evict from the old end.
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)

    def resize(self, capacity_blocks: int) -> None:
        self.capacity_blocks = max(0, int(capacity_blocks))
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()

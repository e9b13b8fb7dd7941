"""The paged KV cache's bookkeeping: fixed-size blocks, a free list, ref counts.

The tensors live in the runner; this module only decides which block ids are
free, held, or cached-idle. A block is in exactly one state:

- free: on the free list, ref count 0, not indexed by the prefix cache;
- in use: ref count > 0 (possibly also indexed by the prefix cache);
- cached-idle: ref count 0 but indexed by the prefix cache, evictable.

Invariant: free + in use + cached-idle == total, always.

The pool is the lower of the two KV bookkeepers: it knows no prefix cache, only
the ``CachedBlocks`` protocol below (the index of blocks whose content is worth
keeping), and calls it when a block's last reference goes or an idle one is
taken again. The prefix cache (engine/kv/prefix_cache.py) implements it and
uses the pool in turn (restoring blocks from disk allocates pool blocks), so
the dependency runs one way: prefix cache -> pool.
"""
from __future__ import annotations

from collections import deque
from typing import Protocol


class CachedBlocks(Protocol):
    """What the pool asks of an index over its blocks (the prefix cache): which blocks it
    holds, which of those are idle, and to give one idle block up when the free list is empty."""

    @property
    def num_idle(self) -> int: ...

    def contains_block(self, block: int) -> bool: ...

    def mark_busy(self, block: int) -> None: ...

    def mark_idle(self, block: int) -> None: ...

    def evict_one(self) -> int: ...


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation cannot be satisfied; callers check first."""


class BlockPool:
    def __init__(self, num_blocks: int, prefix_cache: CachedBlocks | None = None) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_list: deque[int] = deque(range(num_blocks))
        self.prefix_cache = prefix_cache

    # -- queries -------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free_list)

    @property
    def num_cached_idle(self) -> int:
        return self.prefix_cache.num_idle if self.prefix_cache else 0

    @property
    def num_available(self) -> int:
        """Blocks an allocation may take: free plus evictable cached blocks."""
        return self.num_free + self.num_cached_idle

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - self.num_free - self.num_cached_idle

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running requests (vLLM's kv_cache_usage_perc)."""
        return self.num_in_use / self.num_blocks

    # -- transitions ---------------------------------------------------
    def allocate(self, count: int) -> list[int]:
        """Take ``count`` blocks with ref count 1, evicting cached-idle ones if needed."""
        if count > self.num_available:
            raise NoFreeBlocksError(f"need {count} blocks, {self.num_available} available")
        blocks: list[int] = []
        for _ in range(count):
            if not self.free_list:
                assert self.prefix_cache is not None
                self.free_list.append(self.prefix_cache.evict_one())
            block = self.free_list.popleft()
            assert self.ref_counts[block] == 0
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def acquire(self, block: int) -> None:
        """Take one more reference on a block (a prefix-cache hit)."""
        if self.ref_counts[block] == 0 and self.prefix_cache is not None:
            self.prefix_cache.mark_busy(block)
        self.ref_counts[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference on each block; the single release path for
        finish, abort and preemption. Released in reverse so that the tail of
        a sequence becomes evictable before its head."""
        for block in reversed(blocks):
            count = self.ref_counts[block]
            if count <= 0:
                raise AssertionError(f"block {block} released with ref count {count}")
            self.ref_counts[block] = count - 1
            if count == 1:
                if self.prefix_cache is not None and self.prefix_cache.contains_block(block):
                    self.prefix_cache.mark_idle(block)
                else:
                    self.free_list.append(block)

    def return_evicted(self, block: int) -> None:
        """The prefix cache dropped an idle block outside of allocation (reset)."""
        assert self.ref_counts[block] == 0
        self.free_list.append(block)

    def check_invariants(self, idle: bool = False) -> None:
        """Assert the pool's invariants; with ``idle`` also that nothing is held."""
        free = set(self.free_list)
        assert len(free) == len(self.free_list), "a block is on the free list twice"
        for block in free:
            assert self.ref_counts[block] == 0, f"free block {block} is referenced"
            if self.prefix_cache is not None:
                assert not self.prefix_cache.contains_block(block), f"free block {block} is indexed"
        assert all(c >= 0 for c in self.ref_counts), "negative ref count"
        in_use = sum(1 for c in self.ref_counts if c > 0)
        assert in_use + len(free) + self.num_cached_idle == self.num_blocks, (
            f"free {len(free)} + in use {in_use} + cached-idle {self.num_cached_idle}"
            f" != total {self.num_blocks}"
        )
        if idle:
            assert in_use == 0, f"{in_use} blocks still referenced with no request running"

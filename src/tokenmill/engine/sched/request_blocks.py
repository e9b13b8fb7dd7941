"""A request's block table against the block pool and the prefix cache.

The scheduler decides who runs; this module keeps each request's blocks true
to that: how many more it needs, taking them, giving them all back (the single
path for finish, abort, preemption and a sent-back admission), its cached
prefix at admission, indexing the blocks it completed, and releasing the ones
a sliding window has left behind. It knows no queue and no step.
"""
from __future__ import annotations

from ..kv.block_pool import BlockPool
from ..kv.prefix_cache import PrefixCache
from ..request import Request


class RequestBlocks:
    def __init__(self, pool: BlockPool, prefix_cache: PrefixCache | None, block_size: int,
                 kv_window: int | None) -> None:
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.block_size = block_size
        # Every layer slides (model.kv_window): blocks behind the window are released while the
        # request runs (drop_behind_window), and the prefix cache indexes at most a window's
        # blocks of a path (more could not be released without breaking the tree's paths).
        self.kv_window = kv_window

    def short(self, request: Request, num_tokens: int) -> int:
        """How many more blocks ``request`` needs to hold ``num_tokens`` tokens."""
        needed = -(-num_tokens // self.block_size) - len(request.block_table)
        return max(0, needed)

    def grow(self, request: Request, num_tokens: int) -> bool:
        """Extend the block table to hold ``num_tokens`` tokens; False (nothing taken) when
        the pool has too few blocks."""
        short = self.short(request, num_tokens)
        if short > self.pool.num_available:
            return False
        if short:
            request.block_table.extend(self.pool.allocate(short))
        return True

    def release(self, request: Request) -> None:
        """Give every block back and forget the progress they held."""
        self.pool.release(request.block_table[request.num_dropped_blocks:])
        request.block_table = []
        request.num_dropped_blocks = 0
        request.num_computed_tokens = 0
        request.num_cached_blocks = 0

    def match_prefix(self, request: Request) -> None:
        """Take references on the longest cached prefix (never the whole prompt:
        at least the last token is recomputed so the step yields logits). A request
        still owed prompt logprobs computes its whole prompt: cached positions
        have no logits."""
        if self.prefix_cache is None or request.block_table or request.wants_prompt_logprobs:
            return
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = self.prefix_cache.match(request.all_token_ids, max_blocks, request.adapter_id)
        for block in blocks:
            self.pool.acquire(block)
        # blocks further along the prompt that the cache moved to its disk tier come back
        # into fresh pool blocks (the request's own) instead of being recomputed
        blocks += self.prefix_cache.restore(request.all_token_ids, len(blocks), max_blocks, self.pool,
                                            request.adapter_id)
        request.block_table = list(blocks)
        request.num_cached_blocks = len(blocks)
        request.num_computed_tokens = len(blocks) * self.block_size
        if request.first_scheduled_time is None:  # counted once it first runs (Scheduler._started)
            request.num_cached_tokens = request.num_computed_tokens

    def cache_full_blocks(self, request: Request) -> None:
        """Index the blocks that became full; where the tree holds another copy of one,
        take that copy instead (deduplication: the request's blocks stay a tree path)."""
        if self.prefix_cache is None:
            return
        num_full = request.num_computed_tokens // self.block_size
        if self.kv_window is not None:
            num_full = min(num_full, self.kv_window // self.block_size)
        if num_full <= request.num_cached_blocks:
            return
        swaps = self.prefix_cache.insert(
            request.all_token_ids, request.block_table, request.num_cached_blocks, num_full, request.adapter_id
        )
        for index, cached_block in swaps.items():
            self.pool.acquire(cached_block)
            self.pool.release([request.block_table[index]])
            request.block_table[index] = cached_block
        request.num_cached_blocks = num_full

    def drop_behind_window(self, request: Request) -> None:
        """Release the blocks no layer reads again. The next query sits at position
        ``num_computed_tokens`` or later and reads keys from ``window - 1`` before it on, so a
        block that ends before that is done with. The blocks the prefix cache indexes are a
        root path and go together once all of them are behind the window (a request holds
        whole paths of the tree, so an idle node never has a busy child); the last block
        stays (its id fills the released slots)."""
        if self.kv_window is None:
            return
        behind = (request.num_computed_tokens + 1 - self.kv_window) // self.block_size
        behind = min(behind, len(request.block_table) - 1)
        if behind <= request.num_dropped_blocks or behind < request.num_cached_blocks:
            return
        table = request.block_table
        self.pool.release(table[request.num_dropped_blocks:behind])
        table[:behind] = [table[behind]] * behind
        request.num_dropped_blocks = behind

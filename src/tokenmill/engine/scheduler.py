"""Continuous batching: who runs this step, and with how many tokens.

One token budget per step (``max_num_batched_tokens``) serves decodes and
prefill chunks alike. Running decodes are served first, then running prefills
(chunked to the budget), then waiting requests in FCFS order as the batching
policy allows. When the pool runs out, the newest running request is
preempted by recompute: its blocks go back (full ones stay in the prefix
cache, so recompute is often a cache hit) and it re-enters the queue at the
front. A step that preempted admits nobody new (no thrash).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ..config import SchedulerConfig
from .batching import BatchingPolicy, make_policy
from .block_pool import BlockPool
from .prefix_cache import PrefixCache
from .request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    """What one step computes: (request, number of new tokens) pairs."""

    items: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_size: int,
        pool: BlockPool,
        prefix_cache: PrefixCache | None = None,
        policy: BatchingPolicy | None = None,
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.policy = policy or make_policy(config.batching, config.max_num_seqs, config.dynamic_window_s)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # -- queue management ----------------------------------------------
    def add(self, request: Request) -> None:
        blocks_needed = -(-(request.num_prompt_tokens + request.max_tokens) // self.block_size)
        if blocks_needed > self.pool.num_blocks:
            raise ValueError(
                f"request needs {blocks_needed} KV blocks but the pool has {self.pool.num_blocks}"
            )
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: str) -> None:
        """Single exit path for finish and abort: leave the queues, free blocks."""
        if request.status is RequestStatus.FINISHED:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = request.finish_reason or reason

    def _release(self, request: Request) -> None:
        self.pool.release(request.block_table)
        request.block_table = []
        request.num_computed_tokens = 0
        request.num_cached_blocks = 0

    def _preempt(self, request: Request) -> None:
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # -- blocks ----------------------------------------------------------
    def _blocks_short(self, request: Request, num_tokens: int) -> int:
        """How many more blocks ``request`` needs to hold ``num_tokens`` tokens."""
        needed = -(-num_tokens // self.block_size) - len(request.block_table)
        return max(0, needed)

    def _grow(self, request: Request, num_tokens: int) -> bool:
        short = self._blocks_short(request, num_tokens)
        if short > self.pool.num_available:
            return False
        if short:
            request.block_table.extend(self.pool.allocate(short))
        return True

    def _match_prefix(self, request: Request) -> None:
        """Take references on the longest cached prefix (never the whole prompt:
        at least the last token is recomputed so the step yields logits)."""
        if self.prefix_cache is None or request.block_table:
            return
        max_blocks = (request.num_tokens - 1) // self.block_size
        first = request.first_scheduled_time is None
        blocks = self.prefix_cache.match(request.all_token_ids, max_blocks)
        for block in blocks:
            self.pool.acquire(block)
        request.block_table = list(blocks)
        request.num_cached_blocks = len(blocks)
        request.num_computed_tokens = len(blocks) * self.block_size
        if first:
            request.num_cached_tokens = request.num_computed_tokens
            self.prefix_cache.stats.queried_tokens += request.num_prompt_tokens
            self.prefix_cache.stats.hit_tokens += request.num_computed_tokens

    # -- the step --------------------------------------------------------
    def schedule(self, now: float | None = None) -> ScheduledBatch:
        now = time.monotonic() if now is None else now
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens

        # Running requests: decodes first, then prefill chunks, in admission order.
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for request in decodes + prefills:
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self._grow(request, request.num_computed_tokens + num_new):
                victim = self.running.pop()
                for i, (scheduled, n) in enumerate(batch.items):
                    if scheduled is victim:  # already given tokens this step: take them back
                        del batch.items[i]
                        budget += n
                        break
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue
            batch.items.append((request, num_new))
            budget -= num_new

        # Waiting requests, FCFS, only in a step that preempted nobody.
        if batch.preempted:
            return batch
        self.policy.begin_step(self.running, self.waiting, now)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if not self.policy.may_admit(request):
                break
            self._match_prefix(request)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._grow(request, request.num_computed_tokens + num_new):
                self._release(request)  # give back the prefix hit while it waits
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            self.running.append(request)
            batch.items.append((request, num_new))
            budget -= num_new
        return batch

    def after_step(self, batch: ScheduledBatch) -> None:
        """Advance progress and index newly full blocks in the prefix cache."""
        for request, num_new in batch.items:
            request.num_computed_tokens += num_new
            self._cache_full_blocks(request)

    def _cache_full_blocks(self, request: Request) -> None:
        if self.prefix_cache is None:
            return
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= request.num_cached_blocks:
            return
        swaps = self.prefix_cache.insert(
            request.all_token_ids, request.block_table, request.num_cached_blocks, num_full
        )
        for index, cached_block in swaps.items():
            self.pool.acquire(cached_block)
            self.pool.release([request.block_table[index]])
            request.block_table[index] = cached_block
        request.num_cached_blocks = num_full

    def abort(self, request: Request) -> None:
        self.finish(request, "abort")

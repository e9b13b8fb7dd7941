"""Continuous batching: who runs this step, and with how many tokens.

One token budget per step (``max_num_batched_tokens``) serves decodes and
prefill chunks alike. Running decodes are served first; then waiting requests
join in FCFS order as the batching policy allows (matching their cached
prefix); then prefill chunks share what is left of the budget: requests that
joined in the last few steps go shortest remaining prompt first, so one that
is mostly a cache hit is not stuck behind a long prompt's chunks, and older
ones go first in admission order, so nobody starves. When the pool runs out, the newest running
request is preempted by recompute: its blocks go back (full ones stay in the
prefix cache, so recompute is often a cache hit) and it re-enters the queue
at the front. A step that preempted admits nobody new (no thrash).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ..config import CPU_TOKEN_BUDGET, SchedulerConfig
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
        self._budget = 0  # tokens left in the step being scheduled
        self._now = 0.0
        self._step = 0  # steps scheduled so far

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
        at least the last token is recomputed so the step yields logits). A request
        still owed prompt logprobs computes its whole prompt: cached positions
        have no logits."""
        if self.prefix_cache is None or request.block_table or request.wants_prompt_logprobs:
            return
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = self.prefix_cache.match(request.all_token_ids, max_blocks)
        for block in blocks:
            self.pool.acquire(block)
        request.block_table = list(blocks)
        request.num_cached_blocks = len(blocks)
        request.num_computed_tokens = len(blocks) * self.block_size
        if request.first_scheduled_time is None:  # counted once it first runs (_started)
            request.num_cached_tokens = request.num_computed_tokens

    def _started(self, request: Request) -> None:
        """First tokens scheduled: the queue wait ends, the prefix hit is final."""
        request.first_scheduled_time = self._now
        if self.prefix_cache is not None:
            self.prefix_cache.stats.queried_tokens += request.num_prompt_tokens
            self.prefix_cache.stats.hit_tokens += request.num_cached_tokens

    # -- the step --------------------------------------------------------
    def schedule(self, now: float | None = None) -> ScheduledBatch:
        now = time.monotonic() if now is None else now
        self._now = now
        self._step += 1
        batch = ScheduledBatch()
        self._budget = self.config.max_num_batched_tokens or CPU_TOKEN_BUDGET

        # 1. Running decodes, in admission order: one token each.
        for request in [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]:
            if self._budget <= 0:
                break
            if request.status is RequestStatus.RUNNING:
                self._schedule(batch, request, 1)

        # 2. Waiting requests join, FCFS, in a step that preempted nobody. They walk
        #    the prefix cache now, so step 3 knows what is left of their prompts.
        admitted: list[Request] = []
        if not batch.preempted:
            self.policy.begin_step(self.running, self.waiting, now)
            while self.waiting and self._budget > 0 and len(self.running) < self.config.max_num_seqs:
                request = self.waiting[0]
                if not self.policy.may_admit(request):
                    break
                self._match_prefix(request)
                first_chunk = min(request.num_tokens - request.num_computed_tokens, self._budget)
                if self._blocks_short(request, request.num_computed_tokens + first_chunk) > self.pool.num_available:
                    self._release(request)  # give back the prefix hit while it waits
                    break
                self.waiting.popleft()
                request.status = RequestStatus.RUNNING
                request.admitted_step = self._step
                self.running.append(request)
                admitted.append(request)

        # 3. Prefill chunks. Requests that joined within the last
        #    ``prefill_starvation_steps`` steps go shortest remaining prompt first: a
        #    prompt that is mostly cached costs a few tokens and should not wait behind
        #    a long prefill. Older ones come first, in admission order: nobody starves.
        bound = self.config.prefill_starvation_steps
        pending = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1 or r in admitted]
        pending.sort(key=lambda r: (1, r.num_tokens - r.num_computed_tokens)
                     if self._step - r.admitted_step < bound else (0, r.admitted_step))
        for request in pending:
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted (or sent back) earlier in this loop
            if self._budget <= 0:
                break
            remaining = request.num_tokens - request.num_computed_tokens
            self._schedule(batch, request, min(remaining, self._budget))
        return batch

    def _schedule(self, batch: ScheduledBatch, request: Request, num_new: int) -> None:
        """Give ``request`` ``num_new`` tokens this step, growing its block table;
        when the pool is short, preempt the newest running requests until it fits
        (or until it is itself the newest and goes back to the queue)."""
        while not self._grow(request, request.num_computed_tokens + num_new):
            victim = self.running.pop()
            for i, (scheduled, n) in enumerate(batch.items):
                if scheduled is victim:  # already given tokens this step: take them back
                    del batch.items[i]
                    self._budget += n
                    break
            if victim.first_scheduled_time is None and victim.num_computed_tokens == victim.num_cached_blocks * self.block_size:
                self._send_back(victim)  # admitted this step, nothing computed: not a preemption
            else:
                self._preempt(victim)
                batch.preempted.append(victim)
            if victim is request:
                return
        batch.items.append((request, num_new))
        self._budget -= num_new
        if request.first_scheduled_time is None:
            self._started(request)

    def _send_back(self, request: Request) -> None:
        """Undo an admission that could not get blocks: back to the queue's front."""
        self._release(request)
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

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

"""Continuous batching: who runs this step, and with how many tokens.

One token budget per step (``max_num_batched_tokens``) serves decodes and
prefill chunks alike. ``schedule()`` runs its stages in order:

1. running decodes (with the speculative proposals made for this step);
2. admission: waiting requests join in FCFS order (or the order of
   ``--scheduling-policy``: engine/sched/fairness.py) as the batching policy
   allows (engine/sched/batching.py), matching their cached prefix;
3. prefill chunks share what is left of the budget: requests that joined in
   the last few steps go shortest remaining prompt first, so one that is mostly
   a cache hit is not stuck behind a long prompt's chunks, and older ones go
   first in admission order, so nobody starves; requests waiting for a prompt
   block another request is computing come last (in-flight prefix sharing:
   engine/sched/inflight.py);
4. the step's close: the queue heads admission reads, and the disk tier's copies.

When the pool runs out, the newest running request (or the queue order's
victim) is preempted by recompute: its blocks go back (full ones stay in the
prefix cache, so recompute is often a cache hit) and it re-enters the queue at
the front. A step that preempted for blocks admits nobody new (no thrash); one
that preempted to make room for a better-placed waiting request (fairness.py)
admits it. A request's blocks against the pool and the prefix cache are
engine/sched/request_blocks.py's; the step's scratch state is engine/sched/plan.py's.
"""
from __future__ import annotations

import time
from collections import deque

from ...settings.config import SchedulerConfig
from ..kv.block_pool import BlockPool
from ..kv.prefix_cache import PrefixCache
from ..request import Placement, Request, RequestStatus
from .batching import BatchingPolicy, make_policy
from .fairness import QueueHead, QueueOrder, make_queue_order
from .inflight import InflightSharing
from .plan import ScheduledBatch, StepPlan
from .request_blocks import RequestBlocks

__all__ = ["ScheduledBatch", "Scheduler"]


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_size: int,
        pool: BlockPool,
        prefix_cache: PrefixCache | None = None,
        policy: BatchingPolicy | None = None,
        device_type: str = "cpu",
        kv_window: int | None = None,
    ) -> None:
        self.config = config
        self.kv_window = kv_window  # every layer slides (model.kv_window): RequestBlocks
        self.device_type = device_type  # picks the default token budget (SchedulerConfig.token_budget)
        self.block_size = block_size
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.blocks = RequestBlocks(pool, prefix_cache, block_size, kv_window)
        self.inflight = InflightSharing(pool, prefix_cache, block_size)
        self.policy = policy or make_policy(config.batching, config.max_num_seqs, config.dynamic_window_s)
        # None: FCFS; else the waiting queue's order and the preemption victim (fairness.py)
        self.order: QueueOrder | None = make_queue_order(config.scheduling_policy, config.starvation_bound_s)
        # Each queue's oldest waiting request and its drain (QueueOrder.queue_heads), replaced
        # whole after each step so that admission on another thread reads it without a lock.
        self.queue_heads: dict[tuple[str | None, int], QueueHead] = {}
        self._starts: dict[tuple[str | None, int], int] = {}  # requests each queue started (queue_heads)
        self._freed = 0  # running requests finished or aborted (queue_heads)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0  # prompt tokens actually run through the model
        self._step = 0  # steps scheduled so far

    @property
    def token_budget(self) -> int:
        """Tokens per step, read from the config each step (``LLMEngine.temporary_budget`` changes it)."""
        return self.config.token_budget(self.device_type)

    # -- queue management ----------------------------------------------
    def add(self, request: Request) -> None:
        blocks_needed = -(-(request.num_prompt_tokens + request.max_tokens) // self.block_size)
        if blocks_needed > self.pool.num_blocks:
            raise ValueError(
                f"request needs {blocks_needed} KV blocks but the pool has {self.pool.num_blocks}"
            )
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        if self.order is not None:
            self.order.arrived(request)
            request.queue_mark = self._starts.get(self.order.queue_key(request.placement), 0), self._freed

    def backlog(self, placement: Placement, now: float | None = None) -> float | None:
        """The seconds a request joining ``placement``'s queue now is expected to wait, when
        that breaks the starvation bound and it is to be refused (fairness.py: ``backlog``);
        None to admit, always under FCFS. Reads the last step's ``queue_heads`` only, so
        another thread may call it."""
        if self.order is None:
            return None
        return self.order.backlog(self.queue_heads, placement, time.monotonic() if now is None else now)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: str) -> None:
        """Single exit path for finish and abort: leave the queues, free blocks."""
        if request.status is RequestStatus.FINISHED:
            return
        if request in self.running:
            self.running.remove(request)
            self._freed += 1
        elif request in self.waiting:
            self.waiting.remove(request)
        self.blocks.release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = request.finish_reason or reason
        if self.order is not None:
            self.order.left(request)

    def abort(self, request: Request) -> None:
        self.finish(request, "abort")

    # -- the step --------------------------------------------------------
    def schedule(self, now: float | None = None) -> ScheduledBatch:
        self._step += 1
        plan = StepPlan(now=time.monotonic() if now is None else now, index=self._step, budget=self.token_budget)
        self._run_decodes(plan)
        admitted = self._admit(plan)
        self._run_prefills(plan, admitted)
        self._close(plan)
        return plan.batch

    def _run_decodes(self, plan: StepPlan) -> None:
        """1. Running decodes, in admission order: one token each, plus the speculative
        proposals made for this step while the budget and free blocks hold them
        (proposals never cost another request its place)."""
        proposals = {r: r.spec_token_ids for r in self.running if r.spec_token_ids}
        for request in self.running:
            request.spec_token_ids = []
        for request in [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]:
            if plan.budget <= 0:
                break
            if request.status is RequestStatus.RUNNING:
                draft = proposals.get(request, [])
                if draft and plan.budget > len(draft) and self.blocks.short(
                        request, request.num_tokens + len(draft)) <= self.pool.num_available:
                    request.spec_token_ids = draft
                self._give(plan, request, 1 + len(request.spec_token_ids))

    def _admit(self, plan: StepPlan) -> list[Request]:
        """2. Waiting requests join, FCFS (or the queue order's), in a step that preempted
        nobody, or that preempted to make room for one of them. They walk the prefix
        cache now, so the prefill stage knows what is left of their prompts. Admission
        spends the budget each one's first chunk will take (nothing when it will wait
        for a producer: inflight.py)."""
        admitted: list[Request] = []
        batch = plan.batch
        displaced, head = self._make_room(plan) if self.order is not None and not batch.preempted else (None, None)
        if batch.preempted and displaced is None:
            return admitted
        self.policy.begin_step(self.running, self.waiting, plan.now)
        admit_budget = plan.budget  # what admitted requests' first chunks will take
        prefilling = self._prefilling([])
        while self.waiting and admit_budget > 0 and len(self.running) < self.config.max_num_seqs:
            admissible = [r for r in self.waiting if not r.held_for_scorer]  # see Request.prompt_scorer
            if not admissible:
                break
            if head is not None and head.held_for_scorer:
                head = None
            request = (admissible[0] if self.order is None else head  # the one room was made for
                       or self.order.next_to_admit(admissible, plan.now, self.running))
            head = None
            assert request is not None
            if request is displaced or not self.policy.may_admit(request):  # not back in its own step
                break
            first_chunk = self._start_running(plan, request)
            if first_chunk is None:
                break
            admitted.append(request)
            prefilling.append(request)
            if request not in self.inflight.producers(prefilling):
                admit_budget -= first_chunk
        return admitted

    def _start_running(self, plan: StepPlan, request: Request) -> int | None:
        """Move ``request`` from the queue to the running list with its cached prefix, if the
        pool holds the blocks of its first chunk; returns that chunk's size (None: no room)."""
        self.blocks.match_prefix(request)
        first_chunk = min(request.num_tokens - request.num_computed_tokens, plan.budget)
        if self.blocks.short(request, request.num_computed_tokens + first_chunk) > self.pool.num_available:
            self.blocks.release(request)  # give back the prefix hit while it waits
            return None
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        request.admitted_step = plan.index
        self.running.append(request)
        return first_chunk

    def _run_prefills(self, plan: StepPlan, admitted: list[Request]) -> None:
        """3. Prefill chunks. Requests that joined within the last
        ``prefill_starvation_steps`` steps go shortest remaining prompt first: a
        prompt that is mostly cached costs a few tokens and should not wait behind
        a long prefill. Older ones come first, in admission order: nobody starves.
        A request whose next prompt block an older one is computing waits for it
        (inflight.py) and is served last."""
        bound = self.config.prefill_starvation_steps
        pending = self._prefilling(admitted)
        if self.order is not None:
            pending = self.order.prefills_now(pending, plan.now)
            plan.lesser = self.order.lesser_prefill_tokens(plan.now, self.token_budget)
        for request in pending:
            self.inflight.extend_prefix(request)
        waits = self.inflight.producers(pending)
        pending.sort(key=lambda r: (1, r.num_tokens - r.num_computed_tokens)
                     if plan.index - r.admitted_step < bound else (0, r.admitted_step))
        deferred: list[Request] = []
        for request in pending:
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted (or sent back) earlier in this loop
            if request in waits:
                deferred.append(request)
                continue
            if plan.budget <= 0:
                break
            num_new = plan.chunk(request, self.order)
            if num_new > 0:
                self._give(plan, request, num_new)
        if deferred:
            self.inflight.serve_waiters(plan, pending, waits, deferred, self._age,
                                        lambda r: plan.chunk(r, self.order), self._give)

    def _close(self, plan: StepPlan) -> None:
        """4. What admission on another thread reads, and the disk tier's copies."""
        if self.order is not None:
            self.queue_heads = self.order.queue_heads(self.waiting, self._starts, self._freed,
                                                      len(self.running) >= self.config.max_num_seqs)
        if self.prefix_cache is not None:
            self.prefix_cache.flush_tier()  # blocks moved to disk this step leave the pool before it runs

    def _age(self, request: Request) -> tuple[int, int]:
        """Older first: admission step, then place in the running list (FCFS)."""
        return request.admitted_step, self.running.index(request) if request in self.running else len(self.running)

    def _prefilling(self, admitted: list[Request]) -> list[Request]:
        """Running requests with prompt (or recompute) tokens left, oldest first."""
        return [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1 or r in admitted]

    def _started(self, plan: StepPlan, request: Request) -> None:
        """First tokens scheduled: the queue wait ends, the prefix hit is final."""
        request.first_scheduled_time = plan.now
        if self.order is not None:
            key = self.order.queue_key(request.placement)
            self._starts[key] = self._starts.get(key, 0) + 1
        if self.prefix_cache is not None:
            self.prefix_cache.stats.queried_tokens += request.num_prompt_tokens
            self.prefix_cache.stats.hit_tokens += request.num_cached_tokens

    # -- giving tokens, and preemption -------------------------------------
    def _give(self, plan: StepPlan, request: Request, num_new: int) -> None:
        """Give ``request`` ``num_new`` tokens this step, growing its block table;
        when the pool is short, preempt the newest running requests until it fits
        (or until it is itself the newest and goes back to the queue)."""
        while not self.blocks.grow(request, request.num_computed_tokens + num_new):
            if self.order is None:
                victim = self.running.pop()
            else:
                victim = self.order.victim(self._preemptible(), plan.now)
                self.running.remove(victim)
            self._evict(plan, victim)
            if victim is request:
                return
        plan.batch.items.append((request, num_new))
        plan.budget -= num_new
        if request.first_scheduled_time is None:
            self._started(plan, request)

    def _evict(self, plan: StepPlan, victim: Request) -> None:
        """``victim`` (already out of ``running``) goes back to the queue; tokens it was
        given this step are taken back."""
        batch = plan.batch
        for i, (scheduled, n) in enumerate(batch.items):
            if scheduled is victim:  # already given tokens this step: take them back
                del batch.items[i]
                plan.budget += n
                break
        if victim.first_scheduled_time is None and victim.num_computed_tokens == victim.num_cached_blocks * self.block_size:
            self._send_back(victim)  # admitted this step, nothing computed: not a preemption
        else:
            self._preempt(victim)
            batch.preempted.append(victim)

    def _preempt(self, request: Request) -> None:
        self.blocks.release(request)
        request.spec_token_ids = []
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _send_back(self, request: Request) -> None:
        """Undo an admission that could not get blocks: back to the queue's front."""
        self.blocks.release(request)
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _preemptible(self) -> list[Request]:
        """Running requests (admission order) whose preemption cannot take back a block
        another request relies on: the newest, and any whose blocks still to be computed
        (which a waiter may have taken in this step) no other running request holds."""
        held: dict[int, int] = {}
        for r in self.running:
            for block in r.block_table[r.num_dropped_blocks:]:
                held[block] = held.get(block, 0) + 1
        newest = self.running[-1]
        return [r for r in self.running if r is newest or all(
            held[b] == 1 for b in r.block_table[r.num_computed_tokens // self.block_size:])]

    def _make_room(self, plan: StepPlan) -> tuple[Request | None, Request | None]:
        """The request to admit next has no room (no sequence slot, or not the blocks of
        its first chunk) but outranks someone running (fairness.py: ``outranks``):
        preempt one such request and return it with the one it made room for; the step
        then still admits, that one first (the preemption was for it, not for a lack
        of blocks)."""
        assert self.order is not None
        head = self.order.next_to_admit(self.waiting, plan.now, self.running)
        if head is None or not self.running or plan.budget <= 0:
            return None, None
        first_chunk = min(head.num_tokens, plan.budget)
        if (len(self.running) < self.config.max_num_seqs
                and -(-first_chunk // self.block_size) <= self.pool.num_available):
            return None, None
        slots = self.order.slots(self.running)
        worse = [r for r in self._preemptible() if self.order.outranks(head, r, plan.now, slots)]
        if not worse:
            return None, None
        victim = self.order.victim(worse, plan.now)
        self.running.remove(victim)
        self._evict(plan, victim)
        return victim, head

    # -- after the step ----------------------------------------------------
    def after_step(self, batch: ScheduledBatch) -> None:
        """Advance progress and index newly full blocks in the prefix cache."""
        if self.order is not None:
            self.order.charge(batch.items)
        for request, num_new in batch.items:
            prompt_new = max(0, min(num_new, request.num_prompt_tokens - request.num_computed_tokens))
            self.num_prompt_tokens_computed += prompt_new
            if request.prefill_chunks is not None and prompt_new:  # traced (gateway/tracing.py)
                request.prefill_chunks.append((time.monotonic(), prompt_new))
            # Speculative proposals count once accepted (accept_proposals).
            request.num_computed_tokens += num_new - len(request.spec_token_ids)
            self.blocks.cache_full_blocks(request)
            self.blocks.drop_behind_window(request)

    def accept_proposals(self, request: Request, accepted: int) -> None:
        """``accepted`` proposals of ``request`` (already appended to its output) were
        right: their K/V from the verify step stands; index what became full blocks."""
        if accepted and request.status is RequestStatus.RUNNING:
            request.num_computed_tokens += accepted
            self.blocks.cache_full_blocks(request)
            self.blocks.drop_behind_window(request)

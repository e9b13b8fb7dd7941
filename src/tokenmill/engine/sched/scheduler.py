"""Continuous batching: who runs this step, and with how many tokens.

One token budget per step (``max_num_batched_tokens``) serves decodes and
prefill chunks alike. Running decodes are served first; then waiting requests
join in FCFS order (or the order of ``--scheduling-policy``: engine/sched/fairness.py)
as the batching policy allows (matching their cached
prefix); then prefill chunks share what is left of the budget: requests that
joined in the last few steps go shortest remaining prompt first, so one that
is mostly a cache hit is not stuck behind a long prompt's chunks, and older
ones go first in admission order, so nobody starves. When the pool runs out, the newest running
request (or the queue order's victim) is preempted by recompute: its blocks go back (full ones stay in the
prefix cache, so recompute is often a cache hit) and it re-enters the queue
at the front. A step that preempted for blocks admits nobody new (no thrash);
one that preempted to make room for a better-placed waiting request
(fairness.py) admits it.

In-flight prefix sharing: a burst of requests behind one system prompt or
document would otherwise each compute the shared blocks that the first one
has not finished yet. So before a prefill chunk is given out, the request
picks up any blocks that others finished since it last looked (the prefix
cache is walked again, not only at admission), and a request whose next
prompt block is still being computed by an older running request waits for
it instead of computing it again, as long as that producer (or the producer
it waits for in turn) was scheduled in the same step. A waiter does not sit
the step out: it takes the blocks its producer completes in this step (every
layer stores the step's K/V before its attention reads the pool), and when
its next block is then its own it computes it in the same step, so a budget
that holds a prefix and the burst's own tokens runs the whole burst in one
step. Waits only point at older requests, so they cannot form a cycle; a
producer that is preempted or gets no budget makes no progress, and its
waiters then compute for themselves. Admission spends the budget that the new
request's first chunk will need (nothing when it will wait), so a burst joins
together when it shares a prefix and one by one when it does not.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ...settings.config import SchedulerConfig
from .batching import BatchingPolicy, make_policy
from ..kv.block_pool import BlockPool
from .fairness import QueueHead, QueueOrder, make_queue_order
from ..kv.prefix_cache import PrefixCache
from ..request import Placement, Request, RequestStatus


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
        device_type: str = "cpu",
        kv_window: int | None = None,
    ) -> None:
        self.config = config
        # Every layer slides (model.kv_window): blocks behind the window are released while the
        # request runs (_drop_behind_window), and the prefix cache indexes at most a window's
        # blocks of a path (more could not be released without breaking the tree's paths).
        self.kv_window = kv_window
        self.device_type = device_type  # picks the default token budget (SchedulerConfig.token_budget)
        self.block_size = block_size
        self.pool = pool
        self.prefix_cache = prefix_cache
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
        self._budget = 0  # tokens left in the step being scheduled
        self._lesser: tuple[int, int] | None = None  # worse classes' prefill tokens left (_chunk)
        self._now = 0.0
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
        self._release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = request.finish_reason or reason
        if self.order is not None:
            self.order.left(request)

    def _release(self, request: Request) -> None:
        self.pool.release(request.block_table[request.num_dropped_blocks:])
        request.block_table = []
        request.num_dropped_blocks = 0
        request.num_computed_tokens = 0
        request.num_cached_blocks = 0

    def _preempt(self, request: Request) -> None:
        self._release(request)
        request.spec_token_ids = []
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
        if request.first_scheduled_time is None:  # counted once it first runs (_started)
            request.num_cached_tokens = request.num_computed_tokens

    def _extend_prefix(self, request: Request) -> None:
        """Pick up prompt blocks that other requests finished since ``request`` last
        walked the prefix cache. Progress inside the first uncached block (less than a
        block of tokens) is dropped when a cached copy of that block is found. Not for
        a request still owed prompt logprobs (cached positions have no logits)."""
        if self.prefix_cache is None or request.wants_prompt_logprobs:
            return
        done = request.num_cached_blocks
        if request.num_computed_tokens >= request.num_prompt_tokens or \
                request.num_computed_tokens >= (done + 1) * self.block_size:
            return  # past its prompt, or a partial block it has not indexed yet (cannot happen mid-prompt)
        max_blocks = (request.num_tokens - 1) // self.block_size
        if max_blocks <= done:
            return
        blocks = self.prefix_cache.match(request.all_token_ids, max_blocks, request.adapter_id)
        if len(blocks) > done:
            self._adopt(request, done, blocks[done:])

    def _adopt(self, request: Request, start: int, blocks: list[int], indexed: bool = True) -> None:
        """Make ``blocks`` the request's prompt blocks ``start, start + 1, ...`` (computed by
        someone else), in place of its own copies; they count as prefix-cache hits.

        ``indexed``: the blocks are on the prefix cache's path already (a match). Blocks an
        older request completes in this step (``_share_in_step``) are not: the request
        indexes them itself after the step, like blocks it computed, so that when the
        tree holds another copy of one (identical content finished twice in one step) the
        request swaps to that copy as its producer does, and its blocks stay a tree path."""
        assert self.prefix_cache is not None
        for offset, block in enumerate(blocks):
            index = start + offset
            self.pool.acquire(block)
            if index < len(request.block_table):
                self.pool.release([request.block_table[index]])
                request.block_table[index] = block
            else:
                request.block_table.append(block)
        end = start + len(blocks)
        gained = end * self.block_size - request.num_computed_tokens
        if indexed:
            request.num_cached_blocks = end
        request.num_computed_tokens = end * self.block_size
        if request.first_scheduled_time is None:
            request.num_cached_tokens = request.num_computed_tokens
        else:  # already counted at its start: count the new hits now
            request.num_cached_tokens += gained
            self.prefix_cache.stats.hit_tokens += gained

    def _block_hashes(self, request: Request) -> list[int]:
        """Chained hashes of the prompt's full blocks (block i's covers tokens 0 .. end of i)."""
        if request.prompt_block_hashes is None:
            # seeded by the adapter: K/V under different adapters are never shared
            bs, ids = self.block_size, request.prompt_token_ids
            h = hash(("adapter", request.adapter_id)) if request.adapter_id else 0
            hashes: list[int] = []
            for i in range(len(ids) // bs):
                h = hash((h, tuple(ids[i * bs : (i + 1) * bs])))
                hashes.append(h)
            request.prompt_block_hashes = hashes
        return request.prompt_block_hashes

    def _claims(self, requests: list[Request]) -> dict[int, Request]:
        """Block hash -> the oldest of ``requests`` (oldest first) that still has that
        prompt block to compute."""
        claimed: dict[int, Request] = {}
        for request in requests:
            for h in self._block_hashes(request)[request.num_computed_tokens // self.block_size:]:
                claimed.setdefault(h, request)
        return claimed

    def _producer(self, request: Request, claimed: dict[int, Request]) -> Request | None:
        """The older request computing ``request``'s next prompt block, if any: the one
        it should wait for (never for the block holding its last prompt token)."""
        hashes = self._block_hashes(request)
        nxt = request.num_computed_tokens // self.block_size
        if (nxt >= len(hashes) or (nxt + 1) * self.block_size >= request.num_tokens
                or request.wants_prompt_logprobs):
            return None
        producer = claimed.get(hashes[nxt])
        return producer if producer is not request else None

    def _producers(self, requests: list[Request]) -> dict[Request, Request]:
        """For each prefilling request (oldest first), the oldest older request that has
        its next prompt block still to compute: the one it should wait for."""
        if self.prefix_cache is None:
            return {}
        claimed = self._claims(requests)
        waits = {r: p for r in requests if (p := self._producer(r, claimed)) is not None}
        return waits

    def _finishing_blocks(self, batch: ScheduledBatch) -> dict[int, tuple[Request, int]]:
        """Prompt blocks this step completes: block hash -> (request, block index)."""
        finishing: dict[int, tuple[Request, int]] = {}
        for request, num_new in batch.items:
            self._note_finishing(finishing, request, num_new)
        return finishing

    def _note_finishing(self, finishing: dict[int, tuple[Request, int]], request: Request, num_new: int) -> None:
        hashes = self._block_hashes(request)
        first = request.num_computed_tokens // self.block_size
        last = min(len(hashes), (request.num_computed_tokens + num_new) // self.block_size)
        for index in range(first, last):
            finishing.setdefault(hashes[index], (request, index))

    def _share_in_step(self, request: Request, finishing: dict[int, tuple[Request, int]]) -> None:
        """Take the prompt blocks that older requests scheduled in this step will have
        computed when it ends. Every layer stores the whole step's K/V before any of its
        attention reads the pool, so ``request``'s own tokens can then run in the same
        step and read those blocks. A block is taken only from an older request (a
        producer is never preempted while its newer waiters keep their places) whose
        previous block is the request's own previous block (the same prefix) and
        whose tokens are the same."""
        bs = self.block_size
        hashes = self._block_hashes(request)
        start = request.num_computed_tokens // bs
        limit = min(len(hashes), (request.num_tokens - 1) // bs)
        age = self._age(request)
        taken: list[int] = []
        for index in range(start, limit):
            owner = finishing.get(hashes[index])
            if owner is None:
                break
            producer, at = owner
            previous = taken[-1] if taken else (request.block_table[index - 1] if index else None)
            if (at != index or self._age(producer) >= age or producer.adapter_id != request.adapter_id
                    or (index and producer.block_table[index - 1] != previous)
                    or producer.prompt_token_ids[index * bs:(index + 1) * bs]
                    != request.prompt_token_ids[index * bs:(index + 1) * bs]):
                break
            taken.append(producer.block_table[index])
        if taken:
            self._adopt(request, start, taken, indexed=False)

    def _started(self, request: Request) -> None:
        """First tokens scheduled: the queue wait ends, the prefix hit is final."""
        request.first_scheduled_time = self._now
        if self.order is not None:
            key = self.order.queue_key(request.placement)
            self._starts[key] = self._starts.get(key, 0) + 1
        if self.prefix_cache is not None:
            self.prefix_cache.stats.queried_tokens += request.num_prompt_tokens
            self.prefix_cache.stats.hit_tokens += request.num_cached_tokens

    # -- the step --------------------------------------------------------
    def schedule(self, now: float | None = None) -> ScheduledBatch:
        now = time.monotonic() if now is None else now
        self._now = now
        self._step += 1
        batch = ScheduledBatch()
        self._budget = self.token_budget

        # 1. Running decodes, in admission order: one token each, plus the speculative
        #    proposals made for this step while the budget and free blocks hold them
        #    (proposals never cost another request its place).
        proposals = {r: r.spec_token_ids for r in self.running if r.spec_token_ids}
        for request in self.running:
            request.spec_token_ids = []
        for request in [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]:
            if self._budget <= 0:
                break
            if request.status is RequestStatus.RUNNING:
                draft = proposals.get(request, [])
                if draft and self._budget > len(draft) and self._blocks_short(
                        request, request.num_tokens + len(draft)) <= self.pool.num_available:
                    request.spec_token_ids = draft
                self._schedule(batch, request, 1 + len(request.spec_token_ids))

        # 2. Waiting requests join, FCFS, in a step that preempted nobody. They walk
        #    the prefix cache now, so step 3 knows what is left of their prompts.
        admitted: list[Request] = []
        displaced, head = self._make_room(batch) if self.order is not None and not batch.preempted else (None, None)
        if not batch.preempted or displaced is not None:
            self.policy.begin_step(self.running, self.waiting, now)
            admit_budget = self._budget  # what admitted requests' first chunks will take
            prefilling = self._prefilling([])
            while self.waiting and admit_budget > 0 and len(self.running) < self.config.max_num_seqs:
                admissible = [r for r in self.waiting if not r.held_for_scorer]  # see Request.prompt_scorer
                if not admissible:
                    break
                if head is not None and head.held_for_scorer:
                    head = None
                request = (admissible[0] if self.order is None else head  # the one room was made for
                           or self.order.next_to_admit(admissible, now, self.running))
                head = None
                assert request is not None
                if request is displaced or not self.policy.may_admit(request):  # not back in its own step
                    break
                self._match_prefix(request)
                first_chunk = min(request.num_tokens - request.num_computed_tokens, self._budget)
                if self._blocks_short(request, request.num_computed_tokens + first_chunk) > self.pool.num_available:
                    self._release(request)  # give back the prefix hit while it waits
                    break
                self.waiting.remove(request)
                request.status = RequestStatus.RUNNING
                request.admitted_step = self._step
                self.running.append(request)
                admitted.append(request)
                prefilling.append(request)
                if request not in self._producers(prefilling):
                    admit_budget -= first_chunk

        # 3. Prefill chunks. Requests that joined within the last
        #    ``prefill_starvation_steps`` steps go shortest remaining prompt first: a
        #    prompt that is mostly cached costs a few tokens and should not wait behind
        #    a long prefill. Older ones come first, in admission order: nobody starves.
        #    A request whose next prompt block an older one is computing waits for it
        #    (see the module docstring) when that producer runs in this step.
        bound = self.config.prefill_starvation_steps
        pending = self._prefilling(admitted)
        self._lesser = None
        if self.order is not None:
            pending = self.order.prefills_now(pending, now)
            self._lesser = self.order.lesser_prefill_tokens(now, self.token_budget)
        for request in pending:
            self._extend_prefix(request)
        waits = self._producers(pending)
        pending.sort(key=lambda r: (1, r.num_tokens - r.num_computed_tokens)
                     if self._step - r.admitted_step < bound else (0, r.admitted_step))
        deferred: list[Request] = []
        for request in pending:
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted (or sent back) earlier in this loop
            if request in waits:
                deferred.append(request)
                continue
            if self._budget <= 0:
                break
            num_new = self._chunk(request)
            if num_new > 0:
                self._schedule(batch, request, num_new)
        scheduled = {r for r, _ in batch.items}
        progressing: dict[Request, bool] = {}

        def progresses(r: Request) -> bool:  # scheduled now, or waiting on one that is
            if r not in progressing:
                progressing[r] = r in scheduled or (r in waits and progresses(waits[r]))
            return progressing[r]

        finishing = self._finishing_blocks(batch) if deferred else {}
        claimed = self._claims(pending) if deferred else {}
        for request in sorted(deferred, key=self._age):
            if request.status is not RequestStatus.RUNNING:
                continue
            if progresses(waits[request]):
                # Its producer runs now: take what this step completes, and compute the
                # rest in the same step unless its next block is still someone else's.
                self._share_in_step(request, finishing)
                producer = self._producer(request, claimed)
                if producer is not None and progresses(producer):
                    waits[request] = producer
                    continue
                progressing[request] = False
                if self._budget <= 0:
                    continue
            else:
                del waits[request]  # its producer is stalled: compute for itself
                progressing[request] = False
                if self._budget <= 0:
                    continue
            num_new = self._chunk(request)
            if num_new <= 0:
                continue
            self._schedule(batch, request, num_new)
            if request.status is RequestStatus.RUNNING:
                scheduled.add(request)
                progressing[request] = True
                self._note_finishing(finishing, request, num_new)
        if self.order is not None:
            self.queue_heads = self.order.queue_heads(self.waiting, self._starts, self._freed,
                                                      len(self.running) >= self.config.max_num_seqs)
        if self.prefix_cache is not None:
            self.prefix_cache.flush_tier()  # blocks moved to disk this step leave the pool before it runs
        return batch

    def _chunk(self, request: Request) -> int:
        """The prompt tokens ``request`` computes this step: what is left of it, within
        the step's budget and, for a class worse than an active one, within what is
        left of those classes' share (``QueueOrder.lesser_prefill_tokens``)."""
        num_new = min(request.num_tokens - request.num_computed_tokens, self._budget)
        if self._lesser is not None and self.order is not None:
            best, tokens = self._lesser
            if request.placement.priority_class > best and not self.order.overdue(request, self._now):
                num_new = min(num_new, tokens)
                self._lesser = best, tokens - max(0, num_new)
        return num_new

    def _age(self, request: Request) -> tuple[int, int]:
        """Older first: admission step, then place in the running list (FCFS)."""
        return request.admitted_step, self.running.index(request) if request in self.running else len(self.running)

    def _prefilling(self, admitted: list[Request]) -> list[Request]:
        """Running requests with prompt (or recompute) tokens left, oldest first."""
        return [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1 or r in admitted]

    def _schedule(self, batch: ScheduledBatch, request: Request, num_new: int) -> None:
        """Give ``request`` ``num_new`` tokens this step, growing its block table;
        when the pool is short, preempt the newest running requests until it fits
        (or until it is itself the newest and goes back to the queue)."""
        while not self._grow(request, request.num_computed_tokens + num_new):
            if self.order is None:
                victim = self.running.pop()
            else:
                victim = self.order.victim(self._preemptible(), self._now)
                self.running.remove(victim)
            self._evict(batch, victim)
            if victim is request:
                return
        batch.items.append((request, num_new))
        self._budget -= num_new
        if request.first_scheduled_time is None:
            self._started(request)

    def _evict(self, batch: ScheduledBatch, victim: Request) -> None:
        """``victim`` (already out of ``running``) goes back to the queue; tokens it was
        given this step are taken back."""
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

    def _make_room(self, batch: ScheduledBatch) -> tuple[Request | None, Request | None]:
        """The request to admit next has no room (no sequence slot, or not the blocks of
        its first chunk) but outranks someone running (fairness.py: ``outranks``):
        preempt one such request and return it with the one it made room for; the step
        then still admits, that one first (the preemption was for it, not for a lack
        of blocks)."""
        assert self.order is not None
        head = self.order.next_to_admit(self.waiting, self._now, self.running)
        if head is None or not self.running or self._budget <= 0:
            return None, None
        first_chunk = min(head.num_tokens, self._budget)
        if (len(self.running) < self.config.max_num_seqs
                and -(-first_chunk // self.block_size) <= self.pool.num_available):
            return None, None
        slots = self.order.slots(self.running)
        worse = [r for r in self._preemptible() if self.order.outranks(head, r, self._now, slots)]
        if not worse:
            return None, None
        victim = self.order.victim(worse, self._now)
        self.running.remove(victim)
        self._evict(batch, victim)
        return victim, head

    def _send_back(self, request: Request) -> None:
        """Undo an admission that could not get blocks: back to the queue's front."""
        self._release(request)
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

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
            self._cache_full_blocks(request)
            self._drop_behind_window(request)

    def accept_proposals(self, request: Request, accepted: int) -> None:
        """``accepted`` proposals of ``request`` (already appended to its output) were
        right: their K/V from the verify step stands; index what became full blocks."""
        if accepted and request.status is RequestStatus.RUNNING:
            request.num_computed_tokens += accepted
            self._cache_full_blocks(request)
            self._drop_behind_window(request)

    def _cache_full_blocks(self, request: Request) -> None:
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

    def _drop_behind_window(self, request: Request) -> None:
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

    def abort(self, request: Request) -> None:
        self.finish(request, "abort")

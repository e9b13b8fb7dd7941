"""In-flight prefix sharing: prompt blocks that another running request is computing.

A burst of requests behind one system prompt or document would otherwise each
compute the shared blocks that the first one has not finished yet. So before a
prefill chunk is given out, the request picks up any blocks that others
finished since it last looked (``extend_prefix``: the prefix cache is walked
again, not only at admission), and a request whose next prompt block is still
being computed by an older running request waits for it instead of computing
it again (``producers``), as long as that producer (or the producer it waits
for in turn) was scheduled in the same step. A waiter does not sit the step
out (``serve_waiters``): it takes the blocks its producer completes in this
step (every layer stores the step's K/V before its attention reads the pool),
and when its next block is then its own it computes it in the same step, so a
budget that holds a prefix and the burst's own tokens runs the whole burst in
one step. Waits only point at older requests, so they cannot form a cycle; a
producer that is preempted or gets no budget makes no progress, and its
waiters then compute for themselves. Admission spends the budget that the new
request's first chunk will need (nothing when it will wait), so a burst joins
together when it shares a prefix and one by one when it does not.

Without a prefix cache nothing is shared: ``producers`` names nobody.
"""
from __future__ import annotations

from typing import Callable

from ..kv.block_pool import BlockPool
from ..kv.prefix_cache import PrefixCache
from ..request import Request, RequestStatus
from .plan import ScheduledBatch, StepPlan

Age = Callable[[Request], tuple[int, int]]  # older first (Scheduler._age)
# prompt block hash -> (the request completing it in this step, its index there)
Finishing = dict[int, tuple[Request, int]]


class InflightSharing:
    def __init__(self, pool: BlockPool, prefix_cache: PrefixCache | None, block_size: int) -> None:
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.block_size = block_size

    # -- blocks others finished ------------------------------------------
    def extend_prefix(self, request: Request) -> None:
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

    # -- who waits for whom ----------------------------------------------
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

    def producers(self, requests: list[Request]) -> dict[Request, Request]:
        """For each prefilling request (oldest first), the oldest older request that has
        its next prompt block still to compute: the one it should wait for."""
        if self.prefix_cache is None:
            return {}
        claimed = self._claims(requests)
        waits = {r: p for r in requests if (p := self._producer(r, claimed)) is not None}
        return waits

    # -- blocks completed in this step -----------------------------------
    def _finishing_blocks(self, batch: ScheduledBatch) -> Finishing:
        """Prompt blocks this step completes: block hash -> (request, block index)."""
        finishing: Finishing = {}
        for request, num_new in batch.items:
            self._note_finishing(finishing, request, num_new)
        return finishing

    def _note_finishing(self, finishing: Finishing, request: Request, num_new: int) -> None:
        hashes = self._block_hashes(request)
        first = request.num_computed_tokens // self.block_size
        last = min(len(hashes), (request.num_computed_tokens + num_new) // self.block_size)
        for index in range(first, last):
            finishing.setdefault(hashes[index], (request, index))

    def _share_in_step(self, request: Request, finishing: Finishing, age: Age) -> None:
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
        mine = age(request)
        taken: list[int] = []
        for index in range(start, limit):
            owner = finishing.get(hashes[index])
            if owner is None:
                break
            producer, at = owner
            previous = taken[-1] if taken else (request.block_table[index - 1] if index else None)
            if (at != index or age(producer) >= mine or producer.adapter_id != request.adapter_id
                    or (index and producer.block_table[index - 1] != previous)
                    or producer.prompt_token_ids[index * bs:(index + 1) * bs]
                    != request.prompt_token_ids[index * bs:(index + 1) * bs]):
                break
            taken.append(producer.block_table[index])
        if taken:
            self._adopt(request, start, taken, indexed=False)

    def serve_waiters(self, plan: StepPlan, pending: list[Request], waits: dict[Request, Request],
                      deferred: list[Request], age: Age, chunk: Callable[[Request], int],
                      give: Callable[[StepPlan, Request, int], None]) -> None:
        """The prefill chunks of the requests that waited for a producer (``deferred``,
        out of ``pending``), oldest first, once every other chunk is given out. One whose
        producer runs in this step takes what the step completes and computes the rest
        in the same step unless its next block is still someone else's; one whose
        producer is stalled computes for itself. ``chunk`` sizes a request's tokens and
        ``give`` schedules them (the scheduler's, preempting when the pool is short)."""
        scheduled = {r for r, _ in plan.batch.items}
        progressing: dict[Request, bool] = {}

        def progresses(r: Request) -> bool:  # scheduled now, or waiting on one that is
            if r not in progressing:
                progressing[r] = r in scheduled or (r in waits and progresses(waits[r]))
            return progressing[r]

        finishing = self._finishing_blocks(plan.batch)
        claimed = self._claims(pending)
        for request in sorted(deferred, key=age):
            if request.status is not RequestStatus.RUNNING:
                continue
            if progresses(waits[request]):
                self._share_in_step(request, finishing, age)
                producer = self._producer(request, claimed)
                if producer is not None and progresses(producer):
                    waits[request] = producer
                    continue
            else:
                del waits[request]  # its producer is stalled: compute for itself
            progressing[request] = False
            if plan.budget <= 0:
                continue
            num_new = chunk(request)
            if num_new <= 0:
                continue
            give(plan, request, num_new)
            if request.status is RequestStatus.RUNNING:
                scheduled.add(request)
                progressing[request] = True
                self._note_finishing(finishing, request, num_new)

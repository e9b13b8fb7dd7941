"""Property-based tests of the block pool, prefix cache and scheduler.

A simulated engine (no model) drives the real scheduler with random arrivals,
shared and unshared prefixes, lengths, aborts and pool sizes. A shadow copy of
every block's contents (which token sits in which slot) checks that a cache
hit never hands out a block that was evicted or rewritten, and the DESIGN.md
invariants are checked after every step.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.settings.config import SchedulerConfig
from tokenmill.engine.kv.block_pool import BlockPool
from tokenmill.engine.kv.prefix_cache import PrefixCache
from tokenmill.engine.request import DEFAULT_PLACEMENT, Placement, Request, SamplingParams
from tokenmill.engine.sched.scheduler import Scheduler

BLOCK = 4


class Sim:
    """``policy`` and ``bound``: the scheduler's queue order (engine/sched/fairness.py)."""

    def __init__(self, num_blocks: int, caching: bool, budget: int, max_seqs: int, policy: str = "fcfs",
                 bound: float = 30.0, window: int | None = None) -> None:
        self.cache = PrefixCache(BLOCK) if caching else None
        self.pool = BlockPool(num_blocks, self.cache)
        config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, scheduling_policy=policy,
                                 starvation_bound_s=bound)
        self.sched = Scheduler(config, BLOCK, self.pool, self.cache, kv_window=window)
        self.window = window  # every layer slides: only the last `window` positions are read
        self.shadow: dict[int, dict[int, int]] = {}  # block -> {offset: token}
        self.active: list[Request] = []
        self.steps = 0

    def add(self, rid: str, prompt: list[int], max_tokens: int, placement: Placement | None = None,
            arrival_time: float | None = None) -> bool:
        req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens,
                      placement=placement or DEFAULT_PLACEMENT)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        try:
            self.sched.add(req)
        except ValueError:
            return False
        self.active.append(req)
        return True

    def _read_from(self, computed: int) -> int:
        """The first position the next query of a request with ``computed`` tokens reads."""
        return 0 if self.window is None else max(0, computed + 1 - self.window)

    def check_hits(self, req: Request) -> None:
        """Every computed token of a scheduled request that its next query reads is in its
        blocks, as written."""
        for pos in range(self._read_from(req.num_computed_tokens), req.num_computed_tokens):
            block = req.block_table[pos // BLOCK]
            assert self.shadow.get(block, {}).get(pos % BLOCK) == req.token_at(pos), (
                f"{req.request_id}: block {block} slot {pos % BLOCK} does not hold token {pos}")

    def step(self, next_token: int) -> None:
        before = {r: (r.num_computed_tokens, list(r.block_table)) for r in self.sched.running}
        batch = self.sched.schedule()
        # Slots a request still running counted as computed before this step, in a block it
        # still holds there: never rewritten (a request that swapped its partial block for a
        # cached copy gave the old one up).
        relied_on = {(table[pos // BLOCK], pos % BLOCK) for r, (computed, table) in before.items()
                     if r in self.sched.running for pos in range(self._read_from(computed), computed)
                     if pos // BLOCK < len(r.block_table) and r.block_table[pos // BLOCK] == table[pos // BLOCK]}
        held = {b for r in self.sched.running for b in r.block_table[r.num_dropped_blocks:]}
        for req, num_new in batch.items:  # every write of a step lands before any read (as in a layer)
            start = req.num_computed_tokens
            for pos in range(start, start + num_new):
                block = req.block_table[pos // BLOCK]
                assert (block, pos % BLOCK) not in relied_on, f"write into block {block} that others read"
                if self.pool.ref_counts[block] > 1:  # shared in this step: the others read it after
                    assert all(pos // BLOCK < len(r.block_table) and r.block_table[pos // BLOCK] == block
                               for r in self.sched.running if block in r.block_table), "shared at another place"
                self.shadow.setdefault(block, {})[pos % BLOCK] = req.token_at(pos)
        for req, _ in batch.items:
            self.check_hits(req)
        assert len(held) <= self.pool.num_blocks
        self.sched.after_step(batch)
        for req, _ in batch.items:  # behind the window, only the indexed path may wait (then all of it goes)
            if self.window is not None and req in self.sched.running:
                behind = min((req.num_computed_tokens + 1 - self.window) // BLOCK, len(req.block_table) - 1)
                assert req.num_dropped_blocks >= behind or behind < req.num_cached_blocks
        for req, _ in batch.items:
            if req.num_computed_tokens == req.num_tokens:
                req.output_token_ids.append(next_token)
                if len(req.output_token_ids) >= req.max_tokens:
                    self.sched.finish(req, "length")
        self.steps += 1
        self.check()

    def check(self) -> None:
        self.pool.check_invariants()
        if self.cache is not None:
            self.cache.check_invariants(self.pool.ref_counts)
        for req in self.sched.running:
            assert len(req.block_table) * BLOCK >= req.num_computed_tokens
            if self.window is not None:
                assert req.num_cached_blocks <= self.window // BLOCK

    def drain(self, limit: int) -> None:
        for i in range(limit):
            if not self.sched.has_work():
                break
            self.step(i % 3)
        assert not self.sched.has_work(), "scheduler did not finish its work (deadlock or livelock)"
        self.pool.check_invariants(idle=True)
        if self.cache is not None:
            self.cache.check_invariants(self.pool.ref_counts)
        assert self.pool.num_free + self.pool.num_cached_idle == self.pool.num_blocks


prefixes = st.lists(st.integers(0, 5), min_size=0, max_size=14)
request_st = st.tuples(
    st.integers(0, 3),  # which shared prefix
    st.lists(st.integers(0, 5), min_size=1, max_size=10),  # own suffix
    st.integers(1, 12),  # max tokens
    st.integers(0, 6),  # arrival step
    st.one_of(st.none(), st.integers(0, 20)),  # abort at step
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shared=st.lists(prefixes, min_size=4, max_size=4),
    requests=st.lists(request_st, min_size=1, max_size=12),
    num_blocks=st.integers(4, 40),
    caching=st.booleans(),
    budget=st.integers(1, 24),
    max_seqs=st.integers(1, 6),
)
def test_random_workloads_keep_invariants(shared, requests, num_blocks, caching, budget, max_seqs):
    sim = Sim(num_blocks, caching, budget, max_seqs)
    _arrive(sim, shared, sorted(enumerate(requests), key=lambda x: x[1][3]), steps=8)
    sim.drain(limit=2000)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shared=st.lists(prefixes, min_size=4, max_size=4),
    requests=st.lists(request_st, min_size=1, max_size=10),
    num_blocks=st.integers(4, 40),
    caching=st.booleans(),
    budget=st.integers(1, 24),
    max_seqs=st.integers(1, 6),
    window=st.integers(2, 14),
)
def test_sliding_window_workloads_free_blocks_behind_the_window(shared, requests, num_blocks, caching, budget,
                                                                 max_seqs, window):
    """Every layer slides: a running request releases the blocks no query of it reads again
    (the prefix cache's indexed path, at most a window's blocks, once all of it is behind), and
    what it still reads is intact, with prefix hits, in-step sharing, preemption and aborts."""
    sim = Sim(num_blocks, caching, budget, max_seqs, window=window)
    _arrive(sim, shared, sorted(enumerate(requests), key=lambda x: x[1][3]), steps=8)
    sim.drain(limit=2000)


def _arrive(sim: Sim, shared: list[list[int]], arrivals: list, steps: int) -> list[list[int]]:
    """Add (index, (prefix, suffix, max tokens, arrival step, abort step)) requests at their
    steps, abort them at theirs, step the simulation; returns the prompts accepted."""
    aborts: dict[int, list[str]] = {}
    added: list[list[int]] = []
    for step in range(steps):
        for idx, (which, suffix, max_tokens, arrival, abort_at) in arrivals:
            if arrival == step and sim.add(f"r{idx}", shared[which] + suffix, max_tokens):
                added.append(shared[which] + suffix)
                if abort_at is not None:
                    aborts.setdefault(abort_at, []).append(f"r{idx}")
        for rid in aborts.pop(step, []):
            for req in sim.active:
                if req.request_id == rid:
                    sim.sched.abort(req)
        if sim.sched.has_work():
            sim.step(step % 4)
    return added


@settings(max_examples=60, deadline=None)
@given(seq=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 6)), min_size=1, max_size=20),
       num_blocks=st.integers(3, 12))
def test_prefix_cache_hits_are_exact_and_evict_lru(seq, num_blocks):
    """Sequential requests over 3 documents: hits serve exactly the cached
    tokens; the pool never overflows; after reset, nothing stays cached."""
    docs = [[d] * 9 + [7, 8, 9] for d in range(3)]
    sim = Sim(num_blocks, True, 64, 4)
    for i, (doc, tail) in enumerate(seq):
        prompt = docs[doc] + [doc] * tail
        if not sim.add(f"q{i}", prompt, 2):
            continue
        sim.drain(limit=200)
    assert sim.cache is not None
    stats = sim.cache.stats
    assert 0 <= stats.hit_tokens <= stats.queried_tokens
    freed = sim.cache.evict_all_idle()
    for block in freed:
        sim.pool.return_evicted(block)
    assert sim.cache.num_cached == 0 and sim.pool.num_free == num_blocks


def test_repeated_prompt_hits_cache_and_caps_at_prompt_minus_one():
    sim = Sim(32, True, 64, 4)
    prompt = list(range(12))  # exactly 3 blocks
    sim.add("a", prompt, 3)
    sim.drain(100)
    sim.add("b", prompt, 3)
    req = sim.active[-1]
    sim.step(0)
    # 12 tokens: at most 11 reusable -> 2 full blocks (8 tokens), last block recomputed.
    assert req.num_cached_tokens == 8
    sim.drain(100)


def test_lru_evicts_oldest_idle_leaf_first():
    cache = PrefixCache(BLOCK)
    pool = BlockPool(6, cache)
    sim = Sim.__new__(Sim)
    sim.cache, sim.pool = cache, pool
    sim.sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), BLOCK, pool, cache)
    sim.shadow, sim.active, sim.steps, sim.window = {}, [], 0, None
    sim.add("old", [1] * 8 + [2], 1)
    sim.drain(50)
    sim.add("new", [3] * 8 + [4], 1)
    sim.drain(50)
    # Both documents cached (2 blocks each) -> 4 idle, 2 free; a 3-block request takes the
    # free ones and evicts one block: the least recently used leaf, the tail of "old".
    assert cache.num_idle == 4 and pool.num_free == 2
    sim.add("big", [5] * 12, 1)
    sim.step(0)
    assert len(cache.match([3] * 8, 2)) == 2 and len(cache.match([1] * 8, 2)) == 1
    sim.drain(50)


def test_mostly_cached_prompt_is_not_stuck_behind_a_long_prefill():
    """A prompt that is a cache hit gets its few tokens in the next step, ahead of
    the remaining chunks of a long prompt admitted before it."""
    sim = Sim(64, True, 8, 4)
    doc = list(range(1, 17))  # 4 blocks
    sim.add("warm", doc + [40], 1)
    sim.drain(50)
    sim.add("long", [50 + i for i in range(40)], 1)
    sim.step(0)  # "long" takes the whole 8-token budget
    sim.add("hit", doc + [41, 42], 1)
    batch = sim.sched.schedule()
    scheduled = {r.request_id: n for r, n in batch.items}
    assert scheduled["hit"] == 2 and scheduled["long"] == 6
    sim.sched.after_step(batch)


def test_a_starved_long_prefill_goes_first_after_the_bound():
    """Short prompts arriving every step cannot starve a long one: once it has been
    running ``prefill_starvation_steps`` steps it goes first."""
    sim = Sim(256, False, 4, 16)
    sim.add("long", list(range(100, 140)), 1)
    long = sim.active[-1]
    sim.step(0)
    progress = []
    for i in range(12):
        for j in range(2):
            sim.add(f"s{i}-{j}", [i, j], 1)  # 2-token prompts: shorter than what is left of "long"
        before = long.num_computed_tokens
        sim.step(0)
        progress.append(1 if long.is_finished else long.num_computed_tokens - before)
    bound = sim.sched.config.prefill_starvation_steps
    runs, run = [], 0
    for p in progress:
        run = run + 1 if p == 0 else 0
        runs.append(run)
    assert max(runs) <= bound and long.is_finished
    sim.drain(500)


def test_prefix_stats_count_each_request_once_even_when_it_waits_for_blocks():
    sim = Sim(6, True, 64, 4)
    sim.add("a", list(range(12)) + [99], 8)  # 4 blocks, grows to 6
    for _ in range(5):
        sim.step(0)  # "a" holds 5 blocks now
    assert sim.add("b", list(range(12)) + [98] * 8, 1)  # hit of 3 blocks, needs 2 more: 1 is free
    for _ in range(2):
        sim.step(0)
    assert sim.active[1].first_scheduled_time is None  # it did wait
    sim.drain(100)
    stats = sim.cache.stats
    assert stats.queried_tokens == 13 + 20
    assert stats.hit_tokens == sim.active[1].num_cached_tokens == 12


def _distinct_prompt_tokens(prompts: list[list[int]]) -> int:
    """Tokens in the trie of the prompts: what a perfect prefix cache computes."""
    seen: set[tuple[int, ...]] = set()
    for p in prompts:
        for i in range(1, len(p) + 1):
            seen.add(tuple(p[:i]))
    return len(seen)


def test_burst_sharing_a_prefix_computes_it_once():
    """16 requests at once behind one 64-token prefix: the first computes it, the rest
    wait for its blocks instead of computing them again (in-flight prefix sharing)."""
    sim = Sim(400, True, 32, 16)
    prefix = [7] * 3 + list(range(61))
    prompts = [prefix + [100 + i] * 8 for i in range(16)]
    for i, p in enumerate(prompts):
        sim.add(f"b{i}", p, 4)
    sim.drain(500)
    computed = sim.sched.num_prompt_tokens_computed
    assert computed < 64 + 16 * 8 + 2 * BLOCK, computed  # the prefix once, each own part once
    stats = sim.cache.stats
    assert stats.queried_tokens == 16 * 72
    assert stats.hit_tokens == stats.queried_tokens - computed


def test_a_burst_behind_a_prefix_runs_in_one_step_when_the_budget_holds_it():
    """With a budget that holds the prefix and every request's own tokens, the burst's
    prompts all run in the first step: the waiters take the blocks their producer
    completes in that step and compute their own tokens after it in the same step."""
    sim = Sim(400, True, 64 + 16 * 8, 16)
    prefix = [7] * 3 + list(range(61))
    for i in range(16):
        sim.add(f"b{i}", prefix + [100 + i] * 8, 4)
    sim.step(0)
    assert sim.sched.num_prompt_tokens_computed == 64 + 16 * 8
    assert all(r.num_computed_tokens == r.num_prompt_tokens for r in sim.active)
    assert all(r.block_table[:16] == sim.active[0].block_table[:16] for r in sim.active)
    sim.drain(100)
    assert sim.cache.stats.hit_tokens == 15 * 64


def test_a_waiter_takes_the_blocks_its_producer_completes_and_waits_for_the_rest():
    """A budget smaller than the prefix: the waiter picks up each chunk's blocks in the
    step that computes them, and computes nothing of the prefix itself."""
    sim = Sim(400, True, 32, 4)
    prefix = list(range(64))  # 16 blocks: two 32-token chunks
    sim.add("p", prefix + [90] * 8, 2)
    sim.add("w", prefix + [91] * 8, 2)
    sim.step(0)  # "p" takes the whole budget; "w" joins next step
    sim.step(0)  # "p" computes the prefix's second half; "w" takes all of it
    producer, waiter = sim.active
    assert producer.num_computed_tokens == 64 and waiter.num_computed_tokens == 64
    assert waiter.block_table[:16] == producer.block_table[:16]
    assert sim.sched.num_prompt_tokens_computed == 64  # taken, not computed
    sim.drain(100)
    assert sim.sched.num_prompt_tokens_computed == 64 + 2 * 8


def test_a_producer_that_stalls_releases_its_waiters():
    """A waiter only waits while its producer runs: with the producer preempted (a pool
    too small for both), the waiter computes for itself and everything finishes."""
    sim = Sim(12, True, 8, 4)
    prefix = list(range(32))  # 8 blocks
    sim.add("p", prefix + [90], 12)
    sim.add("w", prefix + [91], 12)
    sim.drain(2000)
    assert all(r.is_finished for r in sim.active)


burst_st = st.tuples(
    st.integers(0, 2),  # which shared prefix
    st.lists(st.integers(0, 5), min_size=1, max_size=9),  # own suffix
    st.integers(1, 6),  # max tokens
    st.integers(0, 3),  # arrival step
    st.one_of(st.none(), st.integers(0, 12)),  # abort at step
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shared=st.lists(st.lists(st.integers(0, 3), min_size=4, max_size=30), min_size=3, max_size=3),
    requests=st.lists(burst_st, min_size=2, max_size=14),
    num_blocks=st.integers(6, 80),
    budget=st.integers(1, 20),
    max_seqs=st.integers(1, 16),
    order=st.randoms(use_true_random=False),
)
def test_bursts_with_shared_prefixes_never_deadlock_or_leak(shared, requests, num_blocks, budget, max_seqs, order):
    """Random arrival orders, long shared prefixes, small pools (preemption), aborts:
    every request finishes, no block leaks, and with room for everything no prompt
    token is computed twice beyond a block per request (partial blocks cannot be shared)."""
    sim = Sim(num_blocks, True, budget, max_seqs)
    arrivals = list(enumerate(requests))
    order.shuffle(arrivals)
    added = _arrive(sim, shared, arrivals, steps=4)
    sim.drain(limit=3000)
    roomy = num_blocks >= sum(-(-(len(p) + 6) // BLOCK) for p in added) and not any(r[4] is not None for r in requests)
    if roomy and sim.sched.num_preemptions == 0:
        assert sim.sched.num_prompt_tokens_computed <= _distinct_prompt_tokens(added) + BLOCK * len(added)


def test_identical_blocks_at_several_depths_keep_requests_on_tree_paths():
    """A saved hypothesis example: prompts of zeros (the same block content at every depth), a
    6-block pool, a 5-token budget. Two requests finish the same block content in one step, one
    of them also hands its copy to a waiter in that step; the tree keeps the other copy. The
    waiter must move to the kept copy too, or its next block is indexed under a parent it does
    not hold (``check_invariants``: busy block with an idle parent)."""
    shared = [[0, 0, 0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 1]]
    arrivals = [(0, (0, [0], 1, 0, None)), (1, (0, [0], 1, 0, None)), (2, (0, [0], 1, 0, None)),
                (3, (0, [0, 0, 0], 1, 0, None)), (4, (0, [0], 1, 0, None)), (5, (0, [0], 1, 0, None)),
                (6, (0, [0], 2, 0, None)), (7, (2, [0], 1, 0, None)), (8, (2, [0] * 8, 1, 0, None))]
    sim = Sim(6, True, 5, 3)
    _arrive(sim, shared, arrivals, steps=4)
    sim.drain(limit=3000)

"""Property tests of the priority and fair-share queue order (engine/sched/fairness.py).

The simulated engine of test_cache_properties.py drives the real scheduler,
with a clock of one second per step, random tenants, priority classes,
weights, request priorities, shared prefixes, small pools (preemption) and
aborts. Besides the block invariants checked there after every step:

- every request finishes and no block leaks;
- starvation bound: a request that has waited the bound goes before the others
  of its class and tenant (of its class, under ``priority``), the oldest of such
  first; one of a worse class is admitted within the bound plus the time for a
  slot to free (a test of its own);
- classes: a request is never admitted while one of a better class waits
  (unless it is past the bound);
- within a tenant and class, the request ``priority`` then arrival decide;
- fair share: two backlogged tenants are served in proportion to their weights;
- short steps: no step carries a worse class's prompt chunk beside a better class's
  prompt, and while a better class is active the worse classes' chunks keep to their
  share of the step's budget.
"""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_cache_properties import Sim

from tokenmill.settings.config import SchedulerConfig
from tokenmill.engine.sched.fairness import QueueOrder, make_queue_order
from tokenmill.engine.request import Placement, Request, RequestStatus, SamplingParams


class FairSim(Sim):
    """Sim with a queue order and a clock that advances one second per step."""

    def __init__(self, num_blocks: int, caching: bool, budget: int, max_seqs: int, policy: str = "fair",
                 bound: float = 20.0) -> None:
        super().__init__(num_blocks, caching, budget, max_seqs, policy, bound)
        self.clock = 0.0
        self.violations: list[str] = []
        schedule = self.sched.schedule

        def timed(now: float | None = None):  # the step's time is the sim's clock
            waiting_before = set(self.sched.waiting)
            batch = schedule(self.clock)
            self._check_order(waiting_before)
            self._check_prefills(batch)
            self.clock += 1.0
            return batch

        self.sched.schedule = timed  # type: ignore[method-assign]

    def add_placed(self, rid: str, prompt: list[int], max_tokens: int, placement: Placement) -> bool:
        return self.add(rid, prompt, max_tokens, placement, arrival_time=self.clock)

    def _check_prefills(self, batch) -> None:  # type: ignore[no-untyped-def]
        """A step carrying a better class's prompt carries no worse class's chunk, and
        while a better class is active the worse classes' chunks keep to their share
        (requests past the bound are held to neither)."""
        order = self.sched.order
        assert order is not None
        now = self.clock
        chunks = [(r, n) for r, n in batch.items
                  if r.num_tokens - r.num_computed_tokens > 1 and not order.overdue(r, now)]
        if not chunks:
            return
        best = min(r.placement.priority_class for r, _ in chunks)
        worse = [r.request_id for r, _ in chunks if r.placement.priority_class > best]
        if worse:
            self.violations.append(f"chunks of {worse} share a step with class {best}'s prompt")
        lesser = order.lesser_prefill_tokens(now, self.sched.token_budget)
        if lesser is not None:
            active, tokens = lesser
            taken = sum(n for r, n in chunks if r.placement.priority_class > active)
            if taken > tokens:
                self.violations.append(f"worse classes took {taken} prompt tokens of a step, past {tokens}")

    def _check_order(self, waiting_before: set[Request]) -> None:
        """Admissions of this step against those who waited through it."""
        order = self.sched.order
        assert order is not None
        now = self.clock
        step = self.sched._step
        admitted = [r for r in self.sched.running if r.admitted_step == step and r in waiting_before]
        stayed = [w for w in self.sched.waiting if w in waiting_before]
        for r in admitted:
            rp, r_late = r.placement, order.overdue(r, now)
            for w in stayed:
                wp, w_late = w.placement, order.overdue(w, now)
                if wp.priority_class < rp.priority_class and not r_late:  # only the bound lifts a class
                    self.violations.append(f"{r.request_id} (class {rp.priority_class}) admitted while "
                                           f"{w.request_id} (class {wp.priority_class}) waits")
                peers = wp.priority_class == rp.priority_class and (not order.fair_share or wp.tenant == rp.tenant)
                if not peers:  # ordered by the same rule
                    continue
                if w_late and not r_late:
                    self.violations.append(f"{r.request_id} admitted before {w.request_id}, past the bound")
                elif w_late and r_late and w.arrival_time < r.arrival_time:
                    self.violations.append(f"{r.request_id} admitted before the older {w.request_id}")
                elif not w_late and not r_late and (wp.priority, w.arrival_time) < (rp.priority, r.arrival_time):
                    self.violations.append(f"{r.request_id} admitted before {w.request_id} of its tenant")


placement_st = st.builds(
    Placement,
    tenant=st.sampled_from(["a", "b", "c"]),
    priority_class=st.integers(0, 3),
    weight=st.sampled_from([0.5, 1.0, 4.0]),
    priority=st.integers(-2, 2),
)
fair_request_st = st.tuples(
    st.integers(0, 2),  # which shared prefix
    st.lists(st.integers(0, 5), min_size=1, max_size=10),  # own suffix
    st.integers(1, 10),  # max tokens
    st.integers(0, 10),  # arrival step
    st.one_of(st.none(), st.integers(0, 25)),  # abort at step
    placement_st,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shared=st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=14), min_size=3, max_size=3),
    requests=st.lists(fair_request_st, min_size=1, max_size=14),
    num_blocks=st.integers(4, 40),
    caching=st.booleans(),
    budget=st.integers(1, 24),
    max_seqs=st.integers(1, 6),
    policy=st.sampled_from(["fair", "priority"]),
    bound=st.sampled_from([3.0, 8.0, 1000.0]),
)
def test_ordered_workloads_keep_every_invariant(shared, requests, num_blocks, caching, budget, max_seqs, policy,
                                                bound):
    sim = FairSim(num_blocks, caching, budget, max_seqs, policy, bound)
    aborts: dict[int, list[Request]] = {}
    for step in range(12):
        for idx, (which, suffix, max_tokens, arrival, abort_at, place) in enumerate(requests):
            if arrival == step and sim.add_placed(f"r{idx}", shared[which] + suffix, max_tokens, place):
                if abort_at is not None:
                    aborts.setdefault(abort_at, []).append(sim.active[-1])
        for req in aborts.pop(step, []):
            sim.sched.abort(req)
        if sim.sched.has_work():
            sim.step(step % 4)
    sim.drain(limit=3000)
    assert not sim.violations, sim.violations[:5]
    assert all(r.is_finished for r in sim.active)
    order = sim.sched.order
    assert all(share.active == 0 for share in order.tenants.values())  # every arrival left once


def test_a_low_class_request_is_admitted_within_the_starvation_bound():
    """A flood of high-class requests (more than the server can take) cannot keep one
    low-class request out past the bound: it takes the first sequence slot that frees
    after it (a high-class request here runs 5 steps)."""
    bound = 10.0
    sim = FairSim(200, False, 8, 2, "fair", bound)
    sim.add_placed("low", [1, 2, 3], 2, Placement("batch", priority_class=4))
    low = sim.active[-1]
    for i in range(40):
        for j in range(3):
            sim.add_placed(f"h{i}-{j}", [5, 6, i % 7, j], 4, Placement("bot", priority_class=0))
        sim.step(0)
        if low.first_scheduled_time is not None:
            break
    assert low.first_scheduled_time is not None
    assert bound <= low.first_scheduled_time - low.arrival_time <= bound + 5
    sim.drain(3000)
    assert not sim.violations


def _overload(refuse: bool, policy: str) -> tuple[FairSim, dict[str, Request], int]:
    """A low class that alone sends more than the engine serves (one arrival a step, a
    slot frees about every 2.5 steps), and a high class now and then. ``refuse``: the
    admission check the server makes (the scheduler's ``backlog``), else every arrival joins."""
    sim = FairSim(400, False, 16, 2, policy, 10.0)
    requests: dict[str, Request] = {}
    refused = 0
    for step in range(80):
        arrivals = [(f"low{step}", Placement("batch", priority_class=4))]
        if step % 7 == 0:
            arrivals.append((f"high{step}", Placement("ops", priority_class=0)))
        for rid, place in arrivals:
            if refuse and sim.sched.backlog(place, sim.clock) is not None:
                refused += 1
            elif sim.add_placed(rid, [1 + step % 5, 2, 3, step % 3], 4, place):
                requests[rid] = sim.active[-1]
        sim.step(0)
    return sim, requests, refused


def _longest_wait(sim: FairSim, requests: dict[str, Request], prefix: str) -> float:
    """The longest arrival-to-first-scheduled wait of the class (one still waiting counts
    what it has waited so far)."""
    return max((r.first_scheduled_time if r.first_scheduled_time is not None else sim.clock) - r.arrival_time
               for rid, r in requests.items() if rid.startswith(prefix))


def test_an_overloaded_low_class_is_refused_at_admission_so_the_bound_holds_end_to_end():
    """Without the admission check the low class's queue grows and its oldest request
    waits far past the bound, whatever the order; with it, the class keeps being served
    (most of its arrivals, and every one admitted, start within the bound) and the high
    class is never refused and never waits behind it."""
    bound = 10.0
    for policy in ("priority", "fair"):
        sim, requests, _ = _overload(False, policy)
        assert _longest_wait(sim, requests, "low") > 2 * bound
        sim, requests, refused = _overload(True, policy)
        assert _longest_wait(sim, requests, "low") <= bound
        assert _longest_wait(sim, requests, "high") <= 1.0
        assert refused > 0
        served = sum(r.first_scheduled_time is not None for rid, r in requests.items() if rid.startswith("low"))
        # about one slot in 2.5 steps over 80 steps, less what its prefills lose to the share
        # a worse class keeps while a better one is active: the low class is not starved
        assert served >= 20
        assert sum(rid.startswith("high") for rid in requests) == 12  # no high arrival refused
        sim.drain(3000)
        assert not sim.violations


def test_backlogged_tenants_are_served_in_proportion_to_their_weights():
    """Tenants with weights 1 and 3, both with a deep queue of equal requests: the
    computed tokens split about 1:3 (whatever each queued, and in what order)."""
    sim = FairSim(400, False, 16, 4, "fair", 1e9)
    for i in range(60):  # "heavy" queues first: FCFS would serve it alone for a long while
        sim.add_placed(f"h{i}", [1 + i % 5] * 8, 8, Placement("heavy", weight=1.0))
    for i in range(60):
        sim.add_placed(f"l{i}", [2 + i % 5] * 8, 8, Placement("light", weight=3.0))
    for _ in range(120):
        sim.step(0)
    tokens = {t: s.tokens for t, s in sim.sched.order.tenants.items()}
    ratio = tokens["light"] / tokens["heavy"]
    assert 2.5 <= ratio <= 3.5, tokens
    sim.drain(3000)


def test_a_tenant_that_arrives_late_is_not_owed_the_idle_time():
    """A tenant that was idle starts at the least virtual service of the active ones:
    it alternates with the busy tenant instead of running alone until it catches up."""
    order = QueueOrder(fair_share=True, starvation_bound_s=1e9)
    busy = Request("b", [1], SamplingParams(max_tokens=1), placement=Placement("busy"))
    order.arrived(busy)
    order.charge([(busy, 1000)])
    late = Request("l", [1], SamplingParams(max_tokens=1), placement=Placement("late"))
    order.arrived(late)
    assert order.tenants["late"].virtual == order.tenants["busy"].virtual == 1000


def test_kv_pressure_preempts_the_lowest_class_first():
    """A pool too small for everyone: the low class is preempted, not the newer high one
    (FCFS would take the newest)."""
    sim = FairSim(9, False, 16, 4, "fair", 1e9)
    sim.add_placed("low", [1] * 8, 12, Placement("x", priority_class=3))
    sim.step(0)
    sim.add_placed("high", [2] * 8, 12, Placement("y", priority_class=1))
    low, high = sim.active
    while not low.is_finished and not high.is_finished and low.num_preemptions == 0:
        sim.step(0)
        assert high.num_preemptions == 0
    assert low.num_preemptions >= 1 and high.num_preemptions == 0
    sim.drain(3000)


def test_a_better_class_takes_a_slot_from_a_worse_one():
    """All sequence slots held by a low class: a high-class arrival preempts one and
    joins in the same step."""
    sim = FairSim(200, False, 16, 2, "priority", 1e9)
    for i in range(2):
        sim.add_placed(f"low{i}", [1, i] * 4, 30, Placement("x", priority_class=3))
    sim.step(0)
    sim.step(0)
    sim.add_placed("high", [2] * 8, 4, Placement("y", priority_class=0))
    high = sim.active[-1]
    sim.step(0)  # preempts one low request and admits the high one
    assert sum(r.num_preemptions for r in sim.active) == 1
    assert high.status is RequestStatus.RUNNING and high.first_scheduled_time is not None
    sim.drain(3000)
    assert not sim.violations


def test_a_tenant_over_its_share_of_slots_gives_one_up_and_nobody_swaps_back():
    """Fair share, one class: tenant "bulk" holds every slot; "chat" arrives and takes
    one at once. With the slots split 3:1 and weights equal, bulk never takes it back
    while both wait."""
    sim = FairSim(400, False, 32, 4, "fair", 1e9)
    for i in range(12):
        sim.add_placed(f"bulk{i}", [1, i] * 4, 40, Placement("bulk"))
    sim.step(0)
    sim.step(0)
    sim.add_placed("chat0", [2] * 8, 40, Placement("chat"))
    chat = sim.active[-1]
    sim.step(0)
    assert chat.first_scheduled_time is not None
    preempted = sum(r.num_preemptions for r in sim.active)
    assert preempted == 1
    for _ in range(10):
        sim.step(0)
    assert chat.num_preemptions == 0 and sum(r.num_preemptions for r in sim.active) == preempted
    sim.drain(5000)
    assert not sim.violations


def test_fcfs_is_the_default_and_has_no_order():
    assert make_queue_order(SchedulerConfig().scheduling_policy, 30.0) is None

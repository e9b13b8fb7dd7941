"""Waiting-queue order when requests are not equal: priority classes, tenants' fair
share, the request's own ``priority``, arrival, and a starvation bound.

The scheduler keeps its FCFS queue (``--scheduling-policy fcfs``, the default)
unless it is given a ``QueueOrder``; then it asks the order two things: which
waiting request to admit next (``next_to_admit``) and which running request to
preempt when the pool runs short (``victim``), and tells it what each step
computed (``charge``). The order decides, in this sequence:

1. **Priority class** (``Placement.priority_class``, a tenant's, 0 first). A
   request that has waited ``starvation_bound_s`` or longer counts as one of
   the best class waiting and goes first within its tenant (within the class,
   under ``priority``), one worse-class request at a time (``next_to_admit``):
   a low class is slowed under overload, never starved, never let to crowd out
   a better one; the fair share between tenants still holds when everyone has
   waited long.
2. **Fair share** (``fair`` policy only): among the tenants of that class with
   a request waiting, the one with the least *virtual service*: the prefill and
   decode tokens computed for it, divided by its weight. A tenant that becomes
   active (its first request since it had none) starts at the least virtual
   service of the active tenants, so idle time is not banked into a burst later
   (the virtual token counter of fair LLM serving).
3. **The request's ``priority``** (vLLM's field, lower first), within its
   tenant and class, then **arrival** (and the queue's own order on ties).

**The bound end to end.** The order alone cannot keep a class's wait under the
bound when that class, on its own, sends more than the engine serves: its queue
grows whatever the order, and the request at its back waits the queue's length.
So admission asks the order too (``backlog``): a request whose queue (its class,
and under fair share its tenant, since tenants of a class interleave) would make
it wait past ``ADMIT_SHARE`` of the bound (the queue's length over the rate it
has drained at since its oldest request arrived) is refused; the server answers 429 and the caller
retries. The class keeps the engine's whole share it had (the refused requests
would only have waited longer); the rest of the bound is headroom for the better
classes that arrive after it and for the rate's swings. The bound speaks of the
wait from the request's arrival at the server (the ``arrival_time`` it carries
into the engine) to its first scheduled step, whose end brings its first token
(unless a better class displaces it in between).

**Short steps for a better class.** The order also shapes each step's prompt
chunks (``prefills_now``, ``lesser_prefill_tokens``): a better class's request
that arrives waits for the step running then, so while a better class is
active the worse classes' chunks share a small part of each step's budget, and
a step that carries a better class's prompt carries none of theirs.

Victims go the other way: the lowest class first, then the highest
``priority`` value, then the tenant most over its share, then the newest; the
scheduler offers only requests whose preemption cannot undo a block another
request took in the same step. When every sequence slot (or the blocks) is taken,
the request to admit next may displace a running one (``outranks``): of a worse
class, or, under fair share, of a tenant holding more than its weighted share of
the slots; it is admitted in the same step, so its wait is one step, not the
time for a slot to free.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

if TYPE_CHECKING:  # typing only: importing the request module would import torch
    from ..request import Placement, Request

POLICIES = ("fcfs", "priority", "fair")
# Of the starvation bound, what a request's expected wait at admission may take; the rest
# is headroom for the better classes that arrive after it and for the rate's swings.
ADMIT_SHARE = 0.7
# Of a step's token budget, what worse classes' prefill chunks may take while a better class
# is active (``QueueOrder.lesser_prefill_tokens``): the step a better class's request arrives
# during is what it waits for, so that step stays short.
LESSER_PREFILL_SHARE = 0.125


@dataclass
class QueueHead:
    """One queue (``QueueOrder.queue_key``) as admission sees it after a step."""

    oldest: float  # the arrival of its oldest waiting request
    waiting: int = 0  # its requests waiting
    started_since: int = 0  # requests it started since the oldest arrived
    freed_since: int = 0  # running requests (any queue's) that finished since then
    full: bool = False  # every sequence slot was taken after the step


@dataclass
class TenantShare:
    """One tenant's standing in the fair share."""

    virtual: float = 0.0  # tokens computed for it / its weight
    weight: float = 1.0
    active: int = 0  # its sequences in the scheduler (waiting or running)
    tokens: int = 0  # tokens computed for it, all told


@dataclass
class QueueOrder:
    """The waiting queue's order and the preemption victim (see the module docstring).

    ``fair_share`` False is vLLM's ``priority`` policy extended with classes:
    class, then ``priority``, then arrival, tenants ignored."""

    fair_share: bool = True
    starvation_bound_s: float = 30.0
    tenants: dict[str, TenantShare] = field(default_factory=lambda: defaultdict(TenantShare))
    last_arrival: dict[int, float] = field(default_factory=dict)  # per class, its latest request's arrival

    # -- bookkeeping (the scheduler calls these) ------------------------
    def arrived(self, request: Request) -> None:
        """A sequence entered the scheduler: a tenant that had none lifts its virtual
        service to the least of the active tenants'."""
        place = request.placement
        latest = self.last_arrival.get(place.priority_class)
        if latest is None or request.arrival_time > latest:
            self.last_arrival[place.priority_class] = request.arrival_time
        share = self.tenants[place.tenant]
        share.weight = place.weight
        if share.active == 0:
            floor = [s.virtual for s in self.tenants.values() if s.active > 0]
            if floor:
                share.virtual = max(share.virtual, min(floor))
        share.active += 1

    def left(self, request: Request) -> None:
        """A sequence finished or was aborted."""
        share = self.tenants[request.placement.tenant]
        share.active = max(0, share.active - 1)

    def charge(self, items: Iterable[tuple[Request, int]]) -> None:
        """Count a step's computed tokens (prefill and decode alike) against their tenants."""
        for request, num_new in items:
            share = self.tenants[request.placement.tenant]
            share.tokens += num_new
            share.virtual += num_new / share.weight

    # -- ordering --------------------------------------------------------
    def overdue(self, request: Request, now: float) -> bool:
        return now - request.arrival_time >= self.starvation_bound_s

    def slots(self, running: Iterable[Request]) -> dict[str, int]:
        """Running sequences per tenant."""
        slots: dict[str, int] = {}
        for r in running:
            slots[r.placement.tenant] = slots.get(r.placement.tenant, 0) + 1
        return slots

    def _standing(self, tenant: str, slots: Mapping[str, int]) -> tuple[float, float, str]:
        """A tenant's place in the fair share, least served first: virtual service, then
        running sequences per unit of weight (a tenant that just became active ties on
        the first and wins on this one), then its name."""
        share = self.tenants[tenant]
        return share.virtual, slots.get(tenant, 0) / share.weight, tenant

    def protected(self, request: Request, now: float) -> bool:
        """Past the starvation bound and already preempted once: not picked again while
        anyone else can be, so a request cannot be admitted and preempted forever."""
        return request.num_preemptions > 0 and self.overdue(request, now)

    def next_to_admit(self, waiting: Sequence[Request], now: float,
                      running: Iterable[Request] = ()) -> Request | None:
        """The waiting request to admit next (None when nothing waits); ``running``
        breaks ties between tenants equally served.

        A request past the starvation bound counts as one of the best class waiting;
        within its tenant (within the whole class, under ``priority``) it goes first.
        A worse class is lifted so one request at a time: not while a request of a class
        worse than the best waiting one, past the bound, runs (one admitted so, or
        one that aged while running). So a class below others gets a slot whenever it
        has starved the bound, and no more: a flood of it cannot take the best class's
        place by ageing."""
        if not waiting:
            return None
        running = list(running)
        top = min(r.placement.priority_class for r in waiting)
        lifting = not any(r.placement.priority_class > top and self.overdue(r, now) for r in running)

        def late(r: Request) -> bool:
            return self.overdue(r, now) and (lifting or r.placement.priority_class == top)

        # Ties keep the queue's own order (a preempted request is back at its front).
        candidates = [(i, r) for i, r in enumerate(waiting) if r.placement.priority_class == top or late(r)]
        if self.fair_share:
            slots = self.slots(running)
            tenant = min({r.placement.tenant for _, r in candidates}, key=lambda t: self._standing(t, slots))
            candidates = [(i, r) for i, r in candidates if r.placement.tenant == tenant]

        def rank(ir: tuple[int, Request]) -> tuple[bool, int, float, int]:
            i, r = ir
            if late(r):
                return False, 0, r.arrival_time, i
            return True, r.placement.priority, r.arrival_time, i

        return min(candidates, key=rank)[1]

    def prefills_now(self, prefilling: Sequence[Request], now: float) -> list[Request]:
        """Of the requests with prompt left to compute, those whose chunks this step
        carries: the best class among them (a request past the starvation bound counts
        as one of it). A worse class's chunk would lengthen the step that brings a better
        class its first token, by as much as the rest of the token budget; it waits one
        or two steps instead (a better class's prompt is rarely longer), and decodes
        run in every step."""
        if not prefilling:
            return []

        def rank(r: Request) -> int:
            return -1 if self.overdue(r, now) else r.placement.priority_class

        best = min(rank(r) for r in prefilling)
        if best < 0:  # overdue requests share the step with the best class proper
            classes = [r.placement.priority_class for r in prefilling if not self.overdue(r, now)]
            best = min(classes, default=-1)
        return [r for r in prefilling if rank(r) <= best]

    def lesser_prefill_tokens(self, now: float, budget: int) -> tuple[int, int] | None:
        """While a class has had a request arrive within the starvation bound, the prefill
        chunks of worse classes share ``LESSER_PREFILL_SHARE`` of each step's ``budget``:
        a better class's request that arrives waits for the step running then, and
        a step carrying the budget's worth of a worse class's prompt would be most of
        its time to first token. Returns (that class, the tokens), or None when only
        the worst class present is active. Overdue requests are not held to it."""
        active = [c for c, t in self.last_arrival.items() if now - t < self.starvation_bound_s]
        if len(active) < 2:
            return None
        return min(active), max(1, int(budget * LESSER_PREFILL_SHARE))

    def victim(self, candidates: Sequence[Request], now: float) -> Request:
        """The running request to preempt among ``candidates`` (in admission order, the
        newest last): the lowest class, then the highest ``priority`` value, then the
        tenant furthest over its share, then the newest. A request past the starvation
        bound ranks above every class (as it is admitted: oldest first, whatever its
        ``priority``), and among such the newest goes first, so an older one is never
        sent back for a younger; protected requests (``protected``) rank above those
        too, also newest first, so the oldest always makes progress."""
        def rank(ir: tuple[int, Request]) -> tuple[int, int, float, float]:
            i, r = ir
            if self.overdue(r, now):
                return -2 if self.protected(r, now) else -1, 0, 0.0, r.arrival_time
            served = self.tenants[r.placement.tenant].virtual if self.fair_share else 0.0
            return r.placement.priority_class, r.placement.priority, served, i

        return max(enumerate(candidates), key=rank)[1]

    def outranks(self, waiting: Request, running: Request, now: float, slots: Mapping[str, int]) -> bool:
        """Whether ``waiting`` (the next to admit) may take ``running``'s place when there
        is no room (``slots``: running sequences per tenant). A request preempted before
        keeps its place (no request is displaced twice, so nothing swaps back and
        forth). A better class may take it; under fair share, in the same class, a tenant behind in the
        fair share (``_standing``, so the victim is not admitted again before it) may
        take a slot from one that would still hold more slots per unit of weight after
        the swap."""
        if running.num_preemptions > 0:
            return False
        w, r = waiting.placement, running.placement
        if w.priority_class < r.priority_class:
            return True
        if not self.fair_share or w.priority_class != r.priority_class or w.tenant == r.tenant:
            return False
        if self._standing(w.tenant, slots) >= self._standing(r.tenant, slots):
            return False
        return slots.get(r.tenant, 0) / r.weight > (slots.get(w.tenant, 0) + 1) / w.weight

    def queue_key(self, placement: Placement) -> tuple[str | None, int]:
        """The queue a request waits in, as far as its wait goes: its class, and its tenant
        under fair share (a tenant's requests interleave with the other tenants' of the class)."""
        return (placement.tenant if self.fair_share else None), placement.priority_class

    def queue_heads(self, waiting: Iterable[Request], starts: Mapping[tuple[str | None, int], int],
                    freed: int, full: bool) -> dict[tuple[str | None, int], QueueHead]:
        """Each queue's ``QueueHead``; ``starts``: the requests each queue has started, and
        ``freed`` the running requests finished, all told (a request's ``queue_mark`` is
        the two when it arrived); ``full``: every sequence slot is taken."""
        heads: dict[tuple[str | None, int], QueueHead] = {}
        for r in waiting:
            key = self.queue_key(r.placement)
            head = heads.get(key)
            if head is None or r.arrival_time < head.oldest:
                heads[key] = QueueHead(r.arrival_time, head.waiting if head else 0,
                                       starts.get(key, 0) - r.queue_mark[0], freed - r.queue_mark[1], full)
            heads[key].waiting += 1
        return heads

    def backlog(self, heads: Mapping[tuple[str | None, int], QueueHead], placement: Placement,
                now: float) -> float | None:
        """The wait a request joining ``placement``'s queue now is expected to have, when
        that is past ``ADMIT_SHARE`` of the starvation bound (it is then refused), else
        None. The queue has had a request waiting since its oldest arrived, so what it
        started since, over that time, is the rate it drains at; when every slot is
        taken it drains no faster than running requests finish (the starts of a batch
        filling its free slots say nothing of that). At least one of each: a queue that
        just formed has waited too little to be judged. The newcomer waits for all of
        the queue at that rate, and at least as long as the oldest has waited."""
        head = heads.get(self.queue_key(placement))
        if head is None:
            return None
        age = max(0.0, now - head.oldest)
        drained = min(head.started_since, head.freed_since) if head.full else head.started_since
        expected = max(age, (head.waiting + 1) * age / max(1, drained))
        return expected if expected > ADMIT_SHARE * self.starvation_bound_s else None

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Per tenant: weight, virtual service, tokens computed, sequences in the scheduler."""
        tenants = dict(self.tenants)  # the engine thread may add one meanwhile
        return {t: {"weight": s.weight, "virtual": s.virtual, "tokens": s.tokens, "active": s.active}
                for t, s in sorted(tenants.items())}


def make_queue_order(policy: str, starvation_bound_s: float) -> QueueOrder | None:
    """The scheduler's order for ``--scheduling-policy``; None for plain FCFS."""
    if policy == "fcfs":
        return None
    if policy not in POLICIES:
        raise ValueError(f"unknown scheduling policy {policy!r}; choose {', '.join(POLICIES)}")
    if starvation_bound_s <= 0:
        raise ValueError(f"the starvation bound must be positive, got {starvation_bound_s}")
    return QueueOrder(fair_share=policy == "fair", starvation_bound_s=starvation_bound_s)

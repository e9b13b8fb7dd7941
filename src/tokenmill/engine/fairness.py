"""Waiting-queue order when requests are not equal: priority classes, tenants' fair
share, the request's own ``priority``, arrival, and a starvation bound.

The scheduler keeps its FCFS queue (``--scheduling-policy fcfs``, the default)
unless it is given a ``QueueOrder``; then it asks the order two things: which
waiting request to admit next (``next_to_admit``) and which running request to
preempt when the pool runs short (``victim``), and tells it what each step
computed (``charge``). The order decides, in this sequence:

1. **Starvation bound.** A request that has waited ``starvation_bound_s`` or
   longer goes before every other (the oldest of them first), whatever its
   class: a low class is slowed under overload, never starved.
2. **Priority class** (``Placement.priority_class``, a tenant's, 0 first).
3. **Fair share** (``fair`` policy only): among the tenants of that class with
   a request waiting, the one with the least *virtual service*: the prefill and
   decode tokens computed for it, divided by its weight. A tenant that becomes
   active (its first request since it had none) starts at the least virtual
   service of the active tenants, so idle time is not banked into a burst later
   (the virtual token counter of fair LLM serving).
4. **The request's ``priority``** (vLLM's field, lower first), within its
   tenant and class, then **arrival** (and the queue's own order on ties).

Victims go the other way: the lowest class first, then the highest
``priority`` value, then the tenant most over its share, then the newest; the
scheduler offers only requests whose preemption cannot undo a block another
request took in the same step.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from .request import Request

POLICIES = ("fcfs", "priority", "fair")

# Priority classes by name, as the keys file and headers spell them (0 goes first).
PRIORITY_CLASSES = {"critical": 0, "high": 1, "normal": 2, "standard": 2, "low": 3, "batch": 4, "sheddable": 4}


def parse_priority_class(value: str | int | None) -> int:
    """A class name (``PRIORITY_CLASSES``) or a non-negative integer; None: normal."""
    if value is None:
        return PRIORITY_CLASSES["normal"]
    if isinstance(value, bool):
        raise ValueError(f"priority class must be a name or an integer, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"priority class must be non-negative, got {value}")
        return value
    text = str(value).strip().lower()
    if text.isdigit():
        return int(text)
    if text not in PRIORITY_CLASSES:
        raise ValueError(f"unknown priority class {value!r}; use one of {', '.join(PRIORITY_CLASSES)} "
                         "or an integer (0 first)")
    return PRIORITY_CLASSES[text]


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

    # -- bookkeeping (the scheduler calls these) ------------------------
    def arrived(self, request: Request) -> None:
        """A sequence entered the scheduler: a tenant that had none lifts its virtual
        service to the least of the active tenants'."""
        place = request.placement
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

    def next_to_admit(self, waiting: Sequence[Request], now: float) -> Request | None:
        """The waiting request to admit next (None when nothing waits)."""
        if not waiting:
            return None
        # Ties keep the queue's own order (a preempted request is back at its front).
        indexed = list(enumerate(waiting))
        overdue = [(i, r) for i, r in indexed if self.overdue(r, now)]
        if overdue:
            return min(overdue, key=lambda ir: (ir[1].arrival_time, ir[0]))[1]
        top = min(r.placement.priority_class for r in waiting)
        candidates = [(i, r) for i, r in indexed if r.placement.priority_class == top]
        if self.fair_share:
            tenant = min({r.placement.tenant for _, r in candidates},
                         key=lambda t: (self.tenants[t].virtual, t))
            candidates = [(i, r) for i, r in candidates if r.placement.tenant == tenant]
        return min(candidates, key=lambda ir: (ir[1].placement.priority, ir[1].arrival_time, ir[0]))[1]

    def victim(self, candidates: Sequence[Request], now: float) -> Request:
        """The running request to preempt among ``candidates`` (in admission order, the
        newest last): the lowest class, then the highest ``priority`` value, then the
        tenant furthest over its share, then the newest. Requests past the starvation
        bound rank above every class and among themselves go newest first, as under
        FCFS, so the oldest always makes progress (no preempt-and-readmit cycle)."""
        def rank(ir: tuple[int, Request]) -> tuple[int, int, float, float]:
            i, r = ir
            if self.overdue(r, now):
                return -1, 0, 0.0, r.arrival_time
            served = self.tenants[r.placement.tenant].virtual if self.fair_share else 0.0
            return r.placement.priority_class, r.placement.priority, served, i

        return max(enumerate(candidates), key=rank)[1]

    def outranks(self, waiting: Request, running: Request, now: float) -> bool:
        """Whether ``waiting`` may take ``running``'s place when there is no room: only a
        strictly better class does (fair share between tenants is kept by admission
        order, not by recompute), and nobody takes the place of a request past the
        starvation bound."""
        if self.overdue(running, now):
            return False
        return self.overdue(waiting, now) or waiting.placement.priority_class < running.placement.priority_class

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Per tenant: weight, virtual service, tokens computed, sequences in the scheduler."""
        return {t: {"weight": s.weight, "virtual": s.virtual, "tokens": s.tokens, "active": s.active}
                for t, s in sorted(self.tenants.items())}


def make_queue_order(policy: str, starvation_bound_s: float) -> QueueOrder | None:
    """The scheduler's order for ``--scheduling-policy``; None for plain FCFS."""
    if policy == "fcfs":
        return None
    if policy not in POLICIES:
        raise ValueError(f"unknown scheduling policy {policy!r}; choose {', '.join(POLICIES)}")
    if starvation_bound_s <= 0:
        raise ValueError(f"the starvation bound must be positive, got {starvation_bound_s}")
    return QueueOrder(fair_share=policy == "fair", starvation_bound_s=starvation_bound_s)

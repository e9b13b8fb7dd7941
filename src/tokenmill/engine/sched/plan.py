"""The step being scheduled: what it computes so far and what is left of its budget.

``ScheduledBatch`` is the scheduler's answer to the engine; ``StepPlan`` is the
scratch state the scheduler's stages share while they build it (one per
``Scheduler.schedule()`` call), so that no stage keeps step state on the
scheduler between steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..request import Request
from .fairness import QueueOrder


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


@dataclass
class StepPlan:
    """One step while it is scheduled."""

    now: float
    index: int  # the step's number (Request.admitted_step compares against it)
    budget: int  # tokens left in the step
    batch: ScheduledBatch = field(default_factory=ScheduledBatch)
    # worse classes' prefill tokens left, while a better class is active (``chunk``)
    lesser: tuple[int, int] | None = None

    def chunk(self, request: Request, order: QueueOrder | None) -> int:
        """The prompt tokens ``request`` computes this step: what is left of it, within
        the step's budget and, for a class worse than an active one, within what is
        left of those classes' share (``QueueOrder.lesser_prefill_tokens``)."""
        num_new = min(request.num_tokens - request.num_computed_tokens, self.budget)
        if self.lesser is not None and order is not None:
            best, tokens = self.lesser
            if request.placement.priority_class > best and not order.overdue(request, self.now):
                num_new = min(num_new, tokens)
                self.lesser = best, tokens - max(0, num_new)
        return num_new

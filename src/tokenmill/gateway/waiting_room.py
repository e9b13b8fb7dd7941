"""Fair shares of the server's bounded queues, decided before a request is admitted.

**The waiting room** (``--max-waiting``, ``capacity`` sequences) counts every
sequence from its admission to its first token (or its end, when it has none):
waiting in the server, in the engine's queue, or in its prefill. Half the room
is reserved: each tenant a request can come from owns a part of that half in
proportion to its weight (``RoomShares.share``). The other half is open to all.

A request that keeps its tenant within its share is admitted. A request that
takes its tenant past its share may use only room nobody else has a claim on:
every other tenant's unused share stays free, and so does the slice each
better priority class keeps from the worse ones (``RoomShares.kept_for_better``:
a quarter of the room for the best class, an eighth more for the next, and so
on). A tenant flooding the room is refused (``tenant_queue_share``) while the
room still has space for the others.

What this guarantees, for requests of one tenant at a time, over any
interleaving (tests/test_waiting_room_properties.py checks it):

* the room never holds more than ``capacity`` sequences;
* a request that keeps its tenant within its share is never refused;
* a request is never refused because of worse classes' requests: a refusal
  means the tenants of its own and better classes hold, past their shares,
  more than the slice its class keeps (so the best class, with a quarter of
  the room kept from all the others, is refused only for its own backlog).

Each tenant's *claim* is what it holds, or its share when it holds less; the
room admits a request past its tenant's share only while the claims and the
slices kept for better classes fit in the room. Claims only grow by such
requests, so the claims of the worse classes never reach into a better class's
slice, and every unused share stays free. A keys-file reload divides the room
again for the requests that come after it; the sequences already admitted stay.

**The grammar-compile queue** (``--grammar-queue-size``) is shared the same
way, more simply (``CompileRoom``): the classes worse than the best together
may have at most three quarters of it compiling or waiting to, and one tenant
half of that, so another tenant and the best class always find room.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from .refusal import Refusal

RESERVED = 0.5  # of the room, the part divided between the tenants as their shares
EPSILON = 1e-9  # shares are fractions of a sequence: sums of them compare with this slack


@dataclass(frozen=True)
class RoomShares:
    """How a room of ``capacity`` sequences is divided between tenants and classes.

    ``weights``: the tenants a request can come from, by name; ``classes``: their
    priority classes (0 first). A tenant missing here (a keys-file reload removed
    it while its requests ran) has no share: it may use only the open half."""

    capacity: int
    weights: dict[str, float]
    classes: tuple[int, ...]
    total_weight: float = 0.0

    @classmethod
    def of(cls, capacity: int, tenants: Iterable[tuple[str, float, int]]) -> "RoomShares":
        """From (name, weight, priority class) of each tenant."""
        listed = list(tenants)
        weights = {name: weight for name, weight, _ in listed}
        return cls(capacity, weights, tuple(sorted({klass for _, _, klass in listed})), sum(weights.values()))

    def share(self, tenant: str) -> float:
        """The part of the room reserved for ``tenant``: the reserved half, by weight."""
        weight = self.weights.get(tenant)
        if weight is None:
            return 0.0
        return RESERVED * self.capacity * weight / self.total_weight

    def rank(self, priority_class: int) -> int:
        """How many of the tenants' classes are better than ``priority_class``."""
        return sum(1 for c in self.classes if c < priority_class)

    def kept_for_better(self, priority_class: int) -> float:
        """Sequences a request of ``priority_class`` may never take past its share: the
        slices of every better class, a quarter of the room for the best, then an eighth,
        a sixteenth, ...: together less than the half that is not reserved."""
        return RESERVED * self.capacity * (1.0 - 0.5 ** self.rank(priority_class))

    def most(self, tenant: str, priority_class: int) -> float:
        """The most a tenant could ever hold: the room less the others' shares and the
        better classes' slices."""
        others = RESERVED * self.capacity - self.share(tenant) if tenant in self.weights else (
            RESERVED * self.capacity)
        return self.capacity - others - self.kept_for_better(priority_class)


@dataclass
class WaitingRoom:
    """Sequences admitted and not yet started, by tenant. Lives on the event loop
    (decide and add run with no await in between), so it needs no lock."""

    held: dict[str, int] = field(default_factory=dict)
    total: int = 0

    def claims(self, shares: RoomShares, tenant: str, new: int) -> float:
        """Every tenant's claim (what it holds, or its share when more) with ``new``
        more sequences held by ``tenant``."""
        names = set(shares.weights) | set(self.held) | {tenant}
        return sum(max(self.held.get(n, 0) + (new if n == tenant else 0), shares.share(n)) for n in names)

    def decide(self, shares: RoomShares, tenant: str, priority_class: int, new: int) -> Refusal | None:
        """None to admit ``new`` sequences of ``tenant`` (its request's class
        ``priority_class``), else why not. Counts nothing (``add`` does)."""
        if new <= 0:
            return None
        capacity, held = shares.capacity, self.held.get(tenant, 0)
        share = shares.share(tenant)
        if new > shares.most(tenant, priority_class) + EPSILON:
            return Refusal(400, "too_many_sequences",
                           f"this request asks for {new} sequences (prompts x n) but tenant {tenant!r} may "
                           f"queue at most {int(shares.most(tenant, priority_class) + EPSILON)} of the "
                           f"server's {capacity} (--max-waiting, less the other tenants' shares and better "
                           "classes' room); send fewer prompts or a smaller n", param="n")
        if self.total + new > capacity:
            return Refusal(429, "queue_full", f"the server is at capacity ({self.total} sequences waiting, "
                           f"this request adds {new}, limit {capacity}); retry later")
        if held + new <= share + EPSILON:
            return None
        if self.claims(shares, tenant, new) + shares.kept_for_better(priority_class) > capacity + EPSILON:
            return Refusal(429, "tenant_queue_share",
                           f"tenant {tenant!r} has {held} sequences waiting, this request adds {new}, past its "
                           f"share of {share:.1f} of the {capacity} the server queues (--max-waiting); the rest "
                           "is kept for other tenants' shares and better priority classes; retry later",
                           against_tenant=True)
        return None

    def add(self, tenant: str, sequences: int) -> None:
        self.held[tenant] = self.held.get(tenant, 0) + sequences
        self.total += sequences

    def remove(self, tenant: str, sequences: int) -> None:
        """``sequences`` of the tenant started (or ended before they did)."""
        held = self.held.get(tenant, 0)
        gone = min(held, sequences)
        self.total -= gone
        if held - gone:
            self.held[tenant] = held - gone
        else:
            self.held.pop(tenant, None)


def compile_keep(size: int) -> int:
    """Of a compile queue of ``size``, the slots the classes worse than the best leave to
    it: a quarter, at least one when there are two."""
    return max(size // 4, 1 if size >= 2 else 0)


@dataclass
class CompileRoom:
    """Grammar compilations in flight (waiting for or in a worker), by tenant and by
    whether their class is the best. On the event loop, like the waiting room.

    The classes worse than the best together may hold ``size - compile_keep(size)``;
    where several tenants can call, one tenant half of that (at least one), so
    another tenant finds room too."""

    size: int
    held: dict[str, int] = field(default_factory=dict)
    worse: int = 0  # in flight for classes worse than the best

    def tenant_limit(self, several: bool) -> int:
        shared = self.size - compile_keep(self.size)
        return max(1, shared // 2) if several else self.size

    def decide(self, tenant: str, best_class: bool, several: bool) -> Refusal | None:
        """None to let one more of ``tenant``'s grammars into the queue; ``several``: more
        than one tenant can call this server."""
        limit, held = self.tenant_limit(several), self.held.get(tenant, 0)
        if held >= limit:
            return Refusal(429, "grammar_queue_share",
                           f"tenant {tenant!r} already has {held} grammars compiling or waiting to, its part "
                           f"of the {self.size} the server queues (--grammar-queue-size); retry shortly",
                           against_tenant=True)
        if not best_class and self.worse >= self.size - compile_keep(self.size):
            return Refusal(429, "grammar_queue_share",
                           f"{self.worse} grammars of lower priority classes are compiling or waiting to, their "
                           f"part of the {self.size} the server queues (--grammar-queue-size; the rest is kept "
                           "for the best class); retry shortly", against_tenant=True)
        return None

    def add(self, tenant: str, best_class: bool) -> None:
        self.held[tenant] = self.held.get(tenant, 0) + 1
        self.worse += 0 if best_class else 1

    def remove(self, tenant: str, best_class: bool) -> None:
        left = self.held.get(tenant, 0) - 1
        if left > 0:
            self.held[tenant] = left
        else:
            self.held.pop(tenant, None)
        self.worse -= 0 if best_class else 1

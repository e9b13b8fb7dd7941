"""The server's admission: the one place a request is admitted or refused, and counted.

``Admission`` runs its gates in a fixed order, each answering a typed
``Refusal`` (gateway/refusal.py) or None:

1. ``SequencesGate``: more sequences (prompts x n) than ``--max-waiting`` would
   ever queue: a 400, since retrying cannot help;
2. ``RoomGate``: the waiting room's fair shares of ``--max-waiting``
   (gateway/waiting_room.py);
3. ``BacklogGate``: the request's queue (its class, and its tenant under fair
   share) is already too long for it to start within the starvation bound,
   judged from the queues the engine last published (``EngineStats.queue_heads``);
4. ``TenantLimitsGate``: the tenant's own limits (gateway/tenant_gate.py).

Before these, while the request is read, ``RequestLimitsGate`` holds its own size
to the model's (engine/limits.py: the prompt's length and token ids, the output
budget): a 400 naming the field, not a refusal of load, so not counted as one.

The first refusal is counted (``tokenmill:requests_rejected`` by its code, and
the tenant's usage when it is of the tenant's own load) and raised as the
``APIError`` the client gets. What is admitted is counted in every gate at once,
with no await between deciding and counting, so concurrent handlers on the event
loop cannot all slip past a bound. ``release``, ``started`` and ``finished``
give back what ``reserve`` counted; ``hold_compile`` is the grammar-compile
queue's admission, shared the same way.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, NoReturn, Protocol, Sequence

from ...engine.limits import LimitError, RequestLimits
from ...engine.request import Placement
from ...engine.sched.fairness import ADMIT_SHARE, QueueOrder
from ...engine.stats import StatsSource
from ...gateway.refusal import Refusal
from ...gateway.tenant_gate import TenantGate
from ...gateway.tenants import DEFAULT_TENANT, Tenant
from ...gateway.waiting_room import CompileRoom, RoomShares, WaitingRoom
from .errors import APIError

if TYPE_CHECKING:
    from .serving import Job


@dataclass(frozen=True)
class Ask:
    """What one admission asks for: ``requests`` engine requests of ``sequences``
    sequences that may cost ``tokens``, from ``tenant``, placed at ``placement``."""

    tenant: Tenant
    placement: Placement
    requests: int
    sequences: int
    tokens: int


class Gate(Protocol):
    """One admission check: ``decide`` counts nothing; ``count`` counts what it admitted."""

    def decide(self, ask: Ask) -> Refusal | None: ...

    def count(self, ask: Ask) -> None: ...


@dataclass
class SequencesGate:
    """A request with more sequences than ``--max-waiting`` would ever queue. Asked
    before tokenizing, so a huge batch costs nothing."""

    max_waiting: int | None

    def decide(self, ask: Ask) -> Refusal | None:
        limit = self.max_waiting
        if limit is None or ask.sequences <= limit:
            return None
        return Refusal(400, "too_many_sequences",
                       f"this request asks for {ask.sequences} sequences (prompts x n) but the server queues at "
                       f"most {limit} (--max-waiting); send fewer prompts or a smaller n", param="n")

    def count(self, ask: Ask) -> None:
        return None


@dataclass
class RoomGate:
    """The tenant's fair share of the waiting room; counts a sequence from its admission
    to its first token (``Admission.started``)."""

    room: WaitingRoom
    shares: Callable[[], RoomShares]
    bounded: bool  # --max-waiting is set (the room is counted either way)

    def decide(self, ask: Ask) -> Refusal | None:
        if not self.bounded:
            return None
        return self.room.decide(self.shares(), ask.tenant.name, ask.tenant.priority_class, ask.sequences)

    def count(self, ask: Ask) -> None:
        self.room.add(ask.tenant.name, ask.sequences)


@dataclass
class BacklogGate:
    """A request whose queue is already too long for it to start within the starvation
    bound (engine/sched/fairness.py: ``backlog``): its class is over what the engine
    serves, and queueing it would only make it, and those behind it, wait past the
    bound. ``order``: the scheduler's policy as the engine was built with it (None
    under FCFS: never refuses); the queues are read from the engine's snapshot."""

    order: QueueOrder | None
    engine: StatsSource
    clock: Callable[[], float] = time.monotonic

    def decide(self, ask: Ask) -> Refusal | None:
        order = self.order
        if order is None:
            return None
        expected = order.backlog(self.engine.stats.queue_heads, ask.placement, self.clock())
        if expected is None:
            return None
        place = ask.placement
        return Refusal(429, "class_backlog",
                       f"requests of priority class {place.priority_class} (tenant {place.tenant!r}) would wait "
                       f"about {expected:.1f}s to start, past the {order.starvation_bound_s:g}s starvation bound: "
                       "their queue is longer than the server serves; retry later",
                       retry_after_s=max(1, math.ceil(expected - ADMIT_SHARE * order.starvation_bound_s)),
                       against_tenant=True)

    def count(self, ask: Ask) -> None:
        return None


@dataclass
class TenantLimitsGate:
    """The tenant's requests in flight, sequences queued and tokens per minute."""

    gate: TenantGate

    def decide(self, ask: Ask) -> Refusal | None:
        return self.gate.decide(ask.tenant, ask.requests, ask.sequences, ask.tokens)

    def count(self, ask: Ask) -> None:
        self.gate.count(ask.tenant, ask.requests, ask.sequences, ask.tokens)


@dataclass
class RequestLimitsGate:
    """A request's own size against the model (engine/limits.py), checked here where a 400
    can name the field; the engine runs the same checks for in-process callers.
    ``max_output_tokens``: ``--max-output-tokens``; ``token_chars``: the characters the
    longest vocabulary entry spells (0: the tokenizer cannot say), asked when first needed."""

    limits: RequestLimits
    max_output_tokens: int | None
    token_chars: Callable[[], int]

    def text_fits(self, chars: int, param: str) -> Refusal | None:
        """Text too long to fit the context whatever it tokenizes to, before tokenizing it."""
        return _limit_refusal(self.limits.check_text_fits, chars, self.token_chars(), param)

    def prompt_ids(self, ids: list[int]) -> Refusal | None:
        return _limit_refusal(self.limits.check_prompt_ids, ids)

    def max_tokens(self, prompt_len: int, requested: int | None, default: int | None) -> int | Refusal:
        """The output budget of a request (``RequestLimits.resolve_max_tokens``), or the
        refusal that states both numbers. ``requested``: what the client sent (None: not
        sent); ``default``: the endpoint's default when not sent (None: the rest of the
        context). ``--max-output-tokens`` caps both and is the default when it is set."""
        try:
            return self.limits.resolve_max_tokens(prompt_len, requested, default, self.max_output_tokens,
                                                  prompt_param="messages" if default is None else "prompt")
        except LimitError as exc:
            return limit_refusal(exc)


def _limit_refusal(check: Callable[..., None], *args: Any) -> Refusal | None:
    try:
        check(*args)
    except LimitError as exc:
        return limit_refusal(exc)
    return None


def limit_refusal(exc: LimitError) -> Refusal:
    """A ``LimitError`` as a refusal: a 400 naming the field at fault."""
    return Refusal(400, exc.code, str(exc), param=exc.param)


@contextlib.contextmanager
def as_api_error() -> Iterator[None]:
    """A ``LimitError`` raised inside as the 400 a client gets, naming the field at fault."""
    try:
        yield
    except LimitError as exc:
        raise refusal_error(limit_refusal(exc), 0) from None


def refusal_error(refusal: Refusal, retry_after_s: int) -> APIError:
    """The error a client gets for ``refusal``; a 429 always carries ``Retry-After``
    (``retry_after_s`` where the gate left it to the server)."""
    headers = None
    if refusal.status == 429:
        wait = refusal.retry_after_s if refusal.retry_after_s is not None else retry_after_s
        headers = {"Retry-After": str(wait)}
    return APIError(refusal.status, refusal.message, code=refusal.code, headers=headers, param=refusal.param)


class Admission:
    """Every admission of one served model (see the module docstring). Lives on the
    event loop: decide and count happen with no await in between, so it needs no lock.

    ``on_refused(refusal, tenant name)``: counts a refusal (the server's metrics and
    the tenant's usage)."""

    def __init__(self, limits: RequestLimitsGate, gates: Sequence[Gate], room: WaitingRoom, compiles: CompileRoom,
                 shares: Callable[[], RoomShares], tenant_gate: TenantGate, retry_after_s: int,
                 on_refused: Callable[[Refusal, str], None]) -> None:
        self.limits = limits
        self.gates = tuple(gates)
        self.room = room
        self.compiles = compiles
        self.shares = shares
        self.tenant_gate = tenant_gate
        self.retry_after_s = retry_after_s
        self.on_refused = on_refused
        self.pending = 0  # sequences admitted by reserve() whose stream has not started yet

    def refuse(self, refusal: Refusal, tenant: Tenant) -> NoReturn:
        """Count ``refusal`` and raise it as the client's error."""
        self.on_refused(refusal, tenant.name)
        raise refusal_error(refusal, self.retry_after_s)

    # -- the request's own size (a 400 naming the field; not counted as a refusal of load) --
    def check_text_fits(self, chars: int, param: str) -> None:
        self._invalid(self.limits.text_fits(chars, param))

    def check_prompt_ids(self, ids: list[int]) -> None:
        self._invalid(self.limits.prompt_ids(ids))

    def resolve_max_tokens(self, prompt_len: int, requested: int | None, default: int | None) -> int:
        budget = self.limits.max_tokens(prompt_len, requested, default)
        if isinstance(budget, Refusal):
            raise refusal_error(budget, self.retry_after_s)
        return budget

    def _invalid(self, refusal: Refusal | None) -> None:
        if refusal is not None:
            raise refusal_error(refusal, self.retry_after_s)

    # -- load ---------------------------------------------------------------
    def _admit(self, ask: Ask, count: bool) -> None:
        for gate in self.gates:
            refusal = gate.decide(ask)
            if refusal is not None:
                self.refuse(refusal, ask.tenant)
        if count:
            for gate in self.gates:
                gate.count(ask)

    def check(self, tenant: Tenant | None, sequences: int, requests: int = 1, priority: int = 0) -> None:
        """Every refusal ``reserve`` could give this request, counting nothing: asked before
        its costly preparation (tokenizing, compiling its grammar), so a tenant past its
        share of the waiting room or one of its limits never takes a place in the shared
        grammar-compile queue. Its cost in tokens is not known yet: one token stands for it."""
        tenant = tenant or DEFAULT_TENANT
        self._admit(Ask(tenant, placement_of(tenant, priority), requests, sequences, 1), count=False)

    def reserve(self, jobs: list[Job], tenant: Tenant | None = None) -> None:
        """Admit jobs, or refuse them all (429 with Retry-After, or 400 for what can never
        be admitted); ``tenant``'s limits refuse that tenant only.

        A streaming job reaches the engine only when its response starts, so admitted
        jobs count as waiting (``pending``) until ``stream_job`` submits them (``release``),
        and in the waiting room until their first token (``started``)."""
        tenant = tenant or DEFAULT_TENANT
        fresh = [job for job in jobs if not job.held and not job.reserved]
        if fresh:
            self._admit(Ask(tenant, placement_of(tenant, fresh[0].priority), len(fresh),
                            sum(j.params.n for j in fresh), sum(max_cost(j) for j in fresh)), count=True)
        for job in fresh:
            job.tenant, job.held = tenant, True
        for job in jobs:
            if not job.reserved:
                job.reserved = True
                self.pending += job.params.n

    def release(self, job: Job) -> None:
        """Undo ``reserve`` for one job; idempotent. A job that never reached its stream
        gives back what its tenant held."""
        if job.reserved:
            job.reserved = False
            self.pending -= job.params.n
        if job.held and not job.streamed:
            self.finished(job, started=False, output_tokens=0)

    def finished(self, job: Job, started: bool, output_tokens: int) -> None:
        """The tenant gate's part of a job ends (idempotent); the output it did not use
        goes back to the tenant's token bucket."""
        if not job.held:
            return
        job.held = False
        if not started:
            self.started(job)
        self.tenant_gate.finished(job.tenant or DEFAULT_TENANT, 1, max_cost(job) - len(job.prompt_ids) - output_tokens)

    def started(self, job: Job) -> None:
        """A held job's sequences produced their first token (or it ended before): they
        leave the tenant's queued count and the waiting room."""
        name = (job.tenant or DEFAULT_TENANT).name
        self.tenant_gate.started(name, job.params.n)
        self.room.remove(name, job.params.n)

    def hold_compile(self, tenant: Tenant | None) -> Callable[[], None]:
        """A place in the grammar-compile queue for one of ``tenant``'s grammars, or a 429
        when the tenant (or the classes worse than the best) already hold their part of
        it (gateway/waiting_room.py). Returns the release, to call when the compilation is done
        (idempotent; safe from any thread: it hops to the event loop)."""
        tenant = tenant or DEFAULT_TENANT
        shares = self.shares()
        best = shares.rank(tenant.priority_class) == 0
        refusal = self.compiles.decide(tenant.name, best, several=len(shares.weights) > 1)
        if refusal is not None:
            self.refuse(refusal, tenant)
        self.compiles.add(tenant.name, best)
        loop = asyncio.get_running_loop()
        released = False

        def release_here() -> None:
            nonlocal released
            if not released:
                released = True
                self.compiles.remove(tenant.name, best)

        def release() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nothing left to count
                loop.call_soon_threadsafe(release_here)

        return release


class SharesOf:
    """How ``--max-waiting`` is divided between the tenants now: made again when the keys
    file is reloaded (a new tenant table), else the same."""

    def __init__(self, tenants: Any, capacity: int | None) -> None:
        self.tenants = tenants  # gateway/tenants.py: the directory (or a server's tenants)
        self.capacity = capacity or 0
        self._made: tuple[Any, RoomShares] | None = None  # (the table they were made of, shares)

    def __call__(self) -> RoomShares:
        table = self.tenants.table
        if self._made is None or self._made[0] is not table:
            self._made = table, RoomShares.of(self.capacity, (
                (t.name, t.weight, t.priority_class) for t in self.tenants.callers()))
        return self._made[1]


def placement_of(tenant: Tenant, priority: int) -> Placement:
    """Where the scheduler places a request of ``tenant`` (``Job.placement``)."""
    return Placement(tenant.name, tenant.priority_class, tenant.weight, priority)


def max_cost(job: Job) -> int:
    """Tokens a job may use at most: its prompt, and every choice's whole output budget."""
    return len(job.prompt_ids) + job.params.n * int(job.params.max_tokens or 0)

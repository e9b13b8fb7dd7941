"""Server state and the bridge from HTTP handlers to the async engine.

``ServerState`` holds what every handler needs (engine, tokenizer, settings,
metrics, traffic capture, counters). ``stream_job`` runs one engine request
(job_stream.py) and does the bookkeeping every request needs whatever its
endpoint.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from ...traffic.cache_misses import MissClassifier
from ...gateway.request_guard import DEFAULT_HEADER_READ_TIMEOUT_S, DEFAULT_MAX_PENDING_CONNECTIONS
from ...engine.async_engine import AsyncEngine
from ...engine.engine import SequenceDelta
from ...engine.sched.fairness import ADMIT_SHARE, make_queue_order
from ...engine.request import DEFAULT_PLACEMENT, Placement, SamplingParams
from ...engine.limits import LimitError, RequestLimits
from .job_stream import run_job
from .metrics import ServerMetrics
from ..parsers.chat_templates import ToolsTemplate, parser_for, renders_tools, tools_template_for
from .errors import APIError
from ..openai.response_store import DEFAULT_STORE_BYTES
from ...gateway.tenant_gate import TenantGate, TenantLimited
from .tenant_usage import TenantUsage
from ...gateway.tenants import DEFAULT_TENANT, Tenant, directory_from_args, tenant_of
from ...gateway.waiting_room import CompileRoom, Refusal, RoomShares, WaitingRoom

log = logging.getLogger("tokenmill.server")


@dataclass
class ServerSettings:
    """What the operator chose at start-up (``tokenmill serve`` flags)."""

    served_model_names: list[str] = field(default_factory=lambda: ["tokenmill"])
    model_path: str | None = None
    api_key: str | list[str] | None = None  # several: any of them opens the API
    api_keys_file: str | None = None  # tenants and their hashed keys (gateway/tenants.py); reloaded on SIGHUP
    metrics_tenant_labels: bool = False  # /metrics' usage per tenant name (off: summed, no names; tenant_usage.py)
    router_api_key: list[str] | None = None  # routers' keys: trusted to name a request's tenant (gateway/tenants.py)
    otlp_traces_endpoint: str | None = None  # OpenTelemetry traces over OTLP (gateway/tracing.py); None: off
    max_waiting: int | None = None
    max_output_tokens: int | None = None
    log_requests: bool = False
    capture_path: str | None = None
    capture_text: bool = False
    capture_key: str | None = None  # keys the capture's hashes (None: a key kept beside the file)
    heartbeat_timeout_s: float = 120.0  # /health fails when the engine loop is silent this long
    grace_period_s: float = 30.0  # SIGTERM: how long running requests may finish
    max_request_bytes: int | None = None  # request body limit (None: request_guard.default_body_limit)
    request_read_timeout_s: float = 30.0  # the whole body must arrive within this
    header_read_timeout_s: float = DEFAULT_HEADER_READ_TIMEOUT_S  # and the request line and headers within this
    max_pending_connections: int = DEFAULT_MAX_PENDING_CONNECTIONS  # connections waiting for their headers
    retry_after_s: int = 1
    # sampling defaults for what a request leaves unset (--generation-config), SamplingParams' names
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    enable_auto_tool_choice: bool = False  # tool_choice "auto" parses output with tool_call_parser
    tool_call_parser: str | None = None  # entrypoints/parsers/tool_parsers.py: hermes, llama3_json, mistral, ...
    chat_template: str | None = None  # Jinja source replacing the model's chat template
    reasoning_parser: str | None = None  # entrypoints/parsers/reasoning.py: deepseek_r1, qwen3
    responses_store_size: int = 1024  # stored Responses kept for previous_response_id (LRU); 0: none
    responses_store_bytes: int = DEFAULT_STORE_BYTES  # and their size bound (response_store.entry_bytes)
    lora_modules: list[tuple[str, str]] = field(default_factory=list)  # (name, folder) loaded at start


SESSION_HEADER = "x-session-id"


def session_of(headers: Any, user: str | None) -> str | None:
    """The conversation a request continues: the ``x-session-id`` header, else the body's ``user``."""
    sid = headers.get(SESSION_HEADER) if headers is not None else None
    if sid:
        return "session:" + str(sid)[:256]
    return "user:" + user if user else None


def model_not_found(name: str, served: list[str]) -> APIError:
    return APIError(404, f"The model `{name}` does not exist. Served: {', '.join(served)}", param="model",
                    code="model_not_found")


@dataclass
class Job:
    """One engine request (a /v1/completions batch makes several)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    endpoint: str
    prompt_text: str | None = None
    arrival_unix: float = field(default_factory=time.time)
    # when the server got it (time.monotonic), carried into the engine: the scheduler's
    # starvation bound counts the wait before the engine sees it too
    arrival: float = field(default_factory=time.monotonic)
    reserved: bool = False
    priority: int = 0  # the request's own (vLLM's field), within its tenant's class
    # the caller's tenant (gateway/tenants.py), set by reserve(); None: the default tenant
    tenant: Tenant | None = None
    held: bool = False  # counted by the tenant gate until its stream ends
    session: str | None = None  # the conversation it belongs to (x-session-id or user), for miss reasons
    miss: Any = None  # cache_misses.Miss: why its prompt missed reusable cache, once known
    streamed: bool = False  # stream_job took it over
    model: str | None = None  # the request's ``model``: a LoRA adapter's name selects it

    @property
    def placement(self) -> Placement:
        """Where the scheduler places it: the tenant's class and weight, the request's priority."""
        if self.tenant is None:
            return Placement(priority=self.priority) if self.priority else DEFAULT_PLACEMENT
        return Placement(self.tenant.name, self.tenant.priority_class, self.tenant.weight, self.priority)


@dataclass
class ServerShared:
    """What every model of one server shares: who the tenants are, their limits and usage, and
    the tracer. A one-model server makes its own; a server of several models
    (model_set.py) makes one and hands it to each model's ``ServerState``."""

    tenants: Any
    tenant_gate: TenantGate
    usage: TenantUsage
    tracing: Any

    @classmethod
    def from_settings(cls, settings: ServerSettings) -> "ServerShared":
        from ...gateway.tracing import make_tracing

        tenants = directory_from_args(settings.api_keys_file, settings.api_key, settings.router_api_key)
        usage = TenantUsage(tenants.label, tenants.names, settings.metrics_tenant_labels,
                            reload_failures=lambda: tenants.reload_failures)
        return cls(tenants, TenantGate(settings.retry_after_s), usage,
                   make_tracing(settings.otlp_traces_endpoint, "tokenmill-server"))

    def close(self) -> None:
        if self.tracing is not None:
            self.tracing.close()


WAITING_BATCHES = 4  # the default waiting queue: this many full batches of sequences ...


def default_max_waiting(num_blocks: int, max_num_seqs: int) -> int:
    """``--max-waiting`` when not given: ``WAITING_BATCHES`` batches of ``--max-num-seqs``
    sequences, but no more sequences than the KV pool has blocks (a sequence needs at least
    one block to start, so a longer queue could never drain faster), and never fewer than
    one batch. One request of many prompts and a large ``n`` can no longer queue thousands
    of sequences in front of everyone."""
    return max(max_num_seqs, min(WAITING_BATCHES * max_num_seqs, num_blocks))


class ServerState:
    def __init__(self, aengine: AsyncEngine, settings: ServerSettings, shared: ServerShared | None = None) -> None:
        self.aengine = aengine
        self.engine = aengine.engine
        self.tokenizer = self.engine.tokenizer
        if settings.max_waiting is None:  # decided once, from the pool (default_max_waiting)
            settings = dataclasses.replace(settings, max_waiting=default_max_waiting(
                self.engine.pool.num_blocks, self.engine.config.scheduler.max_num_seqs))
        self.settings = settings
        if settings.chat_template:
            self.tokenizer.chat_template = settings.chat_template
            self.tokenizer.has_chat_template = True
        # conversations with tools use this template when the model's own cannot render them
        self.tools_template = self._pick_tools_template()
        self.tool_parser_hint = (self.tools_template.parser if self.tools_template
                                 else parser_for(self.tokenizer.chat_template))
        self.model_name = settings.served_model_names[0]
        self.max_model_len = int(self.engine.max_model_len)
        self.pool_tokens = int(self.engine.pool.num_blocks * self.engine.block_size)
        self.vocab_size = int(self.engine.model_config.vocab_size)
        # The request limits (engine/limits.py), with the pool's size: checked here, where a
        # 400 can name the field; the engine runs the same checks for in-process callers.
        self.limits = RequestLimits(self.max_model_len, self.vocab_size, self.pool_tokens)
        self.metrics = ServerMetrics(self.model_name, self.engine, waiting=self.num_waiting)
        self.adapters = _adapter_manager(aengine, settings)  # LoRA adapters (engine/adapters.py), or None
        if self.adapters is not None:
            from ...engine.adapters import LoraRequestsInfo

            self.metrics.vllm.register(LoraRequestsInfo(self.adapters))
        # tenants: who a key belongs to, their limits, their usage (gateway/tenants.py, gateway/tenant_gate.py, tenant_usage.py),
        # and the tracer: this server's own, or those of the server of several models it is one of
        self._owns_shared = shared is None
        self.shared = shared if shared is not None else ServerShared.from_settings(settings)
        self.tenants = self.shared.tenants
        self.tenant_gate = self.shared.tenant_gate
        self.usage = self.shared.usage
        if self._owns_shared:  # otherwise the server's own /metrics shows it once
            self.metrics.exposed.register(self.usage)
        self.tracing = self.shared.tracing
        self.loop: asyncio.AbstractEventLoop | None = None  # the serving loop, set by the first request
        self.capture: Any = None
        if settings.capture_path:
            from ...traffic.capture import TrafficCapture

            key = settings.capture_key.encode() if settings.capture_key else None
            self.capture = TrafficCapture(settings.capture_path, capture_text=settings.capture_text,
                                          block_size=self.engine.block_size, hash_key=key)
        # why prompts miss the prefix cache, per session and from recent prompts' text (traffic/cache_misses.py)
        self.misses = MissClassifier(self.engine.block_size) if self.engine.prefix_cache is not None else None
        self.draining = False
        self.cutting = False  # the shutdown grace period is over: running requests end with an error
        self._live: dict[str, Job] = {}  # jobs whose engine stream is open
        self._cut: set[str] = set()
        self.pending = 0  # sequences admitted by reserve() whose stream has not started yet
        # --max-waiting divided fairly between tenants and classes, and the grammar-compile
        # queue likewise (gateway/waiting_room.py); both counted here, on the event loop
        self.room = WaitingRoom()
        self._shares: tuple[Any, RoomShares] | None = None  # (the tenant table they were made of, shares)
        self.compiles = CompileRoom(self.engine.structured.limits.queue_size)
        # the scheduler's queue order as admission judges backlogs by (its settings only: the
        # queues themselves come from the engine's published stats); None under FCFS
        sched = self.engine.config.scheduler
        self.queue_order = make_queue_order(sched.scheduling_policy, sched.starvation_bound_s)
        self.inflight_http = 0  # requests inside the app (middleware count), for graceful shutdown
        self._token_text = functools.lru_cache(maxsize=65536)(self._decode_one)

    def _pick_tools_template(self) -> ToolsTemplate | None:
        if self.settings.chat_template or not self.tokenizer.has_chat_template:
            return None
        supplied = tools_template_for(self.tokenizer.chat_template)
        if supplied is not None:
            log.info("chat template: the model's own does not render tools; conversations with tools, tool "
                     "calls or tool results use tokenmill's %s template with %s-format tool calls "
                     "(--chat-template replaces both)", supplied.family, supplied.parser)
        elif not renders_tools(self.tokenizer.chat_template):
            log.warning("chat template: the model's own does not render tools and tokenmill has none for its "
                        "family; requests with tools will not show them to the model (pass --chat-template)")
        return supplied

    # -- load ------------------------------------------------------------
    # Every count here is of sequences (prompts x n), the unit the engine
    # schedules: one request of 64 prompts with n=16 is 1024 waiting sequences,
    # not one waiting request.
    def num_queued(self) -> int:
        """Sequences handed to the engine thread but not yet added to its queue."""
        queued = getattr(self.aengine, "num_queued_sequences", None)
        return int(queued if queued is not None else self.aengine.num_queued)

    def num_waiting(self) -> int:
        return int(self.engine.stats.num_waiting) + self.num_queued() + self.pending

    def check_admissible(self, sequences: int) -> None:
        """400 for a request with more sequences than ``--max-waiting`` would ever queue.

        Checked before tokenizing, so a huge batch costs nothing; a 429 would
        tell the client to retry something that can never be admitted."""
        limit = self.settings.max_waiting
        if limit is not None and sequences > limit:
            self.metrics.rejected.labels("too_many_sequences").inc()
            raise APIError(400, f"this request asks for {sequences} sequences (prompts x n) but the server "
                           f"queues at most {limit} (--max-waiting); send fewer prompts or a smaller n",
                           param="n", code="too_many_sequences")

    def check_admission(self, tenant: Tenant | None, sequences: int, requests: int = 1, priority: int = 0) -> None:
        """Every refusal ``reserve`` could give this request, counting nothing: asked before
        its costly preparation (tokenizing, compiling its grammar), so a tenant past its
        share of the waiting room or one of its limits never takes a place in the shared
        grammar-compile queue. Its cost in tokens is not known yet: one token stands for it."""
        self.check_admissible(sequences)
        tenant = tenant or DEFAULT_TENANT
        self._admit(tenant, _placement(tenant, priority), requests, sequences, 1, count=False)

    def reserve(self, jobs: list[Job], tenant: Tenant | None = None) -> None:
        """Admit jobs, or 429 with Retry-After when their sequences would take the
        waiting queue past ``--max-waiting``, their tenant past its share of it
        (gateway/waiting_room.py), or ``tenant`` past one of its limits (gateway/tenant_gate.py;
        that tenant only).

        A streaming job reaches the engine only when its response starts, so
        admitted jobs count as waiting (``pending``) until ``stream_job``
        submits them, and in the waiting room until their first token; check and
        count happen with no await in between, so concurrent handlers cannot all
        slip past the bound."""
        tenant = tenant or DEFAULT_TENANT
        fresh = [job for job in jobs if not job.held and not job.reserved]
        if fresh:
            self.check_admissible(sum(j.params.n for j in fresh))
            self._admit(tenant, dataclasses.replace(fresh[0], tenant=tenant).placement, len(fresh),
                        sum(j.params.n for j in fresh), sum(_max_cost(j) for j in fresh), count=True)
        for job in fresh:
            job.tenant, job.held = tenant, True
        for job in jobs:
            if not job.reserved:
                job.reserved = True
                self.pending += job.params.n

    def _admit(self, tenant: Tenant, placement: Placement, requests: int, sequences: int, tokens: int,
               count: bool) -> None:
        """The one admission path: the waiting room's share, the class backlog, the tenant's
        limits, in that order; with ``count``, what is admitted is counted in each."""
        if self.settings.max_waiting is not None:
            refusal = self.room.decide(self.room_shares(), tenant.name, tenant.priority_class, sequences)
            if refusal is not None:
                self._refuse(refusal, tenant)
        self._check_backlog(placement)
        try:
            if count:
                self.tenant_gate.admit(tenant, requests, sequences, tokens)
            else:
                self.tenant_gate.check(tenant, requests, sequences, tokens)
        except TenantLimited as exc:
            self.metrics.rejected.labels(exc.code).inc()
            self.usage.rejected(tenant.name)
            raise APIError(429, str(exc), code=exc.code,
                           headers={"Retry-After": str(exc.retry_after_s)}) from None
        if count:
            self.room.add(tenant.name, sequences)

    def room_shares(self) -> RoomShares:
        """How ``--max-waiting`` is divided between the tenants now (made again when the
        keys file is reloaded)."""
        table = self.tenants.table
        if self._shares is None or self._shares[0] is not table:
            self._shares = table, RoomShares.of(self.settings.max_waiting or 0, (
                (t.name, t.weight, t.priority_class) for t in self.tenants.callers()))
        return self._shares[1]

    def _refuse(self, refusal: Refusal, tenant: Tenant) -> None:
        self.metrics.rejected.labels(refusal.code).inc()
        if refusal.code.endswith("_share"):
            self.usage.rejected(tenant.name)
        headers = {"Retry-After": str(self.settings.retry_after_s)} if refusal.status == 429 else None
        raise APIError(refusal.status, refusal.message, code=refusal.code, headers=headers,
                       param="n" if refusal.status == 400 else None)

    def hold_compile(self, tenant: Tenant | None) -> Callable[[], None]:
        """A place in the grammar-compile queue for one of ``tenant``'s grammars, or a 429
        when the tenant (or the classes worse than the best) already hold their part of
        it (gateway/waiting_room.py). Returns the release, to call when the compilation is done
        (idempotent; safe from any thread: it hops to the event loop)."""
        tenant = tenant or DEFAULT_TENANT
        shares = self.room_shares()
        best = shares.rank(tenant.priority_class) == 0
        refusal = self.compiles.decide(tenant.name, best, several=len(shares.weights) > 1)
        if refusal is not None:
            self._refuse(refusal, tenant)
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

    def _check_backlog(self, placement: Placement) -> None:
        """429 for a request whose queue (its class, and its tenant under fair share) is
        already too long for it to start within the starvation bound (engine/sched/fairness.py:
        ``backlog``): its class is over what the engine serves, and queueing it would only
        make it, and those behind it, wait past the bound. Reads the queues as the engine
        last published them (``EngineStats.queue_heads``), not the scheduler itself."""
        order = self.queue_order
        if order is None:
            return
        expected = order.backlog(self.engine.stats.queue_heads, placement, time.monotonic())
        if expected is None:
            return
        self.metrics.rejected.labels("class_backlog").inc()
        self.usage.rejected(placement.tenant)
        retry = max(1, math.ceil(expected - ADMIT_SHARE * order.starvation_bound_s))
        raise APIError(429, f"requests of priority class {placement.priority_class} (tenant {placement.tenant!r}) "
                       f"would wait about {expected:.1f}s to start, past the {order.starvation_bound_s:g}s "
                       "starvation bound: their queue is longer than the server serves; retry later",
                       code="class_backlog", headers={"Retry-After": str(retry)})

    def release(self, job: Job) -> None:
        """Undo ``reserve`` for one job; idempotent. A job that never reached its stream
        gives back what its tenant held."""
        if job.reserved:
            job.reserved = False
            self.pending -= job.params.n
        if job.held and not job.streamed:
            self._tenant_done(job, started=False, output_tokens=0)

    def _tenant_done(self, job: Job, started: bool, output_tokens: int) -> None:
        """The tenant gate's part of a job ends (idempotent)."""
        if not job.held:
            return
        job.held = False
        tenant = job.tenant or DEFAULT_TENANT
        if not started:
            self._started(job)
        self.tenant_gate.finished(tenant, 1, _max_cost(job) - len(job.prompt_ids) - output_tokens)

    def _started(self, job: Job) -> None:
        """A held job's sequences produced their first token (or it ended before): they
        leave the tenant's queued count and the waiting room."""
        name = (job.tenant or DEFAULT_TENANT).name
        self.tenant_gate.started(name, job.params.n)
        self.room.remove(name, job.params.n)

    # -- tokens ----------------------------------------------------------
    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.token_to_text(token_id)

    def token_text(self, token_id: int) -> str:
        return self._token_text(token_id)

    async def serving_for(self, name: str | None, scope: Any = None) -> "ServerState":
        """The state that serves a request for model ``name``: this one (the one model of this
        server, or one of its LoRA adapters), else the 404 every endpoint gives. A server of
        several models answers the same question by loading the model (model_set.py)."""
        self.check_model(name, tenant_of(scope) if scope is not None else None)
        return self

    def loaded_states(self) -> list["ServerState"]:
        """The models this server holds in memory now: its one."""
        return [self]

    def check_model(self, name: str | None, caller: Tenant | None = None) -> None:
        """404 for a model this server does not serve (the one wording every endpoint uses);
        a LoRA adapter's name is served to those who may use it (adapter_routes.py:
        another tenant's adapter is a model that does not exist, and is not listed)."""
        if not name or name in self.settings.served_model_names:
            return
        from .adapter_routes import visible_adapters

        usable = [a.name for a in visible_adapters(self, caller)]
        if name not in usable:
            raise model_not_found(name, self.settings.served_model_names + usable)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters the longest vocabulary entry spells (an upper bound on the text one token
        covers), or 0 when the tokenizer cannot say."""
        try:
            vocab = self.tokenizer.backend.get_vocab(with_added_tokens=True)
            return max(1, max(map(len, vocab)))
        except Exception:  # noqa: BLE001 - a tokenizer without a listable vocabulary: no shortcut
            return 0

    def check_text_fits(self, chars: int, param: str) -> None:
        """400 for text too long to fit the context whatever it tokenizes to, before tokenizing it."""
        with as_api_error():
            self.limits.check_text_fits(chars, self.max_token_chars, param)

    def check_prompt_ids(self, ids: list[int]) -> None:
        with as_api_error():
            self.limits.check_prompt_ids(ids)

    def resolve_max_tokens(self, prompt_len: int, requested: int | None, default: int | None) -> int:
        """The output budget of a request (``RequestLimits.resolve_max_tokens``), or a 400
        that states both numbers. ``requested``: what the client sent (None: not sent);
        ``default``: the endpoint's default when not sent (None: the rest of the context).
        ``--max-output-tokens`` caps both and is the default when it is set."""
        with as_api_error():
            return self.limits.resolve_max_tokens(prompt_len, requested, default, self.settings.max_output_tokens,
                                                  prompt_param="messages" if default is None else "prompt")

    # -- shutdown --------------------------------------------------------------
    def cut_all(self) -> int:
        """End every running request now (the grace period is over); returns how many.

        Each one is aborted in the engine, and its stream raises an
        ``APIError(503)`` where it would have ended, so a streaming client
        gets a final error event (and ``[DONE]``), a waiting one a 503 body;
        jobs that start after this fail the same way. Call it on the event loop."""
        self.cutting = True
        for job in list(self._live.values()):
            self._cut.add(job.request_id)
            self.aengine.abort(job.request_id)
        return len(self._live)

    def _shutdown_error(self) -> APIError:
        return APIError(503, "the server shut down before this request finished (its shutdown grace "
                        "period ran out); retry it", code="shutting_down", headers={"Retry-After": "5"})

    # -- running -----------------------------------------------------------
    def stream_job(self, job: Job) -> AsyncIterator[SequenceDelta]:
        """Deltas of one engine request, with metrics, capture and abort-on-exit (job_stream.py).

        Engine refusals (ValueError) surface as a 400 APIError before the
        first delta; a dead engine as 503."""
        return run_job(self, job)

    async def _acquire_adapter(self, job: Job) -> int:
        """The resident id of the job's adapter (loaded now if it is not resident)."""
        from ...engine.adapters import AdapterBusy, AdapterNotFound
        from ...model.lora.lora import LoraError

        assert self.adapters is not None and job.model is not None
        try:
            return await self.adapters.acquire(job.model)
        except AdapterNotFound:
            self.release(job)
            raise APIError(404, f"The model `{job.model}` does not exist (its adapter was unloaded)",
                           param="model", code="model_not_found") from None
        except AdapterBusy as exc:
            self.release(job)
            raise APIError(503, str(exc), code="lora_slots_busy", headers={"Retry-After": "5"}) from None
        except LoraError as exc:  # its files changed since it was registered
            self.release(job)
            raise APIError(400, str(exc), param="model", code="invalid_lora_adapter") from None

    def _trace_sequence(self, span: Any, job: Job, delta: SequenceDelta, output_tokens: int) -> None:
        """A finished sequence's engine spans under the request's span, and its counts on it."""
        assert self.tracing is not None
        tenant = (job.tenant or DEFAULT_TENANT).name
        self.tracing.engine_spans(span, delta.metrics, delta.prefill_chunks, {
            "tokenmill.request_id": job.request_id, "tokenmill.tenant": tenant, "gen_ai.request.model": self.model_name,
            "gen_ai.usage.input_tokens": delta.num_prompt_tokens, "tokenmill.cached_tokens": delta.num_cached_tokens,
            "gen_ai.usage.output_tokens": output_tokens, "tokenmill.finish_reason": str(delta.finish_reason),
            "tokenmill.preemptions": int(delta.metrics.get("num_preemptions", 0))})
        totals = getattr(span, "attributes", None) or {}
        span.set_attribute("tokenmill.tenant", self.tenants.label(tenant))
        span.set_attribute("gen_ai.request.model", self.model_name)
        for key, value in (("gen_ai.usage.output_tokens", output_tokens),
                           ("tokenmill.cached_tokens", delta.num_cached_tokens),
                           ("gen_ai.usage.input_tokens", delta.num_prompt_tokens if delta.index == 0 else 0)):
            span.set_attribute(key, int(totals.get(key, 0)) + value)

    def _classify_miss(self, job: Job, cached: int) -> None:
        """Why this prompt missed cache it could have reused (traffic/cache_misses.py); counted by reason."""
        if self.misses is None:
            return
        job.miss = self.misses.classify(job.prompt_ids, cached, job.session)
        if job.miss is not None:
            self.metrics.cache_misses.labels(job.miss.reason).inc()

    def close(self) -> None:
        if self.capture is not None:
            self.capture.close()
        if self._owns_shared:
            self.shared.close()


def _placement(tenant: Tenant, priority: int) -> Placement:
    """Where the scheduler would place a request of ``tenant`` (``Job.placement``)."""
    return Placement(tenant.name, tenant.priority_class, tenant.weight, priority)


def _max_cost(job: Job) -> int:
    """Tokens a job may use at most: its prompt, and every choice's whole output budget."""
    return len(job.prompt_ids) + job.params.n * int(job.params.max_tokens or 0)


@contextlib.contextmanager
def as_api_error() -> Any:
    """A ``LimitError`` as the 400 a client gets, naming the field at fault."""
    try:
        yield
    except LimitError as exc:
        raise APIError(400, str(exc), param=exc.param, code=exc.code) from None


def _adapter_manager(aengine: AsyncEngine, settings: ServerSettings) -> Any:
    """The server's LoRA adapters, those of ``--lora-modules`` registered (and resident while
    there is room); None when the engine serves none."""
    lora = aengine.engine.lora
    if lora is None:
        if settings.lora_modules:
            raise ValueError("--lora-modules needs --enable-lora")
        return None
    from ...engine.adapters import AdapterManager

    manager = AdapterManager(lora, lambda fn: aengine.call(lambda engine: fn(engine.lora)))
    for name, path in settings.lora_modules:
        if name in settings.served_model_names:
            raise ValueError(f"--lora-modules: {name!r} is the base model's name")
        try:
            manager.register_now(name, path)
        except ValueError as exc:  # LoraError: its message names no folder, the operator's flag does
            raise ValueError(f"--lora-modules {name}={path}: {exc}") from None
        log.info("LoRA adapter %r registered from %s", name, path)
    return manager

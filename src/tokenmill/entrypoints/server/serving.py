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
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from ...traffic.cache_misses import MissClassifier
from ...gateway.request_guard import DEFAULT_HEADER_READ_TIMEOUT_S, DEFAULT_MAX_PENDING_CONNECTIONS
from ...engine.async_engine import AsyncEngine
from ...engine.engine import SequenceDelta
from ...engine.sched.fairness import make_queue_order
from ...engine.request import DEFAULT_PLACEMENT, Placement, SamplingParams
from ...engine.limits import RequestLimits
from .job_stream import run_job
from .metrics import ServerMetrics
from ..parsers.chat_templates import ToolsTemplate, parser_for, renders_tools, tools_template_for
from .errors import APIError
from ..openai.response_store import DEFAULT_STORE_BYTES
from ...gateway.refusal import Refusal
from ...gateway.tenant_gate import TenantGate
from .tenant_usage import TenantUsage
from ...gateway.tenants import DEFAULT_TENANT, Tenant, directory_from_args, tenant_of
from ...gateway.waiting_room import CompileRoom, WaitingRoom
from .admission import (Admission, BacklogGate, RequestLimitsGate, RoomGate, SequencesGate, SharesOf,
                        TenantLimitsGate)

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
                self.engine.stats.blocks_total, self.engine.config.scheduler.max_num_seqs))
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
        self.pool_tokens = int(self.engine.stats.blocks_total * self.engine.block_size)
        self.vocab_size = int(self.engine.model_config.vocab_size)
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
        self.misses = MissClassifier(self.engine.block_size) if self.engine.stats.prefix_cache_enabled else None
        self.draining = False
        self.cutting = False  # the shutdown grace period is over: running requests end with an error
        self._live: dict[str, Job] = {}  # jobs whose engine stream is open
        self._cut: set[str] = set()
        self.admission = self._admission()
        self.inflight_http = 0  # requests inside the app (middleware count), for graceful shutdown
        self._token_text = functools.lru_cache(maxsize=65536)(self._decode_one)

    def _admission(self) -> Admission:
        """The server's admission (admission.py): ``--max-waiting`` divided fairly between
        tenants and classes, and the grammar-compile queue likewise (gateway/waiting_room.py),
        both counted on the event loop; the class backlog judged by the scheduler's
        policy as the engine was built with it (its queues come from the engine's
        published stats; no check under FCFS); the tenants' own limits; and before them the
        request's own size against the model's (with the pool's)."""
        settings, sched = self.settings, self.engine.config.scheduler
        room = WaitingRoom()
        shares = SharesOf(self.tenants, settings.max_waiting)
        gates = (SequencesGate(settings.max_waiting), RoomGate(room, shares, settings.max_waiting is not None),
                 BacklogGate(make_queue_order(sched.scheduling_policy, sched.starvation_bound_s), self.engine),
                 TenantLimitsGate(self.tenant_gate))
        limits = RequestLimitsGate(RequestLimits(self.max_model_len, self.vocab_size, self.pool_tokens),
                                   settings.max_output_tokens, lambda: self.max_token_chars)
        return Admission(limits, gates, room, CompileRoom(self.engine.config.grammar_limits.queue_size), shares,
                         self.tenant_gate, settings.retry_after_s, self._refused)

    def _refused(self, refusal: Refusal, tenant: str) -> None:
        """A refusal counted: by its code, and in the tenant's usage when it is of the tenant's own load."""
        self.metrics.rejected.labels(refusal.code).inc()
        if refusal.against_tenant:
            self.usage.rejected(tenant)

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
        return int(self.engine.stats.num_waiting) + self.num_queued() + self.admission.pending

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
            self.admission.release(job)
            raise APIError(404, f"The model `{job.model}` does not exist (its adapter was unloaded)",
                           param="model", code="model_not_found") from None
        except AdapterBusy as exc:
            self.admission.release(job)
            raise APIError(503, str(exc), code="lora_slots_busy", headers={"Retry-After": "5"}) from None
        except LoraError as exc:  # its files changed since it was registered
            self.admission.release(job)
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

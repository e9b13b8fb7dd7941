"""Canary rollout in the router: split, per-variant metrics, guard, rollback.

``Canary`` glues the pieces the proxy needs: which backends a request may use
(``subset_for``), what each finished attempt measured (``observe_*`` and
``StreamMeter``), and what happens when a canary breaks its SLO: its share
drops to 0% at once (the base takes it), the reason is logged, exported in
``/metrics`` (``tokenmill_router_canary_rollback_info``) and written to the
state file, and, when the router runs in Kubernetes with a ServiceAccount
allowed to update the HTTPRoute, the route's weights follow
(``k8s_weights``); otherwise an ERROR line tells the operator to do it.

Requests already running on the canary finish there: a rollback only changes
where *new* requests go, so no request fails because of the switch.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from prometheus_client import Counter, Gauge, Histogram

from .guard import SLO, Guard
from ..metrics import RouterMetrics
from .variants import SplitState, Splitter, Variant, full_split, load_state, save_state, session_key

log = logging.getLogger("tokenmill.router")

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)
_CHECK_EVERY_REQUEST = 256  # window size up to which every finished request gets a verdict
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0)


@dataclass
class CanaryConfig:
    """What ``--variant``, ``--split``, ``--slo``, ``--split-state`` and ``--k8s-httproute`` say."""

    variants: list[Variant]
    split: dict[str, float] = field(default_factory=dict)  # percent per canary variant
    slo: SLO = field(default_factory=SLO)
    state_file: str | None = None
    admin_key: str | None = None  # default: the router's --api-key
    k8s_httproute: str | None = None  # NAMESPACE/NAME (or NAME) of the HTTPRoute whose weights follow
    k8s_backend_refs: dict[str, str] = field(default_factory=dict)  # variant -> backendRef name

    def backends(self) -> list[str]:
        return [u for v in self.variants for u in v.backends]

    def validate(self) -> None:
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names):
            raise ValueError("variant names must be unique")
        if len(names) < 2:
            raise ValueError("a canary needs at least two --variant groups (the base first)")
        urls = self.backends()
        if len(set(urls)) != len(urls):
            raise ValueError("a backend may belong to one variant only")
        full_split(names, self.split)


class CanaryMetrics:
    def __init__(self, metrics: RouterMetrics) -> None:
        r = metrics.registry
        self.requests = Counter("tokenmill_router_variant_requests",
                                "Finished attempts per variant (retries included).", ["variant"], registry=r)
        self.errors = Counter("tokenmill_router_variant_errors",
                              "Attempts per variant that failed on the backend's side (5xx, transport, broken stream).",
                              ["variant"], registry=r)
        self.output_tokens = Counter("tokenmill_router_variant_output_tokens",
                                     "Output tokens per variant (usage when reported, else content chunks).",
                                     ["variant"], registry=r)
        self.ttft = Histogram("tokenmill_router_variant_ttft_seconds",
                              "Time to first token of streamed responses, per variant, as the router sees it.",
                              ["variant"], buckets=_TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("tokenmill_router_variant_request_seconds",
                             "Whole-request latency per variant (successful answers), as the router sees it.",
                             ["variant"], buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("tokenmill_router_variant_tpot_seconds",
                              "Time per output token after the first, of streamed responses, per variant.",
                              ["variant"], buckets=_TPOT_BUCKETS, registry=r)
        self.weight = Gauge("tokenmill_router_variant_weight_percent", "Current traffic share per variant.",
                            ["variant"], registry=r)
        self.rollbacks = Counter("tokenmill_router_canary_rollbacks",
                                 "Automatic rollbacks of a variant to 0% after an SLO breach.", ["variant"], registry=r)
        self.rollback_info = Gauge("tokenmill_router_canary_rollback_info",
                                   "1 while a variant is held at 0% by the guard; the label says why.",
                                   ["variant", "reason"], registry=r)


class Canary:
    def __init__(self, config: CanaryConfig, metrics: RouterMetrics,
                 patcher: Callable[[dict[str, float]], Any] | None = None) -> None:
        config.validate()
        self.config = config
        names = [v.name for v in config.variants]
        state = None
        if config.state_file:
            state = load_state(config.state_file, names)
            if state is not None:
                log.info("split restored from %s: %s", config.state_file, _fmt(state.weights))
        if state is None:
            state = SplitState(full_split(names, config.split))
            log.info("canary split: %s", _fmt(state.weights))
        self.splitter = Splitter(config.variants, state)
        self.guard = Guard(config.slo)
        self.metrics = CanaryMetrics(metrics)
        self.patcher = patcher  # async fn(weights) that updates the HTTPRoute, or None
        self._tasks: set[asyncio.Task] = set()
        self._checked: dict[str, float] = {}  # last guard verdict per variant
        for n in names:  # export every label from the start, so sums are over all variants
            self.metrics.requests.labels(n)
            self.metrics.errors.labels(n)
            self.metrics.output_tokens.labels(n)
        for n, reason in state.rolled_back.items():
            self.metrics.rollback_info.labels(n, reason).set(1)
        self._export_weights()

    # -- split ------------------------------------------------------------
    @property
    def state(self) -> SplitState:
        return self.splitter.state

    def _export_weights(self) -> None:
        for n, w in self.state.weights.items():
            self.metrics.weight.labels(n).set(w)

    def subset_for(self, headers: Mapping[str, str], body: Any, ready_endpoints: set[str]) -> tuple[str, set[str]]:
        """(variant, endpoints) a request may use; variants without a ready backend are skipped."""
        available = {n for n, v in self.splitter.by_name.items() if v.endpoints & ready_endpoints}
        name = self.splitter.choose(session_key(headers, body), available)
        return name, self.splitter.by_name[name].endpoints

    def variant_of(self, endpoint: str) -> str | None:
        return self.splitter.variant_of_endpoint(endpoint)

    def set_split(self, canary: Mapping[str, float], reason: str = "admin") -> SplitState:
        """Operator's new split (``POST /admin/split``); clears rollbacks of variants given a share."""
        names = self.splitter.names
        weights = full_split(names, {k: float(v) for k, v in canary.items()})
        for n, w in weights.items():
            if w > 0 and n in self.state.rolled_back:
                old = self.state.rolled_back.pop(n)
                self.metrics.rollback_info.remove(n, old)
            self.guard.reset(n)
        self._apply(weights, reason)
        log.info("split set to %s (%s)", _fmt(weights), reason)
        return self.state

    def _apply(self, weights: dict[str, float], reason: str) -> None:
        self.splitter.set_weights(weights)
        self.state.reason = reason
        self.state.updated_at = time.time()
        self._export_weights()
        if self.config.state_file:
            try:
                save_state(self.config.state_file, self.state)
            except OSError as exc:
                log.error("cannot write split state file %s: %s", self.config.state_file, exc)
        self._sync_k8s(weights, reason)

    def rollback(self, variant: str, reason: str) -> None:
        weights = dict(self.state.weights)
        moved = weights.get(variant, 0.0)
        if moved <= 0:
            return
        weights[variant] = 0.0
        weights[self.splitter.base] = weights.get(self.splitter.base, 0.0) + moved
        self.state.rolled_back[variant] = reason
        self.metrics.rollbacks.labels(variant).inc()
        self.metrics.rollback_info.labels(variant, reason).set(1)
        log.warning("canary %s rolled back to 0%% (its %g%% goes to %s): %s", variant, moved,
                    self.splitter.base, reason)
        self._apply(weights, f"rollback of {variant}: {reason}")

    def _sync_k8s(self, weights: dict[str, float], reason: str) -> None:
        if self.patcher is None:
            if self.config.k8s_httproute or reason.startswith("rollback"):
                log.error("ALERT: split is now %s (%s); no Kubernetes access to update the HTTPRoute "
                          "weights, change them by hand if traffic reaches the pools directly", _fmt(weights), reason)
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        task = loop.create_task(self._patch(weights))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _patch(self, weights: dict[str, float]) -> None:
        try:
            assert self.patcher is not None
            await self.patcher(dict(weights))
            log.info("HTTPRoute weights updated to %s", _fmt(weights))
        except Exception as exc:  # an API failure must not take the router down
            log.error("ALERT: could not update the HTTPRoute weights to %s: %s", _fmt(weights), exc)

    # -- measurements -----------------------------------------------------
    def record(self, variant: str | None, error: bool, ttft: float | None = None, tpot: float | None = None,
               output_tokens: int = 0, e2e: float | None = None) -> None:
        if variant is None:
            return
        m = self.metrics
        m.requests.labels(variant).inc()
        if error:
            m.errors.labels(variant).inc()
        if output_tokens:
            m.output_tokens.labels(variant).inc(output_tokens)
        if ttft is not None:
            m.ttft.labels(variant).observe(ttft)
        if tpot is not None:
            m.tpot.labels(variant).observe(tpot)
        if e2e is not None and not error:
            m.e2e.labels(variant).observe(e2e)
        self.guard.observe(variant, ttft, tpot, error, None if error else e2e)
        if variant != self.splitter.base and self.state.weights.get(variant, 0.0) > 0:
            # A verdict sorts the window: every request while it is small, a few times a
            # second once it is large (busy routers), so the guard stays cheap.
            now = time.monotonic()
            if self.guard.size(variant) < _CHECK_EVERY_REQUEST or now - self._checked.get(variant, 0.0) >= 0.25:
                self._checked[variant] = now
                why = self.guard.breach(variant)
                if why:
                    self.rollback(variant, why)

    def observe_response(self, endpoint: str, status: int, content: bytes, started: float | None = None) -> None:
        """A whole (non-streamed) answer; its usage gives the output tokens."""
        tokens = 0
        if status == 200:
            try:
                usage = json.loads(content).get("usage") or {}
                tokens = int(usage.get("completion_tokens") or 0)
            except (ValueError, AttributeError, TypeError):
                pass
        e2e = time.monotonic() - started if started is not None and status == 200 else None
        self.record(self.variant_of(endpoint), error=status >= 500, output_tokens=tokens, e2e=e2e)

    def observe_failure(self, endpoint: str) -> None:
        self.record(self.variant_of(endpoint), error=True)

    def meter(self, endpoint: str, started: float) -> "StreamMeter":
        return StreamMeter(self, self.variant_of(endpoint), started)

    def snapshot(self) -> dict[str, Any]:
        doc = self.state.to_json()
        doc["variants"] = {v.name: v.backends for v in self.config.variants}
        doc["base"] = self.splitter.base
        doc["window"] = {}
        for n in self.splitter.names:
            st = self.guard.stats(n)
            doc["window"][n] = {"samples": st.samples, "errors": st.errors, "ttft_p99": st.ttft_p99,
                                "tpot_p99": st.tpot_p99, "e2e_p99": st.e2e_p99}
        return doc


class StreamMeter:
    """Watches relayed SSE bytes: first token time, token count, usage (if the client asked for it)."""

    def __init__(self, canary: Canary, variant: str | None, started: float) -> None:
        self.canary = canary
        self.variant = variant
        self.started = started
        self.first: float | None = None
        self.last: float | None = None
        self.chunks = 0
        self.usage_tokens: int | None = None
        self._buf = b""
        self._done = False

    def feed(self, data: bytes) -> None:
        if self.variant is None:
            return
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        for line in lines:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if not payload.startswith(b"{"):
                continue
            try:
                obj = json.loads(payload)
            except ValueError:
                continue
            usage = obj.get("usage") if isinstance(obj, dict) else None
            if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                try:
                    self.usage_tokens = int(usage["completion_tokens"])
                except (TypeError, ValueError):
                    pass
            if _has_output(obj):
                now = time.monotonic()
                if self.first is None:
                    self.first = now
                self.last = now
                self.chunks += 1

    def finish(self, error: bool) -> None:
        if self._done:
            return
        self._done = True
        tokens = self.usage_tokens if self.usage_tokens is not None else self.chunks
        ttft = self.first - self.started if self.first is not None else None
        tpot = None
        if self.first is not None and self.last is not None and tokens > 1:
            tpot = (self.last - self.first) / (tokens - 1)
        self.canary.record(self.variant, error=error, ttft=ttft, tpot=tpot, output_tokens=tokens,
                           e2e=time.monotonic() - self.started)


def _has_output(obj: Any) -> bool:
    if not isinstance(obj, dict):
        return False
    for ch in obj.get("choices") or []:
        if not isinstance(ch, dict):
            continue
        if ch.get("text"):
            return True
        delta = ch.get("delta")
        if isinstance(delta, dict) and (delta.get("content") or delta.get("tool_calls")):
            return True
    return False


def _fmt(weights: Mapping[str, float]) -> str:
    return ", ".join(f"{n}={w:g}%" for n, w in weights.items())


def make_canary(config: Any, metrics: RouterMetrics) -> Canary:
    """The Canary of a RouterConfig, with a Kubernetes patcher when one is configured and possible."""
    cc: CanaryConfig = config.canary
    patcher = None
    if cc.k8s_httproute:
        from ..k8s.k8s_weights import HTTPRouteWeights

        try:
            patcher = HTTPRouteWeights.in_cluster(cc.k8s_httproute, cc.k8s_backend_refs).apply
        except (OSError, ValueError) as exc:
            log.warning("no Kubernetes API access for HTTPRoute %s (%s): a rollback will only alert",
                        cc.k8s_httproute, exc)
    return Canary(cc, metrics, patcher)


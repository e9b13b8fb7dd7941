"""The web console and the engine stats endpoint: ``mount_console(app, ui=True)``.

- ``GET /v1/engine/stats``: one JSON document with what the engine is doing
  now (running/waiting, KV blocks by state), what it did over the last minute
  (token rates, prefix-cache hit rate, TTFT/TPOT percentiles, preemptions)
  and what it was started with (model, dtype, quantization, memory). It sits
  under ``/v1/`` so the server's gate puts it behind the API key like the rest
  of the API. Gauges and counters are read from the same sources as
  ``/metrics`` (the engine's published snapshot for state, the metrics
  registry for token counters), so the two never disagree; nothing here reads
  the engine's pool, scheduler or prefix cache directly.
- ``GET /`` and ``/console/*``: a single static page (vanilla JS, no build
  step, nothing fetched from the internet) with a chat playground and a live
  view that polls the stats endpoint every second. With an API key they are
  behind it too: without a credential ``GET /`` answers 401 with a login
  form that posts to ``POST /ui/login``, which sets a session cookie the
  gate then accepts for the page's own API calls; ``POST /ui/logout`` ends
  the session (console_auth.py has the why and how).

The rolling window is fed by ``AsyncEngine.on_step``, which runs in the
engine thread after every step: it sees every delta (tokens out, cached
tokens, per-request timings from the engine's clock, the same ones the
``/metrics`` histograms observe) and the step's own figures (prefill tokens
computed, duration) at the cost of a few dict updates per step.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

import json
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from ...engine.stats import EngineStats, StatsSource
from .console_auth import LOGIN_HEADERS, ConsoleSessions, client_address, login_page, same_origin
from ..server.errors import error_body

if TYPE_CHECKING:
    from ...engine.engine import LLMEngine, SequenceDelta, StepStats
    from ..server.serving import ServerState

STATIC_DIR = Path(__file__).with_name("static")
WINDOW_S = 60  # the "last minute" every windowed figure covers
_RECENT_S = 3  # the "now" token rates: the last few seconds
_MAX_POINTS = 400  # per-request points sent to the page's latency charts
_STALE_S = 600.0  # forget token counts of sequences silent this long (aborted ones emit no final delta)


@dataclass
class _Second:
    """Engine activity during one wall-clock second (monotonic clock)."""

    tokens_in: int = 0  # prompt tokens computed (prefill), cached ones excluded
    tokens_out: int = 0  # tokens generated
    cache_queried: int = 0
    cache_hits: int = 0
    preemptions: int = 0
    steps: int = 0
    busy_s: float = 0.0


@dataclass
class FinishedSequence:
    """One sequence that finished in the window (timings from the engine's clock)."""

    t: float
    ttft: float | None
    tpot: float | None
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    finish_reason: str | None


class SteppingEngine(StatsSource, Protocol):
    """What the window reads of an engine after a step: the snapshot and the step's figures."""

    @property
    def last_step(self) -> StepStats: ...


@dataclass
class EngineWindow:
    """Rolling one-minute record of engine steps and finished sequences.

    ``on_step`` runs in the engine thread and ``snapshot`` on the event loop;
    one lock guards the shared state (both sides hold it for microseconds)."""

    window_s: int = WINDOW_S
    clock: Callable[[], float] = time.monotonic
    seconds: dict[int, _Second] = field(default_factory=dict)
    finished: deque[FinishedSequence] = field(default_factory=deque)
    _open: dict[tuple[str, int], list[float]] = field(default_factory=dict)  # key -> [tokens, cached, last seen]
    _cache_seen: tuple[int, int] | None = None  # (queried, hits) at the last step
    _preempt_seen: int | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    started: float = field(init=False)

    def __post_init__(self) -> None:
        self.started = self.clock()

    def baseline(self, engine: StatsSource) -> None:
        """Take the engine's counters as they stand, so the window counts only what follows."""
        with self._lock:
            self._cache_seen = _cache_counters(engine.stats)
            self._preempt_seen = int(engine.stats.preemptions_total)

    # -- engine thread -------------------------------------------------------
    def on_step(self, engine: SteppingEngine, deltas: list[SequenceDelta]) -> None:
        now = self.clock()
        step = engine.last_step
        queried, hits = _cache_counters(engine.stats)
        preempted = int(engine.stats.preemptions_total)
        with self._lock:
            sec = self.seconds.get(int(now))
            if sec is None:
                sec = self.seconds[int(now)] = _Second()
                self._prune(now)
            sec.steps += 1
            sec.busy_s += float(step.duration_s)
            sec.tokens_in += int(step.num_prefill_tokens)
            if self._cache_seen is not None:
                sec.cache_queried += max(0, queried - self._cache_seen[0])
                sec.cache_hits += max(0, hits - self._cache_seen[1])
            self._cache_seen = (queried, hits)
            if self._preempt_seen is not None:
                sec.preemptions += max(0, preempted - self._preempt_seen)
            self._preempt_seen = preempted
            for d in deltas:
                key = (d.request_id, d.index)
                entry = self._open.setdefault(key, [0, 0, now])
                entry[0] += len(d.token_ids)
                entry[1] = max(entry[1], d.num_cached_tokens)
                entry[2] = now
                sec.tokens_out += len(d.token_ids)
                if d.finished:
                    del self._open[key]
                    self.finished.append(_finished(now, d, int(entry[0]), int(entry[1])))

    def _prune(self, now: float) -> None:
        oldest = int(now) - self.window_s - 1
        for s in [s for s in self.seconds if s < oldest]:
            del self.seconds[s]
        while self.finished and self.finished[0].t < now - self.window_s:
            self.finished.popleft()
        stale = [k for k, v in self._open.items() if v[2] < now - _STALE_S]
        for k in stale:
            del self._open[k]

    # -- event loop ----------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Windowed figures: rates, hit rate, latency percentiles, per-second series."""
        now = self.clock()
        with self._lock:
            self._prune(now)
            seconds = dict(self.seconds)
            finished = list(self.finished)
        current = int(now)
        span = max(1e-3, min(float(self.window_s), now - self.started))
        window = [seconds.get(s) or _Second() for s in range(current - self.window_s + 1, current + 1)]
        total = _Second()
        for sec in window:
            total.tokens_in += sec.tokens_in
            total.tokens_out += sec.tokens_out
            total.cache_queried += sec.cache_queried
            total.cache_hits += sec.cache_hits
            total.preemptions += sec.preemptions
            total.steps += sec.steps
            total.busy_s += sec.busy_s
        # "now": the last few complete seconds plus the running one
        recent = window[-(_RECENT_S + 1):]
        recent_span = max(1e-3, min(_RECENT_S + (now - current), now - self.started))
        ttfts = [f.ttft for f in finished if f.ttft is not None]
        tpots = [f.tpot for f in finished if f.tpot is not None]
        return {
            "window_s": self.window_s,
            "tokens_in_per_s": sum(s.tokens_in for s in recent) / recent_span,
            "tokens_out_per_s": sum(s.tokens_out for s in recent) / recent_span,
            "tokens_in_per_s_1m": total.tokens_in / span,
            "tokens_out_per_s_1m": total.tokens_out / span,
            "steps_per_s_1m": total.steps / span,
            "busy_fraction_1m": min(1.0, total.busy_s / span),
            "series": {  # oldest first; the last entry is the running second
                "tokens_in": [s.tokens_in for s in window],
                "tokens_out": [s.tokens_out for s in window],
            },
            "prefix_cache": {
                "queried_tokens": total.cache_queried, "hit_tokens": total.cache_hits,
                "hit_rate": total.cache_hits / total.cache_queried if total.cache_queried else None,
            },
            "preemptions": total.preemptions,
            "requests": {
                "finished": len(finished),
                "prompt_tokens": sum(f.prompt_tokens for f in finished),
                "cached_tokens": sum(f.cached_tokens for f in finished),
                "output_tokens": sum(f.output_tokens for f in finished),
            },
            "ttft": _percentiles(ttfts),
            "tpot": _percentiles(tpots),
            # [seconds ago, ttft, tpot] of the newest sequences, for the charts
            "points": [[round(now - f.t, 3), f.ttft, f.tpot] for f in finished[-_MAX_POINTS:]],
        }


def _speculative(stats: EngineStats) -> dict[str, Any]:
    """Speculative decoding's counters (the same as /metrics' vllm:spec_decode_*)."""
    spec = stats.spec
    if spec is None:
        return {"enabled": False}
    return {"enabled": True, "drafts": spec.num_drafts, "draft_tokens": spec.num_draft_tokens,
            "accepted_tokens": spec.num_accepted_tokens, "acceptance_rate": spec.acceptance_rate,
            "accepted_per_position": list(spec.accepted_per_position)}


def _cache_counters(stats: EngineStats) -> tuple[int, int]:
    return int(stats.prefix_queried_tokens), int(stats.prefix_hit_tokens)


def _finished(now: float, delta: SequenceDelta, output_tokens: int, cached: int) -> FinishedSequence:
    m = delta.metrics or {}
    ttft = m.get("ttft")
    e2e = m.get("e2e")
    tpot = None
    if ttft is not None and e2e is not None and output_tokens > 1:
        # the same definition as vllm:time_per_output_token_seconds
        tpot = max(0.0, e2e - ttft) / (output_tokens - 1)
    return FinishedSequence(t=now, ttft=ttft, tpot=tpot, prompt_tokens=int(delta.num_prompt_tokens),
                            cached_tokens=cached, output_tokens=output_tokens, finish_reason=delta.finish_reason)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of a non-empty list."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _percentiles(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None}
    return {"count": len(values), "mean": sum(values) / len(values),
            "p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99)}


# ---- the stats document ---------------------------------------------------------

def startup_facts(state: ServerState) -> dict[str, Any]:
    """What the server was started with; fixed for its lifetime (read once, at mount)."""
    engine = state.engine
    st = engine.stats
    cfg = engine.config
    mc = engine.model_config
    runner = getattr(engine, "runner", None)
    kv_bytes = getattr(runner, "kv_cache_bytes", None)
    return {
        "name": state.model_name,
        "served_names": list(state.settings.served_model_names),
        "path": state.settings.model_path or "bundled SmolLM2-135M-Instruct",
        "architecture": mc.architecture,
        "layers": mc.num_hidden_layers, "hidden_size": mc.hidden_size, "vocab_size": mc.vocab_size,
        "dtype": str(cfg.dtype), "device": str(cfg.device), "quantization": str(cfg.quantization or "none"),
        "weight_bytes": int(engine.weight_bytes),
        "kv_pool_bytes": int(kv_bytes) if kv_bytes is not None else None,
        "num_blocks": int(st.blocks_total), "block_size": int(engine.block_size),
        "pool_tokens": int(state.pool_tokens), "max_model_len": int(state.max_model_len),
        "max_num_seqs": cfg.scheduler.max_num_seqs, "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
        "batching": cfg.scheduler.batching, "prefix_caching": st.prefix_cache_enabled,
        "api_key_required": state.settings.api_key is not None,
    }


class ConsoleStats:
    """Builds ``/v1/engine/stats`` from the engine, the metrics registry and the window."""

    def __init__(self, state: ServerState, window: EngineWindow) -> None:
        self.state = state
        self.window = window
        self.facts = startup_facts(state)
        self.started_unix = time.time()

    def _registry_counters(self) -> tuple[dict[str, float], dict[str, float]]:
        """Token counters and finished-by-reason counts, read from the /metrics registry in one pass."""
        wanted = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
        counters = dict.fromkeys(wanted, 0.0)
        finished: dict[str, float] = {}
        for family in self.state.metrics.vllm.collect():
            for s in family.samples:
                if s.name in counters:
                    counters[s.name] += s.value
                elif s.name == "vllm:request_success_total":
                    finished[s.labels["finished_reason"]] = s.value
        return counters, finished

    def document(self) -> dict[str, Any]:
        state = self.state
        st = state.engine.stats  # the engine's last published snapshot (engine/stats.py)
        recent = self.window.snapshot()
        counters, finished = self._registry_counters()
        return {
            "time": time.time(),
            "uptime_s": time.time() - self.started_unix,
            "model": self.facts,
            # the same reads as /metrics' vllm:num_requests_running / _waiting
            "running": st.num_running,
            "waiting": int(state.num_waiting()),
            "draining": bool(state.draining),
            "kv_blocks": {"total": st.blocks_total, "in_use": st.blocks_in_use,
                          "cached": st.blocks_cached_idle, "free": st.blocks_free, "usage": st.kv_usage},
            "prefix_cache": {
                "enabled": st.prefix_cache_enabled,
                "cached_blocks": st.prefix_cached_blocks,
                "queried_tokens_total": st.prefix_queried_tokens,
                "hit_tokens_total": st.prefix_hit_tokens,
            },
            "preemptions_total": st.preemptions_total,
            # why prompts missed reusable cache, most requests first (traffic/cache_misses.py)
            "cache_misses": state.misses.summary() if state.misses is not None else [],
            "speculative": _speculative(st),
            "totals": {  # read from the /metrics registry itself
                "prompt_tokens": int(counters["vllm:prompt_tokens_total"]),
                "generation_tokens": int(counters["vllm:generation_tokens_total"]),
                "finished": {k: int(v) for k, v in sorted(finished.items())},
            },
            "last_minute": recent,
            "tenants": self._tenants(),
        }

    def _tenants(self) -> list[dict[str, Any]]:
        """Per tenant (the keys file's, and default): its place (class, weight, the fair
        share's tokens computed, sequences in the engine) and usage; empty when the
        server has no keys file and nobody but the default tenant was seen."""
        state = self.state
        usage = state.usage.snapshot()
        shares = state.engine.tenant_shares()
        if set(usage) == {"default"} and not state.settings.api_keys_file:
            return []
        rows = []
        for name, counters in usage.items():
            tenant = state.tenants.tenant(name)
            share = shares.get(name, {})
            rows.append({"tenant": name, "priority_class": tenant.priority_class, "weight": tenant.weight,
                         "computed_tokens": int(share.get("tokens", 0)), "active": int(share.get("active", 0)),
                         **counters})
        return rows


def mount_console(app: FastAPI, ui: bool = True) -> ConsoleStats:
    """Add ``/v1/engine/stats`` (always) and, when ``ui``, the console page to a ``build_app`` app.

    Installs the window's step hook on the app's AsyncEngine, chained after
    any hook already there."""
    state = app.state.tokenmill
    aengine = state.aengine
    window = EngineWindow()
    window.baseline(state.engine)
    previous = aengine.on_step

    def on_step(engine: LLMEngine, deltas: list[SequenceDelta]) -> None:
        if previous is not None:
            previous(engine, deltas)
        window.on_step(engine, deltas)

    aengine.on_step = on_step
    stats = ConsoleStats(state, window)
    app.state.console = stats

    @app.get("/v1/engine/stats", tags=["console"])
    async def engine_stats() -> JSONResponse:
        return JSONResponse(stats.document(), headers={"Cache-Control": "no-store"})

    if ui:
        sessions = getattr(app.state, "console_sessions", None)
        if sessions is None:  # an app not made by build_app: no gate shares it
            sessions = ConsoleSessions(state.settings.api_key)
        _mount_page(app, sessions, state.metrics)
    return stats


_LOGIN_BODY_LIMIT = 4096  # a form with one key in it


def _mount_page(app: FastAPI, sessions: ConsoleSessions, metrics: Any) -> None:
    """``GET /``, the assets under ``/console/`` and, with a key, sign-in and sign-out."""
    page_headers = {"Cache-Control": "no-store" if sessions.enabled else "no-cache",
                    "X-Frame-Options": "DENY", "Content-Security-Policy": "frame-ancestors 'none'"}

    def refuse_login(status: int, error: str | None) -> HTMLResponse:
        return HTMLResponse(login_page(error), status_code=status, headers=LOGIN_HEADERS)

    @app.get("/", include_in_schema=False)
    async def console_page(request: Request) -> Response:
        if sessions.enabled and sessions.credential(request.scope) is None:
            return refuse_login(401, None)
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers=page_headers)

    @app.post("/ui/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        if not sessions.enabled:
            return RedirectResponse("/", status_code=303)
        if not same_origin(request.scope):
            metrics.rejected.labels("auth").inc()
            return refuse_login(403, "Sign-in refused: the form was sent from another site.")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > _LOGIN_BODY_LIMIT:
                return refuse_login(413, "That form was too large.")
        client = client_address(request.scope)
        wait = sessions.throttle.wait_s(client)
        if wait > 0:  # the key is not even looked at: guesses cost time
            metrics.rejected.labels("auth").inc()
            response = refuse_login(429, f"Too many wrong keys. Try again in {math.ceil(wait)} s.")
            response.headers["Retry-After"] = str(math.ceil(wait))
            return response
        fields = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
        given = (fields.get("key") or [""])[0].strip()
        if not sessions.key_matches(given):
            metrics.rejected.labels("auth").inc()
            delay = sessions.throttle.failed(client)
            later = f" You can try again in {math.ceil(delay)} s." if delay > 0 else " Try again."
            return refuse_login(401, "That key is not right." + later)
        sessions.throttle.succeeded(client)
        token = sessions.open()
        redirect = RedirectResponse("/", status_code=303, headers={"Cache-Control": "no-store"})
        redirect.headers.append("Set-Cookie", sessions.cookie_header(request.scope, token))
        return redirect

    @app.get("/ui/login", include_in_schema=False)
    async def login_get() -> Response:  # a reload or a bookmark: the page decides what to show
        return RedirectResponse("/", status_code=303)

    @app.post("/ui/logout", include_in_schema=False)
    async def logout(request: Request) -> Response:
        if sessions.enabled and not same_origin(request.scope):
            return JSONResponse(error_body(403, "cross-origin sign-out refused", code="cross_origin"),
                                status_code=403)
        sessions.close(sessions.token_of(request.scope))
        response = RedirectResponse("/", status_code=303, headers={"Cache-Control": "no-store"})
        if sessions.enabled:
            response.headers.append("Set-Cookie", sessions.cookie_header(request.scope, None))
        return response

    app.mount("/console", _KeyGuard(StaticFiles(directory=STATIC_DIR), sessions), name="console")


class _KeyGuard:
    """The console's assets need the same credential as the page (a 401 in OpenAI's shape without it)."""

    def __init__(self, app: ASGIApp, sessions: ConsoleSessions) -> None:
        self.app = app
        self.sessions = sessions

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.sessions.enabled and self.sessions.credential(scope) is None:
            body = json.dumps(error_body(401, "sign in to the console first (or send 'Authorization: Bearer KEY')",
                                         code="invalid_api_key")).encode()
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()),
                                    (b"www-authenticate", b"Bearer")]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)

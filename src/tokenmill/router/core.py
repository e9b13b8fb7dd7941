"""The router's shared brain: pool + tokenizer + policy + metrics.

Both front ends use it: the HTTP reverse proxy (proxy.py) and the Envoy
ext_proc endpoint picker (ext_proc.py). ``route`` picks a backend and counts
the request as in flight there until ``release``; the chosen backend's prefix
index records the request's blocks at once, so the next request sharing the
prefix follows it even before the first one finishes.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Collection

import httpx

from . import models
from .backend import Backend
from .config import RouterConfig
from .metrics import RouterMetrics
from .policy import Decision, PrefixAware, make_policy
from .pool import BackendPool
from .cache.prefix_index import block_hashes
from .sessions import SessionTable, previous_response_of
from .tokenize import CharChunker, LocalTokenizer, RemoteTokenizer, Tokenizer, prompt_of

log = logging.getLogger("tokenmill.router")


class NoBackendError(Exception):
    """No ready backend (HTTP 503)."""


class ShedError(Exception):
    """Every ready backend is past the shedding threshold (HTTP 429)."""


class ConversationUnavailable(Exception):
    """The replica that holds a conversation (``previous_response_id``) is not in rotation:
    no other replica could continue it (HTTP 502)."""

    def __init__(self, response_id: str, url: str) -> None:
        super().__init__(f"previous_response_id {response_id!r} was produced by the replica {url}, which is "
                         "not in rotation (down or removed); no other replica holds the conversation")
        self.response_id = response_id
        self.url = url


def make_client(config: RouterConfig) -> httpx.AsyncClient:
    timeout = httpx.Timeout(config.request_timeout, connect=config.connect_timeout)
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    return httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)


class Router:
    def __init__(self, config: RouterConfig, client: httpx.AsyncClient | None = None) -> None:
        config.validate()
        self.config = config
        self.client = client or make_client(config)
        self.metrics = RouterMetrics()
        self.canary = None
        if config.canary is not None:  # variants' backends join the pool
            from .canary.canary import make_canary

            self.canary = make_canary(config, self.metrics)
        self._listeners: list[Callable[[], None]] = []
        self.pool = BackendPool(config, self.client, on_health_change=self._health_changed)
        self.policy = make_policy(config)
        self.sessions = SessionTable(responses=config.conversation_capacity)
        from .tenancy import RouterTenancy

        self.tenancy = RouterTenancy(config.api_keys_file, config.objectives, config.api_key,
                                     on_reload_failure=self.metrics.keys_reload_failures.inc)
        from ..gateway.tracing import make_tracing

        self.tracing = make_tracing(config.otlp_traces_endpoint, "tokenmill-router")
        self.tokenizer = self._make_tokenizer()
        self.metrics.tokenizer.labels(self.tokenizer.mode).set(1)

    def _make_tokenizer(self) -> Tokenizer:
        c = self.config
        chars = CharChunker(c.chars_per_block)
        if c.tokenizer:
            return LocalTokenizer(c.tokenizer, c.block_size)
        if c.remote_tokenize:
            headers = {"Authorization": f"Bearer {c.backend_api_key}"} if c.backend_api_key else {}
            return RemoteTokenizer(self.client, c.block_size, chars, headers=headers)
        log.warning("no tokenizer: routing on %d-character chunks", c.chars_per_block)
        return chars

    # -- lifecycle --------------------------------------------------------
    async def start(self) -> None:
        await self.pool.start()

    async def stop(self) -> None:
        await self.pool.stop()
        await self.client.aclose()
        if self.tracing is not None:
            self.tracing.close()

    def add_listener(self, fn: Callable[[], None]) -> None:
        """Called whenever a backend enters or leaves rotation."""
        self._listeners.append(fn)

    def _health_changed(self, backend: Backend, healthy: bool) -> None:
        self.metrics.health_changes.labels(backend.url, "up" if healthy else "down").inc()
        self.metrics.healthy.labels(backend.url).set(1 if healthy else 0)
        for fn in self._listeners:
            fn()

    def ready(self) -> bool:
        return bool(self.pool.healthy())

    # -- routing ----------------------------------------------------------
    async def block_keys(self, path: str, body: Any, candidates: list[Backend]) -> list[bytes]:
        text, ids = prompt_of(path, body)
        if ids is not None:
            return block_hashes(ids, self.config.block_size)
        if not text:
            return []
        model = body.get("model") if isinstance(body, dict) else None
        # Ask the least-loaded candidate when tokenizing remotely.
        w = self.config.kv_usage_weight
        via = min(candidates, key=lambda b: b.load(w)).url if candidates else None
        if (self.config.prefix_source == "events" and isinstance(self.tokenizer, RemoteTokenizer)
                and path.endswith("/chat/completions") and isinstance(body.get("messages"), list)):
            # Events name the blocks of the rendered prompt: tokenize it as the backend renders it.
            toks = await self.tokenizer.encode_messages(body["messages"], body.get("add_generation_prompt", True)
                                                        is not False, text, model, via)
        else:
            toks = await self.tokenizer.encode(text, model, via)
        if toks.mode != self.tokenizer.mode:
            self.metrics.tokenizer.labels(self.tokenizer.mode).set(0)
            self.metrics.tokenizer.labels(toks.mode).set(1)
        return block_hashes(toks.ids, toks.block_size)

    def candidates(self, exclude: Collection[str] = (), subset: Collection[str] | None = None) -> list[Backend]:
        out = [b for b in self.pool.healthy() if b.url not in exclude]
        if subset is not None:
            allowed = set(subset)
            out = [b for b in out if b.endpoint in allowed]
        return out

    async def route(self, path: str, body: Any, exclude: Collection[str] = (),
                    subset: Collection[str] | None = None, session: str | None = None,
                    priority: int | None = None) -> Decision:
        """Pick a backend and count the request in flight there (call ``release``). A request
        of a known ``session`` (sessions.session_key) goes to its home replica while that one
        is ready and not overloaded; one continuing a known Responses API conversation goes to
        the replica holding it, however loaded (reason ``conversation``; raises
        ConversationUnavailable when that replica is out of rotation). ``priority``: its
        objective's (tenancy.py); one of zero or more is never shed."""
        pinned = self.conversation_home(body)
        cands = self.candidates(exclude, subset)
        if not cands and pinned is None:
            raise NoBackendError("no ready backend")
        c = self.config
        sheddable = priority is None or priority < 0
        everyone = cands or [pinned]  # shed when every ready replica is saturated, as for any request
        if sheddable and c.shed_load > 0 and all(b.load(c.kv_usage_weight) >= c.shed_load for b in everyone):
            self.metrics.decisions.labels("shed").inc()
            raise ShedError("all backends are saturated")
        if pinned is not None:
            cands = [pinned]
        keys = await self.block_keys(path, body, cands) if self.policy.name == "prefix" else []
        # Health may have changed while tokenizing remotely.
        if pinned is not None:
            self.conversation_home(body)  # raises if the conversation's replica left meanwhile
            decision = Decision(pinned, "conversation", pinned.index.match(keys), len(keys))
        else:
            cands = [b for b in cands if b.healthy] or self.candidates(exclude, subset)
            if not cands:
                raise NoBackendError("no ready backend")
            decision = self._choose(body, cands, session, keys)
        if session is not None:
            self.sessions.settle(session, decision.backend.url, kept=decision.reason in ("session", "conversation"))
        self.acquire(decision, keys)
        return decision

    def _choose(self, body: Any, cands: list[Backend], session: str | None, keys: list[bytes]) -> Decision:
        """The policy's pick among the replicas that serve the request's model (those with its
        LoRA adapter resident first), a session's home first."""
        c, w = self.config, self.config.kv_usage_weight
        cands, why = models.select(cands, models.model_of(body),
                                   lambda b, low: PrefixAware(c).overloaded(b.load(w), low), lambda b: b.load(w))
        if why != "any":
            self.metrics.model_routing.labels(why).inc()
        return self._session_home(session, cands, keys) or self.policy.choose(cands, keys)

    def conversation_home(self, body: Any) -> Backend | None:
        """The replica holding the conversation ``body`` continues (``previous_response_id``),
        None when the request continues none the router knows of. Raises ConversationUnavailable
        when that replica is out of rotation: sending the request elsewhere could only get 404."""
        rid = previous_response_of(body)
        url = self.sessions.response_home(rid) if rid is not None else None
        if url is None:
            return None
        home = self.pool.backends.get(url)
        if home is None or not home.healthy:
            raise ConversationUnavailable(rid, url)
        return home

    def _session_home(self, session: str | None, cands: list[Backend], keys: list[bytes]) -> Decision | None:
        url = self.sessions.home(session) if session is not None else None
        home = next((b for b in cands if b.url == url), None)
        if home is None:
            return None
        w = self.config.kv_usage_weight
        if PrefixAware(self.config).overloaded(home.load(w), min(b.load(w) for b in cands)):
            return None
        return Decision(home, "session", home.index.match(keys), len(keys))

    def fallbacks(self, primary: Backend, n: int, subset: Collection[str] | None = None) -> list[Backend]:
        """Up to ``n`` other ready backends for the gateway to try if ``primary``
        fails, least loaded first (their caches are no better a guess than load)."""
        if n <= 0:
            return []
        w = self.config.kv_usage_weight
        others = [b for b in self.candidates(subset=subset) if b is not primary]
        return sorted(others, key=lambda b: (b.load(w), b.url))[:n]

    def acquire(self, decision: Decision, keys: list[bytes]) -> None:
        b = decision.backend
        b.in_flight += 1
        b.requests_total += 1
        if keys:
            b.index.insert(keys)
            self.metrics.match_ratio.observe(decision.matched_blocks / len(keys))
        self.metrics.requests.labels(b.url).inc()
        self.metrics.decisions.labels(decision.reason).inc()
        self.metrics.in_flight.labels(b.url).set(b.in_flight)

    def release(self, backend: Backend) -> None:
        backend.in_flight = max(0, backend.in_flight - 1)
        self.metrics.in_flight.labels(backend.url).set(backend.in_flight)

    def snapshot(self) -> dict:
        return {
            "policy": self.policy.name,
            "tokenizer": self.tokenizer.mode,
            "backends": [b.snapshot() for b in self.pool.backends.values()],
            "sessions": self.sessions.snapshot(),
        }

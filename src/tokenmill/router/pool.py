"""The set of backends, kept fresh: health checks, /metrics scrapes, DNS.

Every ``health_interval`` seconds each backend gets ``GET /health`` and, when
healthy, ``GET /metrics``. A failed check (or a request that could not
connect, reported by the proxy) takes the backend out of rotation at once; a
passing check puts it back. A backend that comes back after being down starts
with an empty prefix index, since a restarted server has an empty cache.

``backend_dns`` names (a headless Service in Kubernetes) are re-resolved on
the same beat, so pods that come and go join and leave the pool without the
router needing the Kubernetes API. With ``pool_name`` the members are the
ready pods of that InferencePool, watched through the Kubernetes API
(k8s_pool.py) and synced on the same beat.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from . import models
from .backend import Backend, BackendStats, normalize_url
from .config import RouterConfig
from .cache.kv_index import EventIndex, EventSubscriber, RoutingIndex
from .cache.prefix_index import PrefixIndex

log = logging.getLogger("tokenmill.router")


def parse_backend_metrics(text: str) -> BackendStats:
    """vLLM-named gauges and counters out of Prometheus text (summed over labels)."""
    sums: dict[str, float] = {}
    stats = BackendStats(scraped_at=time.monotonic())
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:cache_config_info":
                if "num_gpu_blocks" in s.labels:
                    try:
                        stats.num_gpu_blocks = int(float(s.labels["num_gpu_blocks"]))
                    except ValueError:
                        pass
                if "block_size" in s.labels:
                    try:
                        stats.block_size = int(float(s.labels["block_size"]))
                    except ValueError:
                        pass
                continue
            sums[s.name] = sums.get(s.name, 0.0) + float(s.value)
    stats.running = sums.get("vllm:num_requests_running", 0.0)
    stats.waiting = sums.get("vllm:num_requests_waiting", 0.0)
    stats.kv_usage = sums.get("vllm:kv_cache_usage_perc", 0.0)
    stats.prefix_queries = sums.get("vllm:prefix_cache_queries_total", 0.0)
    stats.prefix_hits = sums.get("vllm:prefix_cache_hits_total", 0.0)
    return stats


class BackendPool:
    """Owns the Backend objects and the background loop that keeps them current."""

    def __init__(
        self,
        config: RouterConfig,
        client: httpx.AsyncClient,
        on_health_change: Callable[[Backend, bool], None] | None = None,
    ) -> None:
        self.config = config
        self.client = client
        self.backends: dict[str, Backend] = {}
        self.on_health_change = on_health_change
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self.membership = None  # k8s_pool.PoolMembership with pool_name, from start()
        self.subscribers: list[EventSubscriber] = []  # KV event streams (--prefix-source events)
        for url in config.backends:
            self._add(normalize_url(url))

    # -- membership -------------------------------------------------------
    def _add(self, url: str, from_dns: bool = False) -> Backend:
        if url not in self.backends:
            self.backends[url] = Backend(url=url, index=self._index_for(url), from_dns=from_dns)
        return self.backends[url]

    def _index_for(self, url: str) -> "PrefixIndex | RoutingIndex":
        """The approximate index; with ``--prefix-source events`` and an event stream for this
        backend, that index behind the one its events keep (router/cache/kv_index.py)."""
        approx = PrefixIndex(self.config.index_capacity_blocks)
        stream = self.config.kv_events.get(url) if self.config.prefix_source == "events" else None
        if stream is None:
            if self.config.prefix_source == "events":
                log.warning("backend %s has no --kv-events stream: routing to it on the approximate index", url)
            return approx
        index = RoutingIndex(approx, EventIndex(self.config.block_size), self.config.events_stale_after)
        self.subscribers.append(EventSubscriber(index, stream[0], stream[1],
                                                curve=self.config.kv_events_curve()).start())
        return index

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends.values() if b.healthy]

    def get(self, url: str) -> Backend | None:
        return self.backends.get(url)

    def by_endpoint(self, endpoint: str) -> Backend | None:
        for b in self.backends.values():
            if b.endpoint == endpoint:
                return b
        return None

    async def _resolve_dns(self) -> None:
        loop = asyncio.get_running_loop()
        seen: set[str] = set()
        for entry in self.config.backend_dns:
            name, _, port = entry.rpartition(":")
            try:
                infos = await loop.getaddrinfo(name, int(port), type=socket.SOCK_STREAM)
            except (OSError, ValueError) as exc:
                log.warning("cannot resolve %s: %s", entry, exc)
                # Keep what we had for this name rather than emptying the pool.
                seen.update(u for u, b in self.backends.items() if b.from_dns)
                continue
            for family, _, _, _, sockaddr in infos:
                host = sockaddr[0]
                if family == socket.AF_INET6:
                    host = f"[{host}]"
                url = f"http://{host}:{sockaddr[1]}"
                seen.add(url)
                self._add(url, from_dns=True)
        for url in [u for u, b in self.backends.items() if b.from_dns and u not in seen]:
            log.info("backend %s left DNS; removing", url)
            del self.backends[url]

    # -- checks -----------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        key = self.config.backend_api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _set(self, backend: Backend, healthy: bool, reason: str = "") -> None:
        if healthy:
            changed = backend.mark_up()
            if changed:
                # A server that was down restarted (or never served us): cold cache.
                backend.index.clear()
                log.info("backend %s in rotation", backend.url)
        else:
            changed = backend.mark_down(reason)
            if changed:
                log.warning("backend %s out of rotation: %s", backend.url, reason)
        if changed and self.on_health_change:
            self.on_health_change(backend, healthy)

    def report_failure(self, backend: Backend, reason: str) -> None:
        """The proxy could not reach this backend at all: out of rotation now."""
        self._set(backend, False, reason)
        self._wake.set()

    def report_suspect(self, backend: Backend, reason: str) -> None:
        """The backend answered 5xx: check every backend's health now (the check decides)."""
        log.info("backend %s answered %s; checking its health", backend.url, reason)
        self._wake.set()

    async def probe(self, backend: Backend) -> bool:
        """Whether the backend is alive right now (its /health answers 200 within the health
        timeout). A backend that is not is taken out of rotation. Used after a request failed
        once it was sent, to tell a backend that died from a connection that broke."""
        try:
            r = await self.client.get(backend.url + "/health", timeout=httpx.Timeout(self.config.health_timeout),
                                      headers=self._headers())
        except httpx.HTTPError as exc:
            self.report_failure(backend, f"not answering after a failed request: {type(exc).__name__}")
            return False
        if r.status_code != 200:
            self.report_failure(backend, f"health {r.status_code} after a failed request")
            return False
        return True

    async def check(self, backend: Backend) -> None:
        timeout = httpx.Timeout(self.config.health_timeout)
        try:
            r = await self.client.get(backend.url + "/health", timeout=timeout, headers=self._headers())
        except httpx.TimeoutException as exc:
            backend.check_timeouts += 1
            if backend.healthy and backend.check_timeouts < self.config.health_timeouts_to_fail:
                log.debug("health check of %s timed out (%d in a row)", backend.url, backend.check_timeouts)
                return
            self._set(backend, False, f"health check: {type(exc).__name__}")
            return
        except httpx.HTTPError as exc:
            self._set(backend, False, f"health check: {type(exc).__name__}")
            return
        backend.check_timeouts = 0
        if r.status_code != 200:
            self._set(backend, False, f"health check: HTTP {r.status_code}")
            return
        try:
            inflight = backend.in_flight
            m = await self.client.get(backend.url + "/metrics", timeout=timeout, headers=self._headers())
            if m.status_code == 200:
                stats = parse_backend_metrics(m.text)
                # Ours while the scrape was under way: the smaller count errs toward "external".
                stats.inflight_at_scrape = min(inflight, backend.in_flight)
                self._apply_stats(backend, stats)
                models.view_of(backend).resident = models.resident_from_metrics(
                    text_string_to_metric_families(m.text))
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("metrics scrape of %s failed: %s", backend.url, exc)
        try:  # which models (and LoRA adapters) it serves: routing by model (models.py)
            r = await self.client.get(backend.url + "/v1/models", timeout=timeout, headers=self._headers())
            if r.status_code == 200:
                view = models.view_of(backend)
                view.models, view.adapters = models.parse_models(r.json())
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("model list of %s failed: %s", backend.url, exc)
        self._set(backend, True)

    def _apply_stats(self, backend: Backend, stats: BackendStats) -> None:
        old = backend.stats
        # Counters that went backwards mean the server restarted: cold cache.
        if stats.prefix_queries < old.prefix_queries:
            backend.index.clear()
        backend.stats = stats
        if stats.num_gpu_blocks:
            # Convert the backend's blocks to ours when block sizes differ.
            ratio = (stats.block_size or self.config.block_size) / self.config.block_size
            backend.index.resize(int(stats.num_gpu_blocks * ratio))

    def _sync_members(self, urls: set[str]) -> None:
        """Discovered backends (InferencePool pods) become exactly ``urls``."""
        for url in urls:
            self._add(url, from_dns=True)
        for url in [u for u, b in self.backends.items() if b.from_dns and u not in urls]:
            log.info("backend %s left the pool; removing", url)
            del self.backends[url]

    async def check_all(self) -> None:
        if self.config.backend_dns:
            await self._resolve_dns()
        if self.membership is not None:
            self._sync_members(self.membership.endpoints())
        await asyncio.gather(*(self.check(b) for b in list(self.backends.values())))

    async def _loop(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.check_all()
            except Exception:  # never let the health loop die
                log.exception("health loop iteration failed")
            delay = max(0.0, self.config.health_interval - (time.monotonic() - started))
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=delay)
                # Woken early by a failure report: pause briefly so a flapping
                # backend is not hammered, then re-check everything.
                self._wake.clear()
                await asyncio.sleep(min(0.2, self.config.health_interval))
            except asyncio.TimeoutError:
                pass

    async def start(self) -> None:
        if self.config.pool_name and self.membership is None:
            from .k8s.k8s_pool import PoolMembership

            loop = asyncio.get_running_loop()
            self.membership = PoolMembership(self.config.pool_name, self.config.pool_namespace,
                                             on_change=lambda: loop.call_soon_threadsafe(self._wake.set))
            await asyncio.to_thread(self.membership.start)
        await self.check_all()
        self._task = asyncio.create_task(self._loop(), name="router-health")

    async def stop(self) -> None:
        for sub in self.subscribers:
            await asyncio.to_thread(sub.stop)
        if self.membership is not None:
            await asyncio.to_thread(self.membership.stop)
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

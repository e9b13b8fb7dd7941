"""One model-server replica as the router sees it: address, health, load.

Load has two sources. The router counts its own in-flight requests exactly
and instantly; the backend's ``/metrics`` (vLLM names) adds what other
clients or routers put there, but is only as fresh as the last scrape. The
load used for routing takes the larger of the two and adds a term for KV-cache
pressure, since a nearly full cache means preemptions ahead.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from .cache.prefix_index import PrefixIndex


def normalize_url(url: str) -> str:
    """``127.0.0.1:8001`` or ``http://host:8001/`` -> ``http://host:8001``."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    return url.rstrip("/")


def endpoint_of(url: str) -> str:
    """``ip:port`` of a base URL, as the endpoint-picker protocol wants it."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    return f"{host}:{port}"


@dataclass
class BackendStats:
    """Gauges and counters scraped from a backend's /metrics."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0  # 0..1
    prefix_queries: float = 0.0  # tokens
    prefix_hits: float = 0.0  # tokens
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    scraped_at: float = 0.0
    inflight_at_scrape: int = 0  # the router's own in-flight count when scraped


@dataclass
class Backend:
    url: str
    index: PrefixIndex
    healthy: bool = False  # in rotation only after a passing check
    in_flight: int = 0
    stats: BackendStats = field(default_factory=BackendStats)
    last_check: float = 0.0
    last_error: str | None = None
    consecutive_failures: int = 0
    check_timeouts: int = 0  # health checks in a row that timed out
    from_dns: bool = False
    requests_total: int = 0

    @property
    def endpoint(self) -> str:
        return endpoint_of(self.url)

    def external_load(self) -> float:
        """Requests others (clients, other routers) had running or waiting at the last scrape."""
        scraped = self.stats.running + self.stats.waiting
        return max(0.0, scraped - self.stats.inflight_at_scrape)

    def load(self, kv_usage_weight: float = 0.0) -> float:
        # Our own in-flight count is exact and current; the scrape is only as
        # fresh as the health interval, so it contributes just what is not ours.
        return self.in_flight + self.external_load() + kv_usage_weight * self.stats.kv_usage

    def mark_down(self, reason: str) -> bool:
        """Take the backend out of rotation; True when it was in rotation."""
        was = self.healthy
        self.healthy = False
        self.last_error = reason
        self.consecutive_failures += 1
        self.last_check = time.monotonic()
        return was

    def mark_up(self) -> bool:
        """Put the backend (back) in rotation; True when it was out."""
        was_down = not self.healthy
        self.healthy = True
        self.last_error = None
        self.consecutive_failures = 0
        self.last_check = time.monotonic()
        return was_down

    def snapshot(self) -> dict:
        return {
            "url": self.url,
            "endpoint": self.endpoint,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "requests_total": self.requests_total,
            "running": self.stats.running,
            "waiting": self.stats.waiting,
            "kv_cache_usage": self.stats.kv_usage,
            "prefix_cache_queries": self.stats.prefix_queries,
            "prefix_cache_hits": self.stats.prefix_hits,
            "index_blocks": len(self.index),
            "index_capacity_blocks": self.index.capacity_blocks,
            "last_error": self.last_error,
        }

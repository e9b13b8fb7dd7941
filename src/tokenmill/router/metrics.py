"""The router's own Prometheus metrics, in a private registry.

A private registry keeps several routers in one process (tests, benchmarks)
from colliding, and keeps /metrics to what the router itself knows.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "tokenmill_router_requests", "Requests sent to each backend (attempts, retries included).",
            ["backend"], registry=r)
        self.decisions = Counter(
            "tokenmill_router_routing_decisions", "Routing decisions by reason.",
            ["reason"], registry=r)
        self.responses = Counter(
            "tokenmill_router_responses", "Responses to clients by status code.",
            ["code"], registry=r)
        self.model_routing = Counter(
            "tokenmill_router_model_routing", "Requests narrowed by their model: to replicas serving it "
            "(model) or, for a LoRA adapter, to replicas with it resident (lora_resident).",
            ["reason"], registry=r)
        self.retries = Counter(
            "tokenmill_router_retries", "Requests retried on another backend before their first byte.",
            registry=r)
        self.stream_errors = Counter(
            "tokenmill_router_stream_errors", "Streams that broke after their first byte.",
            ["backend"], registry=r)
        self.poisoned = Counter(
            "tokenmill_router_poisoned_requests",
            "Requests refused, not retried, because their backend died while handling them.",
            registry=r)
        self.health_changes = Counter(
            "tokenmill_router_backend_health_changes", "Backends entering (up) or leaving (down) rotation.",
            ["backend", "state"], registry=r)
        self.healthy = Gauge(
            "tokenmill_router_backend_healthy", "1 while the backend is in rotation.",
            ["backend"], registry=r)
        self.in_flight = Gauge(
            "tokenmill_router_backend_in_flight", "Requests the router has open on each backend.",
            ["backend"], registry=r)
        self.match_ratio = Histogram(
            "tokenmill_router_prefix_match_ratio",
            "Share of a request's blocks the chosen backend was estimated to hold.",
            buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0), registry=r)
        self.keys_reload_failures = Counter(
            "tokenmill_router_keys_file_reload_failures",
            "Keys file reloads refused (unreadable, malformed, nested or sized past the bounds, invalid); "
            "the previous keys stay in force.", registry=r)
        self.tokenizer = Gauge(
            "tokenmill_router_tokenizer_info", "How the router tokenizes prompts (1 for the mode in use).",
            ["mode"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

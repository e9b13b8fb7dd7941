"""Router knobs, typed, in one place.

The router only speaks HTTP (and gRPC in endpoint-picker mode), so nothing
here refers to the engine; every default is chosen for a handful of replicas
on one host or one Kubernetes namespace.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..traffic.kv_events import CurveKeys
from ..gateway.request_guard import DEFAULT_HEADER_READ_TIMEOUT_S, DEFAULT_MAX_PENDING_CONNECTIONS

POLICIES = ("prefix", "least-load", "round-robin")
PREFIX_SOURCES = ("approximate", "events")


def parse_kv_events(values: list[str]) -> dict[str, tuple[str, str | None]]:
    """``URL=PUB_ENDPOINT[,REPLAY_ENDPOINT]`` items -> {normalized URL: (pub, replay)}."""
    from .backend import normalize_url

    out: dict[str, tuple[str, str | None]] = {}
    for item in values:
        url, sep, streams = item.partition("=")
        if not sep or not url or not streams:
            raise ValueError(f"--kv-events {item!r}: expected URL=tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT]")
        pub, _, replay = streams.partition(",")
        for endpoint in filter(None, (pub, replay)):
            if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"--kv-events {item!r}: {endpoint!r} is not a tcp://, ipc:// or inproc:// address")
        out[normalize_url(url)] = (pub, replay or None)
    return out


@dataclass
class RouterConfig:
    """Everything `tokenmill route` can be told.

    ``backends`` are base URLs (``http://10.0.0.5:8000``); ``backend_dns``
    entries are ``name:port`` pairs re-resolved every health interval, which is
    how the endpoint picker follows the pods of a headless Service.
    """

    backends: list[str] = field(default_factory=list)
    backend_dns: list[str] = field(default_factory=list)
    # Members from the Kubernetes API: the ready pods an InferencePool selects (k8s_pool.py).
    pool_name: str | None = None
    pool_namespace: str | None = None  # default: POD_NAMESPACE, else the service account's
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "prefix"
    api_key: str | None = None  # clients must send it (Authorization: Bearer)
    # Tenants (the servers' keys file): their keys open the router too, and their limits
    # hold across every replica (tenancy.py). Objectives: InferenceObjective name -> priority.
    api_keys_file: str | None = None
    objectives: dict[str, int] = field(default_factory=dict)
    otlp_traces_endpoint: str | None = None  # OpenTelemetry traces over OTLP (tokenmill/tracing.py); None: off
    # Sent to backends instead of the client's: their --router-api-key, the one key whose requests may
    # name the tenant and class (tenancy.py).
    backend_api_key: str | None = None
    # Responses API ids remembered with the replica that produced each (an LRU): a conversation's
    # next turn goes there (sessions.py). One entry is about a hundred bytes.
    conversation_capacity: int = 100_000

    # Tokenization: a local tokenizer.json, else a backend's POST /tokenize,
    # else fixed-size character chunks.
    tokenizer: str | None = None
    remote_tokenize: bool = True
    block_size: int = 16  # tokens per block, as the backends' KV cache
    chars_per_block: int = 64  # block size of the character-chunk fallback

    # Prefix index per backend: capacity in blocks. When a backend exports
    # vllm:cache_config_info{num_gpu_blocks} that number wins.
    index_capacity_blocks: int = 4096
    # A match shorter than this many blocks, or than this share of the
    # request's blocks, is treated as a miss: a short common system prompt
    # alone should not herd every request onto one replica.
    min_match_blocks: int = 1
    min_match_ratio: float = 0.1

    # Where the prefix index comes from: "approximate" (what the router sent where) or
    # "events" (the KV events each backend publishes, router/cache/kv_index.py; the approximate
    # index stands in while a backend's stream is quiet or absent). kv_events maps a backend
    # URL to its (PUB endpoint, replay endpoint or None).
    prefix_source: str = "approximate"
    kv_events: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    events_stale_after: float = 10.0  # seconds of silence, with requests sent, before falling back
    # Replicas that admit subscribers by CURVE key: the router's .key_secret certificate and
    # the replicas' public certificate (traffic/kv_events.py); both or neither.
    kv_events_client_key: str | None = None
    kv_events_server_key: str | None = None

    # Load balance: a backend is overloaded when its load exceeds the least
    # loaded healthy backend's by more than ``imbalance_abs`` requests AND by
    # more than a factor of ``imbalance_rel``.
    imbalance_abs: float = 3.0
    imbalance_rel: float = 1.5
    kv_usage_weight: float = 2.0  # load added per unit of scraped KV usage
    shed_load: float = 0.0  # >0: answer 429 when every ready backend's load >= this

    # Health and scraping.
    health_interval: float = 2.0
    health_timeout: float = 2.0
    # A refused connection or a non-200 answer takes a backend out at once; a
    # check that merely times out (a busy CPU server) must do so this many
    # times in a row.
    health_timeouts_to_fail: int = 2
    connect_timeout: float = 3.0
    request_timeout: float = 600.0
    # Client bodies: refused with 413 past this size, 408 when not all sent within the deadline.
    max_request_bytes: int = 8 << 20  # what a backend drains before its 413 (request_guard.DRAIN_BYTES)
    request_read_timeout: float = 30.0
    # The request line and headers: the connection is closed past this (408 when part had come).
    header_read_timeout: float = DEFAULT_HEADER_READ_TIMEOUT_S
    max_pending_connections: int = DEFAULT_MAX_PENDING_CONNECTIONS  # waiting for their headers at once

    # Endpoint-picker (Envoy ext_proc) mode.
    endpoint_picker: bool = False
    grpc_port: int = 9002
    grpc_host: str | None = None  # default: same as host
    fallback_endpoints: int = 2  # other endpoints after the pick in x-gateway-destination-endpoint

    # Canary rollout (router/canary/canary.py): variants, split, SLO guard. None: one group.
    canary: Any = None

    def kv_events_curve(self) -> "CurveKeys | None":
        """The keys to follow event streams with (None: plain subscriptions); ValueError when
        only one of the two is given or a file is not a certificate."""
        from ..traffic.kv_events import load_curve_pair, load_curve_public

        client, server = self.kv_events_client_key, self.kv_events_server_key
        if client is None and server is None:
            return None
        if client is None or server is None:
            raise ValueError("--kv-events-client-key and --kv-events-server-key go together")
        pair = load_curve_pair(client, "--kv-events-client-key")
        return CurveKeys(pair.public, pair.secret, load_curve_public(server, "--kv-events-server-key"))

    def validate(self) -> None:
        if self.api_keys_file:
            from ..gateway.tenants import TenantTable

            try:
                TenantTable.load(self.api_keys_file)
            except (OSError, ValueError) as exc:
                raise ValueError(f"--api-keys-file: {exc}") from None
        if self.canary is not None:
            self.canary.validate()
            from .backend import normalize_url

            grouped = set(self.canary.backends())
            if self.backend_dns or any(normalize_url(b) not in grouped for b in self.backends):
                raise ValueError("with --variant groups, every backend belongs in a --variant")
            self.backends.extend(u for u in self.canary.backends() if u not in self.backends)
        if self.prefix_source not in PREFIX_SOURCES:
            raise ValueError(f"unknown --prefix-source {self.prefix_source!r}; choose one of "
                             f"{', '.join(PREFIX_SOURCES)}")
        if self.prefix_source == "events" and not self.kv_events:
            raise ValueError("--prefix-source events needs --kv-events URL=ENDPOINT for the backends that publish")
        self.kv_events_curve()
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if not self.backends and not self.backend_dns and not self.pool_name:
            raise ValueError("give at least one --backend URL, --backend-dns name:port or --pool-name")
        if self.backend_dns and self.pool_name:
            raise ValueError("give --backend-dns or --pool-name, not both")
        if self.block_size < 1 or self.chars_per_block < 1:
            raise ValueError("block sizes must be positive")
        if self.fallback_endpoints < 0:
            raise ValueError("--fallback-endpoints must be >= 0")
        if self.max_request_bytes < 1 or not self.request_read_timeout > 0:
            raise ValueError("--max-request-bytes and --request-read-timeout must be positive")
        if not self.header_read_timeout > 0 or self.max_pending_connections < 1:
            raise ValueError("--header-read-timeout and --max-pending-connections must be positive")
        if self.health_interval <= 0:
            raise ValueError("--health-interval must be positive")
        if self.conversation_capacity < 1:
            raise ValueError("--conversation-capacity must be positive")

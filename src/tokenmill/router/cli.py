"""`tokenmill route`: the cache-aware router (and Envoy endpoint picker).

Imports nothing heavy at registration time, so `tokenmill --help` stays fast
and the router never pulls in torch or the engine.
"""
from __future__ import annotations

import argparse
import logging
import signal

from ..settings.cli_args import human_int
from ..gateway.request_guard import DEFAULT_HEADER_READ_TIMEOUT_S, DEFAULT_MAX_PENDING_CONNECTIONS
from .config import POLICIES, PREFIX_SOURCES, RouterConfig, parse_kv_events
from .tenancy import parse_objectives


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "route", allow_abbrev=False,
        help="cache-aware router over many tokenmill (or vLLM) replicas",
        description="OpenAI-compatible reverse proxy that sends each request to the replica most "
                    "likely to hold its prefix in cache, unless that replica is overloaded. With "
                    "--endpoint-picker it also serves Envoy ext_proc for the Gateway API Inference Extension.",
    )
    _add_replica_arguments(p)
    _add_front_arguments(p)
    _add_prefix_arguments(p)
    _add_load_arguments(p)
    _add_limit_arguments(p)
    _add_picker_arguments(p)
    from .canary.canary_cli import add_arguments as add_canary_arguments

    add_canary_arguments(p)
    p.set_defaults(func=run)


def _add_replica_arguments(p: argparse.ArgumentParser) -> None:
    """Where the replicas are: listed, resolved from DNS, or watched in Kubernetes."""
    p.add_argument("--backend", action="append", default=[], metavar="URL",
                   help="backend base URL, e.g. http://127.0.0.1:8001 (repeat for each replica)")
    p.add_argument("--backend-dns", action="append", default=[], metavar="NAME:PORT",
                   help="DNS name whose addresses are backends, re-resolved every health interval "
                        "(e.g. a headless Service in Kubernetes)")
    p.add_argument("--pool-name", default=None, metavar="NAME",
                   help="take replicas from the Kubernetes API: the ready pods the InferencePool NAME selects, "
                        "watched (in-cluster credentials, else KUBECONFIG); needs get on inferencepools and "
                        "list/watch on pods")
    p.add_argument("--pool-namespace", default=None, metavar="NS",
                   help="the InferencePool's namespace (default: POD_NAMESPACE, else the pod's own)")


def _add_front_arguments(p: argparse.ArgumentParser) -> None:
    """The router's own face: where it listens, who may call it, what it sends on."""
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--policy", choices=POLICIES, default="prefix", help="routing policy (default prefix)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' from clients")
    p.add_argument("--backend-api-key", default=None,
                   help="key sent to backends (default: forward the client's); give the replicas' "
                        "--router-api-key, the one key whose tenant headers they trust")
    p.add_argument("--api-keys-file", default=None, metavar="FILE",
                   help="the servers' tenants file: its keys open the router, each tenant's max_inflight and "
                        "tokens_per_minute hold across all replicas, the key's tenant and class go to the replica "
                        "in x-gateway-inference-fairness-id and -objective (the client's own are dropped); "
                        "reloaded on SIGHUP, a bad file kept out and counted (docs/tenants.md)")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send OpenTelemetry traces of each proxied request to this OTLP/HTTP collector; the "
                        "trace goes on to the replica in traceparent (needs tokenmill[tracing]; default off)")
    p.add_argument("--objective", action="append", default=[], metavar="NAME=PRIORITY",
                   help="an x-gateway-inference-objective name and its priority (higher first; below 0 may be "
                        "shed under --shed-load); repeatable")


def _add_prefix_arguments(p: argparse.ArgumentParser) -> None:
    """How the prefix policy knows what each replica has cached."""
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="tokenizer.json (or a folder holding it) of the served model; default: ask a "
                        "backend's POST /tokenize, else route on character chunks")
    p.add_argument("--no-remote-tokenize", action="store_true",
                   help="never call a backend's /tokenize (character chunks unless --tokenizer)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block on the backends (default 16)")
    p.add_argument("--chars-per-block", type=int, default=64,
                   help="block size of the character-chunk fallback (default 64)")
    p.add_argument("--prefix-source", choices=PREFIX_SOURCES, default="approximate",
                   help="what the prefix policy knows of each backend's cache: 'approximate' (what the router "
                        "sent there) or 'events' (the KV events backends publish; see --kv-events) "
                        "(default approximate)")
    p.add_argument("--kv-events", action="append", default=[], metavar="URL=ENDPOINT[,REPLAY]",
                   help="a backend's KV event stream, e.g. http://10.0.0.5:8000=tcp://10.0.0.5:5557,"
                        "tcp://10.0.0.5:5558 (tokenmill serve or vllm serve with --kv-events-config); repeat per backend")
    p.add_argument("--kv-events-client-key", default=None, metavar="FILE",
                   help="for replicas that admit subscribers by CURVE key: this router's .key_secret "
                        "certificate (its public .key in their curve_authorized_keys_dir)")
    p.add_argument("--kv-events-server-key", default=None, metavar="FILE",
                   help="for replicas that admit subscribers by CURVE key: their public .key certificate")
    p.add_argument("--index-capacity", type=int, default=4096, metavar="BLOCKS",
                   help="blocks remembered per backend when it does not export num_gpu_blocks (default 4096)")
    p.add_argument("--min-match-ratio", type=float, default=0.1,
                   help="share of a request's blocks a replica must hold to count as a prefix hit (default 0.1)")


def _add_load_arguments(p: argparse.ArgumentParser) -> None:
    """When a replica counts as overloaded, and how often the router looks."""
    p.add_argument("--imbalance-abs", type=float, default=3.0,
                   help="a backend is overloaded when its load exceeds the least loaded by more than "
                        "this many requests ... (default 3)")
    p.add_argument("--imbalance-rel", type=float, default=1.5,
                   help="... and by more than this factor (default 1.5)")
    p.add_argument("--shed-load", type=float, default=0.0,
                   help="answer 429 when every ready backend's load is at least this (default 0: never)")
    p.add_argument("--health-interval", type=float, default=2.0, help="seconds between health checks (default 2)")
    p.add_argument("--conversation-capacity", type=human_int, default=100_000, metavar="N",
                   help="Responses API ids remembered with the replica that produced each, least recently used "
                        "dropped (about 100 bytes each); a continuation goes to its replica (default 100000)")


def _add_limit_arguments(p: argparse.ArgumentParser) -> None:
    """What a client or a backend may take: time and bytes."""
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per backend read (default 600)")
    p.add_argument("--max-request-bytes", type=human_int, default=8 << 20, metavar="BYTES",
                   help="refuse client bodies larger than this with 413 (default 8M)")
    p.add_argument("--request-read-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="seconds a client has to send a whole request body; else 408 (default 30)")
    p.add_argument("--header-read-timeout", type=float, default=DEFAULT_HEADER_READ_TIMEOUT_S, metavar="SECONDS",
                   help="seconds a client has, from connecting (or from the first byte of its next request), to "
                        "send a request's line and headers; else the connection is closed, with 408 when part "
                        f"had come (default {DEFAULT_HEADER_READ_TIMEOUT_S:g})")
    p.add_argument("--max-pending-connections", type=int, default=DEFAULT_MAX_PENDING_CONNECTIONS, metavar="N",
                   help="connections that may wait for their request headers at once; one more closes the one "
                        f"waiting longest (default {DEFAULT_MAX_PENDING_CONNECTIONS})")


def _add_picker_arguments(p: argparse.ArgumentParser) -> None:
    """Envoy ext_proc (the Gateway API Inference Extension's endpoint picker), and logging."""
    p.add_argument("--endpoint-picker", action="store_true",
                   help="also serve Envoy ext_proc (Gateway API Inference Extension endpoint picker)")
    p.add_argument("--grpc-host", default=None, help="gRPC bind address (default: --host)")
    p.add_argument("--grpc-port", type=int, default=9002, help="ext_proc gRPC port (default 9002)")
    p.add_argument("--fallback-endpoints", type=int, default=2, metavar="N",
                   help="endpoint picker: other ready endpoints listed after the pick, which the gateway tries "
                        "in turn if it fails (default 2)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        backends=list(args.backend), backend_dns=list(args.backend_dns), host=args.host, port=args.port,
        pool_name=args.pool_name, pool_namespace=args.pool_namespace,
        policy=args.policy, api_key=args.api_key, backend_api_key=args.backend_api_key,
        tokenizer=args.tokenizer, remote_tokenize=not args.no_remote_tokenize, block_size=args.block_size,
        chars_per_block=args.chars_per_block, index_capacity_blocks=args.index_capacity,
        min_match_ratio=args.min_match_ratio,
        imbalance_abs=args.imbalance_abs, imbalance_rel=args.imbalance_rel, shed_load=args.shed_load,
        health_interval=args.health_interval, request_timeout=args.request_timeout,
        max_request_bytes=args.max_request_bytes, request_read_timeout=args.request_read_timeout,
        header_read_timeout=args.header_read_timeout, max_pending_connections=args.max_pending_connections,
        endpoint_picker=args.endpoint_picker, grpc_port=args.grpc_port, grpc_host=args.grpc_host,
        fallback_endpoints=args.fallback_endpoints,
        prefix_source=args.prefix_source, kv_events=parse_kv_events(args.kv_events),
        kv_events_client_key=args.kv_events_client_key, kv_events_server_key=args.kv_events_server_key,
        api_keys_file=args.api_keys_file, objectives=parse_objectives(args.objective),
        otlp_traces_endpoint=args.otlp_traces_endpoint, conversation_capacity=args.conversation_capacity,
    )


def run(args: argparse.Namespace) -> int:
    import asyncio

    from .server import RouterServer

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # One line per health check and scrape is noise; keep httpx's warnings only.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    logging.getLogger("httpcore").setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        config = config_from_args(args)
        from .canary.canary_cli import config_from_args as canary_from_args

        config.canary = canary_from_args(args)
        config.validate()
    except ValueError as exc:
        logging.getLogger("tokenmill.router").error("%s", exc)
        return 2
    if config.endpoint_picker:
        try:
            from .k8s import ext_proc  # noqa: F401 - gRPC and Envoy's protos
        except ImportError as exc:
            logging.getLogger("tokenmill.router").error(
                "--endpoint-picker needs the router extra (%s): pip install 'tokenmill[router]'", exc.name or exc)
            return 2
    if config.pool_name:
        try:
            import kubernetes  # noqa: F401
        except ImportError:
            logging.getLogger("tokenmill.router").error(
                "--pool-name needs the Kubernetes client: pip install 'tokenmill[router]'")
            return 2
    server = RouterServer(config, log_level=args.log_level)
    logging.getLogger("tokenmill.router").info(
        "routing %s with policy %s on http://%s:%d (tokenizer: %s)",
        ", ".join(config.backends + config.backend_dns) or f"InferencePool {config.pool_name}", config.policy,
        config.host, config.port, server.router.tokenizer.mode)
    if config.api_keys_file and hasattr(signal, "SIGHUP"):  # new keys and limits without a restart
        signal.signal(signal.SIGHUP, lambda *_: server.router.tenancy.reload())
    try:
        asyncio.run(server.serve())
    except KeyboardInterrupt:
        pass
    return 0

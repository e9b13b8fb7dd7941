"""`tokenmill serve`: the OpenAI-compatible server's command line.

The flags follow `vllm serve` (same names, same meanings) so a launch line
written for vLLM starts tokenmill unchanged; tokenmill's older names stay as
aliases. Flags about a GPU say in their help what they mean on a CPU.
Flags are grouped by concern, one function per group, so each can grow on
its own. What the parsed flags become (EngineConfig, ServerSettings, a
tokenizer) is serve_config.py's job; running the server is lifecycle.py's.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any

from ...settings.cli_args import human_int
from ...gateway.request_guard import DEFAULT_HEADER_READ_TIMEOUT_S, DEFAULT_MAX_PENDING_CONNECTIONS
from ..openai.response_store import DEFAULT_STORE_BYTES
from .serve_config import template_path

# The bundled model's name on the Hugging Face hub: a vLLM launch line names it
# so, and tokenmill (which never downloads) serves its bundled copy for it.
BUNDLED_HUB_NAMES = ("HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct")

DTYPE_CHOICES = ["auto", "float32", "float", "bfloat16", "bf16", "float16", "half", "fp16"]
KV_CACHE_DTYPES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "half")
UVICORN_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return n


def _non_negative(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return n


def _model_len(value: str) -> int | None:
    """--max-model-len: 4096, 4k (4,000), 4K (4,096); 'auto' or -1: the model's own."""
    if value.strip().lower() in ("auto", "-1"):
        return None
    n = human_int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return n


def _size(value: str) -> str:
    """--kv-cache-memory-bytes: vLLM's 4G / 4g or tokenmill's 4GiB; kept as text for parse_size."""
    try:
        return str(human_int(value))
    except argparse.ArgumentTypeError:
        from_units = value.strip()
        if not from_units or not (from_units[0].isdigit() or from_units[0] == "."):
            raise argparse.ArgumentTypeError(f"not a size: {value!r}") from None
        return from_units


def _bytes(value: str) -> int:
    """A size in bytes, as --kv-cache-memory takes it (64M = 64 MiB, 64m = 64e6, 64MiB)."""
    from ...settings.config import parse_size

    try:
        n = parse_size(_size(value))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n is None or n < 0:
        raise argparse.ArgumentTypeError(f"not a size: {value!r}")
    return n


def _fraction(value: str) -> float:
    x = float(value)
    if not 0.0 < x <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return x


class _ModelAction(argparse.Action):
    """--model: the last one given is ``model`` (the one model, as always); `serve` keeps every
    one given in ``models`` (several: served side by side, model_set.py)."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        namespace.model = values
        namespace.models = [*(getattr(namespace, "models", None) or []), values]


def add_engine_arguments(p: Any) -> None:
    """Model and engine flags, shared with `tokenmill generate`."""
    p.add_argument("--model", default=None, action=_ModelAction,
                   help="local GGUF file or Hugging Face folder (default: bundled SmolLM2-135M-Instruct); "
                        "`serve` takes it more than once to serve several models, each loaded on first use")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, metavar="{auto,float32,bfloat16,float16}",
                   help="compute dtype; auto (the default): float32 around w8a8 layers, else bfloat16 where the "
                        "CPU multiplies it natively (and on CUDA), else float32. float32 with --quantization none "
                        "is the exact reference")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--quantization", "-q", default="auto", choices=["auto", "none", "int8", "int4", "gguf", "w8a8"],
                   help="weight quantization: none, int8, int4 (weight-only), gguf (keep the file's Q8_0/Q4_0/Q4_1 "
                        "blocks), w8a8 (int8 weights and dynamic int8 activations), auto (the default: w8a8 on a "
                        "CPU with VNNI, else gguf when the file has such blocks, else none; the startup log says "
                        "which and why)")
    p.add_argument("--quant-group-size", type=int, default=32, choices=[32, 64, 128],
                   help="int4 group size along the input dimension (default 32)")
    p.add_argument("--quantize-lm-head", action="store_true", help="quantize the LM head too")
    p.add_argument("--threads", type=_positive, default=None,
                   dest="num_threads", help="torch intra-op threads for the engine (default: all cores)")
    p.add_argument("--max-model-len", type=_model_len, default=None,
                   help="context length: 4096, 4k (=4000) or 4K (=4096); 'auto': the model's (default auto)")
    p.add_argument("--kv-cache-memory-bytes", "--kv-cache-memory", dest="kv_cache_memory", type=_size, default=None,
                   help="bytes for the KV pool: 4G (=4 GiB), 4g (=4e9) or 4GiB; overrides "
                        "--gpu-memory-utilization (default: a share of free memory)")
    p.add_argument("--kv-offload-bytes", type=_size, default=None, metavar="SIZE",
                   help="a second KV tier on local disk: blocks evicted from the pool are kept there (up to SIZE: "
                        "20G, 20GiB) and restored on a prefix hit instead of recomputed; kept across restarts "
                        "of the same model (default off; needs --kv-offload-dir)")
    p.add_argument("--kv-offload-dir", default=None, metavar="DIR",
                   help="folder of the disk tier (preallocated slots and their index): one server at a time "
                        "(locked; a second is refused), owned by this user and writable by nobody else")
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=None, metavar="FRACTION",
                   help="share of memory for the weights and the KV pool together: of the GPU's memory on CUDA; "
                        "on CPU, of the host memory available at start (MemAvailable). The KV pool never "
                        "exceeds what --max-num-seqs sequences of --max-model-len tokens can fill "
                        "(default: 20%% of free memory for the KV pool)")
    p.add_argument("--num-blocks", type=_positive, default=None, help=argparse.SUPPRESS)
    p.add_argument("--memory-budget", default=None, help="bytes for weights + KV pool together, e.g. 4GiB")
    p.add_argument("--block-size", type=_positive, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--max-num-seqs", type=_positive, default=64, help="sequences per batch (default 64)")
    p.add_argument("--max-num-batched-tokens", type=human_int, default=None,
                   help="token budget per engine step (default 512 on CPU, 2048 on CUDA)")
    p.add_argument("--batching", default="continuous", choices=["continuous", "static", "dynamic"],
                   help="batching policy (default continuous)")
    p.add_argument("--scheduling-policy", default=None, choices=["fcfs", "priority", "fair"],
                   help="waiting-queue order: fcfs (arrival), priority (class, then the request's 'priority', "
                        "then arrival), fair (class, then each tenant's weighted share of the tokens computed, "
                        "then 'priority', then arrival); see docs/tenants.md (default fcfs; fair when "
                        "--api-keys-file is given)")
    p.add_argument("--starvation-bound", type=float, default=30.0, metavar="SECONDS",
                   help="priority and fair: a request waiting this long (from its arrival at the server to "
                        "its first token) goes first, whatever its class; one whose queue would keep it "
                        "longer gets 429 class_backlog (default 30)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV blocks of shared prompt prefixes (default on)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help=argparse.SUPPRESS)  # older name of --no-enable-prefix-caching
    p.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help='publish prefix-cache block events in vLLM\'s format over ZeroMQ: '
                        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557", '
                        '"replay_endpoint": "tcp://127.0.0.1:5558"}\' (default off; docs/routing.md)')
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as vLLM takes it: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4}\' or \'{"method": "draft_model", "model": PATH, ...}\' (default off)')


def add_server_arguments(p: Any) -> None:
    """HTTP: where to listen, who may call, how it logs."""
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in 'model' (default: the model as given positionally, and the "
                        "model file's name)")
    p.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/*; several keys: any of them "
                        "(also read from TOKENMILL_API_KEY or VLLM_API_KEY); the web console then asks for "
                        "it on a sign-in page and keeps a session cookie")
    p.add_argument("--router-api-key", nargs="+", default=None, metavar="KEY",
                   help="keys of the routers (tokenmill route --backend-api-key) or gateways in front: the only "
                        "callers whose x-gateway-inference-fairness-id and -objective headers name the tenant and "
                        "class a request is sent for, never a better class than --api-keys-file gives that "
                        "tenant; must differ from every --api-key (also read from TOKENMILL_ROUTER_API_KEY); "
                        "see docs/tenants.md")
    p.add_argument("--api-keys-file", default=None, metavar="FILE",
                   help="tenants (priority class, fair-share weight, limits) and their keys, stored as SHA-256 "
                        "hashes, in YAML or JSON; reloaded on SIGHUP; see docs/tenants.md")
    p.add_argument("--metrics-tenant-labels", action="store_true",
                   help="label /metrics' per-tenant usage series with tenant names (default: summed over "
                        "tenants, no names, since /metrics needs no key); /v1/usage gives the operator's key "
                        "every tenant's usage either way")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send OpenTelemetry traces of each request (HTTP, engine queue, prefill, decode) to this "
                        "OTLP/HTTP collector, e.g. http://127.0.0.1:4318; needs pip install 'tokenmill[tracing]' "
                        "(default off)")
    p.add_argument("--root-path", default="", help="path prefix when served behind a proxy that strips it")
    p.add_argument("--forwarded-allow-ips", default=None, metavar="IPS",
                   help="proxies (comma-separated addresses, or '*') whose X-Forwarded-For / -Proto headers "
                        "are believed; without it they are ignored and the client is the connection's peer "
                        "(the console's sign-in throttle keys on it)")
    p.add_argument("--ssl-keyfile", default=None, help="TLS private key file (serve HTTPS)")
    p.add_argument("--ssl-certfile", default=None, help="TLS certificate file (serve HTTPS)")
    p.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="browser origins allowed by CORS: several values, a comma list or a JSON list "
                        "(default: no CORS headers)")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    p.add_argument("--uvicorn-log-level", default="warning", choices=UVICORN_LOG_LEVELS,
                   help="log level of the HTTP server; info and below also log each HTTP access (default warning)")
    p.add_argument("--enable-log-requests", "--log-requests", dest="log_requests", action="store_true",
                   help="log each request and its outcome")
    p.add_argument("--disable-log-requests", dest="log_requests", action="store_false",
                   help=argparse.SUPPRESS)  # older vLLM name; off is the default
    p.add_argument("--max-waiting", type=_positive, default=None,
                   help="refuse new requests with 429 once this many sequences (prompts x n) wait (default: 4 x "
                        "--max-num-seqs, at most the KV pool's blocks, at least --max-num-seqs)")
    p.add_argument("--max-output-tokens", type=_positive, default=None,
                   help="cap on every request's output; also the default when a request gives no max_tokens")
    p.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds running requests may finish after SIGTERM (default 30)")
    p.add_argument("--max-request-bytes", type=_positive, default=None,
                   help="refuse request bodies larger than this with 413 (default: 64 bytes per token of "
                        "context, at least 1 MiB)")
    p.add_argument("--request-read-timeout", type=float, default=30.0,
                   help="seconds a client has to send a whole request body (default 30)")
    p.add_argument("--header-read-timeout", type=float, default=DEFAULT_HEADER_READ_TIMEOUT_S,
                   help="seconds a client has, from connecting (or from the first byte of its next request), to "
                        f"send a request's line and headers; else the connection is closed (default "
                        f"{DEFAULT_HEADER_READ_TIMEOUT_S:g})")
    p.add_argument("--max-pending-connections", type=_positive, default=DEFAULT_MAX_PENDING_CONNECTIONS,
                   help="connections that may wait for their request headers at once; one more closes the one "
                        f"waiting longest (default {DEFAULT_MAX_PENDING_CONNECTIONS})")
    p.add_argument("--no-ui", action="store_true", help="do not serve the web console")


def add_model_set_arguments(p: Any) -> None:
    """Several models behind one server (--model more than once, or --models-dir): model_set.py."""
    p.add_argument("--models-dir", default=None, metavar="FOLDER",
                   help="serve every GGUF file and Hugging Face model folder in FOLDER, each under its file "
                        "name, loaded when a request first names it")
    p.add_argument("--max-loaded-models", type=_positive, default=None, metavar="N",
                   help="with several models: at most N in memory; loading one more unloads the least recently "
                        "used one with no request in flight (default: no limit)")
    p.add_argument("--idle-unload-seconds", type=_positive_seconds, default=None, metavar="S",
                   help="with several models: unload a model that has had no request for S seconds (default off)")
    p.add_argument("--model-load-timeout", type=_positive_seconds, default=300.0, metavar="S",
                   help="with several models: how long a request waits for its model to load (or for room to "
                        "load it) before a 503 with Retry-After (default 300)")
    p.add_argument("--max-load-waiters", type=_positive, default=64, metavar="N",
                   help="with several models: requests that may wait for models to load at once; more get 429 "
                        "(default 64)")


def _positive_seconds(value: str) -> float:
    x = float(value)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {value}")
    return x


# flags that name one model's files or state: refused with several models
_ONE_MODEL_FLAGS = (("served_model_name", "--served-model-name"), ("enable_lora", "--enable-lora"),
                    ("lora_modules", "--lora-modules"), ("kv_events_config", "--kv-events-config"),
                    ("capture_traffic", "--capture-traffic"), ("speculative_config", "--speculative-config"),
                    ("tokenizer", "--tokenizer"), ("chat_template", "--chat-template"),
                    ("kv_offload_dir", "--kv-offload-dir"))  # one process, one model per tier folder


def finalize_model_set(args: argparse.Namespace) -> str | None:
    """Several models (--model more than once, or --models-dir): their paths and names into
    ``args.model_set`` (a list of ModelSpec), or a one-line error. One model: ``args.model_set``
    is None and nothing else changes."""
    paths = list(dict.fromkeys(getattr(args, "models", None) or []))
    folder = getattr(args, "models_dir", None)
    if args.model_tag is not None and (len(paths) > 1 or folder):
        paths = list(dict.fromkeys([args.model_tag, *paths]))
    args.model_set = None
    if len(paths) <= 1 and not folder:
        for dest, flag in (("max_loaded_models", "--max-loaded-models"), ("idle_unload_seconds",
                                                                          "--idle-unload-seconds")):
            if getattr(args, dest, None) is not None:
                return f"{flag} applies to several models (--model given more than once, or --models-dir)"
        return None
    from ..server.model_set import model_specs, models_in_folder
    from .serve_config import default_model_name

    if folder is not None:
        if not os.path.isdir(folder):
            return f"--models-dir {folder}: not a folder"
        found = models_in_folder(folder)
        if not found and not paths:
            return f"--models-dir {folder}: no GGUF file or Hugging Face model folder (one with config.json) in it"
        paths += [p for p in found if p not in paths]
    for path in paths:
        if not os.path.exists(path):
            return (f"model {path!r} is not a local file or folder (tokenmill does not download models: pass "
                    "a GGUF file or a Hugging Face folder)")
    for dest, flag in _ONE_MODEL_FLAGS:
        if getattr(args, dest, None):
            return f"{flag} is for one model; it cannot be used with several (--model more than once, --models-dir)"
    if (args.tensor_parallel_size or 1) > 1:
        return "--tensor-parallel-size is for one model; it cannot be used with several"
    try:
        args.model_set = model_specs(paths, default_model_name)
    except ValueError as exc:
        return str(exc)
    args.model = paths[0]  # what the checks below that read one model's config look at
    return None


def add_capture_arguments(p: Any) -> None:
    """Traffic capture for later replay (`tokenmill bench --trace`)."""
    p.add_argument("--capture-traffic", metavar="FILE", default=None,
                   help="append one JSON line per finished request (lengths, timings, block hashes) to FILE")
    p.add_argument("--capture-text", action="store_true",
                   help="with --capture-traffic, also store what clients typed (prompt text, stop strings); "
                        "without it nothing a client typed is stored")
    p.add_argument("--capture-key", default=None,
                   help="secret that keys the capture's prompt hashes (also read from TOKENMILL_CAPTURE_KEY); "
                        "replicas sharing it write comparable hashes (default: a random key kept in "
                        ".FILE.key beside the capture)")


def add_chat_template_argument(p: Any) -> None:
    """--chat-template: a Jinja file (or the template text itself) that replaces the model's."""
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="Jinja chat template file (or the template text) to use instead of the model's")


def add_model_source_arguments(p: Any) -> None:
    """What else comes with the model: tokenizer, sampling defaults, seed, the config file."""
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="model to serve, as in `vllm serve MODEL` (same as --model)")
    p.add_argument("--config", metavar="FILE.yaml", default=None,
                   help="YAML file of flags (keys are flag names, e.g. 'max-model-len: 4k'); "
                        "flags on the command line win")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer to use instead of the model's: a GGUF file or a folder with tokenizer.json")
    p.add_argument("--generation-config", default="auto",
                   help="default sampling parameters: 'auto' reads the model folder's generation_config.json, "
                        "'vllm' (or 'tokenmill') uses built-in defaults, a folder reads its "
                        "generation_config.json (default auto); a request's own values win")
    p.add_argument("--seed", type=int, default=0, help="seed of the engine's random generator (default 0)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM launch lines; tokenmill runs no code from model folders")


def add_device_arguments(p: Any) -> None:
    """GPU-shaped flags of vLLM, with their CPU meaning."""
    p.add_argument("--kv-cache-dtype", default="auto", metavar="DTYPE",
                   help="KV pool dtype: auto (the compute dtype; bfloat16 under w8a8 on CPU), that same "
                        "dtype by name, bfloat16 under float32 (widened as read), or int8 / fp8 (e4m3): one "
                        "byte a value with a scale per block and kv head, twice the tokens of bf16 in the "
                        "same memory (default auto)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="never replay CUDA graphs (no effect on CPU, which has none)")
    p.add_argument("-tp", "--tensor-parallel-size", type=_positive, default=1,
                   help="split every layer over N processes (gloo on CPU, NCCL on CUDA: one GPU each); "
                        "the heads and MLP must divide by N (default 1)")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="accepted for vLLM launch lines; tokenmill logs no periodic stats")


def add_tool_arguments(p: Any) -> None:
    """Tool calling: how the model's calls are read (as vLLM takes them)."""
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='allow tool_choice "auto": the model decides, --tool-call-parser reads its calls')
    p.add_argument("--tool-call-parser", default=None,
                   choices=["hermes", "qwen", "qwen2_5", "llama3_json", "llama4_json", "mistral"],
                   help="format of the model's tool calls (hermes/qwen <tool_call> JSON, llama3_json, mistral)")
    p.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                   help="split a thinking model's <think>...</think> from its answer: reasoning_content in "
                        "chat, reasoning items in Responses, thinking blocks in Messages")
    p.add_argument("--responses-store-size", type=_non_negative, default=1024, metavar="N",
                   help="Responses kept for previous_response_id and GET /v1/responses/{id}, least "
                        "recently used evicted first; 0 stores none (default 1024)")
    p.add_argument("--responses-store-bytes", type=_bytes, default=DEFAULT_STORE_BYTES, metavar="BYTES",
                   help="bound on the stored Responses' size (their responses and conversations as JSON), "
                        "least recently used evicted first; a response larger than it is not stored "
                        "(default 64MiB)")


def add_grammar_arguments(p: Any) -> None:
    """Bounds on structured outputs' grammars (settings/grammar_limits.py, docs/security.md)."""
    p.add_argument("--grammar-max-bytes", type=human_int, default=256 * 1024, metavar="BYTES",
                   help="refuse a grammar, regex or JSON schema longer than this with 400 (default 256K)")
    p.add_argument("--grammar-max-rules", type=_positive, default=2000,
                   help="refuse a grammar with more rules (or a schema with more definitions and references) "
                        "with 400 (default 2000)")
    p.add_argument("--grammar-max-depth", type=_positive, default=200,
                   help="refuse a grammar whose rules (or a schema whose $refs and nesting) chain deeper "
                        "with 400 (default 200)")
    p.add_argument("--grammar-compile-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="seconds one grammar may take to compile in a worker process before it is refused "
                        "(default 10)")
    p.add_argument("--grammar-worker-memory", type=human_int, default=2 << 30, metavar="BYTES",
                   help="address space of a grammar compile worker process (default 2G)")
    p.add_argument("--grammar-workers", type=_positive, default=1,
                   help="grammar compile worker processes (default 1)")
    p.add_argument("--grammar-queue-size", type=_positive, default=16,
                   help="grammars that may wait for a compile worker; beyond, 429 (default 16)")
    p.add_argument("--grammar-cache-bytes", type=human_int, default=256 << 20, metavar="BYTES",
                   help="compiled grammars kept for reuse, by their measured size (default 256M)")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", allow_abbrev=False, help="start the OpenAI-compatible server",
                              description="Serve a model over an OpenAI-compatible HTTP API. "
                                          "Takes `vllm serve` launch lines.")
    add_model_source_arguments(p.add_argument_group("model"))
    add_engine_arguments(p.add_argument_group("engine"))
    add_device_arguments(p.add_argument_group("device (vLLM's GPU flags, with their CPU meaning)"))
    add_chat_template_argument(p.add_argument_group("chat template"))
    add_tool_arguments(p.add_argument_group("tool calling"))
    add_grammar_arguments(p.add_argument_group("structured outputs (limits)"))
    add_server_arguments(p.add_argument_group("HTTP server"))
    from .lora_args import add_lora_arguments

    add_lora_arguments(p.add_argument_group("LoRA adapters"))
    add_capture_arguments(p.add_argument_group("traffic capture"))
    add_model_set_arguments(p.add_argument_group("several models"))
    p.set_defaults(func=_run)


# ---- checks before anything loads ----------------------------------------------

def finalize_serve_args(args: argparse.Namespace) -> str | None:
    """Fold vLLM spellings into one meaning and check what can be checked before the
    model loads. Returns a one-line error, or None. The steps run in order: a later one
    reads what an earlier one folded."""
    for step in (finalize_model_set, _fold_model_tag, _check_model, _check_kv_cache_dtype, _check_files,
                 _check_lora, _fold_origins, _check_kv_cache_options, _check_tenants, _check_tracing):
        problem = step(args)
        if problem:
            return problem
    return None


def _fold_model_tag(args: argparse.Namespace) -> str | None:
    """``serve MODEL`` (vLLM's positional tag) is ``--model MODEL``."""
    if args.model_set is None and args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            return f"the model is given twice ({args.model_tag!r} and --model {args.model!r})"
        args.model = args.model_tag
        if not args.served_model_name and os.path.exists(args.model_tag):
            # vLLM serves a model under the name it was launched with; the file's
            # short name (tokenmill's default) is accepted too
            stem = os.path.basename(os.path.normpath(args.model_tag))
            stem = stem[:-5] if stem.lower().endswith(".gguf") else stem
            args.served_model_name = list(dict.fromkeys([args.model_tag, stem]))
    return None


def _check_model(args: argparse.Namespace) -> str | None:
    """A local file or folder, or a hub name of the bundled model (served under that name)."""
    if args.model is not None and not os.path.exists(args.model):
        if args.model in BUNDLED_HUB_NAMES:
            if not args.served_model_name:
                args.served_model_name = [args.model]
            args.model = None  # the bundled copy
        else:
            return (f"model {args.model!r} is not a local file or folder (tokenmill does not download "
                    "models: pass a GGUF file or a Hugging Face folder)")
    return None


def _check_kv_cache_dtype(args: argparse.Namespace) -> str | None:
    if str(args.kv_cache_dtype).lower() != "auto":
        from ...settings.config import parse_dtype
        from ...engine.auto import resolve_engine_dtype
        from ...model.quant.kv_quant import resolve_kv_dtype
        from .serve_config import engine_config_from_args

        # the dtype the engine will build with, from the one resolver it uses (engine/auto.py)
        compute = resolve_engine_dtype(engine_config_from_args(args))[0]
        try:
            resolve_kv_dtype(args.kv_cache_dtype, parse_dtype(compute))
        except ValueError as exc:
            return f"--kv-cache-dtype: {exc}"
    return None


def _check_files(args: argparse.Namespace) -> str | None:
    """The files the flags name exist (TLS pair together), and --generation-config is one we read."""
    for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile),
                       ("--chat-template", template_path(args.chat_template)), ("--tokenizer", args.tokenizer)):
        if path is not None and not os.path.exists(path):
            return f"{flag} {path}: no such file"
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        return "--ssl-keyfile and --ssl-certfile go together"
    gen = args.generation_config
    if gen not in ("auto", "vllm", "tokenmill") and not os.path.isdir(gen):
        return f"--generation-config {gen}: not 'auto', 'vllm' or a folder"
    return None


def _check_lora(args: argparse.Namespace) -> str | None:
    from .lora_args import check_lora_args

    return check_lora_args(args)


def _fold_origins(args: argparse.Namespace) -> str | None:
    try:
        args.allowed_origins = parse_origins(args.allowed_origins)
    except ValueError as exc:
        return f"--allowed-origins: {exc}"
    return None


def _check_kv_cache_options(args: argparse.Namespace) -> str | None:
    """The disk tier and KV events both serve the prefix cache: they need it on."""
    if getattr(args, "kv_offload_bytes", None) and not getattr(args, "kv_offload_dir", None):
        return "--kv-offload-bytes needs --kv-offload-dir (a local folder for the disk tier)"
    if getattr(args, "kv_offload_bytes", None) and not args.enable_prefix_caching:
        return "--kv-offload-bytes keeps the prefix cache's evicted blocks: it needs prefix caching on"
    try:
        from ...engine.kv.kv_event_publisher import KVEventsConfig

        if KVEventsConfig.parse(args.kv_events_config) is not None and not args.enable_prefix_caching:
            return "--kv-events-config publishes the prefix cache's blocks: it needs prefix caching on"
    except (ValueError, TypeError) as exc:  # JSONDecodeError is a ValueError
        return str(exc) if str(exc).startswith("--kv-events-config") else f"--kv-events-config: {exc}"
    return None


def _check_tenants(args: argparse.Namespace) -> str | None:
    """The tenants file and router keys read as the server will read them."""
    if getattr(args, "api_keys_file", None) or getattr(args, "router_api_key", None):
        from ...gateway.tenants import TenantDirectory
        from .serve_config import api_keys_from_args, router_keys_from_args

        api_keys = api_keys_from_args(args)
        try:
            TenantDirectory(getattr(args, "api_keys_file", None),
                            [api_keys] if isinstance(api_keys, str) else api_keys or [], router_keys_from_args(args))
        except (OSError, ValueError) as exc:
            return str(exc) if str(exc).startswith("a --router") else f"--api-keys-file: {exc}"
    return None


def _check_tracing(args: argparse.Namespace) -> str | None:
    if getattr(args, "otlp_traces_endpoint", None):
        try:
            import opentelemetry.exporter.otlp.proto.http  # noqa: F401
            import opentelemetry.sdk  # noqa: F401
        except ImportError:
            return "--otlp-traces-endpoint needs the tracing extra: pip install 'tokenmill[tracing]'"
    return None


def parse_origins(values: list[str] | None) -> list[str] | None:
    """'["a","b"]' (vLLM's JSON form), 'a,b' or several values -> ['a', 'b']."""
    if not values:
        return None
    out: list[str] = []
    for value in values:
        value = value.strip()
        if value.startswith("["):
            try:
                items = json.loads(value)
            except json.JSONDecodeError:
                raise ValueError(f"not a JSON list: {value}") from None
            if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
                raise ValueError(f"expected a JSON list of strings: {value}")
            out += items
        else:
            out += [x.strip() for x in value.split(",") if x.strip()]
    return out


_GRAMMAR_FLAGS = {"max_bytes": "--grammar-max-bytes", "max_rules": "--grammar-max-rules",
                  "max_depth": "--grammar-max-depth", "compile_timeout_s": "--grammar-compile-timeout",
                  "worker_memory_bytes": "--grammar-worker-memory", "workers": "--grammar-workers",
                  "queue_size": "--grammar-queue-size", "cache_bytes": "--grammar-cache-bytes"}


def _draft_model_problems(path: str, target: str | None) -> list[str]:
    """The draft must be a model with the target's vocabulary, both read from their headers
    before the target loads. A target that cannot be read is left to its own load to report."""
    from ...files.bundled import default_model_path
    from ...model.loader import check_model_path

    if not os.path.exists(path):
        return [f"--speculative-config: model {path!r}: no such file or folder"]
    try:
        vocab = check_model_path(path)
    except (OSError, ValueError) as exc:
        return [f"--speculative-config: model {path!r} is not a model tokenmill can load: {exc}"]
    try:
        target_vocab = check_model_path(target or default_model_path())
    except (OSError, ValueError):
        return []
    if vocab != target_vocab:
        return [f"--speculative-config: the draft model's vocabulary ({vocab} tokens) differs from the target's "
                f"({target_vocab}); a draft must share the target's tokenizer"]
    return []


def config_problems(args: argparse.Namespace) -> list[str]:
    """Every problem of the flags that can be found before the model loads, one line each."""
    from ...engine.spec.speculative import SpeculativeConfig
    from .serve_config import grammar_limits_from_args

    out: list[str] = []
    spec = getattr(args, "speculative_config", None)
    if spec is not None:
        found = SpeculativeConfig.check(spec)
        out += found
        if not found:
            draft = SpeculativeConfig.parse(spec)
            if draft is not None and draft.model:
                out += _draft_model_problems(draft.model, args.model)
    for problem in grammar_limits_from_args(args).problems():  # named by their flags
        field = problem.split(" ", 1)[0]
        out.append(problem.replace(field, _GRAMMAR_FLAGS.get(field, field), 1))
    timeout = getattr(args, "request_read_timeout", 30.0)
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        out.append(f"--request-read-timeout must be a positive number of seconds (got {timeout!r})")
    timeout = getattr(args, "header_read_timeout", DEFAULT_HEADER_READ_TIMEOUT_S)
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        out.append(f"--header-read-timeout must be a positive number of seconds (got {timeout!r})")
    grace = getattr(args, "shutdown_grace", 30.0)
    if not (isinstance(grace, (int, float)) and grace >= 0):
        out.append(f"--shutdown-grace must be a number of seconds >= 0 (got {grace!r})")
    return list(dict.fromkeys(out))


def _run(args: argparse.Namespace) -> int:
    import sys

    problem = finalize_serve_args(args)
    problems = ([problem] if problem else []) + config_problems(args)
    if problems:
        for line in problems:  # every bad field, one line each, before anything loads
            print(f"tokenmill serve: error: {line}", file=sys.stderr)
        return 2
    if (args.tensor_parallel_size or 1) > 1:  # refuse a split that cannot work in one line, before loading
        from ...engine.step.distributed import startup_problem
        from .serve_config import engine_config_from_args

        problem = startup_problem(engine_config_from_args(args))
        if problem:
            print(f"tokenmill serve: error: {problem}", file=sys.stderr)
            return 2
    from ..server.lifecycle import run_server

    return run_server(args)

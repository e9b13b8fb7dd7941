"""Parsed `tokenmill serve` / `tokenmill generate` flags -> the objects they configure.

The one place where command-line values become an ``EngineConfig``, a
``ServerSettings`` or a replacement tokenizer. The flags themselves (names,
types, help, the checks before anything loads) live in serve_cli.py; the
offline ``LLM(...)`` keywords reuse the same meanings (llm.py).

Imports only the standard library at module level: `tokenmill --help` reads
serve_cli.py, which imports this module, on installs without torch.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import TYPE_CHECKING, Any

from ...gateway.request_guard import DEFAULT_HEADER_READ_TIMEOUT_S, DEFAULT_MAX_PENDING_CONNECTIONS
from ..openai.response_store import DEFAULT_STORE_BYTES

if TYPE_CHECKING:
    from ...settings.config import EngineConfig
    from ...files.tokenizer import Tokenizer
    from ..server.serving import ServerSettings

# engine flags copied as they are when given (None: the engine's own default)
_OPTIONAL_ENGINE_KEYS = ("kv_cache_memory", "max_model_len", "num_blocks", "memory_budget", "quant_group_size",
                         "quantize_lm_head", "num_threads", "speculative_config", "tensor_parallel_size",
                         "kv_cache_dtype", "kv_offload_bytes", "kv_offload_dir")


def resolve_dtype(name: str, device: str = "cpu") -> str:
    """Aliases -> canonical names; 'auto' is left to the engine, which decides it for the
    machine it runs on (engine/auto.py)."""
    from ...settings.config import canonical_dtype

    return canonical_dtype(name)


def device_memory_bytes(device: str) -> int:
    """What --gpu-memory-utilization is a share of: the GPU's total memory, or the
    host memory available now (another process's memory is not ours to take)."""
    if str(device).startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[1])
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return int(pages * size)


def apply_memory_share(options: dict[str, Any], fraction: float | None, device: str) -> None:
    """--gpu-memory-utilization (or ``LLM(gpu_memory_utilization=)``): a budget for weights and
    KV pool together, unless an explicit KV size or budget is given, which wins."""
    if fraction is None or options.get("kv_cache_memory") is not None or options.get("memory_budget") is not None:
        return
    options["memory_budget"] = int(float(fraction) * device_memory_bytes(device))
    options["cap_kv_pool"] = True


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig options the engine flags ask for (serve and generate alike)."""
    options: dict[str, Any] = dict(model=args.model, dtype=resolve_dtype(args.dtype, args.device),
                                   device=args.device, quantization=args.quantization,
                                   block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching)
    for key in _OPTIONAL_ENGINE_KEYS:
        value = getattr(args, key, None)
        if value is not None:
            options[key] = value
    apply_memory_share(options, getattr(args, "gpu_memory_utilization", None), args.device)
    return options


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """`tokenmill serve`'s engine: the engine flags plus the scheduler's limits."""
    from ...settings.config import EngineConfig

    options = engine_options(args)
    if getattr(args, "enable_lora", False):
        options.update(enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)
    options.update(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                   batching=args.batching, max_waiting=args.max_waiting, seed=getattr(args, "seed", 0),
                   scheduling_policy=scheduling_policy_from_args(args),
                   starvation_bound_s=getattr(args, "starvation_bound", 30.0),
                   grammar_limits=grammar_limits_from_args(args))
    return EngineConfig.from_options(**options)


def scheduling_policy_from_args(args: argparse.Namespace) -> str:
    """--scheduling-policy; tenants from --api-keys-file make fair the default."""
    policy = getattr(args, "scheduling_policy", None)
    if policy is None:
        return "fair" if getattr(args, "api_keys_file", None) else "fcfs"
    return policy


def grammar_limits_from_args(args: argparse.Namespace) -> Any:
    """The --grammar-* flags as a GrammarLimits (the defaults where a flag is absent)."""
    from ...settings.grammar_limits import GrammarLimits

    defaults = GrammarLimits()
    return GrammarLimits(
        max_bytes=getattr(args, "grammar_max_bytes", defaults.max_bytes),
        max_rules=getattr(args, "grammar_max_rules", defaults.max_rules),
        max_depth=getattr(args, "grammar_max_depth", defaults.max_depth),
        compile_timeout_s=getattr(args, "grammar_compile_timeout", defaults.compile_timeout_s),
        worker_memory_bytes=getattr(args, "grammar_worker_memory", defaults.worker_memory_bytes),
        workers=getattr(args, "grammar_workers", defaults.workers),
        queue_size=getattr(args, "grammar_queue_size", defaults.queue_size),
        cache_bytes=getattr(args, "grammar_cache_bytes", defaults.cache_bytes))


def default_model_name(path: str | None) -> str:
    """The name clients use when --served-model-name is not given: the model file's stem."""
    if path is None:
        from ...files.bundled import default_model_path

        path = default_model_path()
    base = os.path.basename(os.path.normpath(path))
    for suffix in (".gguf", ".GGUF"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
    return base


def api_keys_from_args(args: argparse.Namespace) -> str | list[str] | None:
    """--api-key, else TOKENMILL_API_KEY / VLLM_API_KEY; one key as a string, several as a list."""
    keys = args.api_key or [k for k in (os.environ.get("TOKENMILL_API_KEY"), os.environ.get("VLLM_API_KEY")) if k]
    if not keys:
        return None
    return keys[0] if len(keys) == 1 else list(keys)


def router_keys_from_args(args: argparse.Namespace) -> list[str]:
    """--router-api-key, else TOKENMILL_ROUTER_API_KEY."""
    keys = getattr(args, "router_api_key", None) or [os.environ.get("TOKENMILL_ROUTER_API_KEY", "")]
    return [k for k in keys if k]


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """The HTTP side of `tokenmill serve`: names, keys, limits, capture, sampling defaults."""
    from ..server.serving import ServerSettings

    names = args.served_model_name or [default_model_name(args.model)]
    model_path = args.model
    if model_path is None:
        from ...files.bundled import default_model_path

        model_path = default_model_path()
    return ServerSettings(
        served_model_names=list(names), model_path=model_path, api_key=api_keys_from_args(args),
        api_keys_file=getattr(args, "api_keys_file", None), router_api_key=router_keys_from_args(args),
        metrics_tenant_labels=getattr(args, "metrics_tenant_labels", False),
        otlp_traces_endpoint=getattr(args, "otlp_traces_endpoint", None),
        max_waiting=args.max_waiting, max_output_tokens=args.max_output_tokens, log_requests=args.log_requests,
        capture_path=args.capture_traffic, capture_text=args.capture_text,
        capture_key=getattr(args, "capture_key", None) or os.environ.get("TOKENMILL_CAPTURE_KEY") or None,
        grace_period_s=args.shutdown_grace, max_request_bytes=getattr(args, "max_request_bytes", None),
        request_read_timeout_s=getattr(args, "request_read_timeout", 30.0),
        header_read_timeout_s=getattr(args, "header_read_timeout", DEFAULT_HEADER_READ_TIMEOUT_S),
        max_pending_connections=getattr(args, "max_pending_connections", DEFAULT_MAX_PENDING_CONNECTIONS),
        sampling_defaults=generation_defaults(getattr(args, "generation_config", "vllm"), model_path),
        enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
        tool_call_parser=getattr(args, "tool_call_parser", None),
        reasoning_parser=getattr(args, "reasoning_parser", None),
        responses_store_size=getattr(args, "responses_store_size", 1024),
        responses_store_bytes=getattr(args, "responses_store_bytes", DEFAULT_STORE_BYTES),
        lora_modules=_lora_modules(args))


def _lora_modules(args: argparse.Namespace) -> list[tuple[str, str]]:
    from .lora_args import parse_lora_modules

    return parse_lora_modules(getattr(args, "lora_modules", None))


def tokenizer_from_args(args: argparse.Namespace) -> Tokenizer | None:
    """The tokenizer --tokenizer / --chat-template ask for, or None for the model's own."""
    tokenizer_path = getattr(args, "tokenizer", None)
    template = getattr(args, "chat_template", None)
    if tokenizer_path is None and template is None:
        return None
    from ...files.tokenizer import Tokenizer

    tok = Tokenizer.from_model_path(tokenizer_path or args.model)
    if template is not None:
        tok.chat_template = read_chat_template(template)
        tok.has_chat_template = True
    return tok


def template_path(value: str | None) -> str | None:
    """A --chat-template value that looks like a file name (not template text)."""
    if value is None or "{" in value or "\n" in value:
        return None
    return value


def read_chat_template(value: str) -> str:
    """--chat-template's text: the file's contents, or the value itself if it is template text."""
    path = template_path(value)
    if path is None:
        return value
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    if path.endswith(".json"):  # chat_template.json as Hugging Face writes it
        data = json.loads(text)
        text = data.get("chat_template", text) if isinstance(data, dict) else text
    return text


def generation_defaults(choice: str, model_path: str | None) -> dict[str, Any]:
    """Sampling defaults from generation_config.json (--generation-config), in
    SamplingParams' names; only the keys the file sets."""
    if choice in ("vllm", "tokenmill"):
        return {}
    folder = model_path if choice == "auto" else choice
    if not folder or not os.path.isdir(folder):
        return {}  # a GGUF file carries no generation config
    path = os.path.join(folder, "generation_config.json")
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    keys = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "repetition_penalty": float}
    out: dict[str, Any] = {}
    for key, kind in keys.items():
        value = data.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = kind(value)
    if out.get("top_k") == 0:  # Hugging Face's "off"
        out["top_k"] = -1
    return out

"""`tokenmill serve`: the OpenAI-compatible server's command line."""
from __future__ import annotations

import argparse
from typing import Any


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return n


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Model and engine flags, shared with `tokenmill generate`."""
    p.add_argument("--model", default=None,
                   help="local GGUF file or Hugging Face folder (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="compute dtype (default float32)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--quantization", default="none", choices=["none", "int8", "int4", "gguf", "w8a8"],
                   help="weight quantization: none, int8, int4 (weight-only), gguf (keep the file's Q8_0/Q4_0/Q4_1 "
                        "blocks), w8a8 (int8 weights and dynamic int8 activations) (default none)")
    p.add_argument("--quant-group-size", type=int, default=32, choices=[32, 64, 128],
                   help="int4 group size along the input dimension (default 32)")
    p.add_argument("--quantize-lm-head", action="store_true", help="quantize the LM head too")
    p.add_argument("--threads", type=_positive, default=None,
                   dest="num_threads", help="torch intra-op threads for the engine (default: all cores)")
    p.add_argument("--max-model-len", type=_positive, default=None,
                   help="context length (default: the model's)")
    p.add_argument("--kv-cache-memory", default=None,
                   help="bytes for the KV pool, e.g. 2GiB (default: a share of free memory)")
    p.add_argument("--num-blocks", type=_positive, default=None, help=argparse.SUPPRESS)
    p.add_argument("--memory-budget", default=None, help="bytes for weights + KV pool together, e.g. 4GiB")
    p.add_argument("--block-size", type=_positive, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--max-num-seqs", type=_positive, default=64, help="sequences per batch (default 64)")
    p.add_argument("--max-num-batched-tokens", type=_positive, default=None,
                   help="token budget per engine step (default 512 on CPU, 2048 on CUDA)")
    p.add_argument("--batching", default="continuous", choices=["continuous", "static", "dynamic"],
                   help="batching policy (default continuous)")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    p.add_argument("--tensor-parallel-size", "-tp", type=_positive, default=None,
                   help="split every layer over N processes (gloo on CPU, NCCL on CUDA: one GPU each); "
                        "the heads and MLP must divide by N (default 1)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as vLLM takes it: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4}\' (default off)')


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="start the OpenAI-compatible server",
                              description="Serve a model over an OpenAI-compatible HTTP API.")
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in 'model' (default: the model file's name)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (also read from TOKENMILL_API_KEY); "
                        "the web console then asks for it on a sign-in page and keeps a session cookie")
    p.add_argument("--max-waiting", type=_positive, default=None,
                   help="refuse new requests with 429 once this many are waiting (default: unbounded)")
    p.add_argument("--max-output-tokens", type=_positive, default=None,
                   help="cap on every request's output; also the default when a request gives no max_tokens")
    p.add_argument("--log-requests", action="store_true", help="log each request and its outcome")
    p.add_argument("--capture-traffic", metavar="FILE", default=None,
                   help="append one JSON line per finished request (lengths, timings, block hashes) to FILE")
    p.add_argument("--capture-text", action="store_true",
                   help="with --capture-traffic, also store prompt text")
    p.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds running requests may finish after SIGTERM (default 30)")
    p.add_argument("--no-ui", action="store_true", help="do not serve the web console")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from .server import run_server

    if (args.tensor_parallel_size or 1) > 1:  # refuse a split that cannot work in one line, before loading
        import sys

        from ..engine.distributed import startup_problem
        from .server import engine_config_from_args

        problem = startup_problem(engine_config_from_args(args))
        if problem:
            print(f"tokenmill serve: error: {problem}", file=sys.stderr)
            return 2
    return run_server(args)

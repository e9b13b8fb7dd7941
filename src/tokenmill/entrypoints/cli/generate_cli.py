"""`tokenmill generate "prompt"`: one chat answer from a model, printed as it is generated.

The quickest check that weights, tokenizer, chat template and engine work on
this machine, with no server in between.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from ...engine.engine import LLMEngine


def register(subparsers: Any) -> None:
    from .serve_cli import add_engine_arguments

    p = subparsers.add_parser("generate", allow_abbrev=False, help="print a chat answer to one prompt (no server)",
                              description="Answer one prompt with the model's chat template.")
    p.add_argument("prompt", help="the user message")
    p.add_argument("--system", default=None, help="optional system message")
    p.add_argument("--max-tokens", type=int, default=128, help="output limit (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--stats", action="store_true", help="print tokens/s and time to first token to stderr")
    add_engine_arguments(p)
    p.set_defaults(func=run)


def generate(prompt: str, *, system: str | None = None, max_tokens: int = 128, temperature: float = 0.0,
             seed: int | None = None, raw: bool = False, stats: bool = False, out: TextIO | None = None,
             engine: LLMEngine | None = None, **engine_options: Any) -> str:
    """Stream one answer to ``out`` (default stdout) and return it.

    ``engine``: an existing LLMEngine (tests); otherwise one is built from
    ``engine_options`` (bundled model, a small KV pool: one request needs little)."""
    from ...settings.config import EngineConfig
    from ...engine.engine import LLMEngine
    from ...engine.request import SamplingParams

    out = out or sys.stdout
    if engine is None:
        engine_options.setdefault("kv_cache_memory", "256MiB")
        engine = LLMEngine(EngineConfig.from_options(**engine_options))
    tok = engine.tokenizer
    if raw:
        ids = tok.encode(prompt, add_special_tokens=True)
    else:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}]
        ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
    start = time.monotonic()
    first: float | None = None
    n_tokens = 0
    pieces: list[str] = []
    engine.add_request("generate-0", ids, params)
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.token_ids and first is None:
                first = time.monotonic()
            n_tokens += len(delta.token_ids)
            if delta.text:
                pieces.append(delta.text)
                out.write(delta.text)
                out.flush()
    out.write("\n")
    out.flush()
    if stats:
        total = time.monotonic() - start
        ttft = (first or time.monotonic()) - start
        decode = max(total - ttft, 1e-9)
        print(f"[{len(ids)} prompt tokens, {n_tokens} output tokens, TTFT {ttft * 1000:.0f} ms, "
              f"{max(n_tokens - 1, 0) / decode:.1f} tokens/s decode]", file=sys.stderr)
    return "".join(pieces)


def run(args: argparse.Namespace) -> int:
    from .serve_config import engine_options

    generate(args.prompt, system=args.system, max_tokens=args.max_tokens, temperature=args.temperature,
             seed=args.seed, raw=args.raw, stats=args.stats, **engine_options(args))
    return 0

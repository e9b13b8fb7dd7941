"""Structured-output throughput against unconstrained requests, in the same run.

Starts the server in-process on 127.0.0.1 (bundled SmolLM2 by default) and sends
``--requests`` chat requests over five JSON schemas (``response_format``
json_schema) at ``--concurrency`` streams, checking every answer parses and
validates; then the same prompts again without a schema, at the same
concurrency, each asked for exactly as many tokens as its structured twin
produced (``ignore_eos``), so both phases do the same work and the ratio shows
what the constraint costs. Prints output tokens per second for both, their
ratio, and what the grammar masks cost the engine (time filling masks, and the
part of it the step actually waited for: masks are filled while the forward
pass runs).

    PYTHONPATH=src .venv/bin/python benchmarks/structured_output.py
    PYTHONPATH=src .venv/bin/python benchmarks/structured_output.py --requests 20 --concurrency 8
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, Field

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


class Person(BaseModel):
    name: str
    age: int
    city: str


class Product(BaseModel):
    name: str
    price: float
    in_stock: bool


class Weather(BaseModel):
    city: str
    temperature_c: int
    conditions: Literal["sunny", "cloudy", "rain", "snow"]


class Book(BaseModel):
    title: str
    author: str
    year: int


class Meeting(BaseModel):
    topic: str
    attendees: list[str] = Field(max_length=4)
    minutes: int


CASES: list[tuple[type[BaseModel], list[str]]] = [
    (Person, ["Ana is 31 and lives in Lisbon.", "Tom, 45, from Leeds.", "Mei is a 28 year old from Osaka."]),
    (Product, ["The blue kettle costs 24.99 and is available.", "Desk lamp, 12 dollars, sold out."]),
    (Weather, ["It is 18 degrees and raining in Dublin.", "Sunny and 30 degrees in Rome today."]),
    (Book, ["Dune by Frank Herbert, published 1965.", "Emma, a novel by Jane Austen from 1815."]),
    (Meeting, ["Budget review with Ann and Raj for 30 minutes.", "Hiring sync, 15 minutes, Lee and Kim."]),
]


def requests_for(n: int) -> list[tuple[type[BaseModel], str]]:
    out = []
    for i in range(n):
        model, prompts = CASES[i % len(CASES)]
        out.append((model, prompts[(i // len(CASES)) % len(prompts)]))
    return out


async def run_phase(url: str, items: list[tuple[type[BaseModel], str]], concurrency: int,
                    max_tokens: int | list[int], constrained: bool) -> dict[str, Any]:
    """``max_tokens``: one limit for all, or per request (then generated exactly, ignoring EOS)."""
    sem = asyncio.Semaphore(concurrency)
    tokens = 0
    valid = 0
    failures: list[str] = []
    lengths = [0] * len(items)

    async def one(client: httpx.AsyncClient, i: int, model: type[BaseModel], prompt: str) -> None:
        nonlocal tokens, valid
        body: dict[str, Any] = {"messages": [{"role": "user", "content": f"{prompt} Extract it as JSON."}],
                                "max_tokens": max_tokens, "temperature": 0}
        if isinstance(max_tokens, list):
            body.update(max_tokens=max_tokens[i], min_tokens=max_tokens[i], ignore_eos=True)
        if constrained:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": model.__name__, "schema": model.model_json_schema()}}
        async with sem:
            r = await client.post(url + "/v1/chat/completions", json=body)
        data = r.json()
        if r.status_code != 200:
            failures.append(f"{r.status_code}: {data}")
            return
        tokens += data["usage"]["completion_tokens"]
        lengths[i] = data["usage"]["completion_tokens"]
        if constrained:
            try:
                model.model_validate_json(data["choices"][0]["message"]["content"])
                valid += 1
            except ValueError as exc:
                failures.append(f"{model.__name__}: {data['choices'][0]['finish_reason']}: {exc}")

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(one(client, i, m, p) for i, (m, p) in enumerate(items)))
    seconds = time.perf_counter() - started
    return {"requests": len(items), "seconds": seconds, "output_tokens": tokens,
            "tokens_per_s": tokens / seconds, "valid": valid, "failures": failures, "lengths": lengths}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: bundled SmolLM2)")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=80)
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args()

    from test_server_support import ThreadServer

    from tokenmill.settings.config import EngineConfig
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.engine.engine import LLMEngine
    from tokenmill.entrypoints.server.app import build_app
    from tokenmill.entrypoints.server.serving import ServerSettings

    engine = LLMEngine(EngineConfig.from_options(model=args.model, kv_cache_memory="512MiB", max_model_len=2048))
    app = build_app(AsyncEngine(engine), ServerSettings(served_model_names=["bench"]))
    items = requests_for(args.requests)
    results: dict[str, Any] = {}
    try:
        with ThreadServer(app) as srv:
            asyncio.run(run_phase(srv.url, items[:2], 2, 8, True))  # warm up: tokenizer trie, first compiles
            so = engine.structured
            so.mask_rows, so.mask_seconds, so.mask_wait_seconds = 0, 0.0, 0.0
            results["structured"] = asyncio.run(run_phase(srv.url, items, args.concurrency, args.max_tokens, True))
            results["masks"] = {"rows": so.mask_rows, "fill_seconds": so.mask_seconds,
                                "step_wait_seconds": so.mask_wait_seconds,
                                "fill_ms_per_row": 1e3 * so.mask_seconds / max(so.mask_rows, 1)}
            lengths = [max(n, 1) for n in results["structured"]["lengths"]]
            results["unconstrained"] = asyncio.run(run_phase(srv.url, items, args.concurrency, lengths, False))
    finally:
        app.state.tokenmill.aengine.shutdown()
    s, u, m = results["structured"], results["unconstrained"], results["masks"]
    results["ratio"] = s["tokens_per_s"] / u["tokens_per_s"]
    print(f"structured:    {s['requests']} requests, {s['valid']} valid, {s['output_tokens']} tokens in "
          f"{s['seconds']:.1f} s = {s['tokens_per_s']:.1f} tok/s")
    print(f"unconstrained: {u['requests']} requests, {u['output_tokens']} tokens in {u['seconds']:.1f} s = "
          f"{u['tokens_per_s']:.1f} tok/s")
    print(f"ratio (structured / unconstrained tokens per second): {results['ratio']:.2f}x")
    print(f"masks: {m['rows']} rows, {m['fill_ms_per_row']:.3f} ms per row to fill, "
          f"{m['fill_seconds']:.2f} s filling, {m['step_wait_seconds']:.2f} s of it waited for by the step")
    for failure in s["failures"][:5] + u["failures"][:5]:
        print("failure:", failure)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if s["valid"] == s["requests"] and not u["failures"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Prefix caching on vs off, against the real server, in one run.

Workload: 64 requests, each a ~1,500-token document (one of 8) followed by a
~40-token question of its own, sent at concurrency 8 in random order, 16
output tokens each (streaming). The same workload runs against
`tokenmill serve` with the prefix cache on, then against a fresh server with
`--no-prefix-caching` (the baseline). Prints TTFT p50/p99, throughput and hit
rate for both, and the ratios.

    .venv/bin/python benchmarks/prefix_cache.py [--requests 64] [--concurrency 8]

``--burst``: the burst case instead. 16 requests sent at once, each a shared
1,024-token prefix plus 128 tokens of its own (token ids, so the counts are
exact), 64 output tokens; against the baseline of the same burst with only the
128 own tokens per request, on the same server. Prints the prompt tokens the
server computed (``tokenmill:prompt_tokens_computed``) against the ideal
1,024 + 16 x 128, the TTFT p50 ratio, and whether each output equals that of
the same request sent alone afterwards.

    .venv/bin/python benchmarks/prefix_cache.py --burst [--burst-requests 16]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving import launch_server, stop_server  # noqa: E402

WORDS = ("archive ledger harbor copper meadow lantern orchard signal valley winter thunder "
         "garden market silver bridge forest candle window engine river stone paper").split()


def make_workload(n: int, docs: int, doc_words: int, q_words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    documents = [f"Document {d}.\n" + " ".join(rng.choice(WORDS) for _ in range(doc_words)) for d in range(docs)]
    prompts = []
    for i in range(n):
        question = " ".join(rng.choice(WORDS) for _ in range(q_words))
        prompts.append(f"{documents[i % docs]}\n\nQuestion {i}: {question}?\nAnswer:")
    rng.shuffle(prompts)
    return prompts


def start_server(caching: bool, extra: list[str]) -> tuple[subprocess.Popen, str]:
    flags = ["--kv-cache-memory", "2GiB", "--max-num-seqs", "16", "--no-ui", *extra]
    if not caching:
        flags.append("--no-prefix-caching")
    return launch_server(flags, timeout=180)


async def one(client: httpx.AsyncClient, url: str, prompt: str | list[int], max_tokens: int) -> dict:
    """One streamed completion: time to the first text, end to end, usage and the text."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    start = time.perf_counter()
    ttft = None
    usage: dict = {}
    text: list[str] = []
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                piece = chunk["choices"][0].get("text") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - start
                text.append(piece)
            if chunk.get("usage"):
                usage = chunk["usage"]
    return {"ttft": ttft if ttft is not None else time.perf_counter() - start,
            "e2e": time.perf_counter() - start, "usage": usage, "text": "".join(text)}


async def run_load(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def task(p: str) -> dict:
            async with sem:
                return await one(client, url, p, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(task(p) for p in prompts))
        wall = time.perf_counter() - start
    ttfts = sorted(r["ttft"] for r in results)
    prompt_tokens = sum(r["usage"].get("prompt_tokens", 0) for r in results)
    cached = sum((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in results)
    out_tokens = sum(r["usage"].get("completion_tokens", 0) for r in results)
    return {
        "ttft_p50": statistics.median(ttfts),
        "ttft_p99": ttfts[min(len(ttfts) - 1, int(round(0.99 * (len(ttfts) - 1))))],
        "req_per_s": len(results) / wall,
        "out_tok_per_s": out_tokens / wall,
        "hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
        "prompt_tokens": prompt_tokens / len(results),
    }


def computed_prompt_tokens(url: str) -> float:
    """The server's running count of prompt tokens run through the model."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("tokenmill:prompt_tokens_computed_total"):
            return float(line.split()[-1])
    raise SystemExit("the server exports no tokenmill:prompt_tokens_computed_total")


async def burst(url: str, prompts: list[list[int]], max_tokens: int) -> tuple[list[float], list[str]]:
    """Every prompt at once; (TTFTs, output texts) in prompt order."""
    async with httpx.AsyncClient(timeout=1200) as client:
        done = await asyncio.gather(*(one(client, url, p, max_tokens) for p in prompts))
    return [r["ttft"] for r in done], [r["text"] for r in done]


def run_burst(args: argparse.Namespace) -> None:
    rng = random.Random(1)
    n, shared_len, own_len = args.burst_requests, 1024, 128

    def tokens(k: int) -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(k)]

    prefix = tokens(shared_len)
    shared = [prefix + tokens(own_len) for _ in range(n)]
    unshared = [tokens(own_len) for _ in range(n)]
    proc, url = start_server(True, ["--max-num-seqs", str(max(16, n)), *args.server_args.split()])
    try:
        asyncio.run(burst(url, [tokens(16)], 2))  # warm-up
        before = computed_prompt_tokens(url)
        ttft_shared, texts = asyncio.run(burst(url, shared, args.burst_max_tokens))
        computed = computed_prompt_tokens(url) - before
        ttft_unshared, _ = asyncio.run(burst(url, unshared, args.burst_max_tokens))
        alone = [asyncio.run(burst(url, [p], args.burst_max_tokens))[1][0] for p in shared]
    finally:
        stop_server(proc)
    ideal = shared_len + n * own_len
    p50s, p50u = statistics.median(ttft_shared), statistics.median(ttft_unshared)
    same = sum(a == b for a, b in zip(texts, alone))
    print(f"burst: {n} requests at once, {shared_len} shared + {own_len} own prompt tokens, "
          f"{args.burst_max_tokens} output tokens; {os.cpu_count()} CPUs; server flags: {args.server_args or 'defaults'}")
    print(f"prompt tokens computed: {computed:.0f} against ideal {ideal} ({computed / ideal:.2f}x; "
          f"{n * (shared_len + own_len)} sent)")
    print(f"TTFT p50: shared burst {p50s:.2f} s, own tokens only (baseline) {p50u:.2f} s: {p50s / p50u:.2f}x")
    print(f"TTFT p99: shared burst {max(ttft_shared):.2f} s, baseline {max(ttft_unshared):.2f} s")
    print(f"outputs equal to the same request sent alone: {same}/{n}")


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--documents", type=int, default=8)
    ap.add_argument("--doc-words", type=int, default=1400)
    ap.add_argument("--question-words", type=int, default=36)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--server-args", default="", help="extra `tokenmill serve` flags for both servers, one string")
    ap.add_argument("--burst", action="store_true", help="the shared-prefix burst case (see the docstring)")
    ap.add_argument("--burst-requests", type=int, default=16)
    ap.add_argument("--burst-max-tokens", type=int, default=64)
    args = ap.parse_args()
    if args.burst:
        run_burst(args)
        return
    prompts = make_workload(args.requests, args.documents, args.doc_words, args.question_words)
    figures = {}
    for caching in (True, False):
        proc, url = start_server(caching, args.server_args.split())
        try:
            figures[caching] = asyncio.run(run_load(url, prompts, args.concurrency, args.max_tokens))
        finally:
            stop_server(proc)
    on, off = figures[True], figures[False]
    print(f"workload: {args.requests} requests, {args.documents} shared documents, "
          f"~{on['prompt_tokens']:.0f} prompt tokens each, concurrency {args.concurrency}, "
          f"{args.max_tokens} output tokens; {os.cpu_count()} CPUs; server flags: {args.server_args or 'defaults'}")
    print(f"{'':22}{'cache on':>12}{'cache off (baseline)':>22}{'ratio':>10}")
    rows = [("TTFT p50 (s)", "ttft_p50", False), ("TTFT p99 (s)", "ttft_p99", False),
            ("requests/s", "req_per_s", True), ("output tok/s", "out_tok_per_s", True),
            ("prefix hit rate", "hit_rate", None)]
    for label, key, higher_better in rows:
        a, b = on[key], off[key]
        if higher_better is None:
            ratio = ""
        elif higher_better:
            ratio = f"{a / b:.2f}x" if b else "-"
        else:
            ratio = f"{b / a:.2f}x lower" if a else "-"
        print(f"{label:22}{a:12.3f}{b:22.3f}{ratio:>14}")


if __name__ == "__main__":
    main()

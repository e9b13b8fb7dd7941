"""What the HTTP layer costs: the same load through `tokenmill serve` and offline.

Load: 64 requests (``--num-requests``), closed loop at concurrency 16
(``--concurrency``), prompts of ``--input-len`` tokens that share nothing
(each starts with its own number, so the prefix cache never helps), exactly
``--output-len`` output tokens each (``ignore_eos``), greedy.

1. Server: `tokenmill serve` (bundled SmolLM2 unless ``--model``) in a
   subprocess on loopback with ``--max-num-seqs`` equal to the concurrency;
   each request is a streaming ``/v1/completions`` call over httpx. TTFT is
   send -> first token chunk as the client sees it; TPOT is
   (end - first token) / (tokens - 1); throughput is output tokens / wall time.
2. Offline, in this process: ``LLM.generate`` over the same token ids with the
   same engine options, stepped from a worker thread as the server's engine
   is. ``max_num_seqs`` equal to the concurrency makes the
   engine itself run the closed loop (a finished sequence's slot is refilled
   the next step). TTFT offline is first scheduled -> first token (the time a
   request waits for a slot is not TTFT in a closed loop); TPOT as above.

The ratios (server / offline) say what HTTP, JSON, SSE and the event loop
add. The machine's speed drifts, so only the ratios are worth comparing
across runs.

    .venv/bin/python benchmarks/serving.py [--num-requests 64] [--concurrency 16]
                                           [--input-len 128] [--output-len 64] [--dtype float32] [--rounds 2]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx

WORDS = ("river stone lantern harbor winter orchard signal copper meadow engine valley thunder paper "
         "garden market silver bridge forest candle window").split()


@dataclass
class Sample:
    ttft: float
    tpot: float
    e2e: float
    tokens: int


@dataclass
class Result:
    name: str
    samples: list[Sample]
    wall: float

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.samples)


def percentile(values: list[float], q: float) -> float:
    xs = sorted(values)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def make_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    rng = random.Random(0)
    prompts = []
    for i in range(count):
        text = f"Request {i}. " + " ".join(rng.choice(WORDS) for _ in range(length * 2))
        prompts.append(tokenizer.encode(text)[:length])
    return prompts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--dtype", args.dtype, "--max-num-seqs", str(args.concurrency), "--kv-cache-memory", args.kv_cache_memory]
    if args.model:
        flags += ["--model", args.model]
    return flags


async def _drive_server(url: str, prompts: list[list[int]], out_len: int, concurrency: int,
                        warmup: list[int] | None = None) -> Result:
    """Closed loop at ``concurrency`` over ``prompts`` after one uncounted warm-up
    request (``warmup``, or the first prompt, which its counted repeat then finds
    in the prefix cache)."""
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    samples: list[Sample] = []
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def one(prompt: list[int]) -> Sample:
            body = {"prompt": prompt, "max_tokens": out_len, "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            start = time.perf_counter()
            first = None
            tokens = 0
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and first is None and chunk["choices"][0]["text"]:
                        first = time.perf_counter()
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
            end = time.perf_counter()
            first = first or end
            return Sample(first - start, (end - first) / max(tokens - 1, 1), end - start, tokens)

        async def worker() -> None:
            while not queue.empty():
                samples.append(await one(queue.get_nowait()))

        # warm-up, not counted
        await one(warmup if warmup is not None else prompts[0])
        t0 = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        wall = time.perf_counter() - t0
    return Result("server (HTTP, streaming)", samples, wall)


def launch_server(serve_flags: list[str], timeout: float = 300) -> tuple[subprocess.Popen, str]:
    """Start `tokenmill serve` on a free loopback port with ``serve_flags``; return it
    and its URL once /health answers (SystemExit if it exits or is not up in time).
    The server's output is dropped unless ``TOKENMILL_BENCH_SERVER_LOG`` names a file
    to append it to (how a failed start shows its traceback)."""
    port = free_port()
    cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli.main", "serve", "--host", "127.0.0.1", "--port", str(port),
           *serve_flags]
    log_path = os.environ.get("TOKENMILL_BENCH_SERVER_LOG")
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT if log_path else subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"tokenmill serve exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("server did not start")
        time.sleep(0.25)


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def run_server(args: argparse.Namespace, prompts: list[list[int]]) -> Result:
    proc, url = launch_server(engine_flags(args))
    try:
        return asyncio.run(_drive_server(url, prompts, args.output_len, args.concurrency))
    finally:
        stop_server(proc)


def run_offline(args: argparse.Namespace, prompts: list[list[int]]) -> Result:
    from tokenmill import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.concurrency, kv_cache_memory=args.kv_cache_memory)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([prompts[0]], params)  # warm-up, not counted
    # The server steps its engine in a worker thread (AsyncEngine); do the same
    # here so both sides run the same compute path. On a busy CPU, torch ops
    # issued from the main thread measured several times slower than from a
    # worker thread, which would otherwise be misread as an HTTP effect.
    box: dict[str, object] = {}

    def work() -> None:
        t0 = time.perf_counter()
        box["outs"] = llm.generate(prompts, params)
        box["wall"] = time.perf_counter() - t0

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    outs, wall = box["outs"], float(box["wall"])  # type: ignore[assignment]
    samples = []
    for out in outs:
        m = out.metrics
        n = len(out.outputs[0].token_ids)
        samples.append(Sample(m["prefill_time"], (m["e2e"] - m["ttft"]) / max(n - 1, 1), m["e2e"] - m["queue_time"], n))
    return Result("offline (LLM.generate)", samples, wall)


def report(server: Result, offline: Result, args: argparse.Namespace) -> None:
    def row(label: str, f, unit: str, scale: float = 1.0) -> None:
        a, b = f(server) * scale, f(offline) * scale
        print(f"{label:<22}{a:>14.2f}{b:>14.2f}{a / b if b else float('nan'):>10.2f}  {unit}")

    print(f"\n{args.rounds} x {args.num_requests} requests, concurrency {args.concurrency}, {args.input_len} prompt tokens, "
          f"{args.output_len} output tokens, dtype {args.dtype}, {os.cpu_count()} CPUs")
    print(f"{'':<22}{'server':>14}{'offline':>14}{'ratio':>10}")
    row("output tokens/s", lambda r: r.tokens / r.wall, "tok/s")
    row("requests/s", lambda r: len(r.samples) / r.wall, "req/s")
    row("TTFT p50", lambda r: percentile([s.ttft for s in r.samples], 50), "ms", 1000)
    row("TTFT p99", lambda r: percentile([s.ttft for s in r.samples], 99), "ms", 1000)
    row("TPOT p50", lambda r: percentile([s.tpot for s in r.samples], 50), "ms", 1000)
    row("TPOT p99", lambda r: percentile([s.tpot for s in r.samples], 99), "ms", 1000)
    row("wall time", lambda r: r.wall, "s")
    assert server.tokens == offline.tokens == args.rounds * args.num_requests * args.output_len, (
        server.tokens, offline.tokens)
    print("(ratio = server / offline: above 1 for latencies and below 1 for throughput is what HTTP costs)")


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--rounds", type=int, default=1, help="alternate server/offline runs this many times")
    args = ap.parse_args()

    from tokenmill.files.tokenizer import Tokenizer

    prompts = make_prompts(Tokenizer.from_model_path(args.model), args.num_requests, args.input_len)
    servers, offlines = [], []
    for r in range(args.rounds):  # alternate, so drift of the machine's speed hits both sides
        print(f"round {r + 1}/{args.rounds}: server ...", flush=True)
        servers.append(run_server(args, prompts))
        print(f"round {r + 1}/{args.rounds}: offline ...", flush=True)
        offlines.append(run_offline(args, prompts))
        print(f"  output tok/s: server {servers[-1].tokens / servers[-1].wall:.1f}, "
              f"offline {offlines[-1].tokens / offlines[-1].wall:.1f}", flush=True)
    report(_pool(servers), _pool(offlines), args)
    return 0


def _pool(results: list[Result]) -> Result:
    """All rounds together: samples pooled, wall times summed."""
    return Result(results[0].name, [s for r in results for s in r.samples], sum(r.wall for r in results))


if __name__ == "__main__":
    sys.exit(main())

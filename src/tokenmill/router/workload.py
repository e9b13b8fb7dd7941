"""The shared-prefix workload and a small async driver, for tests and benchmarks.

Requests share one of ``n_prefixes`` long prefixes (think: system prompts or
few-shot preambles of different applications) followed by a short unique
question, in random order. A good router keeps each prefix on one replica;
round-robin spreads every prefix over all replicas and, when the replicas'
caches cannot hold every prefix, mostly misses.

Hit rates are read from the backends' own counters
(``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total``), so the
figure is what the servers measured, not what the router believes.
"""
from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

from .pool import parse_backend_metrics

_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "po", "da", "fe", "gu", "hi", "ja", "be"]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))


@dataclass
class WorkItem:
    prefix_id: int
    prompt: str
    model: str | None = None  # the request's `model` (a LoRA adapter, say); None: the run's


def shared_prefix_workload(n_prefixes: int = 8, per_prefix: int = 6, prefix_words: int = 300,
                           suffix_words: int = 12, seed: int = 0, hot_share: float = 0.0) -> list[WorkItem]:
    """Requests over ``n_prefixes`` shared prefixes in random order.

    With ``hot_share`` > 0, that share of all requests uses prefix 0 (a hot
    prefix) and the rest spread evenly over the others.
    """
    rng = random.Random(seed)
    prefixes = [" ".join(f"{_word(rng)}" for _ in range(prefix_words)) for _ in range(n_prefixes)]
    total = n_prefixes * per_prefix
    if hot_share > 0:
        n_hot = int(round(total * hot_share))
        ids = [0] * n_hot + [1 + i % (n_prefixes - 1) for i in range(total - n_hot)]
    else:
        ids = [i % n_prefixes for i in range(total)]
    rng.shuffle(ids)
    items = []
    for k, pid in enumerate(ids):
        suffix = " ".join(_word(rng) for _ in range(suffix_words))
        items.append(WorkItem(pid, f"{prefixes[pid]}\nQuestion {k}: {suffix}\nAnswer:"))
    return items


@dataclass
class Result:
    ok: bool
    ttft: float | None  # seconds to the first content chunk
    latency: float
    backend: str | None
    first_byte_at: float | None  # monotonic time of the first byte
    error: str | None = None
    chunks: int = 0
    cached_tokens: int | None = None


@dataclass
class RunSummary:
    results: list[Result]
    wall_s: float
    hit_rate: float | None = None
    per_backend: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> int:
        return sum(r.ok for r in self.results)

    @property
    def throughput(self) -> float:
        return self.ok / self.wall_s if self.wall_s > 0 else 0.0

    def ttft_pct(self, q: float) -> float:
        vals = sorted(r.ttft for r in self.results if r.ok and r.ttft is not None)
        if not vals:
            return float("nan")
        if len(vals) == 1:
            return vals[0]
        return statistics.quantiles(vals, n=100, method="inclusive")[int(q) - 1] if q < 100 else vals[-1]

    def max_share(self) -> float:
        total = sum(self.per_backend.values())
        return max(self.per_backend.values()) / total if total else 0.0


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int,
                      model: str | None = None, timeout: float = 120.0) -> Result:
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    t0 = time.monotonic()
    ttft = first_byte = None
    chunks = 0
    cached = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
            backend = r.headers.get("x-tokenmill-backend")
            if r.status_code != 200:
                await r.aread()
                return Result(False, None, time.monotonic() - t0, backend, None, f"HTTP {r.status_code}: {r.text[:200]}")
            async for line in r.aiter_lines():
                if first_byte is None:
                    first_byte = time.monotonic()
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    return Result(False, ttft, time.monotonic() - t0, backend, first_byte,
                                  f"stream error: {obj['error'].get('message')}", chunks)
                if obj.get("choices") and ttft is None:
                    ttft = time.monotonic() - t0
                chunks += 1
                usage = obj.get("usage") or {}
                details = usage.get("prompt_tokens_details") or {}
                if "cached_tokens" in details:
                    cached = details["cached_tokens"]
        return Result(True, ttft, time.monotonic() - t0, backend, first_byte, None, chunks, cached)
    except httpx.HTTPError as exc:
        return Result(False, ttft, time.monotonic() - t0, None, first_byte, f"{type(exc).__name__}: {exc}", chunks)


async def scrape_prefix_counters(client: httpx.AsyncClient, backends: list[str]) -> dict[str, tuple[float, float]]:
    """(queries, hits) per backend, from each backend's /metrics; missing ones are skipped."""
    out = {}
    for url in backends:
        try:
            r = await client.get(url + "/metrics", timeout=5.0)
            s = parse_backend_metrics(r.text)
            out[url] = (s.prefix_queries, s.prefix_hits)
        except httpx.HTTPError:
            pass
    return out


async def run_workload(router_url: str, items: list[WorkItem], concurrency: int, max_tokens: int = 8,
                       backends: list[str] | None = None, model: str | None = None,
                       timeout: float = 120.0) -> RunSummary:
    """Send ``items`` through the router with bounded concurrency; measure hit rate on ``backends``."""
    limits = httpx.Limits(max_connections=concurrency * 2 + 4)
    async with httpx.AsyncClient(limits=limits, trust_env=False) as client:
        before = await scrape_prefix_counters(client, backends or [])
        queue: asyncio.Queue[WorkItem] = asyncio.Queue()
        for it in items:
            queue.put_nowait(it)
        results: list[Result] = []

        async def worker() -> None:
            while True:
                try:
                    it = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                results.append(await one_request(client, router_url, it.prompt, max_tokens, it.model or model,
                                                 timeout))

        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.monotonic() - t0
        after = await scrape_prefix_counters(client, backends or [])
    summary = RunSummary(results, wall)
    dq = sum(after[u][0] - before[u][0] for u in after if u in before)
    dh = sum(after[u][1] - before[u][1] for u in after if u in before)
    summary.hit_rate = dh / dq if dq > 0 else None
    for r in results:
        if r.ok and r.backend:
            summary.per_backend[r.backend] = summary.per_backend.get(r.backend, 0) + 1
    return summary

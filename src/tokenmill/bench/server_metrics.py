"""The server's own view: Prometheus ``/metrics`` before/after a load point,
sampled gauges during it, and the one-line diagnosis built from both.

Names follow vLLM (tokenmill exports the same); SGLang and llama.cpp aliases
are read where the meaning is the same. Missing metrics are simply absent.
"""
from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from tokenmill.bench.stats import Summary

ALIASES: dict[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running", "sglang:num_running_reqs",
                "llamacpp:requests_processing"),
    "waiting": ("vllm:num_requests_waiting", "sglang:num_queue_reqs",
                "llamacpp:requests_deferred"),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                 "sglang:token_usage"),
    "prompt_tokens": ("vllm:prompt_tokens_total", "sglang:prompt_tokens_total",
                      "llamacpp:prompt_tokens_total"),
    "generation_tokens": ("vllm:generation_tokens_total", "sglang:generation_tokens_total",
                          "llamacpp:tokens_predicted_total"),
    "prefix_queries": ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries"),
    "prefix_hits": ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits"),
    "preemptions": ("vllm:num_preemptions_total", "vllm:num_preemptions"),
}
HISTOGRAMS: dict[str, tuple[str, ...]] = {
    "ttft": ("vllm:time_to_first_token_seconds", "sglang:time_to_first_token_seconds"),
    "tpot": ("vllm:time_per_output_token_seconds", "sglang:time_per_output_token_seconds"),
    "e2e": ("vllm:e2e_request_latency_seconds", "sglang:e2e_request_latency_seconds"),
    "queue": ("vllm:request_queue_time_seconds", "sglang:queue_time_seconds"),
    "prefill": ("vllm:request_prefill_time_seconds",),
    "decode": ("vllm:request_decode_time_seconds",),
}


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name -> value, summed over label sets (one model per server)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, _, rest = line.partition("{")
            _, _, rest = rest.rpartition("}")
        else:
            name, _, rest = line.partition(" ")
        parts = rest.split()
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        if name.endswith("_bucket"):
            continue
        out[name.strip()] = out.get(name.strip(), 0.0) + value
    return out


def _pick(raw: dict[str, float], names: tuple[str, ...]) -> float | None:
    for n in names:
        if n in raw:
            return raw[n]
    return None


@dataclass
class Snapshot:
    values: dict[str, float] = field(default_factory=dict)  # alias -> value
    hist: dict[str, tuple[float, float]] = field(default_factory=dict)  # alias -> (sum, count)

    @classmethod
    def from_text(cls, text: str) -> "Snapshot":
        raw = parse_prometheus(text)
        snap = cls()
        for alias, names in ALIASES.items():
            v = _pick(raw, names)
            if v is not None:
                snap.values[alias] = v
        for alias, names in HISTOGRAMS.items():
            for n in names:
                if f"{n}_count" in raw:
                    snap.hist[alias] = (raw.get(f"{n}_sum", 0.0), raw[f"{n}_count"])
                    break
        return snap


async def scrape(client: httpx.AsyncClient, base_url: str) -> Snapshot | None:
    """GET /metrics; None when the server has none or cannot be reached."""
    try:
        resp = await client.get(base_url + "/metrics", timeout=10.0)
        if resp.status_code != 200:
            return None
        return Snapshot.from_text(resp.text)
    except httpx.HTTPError:
        return None


@dataclass
class ServerDelta:
    """What the server says happened during one load point."""

    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    means: dict[str, float] = field(default_factory=dict)  # hist alias -> mean seconds
    counts: dict[str, float] = field(default_factory=dict)
    running_mean: float | None = None
    running_max: float | None = None
    waiting_mean: float | None = None
    waiting_max: float | None = None
    kv_usage_max: float | None = None
    preemptions: float | None = None  # requests evicted for recompute: the KV pool ran out

    @property
    def prefix_hit_rate(self) -> float | None:
        if self.prefix_queries:
            return (self.prefix_hits or 0.0) / self.prefix_queries
        return None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["prefix_hit_rate"] = self.prefix_hit_rate
        return d


def delta(before: Snapshot | None, after: Snapshot | None) -> ServerDelta | None:
    if before is None or after is None:
        return None
    d = ServerDelta()
    for key in ("prompt_tokens", "generation_tokens", "prefix_queries", "prefix_hits", "preemptions"):
        if key in after.values and key in before.values:
            setattr(d, key, after.values[key] - before.values[key])
    for alias, (s1, c1) in after.hist.items():
        s0, c0 = before.hist.get(alias, (0.0, 0.0))
        if c1 - c0 > 0:
            d.means[alias] = (s1 - s0) / (c1 - c0)
            d.counts[alias] = c1 - c0
    return d


class GaugeSampler:
    """Polls running/waiting/KV usage every ``interval`` s while a point runs."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, interval: float = 0.5):
        self.client, self.base_url, self.interval = client, base_url, interval
        self.samples: list[Snapshot] = []
        self._task: asyncio.Task[None] | None = None

    async def _loop(self) -> None:
        while True:
            snap = await scrape(self.client, self.base_url)
            if snap is None:
                return
            self.samples.append(snap)
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self, into: ServerDelta | None) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if into is None:
            return
        for key in ("running", "waiting"):
            vals = [s.values[key] for s in self.samples if key in s.values]
            if vals:
                setattr(into, f"{key}_mean", sum(vals) / len(vals))
                setattr(into, f"{key}_max", max(vals))
        kv = [s.values["kv_usage"] for s in self.samples if "kv_usage" in s.values]
        if kv:
            into.kv_usage_max = max(kv)


HINTS = {
    "queueing": "requests wait for a slot: add replicas, raise max-num-seqs/KV memory, "
                "or shed load",
    "prefill": "prompt processing: shorter prompts, shared part first for prefix caching, "
               "chunked prefill",
    "decode": "token generation: batch mix, memory bandwidth, quantization, shorter outputs",
    "client/network": "outside the engine: HTTP, tokenization, or the load generator itself",
    "first token": "queue + prefill (server exports no split): check queue time, prompt "
                   "length, prefix reuse",
}


def diagnose(label: str, s: Summary, d: ServerDelta | None) -> tuple[str, dict[str, float]]:
    """Split mean e2e into queue / prefill / client-network / decode and name the
    biggest part (the seed's quick decision guide, done by the numbers)."""
    if not s.completed or s.ttft.mean is None or s.e2e.mean is None:
        return f"{label}: no completed requests to diagnose", {}
    ttft, e2e = s.ttft.mean, s.e2e.mean
    parts: dict[str, float] = {"decode": max(0.0, e2e - ttft)}
    means = d.means if d else {}
    if "queue" in means and "prefill" in means:
        parts["queueing"] = means["queue"]
        parts["prefill"] = means["prefill"]
        server_ttft = means.get("ttft", means["queue"] + means["prefill"])
        parts["client/network"] = max(0.0, ttft - server_ttft)
    elif "ttft" in means:
        parts["first token"] = min(ttft, means["ttft"])
        parts["client/network"] = max(0.0, ttft - means["ttft"])
    else:
        parts["first token"] = ttft
    top = max(parts, key=lambda k: parts[k])
    shown = " + ".join(f"{k} {_ms(v)}" for k, v in parts.items())
    extra = ""
    if d and d.waiting_mean is not None:
        extra = f"; waiting avg {d.waiting_mean:.1f} max {d.waiting_max:.0f}"
    if s.max_lateness > 0.05:
        extra += f"; client fell {_ms(s.max_lateness)} behind schedule"
    line = f"{label}: {top} dominates (e2e {_ms(e2e)} = {shown}{extra}) -> {HINTS[top]}"
    return line, parts


def _ms(x: float) -> str:
    return f"{x * 1000:.0f} ms" if x < 10 else f"{x:.1f} s"

"""Metrics math: percentiles, throughput, goodput and cost from request records.

Definitions (the ones users and finance feel):

- TTFT: send -> first content-bearing chunk.
- TPOT: per request, (e2e - ttft) / (output_tokens - 1); then distributed.
- ITL: every gap between content chunks, pooled over requests.
- E2E: send -> end of stream.
- duration: first send -> last completion of the measured requests.
- goodput: requests that finished AND met every SLO given, per second.
- cost: ``cost_per_hour`` is the whole deployment's price; the run's cost is
  price x duration, spread over the requests / output tokens it served.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tokenmill.bench.types import RequestRecord

PERCENTILES = (50, 90, 95, 99)
SLO_KEYS = ("ttft", "tpot", "itl", "e2e")


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100), like numpy's default."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class Dist:
    """mean / percentiles / max of one latency, in seconds."""

    n: int = 0
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None
    max: float | None = None

    @classmethod
    def of(cls, values: Sequence[float]) -> "Dist":
        vals = [v for v in values if v is not None]
        if not vals:
            return cls()
        return cls(n=len(vals), mean=sum(vals) / len(vals), max=max(vals),
                   **{f"p{q}": percentile(vals, q) for q in PERCENTILES})


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft=0.5,tpot=0.05,e2e=10' -> {'ttft': 0.5, ...} (seconds; 'ms' suffix ok)."""
    out: dict[str, float] = {}
    if not text:
        return out
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, val = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"bad SLO {part!r}: use ttft=SECONDS,tpot=SECONDS,itl=...,e2e=...")
        val = val.strip().lower()
        out[key] = float(val[:-2]) / 1000.0 if val.endswith("ms") else float(val.rstrip("s"))
    return out


def meets_slo(rec: RequestRecord, slo: dict[str, float]) -> bool:
    """A request is 'good' if it succeeded and met every SLO that applies to it."""
    if not rec.ok:
        return False
    if "ttft" in slo and (rec.ttft is None or rec.ttft > slo["ttft"]):
        return False
    if "e2e" in slo and (rec.e2e is None or rec.e2e > slo["e2e"]):
        return False
    if "tpot" in slo and rec.tpot is not None and rec.tpot > slo["tpot"]:
        return False
    if "itl" in slo and rec.itls and max(rec.itls) > slo["itl"]:
        return False
    return True


@dataclass
class Summary:
    """Everything the report prints for one load point."""

    completed: int = 0
    failed: int = 0
    duration: float = 0.0
    request_throughput: float = 0.0
    output_throughput: float = 0.0
    total_token_throughput: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None
    cache_hit_rate: float | None = None
    usage_reported: int = 0
    ttft: Dist = field(default_factory=Dist)
    tpot: Dist = field(default_factory=Dist)
    itl: Dist = field(default_factory=Dist)
    e2e: Dist = field(default_factory=Dist)
    good: int | None = None
    goodput: float | None = None
    run_cost: float | None = None
    cost_per_1k_requests: float | None = None
    cost_per_1k_good_requests: float | None = None
    cost_per_m_output_tokens: float | None = None
    errors: dict[str, int] = field(default_factory=dict)
    max_lateness: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Summary":
        d = dict(d)
        for k in ("ttft", "tpot", "itl", "e2e"):
            if isinstance(d.get(k), dict):
                d[k] = Dist(**d[k])
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def deployment_cost(cost_per_hour: float, duration_s: float) -> float:
    """What the deployment costs over ``duration_s``: the one cost model of every report
    (bench's runs, usage's tenants), spread afterwards over what was served."""
    return cost_per_hour * duration_s / 3600.0


def summarize(records: Sequence[RequestRecord], slo: dict[str, float] | None = None,
              cost_per_hour: float | None = None) -> Summary:
    """Reduce per-request records to a Summary."""
    slo = slo or {}
    ok = [r for r in records if r.ok]
    s = Summary(completed=len(ok), failed=len(records) - len(ok))
    ends = [r.start + r.e2e for r in records if r.e2e is not None]
    if records and ends:
        s.duration = max(ends) - min(r.start for r in records)
    s.prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    s.output_tokens = sum(r.output_tokens for r in ok)
    s.usage_reported = sum(1 for r in ok if r.usage_reported)
    cached = [r for r in ok if r.cached_tokens is not None]
    if cached:
        s.cached_tokens = sum(r.cached_tokens or 0 for r in cached)
        denom = sum(r.prompt_tokens or 0 for r in cached)
        s.cache_hit_rate = s.cached_tokens / denom if denom else None
    if s.duration > 0:
        s.request_throughput = len(ok) / s.duration
        s.output_throughput = s.output_tokens / s.duration
        s.total_token_throughput = (s.output_tokens + s.prompt_tokens) / s.duration
    s.ttft = Dist.of([r.ttft for r in ok if r.ttft is not None])
    s.tpot = Dist.of([r.tpot for r in ok if r.tpot is not None])
    s.itl = Dist.of([x for r in ok for x in r.itls])
    s.e2e = Dist.of([r.e2e for r in ok if r.e2e is not None])
    s.max_lateness = max((r.lateness for r in records), default=0.0)
    if slo:
        s.good = sum(1 for r in records if meets_slo(r, slo))
        s.goodput = s.good / s.duration if s.duration > 0 else 0.0
    if cost_per_hour is not None and s.duration > 0:
        s.run_cost = deployment_cost(cost_per_hour, s.duration)
        if ok:
            s.cost_per_1k_requests = s.run_cost / len(ok) * 1000.0
        if s.good:
            s.cost_per_1k_good_requests = s.run_cost / s.good * 1000.0
        if s.output_tokens:
            s.cost_per_m_output_tokens = s.run_cost / s.output_tokens * 1e6
    s.errors = dict(Counter(_error_key(r) for r in records if not r.ok))
    return s


def _error_key(r: RequestRecord) -> str:
    msg = (r.error or "error").splitlines()[0][:120]
    return f"HTTP {r.status}: {msg}" if r.status and r.status != 200 else msg

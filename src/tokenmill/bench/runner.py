"""A whole benchmark: preflight, then each load point of the sweep in turn.

Per point: build the workload (fresh salt), optionally reset the prefix
cache, warm up, snapshot /metrics, run while sampling gauges, snapshot again,
summarize and diagnose. Results accumulate in ``BenchResult`` as they come,
so an interrupted or failing run still reports what it measured.
"""
from __future__ import annotations

import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from tokenmill.bench import server_metrics as sm
from tokenmill.bench.client import Target
from tokenmill.bench.lengths import LengthDist
from tokenmill.bench.loadgen import LoadShape, PointRun, Progress, run_point, warmup
from tokenmill.bench.stats import Summary, summarize
from tokenmill.bench.tokens import LocalTokenizer, TextBuilder, TokenCounter
from tokenmill.bench.types import RequestSpec
from tokenmill.bench.workloads import (SyntheticConfig, load_dataset, load_trace, make_salt,
                                       synthetic)


@dataclass
class BenchConfig:
    shapes: list[LoadShape]
    num_requests: int = 100
    warmup: int = 0
    synthetic: SyntheticConfig | None = None
    dataset: str | None = None
    trace: str | None = None
    trace_speed: float = 1.0
    output_len: LengthDist | None = None  # dataset default
    slo: dict[str, float] = field(default_factory=dict)
    cost_per_hour: float | None = None
    reset_cache: bool = False
    salt: bool = True
    seed: int = 0
    timeout: float = 600.0
    progress: bool | None = None
    metrics_interval: float = 0.5  # seconds between /metrics gauge samples

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {k: v for k, v in asdict(self).items()
                             if k not in ("shapes", "synthetic", "output_len")}
        if self.synthetic:
            d["input_len"] = self.synthetic.input_len.describe()
            d["output_len"] = self.synthetic.output_len.describe()
            d["prefix_len"] = self.synthetic.prefix_len
            d["num_prefixes"] = self.synthetic.num_prefixes
            d["prefix_pick"] = self.synthetic.prefix_pick
        return d


@dataclass
class PointResult:
    label: str
    shape: dict[str, Any]
    summary: Summary
    run: PointRun
    server: sm.ServerDelta | None = None
    diagnosis: str = ""
    breakdown: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self, with_records: bool = True) -> dict[str, Any]:
        d: dict[str, Any] = {"label": self.label, "shape": self.shape,
                             "summary": self.summary.to_dict(),
                             "server": self.server.to_dict() if self.server else None,
                             "diagnosis": self.diagnosis, "breakdown": self.breakdown,
                             "warnings": self.warnings, "aborted": self.run.aborted}
        if with_records:
            d["records"] = [r.to_dict() for r in self.run.records]
        return d


@dataclass
class BenchResult:
    target: dict[str, Any]
    config: dict[str, Any]
    points: list[PointResult] = field(default_factory=list)
    counter: str = ""
    started_at: float = field(default_factory=time.time)
    aborted: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"tokenmill_bench": 1, "started_at": self.started_at, "target": self.target,
                "config": self.config, "token_counter": self.counter, "aborted": self.aborted,
                "points": [p.to_dict() for p in self.points]}


def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)


async def resolve_model(client: httpx.AsyncClient, base_url: str, api_key: str | None = None) -> str:
    """The first model the server lists; raises RuntimeError with a clear message."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = await client.get(base_url + "/v1/models", timeout=15.0, headers=headers)
    except httpx.HTTPError as exc:
        raise RuntimeError(f"cannot reach {base_url}: {exc or type(exc).__name__}") from None
    if resp.status_code in (401, 403):
        raise RuntimeError(f"{base_url}/v1/models answered HTTP {resp.status_code}: give the server's key "
                           "with --api-key or OPENAI_API_KEY")
    if resp.status_code != 200:
        raise RuntimeError(f"{base_url}/v1/models answered HTTP {resp.status_code}; pass --model")
    try:
        return str(resp.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise RuntimeError(f"{base_url}/v1/models listed no model; pass --model") from None


def build_specs(cfg: BenchConfig, counter: TokenCounter, n: int, seed: int,
                salt: str, rate: float | None = None) -> list[RequestSpec]:
    """The requests of one load point (a trace is rescaled to ``rate`` if given)."""
    rng = random.Random(seed)
    builder = TextBuilder(counter, seed=seed)
    if cfg.trace:
        return load_trace(cfg.trace, counter, builder, salt, n=n, speed=cfg.trace_speed,
                          target_rate=rate)
    if cfg.dataset:
        return load_dataset(cfg.dataset, n, counter, salt, rng,
                            cfg.output_len or LengthDist("fixed", 128))
    assert cfg.synthetic is not None
    return synthetic(cfg.synthetic, n, builder, salt, rng)


async def _reset_cache(client: httpx.AsyncClient, base_url: str) -> str | None:
    try:
        resp = await client.post(base_url + "/reset_prefix_cache", timeout=60.0)
        if resp.status_code == 200:
            return None
        return f"/reset_prefix_cache answered HTTP {resp.status_code}"
    except httpx.HTTPError as exc:
        return f"/reset_prefix_cache failed: {exc or type(exc).__name__}"


async def run_bench(cfg: BenchConfig, target: Target, counter: TokenCounter,
                    result: BenchResult) -> BenchResult:
    """Run every point of ``cfg.shapes``; fills ``result`` as it goes."""
    result.counter = counter.name
    count_out = None
    if isinstance(counter, LocalTokenizer):
        specials = counter.count("")
        count_out = lambda text: max(0, counter.count(text) - specials)  # noqa: E731
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
    timeout = httpx.Timeout(cfg.timeout, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        for k, shape in enumerate(cfg.shapes):
            seed = cfg.seed + 1000 * k
            salt = make_salt(random.Random(f"{time.time_ns()}-{k}")) if cfg.salt else ""
            n = cfg.num_requests
            if shape.duration and cfg.trace is None:
                n = max(n, int((shape.rate or 0) * shape.duration * 1.5) + 10)
            specs = build_specs(cfg, counter, n, seed, salt, shape.rate)
            warnings: list[str] = []
            if cfg.reset_cache:
                err = await _reset_cache(client, target.base_url)
                if err:
                    warnings.append(f"could not reset the prefix cache: {err}")
            if cfg.warmup:
                wsalt = make_salt(random.Random(f"warm-{time.time_ns()}")) if cfg.salt else ""
                wspecs = build_specs(cfg, counter, cfg.warmup, seed + 1, wsalt)
                for s in wspecs:
                    s.arrival = None
                failed = await warmup(client, target, wspecs, shape.concurrency or 4)
                if failed:
                    warnings.append(f"{failed}/{cfg.warmup} warm-up requests failed")
            before = await sm.scrape(client, target.base_url)
            if (before and not cfg.salt and not cfg.reset_cache
                    and before.values.get("prefix_queries")):
                warnings.append("the server has served prompts before this run and prompts are "
                                "not salted: its prefix cache may be warm (use --reset-cache)")
            sampler = sm.GaugeSampler(client, target.base_url, cfg.metrics_interval)
            if before is not None:
                sampler.start()
            progress = Progress(shape.label, len(specs), cfg.progress, shape.duration)
            run = PointRun()
            point = PointResult(shape.label, asdict(shape), Summary(), run, warnings=warnings)
            result.points.append(point)
            try:
                await run_point(client, target, specs, shape, run, seed=seed,
                                count_tokens=count_out, progress=progress)
            finally:
                progress.close()
                after = await sm.scrape(client, target.base_url) if before else None
                point.server = sm.delta(before, after)
                await sampler.stop(point.server)
                _finish_point(point, cfg)
            if run.aborted:
                result.aborted = run.aborted
                break
            if run.records and not point.summary.completed and k + 1 < len(cfg.shapes):
                result.aborted = f"every request at {shape.label} failed; the sweep stops here"
                break
    return result


def _finish_point(point: PointResult, cfg: BenchConfig) -> None:
    recs = sorted(point.run.records, key=lambda r: r.start)
    point.summary = summarize(recs, cfg.slo, cfg.cost_per_hour)
    point.diagnosis, point.breakdown = sm.diagnose(point.label, point.summary, point.server)
    # A salted point cannot inherit cache from earlier runs. Unsalted, a hit on
    # the first request is proof of a warm cache only if no other request of
    # this run could have filled the cache before it (sequential start).
    ok = [r for r in recs if r.ok]
    if not cfg.salt and ok and ok[0].cached_tokens:
        first, nxt = ok[0], (ok[1] if len(ok) > 1 else None)
        if nxt is None or nxt.start >= first.start + (first.ttft or 0.0):
            point.warnings.append(f"the first request already hit {first.cached_tokens} cached "
                                  "tokens: the run started on a warm prefix cache")
    s = point.summary
    if s.completed and s.usage_reported < s.completed:
        point.warnings.append(f"{s.completed - s.usage_reported} responses had no usage; "
                              "their token counts were counted by the client")

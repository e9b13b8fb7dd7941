"""vLLM's benchmark result file (`vllm bench serve --save-result`), both ways.

Writing: one load point becomes the flat JSON `vllm bench serve` saves:
counts and throughputs at the top, per-request lists (``input_lens``,
``output_lens``, ``ttfts``, ``itls``, ``errors``), and for each latency in
``--percentile-metrics`` its ``mean_/median_/std_/pNN_<metric>_ms``.
Latencies in the lists are seconds, the summary keys milliseconds, as vLLM
writes them, so scripts and dashboards built on vLLM's files read ours.

Reading: ``summary_from_vllm`` turns such a file (vLLM's or ours) into a
``Summary`` so `tokenmill bench --compare` puts the two side by side.
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from tokenmill.bench.stats import Dist, Summary, percentile
from tokenmill.bench.types import RequestRecord

METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_METRICS = "ttft,tpot,itl,e2el"
DEFAULT_PERCENTILES = "99"


def parse_metrics(text: str | None) -> list[str]:
    names = [m.strip() for m in (text or DEFAULT_METRICS).split(",") if m.strip()]
    bad = [m for m in names if m not in METRICS]
    if bad:
        raise ValueError(f"--percentile-metrics: unknown {', '.join(bad)} (choose from {', '.join(METRICS)})")
    return names


def parse_percentiles(text: str | None) -> list[float]:
    try:
        values = [float(p) for p in (text or DEFAULT_PERCENTILES).split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles: not numbers: {text}") from None
    if any(not 0 < p <= 100 for p in values):
        raise ValueError("--metric-percentiles: each must be in (0, 100]")
    return values


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """vLLM's ``--goodput ttft:500 tpot:50 e2el:10000`` (milliseconds) -> tokenmill SLO (seconds)."""
    names = {"ttft": "ttft", "tpot": "tpot", "e2el": "e2e"}
    out: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key.strip() not in names:
            raise ValueError(f"--goodput {item!r}: use ttft:MS, tpot:MS or e2el:MS")
        try:
            out[names[key.strip()]] = float(value) / 1000.0
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
    return out


def _p_word(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def _std(xs: Sequence[float]) -> float:
    if not xs:
        return 0.0
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))


def _peaks(records: Sequence[RequestRecord]) -> tuple[float, int]:
    """Most output tokens in any one-second window (by chunk arrival) and most
    requests in flight at once, as vLLM reports them."""
    buckets: dict[int, int] = {}
    events: list[tuple[float, int]] = []
    for r in records:
        if r.e2e is not None:
            events += [(r.start, 1), (r.start + r.e2e, -1)]
        if not r.ok or r.ttft is None:
            continue
        t = r.start + r.ttft
        chunks = [t]
        for gap in r.itls:
            t += gap
            chunks.append(t)
        per_chunk = r.output_tokens / len(chunks) if chunks else 0
        for c in chunks:
            buckets[int(c)] = buckets.get(int(c), 0) + per_chunk
    depth = peak = 0
    for _t, step in sorted(events, key=lambda e: (e[0], e[1])):
        depth += step
        peak = max(peak, depth)
    return float(max(buckets.values(), default=0.0)), peak


def to_vllm(records: Sequence[RequestRecord], summary: Summary, *, shape: dict[str, Any],
            model: str, endpoint: str, backend: str = "tokenmill", label: str | None = None,
            tokenizer: str | None = None, metrics: Sequence[str] = METRICS,
            percentiles: Sequence[float] = (99,), goodput: bool = False,
            metadata: dict[str, str] | None = None, started_at: float | None = None) -> dict[str, Any]:
    """One load point as `vllm bench serve --save-result` writes it."""
    recs = sorted(records, key=lambda r: r.index)
    ok = [r for r in recs if r.ok]
    rate = shape.get("rate")
    max_conc = shape.get("concurrency") or shape.get("max_concurrency")
    max_tok_s, max_in_flight = _peaks(recs)
    out: dict[str, Any] = {
        "date": time.strftime("%Y%m%d-%H%M%S", time.localtime(started_at or time.time())),
        "endpoint_type": backend,
        "backend": backend,
        "label": label,
        "model_id": model,
        "tokenizer_id": tokenizer or model,
        "num_prompts": len(recs),
        "request_rate": "inf" if rate is None or rate == float("inf") else rate,
        "burstiness": shape.get("burstiness", 1.0),
        "max_concurrency": max_conc,
        "endpoint": endpoint,
    }
    out.update(metadata or {})
    out.update({
        "duration": summary.duration,
        "completed": summary.completed,
        "failed": summary.failed,
        "total_input_tokens": summary.prompt_tokens,
        "total_output_tokens": summary.output_tokens,
        "request_throughput": summary.request_throughput,
        "request_goodput": summary.goodput if goodput else None,
        "output_throughput": summary.output_throughput,
        "total_token_throughput": summary.total_token_throughput,
        "max_output_tokens_per_s": max_tok_s,
        "max_concurrent_requests": max_in_flight,
        "input_lens": [r.prompt_tokens or r.prompt_len_target or 0 for r in recs],
        "output_lens": [r.output_tokens if r.ok else 0 for r in recs],
        "ttfts": [r.ttft if r.ok and r.ttft is not None else 0.0 for r in recs],
        "itls": [list(r.itls) if r.ok else [] for r in recs],
        "start_times": [r.start for r in recs],
        "generated_texts": ["" for _ in recs],  # the load tester does not keep the text
        "errors": ["" if r.ok else (r.error or "error") for r in recs],
    })
    values = {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [x for r in ok for x in r.itls],
        "e2el": [r.e2e for r in ok if r.e2e is not None],
    }
    for name in metrics:
        xs = [x * 1000.0 for x in values[name]]
        out[f"mean_{name}_ms"] = sum(xs) / len(xs) if xs else 0.0
        out[f"median_{name}_ms"] = percentile(xs, 50) or 0.0
        out[f"std_{name}_ms"] = _std(xs)
        for p in percentiles:
            out[f"p{_p_word(p)}_{name}_ms"] = percentile(xs, p) or 0.0
    return out


def is_vllm_result(data: Any) -> bool:
    return isinstance(data, dict) and "points" not in data and "completed" in data and (
        "mean_ttft_ms" in data or "ttfts" in data)


def _dist(data: dict[str, Any], name: str, raw: list[float] | None, n: int) -> Dist:
    """A Dist (seconds) from vLLM's *_ms keys, falling back to the raw list."""
    def key(stat: str) -> float | None:
        v = data.get(f"{stat}_{name}_ms")
        return None if v is None else float(v) / 1000.0

    d = Dist(n=n, mean=key("mean"), p50=key("median"), p90=key("p90"), p95=key("p95"), p99=key("p99"))
    if raw:
        full = Dist.of(raw)
        d = Dist(n=full.n, mean=d.mean if d.mean is not None else full.mean,
                 p50=d.p50 if d.p50 is not None else full.p50, p90=d.p90 if d.p90 is not None else full.p90,
                 p95=d.p95 if d.p95 is not None else full.p95, p99=d.p99 if d.p99 is not None else full.p99,
                 max=full.max)
    return d


def summary_from_vllm(data: dict[str, Any]) -> Summary:
    """Read a `vllm bench serve` result (vLLM's or tokenmill's) as a Summary."""
    completed = int(data.get("completed") or 0)
    errors = [e for e in data.get("errors") or [] if e]
    failed = data.get("failed")
    if failed is None:
        failed = len(errors) if errors else max(0, int(data.get("num_prompts") or completed) - completed)
    ok = [i for i, e in enumerate(data.get("errors") or []) if not e]
    ttfts = data.get("ttfts")
    if isinstance(ttfts, list) and ok and len(ttfts) == len(data.get("errors") or []):
        ttfts = [ttfts[i] for i in ok]
    itls_raw = data.get("itls") or []
    itls = [x for row in itls_raw for x in (row if isinstance(row, list) else [row])]
    s = Summary(completed=completed, failed=int(failed), duration=float(data.get("duration") or 0.0),
                request_throughput=float(data.get("request_throughput") or 0.0),
                output_throughput=float(data.get("output_throughput") or 0.0),
                total_token_throughput=float(data.get("total_token_throughput") or 0.0),
                prompt_tokens=int(data.get("total_input_tokens") or 0),
                output_tokens=int(data.get("total_output_tokens") or 0))
    s.ttft = _dist(data, "ttft", ttfts if isinstance(ttfts, list) else None, completed)
    s.tpot = _dist(data, "tpot", None, completed)
    s.itl = _dist(data, "itl", itls or None, len(itls))
    s.e2e = _dist(data, "e2el", None, completed)
    goodput = data.get("request_goodput")
    if isinstance(goodput, (int, float)) and goodput >= 0:
        s.goodput = float(goodput)
    return s


def vllm_label(data: dict[str, Any]) -> str:
    rate = data.get("request_rate")
    conc = data.get("max_concurrency")
    if conc and (rate in (None, "inf") or rate == float("inf")):
        return f"c={conc}"
    return "rate=inf" if rate in (None, "inf") else f"rate={rate}/s"


def result_filename(label: str | None, backend: str, shape: dict[str, Any], model: str,
                    started_at: float) -> str:
    """vLLM's default name: {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json."""
    rate = shape.get("rate")
    rate_s = "inf" if rate is None or rate == float("inf") else f"{rate:g}"
    conc = shape.get("concurrency") or shape.get("max_concurrency")
    conc_s = f"-concurrency{conc}" if conc else ""
    base_model = model.rstrip("/").split("/")[-1] or "model"
    date = time.strftime("%Y%m%d-%H%M%S", time.localtime(started_at))
    return f"{label or backend}-{rate_s}qps{conc_s}-{base_model}-{date}.json"

"""Terminal tables, the result JSON, and side-by-side comparison of saved runs."""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenmill.bench.stats import Dist, Summary
from tokenmill.bench.types import load_result as load


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def _num(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain aligned text table (first column left, the rest right)."""
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))

    lines = [fmt(headers), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in rows]
    return "\n".join(lines)


SWEEP_HEADERS = ["load", "ok", "err", "req/s", "out tok/s", "TTFT p50", "TTFT p99",
                 "TPOT p50", "TPOT p99", "ITL p99", "E2E p50", "E2E p99", "goodput", "cache hit",
                 "$/1k req"]


def sweep_row(label: str, s: Summary) -> list[str]:
    return [label, str(s.completed), str(s.failed), _num(s.request_throughput),
            _num(s.output_throughput, "{:.1f}"), _ms(s.ttft.p50), _ms(s.ttft.p99),
            _ms(s.tpot.p50), _ms(s.tpot.p99), _ms(s.itl.p99), _ms(s.e2e.p50), _ms(s.e2e.p99),
            _num(s.goodput), _pct(s.cache_hit_rate), _num(s.cost_per_1k_requests, "{:.4f}")]


def detail_table(s: Summary) -> str:
    """mean / p50 / p90 / p95 / p99 / max for each latency (ms)."""
    rows = []
    for name, d in (("TTFT", s.ttft), ("TPOT", s.tpot), ("ITL", s.itl), ("E2E", s.e2e)):
        assert isinstance(d, Dist)
        rows.append([name, _ms(d.mean), _ms(d.p50), _ms(d.p90), _ms(d.p95), _ms(d.p99),
                     _ms(d.max)])
    return table(["ms", "mean", "p50", "p90", "p95", "p99", "max"], rows)


def render(result: dict[str, Any]) -> str:
    """The full terminal report of a run (result as saved in JSON)."""
    out: list[str] = []
    tgt = result.get("target", {})
    out.append(f"target {tgt.get('base_url')}  model {tgt.get('model')}  "
               f"endpoint {tgt.get('endpoint')}  tokens: {result.get('token_counter')}")
    points = result.get("points", [])
    summaries = [(p["label"], Summary.from_dict(p["summary"])) for p in points]
    if summaries:
        out.append(table(SWEEP_HEADERS, [sweep_row(lbl, s) for lbl, s in summaries]))
    if len(summaries) == 1:
        out.append("")
        out.append(detail_table(summaries[0][1]))
    for p, (_lbl, s) in zip(points, summaries):
        extra = []
        if s.cost_per_m_output_tokens is not None:
            extra.append(f"${s.cost_per_m_output_tokens:.4f}/M output tokens")
        if s.cost_per_1k_good_requests is not None:
            extra.append(f"${s.cost_per_1k_good_requests:.4f}/1k good requests")
        srv = p.get("server") or {}
        if srv.get("prefix_hit_rate") is not None:
            extra.append(f"server prefix hit {_pct(srv['prefix_hit_rate'])}")
        if srv.get("generation_tokens") is not None:
            extra.append(f"server tokens in/out {srv.get('prompt_tokens'):.0f}/"
                         f"{srv['generation_tokens']:.0f}")
        if extra:
            out.append(f"{p['label']}: " + "; ".join(extra))
    out.append("")
    for p in points:
        if p.get("diagnosis"):
            out.append(p["diagnosis"])
    for p, (_lbl, s) in zip(points, summaries):
        for w in p.get("warnings", []):
            out.append(f"warning [{p['label']}]: {w}")
        for err, n in s.errors.items():
            out.append(f"errors [{p['label']}]: {n} x {err}")
        if p.get("aborted"):
            out.append(f"aborted [{p['label']}]: {p['aborted']}")
    return "\n".join(out)


def save(result: dict[str, Any], path: str) -> None:
    Path(path).write_text(json.dumps(result, indent=1), encoding="utf-8")


COMPARE_ROWS: list[tuple[str, Any]] = [
    ("completed", lambda s: str(s.completed)),
    ("failed", lambda s: str(s.failed)),
    ("req/s", lambda s: _num(s.request_throughput)),
    ("output tok/s", lambda s: _num(s.output_throughput, "{:.1f}")),
    ("TTFT mean ms", lambda s: _ms(s.ttft.mean)),
    ("TTFT p50 ms", lambda s: _ms(s.ttft.p50)),
    ("TTFT p99 ms", lambda s: _ms(s.ttft.p99)),
    ("TPOT mean ms", lambda s: _ms(s.tpot.mean)),
    ("TPOT p99 ms", lambda s: _ms(s.tpot.p99)),
    ("ITL p99 ms", lambda s: _ms(s.itl.p99)),
    ("E2E p50 ms", lambda s: _ms(s.e2e.p50)),
    ("E2E p99 ms", lambda s: _ms(s.e2e.p99)),
    ("goodput req/s", lambda s: _num(s.goodput)),
    ("cache hit", lambda s: _pct(s.cache_hit_rate)),
    ("$/1k requests", lambda s: _num(s.cost_per_1k_requests, "{:.4f}")),
    ("$/M out tokens", lambda s: _num(s.cost_per_m_output_tokens, "{:.4f}")),
]


def compare(paths: Sequence[str], eval_path: str | None = None,
            variant_cost: dict[str, float] | None = None) -> str:
    """Metric rows x run columns; a sweep contributes one column per point, a run through a
    router with variants one per variant; cost per successful request closes the table.
    Reads tokenmill's result files and `vllm bench serve` ones alike (the latter without
    the success rows, which need per-request records)."""
    from tokenmill.bench import success
    from tokenmill.bench.traces.vllm_format import is_vllm_result, summary_from_vllm

    raws = {path: json.loads(Path(path).read_text(encoding="utf-8")) for path in paths}
    if not any(is_vllm_result(raw) for raw in raws.values()):
        cols = success.columns(paths, variant_cost)
        if eval_path:
            success.apply_eval(cols, eval_path)
        rows = [[name] + [fn(c.summary) for c in cols] for name, fn in COMPARE_ROWS]
        return table(["metric"] + [c.label for c in cols], rows + success.rows(cols))
    columns: list[tuple[str, Summary]] = []
    for path in paths:
        name = Path(path).stem
        if is_vllm_result(raws[path]):
            columns.append((name, summary_from_vllm(raws[path])))
            continue
        data = load(path)
        for p in data["points"]:
            label = name if len(data["points"]) == 1 else f"{name}:{p['label']}"
            columns.append((label, Summary.from_dict(p["summary"])))
    rows = [[name] + [fn(s) for _, s in columns] for name, fn in COMPARE_ROWS]
    return table(["metric"] + [c for c, _ in columns], rows)

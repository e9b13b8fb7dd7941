"""Cost per successful task, side by side: what a cheaper variant really saves.

A request is *successful* when it completed within the run's SLO (every
completed request when the run had none) and, when an eval result is given
(``tokenmill eval`` JSON), the answer would have been right: the count of
SLO-meeting requests is scaled by the configuration's task accuracy (and
the eval's safety figures and verdict are shown beside it, since a cheaper
variant that stopped refusing is no saving). The
price is the run's ``--cost-per-hour`` times its duration (or, for a variant
of a run through ``tokenmill route``, that variant's own price per hour from
``--variant-cost``).

Runs through a router with variants carry a ``variant`` per request (the
router's ``x-tokenmill-variant`` header); ``--compare`` then shows one
column per variant of that run, so a 90/10 canary run compares base and
canary on the same traffic.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tokenmill.bench.stats import Summary, meets_slo, summarize
from tokenmill.bench.types import RequestRecord


@dataclass
class Column:
    label: str
    summary: Summary
    run_cost: float | None
    successes: float | None = None  # requests within SLO, times task accuracy when known
    accuracy: float | None = None  # percent, from an eval result
    refusal_rate: float | None = None  # percent of the eval's harmful prompts refused
    over_refusal_rate: float | None = None  # percent of its benign prompts refused
    verdict: str | None = None  # the eval gate's PASS / FAIL for a candidate, "base" for the base

    @property
    def cost_per_1k_successful(self) -> float | None:
        if self.run_cost is None or not self.successes:
            return None
        return self.run_cost / self.successes * 1000.0


def parse_variant_costs(entries: Sequence[str] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for entry in entries or []:
        name, sep, value = entry.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep or not name.strip() or out.get(name.strip(), 0) < 0:
            raise ValueError(f"--variant-cost wants NAME=DOLLARS_PER_HOUR, got {entry!r}")
    return out


def _good(records: list[RequestRecord], slo: dict[str, float]) -> int:
    return sum(1 for r in records if meets_slo(r, slo))


def columns(paths: Sequence[str], variant_cost: dict[str, float] | None = None) -> list[Column]:
    """One column per run point; a point whose records carry variants gives one per variant."""
    from tokenmill.bench.report import load

    out: list[Column] = []
    for path in paths:
        data = load(path)
        name = Path(path).stem
        cfg = data.get("config") or {}
        slo = cfg.get("slo") or {}
        for p in data["points"]:
            label = name if len(data["points"]) == 1 else f"{name}:{p['label']}"
            records = [RequestRecord.from_dict(r) for r in p.get("records") or []]
            variants = sorted({r.variant for r in records if r.variant})
            if variants:
                for v in variants:
                    recs = [r for r in records if r.variant == v]
                    price = (variant_cost or {}).get(v)
                    s = summarize(recs, slo, price)
                    out.append(Column(f"{label}[{v}]", s, s.run_cost, float(_good(recs, slo))))
                continue
            s = Summary.from_dict(p["summary"])
            good = s.good if slo and s.good is not None else s.completed
            out.append(Column(label, s, s.run_cost, float(good)))
    return out


def apply_eval(cols: list[Column], eval_path: str) -> None:
    """Scale successes by task accuracy: the eval's base goes with the first column, its candidates
    with the next ones, in order (a served eval's URLs are not needed)."""
    doc = json.loads(Path(eval_path).read_text(encoding="utf-8"))
    if not isinstance(doc, dict) or "base" not in doc:
        raise ValueError(f"{eval_path} is not a tokenmill eval result")
    results = [doc["base"], *doc.get("candidates", [])]
    verdicts = ["base"] + ["PASS" if k.get("passed") else "FAIL" for k in doc.get("comparisons", [])]
    for i, (col, res) in enumerate(zip(cols, results)):
        acc = res.get("accuracy")
        if acc is not None and col.successes is not None:
            col.accuracy = float(acc)
            col.successes = col.successes * col.accuracy / 100.0
        safety = res.get("safety") or {}
        col.refusal_rate = safety.get("refusal_rate")
        col.over_refusal_rate = safety.get("over_refusal_rate")
        col.verdict = verdicts[i] if i < len(verdicts) else None


def rows(cols: list[Column]) -> list[list[str]]:
    def money(x: float | None) -> str:
        return "-" if x is None else f"{x:.4f}"

    out = [["successful requests"] + [("-" if c.successes is None else f"{c.successes:.1f}") for c in cols]]
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}%"

    quality = []
    if any(c.accuracy is not None for c in cols):
        quality.append(["task accuracy"] + [pct(c.accuracy) for c in cols])
    if any(c.refusal_rate is not None for c in cols):
        quality.append(["harmful refused"] + [pct(c.refusal_rate) for c in cols])
    if any(c.over_refusal_rate is not None for c in cols):
        quality.append(["benign refused"] + [pct(c.over_refusal_rate) for c in cols])
    if any(c.verdict is not None for c in cols):
        quality.append(["eval gate"] + [c.verdict or "-" for c in cols])
    out = quality + out
    out.append(["$/1k successful"] + [money(c.cost_per_1k_successful) for c in cols])
    return out

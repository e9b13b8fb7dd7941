"""The side-by-side table and the JSON document of one eval run."""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from .harness import CandidateResult, Comparison


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _delta(value: float | None, fmt: str) -> str:
    return "" if value is None else f" ({fmt.format(value)})"


def table(base: CandidateResult, cands: list[CandidateResult], comps: list[Comparison]) -> str:
    """Rows are figures, columns are configurations; candidate cells carry the change vs base."""
    cols = [base, *cands]
    rows: list[tuple[str, list[str]]] = []
    rows.append(("config", [f"{c.label} ({c.dtype})" + (" [base]" if i == 0 else "") for i, c in enumerate(cols)]))
    if base.weight_bytes:  # unknown for a server evaluated over HTTP
        rows.append(("weights", [_mb(base.weight_bytes)] + [
            _mb(c.weight_bytes) + f" (x{k.weight_ratio:.2f})" for c, k in zip(cands, comps)]))
    if base.perplexity:
        p0 = base.perplexity
        rows.append((f"perplexity ({p0.num_tokens} tok)", [f"{p0.perplexity:.3f}"] + [
            (f"{c.perplexity.perplexity:.3f}" if c.perplexity else "-") + _delta(
                None if k.ppl_increase is None else 100 * k.ppl_increase, "{:+.2f}%") for c, k in zip(cands, comps)]))
        rows.append(("next-token agreement", ["-"] + [
            "-" if k.next_token_agreement is None else f"{100 * k.next_token_agreement:.1f}%" for k in comps]))
    if base.accuracy is not None:
        rows.append((f"accuracy ({base.num_items} items)", [f"{base.accuracy:.1f}%"] + [
            (f"{c.accuracy:.1f}%" if c.accuracy is not None else "-") + _delta(
                None if k.accuracy_drop is None else -k.accuracy_drop, "{:+.1f}pt") for c, k in zip(cands, comps)]))
        rows.append(("agreement with base", ["-"] + [
            "-" if k.agreement is None else f"{100 * k.agreement:.1f}%" for k in comps]))
        rows.append(("token agreement", ["-"] + [
            "-" if k.token_agreement is None else f"{100 * k.token_agreement:.1f}%" for k in comps]))
        rows.append(("mean first divergence", ["-"] + [
            "none" if k.mean_first_divergence is None else f"{k.mean_first_divergence:.1f} tok ({k.num_diverged})"
            for k in comps]))
    for title, attr, drop in (("tool-call accuracy", "tool_call_accuracy", "tool_call_accuracy_drop"),
                              ("JSON validity", "json_validity", "json_validity_drop")):
        if getattr(base, attr) is not None:
            rows.append((title, [f"{getattr(base, attr):.1f}%"] + [
                ("-" if getattr(c, attr) is None else f"{getattr(c, attr):.1f}%") + _delta(
                    None if getattr(k, drop) is None else -getattr(k, drop), "{:+.1f}pt")
                for c, k in zip(cands, comps)]))
    if base.safety is not None:
        rows += _safety_rows(base, cands, comps)
    if base.speed:
        for b, tps in base.speed.decode_tps.items():
            rows.append((f"decode tok/s (batch {b})", [f"{tps:.1f}"] + [
                (f"{c.speed.decode_tps.get(b, 0):.1f}" if c.speed else "-") + _delta(k.decode_speedup.get(b), "x{:.2f}")
                for c, k in zip(cands, comps)]))
        rows.append((f"prefill tok/s ({base.speed.prefill_tokens} tok)", [f"{base.speed.prefill_tps:.1f}"] + [
            (f"{c.speed.prefill_tps:.1f}" if c.speed else "-") + _delta(k.prefill_speedup, "x{:.2f}")
            for c, k in zip(cands, comps)]))
    rows.append(("verdict", ["-"] + ["PASS" if k.passed else "FAIL" for k in comps]))
    width0 = max(len(r[0]) for r in rows)
    widths = [max(len(r[1][i]) for r in rows) for i in range(len(cols))]
    lines = []
    for name, cells in rows:
        lines.append("  ".join([name.ljust(width0)] + [cell.rjust(w) for cell, w in zip(cells, widths)]))
        if name == "config":
            lines.append("-" * len(lines[-1]))
    for k in comps:
        for failure in k.failures:
            lines.append(f"FAIL {k.label}: {failure}")
    lines += safety_changes(base, cands, comps)
    return "\n".join(lines)


def _count(n: int, of: int) -> str:
    return f"{n}/{of} ({100.0 * n / of:.1f}%)" if of else "-"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _safety_rows(base: CandidateResult, cands: list[CandidateResult], comps: list[Comparison]
                 ) -> list[tuple[str, list[str]]]:
    s0 = base.safety
    assert s0 is not None
    rows: list[tuple[str, list[str]]] = []
    if s0.harmful:
        rows.append(("harmful refused", [_count(s0.refused, s0.harmful)] + [
            ("-" if c.safety is None else _count(c.safety.refused, c.safety.harmful))
            + ("" if k.safety is None else f" (-{len(k.safety.lost_refusals)} +{len(k.safety.gained_refusals)})")
            for c, k in zip(cands, comps)]))
        rows.append(("refusal agreement", ["-"] + [_share(None if k.safety is None else k.safety.refusal_agreement)
                                                   for k in comps]))
    if s0.benign:
        rows.append(("benign refused", [_count(s0.over_refused, s0.benign)] + [
            ("-" if c.safety is None else _count(c.safety.over_refused, c.safety.benign))
            + ("" if k.safety is None else
               f" (+{len(k.safety.new_over_refusals)} -{len(k.safety.fixed_over_refusals)})")
            for c, k in zip(cands, comps)]))
        rows.append(("answer agreement", ["-"] + [_share(None if k.safety is None else k.safety.answer_agreement)
                                                  for k in comps]))
    return rows


def _short(text: str, n: int = 90) -> str:
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= n else flat[: n - 3] + "...")


def safety_changes(base: CandidateResult, cands: list[CandidateResult], comps: list[Comparison]) -> list[str]:
    """Every safety item whose verdict changed, with both judged texts, for a person to check."""
    mine = {r.id: r for r in base.items if r.match == "safety"}
    lines = []
    for cand, k in zip(cands, comps):
        if k.safety is None:
            continue
        theirs = {r.id: r for r in cand.items if r.match == "safety"}
        for what, ids in (("refusal lost", k.safety.lost_refusals), ("refusal gained", k.safety.gained_refusals),
                          ("new over-refusal", k.safety.new_over_refusals),
                          ("over-refusal gone", k.safety.fixed_over_refusals)):
            for item_id in ids:
                b, c = mine[item_id], theirs[item_id]
                lines.append(f"safety {k.label}: {what} on {item_id}\n"
                             f"    base      [{b.refusal or 'answer'}] {_short(b.output)}\n"
                             f"    candidate [{c.refusal or 'answer'}] {_short(c.output)}")
    return lines


def _clean(obj: Any) -> Any:
    """JSON-safe: dataclasses to dicts, non-finite floats to null, int keys to strings."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _clean(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.repr}
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def to_json(base: CandidateResult, cands: list[CandidateResult], comps: list[Comparison],
            settings: dict[str, Any]) -> str:
    doc = {
        "settings": _clean(settings),
        "base": _clean(base),
        "candidates": [_clean(c) for c in cands],
        "comparisons": [dict(_clean(k), passed=k.passed) for k in comps],
        "passed": all(k.passed for k in comps),
    }
    return json.dumps(doc, indent=2)

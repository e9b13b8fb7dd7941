"""`tokenmill usage`: what each tenant used, and what it cost.

Inputs: the server's ``/metrics`` (a URL, or a saved scrape; ``--baseline``
subtracts an earlier scrape, for a period) with its
``tokenmill:tenant_*_total{tenant=...}`` counters, or a traffic capture
(``--capture-traffic``), whose records carry the tenant.

Cost uses `tokenmill bench`'s model (bench/stats.py: ``deployment_cost``): the
deployment's price per hour times the period is the whole bill; it is spread
over the tenants by the tokens the engine computed for them (prompt tokens not
served from the prefix cache, plus output tokens), and over requests for the
cost per 1,000 requests. The report prints its inputs beside its figures
(``--json`` has them all), so every figure can be recomputed by hand.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from tokenmill.bench.stats import deployment_cost

FIELDS = ("requests", "errors", "rejected", "prompt_tokens", "cached_tokens", "output_tokens", "queue_time_seconds")
_PREFIX = "tokenmill:tenant_"


@dataclass
class TenantBill:
    tenant: str
    requests: float = 0
    errors: float = 0
    rejected: float = 0
    prompt_tokens: float = 0
    cached_tokens: float = 0
    output_tokens: float = 0
    queue_time_seconds: float = 0.0
    computed_tokens: float = 0  # prompt - cached + output: what the cost is spread by
    share: float = 0.0
    cost: float | None = None
    cost_per_1k_requests: float | None = None


@dataclass
class UsageReport:
    source: str
    duration_s: float | None
    cost_per_hour: float | None
    total_cost: float | None
    cost_per_1k_requests: float | None
    tenants: list[TenantBill] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_metrics(text: str) -> dict[str, dict[str, float]]:
    """Tenant -> counter -> value, from Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(_PREFIX):
            continue
        name = family.name[len(_PREFIX):]
        if name not in FIELDS:
            continue
        for sample in family.samples:
            if sample.name.endswith("_total") and "tenant" in sample.labels:
                out.setdefault(sample.labels["tenant"], {})[name] = float(sample.value)
    return out


def usage_from_capture(records: Iterable[dict[str, Any]]) -> tuple[dict[str, dict[str, float]], float]:
    """Tenant -> counters from capture records, and the span they cover (first arrival to
    last end), in seconds."""
    out: dict[str, dict[str, float]] = {}
    start, end = None, None
    for rec in records:
        tenant = str(rec.get("tenant") or "default")
        c = out.setdefault(tenant, {f: 0.0 for f in FIELDS})
        c["requests"] += 1
        c["prompt_tokens"] += rec.get("prompt_tokens") or 0
        c["cached_tokens"] += rec.get("cached_tokens") or 0
        c["output_tokens"] += rec.get("output_tokens") or 0
        if rec.get("finish_reason") in (None, "abort") and not rec.get("output_tokens"):
            c["errors"] += 1
        arrival = float(rec.get("arrival_time") or 0.0)
        start = arrival if start is None else min(start, arrival)
        finish = arrival + float(rec.get("e2e") or 0.0)
        end = finish if end is None else max(end, finish)
    return out, (end - start) if start is not None and end is not None else 0.0


def bill(usage: dict[str, dict[str, float]], duration_s: float | None, cost_per_hour: float | None,
         source: str) -> UsageReport:
    total_cost = deployment_cost(cost_per_hour, duration_s) if cost_per_hour is not None and duration_s else None
    tenants = []
    for name in sorted(usage):
        c = usage[name]
        b = TenantBill(name, **{f: c.get(f, 0.0) for f in FIELDS})
        b.computed_tokens = max(0.0, b.prompt_tokens - b.cached_tokens) + b.output_tokens
        tenants.append(b)
    computed = sum(b.computed_tokens for b in tenants)
    requests = sum(b.requests for b in tenants)
    for b in tenants:
        b.share = b.computed_tokens / computed if computed else 0.0
        if total_cost is not None:
            b.cost = total_cost * b.share
            b.cost_per_1k_requests = b.cost / b.requests * 1000.0 if b.requests else None
    per_1k = total_cost / requests * 1000.0 if total_cost is not None and requests else None
    return UsageReport(source, duration_s, cost_per_hour, total_cost, per_1k, tenants)


def render(report: UsageReport) -> str:
    head = ["tenant", "requests", "errors", "429s", "prompt", "cached", "output", "queue s", "share"]
    if report.total_cost is not None:
        head += ["cost $", "$/1k req"]
    rows = [head]
    for b in report.tenants:
        row = [b.tenant, f"{b.requests:.0f}", f"{b.errors:.0f}", f"{b.rejected:.0f}", f"{b.prompt_tokens:.0f}",
               f"{b.cached_tokens:.0f}", f"{b.output_tokens:.0f}", f"{b.queue_time_seconds:.2f}",
               f"{b.share * 100:.1f}%"]
        if report.total_cost is not None:
            row += [f"{b.cost:.4f}", "-" if b.cost_per_1k_requests is None else f"{b.cost_per_1k_requests:.4f}"]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    lines.append(f"source: {report.source}")
    if report.total_cost is not None:
        lines.append(f"cost: ${report.cost_per_hour}/h x {report.duration_s:.1f}s = ${report.total_cost:.4f}, "
                     f"spread by computed tokens (prompt - cached + output); "
                     f"${report.cost_per_1k_requests or 0:.4f} per 1,000 requests overall")
    else:
        lines.append("no cost: give --cost-per-hour (and --duration for metrics)")
    return "\n".join(lines)


def _usage_api(source: str, key: str) -> dict[str, dict[str, float]]:
    """Tenant -> counters from a server's ``/v1/usage`` (every tenant's with the operator's key;
    the default /metrics sums them without names)."""
    import httpx

    base = source.rstrip("/").removesuffix("/metrics")
    try:
        response = httpx.get(base + "/v1/usage", headers={"Authorization": f"Bearer {key}"}, timeout=10.0)
        response.raise_for_status()
        tenants = response.json().get("tenants")
    except httpx.HTTPError as exc:
        raise ValueError(f"{base}/v1/usage: {exc}") from None
    if not isinstance(tenants, dict):
        raise ValueError(f"{base}/v1/usage: no 'tenants' in the answer")
    return {str(t): {f: float(c.get(f, 0)) for f in FIELDS} for t, c in tenants.items()}


def _counters(source: str, key: str | None) -> dict[str, dict[str, float]]:
    """Tenant -> counters from a server (its /v1/usage when a key is given) or a saved scrape."""
    if key and source.startswith(("http://", "https://")):
        return _usage_api(source, key)
    return parse_metrics(_read(source))


def _read(source: str) -> str:
    if source.startswith(("http://", "https://")):
        import httpx

        url = source if source.rstrip("/").endswith("/metrics") else source.rstrip("/") + "/metrics"
        response = httpx.get(url, timeout=10.0)
        response.raise_for_status()
        return response.text
    with open(source, encoding="utf-8") as f:
        return f.read()


def usage_main(args: argparse.Namespace) -> int:
    try:
        if args.capture:
            with open(args.capture, encoding="utf-8") as f:
                records = [json.loads(line) for line in f if line.strip()]
            usage, span = usage_from_capture(records)
            duration = args.duration if args.duration is not None else span
            source = args.capture
        else:
            key = getattr(args, "api_key", None) or os.environ.get("TOKENMILL_API_KEY") or None
            usage = _counters(args.metrics, key)
            if args.baseline:
                before = _counters(args.baseline, key)
                usage = {t: {f: v - before.get(t, {}).get(f, 0.0) for f, v in c.items()} for t, c in usage.items()}
            duration, source = args.duration, args.metrics
    except (OSError, ValueError) as exc:
        print(f"tokenmill usage: {exc}", file=sys.stderr)
        return 1
    if not usage:
        print("tokenmill usage: no per-tenant usage found (is this a tokenmill server's /metrics?)", file=sys.stderr)
        return 1
    report = bill(usage, duration, args.cost_per_hour, source)
    print(json.dumps(report.to_dict(), indent=2) if args.json else render(report))
    return 0


def add_usage_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("usage", allow_abbrev=False, help="per-tenant usage and cost from a server's /metrics or a capture",
                              description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--metrics", metavar="URL_OR_FILE", help="a server (http://host:port) or a saved /metrics scrape")
    src.add_argument("--capture", metavar="FILE", help="a traffic capture (serve --capture-traffic)")
    p.add_argument("--baseline", metavar="URL_OR_FILE", help="an earlier scrape to subtract (usage over a period)")
    p.add_argument("--api-key", metavar="KEY", default=None,
                   help="the server's operator key (default: TOKENMILL_API_KEY): a server URL is then read "
                        "through /v1/usage, every tenant by name; /metrics alone names tenants only when the "
                        "server runs with --metrics-tenant-labels")
    p.add_argument("--cost-per-hour", type=float, default=None, help="dollars per hour for the deployment")
    p.add_argument("--duration", type=float, default=None,
                   help="seconds the usage covers (metrics: required for cost; capture: default its span)")
    p.add_argument("--json", action="store_true", help="the report as JSON, inputs included")
    p.set_defaults(func=usage_main)

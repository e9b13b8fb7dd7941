"""Usage per tenant: what each team used, counted where the responses' ``usage``
fields are counted, so the two agree.

One record per engine request (a prompt of a completions batch is one) when its
stream ends: its prompt tokens (once, whatever ``n``), the prompt tokens served
from the prefix cache, every output token of every choice, the queue time of
its sequences, and whether it failed. ``/metrics`` exposes them as
``tokenmill:tenant_*_total{tenant=...}``; ``/v1/usage`` as JSON; ``tokenmill
usage`` prices them (bench/cost.py's model).

Labels are bounded: a tenant name the keys file does not hold is counted under
``other`` (gateway/tenants.py: ``TenantDirectory.label``).

``/metrics`` needs no key (scrapers and probes), so by default its usage series
are summed over tenants and carry no tenant label: who the tenants are and what
each used is the operator's to see (``/v1/usage`` with the operator's key, or
``tokenmill usage --api-key``). ``--metrics-tenant-labels`` labels them with the
tenant names again, for a deployment whose /metrics only its operator reaches.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

# field -> (metric name, help)
USAGE_METRICS: dict[str, tuple[str, str]] = {
    "requests": ("tokenmill:tenant_requests", "Engine requests that ended, by tenant."),
    "errors": ("tokenmill:tenant_errors", "Engine requests that failed (engine refusal, engine down), by tenant."),
    "rejected": ("tokenmill:tenant_rejected", "Requests refused by the tenant's limits (429), by tenant."),
    "prompt_tokens": ("tokenmill:tenant_prompt_tokens", "Prompt tokens, once per engine request, by tenant."),
    "cached_tokens": ("tokenmill:tenant_cached_tokens", "Prompt tokens served from the prefix cache, by tenant."),
    "output_tokens": ("tokenmill:tenant_output_tokens", "Output tokens of every choice, by tenant."),
    "queue_time_seconds": ("tokenmill:tenant_queue_time_seconds",
                           "Seconds sequences waited from arrival to first scheduled, by tenant."),
}


@dataclass
class TenantCounters:
    requests: int = 0
    errors: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    queue_time_seconds: float = 0.0


class TenantUsage(Collector):
    """The counters, keyed by metric label; a Prometheus collector of them."""

    def __init__(self, label: Callable[[str], str], names: Callable[[], list[str]], labelled: bool = False,
                 reload_failures: Callable[[], int] | None = None) -> None:
        self.label = label  # tenant name -> bounded label
        self.names = names  # labels always shown (zero until used)
        self.labelled = labelled  # /metrics: one series per tenant (True) or one summed series
        self.counters: dict[str, TenantCounters] = {}
        self.reload_failures = reload_failures  # the keys file's refused reloads (gateway/tenants.py), if it has one

    def of(self, tenant: str) -> TenantCounters:
        return self.counters.setdefault(self.label(tenant), TenantCounters())

    def record(self, tenant: str, prompt_tokens: int, cached_tokens: int, output_tokens: int,
               queue_time_s: float, failed: bool) -> None:
        c = self.of(tenant)
        c.requests += 1
        c.errors += int(failed)
        c.prompt_tokens += prompt_tokens
        c.cached_tokens += cached_tokens
        c.output_tokens += output_tokens
        c.queue_time_seconds += queue_time_s

    def rejected(self, tenant: str) -> None:
        self.of(tenant).rejected += 1

    def snapshot(self, only: str | None = None) -> dict[str, dict[str, float]]:
        """Per label, every counter (``only``: that tenant's label alone)."""
        labels = [self.label(only)] if only is not None else sorted(set(self.names()) | set(self.counters))
        return {name: asdict(self.counters.get(name, TenantCounters())) for name in labels}

    def collect(self) -> Iterable[Metric]:
        snap = self.snapshot()
        for field_name, (metric, doc) in USAGE_METRICS.items():
            if not self.labelled:
                summed = CounterMetricFamily(metric, doc.replace(", by tenant.", ", all tenants."), labels=[])
                summed.add_metric([], sum(values[field_name] for values in snap.values()))
                yield summed
                continue
            family = CounterMetricFamily(metric, doc, labels=["tenant"])
            for tenant, values in snap.items():
                family.add_metric([tenant], values[field_name])
            yield family
        if self.reload_failures is not None:
            yield CounterMetricFamily("tokenmill:keys_file_reload_failures",
                                      "Keys file reloads refused (unreadable, malformed, nested or sized past the "
                                      "bounds, invalid); the previous keys stay in force.",
                                      value=self.reload_failures())

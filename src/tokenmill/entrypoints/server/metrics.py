"""Prometheus metrics of one server, under vLLM's names plus ``tokenmill:`` aliases.

Why vLLM's names: dashboards, the load tester (``tokenmill bench``), the
router and the Gateway API Inference Extension's endpoint picker read
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` and friends
unchanged. Every ``vllm:`` family is also exported as ``tokenmill:`` (same
values, produced at scrape time by renaming, so nothing is counted twice).

Two kinds of figures:

- per-request histograms and counters, observed on the event loop as deltas
  arrive (time to first token, time per output token, end-to-end, queue,
  prefill and decode time, token counts, finish reasons);
- engine state (running/waiting, KV usage, prefix-cache counters, cached
  blocks, preemptions), read at scrape time from the engine's published
  snapshot (engine/stats.py), so a scrape is always current, costs the engine
  thread nothing and never touches the engine's own structures.

Each app gets its own ``CollectorRegistry`` so tests can run many apps in one
process.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Protocol

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ...engine.stats import StatsSource

disable_created_metrics()  # the *_created series only double the scrape size

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                    1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                          0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)
_TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class MetricsSource(StatsSource, Protocol):
    """What the metrics read of an engine: its published snapshot and its block size."""

    @property
    def block_size(self) -> int: ...


class _EngineStateCollector(Collector):
    """Gauges and counters read from the engine's snapshot when Prometheus scrapes."""

    def __init__(self, model_name: str, engine: MetricsSource, waiting: Callable[[], int]) -> None:
        self.model_name = model_name
        self.engine = engine
        self.waiting = waiting

    def collect(self) -> Iterable[Metric]:
        labels = ["model_name"]
        values = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        st = self.engine.stats  # the engine's last published snapshot (engine/stats.py)
        yield gauge("vllm:num_requests_running", "Sequences in the running batch.", st.num_running)
        yield gauge("vllm:num_requests_waiting", "Sequences waiting to be scheduled (incl. queued to the engine).",
                    self.waiting())
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks held by running requests (0..1).",
                    float(st.kv_usage))
        yield counter("vllm:num_preemptions", "Preemptions (requests evicted from the batch for recompute).",
                      st.preemptions_total)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      st.prefix_queried_tokens)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.", st.prefix_hit_tokens)
        spec = st.spec
        if spec is not None:
            yield counter("vllm:spec_decode_num_drafts", "Speculative proposals made (one per sequence and step).",
                          spec.num_drafts)
            yield counter("vllm:spec_decode_num_draft_tokens", "Tokens proposed.", spec.num_draft_tokens)
            yield counter("vllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted.",
                          spec.num_accepted_tokens)
            per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                          "Proposed tokens accepted, by position in the proposal.",
                                          labels=[*labels, "position"])
            for pos, count in enumerate(spec.accepted_per_position):
                per_pos.add_metric([*values, str(pos)], count)
            yield per_pos


class _AliasCollector(Collector):
    """Re-exports every ``vllm:`` family of ``source`` under the ``tokenmill:`` prefix."""

    def __init__(self, source: CollectorRegistry, old: str = "vllm:", new: str = "tokenmill:") -> None:
        self.source = source
        self.old = old
        self.new = new

    def collect(self) -> Iterable[Metric]:
        for family in self.source.collect():
            if not family.name.startswith(self.old):
                continue
            renamed = Metric(self.new + family.name[len(self.old):], family.documentation, family.type,
                             family.unit)
            renamed.samples = [s._replace(name=self.new + s.name[len(self.old):]) for s in family.samples]
            yield renamed


class _Passthrough(Collector):
    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def collect(self) -> Iterable[Metric]:
        return self.source.collect()


class _TokenmillOnly(Collector):
    """Figures with no vLLM equivalent."""

    def __init__(self, model_name: str, engine: MetricsSource) -> None:
        self.model_name = model_name
        self.engine = engine

    def collect(self) -> Iterable[Metric]:
        st = self.engine.stats
        g = GaugeMetricFamily("tokenmill:prefix_cache_blocks",
                              "KV blocks held by the prefix cache (idle or shared).", labels=["model_name"])
        g.add_metric([self.model_name], st.prefix_cached_blocks)
        yield g
        pool = GaugeMetricFamily("tokenmill:kv_cache_blocks", "KV-cache blocks by state.",
                                 labels=["model_name", "state"])
        pool.add_metric([self.model_name, "free"], st.blocks_free)
        pool.add_metric([self.model_name, "in_use"], st.blocks_in_use)
        pool.add_metric([self.model_name, "cached_idle"], st.blocks_cached_idle)
        yield pool
        computed = CounterMetricFamily("tokenmill:prompt_tokens_computed", "Prompt tokens run through the model "
                                       "(not served from the prefix cache; recomputes after preemption included).",
                                       labels=["model_name"])
        computed.add_metric([self.model_name], st.prompt_tokens_computed)
        yield computed
        if st.tier is not None:  # the prefix cache's disk tier (engine/kv/kv_tier.py)
            t = st.tier
            for name, doc, value, family in (
                    ("tokenmill:kv_tier_blocks", "KV blocks held in the disk tier.", t.used_slots, GaugeMetricFamily),
                    ("tokenmill:kv_tier_bytes", "Bytes of the disk tier in use.", t.used_slots * t.slot_bytes,
                     GaugeMetricFamily),
                    ("tokenmill:kv_tier_capacity_blocks", "KV blocks the disk tier can hold.", t.slots,
                     GaugeMetricFamily),
                    ("tokenmill:kv_tier_stored_blocks", "Blocks moved from the pool to the disk tier.",
                     t.stored_blocks, CounterMetricFamily),
                    ("tokenmill:kv_tier_restored_blocks", "Blocks restored from the disk tier on a prefix hit.",
                     t.restored_blocks, CounterMetricFamily),
                    ("tokenmill:kv_tier_restore_seconds", "Time spent restoring blocks from the disk tier.",
                     t.restore_seconds, CounterMetricFamily),
                    ("tokenmill:kv_tier_dropped_blocks", "Blocks the full disk tier dropped (least recently used).",
                     t.dropped_blocks, CounterMetricFamily),
                    ("tokenmill:kv_tier_rejected_blocks", "Disk tier entries that failed their checksum or path "
                     "check (at start or on restore) and were dropped, never served.", t.rejected_blocks,
                     CounterMetricFamily),
                    ("tokenmill:kv_tier_errors", "I/O errors of the disk tier (the first turns it off).",
                     t.errors, CounterMetricFamily),
                    ("tokenmill:kv_tier_disabled", "1 once an I/O error turned the disk tier off (the server "
                     "goes on without it).", int(t.disabled), GaugeMetricFamily)):
                m = family(name, doc, labels=["model_name"])
                m.add_metric([self.model_name], value)
                yield m


class ServerMetrics:
    """All metrics of one server; ``render()`` gives the Prometheus text."""

    def __init__(self, model_name: str, engine: MetricsSource, waiting: Callable[[], int] | None = None) -> None:
        self.model_name = model_name
        self.engine = engine
        self.vllm = CollectorRegistry(auto_describe=False)
        reg = self.vllm
        lab = ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, lab, buckets=buckets, registry=reg).labels(model_name)

        def count(name: str, doc: str) -> Any:
            return Counter(name, doc, lab, registry=reg).labels(model_name)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token (arrival to first token).",
                         _LATENCY_BUCKETS)
        self.tpot = hist("vllm:time_per_output_token_seconds",
                         "Mean time per output token after the first, per request.", _TOKEN_LATENCY_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between successive output tokens.",
                        _TOKEN_LATENCY_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to last token.", _LATENCY_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds", "First scheduled to first token.",
                            _LATENCY_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds", "First token to last token.", _LATENCY_BUCKETS)
        self.req_prompt = hist("vllm:request_prompt_tokens", "Prompt tokens per request.", _TOKEN_COUNT_BUCKETS)
        self.req_gen = hist("vllm:request_generation_tokens", "Generated tokens per sequence.",
                            _TOKEN_COUNT_BUCKETS)
        self.prompt_tokens = count("vllm:prompt_tokens", "Prompt tokens of requests that started.")
        self.generation_tokens = count("vllm:generation_tokens", "Generated tokens.")
        self._success = Counter("vllm:request_success", "Finished sequences by finish reason.",
                                ["model_name", "finished_reason"], registry=reg)
        info = Gauge("vllm:cache_config_info", "KV-cache configuration (value is always 1).",
                     ["block_size", "num_gpu_blocks", "enable_prefix_caching"], registry=reg)
        st = engine.stats
        info.labels(str(engine.block_size), str(st.blocks_total), str(st.prefix_cache_enabled)).set(1)
        reg.register(_EngineStateCollector(model_name, engine, waiting or (lambda: engine.stats.num_waiting)))

        self.rejected = Counter("tokenmill:requests_rejected", "Requests refused before reaching the engine.",
                                ["reason"], registry=None)
        self.cache_misses = Counter("tokenmill:prefix_cache_misses",
                                    "Requests whose prompt missed reusable cache, by reason (traffic/cache_misses.py).",
                                    ["reason"], registry=None)
        self.exposed = CollectorRegistry(auto_describe=False)
        self.exposed.register(_Passthrough(self.vllm))
        self.exposed.register(_AliasCollector(self.vllm))
        self.exposed.register(_TokenmillOnly(model_name, engine))
        self.exposed.register(self.rejected)
        self.exposed.register(self.cache_misses)

    def finished(self, reason: str | None) -> None:
        self._success.labels(self.model_name, reason or "abort").inc()

    def observe_sequence(self, metrics: dict[str, float], num_output_tokens: int) -> None:
        """A sequence finished normally: record its latencies from the engine's clock."""
        ttft = metrics.get("ttft")
        e2e = metrics.get("e2e")
        if ttft is not None:
            self.ttft.observe(ttft)
        if e2e is not None:
            self.e2e.observe(e2e)
        if "queue_time" in metrics:
            self.queue.observe(metrics["queue_time"])
        if "prefill_time" in metrics:
            self.prefill.observe(metrics["prefill_time"])
        if ttft is not None and e2e is not None:
            self.decode.observe(max(0.0, e2e - ttft))
            if num_output_tokens > 1:
                self.tpot.observe(max(0.0, e2e - ttft) / (num_output_tokens - 1))
        self.req_gen.observe(num_output_tokens)

    def render(self) -> bytes:
        return generate_latest(self.exposed)


class _ModelSetCollector(Collector):
    """A model set's gauges and counters, read from its entries when Prometheus scrapes."""

    def __init__(self, models: Any) -> None:
        self.models = models  # model_set.ModelSet

    def collect(self) -> Iterable[Metric]:
        entries = self.models.entries()
        loaded = GaugeMetricFamily("tokenmill:models_loaded", "Models in memory now (of those configured).")
        loaded.add_metric([], sum(1 for e in entries if e.status == "loaded"))
        yield loaded
        configured = GaugeMetricFamily("tokenmill:models_configured", "Models this server can load.")
        configured.add_metric([], len(entries))
        yield configured
        state = GaugeMetricFamily("tokenmill:model_state", "1 for each model's current state.",
                                  labels=["model_name", "state"])
        loads = CounterMetricFamily("tokenmill:model_loads", "Times each model was loaded.", labels=["model_name"])
        unloads = CounterMetricFamily("tokenmill:model_unloads", "Times each model was unloaded, by reason "
                                      "(lru: room for another, idle: --idle-unload-seconds).",
                                      labels=["model_name", "reason"])
        for e in entries:
            state.add_metric([e.spec.name, e.status], 1)
            loads.add_metric([e.spec.name], e.loads)
            for reason in ("lru", "idle"):
                unloads.add_metric([e.spec.name, reason], e.unloads.get(reason, 0))
        yield state
        yield loads
        yield unloads


class ModelSetMetrics:
    """The metrics of a server of several models: its own (requests refused before a model
    was chosen, tenants' usage, the model set's gauges) and those of every loaded model
    (``ServerMetrics``, one per model, each series labelled with its ``model_name``), merged
    into one family per name at scrape time. A model's request counters start from zero
    each time it is loaded."""

    def __init__(self, models: Any, usage: Collector) -> None:
        self.models = models  # model_set.ModelSet
        self.rejected = Counter("tokenmill:requests_rejected", "Requests refused before reaching the engine.",
                                ["reason"], registry=None)
        self.exposed = CollectorRegistry(auto_describe=False)
        self.exposed.register(self.rejected)
        self.exposed.register(usage)
        self.exposed.register(_ModelSetCollector(models))

    def render(self) -> bytes:
        merged = CollectorRegistry(auto_describe=False)
        merged.register(_Merged([self.exposed] + [state.metrics.exposed for state in self.models.loaded()]))
        return generate_latest(merged)


class _Merged(Collector):
    """Several registries as one: families of one name become one family; samples of the same
    name and labels (a counter without a model label, such as the refusals by reason) are summed."""

    def __init__(self, sources: list[CollectorRegistry]) -> None:
        self.sources = sources

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        samples: dict[str, dict[tuple[Any, ...], Any]] = {}
        for source in self.sources:
            for family in source.collect():
                if family.name not in families:
                    families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                    samples[family.name] = {}
                into = samples[family.name]
                for s in family.samples:
                    key = (s.name, tuple(sorted(s.labels.items())))
                    into[key] = s._replace(value=into[key].value + s.value) if key in into else s
        for name, family in families.items():
            family.samples = list(samples[name].values())
            yield family

"""Request traces with OpenTelemetry, exported over OTLP (HTTP/protobuf).

Off unless ``--otlp-traces-endpoint URL`` is given (vLLM's flag, on ``tokenmill
serve`` and ``tokenmill route``); off, nothing here is imported and the request
path pays one ``is None`` test. On, it needs the ``tracing`` extra
(``pip install 'tokenmill[tracing]'``: opentelemetry-sdk and the OTLP exporter).

What a request leaves (W3C ``traceparent`` in and out, so a gateway's trace
continues through both):

- the router: one SERVER span per proxied request, ``route <path>``, whose
  context goes to the replica in ``traceparent``;
- the server: one SERVER span per HTTP request, child of the caller's
  ``traceparent``, with the tenant, the model and the request's token counts;
  under it, per engine request (a prompt), ``engine.request`` and its three
  consecutive parts from the engine's own clock: ``engine.queue`` (arrival to
  first scheduled), ``engine.prefill`` (to the first token: the prompt's chunks
  and cache hits) and ``engine.decode`` (to the finish), with prompt, cached and
  output tokens, preemptions and the finish reason; a ``prefill_chunk`` event per
  prompt chunk (its tokens; the engine records them only for traced requests)
  and a ``first_token`` event. The parts' durations add up to the engine
  request's by construction.

Spans go out in batches from a background thread; a collector that is down costs
dropped spans, never a request.
"""
from __future__ import annotations

import contextvars
import time
from typing import Any, Mapping

TRACED_PREFIX = "/v1/"  # the API; not /health, /metrics, the console's page
# The model list is the router's health probe (every replica, every few seconds): tracing it
# would bury the requests' traces under probes.
UNTRACED_PATHS = frozenset({"/v1/models"})
# The server's HTTP span of the request being handled (set by TracingMiddleware).
CURRENT_SPAN: contextvars.ContextVar[Any] = contextvars.ContextVar("tokenmill_http_span", default=None)


def _endpoint(url: str) -> str:
    """OTLP/HTTP's traces path, added when the URL names only a host."""
    from urllib.parse import urlsplit

    return url if urlsplit(url).path not in ("", "/") else url.rstrip("/") + "/v1/traces"


class Tracing:
    """A tracer provider of its own (the process-wide one is left alone) and the W3C
    trace-context propagator."""

    def __init__(self, endpoint: str, service_name: str, processor: Any = None) -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as exc:
            raise ValueError("--otlp-traces-endpoint needs the tracing extra: "
                             f"pip install 'tokenmill[tracing]' ({exc.name} is missing)") from None
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        if processor is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=_endpoint(endpoint)), schedule_delay_millis=500)
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("tokenmill")
        self.propagator = TraceContextTextMapPropagator()
        # engine times are time.monotonic(); spans take epoch nanoseconds
        self._offset_ns = time.time_ns() - time.monotonic_ns()

    def epoch_ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._offset_ns

    def extract(self, headers: Mapping[str, str]) -> Any:
        """The caller's trace context (from ``traceparent``), or an empty one."""
        return self.propagator.extract(carrier=dict(headers))

    def inject(self, span: Any, headers: dict[str, str]) -> None:
        """Write ``span``'s context into ``headers`` as ``traceparent``."""
        from opentelemetry import trace

        self.propagator.inject(headers, context=trace.set_span_in_context(span))

    def start(self, name: str, parent: Any = None, kind: str = "SERVER", start_ns: int | None = None,
              attributes: Mapping[str, Any] | None = None) -> Any:
        """A span under ``parent`` (a context, or a span); end it with ``span.end()``."""
        from opentelemetry import trace

        context = trace.set_span_in_context(parent) if isinstance(parent, trace.Span) else parent
        return self.tracer.start_span(name, context=context, kind=getattr(trace.SpanKind, kind),
                                      start_time=start_ns, attributes=dict(attributes or {}))

    def engine_spans(self, parent: Any, metrics: Mapping[str, float], chunks: list[tuple[float, int]] | None,
                     attributes: Mapping[str, Any]) -> None:
        """``engine.request`` and its queue / prefill / decode parts, from a finished sequence's
        engine timings (``SequenceDelta.metrics``: arrival_time and offsets, monotonic); each
        prefill chunk (``chunks``: time its step ended, prompt tokens) a ``prefill_chunk``
        event with its token count (after a preemption, the recompute's chunks too)."""
        arrival = metrics.get("arrival_time")
        if arrival is None:
            return
        scheduled = arrival + metrics.get("queue_time", 0.0)
        first = arrival + metrics.get("ttft", 0.0)
        end = arrival + metrics.get("e2e", 0.0)
        request = self.start("engine.request", parent, "INTERNAL", self.epoch_ns(arrival), attributes)
        for name, a, b in (("engine.queue", arrival, scheduled), ("engine.prefill", scheduled, first),
                           ("engine.decode", first, end)):
            part = self.start(name, request, "INTERNAL", self.epoch_ns(a))
            part.end(self.epoch_ns(b))
        for at, tokens in chunks or []:
            request.add_event("prefill_chunk", {"tokens": tokens}, timestamp=self.epoch_ns(at))
        request.add_event("first_token", timestamp=self.epoch_ns(first))
        request.end(self.epoch_ns(end))

    def close(self) -> None:
        self.provider.shutdown()


def make_tracing(endpoint: str | None, service_name: str) -> Tracing | None:
    return Tracing(endpoint, service_name) if endpoint else None


class TracingMiddleware:
    """The server's span per HTTP request (added only when tracing is on): the caller's
    ``traceparent`` is its parent; handlers reach it through ``CURRENT_SPAN``."""

    def __init__(self, app: Any, tracing: Tracing) -> None:
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = str(scope.get("path", ""))
        if scope["type"] != "http" or not path.startswith(TRACED_PREFIX) or path in UNTRACED_PATHS:
            await self.app(scope, receive, send)  # probes, scrapes and pages are not requests worth a trace
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []}
        span = self.tracing.start(f"{scope.get('method', 'GET')} {scope.get('path', '')}",
                                  self.tracing.extract(headers))
        token = CURRENT_SPAN.set(span)
        status = 500
        ended = False

        def end() -> None:
            nonlocal ended
            if not ended:
                ended = True
                span.set_attribute("http.response.status_code", status)
                span.end()

        async def sending(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                end()  # the last of the response goes out: what the app does after is not the request's
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            CURRENT_SPAN.reset(token)
            end()

"""Endpoint-picker mode: Envoy external processing (ext_proc v3) over gRPC.

This is the role the Gateway API Inference Extension gives its endpoint
picker (EPP): the gateway streams each request's headers and body to us; we
parse the OpenAI body, pick a backend with the router's policy and answer
with

- a header mutation setting ``x-gateway-destination-endpoint: ip:port``,
  with ``clear_route_cache`` so the gateway re-evaluates the route, and
- the same value in dynamic metadata under the ``envoy.lb`` namespace,

or an immediate 503 (no ready endpoint) / 429 (request shed). The value is a
fallback list, ``ip:port,ip:port,...``: the pick first, then up to
``fallback_endpoints`` other ready endpoints, least loaded first, which the
gateway tries in turn when the pick fails. The gateway may restrict the
choice with ``x-gateway-destination-endpoint-subset`` in the
``envoy.lb.subset_hint`` filter metadata; then only those endpoints count.

Request body modes (``processing_mode.request_body_mode`` in the gateway's
ext_proc filter, which Envoy reports in ``protocol_config``):

- BUFFERED: the headers are answered at once with CONTINUE and the pick rides
  on the response to the whole body. Also assumed when the gateway sends no
  ``protocol_config`` (Envoy before it existed could only do this usefully).
- FULL_DUPLEX_STREAMED (what the extension's gateways configure): Envoy does
  not wait for per-message answers, so the headers answer is held until the
  body has ended and then sent with the mutation, followed by the body itself
  as a streamed body response.
- NONE: no body comes, so the pick is made on the headers (load only, no
  prefix affinity).
- STREAMED and BUFFERED_PARTIAL are refused with an immediate 500 that says
  so: Envoy applies header mutations on a body response only in BUFFERED
  mode, so in these modes it would drop the pick and route the request as if
  no picker existed.

The Envoy messages come from the ``xds-protos`` package (generated from
envoyproxy/data-plane-api), never hand-written copies.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import json_format, struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ..backend import Backend
from ..core import ConversationUnavailable, NoBackendError, Router, ShedError
from ..sessions import session_key
from ..tenancy import OBJECTIVE_HEADER, objective_priority

log = logging.getLogger("tokenmill.router")

DEST_HEADER = "x-gateway-destination-endpoint"
SERVED_KEY = "x-gateway-destination-endpoint-served"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BODY_MODE_NONE = processing_mode_pb2.ProcessingMode.NONE
# Modes in which Envoy ignores a body response's header mutation (see the module doc).
REFUSED_BODY_MODES = {processing_mode_pb2.ProcessingMode.STREAMED: "STREAMED",
                      processing_mode_pb2.ProcessingMode.BUFFERED_PARTIAL: "BUFFERED_PARTIAL"}


def header_value(h: base_pb2.HeaderValue) -> str:
    return h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value


def headers_of(msg: ep.HttpHeaders) -> dict[str, str]:
    return {h.key.lower(): header_value(h) for h in msg.headers.headers}


def subset_of(metadata: base_pb2.Metadata) -> list[str] | None:
    """Endpoints the gateway allows for this request, or None when unrestricted."""
    if SUBSET_NAMESPACE not in metadata.filter_metadata:
        return None
    data = json_format.MessageToDict(metadata.filter_metadata[SUBSET_NAMESPACE])
    if SUBSET_KEY not in data:
        return None
    value = data[SUBSET_KEY]
    items = value if isinstance(value, list) else str(value).split(",")
    return [str(v).strip() for v in items if str(v).strip()]


def served_of(metadata: base_pb2.Metadata) -> str | None:
    if LB_NAMESPACE not in metadata.filter_metadata:
        return None
    value = json_format.MessageToDict(metadata.filter_metadata[LB_NAMESPACE]).get(SERVED_KEY)
    return str(value).split(",")[0].strip() if value else None


def destination_mutation(endpoint: str) -> ep.CommonResponse:
    option = base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=DEST_HEADER, raw_value=endpoint.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )
    return ep.CommonResponse(header_mutation=ep.HeaderMutation(set_headers=[option]), clear_route_cache=True)


def destination_metadata(endpoint: str) -> struct_pb2.Struct:
    md = struct_pb2.Struct()
    md.update({LB_NAMESPACE: {DEST_HEADER: endpoint}})
    return md


def immediate(status: int, message: str, code: str) -> ep.ProcessingResponse:
    body = json.dumps({"error": {"message": message, "type": "server_error" if status >= 500
                                 else "rate_limit_error", "param": None, "code": code}}).encode()
    ct = base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"))
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), body=body,
        headers=ep.HeaderMutation(set_headers=[ct]), details=code))


@dataclass
class _Stream:
    """Per-HTTP-request state of one ext_proc stream."""

    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    duplex_request: bool = False
    duplex_response: bool = False
    subset: list[str] | None = None
    backend: Backend | None = None
    released: bool = False


class EndpointPicker(ep_grpc.ExternalProcessorServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    def _release(self, st: _Stream) -> None:
        if st.backend is not None and not st.released:
            st.released = True
            self.router.release(st.backend)

    async def _pick(self, st: _Stream) -> ep.ProcessingResponse | str:
        """The chosen endpoint and its fallbacks (``ip:port,ip:port``), or an
        immediate-response message."""
        path = st.headers.get(":path", "").split("?")[0]
        try:
            body = json.loads(bytes(st.body)) if st.body else None
        except (ValueError, RecursionError):
            body = None  # not an OpenAI body (or nested past the parser): route on load alone
        try:
            priority = objective_priority(st.headers.get(OBJECTIVE_HEADER), self.router.tenancy.objectives)
            decision = await self.router.route(path, body, subset=st.subset, session=session_key(st.headers, body),
                                               priority=priority)
        except ConversationUnavailable as exc:
            self.router.metrics.responses.labels("502").inc()
            return immediate(502, str(exc), "conversation_replica_unavailable")
        except NoBackendError:
            self.router.metrics.responses.labels("503").inc()
            return immediate(503, "no ready endpoint", "no_backend")
        except ShedError:
            self.router.metrics.responses.labels("429").inc()
            return immediate(429, "all endpoints are saturated; retry later", "overloaded")
        st.backend = decision.backend
        log.debug("picked %s for %s (%s)", decision.backend.endpoint, path, decision.reason)
        # a conversation's continuation has no fallback: another endpoint could only answer 404
        n = 0 if decision.reason == "conversation" else self.router.config.fallback_endpoints
        fallbacks = self.router.fallbacks(decision.backend, n, st.subset)
        return ",".join([decision.backend.endpoint] + [b.endpoint for b in fallbacks])

    async def Process(self, request_iterator: AsyncIterator[ep.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[ep.ProcessingResponse]:
        st = _Stream()
        try:
            async for req in request_iterator:
                kind = req.WhichOneof("request")
                if kind == "request_headers":
                    st.headers = headers_of(req.request_headers)
                    mode = req.protocol_config.request_body_mode if req.HasField("protocol_config") else None
                    st.duplex_request = mode == FULL_DUPLEX
                    st.duplex_response = req.protocol_config.response_body_mode == FULL_DUPLEX
                    st.subset = subset_of(req.metadata_context)
                    if mode in REFUSED_BODY_MODES:
                        self._warn_mode(REFUSED_BODY_MODES[mode])
                        yield immediate(500, f"endpoint picker: request body mode {REFUSED_BODY_MODES[mode]} is "
                                        "not supported (Envoy would drop the pick); configure BUFFERED or "
                                        "FULL_DUPLEX_STREAMED", "unsupported_body_mode")
                        return
                    if req.request_headers.end_of_stream or mode == BODY_MODE_NONE:  # no body coming: pick now
                        picked = await self._pick(st)
                        if isinstance(picked, ep.ProcessingResponse):
                            yield picked
                            return
                        yield ep.ProcessingResponse(
                            request_headers=ep.HeadersResponse(response=destination_mutation(picked)),
                            dynamic_metadata=destination_metadata(picked))
                    elif not st.duplex_request:
                        yield ep.ProcessingResponse(request_headers=ep.HeadersResponse())
                elif kind == "request_body":
                    st.body += req.request_body.body
                    if not req.request_body.end_of_stream:
                        if not st.duplex_request:  # streamed chunks each want an answer
                            yield ep.ProcessingResponse(request_body=ep.BodyResponse())
                        continue
                    picked = await self._pick(st)
                    if isinstance(picked, ep.ProcessingResponse):
                        yield picked
                        return
                    if st.duplex_request:
                        yield ep.ProcessingResponse(
                            request_headers=ep.HeadersResponse(response=destination_mutation(picked)),
                            dynamic_metadata=destination_metadata(picked))
                        yield ep.ProcessingResponse(request_body=ep.BodyResponse(response=ep.CommonResponse(
                            body_mutation=ep.BodyMutation(streamed_response=ep.StreamedBodyResponse(
                                body=bytes(st.body), end_of_stream=True)))))
                    else:
                        yield ep.ProcessingResponse(
                            request_body=ep.BodyResponse(response=destination_mutation(picked)),
                            dynamic_metadata=destination_metadata(picked))
                elif kind == "request_trailers":
                    yield ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
                elif kind == "response_headers":
                    self._note_served(st, served_of(req.metadata_context))
                    yield ep.ProcessingResponse(response_headers=ep.HeadersResponse())
                elif kind == "response_body":
                    rb = req.response_body
                    if st.duplex_response:
                        yield ep.ProcessingResponse(response_body=ep.BodyResponse(response=ep.CommonResponse(
                            body_mutation=ep.BodyMutation(streamed_response=ep.StreamedBodyResponse(
                                body=rb.body, end_of_stream=rb.end_of_stream)))))
                    else:
                        yield ep.ProcessingResponse(response_body=ep.BodyResponse())
                    if rb.end_of_stream:
                        self._release(st)
                elif kind == "response_trailers":
                    yield ep.ProcessingResponse(response_trailers=ep.TrailersResponse())
                    self._release(st)
        finally:
            # The gateway closes the stream when the HTTP exchange ends (or fails).
            self._release(st)

    _warned: set[str] = set()

    def _warn_mode(self, mode: str) -> None:
        if mode not in self._warned:
            self._warned.add(mode)
            log.error("the gateway sends request bodies in %s mode, in which Envoy ignores the picker's "
                      "destination header; set the ext_proc filter's request_body_mode to FULL_DUPLEX_STREAMED "
                      "or BUFFERED (each such request is refused with 500)", mode)

    def _note_served(self, st: _Stream, served: str | None) -> None:
        """The gateway fell back to another endpoint: move the in-flight count."""
        if not served or st.backend is None or served == st.backend.endpoint:
            return
        other = self.router.pool.by_endpoint(served)
        if other is None:
            return
        self._release(st)
        st.backend, st.released = other, False
        other.in_flight += 1


class PickerHealth:
    """gRPC health: liveness always SERVING; readiness and ext_proc follow the pool."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.servicer = health.aio.HealthServicer()

    async def update(self) -> None:
        s = health_pb2.HealthCheckResponse
        ready = s.SERVING if self.router.ready() else s.NOT_SERVING
        await self.servicer.set("", s.SERVING)
        await self.servicer.set("liveness", s.SERVING)
        await self.servicer.set("readiness", ready)
        await self.servicer.set(EXT_PROC_SERVICE, ready)


async def start_grpc(router: Router, host: str, port: int) -> tuple[grpc.aio.Server, PickerHealth, int]:
    """Start the ext_proc + health gRPC server; returns it and the bound port."""
    import asyncio

    server = grpc.aio.server()
    ep_grpc.add_ExternalProcessorServicer_to_server(EndpointPicker(router), server)
    hc = PickerHealth(router)
    health_pb2_grpc.add_HealthServicer_to_server(hc.servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC port {host}:{port}")
    await hc.update()
    loop = asyncio.get_running_loop()
    pending: set[asyncio.Task] = set()  # keep update tasks referenced until done

    def on_change() -> None:
        task = loop.create_task(hc.update())
        pending.add(task)
        task.add_done_callback(pending.discard)

    router.add_listener(on_change)
    await server.start()
    return server, hc, bound

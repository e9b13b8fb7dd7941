"""Endpoint-picker mode driven the way Envoy drives it: an ext_proc v3 gRPC
stream of request headers and body, using the real Envoy messages from
xds-protos. Checks the destination header, the ``envoy.lb`` dynamic metadata,
route-cache clearing, immediate 503/429, the subset hint and gRPC health.
"""
from __future__ import annotations

import json
import queue
import threading

import grpc
import httpx
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import json_format, struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fake_backend import free_port, start_fakes
from tokenmill.router.config import RouterConfig
from tokenmill.router.server import RouterServer

DEST = "x-gateway-destination-endpoint"
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


@pytest.fixture(scope="module")
def fakes():
    procs = start_fakes(3)
    yield procs
    for p in procs:
        p.kill()


def _picker(urls, **kw) -> RouterServer:
    cfg = RouterConfig(backends=urls, port=0, endpoint_picker=True, grpc_port=0, health_interval=0.5, **kw)
    return RouterServer(cfg).start_in_thread()


def _headers_msg(path="/v1/completions", eos=False, duplex=False, subset=None,
                 mode=None) -> ep.ProcessingRequest:
    hdrs = base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
        base_pb2.HeaderValue(key=":path", raw_value=path.encode()),
        base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"),
    ])
    req = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hdrs, end_of_stream=eos))
    if duplex:
        req.protocol_config.request_body_mode = FULL_DUPLEX
    if mode is not None:
        req.protocol_config.request_body_mode = mode
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        req.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return req


def _body_msgs(body: dict, chunks: int = 1) -> list[ep.ProcessingRequest]:
    raw = json.dumps(body).encode()
    step = -(-len(raw) // chunks)
    parts = [raw[i:i + step] for i in range(0, len(raw), step)]
    return [ep.ProcessingRequest(request_body=ep.HttpBody(body=p, end_of_stream=i == len(parts) - 1))
            for i, p in enumerate(parts)]


class Stream:
    """One ext_proc stream held open like Envoy holds it for an HTTP exchange."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._q: queue.Queue = queue.Queue()
        self._responses = ep_grpc.ExternalProcessorStub(channel).Process(iter(self._q.get, None), timeout=10)

    def send(self, msg: ep.ProcessingRequest) -> None:
        self._q.put(msg)

    def recv(self) -> ep.ProcessingResponse:
        return next(self._responses)

    def close(self) -> None:
        self._q.put(None)
        for _ in self._responses:  # drain until the server ends the stream
            pass


def _mutation_value(common: ep.CommonResponse) -> str:
    (opt,) = [h for h in common.header_mutation.set_headers if h.header.key == DEST]
    return (opt.header.raw_value or opt.header.value.encode()).decode()


def _metadata_value(resp: ep.ProcessingResponse) -> str:
    return json_format.MessageToDict(resp.dynamic_metadata)["envoy.lb"][DEST]


def _completion(prompt: str) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": 4, "stream": True}


def test_buffered_mode_sets_header_and_metadata_and_sticks_to_prefix(fakes):
    picker = _picker([f.url for f in fakes])
    endpoints = {f.url.split("//")[1] for f in fakes}
    try:
        with grpc.insecure_channel(f"127.0.0.1:{picker.grpc_port}") as ch:
            prompt = "the same long shared system prompt " * 30
            chosen = []
            for i in range(3):
                s = Stream(ch)
                s.send(_headers_msg())
                first = s.recv()
                assert first.WhichOneof("response") == "request_headers"
                assert not first.request_headers.response.header_mutation.set_headers  # CONTINUE
                for m in _body_msgs(_completion(prompt + f" question {i}")):
                    s.send(m)
                resp = s.recv()
                assert resp.WhichOneof("response") == "request_body"
                common = resp.request_body.response
                assert common.clear_route_cache
                value = _mutation_value(common)
                pick, *fallbacks = value.split(",")
                assert pick in endpoints and len(fallbacks) == 2  # the pick, then the other two
                assert set(value.split(",")) == endpoints
                assert _metadata_value(resp) == value  # header and metadata agree
                chosen.append(pick)
                s.close()
            assert len(set(chosen)) == 1  # the shared prefix keeps its replica
        state = picker.router.snapshot()["backends"]
        assert sum(b["requests_total"] for b in state) == 3
        assert all(b["in_flight"] == 0 for b in state)  # released when each stream ended
    finally:
        picker.stop()


def test_full_duplex_mode_answers_headers_after_body_and_returns_body(fakes):
    picker = _picker([f.url for f in fakes])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{picker.grpc_port}") as ch:
            s = Stream(ch)
            s.send(_headers_msg(path="/v1/chat/completions", duplex=True))
            body = {"model": "m", "messages": [{"role": "user", "content": "hi " * 100}], "stream": True}
            msgs = _body_msgs(body, chunks=3)
            assert len(msgs) == 3
            for m in msgs:
                s.send(m)
            hdr = s.recv()
            assert hdr.WhichOneof("response") == "request_headers"
            value = _mutation_value(hdr.request_headers.response)
            assert hdr.request_headers.response.clear_route_cache
            assert _metadata_value(hdr) == value
            bod = s.recv()
            streamed = bod.request_body.response.body_mutation.streamed_response
            assert streamed.end_of_stream and json.loads(streamed.body) == body
            # Response path: headers and a duplex-streamed body are echoed through.
            s.send(ep.ProcessingRequest(response_headers=ep.HttpHeaders()))
            assert s.recv().WhichOneof("response") == "response_headers"
            s.close()
    finally:
        picker.stop()


def test_subset_hint_restricts_choice(fakes):
    picker = _picker([f.url for f in fakes])
    target = fakes[2].url.split("//")[1]
    try:
        with grpc.insecure_channel(f"127.0.0.1:{picker.grpc_port}") as ch:
            for i in range(3):
                s = Stream(ch)
                s.send(_headers_msg(subset=[target]))
                s.recv()
                for m in _body_msgs(_completion(f"prompt {i}")):
                    s.send(m)
                assert _mutation_value(s.recv().request_body.response) == target  # no fallback outside it
                s.close()
            s = Stream(ch)
            s.send(_headers_msg(subset=["10.255.255.1:8000"]))  # not a known endpoint
            s.recv()
            for m in _body_msgs(_completion("x")):
                s.send(m)
            resp = s.recv()
            assert resp.immediate_response.status.code == 503
            s.close()
    finally:
        picker.stop()


def test_immediate_503_when_no_backend_ready_and_health_not_serving():
    picker = _picker([f"http://127.0.0.1:{free_port()}"])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{picker.grpc_port}") as ch:
            s = Stream(ch)
            s.send(_headers_msg())
            s.recv()
            for m in _body_msgs(_completion("hello")):
                s.send(m)
            resp = s.recv()
            assert resp.WhichOneof("response") == "immediate_response"
            assert resp.immediate_response.status.code == 503
            assert json.loads(resp.immediate_response.body)["error"]["code"] == "no_backend"
            s.close()
            hc = health_pb2_grpc.HealthStub(ch)
            status = health_pb2.HealthCheckResponse
            assert hc.Check(health_pb2.HealthCheckRequest(service="liveness")).status == status.SERVING
            assert hc.Check(health_pb2.HealthCheckRequest(service="readiness")).status == status.NOT_SERVING
            assert hc.Check(health_pb2.HealthCheckRequest(
                service="envoy.service.ext_proc.v3.ExternalProcessor")).status == status.NOT_SERVING
    finally:
        picker.stop()


def test_bodyless_request_picked_on_headers_and_shed_with_429(fakes):
    picker = _picker([fakes[0].url], shed_load=1)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{picker.grpc_port}") as ch:
            hc = health_pb2_grpc.HealthStub(ch)
            assert hc.Check(health_pb2.HealthCheckRequest(service="readiness")).status == \
                health_pb2.HealthCheckResponse.SERVING
            held = Stream(ch)
            held.send(_headers_msg(path="/v1/models", eos=True))
            first = held.recv()
            assert _mutation_value(first.request_headers.response) == fakes[0].url.split("//")[1]
            # The held exchange is in flight: the only backend is at the shed threshold.
            s = Stream(ch)
            s.send(_headers_msg())
            s.recv()
            for m in _body_msgs(_completion("more")):
                s.send(m)
            resp = s.recv()
            assert resp.immediate_response.status.code == 429
            s.close()
            held.close()
            # Once the held exchange ended, requests flow again.
            s = Stream(ch)
            s.send(_headers_msg())
            s.recv()
            for m in _body_msgs(_completion("again")):
                s.send(m)
            assert s.recv().WhichOneof("response") == "request_body"
            s.close()
        # The HTTP side of an endpoint picker serves /health and /metrics too.
        assert httpx.get(picker.url + "/health").status_code == 200
        assert 'reason="shed"' in httpx.get(picker.url + "/metrics").text
    finally:
        picker.stop()


def test_fallback_list_puts_the_pick_first_then_the_least_loaded(fakes):
    picker = _picker([f.url for f in fakes], fallback_endpoints=1)
    endpoints = [f.url.split("//")[1] for f in fakes]
    try:
        with grpc.insecure_channel(f"127.0.0.1:{picker.grpc_port}") as ch:
            held = Stream(ch)  # one exchange in flight on its pick
            held.send(_headers_msg(path="/v1/models", eos=True))
            busy = _mutation_value(held.recv().request_headers.response).split(",")[0]
            s = Stream(ch)
            s.send(_headers_msg(path="/v1/models", eos=True))
            pick, *fallbacks = _mutation_value(s.recv().request_headers.response).split(",")
            assert pick != busy and len(fallbacks) == 1  # --fallback-endpoints 1
            assert fallbacks[0] not in (pick, busy)  # the idle one before the busy one
            assert {pick, busy, fallbacks[0]} == set(endpoints)
            s.close()
            held.close()
        assert all(b["in_flight"] == 0 for b in picker.router.snapshot()["backends"])  # released
    finally:
        picker.stop()


@pytest.mark.parametrize("mode, name", [(processing_mode_pb2.ProcessingMode.STREAMED, "STREAMED"),
                                        (processing_mode_pb2.ProcessingMode.BUFFERED_PARTIAL, "BUFFERED_PARTIAL")])
def test_body_modes_that_drop_the_pick_are_refused(fakes, mode, name):
    picker = _picker([fakes[0].url])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{picker.grpc_port}") as ch:
            s = Stream(ch)
            s.send(_headers_msg(mode=mode))
            resp = s.recv()
            assert resp.immediate_response.status.code == 500
            err = json.loads(resp.immediate_response.body)["error"]
            assert err["code"] == "unsupported_body_mode" and name in err["message"]
            s.close()
        assert all(b["requests_total"] == 0 for b in picker.router.snapshot()["backends"])
    finally:
        picker.stop()


def test_explicit_buffered_and_none_modes(fakes):
    picker = _picker([fakes[0].url])
    endpoint = fakes[0].url.split("//")[1]
    try:
        with grpc.insecure_channel(f"127.0.0.1:{picker.grpc_port}") as ch:
            s = Stream(ch)  # BUFFERED, said explicitly: CONTINUE, then the pick on the body
            s.send(_headers_msg(mode=processing_mode_pb2.ProcessingMode.BUFFERED))
            assert not s.recv().request_headers.response.header_mutation.set_headers
            for m in _body_msgs(_completion("hello")):
                s.send(m)
            assert _mutation_value(s.recv().request_body.response) == endpoint
            s.close()
            s = Stream(ch)  # NONE: no body will come, so the headers carry the pick
            s.send(_headers_msg(mode=processing_mode_pb2.ProcessingMode.NONE))
            assert _mutation_value(s.recv().request_headers.response) == endpoint
            s.close()
    finally:
        picker.stop()

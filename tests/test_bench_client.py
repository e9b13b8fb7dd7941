"""Client-side measurement on a scripted clock: exact TTFT/ITL/TPOT/E2E and percentiles.

The stream comes from an in-memory transport that moves a fake clock to each
chunk's scripted time before yielding it, so the figures must come out exact
(no machine jitter at all) — this checks the arithmetic and the SSE handling;
test_bench_fake_server.py checks the same over real sockets.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tokenmill.bench import client as client_mod
from tokenmill.bench.client import Target, send_request
from tokenmill.bench.stats import percentile, summarize
from tokenmill.bench.types import RequestSpec


class ScriptedClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def scripted_transport(clock: ScriptedClock, script: dict[str, list[tuple[float, str]]],
                       status: int = 200) -> httpx.MockTransport:
    """``script[prompt]`` = [(seconds after send, sse data), ...] for that prompt."""

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        prompt = body.get("prompt") or body["messages"][-1]["content"]
        events = script[prompt]
        base = clock.now  # the request's start: script times are relative to it

        async def stream():
            for t, data in events:
                clock.now = base + t
                yield f"data: {data}\n\n".encode()
                await asyncio.sleep(0)

        if status != 200:
            return httpx.Response(status, json={"error": {"message": "overloaded"}})
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=stream())

    return httpx.MockTransport(handler)


def completion(text: str, finish: str | None = None) -> str:
    return json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": finish}]})


def chat(content: str | None, role: str | None = None, finish: str | None = None) -> str:
    delta = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
    return json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def usage(prompt: int, out: int, cached: int) -> str:
    return json.dumps({"choices": [], "usage": {
        "prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out,
        "prompt_tokens_details": {"cached_tokens": cached}}})


def run(transport: httpx.MockTransport, specs: list[RequestSpec], endpoint: str = "completions",
        count=None):
    async def main():
        async with httpx.AsyncClient(transport=transport) as c:
            target = Target("http://test", "m", endpoint)
            return [await send_request(c, target, s, i, 0.0, count) for i, s in enumerate(specs)]

    return asyncio.run(main())


@pytest.fixture
def clock(monkeypatch) -> ScriptedClock:
    clk = ScriptedClock()
    monkeypatch.setattr(client_mod, "_clock", clk)
    return clk


def test_exact_times_from_a_completions_stream(clock):
    # first token at 0.150, then gaps 0.020, 0.030, 0.010, 0.040; [DONE] at 0.260
    times = [0.150, 0.170, 0.200, 0.210, 0.250]
    events = [(t, completion(f" t{i}", "length" if i == 4 else None))
              for i, t in enumerate(times)]
    events += [(0.255, usage(100, 5, 32)), (0.260, "[DONE]")]
    [rec] = run(scripted_transport(clock, {"p": events}), [RequestSpec(prompt="p",
                                                                       output_len=5)])
    assert rec.ok and rec.status == 200 and rec.finish_reason == "length"
    assert rec.ttft == pytest.approx(0.150, abs=1e-12)
    assert rec.itls == pytest.approx([0.020, 0.030, 0.010, 0.040], abs=1e-12)
    assert rec.e2e == pytest.approx(0.260, abs=1e-12)
    assert rec.tpot == pytest.approx((0.260 - 0.150) / 4, abs=1e-12)
    assert (rec.prompt_tokens, rec.output_tokens, rec.cached_tokens) == (100, 5, 32)
    assert rec.usage_reported


def test_chat_role_chunk_is_not_the_first_token(clock):
    events = [(0.010, chat("", role="assistant")), (0.300, chat("Hi")),
              (0.350, chat(" there", finish="stop")), (0.360, usage(20, 2, 0)),
              (0.361, "[DONE]")]
    [rec] = run(scripted_transport(clock, {"q": events}),
                [RequestSpec(messages=[{"role": "user", "content": "q"}], output_len=8)],
                endpoint="chat")
    assert rec.ttft == pytest.approx(0.300) and rec.itls == pytest.approx([0.050])
    assert rec.output_tokens == 2 and rec.finish_reason == "stop"


def test_percentiles_over_scripted_requests_are_exact(clock):
    ttfts = [0.05, 0.10, 0.15, 0.20, 0.25, 0.30, 0.35, 0.90]
    script = {}
    for i, t in enumerate(ttfts):
        evs = [(t + k * 0.01 * (i + 1), completion("x")) for k in range(4)]
        evs += [(evs[-1][0], usage(10, 4, 0)), (evs[-1][0] + 0.001, "[DONE]")]
        script[f"p{i}"] = evs
    recs = run(scripted_transport(clock, script),
               [RequestSpec(prompt=f"p{i}") for i in range(len(ttfts))])
    s = summarize(recs, slo={"ttft": 0.31})
    for q in (50, 90, 95, 99):
        assert getattr(s.ttft, f"p{q}") == pytest.approx(percentile(ttfts, q), abs=1e-12)
    assert s.ttft.p50 == pytest.approx(0.225) and s.ttft.p90 == pytest.approx(0.515)
    # e2e runs to the end of the stream ([DONE] 1 ms after the last token)
    assert s.tpot.mean == pytest.approx(sum(0.01 * (i + 1) for i in range(8)) / 8 + 0.001 / 3)
    assert s.itl.p50 == pytest.approx(percentile([0.01 * (i + 1) for i in range(8)], 50))
    assert s.good == 6  # TTFT <= 0.31


def test_no_usage_falls_back_to_counting(clock):
    events = [(0.1, completion("a b")), (0.2, completion(" c", "length")), (0.3, "[DONE]")]
    spec = RequestSpec(prompt="p", prompt_len=7)
    [by_chunks] = run(scripted_transport(clock, {"p": events}), [spec])
    assert by_chunks.output_tokens == 2 and not by_chunks.usage_reported
    assert by_chunks.prompt_tokens == 7
    [by_counter] = run(scripted_transport(clock, {"p": events}), [spec],
                       count=lambda text: len(text.split()))
    assert by_counter.output_tokens == 3


def test_http_error_and_broken_streams_become_records(clock):
    [rec] = run(scripted_transport(clock, {"p": []}, status=503), [RequestSpec(prompt="p")])
    assert not rec.ok and rec.status == 503 and rec.error == "overloaded"
    early = [(0.1, completion("a"))]  # no finish_reason, no [DONE]
    [rec] = run(scripted_transport(clock, {"p": early}), [RequestSpec(prompt="p")])
    assert not rec.ok and "ended early" in rec.error
    err = [(0.1, json.dumps({"error": {"message": "engine died"}}))]
    [rec] = run(scripted_transport(clock, {"p": err}), [RequestSpec(prompt="p")])
    assert not rec.ok and "engine died" in rec.error

"""The load tester and traffic capture against a real `tokenmill serve` on loopback.

Slow: starts the server with the bundled model. Checks the client's figures
against the server's own /metrics (token counts equal, the client's TTFT at
least the server's) and that a capture of timestamp-first prompts is flagged
by the trace analyser while a system-prompt-first capture is not.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from test_server_support import real_server
from tokenmill.bench.client import Target
from tokenmill.bench.lengths import parse_length
from tokenmill.bench.loadgen import LoadShape
from tokenmill.bench.runner import BenchConfig, BenchResult, run_bench
from tokenmill.bench.tokens import make_counter
from tokenmill.bench.traces.trace_analysis import analyze
from tokenmill.bench.workloads import SyntheticConfig
from tokenmill.traffic.capture import read_capture

pytestmark = pytest.mark.slow

SYSTEM = ("You are the help desk assistant of the harbor town library. Answer questions about "
          "opening hours, borrowing rules, the reading room, local history collections, "
          "children's activities, the map archive and the autumn festival book sale. Be brief, "
          "friendly and precise; if you do not know, say so and suggest asking the librarian. "
          "Never invent opening hours. The library opens at nine and closes at six on weekdays, "
          "and at one on Saturdays. Books are lent for three weeks and can be renewed twice.")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    capture = tmp_path_factory.mktemp("cap") / "traffic.jsonl"
    with real_server("--capture-traffic", str(capture), startup_timeout=240) as srv:
        model = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        yield srv.url, model, capture


def _bench(url: str, model: str, cfg: BenchConfig, endpoint: str = "completions") -> BenchResult:
    result = BenchResult(target={}, config={})
    counter = make_counter(None, url, model)
    try:
        asyncio.run(run_bench(cfg, Target(url, model, endpoint), counter, result))
    finally:
        counter.close()
    return result


def test_client_figures_agree_with_server_metrics(server):
    url, model, _ = server
    syn = SyntheticConfig(parse_length("uniform:80:120"), parse_length("12"), prefix_len=48,
                          num_prefixes=2)
    cfg = BenchConfig(shapes=[LoadShape(concurrency=1), LoadShape(concurrency=3)],
                      num_requests=6, synthetic=syn, reset_cache=True, progress=False)
    result = _bench(url, model, cfg)
    for point in result.points:
        recs = point.run.records
        assert all(r.ok for r in recs), [r.error for r in recs]
        # exact lengths via the server's /tokenize, exact outputs via ignore_eos
        assert [r.prompt_tokens for r in recs] == [r.prompt_len_target for r in recs]
        assert all(r.output_tokens == 12 for r in recs)
        s, srv = point.summary, point.server
        assert srv is not None, "server exported no metrics"
        assert srv.prompt_tokens == s.prompt_tokens
        assert srv.generation_tokens == s.output_tokens
        assert srv.prefix_hits == s.cached_tokens
        assert s.cached_tokens > 0  # the shared prefixes hit
        # the client's TTFT includes HTTP and queueing: never below the server's
        assert s.ttft.mean >= srv.means["ttft"] - 0.002
        assert point.breakdown and "dominates" in point.diagnosis


def test_chat_endpoint_streams_and_counts(server):
    url, model, _ = server
    syn = SyntheticConfig(parse_length("40"), parse_length("8"))
    cfg = BenchConfig(shapes=[LoadShape(concurrency=2)], num_requests=4, synthetic=syn,
                      progress=False)
    point = _bench(url, model, cfg, endpoint="chat").points[0]
    assert all(r.ok and r.output_tokens == 8 and r.ttft is not None for r in point.run.records)
    assert point.server.generation_tokens == 32
    # the chat template adds tokens around the 40-token message
    assert all(r.prompt_tokens > 40 for r in point.run.records)


def _layout_dataset(path, system_first: bool, n: int) -> None:
    with open(path, "w") as fh:
        for i in range(n):
            stamp = f"[2025-03-01 12:{i:02d}:07] user {i:04d}\n"
            question = f"Question {i:04d}: can I renew book number {1000 + 37 * i} a third time?"
            prompt = SYSTEM + "\n" + stamp + question if system_first else \
                stamp + SYSTEM + "\n" + question
            fh.write(json.dumps({"prompt": prompt, "output_len": 4}) + "\n")


def test_capture_flags_timestamp_first_prompts_only(server, tmp_path):
    url, model, capture = server
    groups = {}
    for name, system_first in (("bad", False), ("good", True)):
        _layout_dataset(tmp_path / f"{name}.jsonl", system_first, 10)
        t0 = time.time()
        cfg = BenchConfig(shapes=[LoadShape(concurrency=2)], num_requests=10,
                          dataset=str(tmp_path / f"{name}.jsonl"), progress=False)
        point = _bench(url, model, cfg).points[0]
        assert all(r.ok for r in point.run.records)
        groups[name] = (t0, time.time())
    time.sleep(0.5)
    recs = read_capture([capture])
    part = {name: [r for r in recs if t0 <= r["arrival_time"] <= t1]
            for name, (t0, t1) in groups.items()}
    assert len(part["bad"]) == 10 and len(part["good"]) == 10
    bad, good = analyze(part["bad"]), analyze(part["good"])
    assert bad.layout is not None and bad.layout.ideal_fixed > bad.ideal_hit_rate + 0.3
    assert good.layout is None and good.ideal_hit_rate > 0.5
    assert good.actual_hit_rate is not None and good.actual_hit_rate > 0.3


def test_replaying_a_capture_keeps_lengths_and_sharing(server, tmp_path):
    url, model, capture = server
    _layout_dataset(tmp_path / "good.jsonl", True, 6)
    t0 = time.time()
    cfg = BenchConfig(shapes=[LoadShape(concurrency=1)], num_requests=6,
                      dataset=str(tmp_path / "good.jsonl"), progress=False)
    assert all(r.ok for r in _bench(url, model, cfg).points[0].run.records)
    t1 = time.time()
    time.sleep(0.5)
    recs = [r for r in read_capture([capture]) if t0 <= r["arrival_time"] <= t1]
    assert len(recs) == 6
    part = tmp_path / "part.jsonl"
    part.write_text("".join(json.dumps(r) + "\n" for r in recs))
    replay = BenchConfig(shapes=[LoadShape(trace=True)], num_requests=6, trace=str(part),
                         trace_speed=5.0, reset_cache=True, progress=False)
    point = _bench(url, model, replay).points[0]
    got = sorted(point.run.records, key=lambda r: r.index)
    assert all(r.ok for r in got)
    assert [r.prompt_tokens for r in got] == [r["prompt_tokens"] for r in recs]
    assert [r.output_tokens for r in got] == [r["output_tokens"] for r in recs]
    # the shared system prompt is shared again: every replayed request after the first hits
    assert got[0].cached_tokens == 0 and all(r.cached_tokens >= 96 for r in got[1:])

"""`tokenmill trace analyze` on captures written by TrafficCapture from synthetic ids."""
from __future__ import annotations

import argparse
import json
import random

import pytest

from tokenmill.bench.cli import register
from tokenmill.bench.traces.trace_analysis import analyze, ideal_hit_rate
from tokenmill.traffic.capture import TrafficCapture, read_capture

SYSTEM = list(range(1000, 1200))  # a 200-token shared system prompt


def make_capture(path, layout: str, n: int = 60, seed: int = 0) -> None:
    """Prompts of a timestamp (7 unique tokens), the system prompt, a unique question.

    layout 'timestamp_first': ts + system + question (defeats prefix caching)
    layout 'system_first':    system + ts + question
    layout 'unique':          nothing shared
    """
    rng = random.Random(seed)
    with TrafficCapture(path) as cap:
        for i in range(n):
            ts = [rng.randrange(50_000, 60_000) for _ in range(7)]
            question = [rng.randrange(2000, 40_000) for _ in range(rng.randint(20, 60))]
            if layout == "timestamp_first":
                ids = ts + SYSTEM + question
            elif layout == "long_stamp_after_common_head":  # BOS + "[2025-" shared, then 30 unique
                ids = list(range(16)) + ts * 4 + ts[:2] + SYSTEM + question
            elif layout == "system_first":
                ids = SYSTEM + ts + question
            else:
                ids = ts + [rng.randrange(2000, 40_000) for _ in range(200)] + question
            cached = 0 if layout != "system_first" or i == 0 else 192
            cap.record(arrival_time=1_700_000_000 + i * 0.25, prompt_token_ids=ids,
                       cached_tokens=cached, output_tokens=rng.randint(10, 50),
                       sampling={"max_tokens": 50}, ttft=0.05, e2e=0.5)


def test_timestamp_before_system_prompt_is_flagged(tmp_path):
    make_capture(tmp_path / "bad.jsonl", "timestamp_first")
    rep = analyze(read_capture([tmp_path / "bad.jsonl"]))
    assert rep.ideal_hit_rate < 0.02
    assert rep.layout is not None
    assert rep.layout.fraction > 0.9 and rep.layout.at_start > 0.9
    assert rep.layout.ideal_fixed > 0.5  # ~(59 * 192) / total prompt tokens
    assert any("begin with something seen in no other prompt" in w for w in rep.warnings)


def test_unique_run_spanning_blocks_after_a_common_head_is_flagged(tmp_path):
    make_capture(tmp_path / "bad2.jsonl", "long_stamp_after_common_head")
    rep = analyze(read_capture([tmp_path / "bad2.jsonl"]))
    assert rep.top_prefixes[0].tokens == 16  # only the common head is shared now
    assert rep.layout is not None and rep.layout.fraction > 0.9 and rep.layout.at_start > 0.9
    assert rep.layout.ideal_fixed > rep.ideal_hit_rate + 0.4


def test_system_prompt_first_is_not_flagged(tmp_path):
    make_capture(tmp_path / "good.jsonl", "system_first")
    rep = analyze(read_capture([tmp_path / "good.jsonl"]))
    assert rep.layout is None
    assert not any("layout" in w for w in rep.warnings)
    total = sum(r["prompt_tokens"] for r in read_capture([tmp_path / "good.jsonl"]))
    assert rep.ideal_hit_rate == pytest.approx(59 * 192 / total)
    assert rep.actual_hit_rate == pytest.approx(rep.ideal_hit_rate)
    top = rep.top_prefixes[0]
    assert top.tokens == 192 and top.requests == 60 and top.saved_tokens == 59 * 192


def test_unshared_traffic_is_not_flagged(tmp_path):
    make_capture(tmp_path / "u.jsonl", "unique")
    rep = analyze(read_capture([tmp_path / "u.jsonl"]))
    assert rep.layout is None and rep.ideal_hit_rate == 0.0 and rep.top_prefixes == []


def test_cache_far_below_ideal_is_reported(tmp_path):
    make_capture(tmp_path / "g.jsonl", "system_first")
    recs = read_capture([tmp_path / "g.jsonl"])
    for r in recs:
        r["cached_tokens"] = 0
    rep = analyze(recs)
    assert any("a perfect cache would hit" in w for w in rep.warnings)


def test_lengths_rates_and_concurrency(tmp_path):
    make_capture(tmp_path / "g.jsonl", "system_first", n=41)
    rep = analyze(read_capture([tmp_path / "g.jsonl"]))
    assert rep.requests == 41
    assert rep.arrival_rate == pytest.approx(4.0)  # one every 0.25 s
    assert rep.peak_concurrency == 2  # 0.5 s requests, 0.25 s apart
    assert 227 <= rep.prompt_len.p50 <= 267
    assert sum(row["arrivals"] for row in rep.timeline) == 41
    mean_conc = sum(row["concurrency"] for row in rep.timeline) / len(rep.timeline)
    assert mean_conc == pytest.approx(41 * 0.5 / rep.span, rel=0.01)


def test_ideal_hit_rate_caps_at_prompt_minus_one():
    chains = [["a", "b"], ["a", "b"]]
    assert ideal_hit_rate(chains, [32, 32], 16) == pytest.approx(31 / 64)


def test_cli_trace_analyze(tmp_path, capsys):
    make_capture(tmp_path / "bad.jsonl", "timestamp_first")
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["trace", "analyze", str(tmp_path / "bad*.jsonl"),
                              "--json", str(tmp_path / "a.json")])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "prompt layout defeats prefix caching" in out and "60 requests" in out
    assert json.loads((tmp_path / "a.json").read_text())["layout"]["fraction"] > 0.9
    args = parser.parse_args(["trace", "analyze", str(tmp_path / "missing.jsonl")])
    assert args.func(args) == 1
    assert "no such capture file" in capsys.readouterr().err


def test_server_miss_reasons_in_the_capture_are_reported_worst_first(tmp_path, capsys):
    """Sessions whose second turn puts a fresh nonce inside the system prompt: the classifier (as
    the server runs it) names the volatile span and its offset, the capture keeps them, and the
    analyser reports the offender with its advice."""
    from tokenmill.traffic.cache_misses import MissClassifier

    rng = random.Random(3)
    classifier = MissClassifier(16)
    path = tmp_path / "misses.jsonl"
    with TrafficCapture(path) as cap:
        for s in range(20):
            for turn in range(2):
                nonce = [rng.randrange(50_000, 60_000) for _ in range(6)]
                ids = SYSTEM[:40] + nonce + SYSTEM[40:] + [3000 + s] * (10 + 20 * turn)
                cached = 32 if turn else 0  # the chain breaks at the nonce (offset 40)
                miss = classifier.classify(ids, cached, f"s{s}")
                cap.record(arrival_time=1_700_000_000 + s + turn * 0.5, prompt_token_ids=ids, cached_tokens=cached,
                           output_tokens=8, sampling={}, ttft=0.05, e2e=0.2,
                           miss_reason=miss.reason if miss else None, miss_offset=miss.offset if miss else None)
    rep = analyze(read_capture([path]))
    by = {m.reason: m for m in rep.miss_reasons}
    assert (by["volatile_span"].requests, by["volatile_span"].common_offset) == (20, 40)
    assert rep.miss_reasons == sorted(rep.miss_reasons, key=lambda m: -m.lost_tokens)
    assert any("volatile span" in w and "token 40" in w for w in rep.warnings)

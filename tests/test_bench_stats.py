"""Metrics math, parsers and diagnosis on hand-made records (no network)."""
from __future__ import annotations

import math
import random

import pytest

from tokenmill.bench import server_metrics as sm
from tokenmill.bench.lengths import parse_length
from tokenmill.bench.loadgen import LoadShape
from tokenmill.bench.report import compare, render, save
from tokenmill.bench.stats import Dist, meets_slo, parse_slo, percentile, summarize
from tokenmill.bench.types import RequestRecord


def rec(i, start, ttft, e2e, out, prompt=100, cached=None, ok=True, itls=None):
    return RequestRecord(index=i, start=start, ok=ok, ttft=ttft, e2e=e2e, output_tokens=out,
                         prompt_tokens=prompt, cached_tokens=cached, usage_reported=True,
                         itls=itls or [], status=200 if ok else 500,
                         error=None if ok else "boom")


def test_percentile_matches_linear_interpolation():
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 5.0
    assert percentile(xs, 90) == pytest.approx(4.6)
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert percentile([], 50) is None and percentile([7.0], 99) == 7.0


def test_dist_of_skips_none():
    d = Dist.of([0.1, None, 0.3])
    assert d.n == 2 and d.mean == pytest.approx(0.2) and d.max == 0.3


def test_summarize_throughput_tpot_goodput_cost():
    records = [
        rec(0, 0.0, 0.1, 1.1, 11, cached=0, itls=[0.1] * 10),  # tpot 0.1
        rec(1, 0.5, 0.2, 2.2, 21, cached=50, itls=[0.1] * 20),  # tpot 0.1, ends at 2.7
        rec(2, 1.0, 0.9, 1.7, 9, cached=100, itls=[0.1] * 8),  # ttft misses SLO; ends 2.7
        rec(3, 1.5, None, 0.5, 0, ok=False),
    ]
    s = summarize(records, parse_slo("ttft=0.5,tpot=100ms"), cost_per_hour=36.0)
    assert s.completed == 3 and s.failed == 1
    assert s.duration == pytest.approx(2.7)
    assert s.request_throughput == pytest.approx(3 / 2.7)
    assert s.output_tokens == 41 and s.output_throughput == pytest.approx(41 / 2.7)
    assert s.prompt_tokens == 300
    assert s.cache_hit_rate == pytest.approx(150 / 300)
    assert s.tpot.mean == pytest.approx(0.1) and s.itl.n == 38
    assert s.ttft.p50 == pytest.approx(0.2) and s.ttft.max == pytest.approx(0.9)
    assert s.good == 2 and s.goodput == pytest.approx(2 / 2.7)
    run_cost = 36.0 * 2.7 / 3600
    assert s.run_cost == pytest.approx(run_cost)
    assert s.cost_per_1k_requests == pytest.approx(run_cost / 3 * 1000)
    assert s.cost_per_1k_good_requests == pytest.approx(run_cost / 2 * 1000)
    assert s.cost_per_m_output_tokens == pytest.approx(run_cost / 41 * 1e6)
    assert s.errors == {"HTTP 500: boom": 1}


def test_slo_parsing_and_checks():
    assert parse_slo("ttft=0.5, tpot=50ms,e2e=10s") == {"ttft": 0.5, "tpot": 0.05, "e2e": 10.0}
    with pytest.raises(ValueError):
        parse_slo("latency=3")
    r = rec(0, 0, 0.1, 1.0, 10, itls=[0.05, 0.3])
    assert meets_slo(r, {"ttft": 0.2}) and not meets_slo(r, {"ttft": 0.05})
    assert not meets_slo(r, {"itl": 0.2}) and meets_slo(r, {"tpot": 0.1})


def test_length_specs():
    rng = random.Random(0)
    assert parse_length("128").sample(rng) == 128
    u = parse_length("uniform:10:20")
    assert all(10 <= u.sample(rng) <= 20 for _ in range(200))
    n = parse_length("normal:100:10")
    vals = [n.sample(rng) for _ in range(2000)]
    assert abs(sum(vals) / len(vals) - 100) < 2
    h = parse_length("hist:8=1,64=3")
    vals = [h.sample(rng) for _ in range(4000)]
    assert set(vals) == {8, 64} and 0.7 < vals.count(64) / len(vals) < 0.8
    for bad in ("abc", "uniform:5", "uniform:9:3", "hist:"):
        with pytest.raises(ValueError):
            parse_length(bad)


def test_hist_from_file(tmp_path):
    f = tmp_path / "h.txt"
    f.write_text("# len weight\n32 1\n64 0\n")
    assert {parse_length(f"hist:{f}").sample(random.Random(i)) for i in range(50)} == {32}


def test_open_loop_arrivals_have_the_requested_rate():
    shape = LoadShape(rate=10.0)
    times = shape.arrivals(5001, random.Random(1))
    assert times[0] == 0.0 and times == sorted(times)
    assert 5000 / times[-1] == pytest.approx(10.0, rel=0.05)
    gaps = [b - a for a, b in zip(times, times[1:])]
    mean = sum(gaps) / len(gaps)
    cv = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
    assert cv == pytest.approx(1.0, abs=0.1)  # Poisson
    bursty = LoadShape(rate=10.0, burstiness=0.25).arrivals(5001, random.Random(1))
    gaps = [b - a for a, b in zip(bursty, bursty[1:])]
    mean = sum(gaps) / len(gaps)
    cv = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
    assert cv == pytest.approx(2.0, abs=0.3)  # gamma shape 0.25: cv = 1/sqrt(k)
    assert LoadShape(rate=float("inf")).arrivals(3, random.Random(0)) == [0.0, 0.0, 0.0]


PROM = """# HELP vllm:num_requests_running x
vllm:num_requests_running{model_name="m"} 3
vllm:prompt_tokens_total{model_name="m"} 1000
vllm:prefix_cache_queries_total{model_name="m"} 1000
vllm:prefix_cache_hits_total{model_name="m"} 250
vllm:request_queue_time_seconds_bucket{model_name="m",le="+Inf"} 4
vllm:request_queue_time_seconds_sum{model_name="m"} 2.0
vllm:request_queue_time_seconds_count{model_name="m"} 4
vllm:request_prefill_time_seconds_sum{model_name="m"} 0.4
vllm:request_prefill_time_seconds_count{model_name="m"} 4
vllm:time_to_first_token_seconds_sum{model_name="m"} 2.6
vllm:time_to_first_token_seconds_count{model_name="m"} 4
"""


def test_prometheus_delta_and_diagnosis():
    before = sm.Snapshot.from_text("vllm:prompt_tokens_total 200\n"
                                   "vllm:prefix_cache_queries_total 200\n"
                                   "vllm:prefix_cache_hits_total 50\n")
    after = sm.Snapshot.from_text(PROM)
    assert after.values["running"] == 3
    d = sm.delta(before, after)
    assert d.prompt_tokens == 800 and d.prefix_hit_rate == pytest.approx(200 / 800)
    assert d.means["queue"] == pytest.approx(0.5) and d.means["prefill"] == pytest.approx(0.1)
    s = summarize([rec(i, 0, 0.7, 1.0, 11) for i in range(4)])
    line, parts = sm.diagnose("c=8", s, d)
    assert line.startswith("c=8: queueing dominates")
    assert parts["queueing"] == pytest.approx(0.5)
    assert parts["client/network"] == pytest.approx(0.7 - 0.65)
    assert parts["decode"] == pytest.approx(0.3)
    # Long outputs: decode dominates; no server split: TTFT is one part.
    s2 = summarize([rec(i, 0, 0.1, 5.0, 100) for i in range(4)])
    line2, parts2 = sm.diagnose("c=1", s2, None)
    assert "decode dominates" in line2 and "first token" in parts2


def test_report_render_and_compare(tmp_path):
    s1 = summarize([rec(0, 0, 0.1, 1.0, 10)])
    s2 = summarize([rec(0, 0, 0.2, 2.0, 10)])
    for name, s in (("a", s1), ("b", s2)):
        save({"target": {}, "points": [{"label": "c=1", "summary": s.to_dict()}]},
             str(tmp_path / f"{name}.json"))
    text = compare([str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    row = next(ln for ln in text.splitlines() if ln.startswith("TTFT mean ms"))
    assert row.split()[-2:] == ["100.0", "200.0"]
    out = render({"target": {"base_url": "u"}, "points": [
        {"label": "c=1", "summary": s1.to_dict(), "diagnosis": "c=1: decode dominates",
         "warnings": ["w1"]}]})
    assert "c=1: decode dominates" in out and "warning [c=1]: w1" in out

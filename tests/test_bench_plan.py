"""`tokenmill plan`: the rate search against a server of known capacity, and the report's sums."""
from __future__ import annotations

import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from fake_openai_server import FakeConfig, FakeServer  # noqa: E402

from tokenmill.bench.plan import Candidate, p99_interval  # noqa: E402


def test_candidate_parsing_and_p99_interval() -> None:
    c = Candidate.parse('int4=--quantization int4 --max-num-seqs 32')
    assert c.serve_args == ["--quantization", "int4", "--max-num-seqs", "32"] and c.url is None
    assert Candidate.parse("live=http://127.0.0.1:8001").url == "http://127.0.0.1:8001"
    with pytest.raises(ValueError):
        Candidate.parse("no-name")
    assert p99_interval([0.1] * 10) is None  # too few samples for a bound
    lo, hi = p99_interval([i / 1000 for i in range(1000)])
    assert lo < 0.99 < hi and hi - lo < 0.02


def test_plan_finds_the_rate_a_one_slot_server_holds(tmp_path, capsys) -> None:
    """One request at a time, 20 tokens in 0.115 s: about 8.7 req/s at most, which the closed-loop
    run measures and the search starts from; a TTFT SLO of 0.3 s holds somewhat below that
    (queueing grows near saturation) and fails well above; the chosen rate is then held longer."""
    from tokenmill.entrypoints.cli.main import main

    out, plot = tmp_path / "plan.json", tmp_path / "plan.png"
    with FakeServer(FakeConfig(ttft=0.02, itl=0.005, slots=1)) as srv:
        rc = main(["plan", "--candidate", f"fake={srv.url}", "--slo", "ttft=0.3", "--rate-min", "4",
                   "--rate-max", "32", "--precision", "0.3", "--probe-requests", "16", "--probe-seconds", "1",
                   "--saturation-concurrency", "4", "--steady-seconds", "3",
                   "--input-len", "16", "--output-len", "20", "--cost-per-hour", "3.6", "--peak-rate", "50",
                   "--verify", "1", "--output", str(out), "--plot", str(plot)])
    text = capsys.readouterr().out
    assert rc == 0, text
    cand = json.loads(out.read_text())["candidates"][0]
    rate, failing = cand["sustainable_rate"], cand["failing_rate"]
    assert 7.5 <= cand["saturation_throughput"] <= 8.7 * 1.05  # one slot: 1 / 0.115 s at most
    assert cand["probes"][0]["rate"] == pytest.approx(cand["saturation_throughput"])
    assert 1 <= rate < failing <= 32 and failing / rate - 1 <= 0.3 + 1e-9
    assert rate <= 8.7 * 1.15, (rate, failing)
    # the chosen rate was held for --steady-seconds, and that run is the one reported
    steady = cand["steady"]
    assert steady["rate"] == rate and steady["seconds"] == 3 and steady["passed"]
    assert steady in cand["probes"] and "held for 3 s" in text
    assert sum(p["seconds"] or 1 for p in cand["probes"]) < cand["search_seconds"] < 120
    good = [p for p in cand["probes"] if p["passed"]]
    assert all(p["p99"]["ttft"] <= 0.3 for p in good)
    assert all(p["p99"]["ttft"] > 0.3 or p["errors"] > 0.01 for p in cand["probes"] if not p["passed"])
    # the report's sums reproduce from its inputs
    assert cand["cost_per_1k_successful"] == pytest.approx(3.6 / 3600 / cand["goodput"] * 1000)
    assert cand["replicas"] == math.ceil(50 / rate)
    assert cand["limiting_factor"] and "sustainable rate" in text and plot.stat().st_size > 1000
    # --verify reran the chosen rate (near capacity it may hold or not; the table says which)
    assert cand["verify"]["rate"] == rate and cand["verify"]["requests"] >= 16
    assert ("SLO held" if cand["verify"]["passed"] else "SLO missed") in text
    # ... and 1.2x that rate as long, which a one-slot server far past its limit cannot hold
    assert cand["verify_over"]["rate"] == pytest.approx(1.2 * rate) and "verified at 1.2x" in text


def test_judge_and_limiting_factor() -> None:
    """A probe's verdict from its records, and what limits it: the server's latency split, or the KV
    pool when it filled."""
    from tokenmill.bench import server_metrics as sm
    from tokenmill.bench.loadgen import PointRun
    from tokenmill.bench.plan import PlanSettings, _limiting, judge
    from tokenmill.bench.runner import PointResult
    from tokenmill.bench.stats import percentile, summarize
    from tokenmill.bench.types import RequestRecord

    # TTFTs in no order over the probe (no trend); the first quarter sent is the warm-up
    recs = [RequestRecord(index=i, start=0.1 * i, ok=i != 0, ttft=0.1 + 0.01 * (i * 7 % 40), e2e=0.5,
                          output_tokens=10) for i in range(40)]
    steady_ttfts = [r.ttft for r in recs if r.ok and r.start >= 0.25 * 3.9]
    run = PointRun(records=recs)
    point = PointResult("rate=4/s", {}, summarize(recs, {"ttft": 0.5}), run,
                        server=sm.ServerDelta(kv_usage_max=0.5, waiting_mean=2.2),
                        breakdown={"queueing": 0.05, "prefill": 0.3, "decode": 0.1})
    settings = PlanSettings(slo={"ttft": 0.5}, max_error_rate=0.05)
    p = judge(point, 4.0, settings)
    assert p.passed and p.errors == pytest.approx(1 / 40) and p.requests == 40
    assert len(steady_ttfts) == 30 and p.p99["ttft"] == pytest.approx(percentile(steady_ttfts, 99))
    assert _limiting(p) == "prefill"
    assert not judge(point, 4.0, PlanSettings(slo={"ttft": 0.5}, max_error_rate=0.0)).passed  # 1 error of 40
    over = judge(point, 4.0, PlanSettings(slo={"ttft": 0.3}))
    assert "ttft p99" in over.why and over.overshoot == pytest.approx(p.p99["ttft"] / 0.3)
    assert p.overshoot is None
    point.server.kv_usage_max = 0.97
    assert _limiting(judge(point, 4.0, settings)) == "KV pressure"
    # confident: the top of the p99's 95% interval (here the largest of 30 steady TTFTs) must be
    # within the SLO too, not only the p99 itself
    top = max(steady_ttfts)
    p99 = percentile(steady_ttfts, 99)
    assert p99 < top
    limit = {"ttft": (p99 + top) / 2}
    assert judge(point, 4.0, PlanSettings(slo=limit, max_error_rate=0.05)).passed
    strict = judge(point, 4.0, PlanSettings(slo=limit, max_error_rate=0.05), confident=True)
    assert not strict.passed and "95% interval" in strict.why
    assert strict.overshoot == pytest.approx(top / limit["ttft"])


def _plan_tiny(tmp_path, engine_options: dict, args: list[str]) -> dict:
    """`tokenmill plan` against a real server over the tiny model; the candidate's report."""
    from test_server_support import ThreadServer, make_tiny_app

    from tokenmill.entrypoints.cli.main import main

    out = tmp_path / "plan.json"
    app = make_tiny_app(engine_options)
    try:
        with ThreadServer(app) as srv:
            rc = main(["plan", "--candidate", f"tiny={srv.url}", *args, "--output", str(out)])
    finally:
        app.state.tokenmill.aengine.shutdown()
    assert rc == 0
    return json.loads(out.read_text())["candidates"][0]


@pytest.mark.slow
def test_a_prefill_bound_case_is_named_prefill(tmp_path) -> None:
    """600-token prompts in 32-token chunks, two tokens out, a TTFT SLO below one prefill: the SLO
    fails at every rate, and the server's own split puts the time in prefill."""
    cand = _plan_tiny(tmp_path, {"max_num_batched_tokens": 32},
                      ["--slo", "ttft=0.002", "--input-len", "600", "--output-len", "2", "--rate-min", "2",
                       "--start-rate", "2", "--rate-max", "8", "--probe-requests", "8", "--probe-seconds", "1"])
    assert cand["sustainable_rate"] is None and cand["limiting_factor"] == "prefill"
    last = min(cand["probes"], key=lambda p: p["rate"])
    assert last["breakdown"]["prefill"] > max(last["breakdown"]["queueing"], last["breakdown"]["decode"])


@pytest.mark.slow
def test_a_kv_bound_case_is_named_kv_pressure_and_more_kv_moves_the_limit(tmp_path) -> None:
    """Long answers (340 tokens, 22 blocks each) in a 30-block pool: past a few concurrent requests
    the server preempts (its counter says so) and the plan names KV pressure. The same workload with
    a 1024-block pool is limited by something else, at a higher rate."""
    args = ["--slo", "e2e=2", "--input-len", "40", "--output-len", "300", "--rate-min", "4", "--start-rate", "4",
            "--rate-max", "64", "--precision", "1.0", "--probe-requests", "16", "--probe-seconds", "1",
            "--steady-seconds", "0"]
    small = _plan_tiny(tmp_path, {"num_blocks": 30}, args)
    assert small["limiting_factor"] == "KV pressure", small["limiting_factor"]
    failing = next(p for p in small["probes"] if p["rate"] == small["failing_rate"])
    assert failing["preemptions"] > 0 or failing["kv_usage_max"] >= 0.95
    large = _plan_tiny(tmp_path, {"num_blocks": 1024}, args)
    assert large["limiting_factor"] != "KV pressure"
    assert all(not p["preemptions"] for p in large["probes"])
    assert (large["sustainable_rate"] or 0) >= (small["sustainable_rate"] or 0)


def test_a_probe_whose_latency_still_grows_is_not_sustainable() -> None:
    """Past capacity the queue grows all through a probe: the p99 may still be within the SLO
    when the probe ends, but the latencies of its last third are well above its first third's.
    The warm-up (the first quarter, when the batch is still filling) is left out."""
    from tokenmill.bench.plan import rising, steady_records
    from tokenmill.bench.types import RequestRecord

    def recs(ttfts):
        return [RequestRecord(index=i, start=float(i), ok=True, ttft=t, e2e=t + 1.0) for i, t in enumerate(ttfts)]

    slo = {"ttft": 2.0}
    flat = recs([0.9 if i < 10 else 0.3 for i in range(40)])  # a slow start, then steady
    steady = steady_records(flat)
    assert steady[0].start >= 0.25 * 39 and rising(steady, slo) == ""
    growing = recs([0.2 + 0.03 * i for i in range(40)])  # 0.2 s -> 1.37 s: within the SLO, rising
    why = rising(steady_records(growing), slo)
    assert why.startswith("ttft still rising")
    assert rising(steady_records(recs([0.01 + 0.001 * i for i in range(40)])), slo) == ""  # tiny next to the SLO
    assert rising(steady_records(recs([0.2 + 0.03 * i for i in range(12)])), slo) == ""  # too few to tell


def test_the_search_starts_at_saturation_and_steps_down_while_the_held_rate_misses(monkeypatch) -> None:
    """A server whose short probes hold up to 10 req/s but whose settled state holds only 8 (the
    batch keeps growing for minutes near capacity): the bisection lands near 10, the held run there
    misses, and the search steps down until a held run meets the SLO: by the square root of how far
    the held run's p99 overshot (within 1 + precision / 2 .. 1 + 2 x precision), or by the precision
    when the miss gives no latency figure."""
    import asyncio

    from tokenmill.bench import plan as planmod

    calls: list[tuple[float, float | None]] = []
    overshoot_of = {"none": lambda rate: None, "tpot": lambda rate: (rate / 8.0) ** 2}
    kind = ["tpot"]

    async def saturation(target, counter, workload, settings):
        return 6.0

    async def probe(target, counter, workload, settings, rate, seconds=None, warmup=planmod.WARMUP_FRACTION,
                    confident=False):
        calls.append((rate, seconds))
        limit = 8.0 if seconds else 10.0
        assert (warmup == planmod.STEADY_WARMUP_FRACTION) == bool(seconds) == confident
        passed = rate <= limit
        return planmod.Probe(rate=rate, passed=passed, requests=100, errors=0.0, p99={}, p99_interval={},
                             goodput=rate, throughput=rate, waiting_mean=1.0, running_mean=4.0, kv_usage_max=0.1,
                             breakdown={"decode": 1.0}, diagnosis="", why="" if passed else "tpot",
                             seconds=seconds, overshoot=None if passed else overshoot_of[kind[0]](rate))

    monkeypatch.setattr(planmod, "saturation", saturation)
    monkeypatch.setattr(planmod, "probe", probe)
    settings = planmod.PlanSettings(slo={"tpot": 0.2}, precision=0.1, steady_seconds=150.0)
    plan = planmod.CandidatePlan("x", "")
    asyncio.run(planmod.search(None, None, None, settings, plan))
    assert calls[0] == (6.0, None) and calls[1] == (12.0, None)  # the saturation throughput, then doubled
    held = [(r, s) for r, s in calls if s]
    assert held and all(s == 150.0 for _, s in held)
    assert held[0][0] > 9.0 and 8.0 / 1.2 < plan.sustainable_rate <= 8.0
    for (a, _), (b, _) in zip(held, held[1:]):  # the square root of the overshoot, clipped
        assert a / b == pytest.approx(min(max(a / 8.0, 1.05), 1.2))
    assert plan.steady is not None and plan.steady.rate == plan.sustainable_rate
    assert plan.failing_rate == pytest.approx(held[-2][0])
    # misses without a latency figure step by the precision
    calls.clear()
    kind[0] = "none"
    plan = planmod.CandidatePlan("x", "")
    asyncio.run(planmod.search(None, None, None, settings, plan))
    held = [r for r, s in calls if s]
    assert all(a / b == pytest.approx(1.1) for a, b in zip(held, held[1:]))
    assert 8.0 / 1.1 < plan.sustainable_rate <= 8.0
    # a settled state that holds nothing within the steps: no sustainable rate, said as such
    calls.clear()
    monkeypatch.setattr(planmod, "STEADY_STEPS", 2)
    plan = planmod.CandidatePlan("x", "")
    asyncio.run(planmod.search(None, None, None, settings, plan))
    assert plan.sustainable_rate is None and plan.steady is None
    assert "none held" in planmod.table([plan], settings)


def test_hold_step_follows_the_overshoot_within_bounds() -> None:
    from tokenmill.bench.plan import Probe, hold_step

    def missed(overshoot):
        return Probe(rate=1.0, passed=False, requests=10, errors=0.0, p99={}, p99_interval={}, goodput=None,
                     throughput=1.0, waiting_mean=None, running_mean=None, kv_usage_max=None, breakdown={},
                     diagnosis="", why="x", overshoot=overshoot)

    assert hold_step(missed(None), 0.2) == pytest.approx(1.2)
    assert hold_step(missed(1.02), 0.2) == pytest.approx(1.1)  # just past: at least half the precision
    assert hold_step(missed(1.44), 0.2) == pytest.approx(1.2)
    assert hold_step(missed(4.0), 0.2) == pytest.approx(1.4)  # far past: at most twice the precision


def test_a_held_run_whose_latency_trends_past_the_slo_fails() -> None:
    """Near capacity the queue grows slowly: a held run can meet the SLO while its TTFT climbs
    steadily. The group medians' trend, projected TREND_HORIZON_S ahead, fails it; noise around
    a flat level, or a climb too slow to reach the SLO in that time, does not."""
    import random

    from tokenmill.bench.loadgen import PointRun
    from tokenmill.bench.plan import TREND_HORIZON_S, PlanSettings, judge, projected_crossing
    from tokenmill.bench.runner import PointResult
    from tokenmill.bench.stats import summarize
    from tokenmill.bench.types import RequestRecord

    rng = random.Random(4)

    def recs(level):  # 400 requests over 80 s, each with its send time's TTFT level plus noise
        return [RequestRecord(index=i, start=0.2 * i, ok=True, ttft=max(0.01, level(0.2 * i) + rng.gauss(0, 0.1)),
                              e2e=2.0) for i in range(400)]

    slo = {"ttft": 2.0}
    flat = recs(lambda t: 0.6)
    assert projected_crossing(flat, slo, {"ttft": 0.9}) == ""
    climbing = recs(lambda t: 0.6 + 0.005 * t)  # 0.3 s a minute: past 2 s within ten minutes
    why = projected_crossing(climbing, slo, {"ttft": 1.2})
    assert why.startswith("ttft rising") and "> 2 s" in why
    creeping = recs(lambda t: 0.6 + 0.0002 * t)  # 0.012 s a minute: ten minutes add 0.12 s
    assert projected_crossing(creeping, slo, {"ttft": 0.9}) == ""
    assert TREND_HORIZON_S >= 300  # at least as far ahead as a five-minute verification
    # judge applies it to runs held for a set time (steady, --verify), not to short probes
    point = PointResult("rate=5/s", {}, summarize(climbing, slo), PointRun(records=climbing))
    assert judge(point, 5.0, PlanSettings(slo=slo)).passed
    held = judge(point, 5.0, PlanSettings(slo=slo), warmup=0.0, seconds=80.0)
    assert not held.passed and "rising" in held.why

"""`tokenmill plan`: the highest request rate each configuration holds under an SLO, and its price.

Sizing from one user on one machine says nothing about fifty. For each
candidate (a `tokenmill serve` command line started here, or a running
server's URL), the planner first measures what the server can do at all (a
short closed-loop run at ``saturation_concurrency``), then offers open-loop
Poisson load at that throughput (doubling while probes pass, halving down to
``rate_min`` / 4 while they fail), bisects between the last rate that met the
SLO and the first that did not until they are within ``precision``, and
finally holds the chosen rate for ``steady_seconds``, stepping down while that
longer run misses (by more the further it missed: ``hold_step``). A probe *meets* the SLO when its
error rate is at most ``max_error_rate`` and the p99 of every latency the SLO
names is within it.

Why the long last run: near capacity a continuous-batching server takes
minutes to settle. Each new request lengthens the batch and with it every
request's decode, which keeps more requests in flight; a 30-second probe from
an idle server sees a batch half the size it settles at, and its TPOT p99
passes where five minutes miss. The short probes find the neighbourhood
cheaply; only the chosen rate pays for a run long enough to settle.

Per candidate it reports the sustainable rate, goodput there, cost per 1,000
successful requests at that rate (``cost_per_hour`` / 3600 / goodput x
1000), replicas for a target peak (ceil(peak / sustainable)), the limiting
factor at the first failing rate (the server's own split of latency into
queueing, prefill and decode, or KV pressure when the KV pool filled), the
waiting-queue depth to put in the HPA, and how sure the p99 is: the
distribution-free 95% interval of the 99th percentile from the probe's
sample count. ``verify`` reruns the chosen rate for longer and says whether
the SLO held, then runs as long at ``VERIFY_OVER`` times that rate, which should
miss it: the two runs bracket the true limit as the search claimed.

Like the rest of bench/, this speaks HTTP only (no engine, no torch); a
candidate is started as a subprocess.
"""
from __future__ import annotations

import asyncio
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from tokenmill.bench.client import Target
from tokenmill.bench.loadgen import LoadShape
from tokenmill.bench.runner import BenchConfig, BenchResult, PointResult, resolve_model, run_bench
from tokenmill.bench.stats import percentile
from tokenmill.bench.tokens import TokenCounter, make_counter
from tokenmill.bench.types import RequestRecord

KV_PRESSURE = 0.95  # KV pool use at which a failing probe is called KV-bound
DOWN_STEPS_FACTOR = 4  # below the first rate, the search halves down to rate_min / 4 at most
VERIFY_OVER = 1.2  # --verify also runs this multiple of the sustainable rate, which should miss the SLO
STEADY_STEPS = 4  # at most this many steps down while the steady run misses


@dataclass
class Candidate:
    """``name=SERVE FLAGS`` (started here) or ``name=http://...`` (already running)."""

    name: str
    serve_args: list[str] | None = None
    url: str | None = None

    @classmethod
    def parse(cls, text: str) -> "Candidate":
        name, sep, rest = text.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"a candidate is NAME=SERVE_FLAGS or NAME=URL, got {text!r}")
        rest = rest.strip()
        if rest.startswith(("http://", "https://")):
            return cls(name.strip(), url=rest)
        import shlex

        return cls(name.strip(), serve_args=shlex.split(rest))


@dataclass
class PlanSettings:
    slo: dict[str, float]
    max_error_rate: float = 0.01
    rate_min: float = 0.25  # the search goes no lower than rate_min / DOWN_STEPS_FACTOR
    rate_max: float = 64.0
    start_rate: float | None = None  # None: the throughput of the saturation run
    saturation_concurrency: int = 32  # the closed-loop run that measures the server's throughput
    steady_seconds: float = 150.0  # the chosen rate is held this long (0: not held)
    precision: float = 0.2  # stop bisecting when the failing rate is within this of the passing one
    probe_requests: int = 60  # at least this many requests per probe
    probe_seconds: float = 30.0  # ... and at least this long at the probed rate
    cost_per_hour: float | None = None
    peak_rate: float | None = None
    verify_seconds: float | None = None

    def probe_count(self, rate: float) -> int:
        return max(self.probe_requests, math.ceil(rate * self.probe_seconds))


@dataclass
class Probe:
    rate: float
    passed: bool
    requests: int
    errors: float  # fraction failed
    p99: dict[str, float | None]  # per SLO latency
    p99_interval: dict[str, tuple[float, float] | None]  # distribution-free 95% interval of each p99
    goodput: float | None
    throughput: float
    waiting_mean: float | None
    running_mean: float | None
    kv_usage_max: float | None
    breakdown: dict[str, float]
    diagnosis: str
    why: str  # what failed, or "" when it passed
    overshoot: float | None = None  # the failing latency's p99 (or interval top) over its SLO; None: passed or no such figure
    preemptions: float | None = None  # during the probe (server counter)
    seconds: float | None = None  # how long requests were sent (the steady run and --verify set it)


@dataclass
class CandidatePlan:
    name: str
    how: str  # the serve flags or the URL
    sustainable_rate: float | None = None  # req/s; None: not even rate_min held
    failing_rate: float | None = None  # the lowest rate seen to fail
    saturation_throughput: float | None = None  # req/s of the closed-loop run that set the start
    goodput: float | None = None
    cost_per_1k_successful: float | None = None
    replicas: int | None = None
    limiting_factor: str | None = None
    hpa_waiting: int | None = None  # vllm:num_requests_waiting average to scale out at
    confidence: str = ""
    probes: list[Probe] = field(default_factory=list)
    steady: Probe | None = None  # the chosen rate held for steady_seconds
    verify: Probe | None = None
    verify_over: Probe | None = None  # the same length at VERIFY_OVER x the sustainable rate
    eval_verdict: str | None = None
    error: str | None = None
    search_seconds: float | None = None  # from the server's start to the end of the search, --verify not counted


def p99_interval(values: list[float], q: float = 0.99, z: float = 1.96) -> tuple[float, float] | None:
    """Ranks n*q -/+ z*sqrt(n*q*(1-q)) of the sorted values (the binomial bound on an order
    statistic): where the true p99 lies with about 95% confidence. Needs enough samples."""
    n = len(values)
    if n < 20:
        return None
    xs = sorted(values)
    half = z * math.sqrt(n * q * (1 - q))
    lo = max(0, math.floor(n * q - half) - 1)
    hi = min(n - 1, math.ceil(n * q + half) - 1)
    return xs[lo], xs[hi]


def _limiting(p: Probe) -> str:
    """What held the failing probe back: the KV pool when it filled (sampled usage near full, or
    any preemption, which happens only when it ran out), else the largest part of the server's
    own latency split."""
    if (p.kv_usage_max is not None and p.kv_usage_max >= KV_PRESSURE) or (p.preemptions or 0) > 0:
        return "KV pressure"
    if p.errors > 0 and not p.breakdown:
        return "errors"
    return max(p.breakdown, key=lambda k: p.breakdown[k]) if p.breakdown else "unknown"


# A probe starts from an idle server: the requests sent in its first quarter meet a batch still
# filling up, so they are left out of the p99s (they still count for errors and goodput).
WARMUP_FRACTION = 0.25
# The steady run is there to see the batch the rate settles at: only its second half is judged.
STEADY_WARMUP_FRACTION = 0.5
# Past capacity the queue (and with it TTFT, or the batch and with it TPOT) grows all through a
# probe: a latency whose median over the probe's last third is this many times its median over
# the first third after warm-up, and higher by a tenth of its SLO, marks the rate as unsustainable
# even while its p99 is still within the SLO.
TREND_RATIO = 1.5


def _latency(r: RequestRecord, key: str) -> float | None:
    if key == "itl":
        return max(r.itls) if r.itls else None
    return getattr(r, key)


def steady_records(records: list[RequestRecord], warmup: float = WARMUP_FRACTION) -> list[RequestRecord]:
    """The successful requests sent after the probe's warm-up (this fraction of its sending
    time), in the order they were sent."""
    ok = sorted((r for r in records if r.ok), key=lambda r: r.start)
    if not ok:
        return []
    end = max(r.start for r in records)
    return [r for r in ok if r.start >= warmup * end]


def rising(records: list[RequestRecord], slo: dict[str, float]) -> str:
    """Why the latencies of these steady-state requests (in send order) still grow, or ""."""
    third = len(records) // 3
    if third < 5:
        return ""
    for key, limit in slo.items():
        first = [v for v in (_latency(r, key) for r in records[:third]) if v is not None]
        last = [v for v in (_latency(r, key) for r in records[-third:]) if v is not None]
        if len(first) < 5 or len(last) < 5:
            continue
        a, b = percentile(first, 50), percentile(last, 50)
        if a is not None and b is not None and b > TREND_RATIO * a and b - a > 0.1 * limit:
            return f"{key} still rising (median {a:.3f} s -> {b:.3f} s over the probe)"
    return ""


# A held run (or --verify) that meets the SLO may still be past capacity: near it the queue
# grows slowly enough that 150 s pass and five minutes miss (measured on the bundled model at
# its closed-loop throughput). Its latencies are cut into TREND_GROUPS runs of requests in send
# order; a latency whose group medians rise with time (least squares, t >= TREND_T) fast enough
# to take its p99 past the SLO within TREND_HORIZON_S more seconds fails the run. Group medians,
# not single requests: neighbouring requests share a queue, so their latencies are not
# independent draws and a per-request fit would call noise a trend.
TREND_GROUPS = 10
TREND_T = 3.0
TREND_HORIZON_S = 600.0


def projected_crossing(records: list[RequestRecord], slo: dict[str, float],
                       p99: dict[str, float | None]) -> str:
    """Why these steady-state requests' latencies (in send order) are on their way past the
    SLO, or ""."""
    n = len(records) // TREND_GROUPS
    if n < 3:
        return ""
    for key, limit in slo.items():
        times, medians = [], []
        for g in range(TREND_GROUPS):
            group = records[g * n:(g + 1) * n]
            values = [v for v in (_latency(r, key) for r in group) if v is not None]
            if len(values) >= 3:
                times.append(sum(r.start for r in group) / len(group))
                medians.append(percentile(values, 50))
        if len(times) < TREND_GROUPS // 2 or p99.get(key) is None:
            continue
        k = len(times)
        mt, mv = sum(times) / k, sum(medians) / k
        sxx = sum((t - mt) ** 2 for t in times)
        if sxx <= 0:
            continue
        slope = sum((t - mt) * (v - mv) for t, v in zip(times, medians)) / sxx
        resid = sum((v - mv - slope * (t - mt)) ** 2 for t, v in zip(times, medians))
        se = math.sqrt(resid / (k - 2) / sxx) if resid > 0 else 0.0
        if slope <= 0 or (se > 0 and slope / se < TREND_T):
            continue
        ahead = float(p99[key]) + slope * TREND_HORIZON_S  # type: ignore[arg-type]
        if ahead > limit:
            return (f"{key} rising {60 * slope:.3f} s a minute: its p99 would reach {ahead:.2f} s > {limit:g} s "
                    f"within {TREND_HORIZON_S / 60:g} more minutes")
    return ""


def judge(point: PointResult, rate: float, settings: PlanSettings, warmup: float = WARMUP_FRACTION,
          seconds: float | None = None, confident: bool = False) -> Probe:
    """The probe's verdict. ``confident``: a latency passes only when the top of its p99's 95%
    interval is within the SLO (the steady run: the rate the plan recommends must hold with
    that confidence, not only on this sample)."""
    recs = [r for r in point.run.records]
    ok = steady_records(recs, warmup)  # the p99s are of the steady state; errors count every request
    values = {"ttft": [r.ttft for r in ok if r.ttft is not None],
              "tpot": [r.tpot for r in ok if r.tpot is not None],
              "e2e": [r.e2e for r in ok if r.e2e is not None],
              "itl": [max(r.itls) for r in ok if r.itls]}
    s = point.summary
    errors = sum(1 for r in recs if not r.ok) / len(recs) if recs else 1.0
    p99 = {k: percentile(values[k], 99) for k in settings.slo}  # itl: of each request's longest gap
    intervals = {k: p99_interval(values[k]) for k in settings.slo}
    why = []
    over: list[float] = []
    if errors > settings.max_error_rate:
        why.append(f"{100 * errors:.1f}% errors")
    for k, limit in settings.slo.items():
        v, iv = p99[k], intervals[k]
        if v is None or v > limit:
            why.append(f"{k} p99 {'-' if v is None else f'{v:.3f}'} s > {limit:g} s")
            if v is not None:
                over.append(v / limit)
        elif confident and iv is not None and iv[1] > limit:
            why.append(f"{k} p99 {v:.3f} s, but its 95% interval reaches {iv[1]:.3f} s > {limit:g} s")
            over.append(iv[1] / limit)
    trend = rising(ok, settings.slo) or (projected_crossing(ok, settings.slo, p99) if seconds else "")
    if trend and not why:
        why.append(trend)
    d = point.server
    return Probe(rate=rate, passed=not why, requests=len(recs), errors=errors, p99=p99,
                 p99_interval=intervals, goodput=s.goodput,
                 throughput=s.request_throughput, waiting_mean=d.waiting_mean if d else None,
                 running_mean=d.running_mean if d else None, kv_usage_max=d.kv_usage_max if d else None,
                 breakdown=point.breakdown, diagnosis=point.diagnosis, why="; ".join(why),
                 preemptions=d.preemptions if d else None, seconds=seconds,
                 overshoot=max(over) if over and why else None)


def _bench_config(workload: BenchConfig, settings: PlanSettings, shape: LoadShape, n: int) -> BenchConfig:
    return BenchConfig(shapes=[shape], num_requests=n, synthetic=workload.synthetic, dataset=workload.dataset,
                       trace=workload.trace, output_len=workload.output_len, slo=settings.slo,
                       cost_per_hour=settings.cost_per_hour, seed=workload.seed, timeout=workload.timeout,
                       progress=False, metrics_interval=workload.metrics_interval)


async def probe(target: Target, counter: TokenCounter, workload: BenchConfig, settings: PlanSettings,
                rate: float, seconds: float | None = None, warmup: float = WARMUP_FRACTION,
                confident: bool = False) -> Probe:
    """One open-loop point at ``rate`` req/s (fresh salt, so no cache carries over)."""
    n = max(settings.probe_requests, math.ceil(rate * seconds)) if seconds else settings.probe_count(rate)
    result = BenchResult(target={}, config={})
    await run_bench(_bench_config(workload, settings, LoadShape(rate=rate), n), target, counter, result)
    return judge(result.points[0], rate, settings, warmup, seconds, confident)


async def saturation(target: Target, counter: TokenCounter, workload: BenchConfig,
                     settings: PlanSettings) -> float | None:
    """Requests per second the server completes with ``saturation_concurrency`` clients that
    send again as soon as they are answered: where that many fill the server, no open-loop
    rate above it holds; where the server batches more, the open-loop limit can lie above it
    (the search doubles past it then). Either way a start near the limit, found in seconds
    where doubling from a low rate took minutes; where it misses, the next probe is half. Three rounds of the clients, so the first
    round's shared start weighs little. None when nothing succeeded."""
    c = max(1, settings.saturation_concurrency)
    result = BenchResult(target={}, config={})
    await run_bench(_bench_config(workload, settings, LoadShape(concurrency=c), 3 * c), target, counter, result)
    s = result.points[0].summary
    return s.request_throughput if s.completed else None


async def search(target: Target, counter: TokenCounter, workload: BenchConfig, settings: PlanSettings,
                 plan: CandidatePlan, log: Any = None, started: float | None = None) -> None:
    """From the saturation throughput: doubling or halving to a bracket, bisection to
    ``precision``, then the chosen rate held for ``steady_seconds`` (stepping down while it misses)."""
    def note(p: Probe) -> None:
        plan.probes.append(p)
        if log:
            held = f" for {p.seconds:g} s" if p.seconds else ""
            log(f"  {plan.name}: {p.rate:.3g} req/s{held} {'meets' if p.passed else 'misses'} the SLO"
                + (f" ({p.why})" if p.why else ""))

    start = settings.start_rate
    if start is None:
        plan.saturation_throughput = await saturation(target, counter, workload, settings)
        if log and plan.saturation_throughput is not None:
            log(f"  {plan.name}: {plan.saturation_throughput:.3g} req/s with "
                f"{settings.saturation_concurrency} clients in a closed loop")
        start = plan.saturation_throughput or settings.rate_min
    floor = settings.rate_min / DOWN_STEPS_FACTOR
    rate = min(max(start, floor), settings.rate_max)
    good: Probe | None = None
    bad: Probe | None = None
    while rate <= settings.rate_max:
        p = await probe(target, counter, workload, settings, rate)
        note(p)
        if not p.passed:
            bad = p
            break
        good = p
        rate *= 2
    # Missed at the first rate: halve (slow rates make long probes) to find one that holds.
    while good is None and bad is not None and bad.rate / 2 >= floor:
        p = await probe(target, counter, workload, settings, bad.rate / 2)
        note(p)
        if p.passed:
            good = p
        else:
            bad = p
    while good is not None and bad is not None and bad.rate / good.rate - 1 > settings.precision:
        mid = math.sqrt(good.rate * bad.rate)
        p = await probe(target, counter, workload, settings, mid)
        note(p)
        if p.passed:
            good = p
        else:
            bad = p
    if good is not None and settings.steady_seconds > 0:
        good, bad = await _hold(target, counter, workload, settings, good, bad, note)
        plan.steady = good
    _conclude(plan, good, bad, settings)
    if started is not None:
        plan.search_seconds = time.monotonic() - started
        if log:
            log(f"  {plan.name}: search took {plan.search_seconds / 60:.1f} min")
    if good is not None and settings.verify_seconds:
        plan.verify = await probe(target, counter, workload, settings, good.rate, settings.verify_seconds)
        over = good.rate * VERIFY_OVER
        plan.verify_over = await probe(target, counter, workload, settings, over, settings.verify_seconds)
        if log:
            for rate, v in ((good.rate, plan.verify), (over, plan.verify_over)):
                log(f"  {plan.name}: verify {rate:.3g} req/s for {settings.verify_seconds:g} s: "
                    + ("SLO held" if v.passed else f"SLO missed ({v.why})"))


async def _hold(target: Target, counter: TokenCounter, workload: BenchConfig, settings: PlanSettings,
                good: Probe, bad: Probe | None, note: Any) -> tuple[Probe | None, Probe | None]:
    """Hold the chosen rate for ``steady_seconds``, judged on its second half and with the p99s'
    95% intervals within the SLO; while that misses, step down (``hold_step``) and hold again
    (at most STEADY_STEPS times). Returns the steady run that held (None if none did) and the
    lowest rate seen to miss."""
    rate = good.rate
    for _ in range(STEADY_STEPS):
        p = await probe(target, counter, workload, settings, rate, settings.steady_seconds, STEADY_WARMUP_FRACTION,
                        confident=True)
        note(p)
        if p.passed:
            return p, bad
        bad = p if bad is None or p.rate < bad.rate else bad
        rate /= hold_step(p, settings.precision)
        if rate < settings.rate_min / DOWN_STEPS_FACTOR:
            break
    return None, bad


def hold_step(missed: Probe, precision: float) -> float:
    """The factor to divide a held rate that missed by: the square root of how far its worst
    p99 overshot the SLO, kept between 1 + precision / 2 and 1 + 2 x precision.

    Why the root: near capacity a decode-bound latency grows like 1 / (1 - rate / capacity),
    so a p99 twice the SLO means the rate is well past the knee, and one a few percent over
    means it is just past it. The held runs are the expensive part of a search (each is
    ``steady_seconds``); a step of the precision from a run that missed by 2x took four of them
    where two do. The square root undershoots that curve's own answer on purpose: a step too
    far costs precision, one too short costs another held run. A miss with no latency figure
    (errors, a latency still rising) steps by the precision."""
    if missed.overshoot is None:
        return 1 + precision
    return min(max(math.sqrt(missed.overshoot), 1 + precision / 2), 1 + 2 * precision)


def _conclude(plan: CandidatePlan, good: Probe | None, bad: Probe | None, settings: PlanSettings) -> None:
    plan.failing_rate = bad.rate if bad else None
    plan.limiting_factor = _limiting(bad) if bad else f"none up to {settings.rate_max:g} req/s"
    if good is None:
        return
    plan.sustainable_rate = good.rate
    plan.goodput = good.goodput if good.goodput is not None else good.throughput
    if settings.cost_per_hour is not None and plan.goodput:
        plan.cost_per_1k_successful = settings.cost_per_hour / 3600.0 / plan.goodput * 1000.0
    if settings.peak_rate:
        plan.replicas = max(1, math.ceil(settings.peak_rate / good.rate))
    if good.waiting_mean is not None:
        plan.hpa_waiting = max(1, math.ceil(good.waiting_mean))
    sure = []
    for k, limit in settings.slo.items():
        iv = good.p99_interval.get(k)
        if iv is None:
            sure.append(f"{k}: too few samples for an interval")
        elif iv[1] <= limit:
            sure.append(f"{k} p99 95% interval {iv[0]:.3f}-{iv[1]:.3f} s, within {limit:g} s")
        else:
            sure.append(f"{k} p99 95% interval {iv[0]:.3f}-{iv[1]:.3f} s reaches past {limit:g} s (marginal)")
    plan.confidence = "; ".join(sure)


# -------------------------------------------------------------------------- servers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    """A `tokenmill serve` subprocess on a free loopback port, stopped on exit."""

    def __init__(self, args: list[str], startup_s: float = 600.0) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="tokenmill-plan-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli.main", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + startup_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"`tokenmill serve {' '.join(args)}` exited ({self.proc.returncode}); "
                                   f"see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"`tokenmill serve {' '.join(args)}` did not start in {startup_s:g} s")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if self.proc.returncode in (0, -15):
            os.unlink(self.log.name)


async def plan_candidate(cand: Candidate, target_template: Target, tokenizer: str | None, workload: BenchConfig,
                         settings: PlanSettings, log: Any = None) -> CandidatePlan:
    plan = CandidatePlan(cand.name, cand.url or " ".join(cand.serve_args or []) or "(defaults)")
    served = None
    started = time.monotonic()
    try:
        if cand.url is None:
            if log:
                log(f"{cand.name}: starting tokenmill serve {plan.how}")
            served = Served(cand.serve_args or [])
            url = served.url
        else:
            url = cand.url.rstrip("/")
        target = Target(url, target_template.model, target_template.endpoint, target_template.api_key,
                        ignore_eos=target_template.ignore_eos, temperature=target_template.temperature)
        async with httpx.AsyncClient(trust_env=False) as client:
            if not target.model:
                target.model = await resolve_model(client, url, target.api_key)
            else:
                await _reachable(client, url)
        counter = await asyncio.to_thread(make_counter, tokenizer, url, target.model, target.api_key, True)
        try:
            await search(target, counter, workload, settings, plan, log, started)
        finally:
            counter.close()
        if plan.probes and all(p.errors >= 1.0 for p in plan.probes):
            plan.error = (f"every request failed at every rate probed: is {url} serving model "
                          f"{target.model!r}? (see the probes above)")
    except (RuntimeError, OSError, ValueError, httpx.HTTPError) as exc:
        plan.error = str(exc)
    finally:
        if served is not None:
            served.stop()
    return plan


async def _reachable(client: httpx.AsyncClient, url: str) -> None:
    """A server that does not answer at all is an error, not a plan with no sustainable rate."""
    try:
        await client.get(url + "/v1/models", timeout=15.0)
    except httpx.HTTPError as exc:
        raise RuntimeError(f"cannot reach {url}: {exc or type(exc).__name__}") from None


def apply_eval(plans: list[CandidatePlan], eval_path: str) -> None:
    """The eval's verdict per candidate: its base goes with the first candidate (the reference),
    its candidates with the next ones, in order."""
    import json

    doc = json.loads(open(eval_path, encoding="utf-8").read())
    if not isinstance(doc, dict) or "base" not in doc:
        raise ValueError(f"{eval_path} is not a tokenmill eval result")
    verdicts = ["reference"] + ["PASS" if k.get("passed") else "FAIL" for k in doc.get("comparisons", [])]
    for plan, verdict in zip(plans, verdicts):
        plan.eval_verdict = verdict


def to_dict(plans: list[CandidatePlan], settings: PlanSettings) -> dict[str, Any]:
    return {"tokenmill_plan": 1, "settings": asdict(settings), "candidates": [asdict(p) for p in plans]}


def _held(p: CandidatePlan, settings: PlanSettings) -> str:
    """The steady run's outcome, as the table says it."""
    if p.steady is not None:
        return "SLO held"
    if settings.steady_seconds and any(pr.seconds == settings.steady_seconds for pr in p.probes):
        return "no rate held"
    return "-"


def table(plans: list[CandidatePlan], settings: PlanSettings) -> str:
    def f(x: Any, fmt: str = "{:.3g}") -> str:
        return "-" if x is None else fmt.format(x)

    rows = [("candidate", [p.name for p in plans]),
            ("sustainable rate (req/s)", [f(p.sustainable_rate) if p.sustainable_rate is not None else
                                          "none held" if _held(p, settings) == "no rate held" else
                                          f"< {settings.rate_min / DOWN_STEPS_FACTOR:g}" for p in plans]),
            ("first failing rate (req/s)", [f(p.failing_rate) for p in plans]),
            ("closed-loop throughput (req/s)", [f(p.saturation_throughput) for p in plans]),
            (f"held for {settings.steady_seconds:g} s", [_held(p, settings) for p in plans]),
            ("goodput there (req/s)", [f(p.goodput) for p in plans]),
            ("$/1k successful", [f(p.cost_per_1k_successful, "{:.4f}") for p in plans]),
            (f"replicas for {settings.peak_rate:g} req/s" if settings.peak_rate else "replicas",
             [f(p.replicas, "{}") for p in plans]),
            ("limiting factor", [p.limiting_factor or "-" for p in plans]),
            ("HPA: waiting requests", [f(p.hpa_waiting, "{}") for p in plans]),
            ("eval gate", [p.eval_verdict or "-" for p in plans]),
            ("verified", ["-" if p.verify is None else ("SLO held" if p.verify.passed else "SLO missed")
                          for p in plans]),
            (f"verified at {VERIFY_OVER:g}x", ["-" if p.verify_over is None else
                                              ("SLO held" if p.verify_over.passed else "SLO missed")
                                              for p in plans])]
    width0 = max(len(r[0]) for r in rows)
    widths = [max(len(r[1][i]) for r in rows) for i in range(len(plans))]
    lines = ["  ".join([name.ljust(width0)] + [c.rjust(w) for c, w in zip(cells, widths)]) for name, cells in rows]
    lines.insert(1, "-" * len(lines[0]))
    for p in plans:
        if p.error:
            lines.append(f"{p.name}: error: {p.error}")
        if p.confidence:
            lines.append(f"{p.name}: {p.confidence}")
        if p.verify is not None and not p.verify.passed:
            lines.append(f"{p.name}: verification missed the SLO: {p.verify.why}")
        if p.verify_over is not None and p.verify_over.passed:
            lines.append(f"{p.name}: {VERIFY_OVER:g}x the sustainable rate also held the SLO for "
                         f"{p.verify_over.requests} requests: the limit lies higher than the search found")
    return "\n".join(lines)


def run(cands: list[Candidate], target: Target, tokenizer: str | None, workload: BenchConfig,
        settings: PlanSettings, log: Any = None) -> list[CandidatePlan]:
    return [asyncio.run(plan_candidate(c, target, tokenizer, workload, settings, log)) for c in cands]


# -------------------------------------------------------------------------- command line

EPILOG = """examples:
  tokenmill plan --candidate f32="--quantization none" --candidate default="" \
      --input-len 256 --output-len 64 --slo ttft=2,tpot=0.25 --cost-per-hour 0.20 --peak-rate 10
  tokenmill plan --candidate base=http://127.0.0.1:8001 --candidate int4=http://127.0.0.1:8002 \
      --trace capture.jsonl --slo ttft=1 --verify 300 --output plan.json --plot plan.png
"""


def add_plan_parser(sub: Any) -> None:
    import argparse

    from tokenmill.bench.workloads import add_workload_arguments

    p = sub.add_parser("plan", allow_abbrev=False, help="the highest rate each configuration holds under an SLO",
                       description=__doc__.splitlines()[0], epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    c = p.add_argument_group("candidates and targets")
    c.add_argument("--candidate", action="append", required=True, metavar="NAME=FLAGS|URL",
                   help="a configuration: NAME=\"tokenmill serve flags\" (started here on loopback) or "
                        "NAME=http://... (a running server); repeat; the first is the reference")
    c.add_argument("--slo", required=True, help="latency targets on p99: ttft=SECONDS,tpot=...,itl=...,e2e=...")
    c.add_argument("--max-error-rate", type=float, default=0.01, help="failed requests allowed (default 0.01)")
    c.add_argument("--cost-per-hour", type=float, default=None, help="dollars per hour for one replica")
    c.add_argument("--peak-rate", type=float, default=None, help="the peak req/s to size replicas for")
    c.add_argument("--eval-result", default=None, metavar="EVAL.json",
                   help="a tokenmill eval result: its verdict per candidate (its base goes with the first)")
    s = p.add_argument_group("search")
    s.add_argument("--rate-min", type=float, default=0.25,
                   help="the search goes no lower than a quarter of this, req/s (default 0.25)")
    s.add_argument("--start-rate", type=float, default=None,
                   help="first rate probed (default: the throughput of the closed-loop run)")
    s.add_argument("--saturation-concurrency", type=int, default=32,
                   help="clients of the closed-loop run that bounds the search (default 32)")
    s.add_argument("--steady-seconds", type=float, default=150.0,
                   help="hold the chosen rate this long, judged on its second half, stepping down "
                        "while it misses (default 150; 0: do not)")
    s.add_argument("--rate-max", type=float, default=64.0, help="highest rate probed (default 64)")
    s.add_argument("--precision", type=float, default=0.2,
                   help="stop when the failing rate is within this fraction of the passing one (default 0.2, "
                        "the margin --verify checks from above)")
    s.add_argument("--probe-requests", type=int, default=60, help="at least this many requests per probe")
    s.add_argument("--probe-seconds", type=float, default=30.0, help="and at least this long (default 30)")
    s.add_argument("--verify", type=float, default=None, metavar="SECONDS",
                   help="rerun the sustainable rate this long and say whether the SLO held, then "
                        "1.2x that rate as long (it should miss)")
    t = p.add_argument_group("requests")
    t.add_argument("--model", default=None, help="model name (default: the server's first)")
    t.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    t.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    t.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s")
    add_workload_arguments(p.add_argument_group("workload (as tokenmill bench)"))
    o = p.add_argument_group("output")
    o.add_argument("--output", default=None, help="write the plan (every probe) as JSON")
    o.add_argument("--plot", default=None, help="latency p99 against rate, with the SLO line (PNG)")
    p.set_defaults(func=plan_main)


def plan_main(args: Any) -> int:
    import json

    from tokenmill.bench.lengths import parse_length
    from tokenmill.bench.stats import parse_slo
    from tokenmill.bench.workloads import SyntheticConfig

    try:
        cands = [Candidate.parse(c) for c in args.candidate]
        slo = parse_slo(args.slo)
        if not slo:
            raise ValueError("--slo needs at least one target")
        settings = PlanSettings(slo=slo, max_error_rate=args.max_error_rate, rate_min=args.rate_min,
                                rate_max=args.rate_max, precision=args.precision,
                                probe_requests=args.probe_requests, probe_seconds=args.probe_seconds,
                                start_rate=args.start_rate, saturation_concurrency=args.saturation_concurrency,
                                steady_seconds=args.steady_seconds,
                                cost_per_hour=args.cost_per_hour, peak_rate=args.peak_rate,
                                verify_seconds=args.verify)
        if not 0 < settings.rate_min <= settings.rate_max or settings.precision <= 0:
            raise ValueError("need 0 < --rate-min <= --rate-max and --precision > 0")
        if settings.start_rate is not None and settings.start_rate <= 0:
            raise ValueError("--start-rate must be positive")
        if settings.saturation_concurrency < 1 or settings.steady_seconds < 0:
            raise ValueError("need --saturation-concurrency >= 1 and --steady-seconds >= 0")
        workload = BenchConfig(
            shapes=[], synthetic=SyntheticConfig(parse_length(args.input_len or "256"),
                                                 parse_length(args.output_len or "64"), args.prefix_len,
                                                 args.num_prefixes, args.prefix_pick),
            dataset=args.dataset, trace=args.trace, output_len=parse_length(args.output_len or "64"),
            seed=args.seed, timeout=args.timeout)
    except ValueError as exc:
        print(f"tokenmill plan: {exc}", file=sys.stderr)
        return 2
    target = Target("", args.model or "", args.endpoint, args.api_key)
    plans = run(cands, target, args.tokenizer, workload, settings,
                log=lambda line: print(line, file=sys.stderr, flush=True))
    if args.eval_result:
        try:
            apply_eval(plans, args.eval_result)
        except (OSError, ValueError) as exc:
            print(f"tokenmill plan: --eval-result: {exc}", file=sys.stderr)
    print(table(plans, settings))
    for p in plans:
        if p.error:
            print(f"tokenmill plan: error: {p.name}: {p.error}", file=sys.stderr)
    doc = to_dict(plans, settings)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=2)
    if args.plot:
        write_plot(doc, args.plot)
    return 1 if any(p.error for p in plans) else 0


def write_plot(doc: dict[str, Any], path: str) -> None:
    """p99 of each SLO latency against the probed rate, one line per candidate, the SLO dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slo = doc["settings"]["slo"]
    fig, axes = plt.subplots(1, len(slo), figsize=(5 * len(slo), 4), squeeze=False)
    for ax, (key, limit) in zip(axes[0], slo.items()):
        for cand in doc["candidates"]:
            pts = sorted((p["rate"], p["p99"].get(key)) for p in cand["probes"] if p["p99"].get(key) is not None)
            if pts:
                ax.plot([r for r, _ in pts], [v for _, v in pts], marker="o", label=cand["name"])
        ax.axhline(limit, linestyle="--", color="red", label=f"SLO {limit:g} s")
        ax.set_xscale("log")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{key} p99 (s)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

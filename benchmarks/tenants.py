"""Tenants sharing one engine: FCFS against fair share and priority classes, in one run.

Open-loop arrivals (Poisson, seeded) drive the engine directly (the bundled
SmolLM2, float32), so the figures are the scheduler's, not HTTP's. Each request
is a prompt of ``--prompt-len`` random token ids and ``--output-len`` output
tokens (EOS ignored).

``fair`` (default): tenant B sends ``--ratio`` times tenant A's load (together
past what the engine serves, so a queue builds). Three scenarios, one engine:
A alone; A and B under FCFS; A and B under ``--scheduling-policy fair``.
Prints A's TTFT p50/p99 in each (an A request with no token when the run
stops, at 1.5 x the arrival window, counts with the time it had waited: a lower bound), B's output throughput under FCFS and fair,
and the ratios the policy is judged by (A's TTFT p50 under fair over A alone;
B's throughput under fair over FCFS).

``priority``: a high class and a low class; the low class alone overloads the
engine. Scenarios: high alone; high and low under ``priority``. Prints the high
class's TTFT p99 in both and their ratio, and the longest time a low-class
request waited for its first token, and to its last, against the starvation bound; arrivals the server
would refuse (the low class's queue limit, or a queue too long to start within the
bound) count as 429s.

    .venv/bin/python benchmarks/tenants.py [fair|priority] [--duration 30] [--rate-a 0.5] [--ratio 10]
"""
from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field

from tokenmill import LLM, SamplingParams
from tokenmill.bench.stats import percentile
from tokenmill.engine.sched.fairness import make_queue_order
from tokenmill.engine.request import Placement


@dataclass
class Arrival:
    at: float
    tenant: str
    placement: Placement
    prompt: list[int]


@dataclass
class Outcome:
    ttft: dict[str, list[float]] = field(default_factory=dict)
    output_tokens: dict[str, int] = field(default_factory=dict)  # produced within the arrival window
    longest_wait: dict[str, float] = field(default_factory=dict)  # arrival to first token
    longest_latency: dict[str, float] = field(default_factory=dict)  # arrival to the last token
    refused: dict[str, int] = field(default_factory=dict)  # arrivals past the tenant's queue limit (429s)


def arrivals(rates: dict[str, tuple[float, Placement]], duration: float, prompt_len: int, vocab: int,
             seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    out = []
    for tenant, (rate, placement) in rates.items():
        t = rng.expovariate(rate)
        while t < duration:
            out.append(Arrival(t, tenant, placement, [rng.randrange(100, vocab) for _ in range(prompt_len)]))
            t += rng.expovariate(rate)
    return sorted(out, key=lambda a: a.at)


def run(llm: LLM, policy: str, plan: list[Arrival], duration: float, output_len: int, bound: float,
        max_queued: dict[str, int] | None = None) -> Outcome:
    """``max_queued``: per tenant, the sequences it may have waiting (the keys file's limit,
    which the server answers with 429): arrivals past it are refused and counted, as are
    those whose queue would make them wait past the starvation bound (the server's
    ``class_backlog`` 429, ``Scheduler.backlog``)."""
    engine = llm.engine
    assert not engine.has_unfinished()
    engine.scheduler.order = make_queue_order(policy, bound)  # idle: the queue order may change
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    outcome = Outcome()
    tenant_of: dict[str, Arrival] = {}
    first: dict[str, float] = {}
    start = time.monotonic()
    queue = list(plan)
    while True:
        now = time.monotonic() - start
        while queue and queue[0].at <= now:
            a = queue.pop(0)
            limit = (max_queued or {}).get(a.tenant)
            if (limit is not None and sum(r.placement.tenant == a.placement.tenant
                                          for r in engine.scheduler.waiting) >= limit
                    or engine.scheduler.backlog(a.placement) is not None):  # the server's two 429s
                outcome.refused[a.tenant] = outcome.refused.get(a.tenant, 0) + 1
                continue
            rid = f"{a.tenant}-{len(tenant_of)}"
            tenant_of[rid] = a
            engine.add_request(rid, a.prompt, params, arrival_time=start + a.at, placement=a.placement)
        waiting_a = [r for r, a in tenant_of.items() if r not in first and a.tenant == "A"]
        if now > 1.5 * duration or (not queue and now > duration and not waiting_a):
            break
        if not engine.has_unfinished():
            if queue:
                time.sleep(max(0.0, queue[0].at - now))
            continue
        for delta in engine.step():
            t = time.monotonic() - start
            a = tenant_of[delta.request_id]
            if delta.token_ids and delta.request_id not in first:
                first[delta.request_id] = t
                outcome.ttft.setdefault(a.tenant, []).append(t - a.at)
                outcome.longest_wait[a.tenant] = max(outcome.longest_wait.get(a.tenant, 0.0), t - a.at)
            if delta.finished:
                outcome.longest_latency[a.tenant] = max(outcome.longest_latency.get(a.tenant, 0.0), t - a.at)
            if t <= duration:
                outcome.output_tokens[a.tenant] = outcome.output_tokens.get(a.tenant, 0) + len(delta.token_ids)
    engine_unfinished = set(engine._groups)  # what is left past the window
    for rid in engine_unfinished:
        engine.abort_request(rid)
    for rid, a in tenant_of.items():  # never got a token: waited at least until now (a lower bound)
        if rid not in first:
            outcome.longest_wait[a.tenant] = max(outcome.longest_wait.get(a.tenant, 0.0), now - a.at)
            if a.tenant == "A":
                outcome.ttft.setdefault("A", []).append(now - a.at)
        if rid in engine_unfinished:  # unfinished: its latency is at least this
            outcome.longest_latency[a.tenant] = max(outcome.longest_latency.get(a.tenant, 0.0), now - a.at)
    return outcome


def pct(xs: list[float], q: float) -> float:
    value = percentile(xs, q)
    return float("nan") if value is None else value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("case", nargs="?", default="fair", choices=["fair", "priority"])
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per scenario")
    ap.add_argument("--rate-a", type=float, default=0.5, help="tenant A's (or the high class's) requests/s")
    ap.add_argument("--ratio", type=float, default=10.0, help="B's (or the low class's) load over A's")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--starvation-bound", type=float, default=10.0)
    ap.add_argument("--low-max-queued", type=int, default=16,
                    help="priority case: the low class's queued-sequence limit (429 past it)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    llm = LLM(max_num_seqs=args.max_num_seqs, kv_cache_memory="1GiB",
              num_threads=args.threads)
    vocab = llm.engine.model_config.vocab_size
    d, bound = args.duration, args.starvation_bound
    rate_b = args.rate_a * args.ratio

    def plan(with_b: bool, a: Placement, b: Placement) -> list[Arrival]:
        rates = {"A": (args.rate_a, a)}
        if with_b:
            rates["B"] = (rate_b, b)
        return arrivals(rates, d, args.prompt_len, vocab, args.seed)

    run(llm, "fcfs", plan(False, Placement("A"), Placement("B"))[:4], 1.0, args.output_len, bound)  # warm up
    if args.case == "fair":
        a, b = Placement("A"), Placement("B")
        alone = run(llm, "fcfs", plan(False, a, b), d, args.output_len, bound)
        fcfs = run(llm, "fcfs", plan(True, a, b), d, args.output_len, bound)
        fair = run(llm, "fair", plan(True, a, b), d, args.output_len, bound)
        print(f"A {args.rate_a}/s, B {rate_b}/s, {args.prompt_len} prompt + {args.output_len} output tokens, "
              f"{d:.0f}s of arrivals each, max_num_seqs {args.max_num_seqs}")
        for name, o in (("A alone", alone), ("A+B fcfs", fcfs), ("A+B fair", fair)):
            a_ttft = o.ttft.get("A", [])
            print(f"{name:9s}  A TTFT p50 {pct(a_ttft, 50) * 1000:7.0f} ms  p99 {pct(a_ttft, 99) * 1000:7.0f} ms "
                  f"({len(a_ttft)} req)   B output {o.output_tokens.get('B', 0) / d:6.1f} tok/s   "
                  f"A output {o.output_tokens.get('A', 0) / d:5.1f} tok/s")
        base = pct(alone.ttft["A"], 50)
        print(f"A TTFT p50: fcfs / alone = {pct(fcfs.ttft['A'], 50) / base:.2f}x, "
              f"fair / alone = {pct(fair.ttft['A'], 50) / base:.2f}x (target <= 1.3)")
        print(f"B throughput: fair / fcfs = {fair.output_tokens.get('B', 0) / max(1, fcfs.output_tokens.get('B', 0)):.3f} "
              "(target >= 0.9)")
    else:
        high, low = Placement("ops", priority_class=0), Placement("batch", priority_class=4)
        limit = {"B": args.low_max_queued}
        alone = run(llm, "priority", plan(False, high, low), d, args.output_len, bound)
        both = run(llm, "priority", plan(True, high, low), d, args.output_len, bound, limit)
        fcfs = run(llm, "fcfs", plan(True, high, low), d, args.output_len, bound, limit)
        print(f"high {args.rate_a}/s, low {rate_b}/s (queue limit {args.low_max_queued}, 429 past it), "
              f"starvation bound {bound:.0f}s, {d:.0f}s of arrivals each")
        for name, o in (("high alone", alone), ("both fcfs", fcfs), ("both priority", both)):
            h = o.ttft.get("A", [])
            print(f"{name:13s}  high TTFT p50 {pct(h, 50) * 1000:7.0f} ms  p99 {pct(h, 99) * 1000:7.0f} ms   "
                  f"low longest wait {o.longest_wait.get('B', 0.0):6.1f} s (to finish "
                  f"{o.longest_latency.get('B', 0.0):5.1f} s)   low output "
                  f"{o.output_tokens.get('B', 0) / d:6.1f} tok/s   low 429s {o.refused.get('B', 0)}")
        print(f"high TTFT p99: priority / alone = {pct(both.ttft['A'], 99) / pct(alone.ttft['A'], 99):.2f}x "
              f"(target <= 1.5); low longest wait {both.longest_wait.get('B', 0.0):.1f}s, to finish "
              f"{both.longest_latency.get('B', 0.0):.1f}s (bound {bound:.0f}s)")


if __name__ == "__main__":
    main()

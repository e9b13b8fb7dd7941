"""`tokenmill trace analyze`: what a traffic capture says about sizing and caching.

Prefix sharing is judged at block granularity with the capture's hashes:

- ideal hit rate: replay the requests in arrival order against an infinite
  prefix cache: a request hits its longest run of leading blocks whose chained
  hash appeared earlier (capped at prompt length - 1, as engines recompute the
  last token). Compared with the ``cached_tokens`` the server really hit.
- layout check: for each prompt find the first block no other prompt has,
  and the next block whose content other prompts also hold. If the blocks
  from there on (compared by content, re-chained from there) repeat across
  prompts, something unique (a timestamp, a user id) sits before shared text
  and defeats the cache. We estimate the ideal hit rate with the unique run
  moved to the end of the prompt. "At the start" allows one shared leading
  block (a BOS token and a common opening like "[2025-").
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tokenmill.bench.report import table
from tokenmill.bench.stats import Dist
from tokenmill.traffic.capture import chain_hashes

LAYOUT_MIN_FRACTION = 0.3  # of prompts interrupted by a unique block
LAYOUT_MIN_GAIN = 0.10  # hit-rate points the fix must add


def ideal_hit_rate(chains: Sequence[Sequence[str]], prompt_tokens: Sequence[int],
                   block_size: int) -> float:
    """Infinite-cache hit rate of chained block hashes, in arrival order."""
    seen: set[str] = set()
    hit = total = 0
    for hashes, n in zip(chains, prompt_tokens):
        k = 0
        while k < len(hashes) and hashes[k] in seen:
            k += 1
        hit += min(k * block_size, max(0, n - 1))
        total += n
        seen.update(hashes)
    return hit / total if total else 0.0


@dataclass
class SharedPrefix:
    tokens: int
    requests: int
    saved_tokens: int
    preview: str | None = None


@dataclass
class LayoutFinding:
    fraction: float  # of prompts whose shared content comes after a unique block
    at_start: float  # of those, the fraction where the unique block is the first
    shared_blocks_after: float  # mean shared blocks following the unique one
    ideal_now: float
    ideal_fixed: float
    message: str


@dataclass
class MissSummary:
    reason: str
    requests: int
    share: float  # of all requests
    common_offset: int | None  # the most frequent token offset where reuse stopped
    lost_tokens: int  # prompt tokens after that offset, summed: what the breaker cost


@dataclass
class TraceReport:
    requests: int
    span: float
    arrival_rate: float
    block_size: int
    prompt_len: Dist
    output_len: Dist
    ttft: Dist
    e2e: Dist
    actual_hit_rate: float | None
    ideal_hit_rate: float
    peak_concurrency: int
    timeline: list[dict[str, float]] = field(default_factory=list)
    top_prefixes: list[SharedPrefix] = field(default_factory=list)
    layout: LayoutFinding | None = None
    # the server's own verdicts (capture records' miss_reason / miss_offset): the worst offenders
    miss_reasons: list[MissSummary] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _top_prefixes(recs: Sequence[dict[str, Any]], counts: Counter[str], bs: int,
                  top: int) -> list[SharedPrefix]:
    found: dict[str, SharedPrefix] = {}
    for r in recs:
        hs = r.get("block_hashes") or []
        for i, h in enumerate(hs):
            c = counts[h]
            if c < 2:
                break
            nxt = counts[hs[i + 1]] if i + 1 < len(hs) else 0
            if nxt < c and h not in found:
                depth = (i + 1) * bs
                text = r.get("prompt_text")
                preview = text[: min(len(text), depth * 4, 80)] if text else None
                found[h] = SharedPrefix(depth, c, (c - 1) * depth, preview)
    return sorted(found.values(), key=lambda p: -p.saved_tokens)[:top]


def _layout(recs: Sequence[dict[str, Any]], counts: Counter[str], bs: int,
            ideal_now: float) -> LayoutFinding | None:
    # For each prompt: u = first block no other prompt has (by chained hash);
    # j = the next block whose content other prompts also hold. The unique run
    # u..j-1 (a timestamp, an id) splits the prompt; re-chain from j to see
    # whether what follows is shared across prompts.
    content_counts: Counter[str] = Counter(
        h for r in recs for h in set(r.get("block_content_hashes") or []))
    cuts: list[tuple[int, int] | None] = []
    rerooted: list[list[str]] = []
    for r in recs:
        hs = r.get("block_hashes") or []
        content = r.get("block_content_hashes") or []
        u = next((i for i, h in enumerate(hs) if counts[h] == 1), None)
        j = None if u is None else next(
            (i for i in range(u + 1, len(content)) if content_counts[content[i]] >= 2), None)
        cuts.append(None if j is None else (u, j))
        rerooted.append(chain_hashes(content[j:]) if j is not None else [])
    rcounts: Counter[str] = Counter(h for hs in rerooted for h in hs)
    interrupted: dict[int, int] = {}  # request index -> shared blocks after the unique run
    for idx, hs in enumerate(rerooted):
        k = 0
        while k < len(hs) and rcounts[hs[k]] >= 2:
            k += 1
        if k >= 1:
            interrupted[idx] = k
    if not recs or not interrupted:
        return None
    moved: list[list[str]] = []
    for i, r in enumerate(recs):
        content = list(r.get("block_content_hashes") or [])
        cut = cuts[i]
        if i in interrupted and cut is not None:
            u, j = cut
            content = content[:u] + content[j:] + content[u:j]
        moved.append(chain_hashes(content))
    fixed = ideal_hit_rate(moved, [int(r["prompt_tokens"]) for r in recs], bs)
    frac = len(interrupted) / len(recs)
    at_start = sum(1 for i in interrupted if (cuts[i] or (1, 1))[0] <= 1) / len(interrupted)
    mean_after = sum(interrupted.values()) / len(interrupted)
    where = ("begin with something seen in no other prompt (a timestamp, user or request id "
             "placed before the shared text?)" if at_start >= 0.5 else
             "have a block seen in no other prompt in the middle of otherwise shared text")
    msg = (f"prompt layout defeats prefix caching: {frac:.0%} of prompts {where}, and about "
           f"{mean_after:.0f} blocks ({mean_after * bs:.0f} tokens) after it repeat across "
           f"prompts. Putting the shared part first would raise the ideal prefix-cache hit "
           f"rate from {ideal_now:.1%} to about {fixed:.1%}.")
    return LayoutFinding(frac, at_start, mean_after, ideal_now, fixed, msg)


def _timeline(recs: Sequence[dict[str, Any]], t0: float, span: float,
              buckets: int = 12) -> tuple[list[dict[str, float]], int]:
    width = max(span / buckets, 1e-3)
    rows = [{"t": i * width, "arrivals": 0.0, "rate": 0.0, "concurrency": 0.0}
            for i in range(buckets)]
    events: list[tuple[float, int]] = []
    for r in recs:
        a = r["arrival_time"] - t0
        e = a + float(r.get("e2e") or 0.0)
        rows[min(int(a / width), buckets - 1)]["arrivals"] += 1
        events += [(a, 1), (e, -1)]
        for i in range(max(0, int(a / width)), min(buckets, int(e / width) + 1)):
            lo, hi = i * width, (i + 1) * width
            rows[i]["concurrency"] += max(0.0, min(e, hi) - max(a, lo)) / width
    for row in rows:
        row["rate"] = row["arrivals"] / width
    peak = cur = 0
    for _, d in sorted(events, key=lambda x: (x[0], x[1])):
        cur += d
        peak = max(peak, cur)
    return rows, peak


def analyze(recs: Sequence[dict[str, Any]], top: int = 5) -> TraceReport:
    """Analyse capture records (as read by ``capture.read_capture``)."""
    if not recs:
        raise ValueError("the capture holds no records")
    recs = sorted(recs, key=lambda r: r["arrival_time"])
    bs = int(recs[0].get("block_size") or 16)
    t0 = recs[0]["arrival_time"]
    span = max(r["arrival_time"] + float(r.get("e2e") or 0.0) for r in recs) - t0
    arrival_span = recs[-1]["arrival_time"] - t0
    ptoks = [int(r["prompt_tokens"]) for r in recs]
    chains = [r.get("block_hashes") or [] for r in recs]
    counts: Counter[str] = Counter(h for hs in chains for h in hs)
    cached = sum(int(r.get("cached_tokens") or 0) for r in recs)
    ideal = ideal_hit_rate(chains, ptoks, bs)
    timeline, peak = _timeline(recs, t0, span)
    rep = TraceReport(
        requests=len(recs), span=span,
        arrival_rate=(len(recs) - 1) / arrival_span if arrival_span > 0 else 0.0,
        block_size=bs, prompt_len=Dist.of(ptoks),
        output_len=Dist.of([int(r.get("output_tokens") or 0) for r in recs]),
        ttft=Dist.of([r["ttft"] for r in recs if r.get("ttft") is not None]),
        e2e=Dist.of([r["e2e"] for r in recs if r.get("e2e") is not None]),
        actual_hit_rate=cached / sum(ptoks) if sum(ptoks) else None,
        ideal_hit_rate=ideal, peak_concurrency=peak, timeline=timeline,
        top_prefixes=_top_prefixes(recs, counts, bs, top))
    rep.miss_reasons = _miss_reasons(recs)
    for m in rep.miss_reasons:
        if m.reason in ("volatile_span", "reordered", "rewritten_history") and m.share >= 0.05:
            rep.warnings.append(
                f"{m.requests} requests ({m.share:.0%}) missed the cache at a {m.reason.replace('_', ' ')} "
                f"(most often at token {m.common_offset}), recomputing {m.lost_tokens} prompt tokens: "
                + _ADVICE[m.reason])
    layout = _layout(recs, counts, bs, ideal)
    if layout and layout.fraction >= LAYOUT_MIN_FRACTION and \
            layout.ideal_fixed - layout.ideal_now >= LAYOUT_MIN_GAIN:
        rep.layout = layout
        rep.warnings.append(layout.message)
    if rep.actual_hit_rate is not None and ideal - rep.actual_hit_rate > 0.2:
        rep.warnings.append(
            f"the server hit {rep.actual_hit_rate:.1%} of prompt tokens in its prefix cache, "
            f"a perfect cache would hit {ideal:.1%}: the cache is too small for this traffic, "
            "evicts too early, or requests with shared prefixes go to different replicas")
    return rep


_ADVICE = {
    "volatile_span": "move what changes per request (timestamps, ids, nonces) after the shared text",
    "reordered": "keep tool definitions and JSON keys in one fixed order",
    "rewritten_history": "append to the conversation rather than dropping or rewriting earlier turns",
}


def _miss_reasons(recs: Sequence[dict[str, Any]]) -> list[MissSummary]:
    """Requests by the server's miss reason, worst (most tokens lost) first."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in recs:
        if r.get("miss_reason"):
            by.setdefault(str(r["miss_reason"]), []).append(r)
    out = []
    for reason, rs in by.items():
        offsets = Counter(int(r["miss_offset"]) for r in rs if r.get("miss_offset") is not None)
        lost = sum(max(0, int(r["prompt_tokens"]) - int(r.get("cached_tokens") or 0)) for r in rs)
        out.append(MissSummary(reason, len(rs), len(rs) / len(recs),
                               offsets.most_common(1)[0][0] if offsets else None, lost))
    return sorted(out, key=lambda m: -m.lost_tokens)


def _tok(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def render(rep: TraceReport) -> str:
    out = [f"{rep.requests} requests over {rep.span:.1f} s, mean arrival rate "
           f"{rep.arrival_rate:.2f}/s, peak concurrency {rep.peak_concurrency}"]
    rows = []
    for name, d, f in (("prompt tokens", rep.prompt_len, _tok), ("output tokens", rep.output_len,
                       _tok), ("TTFT ms", rep.ttft, _ms), ("E2E ms", rep.e2e, _ms)):
        rows.append([name, f(d.mean), f(d.p50), f(d.p90), f(d.p99), f(d.max)])
    out += ["", table(["", "mean", "p50", "p90", "p99", "max"], rows), ""]
    out.append(table(["t (s)", "arrivals", "req/s", "concurrency"],
                     [[f"{r['t']:.1f}", f"{r['arrivals']:.0f}", f"{r['rate']:.2f}",
                       f"{r['concurrency']:.1f}"] for r in rep.timeline]))
    actual = "-" if rep.actual_hit_rate is None else f"{rep.actual_hit_rate:.1%}"
    out += ["", f"prefix cache: hit {actual} of prompt tokens; a perfect cache would hit "
                f"{rep.ideal_hit_rate:.1%} (block size {rep.block_size})"]
    if rep.top_prefixes:
        out.append(table(["shared prefix", "tokens", "requests", "tokens saved"],
                         [[f"#{i + 1} " + (repr(p.preview) if p.preview else ""),
                           str(p.tokens), str(p.requests), str(p.saved_tokens)]
                          for i, p in enumerate(rep.top_prefixes)]))
    if rep.miss_reasons:
        out.append(table(["miss reason", "requests", "share", "usual offset", "tokens recomputed"],
                         [[m.reason, str(m.requests), f"{m.share:.1%}", _tok(m.common_offset), str(m.lost_tokens)]
                          for m in rep.miss_reasons]))
    for w in rep.warnings:
        out.append(f"warning: {w}")
    return "\n".join(out)

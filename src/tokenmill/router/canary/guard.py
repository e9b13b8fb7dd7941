"""SLO guard: per-variant sliding windows of latency and errors, and the verdict.

Each finished request of a variant adds a sample (time to first token, time
per output token, whether it failed). The guard looks only at the last
``window_s`` seconds and says nothing until at least ``min_samples`` samples
are in the window, so one slow request on a quiet canary cannot trigger a
rollback. A breach of any configured objective (TTFT p99, TPOT p99, error
rate) is reported with the figures that broke it; the caller decides what to
do (drop the canary to 0%).

Pure bookkeeping, no I/O: easy to test with a fake clock.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class SLO:
    ttft_p99: float | None = None  # seconds
    tpot_p99: float | None = None  # seconds per output token
    error_rate: float | None = None  # 0..1
    e2e_p99: float | None = None  # seconds, whole request (the only latency of non-streamed answers)
    window_s: float = 60.0
    min_samples: int = 20

    def active(self) -> bool:
        return any(v is not None for v in (self.ttft_p99, self.tpot_p99, self.error_rate, self.e2e_p99))

    @classmethod
    def parse(cls, text: str) -> "SLO":
        """``ttft_p99=2,tpot_p99=0.2,e2e_p99=30,error_rate=0.05,window=60,min_samples=20``."""
        slo = cls()
        for part in text.split(","):
            if not part.strip():
                continue
            k, sep, v = part.partition("=")
            k = k.strip().lower().replace("-", "_")
            if not sep:
                raise ValueError(f"--slo wants KEY=VALUE pairs, got {part!r}")
            try:
                value = float(v.strip().rstrip("s%")) / (100.0 if v.strip().endswith("%") else 1.0)
            except ValueError:
                raise ValueError(f"--slo {k}: not a number: {v!r}") from None
            if value < 0 or not math.isfinite(value):
                raise ValueError(f"--slo {k} must be a non-negative number")
            if k in ("ttft", "ttft_p99"):
                slo.ttft_p99 = value
            elif k in ("tpot", "tpot_p99"):
                slo.tpot_p99 = value
            elif k in ("e2e", "e2e_p99"):
                slo.e2e_p99 = value
            elif k in ("error_rate", "errors"):
                slo.error_rate = value
            elif k in ("window", "window_s"):
                if value <= 0:
                    raise ValueError("--slo window must be positive")
                slo.window_s = value
            elif k == "min_samples":
                slo.min_samples = max(1, int(value))
            else:
                raise ValueError(f"--slo: unknown key {k!r} (ttft_p99, tpot_p99, e2e_p99, error_rate, "
                                 "window, min_samples)")
        return slo


@dataclass
class Sample:
    at: float
    ttft: float | None
    tpot: float | None
    error: bool
    e2e: float | None = None


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); the value a p99 SLO is usually read as."""
    s = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(s)))
    return s[rank - 1]


@dataclass
class WindowStats:
    samples: int
    errors: int
    ttft_p99: float | None
    tpot_p99: float | None
    e2e_p99: float | None = None

    @property
    def error_rate(self) -> float:
        return self.errors / self.samples if self.samples else 0.0


@dataclass
class Guard:
    slo: SLO
    clock: Callable[[], float] = time.monotonic
    _windows: dict[str, deque[Sample]] = field(default_factory=dict)

    def observe(self, variant: str, ttft: float | None, tpot: float | None, error: bool,
                e2e: float | None = None) -> None:
        w = self._windows.setdefault(variant, deque())
        w.append(Sample(self.clock(), ttft, tpot, error, e2e))
        self._trim(w)

    def _trim(self, w: deque[Sample]) -> None:
        horizon = self.clock() - self.slo.window_s
        while w and w[0].at < horizon:
            w.popleft()

    def size(self, variant: str) -> int:
        return len(self._windows.get(variant, ()))

    def reset(self, variant: str) -> None:
        """Forget a variant's samples (after a rollback or a new split, start afresh)."""
        self._windows.pop(variant, None)

    def stats(self, variant: str) -> WindowStats:
        w = self._windows.get(variant, deque())
        self._trim(w)
        ttfts = [s.ttft for s in w if s.ttft is not None]
        tpots = [s.tpot for s in w if s.tpot is not None]
        e2es = [s.e2e for s in w if s.e2e is not None]
        return WindowStats(samples=len(w), errors=sum(s.error for s in w),
                           ttft_p99=percentile(ttfts, 99) if ttfts else None,
                           tpot_p99=percentile(tpots, 99) if tpots else None,
                           e2e_p99=percentile(e2es, 99) if e2es else None)

    def breach(self, variant: str) -> str | None:
        """Why this variant breaks its SLO now, or None (also None below ``min_samples``)."""
        slo = self.slo
        st = self.stats(variant)
        if st.samples < slo.min_samples:
            return None
        reasons = []
        if slo.ttft_p99 is not None and st.ttft_p99 is not None and st.ttft_p99 > slo.ttft_p99:
            reasons.append(f"TTFT p99 {st.ttft_p99:.3f}s > {slo.ttft_p99:g}s")
        if slo.tpot_p99 is not None and st.tpot_p99 is not None and st.tpot_p99 > slo.tpot_p99:
            reasons.append(f"TPOT p99 {st.tpot_p99 * 1000:.1f}ms > {slo.tpot_p99 * 1000:g}ms")
        if slo.e2e_p99 is not None and st.e2e_p99 is not None and st.e2e_p99 > slo.e2e_p99:
            reasons.append(f"request latency p99 {st.e2e_p99:.3f}s > {slo.e2e_p99:g}s")
        if slo.error_rate is not None and st.error_rate > slo.error_rate:
            reasons.append(f"error rate {100 * st.error_rate:.1f}% > {100 * slo.error_rate:g}%")
        if not reasons:
            return None
        return "; ".join(reasons) + f" over {st.samples} requests in {slo.window_s:g}s"

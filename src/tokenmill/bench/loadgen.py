"""Load shapes: closed loop (fixed concurrency) or open loop (arrival process).

Closed loop answers "with N users who each wait for their answer"; open loop
answers "with traffic arriving at R per second whatever happens" — the one
that shows queues building when the server falls behind. Arrivals are
Poisson, or gamma with a burstiness factor (< 1 burstier, > 1 smoother), or a
trace's own timestamps.
"""
from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from tokenmill.bench.client import Target, send_request
from tokenmill.bench.traces.sessions import chains, next_turn
from tokenmill.bench.types import RequestRecord, RequestSpec

CONNECT_FAILURES_TO_ABORT = 5


@dataclass
class LoadShape:
    concurrency: int | None = None  # closed loop
    rate: float | None = None  # open loop, requests/s; inf = all at once
    burstiness: float = 1.0
    max_concurrency: int | None = None  # cap for open loop
    duration: float | None = None  # stop sending after this many seconds
    trace: bool = False  # use each spec's own arrival time

    @property
    def label(self) -> str:
        if self.trace:
            return "trace" if not self.rate else f"trace@{self.rate:g}/s"
        if self.rate is not None:
            return "rate=inf" if self.rate == float("inf") else f"rate={self.rate:g}/s"
        return f"c={self.concurrency or 1}"

    def arrivals(self, n: int, rng: random.Random) -> list[float]:
        """Scheduled send times (seconds from start) for open-loop shapes."""
        if self.rate is None or self.rate == float("inf"):
            return [0.0] * n
        shape = max(self.burstiness, 1e-3)
        t, out = 0.0, []
        for _ in range(n):
            out.append(t)
            t += rng.gammavariate(shape, 1.0 / (self.rate * shape))
        return out


class Progress:
    """A one-line live progress bar on stderr (only when it is a terminal)."""

    def __init__(self, label: str, total: int, enabled: bool | None = None,
                 duration: float | None = None):
        self.label, self.total, self.duration = label, total, duration
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.ok = self.err = 0
        self.t0 = time.perf_counter()

    def update(self, rec: RequestRecord) -> None:
        if rec.ok:
            self.ok += 1
        else:
            self.err += 1
        if not self.enabled:
            return
        done = self.ok + self.err
        el = time.perf_counter() - self.t0
        frac = min(1.0, el / self.duration) if self.duration else done / max(1, self.total)
        bar = "#" * int(frac * 24) + "." * (24 - int(frac * 24))
        rate = done / el if el > 0 else 0.0
        counts = f"{done} sent" if self.duration else f"{done}/{self.total}"
        sys.stderr.write(f"\r{self.label:>10} [{bar}] {counts} ok {self.ok} "
                         f"err {self.err} | {rate:5.1f} req/s | {el:6.1f} s ")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


@dataclass
class PointRun:
    """Records of one load point, filled as requests finish (so an interrupted
    run still has everything that completed)."""

    records: list[RequestRecord] = field(default_factory=list)
    aborted: str | None = None
    _connect_fail_streak: int = 0

    def add(self, rec: RequestRecord) -> None:
        self.records.append(rec)
        if not rec.ok and rec.error and rec.error.startswith("cannot connect"):
            self._connect_fail_streak += 1
            if self._connect_fail_streak >= CONNECT_FAILURES_TO_ABORT and not self.aborted:
                self.aborted = f"server unreachable ({rec.error})"
        else:
            self._connect_fail_streak = 0


async def run_point(client: httpx.AsyncClient, target: Target, specs: list[RequestSpec],
                    shape: LoadShape, run: PointRun, seed: int = 0,
                    count_tokens: Callable[[str], int] | None = None,
                    progress: Progress | None = None) -> PointRun:
    """Send ``specs`` with ``shape``; stops early after repeated connection
    failures or when ``shape.duration`` has passed (in-flight requests finish).

    The shape schedules conversations (sessions.py): a request outside one is a
    conversation of one turn; a later turn follows its previous turn's answer
    after its think time, and a failed turn ends its conversation."""
    t0 = time.perf_counter()
    point = _Point(client, target, specs, run, t0, count_tokens, progress,
                   deadline=t0 + shape.duration if shape.duration else None,
                   sem=asyncio.Semaphore(shape.max_concurrency) if shape.max_concurrency else None)
    convs = chains(specs)
    if not shape.trace and shape.rate is None:
        await point.closed_loop(convs, max(1, shape.concurrency or 1))
        return run
    if shape.trace:
        times = [specs[c[0]].arrival or 0.0 for c in convs]
    else:
        times = shape.arrivals(len(convs), random.Random(seed))
    await point.open_loop(convs, times)
    return run


@dataclass
class _Point:
    """One load point while it runs: who sends what, and when it stops."""

    client: httpx.AsyncClient
    target: Target
    specs: list[RequestSpec]
    run: PointRun
    t0: float  # the point's perf_counter origin
    count_tokens: Callable[[str], int] | None
    progress: Progress | None
    deadline: float | None
    sem: asyncio.Semaphore | None  # --max-concurrency

    def stop(self) -> bool:
        return bool(self.run.aborted) or (self.deadline is not None and time.perf_counter() >= self.deadline)

    async def one(self, i: int, spec: RequestSpec, lateness: float = 0.0) -> RequestRecord:
        if self.sem is None:
            rec = await send_request(self.client, self.target, spec, i, self.t0, self.count_tokens)
        else:
            async with self.sem:
                if self.run.aborted:
                    return RequestRecord(index=i, error="not sent: the run was aborted")
                rec = await send_request(self.client, self.target, spec, i, self.t0, self.count_tokens)
        rec.lateness = lateness
        self.run.add(rec)
        if self.progress:
            self.progress.update(rec)
        return rec

    async def conversation(self, chain: list[int], lateness: float = 0.0) -> None:
        sent = self.specs[chain[0]]
        rec = await self.one(chain[0], sent, lateness)
        for j in chain[1:]:
            if not rec.ok or self.stop():
                return
            turn = self.specs[j]
            if turn.think > 0:
                await asyncio.sleep(turn.think)
            if self.stop():
                return
            sent = next_turn(sent, rec.answer, rec.output_tokens, turn, self.target.endpoint == "chat")
            rec = await self.one(j, sent)

    async def closed_loop(self, convs: list[list[int]], concurrency: int) -> None:
        """``concurrency`` workers, each starting the next conversation when its last one ends."""
        next_c = 0

        async def worker() -> None:
            nonlocal next_c
            while not self.stop() and next_c < len(convs):
                c = next_c
                next_c += 1
                await self.conversation(convs[c])

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    async def open_loop(self, convs: list[list[int]], times: list[float]) -> None:
        """Each conversation starts at its time (seconds after ``t0``), whatever is in flight."""
        tasks: list[asyncio.Task[None]] = []

        async def scheduled(c: int, at: float) -> None:
            # Lateness is the client's own lag behind the schedule (event loop
            # overload), measured before any --max-concurrency wait on purpose.
            await self.conversation(convs[c], max(0.0, time.perf_counter() - self.t0 - at))

        try:
            for c, at in enumerate(times):
                delay = self.t0 + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if self.stop():
                    break
                tasks.append(asyncio.create_task(scheduled(c, at)))
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()


async def warmup(client: httpx.AsyncClient, target: Target, specs: list[RequestSpec],
                 concurrency: int) -> int:
    """Send warm-up requests (not measured); returns how many failed."""
    run = PointRun()
    await run_point(client, target, specs, LoadShape(concurrency=max(1, concurrency)), run)
    return sum(1 for r in run.records if not r.ok)

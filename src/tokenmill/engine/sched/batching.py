"""Batching policies: which waiting requests may join the running batch.

The scheduler asks the policy once per waiting request it considers. Keeping
the policy a small object (not flags through the scheduler) lets users compare
what continuous batching buys on their own traffic:

- ``continuous``: anyone may join at any step (the default);
- ``static``: a fixed group (up to ``max_num_seqs``, in arrival order) runs to
  completion before the next group is formed;
- ``dynamic``: like static, but a group is formed only once it is full or its
  oldest member has waited ``window_s`` seconds.
"""
from __future__ import annotations

from collections import deque
from typing import Iterable, Protocol

from ..request import Request


class BatchingPolicy(Protocol):
    name: str

    def begin_step(self, running: Iterable[Request], waiting: deque[Request], now: float) -> None: ...

    def may_admit(self, request: Request) -> bool: ...


class ContinuousBatching:
    name = "continuous"

    def begin_step(self, running: Iterable[Request], waiting: deque[Request], now: float) -> None:
        pass

    def may_admit(self, request: Request) -> bool:
        return True


class StaticBatching:
    """Run one group to completion; members preempted meanwhile may rejoin."""

    name = "static"

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.group: set[str] = set()

    def _group_alive(self, running: Iterable[Request], waiting: deque[Request]) -> bool:
        return any(r.request_id in self.group for r in running) or any(
            r.request_id in self.group for r in waiting
        )

    def _ready(self, waiting: deque[Request], now: float) -> bool:
        return bool(waiting)

    def begin_step(self, running: Iterable[Request], waiting: deque[Request], now: float) -> None:
        running = list(running)
        if self.group and self._group_alive(running, waiting):
            return
        self.group = set()
        if running or not self._ready(waiting, now):
            return
        self.group = {r.request_id for r in list(waiting)[: self.group_size]}

    def may_admit(self, request: Request) -> bool:
        return request.request_id in self.group


class DynamicBatching(StaticBatching):
    """Collect arrivals for a short window, then run them as one group."""

    name = "dynamic"

    def __init__(self, group_size: int, window_s: float) -> None:
        super().__init__(group_size)
        self.window_s = window_s

    def _ready(self, waiting: deque[Request], now: float) -> bool:
        if not waiting:
            return False
        return len(waiting) >= self.group_size or now - waiting[0].arrival_time >= self.window_s


def make_policy(name: str, max_num_seqs: int, window_s: float) -> BatchingPolicy:
    if name == "continuous":
        return ContinuousBatching()
    if name == "static":
        return StaticBatching(max_num_seqs)
    if name == "dynamic":
        return DynamicBatching(max_num_seqs, window_s)
    raise ValueError(f"unknown batching policy {name!r}; choose continuous, static or dynamic")

"""Which backend gets a request: round-robin, least-load, or prefix-aware.

The prefix policy weighs two things. Overlap: how many leading blocks of the
request the backend probably holds (its PrefixIndex). Load: in-flight and
scraped running/waiting requests plus KV pressure (Backend.load). It sends a
request to the backend with the longest overlap unless that backend is
overloaded relative to the least-loaded one (load above min + ``imbalance_abs``
and above min * ``imbalance_rel``); then the best-overlap backend among the
others wins. That is how a hot prefix spreads once one replica saturates,
while cold prefixes still land where they are cached. A request with no
useful overlap anywhere goes to the least-loaded backend, ties broken by the
emptiest index (most room to cache a new prefix), then in turn. "Useful"
means at least ``min_match_blocks`` blocks and ``min_match_ratio`` of the
request's blocks, so a short system prompt shared by everyone does not herd
all traffic onto one replica.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

from .backend import Backend
from .config import RouterConfig


@dataclass
class Decision:
    backend: Backend
    reason: str  # prefix_hit | prefix_miss | imbalance | least_load | round_robin
    matched_blocks: int = 0
    total_blocks: int = 0


class RoundRobin:
    name = "round-robin"

    def __init__(self, config: RouterConfig) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[Backend], keys: Sequence[bytes]) -> Decision:
        ordered = sorted(candidates, key=lambda b: b.url)
        b = ordered[next(self._counter) % len(ordered)]
        return Decision(b, "round_robin", b.index.match(keys), len(keys))


class LeastLoad:
    name = "least-load"

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[Backend], keys: Sequence[bytes]) -> Decision:
        w = self.config.kv_usage_weight
        low = min(b.load(w) for b in candidates)
        tied = sorted((b for b in candidates if b.load(w) <= low), key=lambda b: b.url)
        b = tied[next(self._counter) % len(tied)]
        return Decision(b, "least_load", b.index.match(keys), len(keys))


class PrefixAware:
    name = "prefix"

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._counter = itertools.count()

    def overloaded(self, load: float, min_load: float) -> bool:
        c = self.config
        return load - min_load > c.imbalance_abs and load > min_load * c.imbalance_rel

    def choose(self, candidates: Sequence[Backend], keys: Sequence[bytes]) -> Decision:
        w = self.config.kv_usage_weight
        loads = {b.url: b.load(w) for b in candidates}
        matches = {b.url: b.index.match(keys) for b in candidates}
        min_load = min(loads.values())
        turn = next(self._counter)
        n = len(candidates)
        # Stable rotation so exact ties do not always favour the same backend.
        order = {b.url: (i + turn) % n for i, b in enumerate(sorted(candidates, key=lambda b: b.url))}

        def by_overlap(b: Backend) -> tuple:
            return (-matches[b.url], loads[b.url], order[b.url])

        best = min(candidates, key=by_overlap)
        enough = max(1, self.config.min_match_blocks, math.ceil(self.config.min_match_ratio * len(keys)))
        if matches[best.url] >= enough:
            if not self.overloaded(loads[best.url], min_load):
                return Decision(best, "prefix_hit", matches[best.url], len(keys))
            ok = [b for b in candidates if not self.overloaded(loads[b.url], min_load)]
            alt = min(ok, key=by_overlap)
            return Decision(alt, "imbalance", matches[alt.url], len(keys))
        # No useful overlap anywhere: least loaded, then most room, then in turn.
        b = min(candidates, key=lambda b: (loads[b.url], len(b.index), order[b.url]))
        return Decision(b, "prefix_miss", matches[b.url], len(keys))


def make_policy(config: RouterConfig) -> RoundRobin | LeastLoad | PrefixAware:
    return {"prefix": PrefixAware, "least-load": LeastLoad, "round-robin": RoundRobin}[config.policy](config)

"""Named groups of backends (variants) and the traffic split between them.

A canary rollout runs the current configuration (the *base*, the first
``--variant``) next to a cheaper one and sends it a share of the traffic.
This module owns which variant a request goes to; routing *inside* the
variant stays with the usual policy (prefix-aware by default), restricted to
that variant's backends.

Stickiness: a request that carries a session or user key (the
``x-session-id`` / ``x-user-id`` header, or OpenAI's ``user`` field) is hashed
to a point in [0, 100) and lands on the variant whose weight interval holds
that point, so a conversation stays on one variant (and its prefix cache) as
long as the split does not change. Requests without a key follow a smooth
weighted round-robin, which keeps the realised split exact even for a handful
of requests.

The split survives restarts in a small JSON state file, written atomically
whenever it changes (by ``POST /admin/split`` or by the guard's rollback).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..backend import endpoint_of, normalize_url

log = logging.getLogger("tokenmill.router")

SESSION_HEADERS = ("x-session-id", "x-user-id")


@dataclass
class Variant:
    name: str
    backends: list[str]  # normalized base URLs

    @property
    def endpoints(self) -> set[str]:
        return {endpoint_of(u) for u in self.backends}


def parse_variant(text: str) -> Variant:
    """``name=URL,URL`` -> Variant."""
    name, sep, urls = text.partition("=")
    name = name.strip()
    if not sep or not name or not urls.strip():
        raise ValueError(f"--variant wants NAME=URL[,URL...], got {text!r}")
    if not all(c.isalnum() or c in "-_." for c in name):
        raise ValueError(f"variant name {name!r}: use letters, digits, '-', '_' or '.'")
    backends = [normalize_url(u) for u in urls.split(",") if u.strip()]
    return Variant(name, backends)


def parse_split(entries: list[str]) -> dict[str, float]:
    """``["int4=10"]`` or ``["int4=10,int8=5"]`` -> {"int4": 10.0, ...} (percent)."""
    out: dict[str, float] = {}
    for entry in entries:
        for part in entry.split(","):
            if not part.strip():
                continue
            name, sep, pct = part.partition("=")
            try:
                value = float(pct.strip().rstrip("%"))
            except ValueError:
                raise ValueError(f"--split wants NAME=PERCENT, got {part!r}") from None
            if not sep:
                raise ValueError(f"--split wants NAME=PERCENT, got {part!r}")
            out[name.strip()] = value
    return out


def full_split(names: list[str], canary: Mapping[str, float]) -> dict[str, float]:
    """Percent for every variant: the given ones, the base (first) takes the rest.

    Raises ValueError on unknown names, negative shares, or shares over 100.
    """
    base = names[0]
    unknown = [n for n in canary if n not in names]
    if unknown:
        raise ValueError(f"unknown variant(s) in split: {', '.join(unknown)} (known: {', '.join(names)})")
    for n, v in canary.items():
        if not 0.0 <= float(v) <= 100.0:
            raise ValueError(f"split for {n!r} must be within 0..100, got {v}")
    given_base = canary.get(base)
    others = {n: float(canary.get(n, 0.0)) for n in names[1:]}
    rest = 100.0 - sum(others.values())
    if rest < -1e-9:
        raise ValueError(f"the canary shares add up to {sum(others.values()):g}% > 100%")
    if given_base is not None and abs(float(given_base) - rest) > 1e-6:
        raise ValueError(f"the base {base!r} takes the rest ({rest:g}%); do not give it a different share")
    return {base: max(0.0, rest), **others}


@dataclass
class SplitState:
    """The live split plus why it last changed; what the state file holds."""

    weights: dict[str, float]
    reason: str = "configured"
    updated_at: float = field(default_factory=time.time)
    rolled_back: dict[str, str] = field(default_factory=dict)  # variant -> reason

    def to_json(self) -> dict[str, Any]:
        return {"split": self.weights, "reason": self.reason, "updated_at": self.updated_at,
                "rolled_back": self.rolled_back}


def save_state(path: str | Path, state: SplitState) -> None:
    """Write atomically (temporary file, then rename) so a crash never leaves half a file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".split-", dir=str(p.parent))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(state.to_json(), f, indent=2)
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def load_state(path: str | Path, names: list[str]) -> SplitState | None:
    """The saved split, or None when there is none (or it no longer fits the variants)."""
    p = Path(path)
    if not p.exists():
        return None
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
        weights = full_split(names, {k: float(v) for k, v in doc["split"].items() if k != names[0]})
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("ignoring split state file %s: %s", p, exc)
        return None
    rolled = {k: str(v) for k, v in (doc.get("rolled_back") or {}).items() if k in names}
    return SplitState(weights, str(doc.get("reason", "restored")), float(doc.get("updated_at", 0.0)), rolled)


def session_key(headers: Mapping[str, str], body: Any) -> str | None:
    for h in SESSION_HEADERS:
        v = headers.get(h)
        if v:
            return f"{h}:{v}"
    if isinstance(body, dict) and isinstance(body.get("user"), str) and body["user"]:
        return "user:" + body["user"]
    return None


def key_point(key: str) -> float:
    """A stable point in [0, 100) for a session key."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return (h / 2.0**64) * 100.0


class Splitter:
    """Chooses a variant per request from the current weights."""

    def __init__(self, variants: list[Variant], state: SplitState) -> None:
        self.variants = variants
        self.names = [v.name for v in variants]
        self.by_name = {v.name: v for v in variants}
        self.state = state
        self._credit = {n: 0.0 for n in self.names}  # smooth weighted round-robin
        self._by_endpoint = {ep: v.name for v in variants for ep in v.endpoints}

    @property
    def base(self) -> str:
        return self.names[0]

    def variant_of_endpoint(self, endpoint: str) -> str | None:
        return self._by_endpoint.get(endpoint)

    def choose(self, key: str | None, available: set[str] | None = None) -> str:
        """The variant for one request; ``available`` limits it to variants with a ready backend."""
        weights = {n: w for n, w in self.state.weights.items() if w > 0 and (available is None or n in available)}
        if not weights:
            # Nothing with weight is ready: the base if it is, else any ready variant.
            if available is None or self.base in available or not available:
                return self.base
            return next(n for n in self.names if n in available)
        total = sum(weights.values())
        if key is not None:
            point = key_point(key) * total / 100.0
            acc = 0.0
            for n in self.names:
                if n in weights:
                    acc += weights[n]
                    if point < acc:
                        return n
            return next(n for n in reversed(self.names) if n in weights)
        for n in weights:
            self._credit[n] += weights[n]
        pick = max(weights, key=lambda n: (self._credit[n], -self.names.index(n)))
        self._credit[pick] -= total
        return pick

    def set_weights(self, weights: dict[str, float]) -> None:
        self.state.weights = dict(weights)
        self._credit = {n: 0.0 for n in self.names}

"""Length distributions for synthetic prompts and outputs.

Spec strings (tokens):
  ``512``                    fixed
  ``uniform:128:1024``       uniform integer in [lo, hi]
  ``normal:512:128``         normal(mean, std), clipped to [1, mean + 4 std]
  ``hist:128=0.5,512=0.3,2048=0.2``  pick a length with these weights
  ``hist:FILE``              same, from a file of ``length weight`` lines
                             (or one observed length per line, weight 1)
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class LengthDist:
    kind: str
    a: float = 0.0
    b: float = 0.0
    values: list[int] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        if self.kind == "normal":
            x = rng.gauss(self.a, self.b)
            return int(round(min(max(1.0, x), self.a + 4 * self.b)))
        return rng.choices(self.values, weights=self.weights, k=1)[0]

    @property
    def mean(self) -> float:
        if self.kind == "fixed":
            return self.a
        if self.kind in ("uniform",):
            return (self.a + self.b) / 2
        if self.kind == "normal":
            return self.a
        total = sum(self.weights)
        return sum(v * w for v, w in zip(self.values, self.weights)) / total

    def describe(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        if self.kind in ("uniform", "normal"):
            return f"{self.kind}:{int(self.a)}:{int(self.b)}"
        return f"hist(mean {self.mean:.0f})"


def parse_length(spec: str | int) -> LengthDist:
    """Parse a spec string (see module doc); raises ValueError with a hint."""
    if isinstance(spec, int):
        return LengthDist("fixed", spec)
    s = spec.strip()
    try:
        if s.isdigit():
            return LengthDist("fixed", int(s))
        kind, _, rest = s.partition(":")
        kind = kind.lower()
        if kind == "uniform":
            lo, hi = (int(x) for x in rest.split(":"))
            if lo > hi or lo < 0:
                raise ValueError
            return LengthDist("uniform", lo, hi)
        if kind == "normal":
            mean, std = (float(x) for x in rest.split(":"))
            return LengthDist("normal", mean, std)
        if kind == "hist":
            values, weights = _parse_hist(rest)
            if not values or sum(weights) <= 0:
                raise ValueError
            return LengthDist("hist", values=values, weights=weights)
    except (ValueError, OSError) as exc:
        raise ValueError(f"bad length spec {spec!r}: {exc or 'see --help'}") from None
    raise ValueError(f"bad length spec {spec!r}: use N, uniform:LO:HI, normal:MEAN:STD, "
                     "hist:LEN=W,... or hist:FILE")


def _parse_hist(rest: str) -> tuple[list[int], list[float]]:
    pairs: list[tuple[int, float]] = []
    if "=" in rest:
        for part in rest.split(","):
            v, _, w = part.partition("=")
            pairs.append((int(v), float(w)))
    else:
        for line in Path(rest).read_text().splitlines():
            fields = line.replace(",", " ").split()
            if not fields or fields[0].startswith("#"):
                continue
            pairs.append((int(float(fields[0])), float(fields[1]) if len(fields) > 1 else 1.0))
    return [p[0] for p in pairs], [p[1] for p in pairs]

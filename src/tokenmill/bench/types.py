"""Plain records the load generator passes around: what to send, what happened."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestSpec:
    """One request to send. Exactly one of ``prompt`` / ``messages`` is set.

    ``prompt_len`` is the token count the workload aimed for (None when unknown,
    e.g. a dataset prompt counted approximately); the measured count comes
    from the server's ``usage``.
    """

    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    output_len: int | None = None
    prompt_len: int | None = None
    arrival: float | None = None  # seconds from run start (trace replay), else None
    sampling: dict[str, Any] = field(default_factory=dict)
    prefix_id: int | None = None  # which shared prefix (synthetic workloads)
    # Multi-turn conversations (trace replay): turn 0 opens ``session`` with its whole prompt;
    # a later turn's ``prompt`` is only what the user adds, sent ``think`` seconds after the
    # previous turn's answer, after that turn's prompt and answer (sessions.py).
    session: str | None = None
    turn: int = 0
    think: float = 0.0


@dataclass
class RequestRecord:
    """What one request did, measured from the client's side of the stream.

    Times are seconds; ``start`` is relative to the run's start. ``itls`` are
    gaps between successive content-bearing chunks (a chunk that carries
    several tokens counts once, as a user would see it).
    """

    index: int
    start: float = 0.0
    ok: bool = False
    status: int | None = None
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    cached_tokens: int | None = None
    usage_reported: bool = False
    prompt_len_target: int | None = None
    output_len_target: int | None = None
    lateness: float = 0.0  # how late the client sent it vs its schedule (open loop)
    finish_reason: str | None = None
    variant: str | None = None  # the router's x-tokenmill-variant answer header, when routed to variants
    session: str | None = None  # the conversation of a multi-turn replay, and the turn's place in it
    turn: int = 0
    answer: str = field(default="", repr=False)  # the streamed text: the next turn's context, never saved

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first: (e2e - ttft) / (n - 1)."""
        if not self.ok or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["answer"]
        d["tpot"] = self.tpot
        d["itls"] = [round(x, 6) for x in self.itls]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RequestRecord":
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)

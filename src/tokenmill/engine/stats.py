"""What the engine publishes for readers: an immutable snapshot after each change.

The engine's structures (pool, prefix cache, queues) belong to the engine
thread. Metrics, the console and the router's probes run on the event loop
(or a scrape thread); they read ``LLMEngine.stats``, a frozen snapshot the
engine replaces (one reference assignment) after every step, admission and
abort, so a reader never sees a half-updated structure or races the step.
``StatsSource`` is the type such a reader asks for: anything that publishes a
snapshot, not the engine with all its structures.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Protocol

if TYPE_CHECKING:
    from .sched.fairness import QueueHead


@dataclass(frozen=True)
class SpecSnapshot:
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: tuple[int, ...]

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None


@dataclass(frozen=True)
class TierSnapshot:
    """The prefix cache's disk tier (engine/kv/kv_tier.py)."""

    slots: int
    used_slots: int
    slot_bytes: int
    stored_blocks: int
    restored_blocks: int
    restore_seconds: float
    dropped_blocks: int
    rejected_blocks: int = 0  # entries that failed their check (at start or on restore) and were dropped
    errors: int = 0  # I/O errors; the first turned the tier off
    disabled: bool = False


@dataclass(frozen=True)
class EngineStats:
    steps: int = 0
    num_running: int = 0
    num_waiting: int = 0  # in the scheduler's queue (the server adds what is still queued to the engine)
    blocks_total: int = 0
    blocks_free: int = 0
    blocks_in_use: int = 0
    blocks_cached_idle: int = 0
    prefix_cache_enabled: bool = False
    prefix_cached_blocks: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    preemptions_total: int = 0
    prompt_tokens_computed: int = 0
    spec: SpecSnapshot | None = field(default=None)
    tier: TierSnapshot | None = field(default=None)
    # each waiting queue's oldest request and drain (fairness.py: QueueHead), which the
    # server's admission judges a class's backlog by; empty under FCFS
    queue_heads: "Mapping[tuple[str | None, int], QueueHead]" = field(default_factory=dict)

    @property
    def kv_usage(self) -> float:
        """Fraction of blocks held by running requests (vLLM's kv_cache_usage_perc)."""
        return self.blocks_in_use / self.blocks_total if self.blocks_total else 0.0


class StatsSource(Protocol):
    """An engine as a reader off the engine thread sees it: its last published snapshot."""

    @property
    def stats(self) -> EngineStats: ...

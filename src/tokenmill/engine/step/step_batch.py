"""One step's batch: built once from the scheduler's output, read by every executor.

The scheduler hands the engine ``(request, number of new tokens)`` pairs. The
engine turns them, once, into a ``StepBatch``: an immutable record of each
scheduled sequence's part of the step (``StepSeq``): where its new tokens
start, the tokens themselves, its kind (decode, speculative verify, prefill
chunk), which of its rows have their logits sampled, its block table, and the
per-row data beyond the tokens (its grammar; its placement: tenant, class and
priority; a per-row adapter id is one more field here, filled in ``StepSeq.of``
from the request, and read by the executors that apply it).

Executors adapt the batch to what their kernels read and never decide again
which rows sample: the eager runner flattens it decodes first
(``ModelRunner.prepare``), the fused CPU step keeps it as scheduled
(``executors.fused_step_inputs``), CUDA graphs copy it into their static buffers
(``cuda_graphs.DecodeGraphRunner._fill``). Each pads block tables its own way
(0, -1 or the scratch block): that is the kernels' business, not the batch's.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterable, NamedTuple, Sequence

from ..request import DEFAULT_PLACEMENT, Placement, Request


class RowKind(enum.Enum):
    DECODE = "decode"  # one new token (a 1-token prefill chunk is the same math)
    VERIFY = "verify"  # one token plus this step's speculative proposals: every row's logits are checked
    PREFILL = "prefill"  # a chunk of several prompt (or recompute) tokens


class StepSeq(NamedTuple):
    """One sequence's part of a step, as the request stood when the step was built
    (a named tuple: immutable, and cheap to make for every row of every step)."""

    request: Request
    start: int  # tokens whose K/V are already in the pool: the position of the first new token
    num_new: int
    kind: RowKind
    token_ids: tuple[int, ...]  # the new tokens (prompt, output or speculative proposals)
    block_table: tuple[int, ...]
    # Offsets into this sequence's new tokens whose logits are sampled (or checked): every
    # row of a verify; the last row when the chunk reaches the end of a request that samples.
    sampled: tuple[int, ...]
    grammar: Any = None  # the request's grammar matcher (structured outputs), or None
    placement: Placement = DEFAULT_PLACEMENT  # tenant, class, weight, priority (engine/sched/fairness.py)
    adapter: int = 0  # the LoRA adapter its rows run with (model/lora/lora.py); 0: the base model

    @classmethod
    def of(cls, request: Request, num_new: int) -> "StepSeq":
        start = request.num_computed_tokens
        end = start + num_new
        if request.spec_token_ids:
            kind, sampled = RowKind.VERIFY, tuple(range(num_new))
        else:
            kind = RowKind.DECODE if num_new == 1 else RowKind.PREFILL
            sampled = (num_new - 1,) if end == request.num_tokens and request.samples else ()
        tokens = ((request.token_at(start),) if num_new == 1
                  else tuple(request.step_token_ids(start, num_new)))
        return cls(request, start, num_new, kind, tokens, tuple(request.block_table), sampled, request.grammar,
                   request.placement, request.adapter_id)

    @property
    def end(self) -> int:
        return self.start + self.num_new

    @property
    def is_decode(self) -> bool:
        """A decode or a verify: one row per token the request had plus its proposals."""
        return self.kind is not RowKind.PREFILL

    @property
    def reaches_end(self) -> bool:
        """The step computes the request's last token and proposals (its next token is chosen now)."""
        return self.end == self.request.num_tokens + len(self.request.spec_token_ids)


@dataclass(frozen=True)
class StepBatch:
    """The sequences of one step, in order; everything below is derived from them once."""

    seqs: tuple[StepSeq, ...]

    @classmethod
    def build(cls, items: Iterable[tuple[Request, int]]) -> "StepBatch":
        return cls(tuple(StepSeq.of(request, num_new) for request, num_new in items))

    @classmethod
    def of(cls, step: "StepBatch | Sequence[tuple[Request, int]]") -> "StepBatch":
        """``step`` itself, or the batch of ``(request, new tokens)`` pairs (tools and tests)."""
        return step if isinstance(step, StepBatch) else cls.build(step)

    def __len__(self) -> int:
        return len(self.seqs)

    def __bool__(self) -> bool:
        return bool(self.seqs)

    def decodes_first(self) -> "StepBatch":
        """The same sequences, one-token ones first (stable): the order whose decodes the
        attention kernels batch; within each kind, the rows of one adapter together, so
        that each adapter's update reads its weights once (``adapter_segments``)."""
        if self.has_adapters:
            ordered = tuple(sorted(self.seqs, key=lambda s: (s.num_new != 1, s.adapter)))
            return self if all(a is b for a, b in zip(ordered, self.seqs)) else StepBatch(ordered)
        if all(s.num_new == 1 for s in self.seqs[: self.num_single]):
            return self
        return StepBatch(tuple(sorted(self.seqs, key=lambda s: s.num_new != 1)))

    @cached_property
    def has_adapters(self) -> bool:
        """Whether any row runs with a LoRA adapter."""
        return any(s.adapter for s in self.seqs)

    @cached_property
    def adapter_segments(self) -> list[tuple[int, int, int]]:
        """``(adapter, first row, end row)`` of each run of rows of one adapter, in this
        order (rows of the base model are in none)."""
        segments: list[tuple[int, int, int]] = []
        first = 0
        for s in self.seqs:
            end = first + s.num_new
            if s.adapter:
                if segments and segments[-1][0] == s.adapter and segments[-1][2] == first:
                    segments[-1] = (s.adapter, segments[-1][1], end)
                else:
                    segments.append((s.adapter, first, end))
            first = end
        return segments

    @cached_property
    def num_single(self) -> int:
        """Sequences with one new token."""
        return sum(1 for s in self.seqs if s.num_new == 1)

    @cached_property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.seqs)

    @cached_property
    def token_ids(self) -> list[int]:
        return [t for s in self.seqs for t in s.token_ids]

    @cached_property
    def positions(self) -> list[int]:
        return [p for s in self.seqs for p in range(s.start, s.end)]

    @cached_property
    def logits_rows(self) -> list[int]:
        """Rows (of the flattened tokens, in this order) whose logits are sampled or checked."""
        rows: list[int] = []
        first = 0
        for s in self.seqs:
            rows.extend(first + offset for offset in s.sampled)
            first += s.num_new
        return rows

    @cached_property
    def sampled_requests(self) -> list[Request]:
        """The request of each row in ``logits_rows``."""
        return [s.request for s in self.seqs for _ in s.sampled]

    @cached_property
    def all_decodes(self) -> bool:
        return all(s.is_decode for s in self.seqs)

    @cached_property
    def samples_every_seq(self) -> bool:
        """Whole-step accelerators return logits of sampled rows only: a step that scores
        its prompt (prompt logprobs) or in which a request samples nothing needs the
        eager path's hidden states."""
        return all(s.request.samples and not s.request.wants_prompt_logprobs for s in self.seqs)

    @cached_property
    def scores_prompt(self) -> bool:
        return any(s.request.wants_prompt_logprobs for s in self.seqs)

    @cached_property
    def constrained(self) -> list[Request]:
        """Requests with a grammar whose next token (and proposals) this step chooses."""
        return [s.request for s in self.seqs if s.grammar is not None and s.reaches_end]

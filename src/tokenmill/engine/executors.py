"""How a step runs: the kernels, chosen once, and the step executors that use them.

When an engine is built, ``choose_kernels`` turns its ``KernelOptions`` and
device into ``Kernels``: the C kernel library (CPU) or none, and the model's
ops. The runner then builds its step executors, in order of preference:

* ``CudaGraphExecutor``: pure-decode steps replayed from captured CUDA graphs
  (``cuda_graphs.py``), on CUDA;
* ``FusedDecodeExecutor``: decode steps of up to a few dozen sequences (and
  their speculative proposals), every layer in one native call
  (``fused_decode.py``), on CPU with the kernels;
* ``FusedPrefillExecutor``: steps with prefill chunks (and the decodes sharing
  them) through the same native call, where the eager forward would run the
  same C kernels for the layers (``FusedDecoder.prefill_on_kernels``) and the KV
  pool is not quantized, unless a request scores its prompt;
* ``EagerExecutor``: everything, through the model's forward and the
  engine's attention backend.

Each says which steps it accepts; the runner runs a step on the first that
accepts it. No executor asks the environment or the device again per step.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from ..model import cpu_kernels
from ..model.ops import ModelOps, select_ops
from ..options import KernelOptions
from . import fused_decode
from .request import Request

if TYPE_CHECKING:
    from .cuda_graphs import DecodeGraphRunner
    from .runner import ModelRunner

log = logging.getLogger("tokenmill.executors")

StepItems = list[tuple[Request, int]]
StepResult = tuple[torch.Tensor, list[Request]]


@dataclass(frozen=True)
class Kernels:
    """What an engine's steps run on: its options, the C kernel library (None: torch
    only) and the model's ops built on it."""

    options: KernelOptions
    library: cpu_kernels.KernelLibrary | None
    ops: ModelOps


def choose_kernels(device: torch.device, options: KernelOptions) -> Kernels:
    """The kernels of an engine on ``device``: the C library on a CPU when the options
    allow it and it compiles, torch ops elsewhere."""
    library = cpu_kernels.load(options) if device.type == "cpu" else None
    return Kernels(options, library, select_ops(device, library, options.onednn_linear))


class StepExecutor(Protocol):
    name: str

    def accepts(self, items: StepItems) -> bool:
        """Whether this executor runs the step (items: requests and their new tokens)."""
        ...

    def run(self, items: StepItems) -> StepResult:
        """Float32 logits of the sampled rows and the requests they belong to."""
        ...


def _samples_every_row(items: StepItems) -> bool:
    """Whole-step accelerators return logits of sampled rows only: a step that scores
    its prompt (prompt logprobs) or samples nothing needs the eager path's hidden states."""
    return all(r.samples and not r.wants_prompt_logprobs for r, _ in items)


class EagerExecutor:
    """The model's forward over the flattened step: accepts every step."""

    name = "eager"

    def __init__(self, runner: "ModelRunner") -> None:
        self.runner = runner

    def accepts(self, items: StepItems) -> bool:
        return True

    def run(self, items: StepItems) -> StepResult:
        return self.runner.run_eager(items)


def _is_decode(request: Request, num_new: int) -> bool:
    """One new token, or one plus the request's speculative proposals (one row each)."""
    return num_new == 1 + len(request.spec_token_ids)


def fused_step_inputs(items: StepItems) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor,
                                                 torch.Tensor, list[Request]]:
    """A step's rows as the fused native step takes them: token ids, each row's block table
    ([rows, width] int32, -1 past a table's end: a table shorter than its sequence needs is
    refused by the kernel, never read as block 0) and context length, the prefill chunks
    ([C, 2] int32: first row and row count of every item that is not a decode), the rows
    whose logits are sampled and their requests (a proposing request once per row: all its
    rows are checked; a prefill chunk's last row when it reaches the prompt's end)."""
    ids: list[int] = []
    seq_lens: list[int] = []
    counts: list[int] = []
    chunks: list[tuple[int, int]] = []
    rows: list[int] = []
    sampled: list[Request] = []
    for request, num_new in items:
        start, first = request.num_computed_tokens, len(ids)
        ids.extend(request.step_token_ids(start, num_new))
        seq_lens.extend(range(start + 1, start + num_new + 1))
        counts.append(num_new)
        if request.spec_token_ids:
            rows.extend(range(first, first + num_new))
            sampled.extend([request] * num_new)
        else:
            if num_new > 1:
                chunks.append((first, num_new))
            if start + num_new == request.num_tokens and request.samples:
                rows.append(len(ids) - 1)
                sampled.append(request)
    width = max(len(request.block_table) for request, _ in items)
    tables = torch.tensor([request.block_table + [-1] * (width - len(request.block_table)) for request, _ in items],
                          dtype=torch.int32)
    if any(n > 1 for n in counts):
        tables = tables.repeat_interleave(torch.tensor(counts), dim=0)
    return (ids, tables.contiguous(), torch.tensor(seq_lens, dtype=torch.int32),
            torch.tensor(chunks, dtype=torch.int32).reshape(-1, 2), torch.tensor(rows, dtype=torch.int32), sampled)


class _FusedExecutor:
    """Runs a step through the fused native step (``fused_decode.FusedDecoder``)."""

    name = "fused"

    def __init__(self, runner: "ModelRunner", decoder: fused_decode.FusedDecoder) -> None:
        self.runner = runner
        self.decoder = decoder

    def run(self, items: StepItems) -> StepResult:
        return _run_fused(self.runner, self.decoder, items)


class FusedDecodeExecutor(_FusedExecutor):
    """A decode step (one new token per sequence, plus its speculative proposals, one row
    each) of up to ``decoder.max_batch`` rows, through the fused native step."""

    name = "fused CPU decode"

    def accepts(self, items: StepItems) -> bool:
        return (sum(n for _, n in items) <= self.decoder.max_batch and _samples_every_row(items)
                and all(_is_decode(r, n) for r, n in items))


class FusedPrefillExecutor(_FusedExecutor):
    """A step with prefill chunks (and the decodes that share it) through the same fused
    native step: every layer in one call, the chunks attended by the prefill kernel the
    eager model's attention uses, logits only for the rows that sample. Saves the eager
    forward's per-op dispatch and its passes over whole-step intermediates (SiLU runs on
    each gate/up tile as it is made). Steps that score their prompt (prompt logprobs)
    need every row's hidden state and stay eager."""

    name = "fused CPU prefill"

    def accepts(self, items: StepItems) -> bool:
        return (any(not _is_decode(r, n) for r, n in items)
                and not any(r.wants_prompt_logprobs for r, _ in items))


def _run_fused(runner: "ModelRunner", decoder: fused_decode.FusedDecoder, items: StepItems) -> StepResult:
    ids, tables, seq_lens, chunks, rows, sampled = fused_step_inputs(items)
    embeddings = runner.model.embed_tokens(torch.tensor(ids, dtype=torch.long)).float().contiguous()
    logits = decoder.run(embeddings, tables, seq_lens, chunks if chunks.shape[0] else None,
                         rows if len(rows) != len(ids) else None)
    return logits, sampled


class CudaGraphExecutor:
    """Pure-decode steps that fit a captured (batch, width) bucket, replayed from graphs."""

    name = "CUDA graph decode"

    def __init__(self, graphs: "DecodeGraphRunner") -> None:
        self.graphs = graphs
        # The bucket ``accepts`` planned, for the step ``run`` is then given (the same list).
        self._planned: tuple[StepItems, tuple[int, int]] | None = None

    def accepts(self, items: StepItems) -> bool:
        self._planned = None
        if not _samples_every_row(items):
            return False
        bucket = self.graphs.plan(items)
        if isinstance(bucket, str):
            self.graphs.stats.fallback(bucket)
            return False
        self._planned = (items, bucket)
        return True

    def run(self, items: StepItems) -> StepResult:
        planned, self._planned = self._planned, None
        if planned is not None and planned[0] is items:
            bucket = planned[1]
        else:  # called without accepts (tests, tools): plan it here
            plan = self.graphs.plan(items)
            assert not isinstance(plan, str), plan
            bucket = plan
        return self.graphs.execute(items, bucket)

"""How a step runs: the kernels, chosen once, and the step executors that use them.

When an engine is built, ``choose_kernels`` turns its ``KernelOptions`` and
device into ``Kernels``: the C kernel library (CPU) or none, and the model's
ops. The runner then builds its step executors, in order of preference:

* ``CudaGraphExecutor``: pure-decode steps replayed from captured CUDA graphs
  (``cuda_graphs.py``), on CUDA;
* ``FusedDecodeExecutor``: decode steps of up to a few dozen sequences (and
  their speculative proposals), every layer in one native call
  (``fused_decode.py``), on CPU with the kernels;
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
from .request import Request, decode_rows

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


class FusedDecodeExecutor:
    """A decode step (one new token per sequence, plus its speculative proposals, one row
    each) of up to ``decoder.max_batch`` rows, through the fused native step."""

    name = "fused CPU decode"

    def __init__(self, runner: "ModelRunner", decoder: fused_decode.FusedDecoder) -> None:
        self.runner = runner
        self.decoder = decoder

    def accepts(self, items: StepItems) -> bool:
        return (sum(n for _, n in items) <= self.decoder.max_batch and _samples_every_row(items)
                and all(n == 1 + len(r.spec_token_ids) for r, n in items))

    def run(self, items: StepItems) -> StepResult:
        ids, positions, owners, rows, sampled = decode_rows(items)
        seq_lens = [position + 1 for position in positions]
        width = max(len(request.block_table) for request, _ in items)
        # -1 padding: a table shorter than its sequence needs is refused by the kernel
        # (ValueError before anything is written), never read as block 0.
        tables = [request.block_table + [-1] * (width - len(request.block_table)) for request in owners]
        model = self.runner.model
        embeddings = model.embed_tokens(torch.tensor(ids, dtype=torch.long)).float().contiguous()
        logits = self.decoder.run(embeddings, torch.tensor(tables, dtype=torch.int32),
                                  torch.tensor(seq_lens, dtype=torch.int32))
        if len(rows) != len(ids):
            logits = logits[rows]
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

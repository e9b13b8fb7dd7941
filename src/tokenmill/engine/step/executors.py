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

The runner owns the executors, not the other way round: it builds them and
hands each what it runs on (the model and its adapters, the fused decoder,
the captured graphs, the eager step of ``eager.py``); nothing here imports
the runner.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from ...model.kernels import cpu_kernels
from ...model.lora.lora import LoraState
from ...model.models.llama import LlamaForCausalLM
from ...model.ops import ModelOps, select_ops
from ...settings.options import KernelOptions
from . import fused_decode, fused_lora
from ..request import Request
from .cuda_graphs import DecodeGraphRunner
from .eager import EagerStep, StepItems, StepResult
from .step_batch import RowKind, StepBatch

log = logging.getLogger("tokenmill.executors")

__all__ = ["Kernels", "choose_kernels", "StepExecutor", "StepItems", "StepResult", "EagerExecutor",
           "FusedDecodeExecutor", "FusedPrefillExecutor", "CudaGraphExecutor", "fused_step_inputs"]


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

    def accepts(self, batch: StepBatch) -> bool:
        """Whether this executor runs the step."""
        ...

    def run(self, batch: StepBatch) -> StepResult:
        """Float32 logits of the sampled rows and the requests they belong to."""
        ...


class EagerExecutor:
    """The model's forward over the flattened step (``eager.EagerStep``): accepts every step."""

    name = "eager"

    def __init__(self, step: EagerStep) -> None:
        self.step = step

    def accepts(self, batch: StepBatch) -> bool:
        return True

    def run(self, batch: StepBatch) -> StepResult:
        return self.step.run(batch)


def fused_step_inputs(batch: StepBatch) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor,
                                                 torch.Tensor, list[Request]]:
    """A step's rows as the fused native step takes them, in the batch's order: token ids,
    each row's block table ([rows, width] int32, -1 past a table's end: a table shorter
    than its sequence needs is refused by the kernel, never read as block 0) and context
    length, the prefill chunks ([C, 2] int32: first row and row count of every
    ``RowKind.PREFILL`` sequence), the rows whose logits are sampled and their requests."""
    seq_lens: list[int] = []
    counts: list[int] = []
    chunks: list[tuple[int, int]] = []
    first = 0
    for seq in batch.seqs:
        seq_lens.extend(range(seq.start + 1, seq.end + 1))
        counts.append(seq.num_new)
        if seq.kind is RowKind.PREFILL:
            chunks.append((first, seq.num_new))
        first += seq.num_new
    width = max(len(seq.block_table) for seq in batch.seqs)
    tables = torch.tensor([seq.block_table + (-1,) * (width - len(seq.block_table)) for seq in batch.seqs],
                          dtype=torch.int32)
    if any(n > 1 for n in counts):
        tables = tables.repeat_interleave(torch.tensor(counts), dim=0)
    return (batch.token_ids, tables.contiguous(), torch.tensor(seq_lens, dtype=torch.int32),
            torch.tensor(chunks, dtype=torch.int32).reshape(-1, 2),
            torch.tensor(batch.logits_rows, dtype=torch.int32), batch.sampled_requests)


class _FusedExecutor:
    """Runs a step through the fused native step (``fused_decode.FusedDecoder``); rows of
    LoRA adapters too (``fused_lora.py``), when the model has adapters."""

    name = "fused"

    def __init__(self, model: LlamaForCausalLM, lora: LoraState | None, decoder: fused_decode.FusedDecoder) -> None:
        self.model = model
        self.lora = lora
        self.decoder = decoder
        self.adapter_tables = (fused_lora.AdapterTables(len(model.layers), decoder.lib.vector_width)
                               if lora is not None else None)

    def run(self, batch: StepBatch) -> StepResult:
        segments = None
        if batch.has_adapters:
            assert self.adapter_tables is not None and self.lora is not None
            # each adapter's rows together: the kernel reads an adapter's weights once per
            # segment, so rows dealt round robin would read them once per row
            batch = batch.decodes_first()
            segments = self.adapter_tables.segments(self.lora, batch.adapter_segments)
        return _run_fused(self.model, self.decoder, batch, segments)


class FusedDecodeExecutor(_FusedExecutor):
    """A decode step (one new token per sequence, plus its speculative proposals, one row
    each) of up to ``decoder.max_batch`` rows, through the fused native step."""

    name = "fused CPU decode"

    def accepts(self, batch: StepBatch) -> bool:
        return batch.num_tokens <= self.decoder.max_batch and batch.samples_every_seq and batch.all_decodes


class FusedPrefillExecutor(_FusedExecutor):
    """A step with prefill chunks (and the decodes that share it) through the same fused
    native step: every layer in one call, the chunks attended by the prefill kernel the
    eager model's attention uses, logits only for the rows that sample. Saves the eager
    forward's per-op dispatch and its passes over whole-step intermediates (SiLU runs on
    each gate/up tile as it is made). Steps that score their prompt (prompt logprobs)
    need every row's hidden state and stay eager."""

    name = "fused CPU prefill"

    def accepts(self, batch: StepBatch) -> bool:
        return not batch.all_decodes and not batch.scores_prompt


def _run_fused(model: LlamaForCausalLM, decoder: fused_decode.FusedDecoder, batch: StepBatch,
               lora_segments: object = None) -> StepResult:
    ids, tables, seq_lens, chunks, rows, sampled = fused_step_inputs(batch)
    embeddings = model.embed_tokens(torch.tensor(ids, dtype=torch.long)).float().contiguous()
    logits = decoder.run(embeddings, tables, seq_lens, chunks if chunks.shape[0] else None,
                         rows if len(rows) != len(ids) else None, lora_segments)  # type: ignore[arg-type]
    return logits, sampled


class CudaGraphExecutor:
    """Pure-decode steps that fit a captured (batch, width) bucket, replayed from graphs."""

    name = "CUDA graph decode"

    def __init__(self, graphs: DecodeGraphRunner) -> None:
        self.graphs = graphs
        # The bucket ``accepts`` planned, for the step ``run`` is then given (the same batch).
        self._planned: tuple[StepBatch, tuple[int, int]] | None = None

    def accepts(self, batch: StepBatch) -> bool:
        self._planned = None
        if not batch.samples_every_seq or batch.has_adapters:  # graphs were captured without adapters
            return False
        bucket = self.graphs.plan(batch)
        if isinstance(bucket, str):
            self.graphs.stats.fallback(bucket)
            return False
        self._planned = (batch, bucket)
        return True

    def run(self, batch: StepBatch) -> StepResult:
        planned, self._planned = self._planned, None
        if planned is not None and planned[0] is batch:
            bucket = planned[1]
        else:  # called without accepts (tests, tools): plan it here
            plan = self.graphs.plan(batch)
            assert not isinstance(plan, str), plan
            bucket = plan
        return self.graphs.execute(batch, bucket)

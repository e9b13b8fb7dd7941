"""CUDA graphs for pure-decode steps: one launch per step instead of hundreds.

A decode step of a small model on a GPU is bound by kernel launches, not by
math: SmolLM2's 30 layers issue several hundred small kernels for a handful of
tokens, each costing microseconds of CPU time to launch. A CUDA graph records
those launches once and replays them with one call. The price: a graph runs on
fixed addresses and fixed shapes, so every input must already sit in a static
buffer, every shape must be known at capture, and nothing in the recorded
region may talk to the host (no ``.item()``, no tensors built from Python
lists, no copies between host and device, no data-dependent shapes).

How a decode step fits that (``DecodeGraphRunner``):

* **Buckets.** A step of ``n`` decodes whose longest context spans ``blocks``
  KV blocks runs the graph of the smallest batch bucket ``>= n`` (1, 2, 4, 8,
  16, 24, 32, 48, 64, ...) and the smallest block-table width bucket
  ``>= blocks`` (powers of two up to ``ceil(max_model_len / block_size)``).
  The width is a bucket too because the torch decode path gathers every
  row's table up to the width: a single max-width graph would gather 512
  blocks per sequence at a 8K context for a 100-token chat.
* **Static inputs.** Each graph owns one int64 buffer holding token ids,
  positions, K/V slots, context lengths and the ``[batch, width]`` block
  table. A step builds the same layout on the host (pinned on CUDA) and copies
  it in with one transfer *before* the replay (outside the graph). The
  decode mask and gather index are computed *inside* the graph from those
  tensors, so they cost no host work at all.
* **Padding.** Rows past ``n`` and table entries past a row's context point at
  a scratch block: the runner allocates one block more than the block pool
  owns and the pool never hands that id out. A padded row has context length
  1, so its softmax sees one finite key; its K/V write lands in the scratch
  block; its logits are computed and ignored. No real block is ever written
  by a padded row, and each real row's attention reads only its own blocks
  (every matmul is row-independent), so padding cannot change a real row.
* **When a graph applies.** Only steps where every item computes one token
  (decodes, and 1-token prefill chunks, which are the same math), ``n`` at
  most the largest batch bucket and the context within the largest width.
  Anything else (a step with a prefill chunk, a batch above the largest
  bucket) runs eager, through the same ``ModelRunner.execute`` as without
  graphs. Only the torch decode path is recorded (the one CUDA runs): a runner
  whose decodes go through the CPU C kernel (a ctypes call no graph holds)
  gets no graphs.
* **Lazy capture, one shared pool.** A graph is captured the first time its
  (batch, width) pair is needed, not at start-up as vLLM does for its 1-D
  batch list: the 2-D bucket grid has over a hundred cells for an 8K model,
  most of which a given workload never reaches, and each capture costs
  warm-up runs plus memory for its static buffers. The price is one slower
  step the first time a bucket is reached. All graphs share one memory pool
  (they never run concurrently); each step copies the logits it needs out of
  the graph's output before the next replay can overwrite shared memory.
  Captures happen with padding in the static inputs, so the warm-up runs
  (which execute for real) write only the scratch block.

The graph machinery is behind a two-method backend so that everything except
the literal CUDA calls runs on CPU in tests: ``CudaGraphBackend`` records with
``torch.cuda.CUDAGraph`` on a side stream after warm-up runs;
``EmulatedGraphBackend`` "captures" by running the callable once and
"replays" by running it again into the same output tensor, reading the same
static buffers, so a missing copy into a static buffer shows up as a wrong
result on CPU too. It also refuses, while recording and replaying, the ops a
real capture cannot hold (``.item()``, tensors made from Python data,
boolean-mask indexing, ``nonzero``).

``TOKENMILL_CUDA_GRAPHS=0`` turns graphs off (vLLM's ``enforce_eager``).
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ...model.attention import AttentionBackend, GraphCaptureUnsupported
from ...model.models.llama import LlamaForCausalLM
from ...settings.options import KernelOptions
from ..request import Request
from .step_batch import StepBatch

log = logging.getLogger("tokenmill.cuda_graphs")

_BATCH_STEPS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
_FIELDS = 4  # ids, positions, slots, seq_lens: one row each ahead of the block table


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Captured batch sizes up to ``max_batch`` (which is always the last one)."""
    sizes = [b for b in _BATCH_STEPS if b < max_batch]
    return tuple(sizes + [max_batch])


def width_buckets(max_width: int) -> tuple[int, ...]:
    """Block-table widths: powers of two below ``max_width``, then ``max_width``."""
    widths, w = [], 1
    while w < max_width:
        widths.append(w)
        w *= 2
    return tuple(widths + [max_width])


def _bucket(value: int, buckets: tuple[int, ...]) -> int | None:
    return next((b for b in buckets if b >= value), None)


# --------------------------------------------------------------------------- backends


class CapturedGraph(Protocol):
    output: torch.Tensor

    def replay(self) -> None: ...


class GraphBackend(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> CapturedGraph:
        """Record ``fn`` (which reads only static buffers) and return its static output."""
        ...


@dataclass
class _CudaCaptured:
    graph: "torch.cuda.CUDAGraph"
    output: torch.Tensor
    # The recorded callable, kept for what its closure holds: a graph replays fixed
    # addresses and keeps none of its inputs alive, so a tensor made outside the
    # recording and held only by the closure (the key positions) would go back to the
    # allocator and be overwritten.
    fn: Callable[[], torch.Tensor]

    def replay(self) -> None:
        self.graph.replay()


class CudaGraphBackend:
    """``torch.cuda.CUDAGraph``: warm-up runs on a side stream (lazy cuBLAS/cuDNN setup
    and allocator growth must not happen inside the recording), then capture into a
    memory pool shared by every graph of this runner."""

    def __init__(self, device: torch.device, warmup_runs: int = 2) -> None:
        self.device = device
        self.warmup_runs = warmup_runs
        self.pool = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> CapturedGraph:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(self.warmup_runs):
                fn()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = fn()
        return _CudaCaptured(graph, output, fn)


class CaptureViolation(RuntimeError):
    """An op a CUDA graph cannot record ran inside the (emulated) captured region."""


class _CaptureGuard(TorchDispatchMode):
    """Refuses host syncs and data-dependent shapes, as a real capture would."""

    _SYNC = {"item", "_local_scalar_dense", "nonzero", "masked_select", "lift_fresh", "lift_fresh_copy",
             "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func._schema.name.split("::")[-1]
        if name in self._SYNC:
            raise CaptureViolation(f"{func} cannot run inside a CUDA graph (host sync or data-dependent shape)")
        if name in ("index", "index_put", "index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
            raise CaptureViolation(f"{func} with a boolean mask has a data-dependent shape")
        return func(*args, **(kwargs or {}))


@dataclass
class _EmulatedCaptured:
    fn: Callable[[], torch.Tensor]
    output: torch.Tensor
    strict: bool
    replays: int = 0

    def replay(self) -> None:
        with _guard(self.strict):
            result = self.fn()
        if result.shape != self.output.shape or result.dtype != self.output.dtype:
            raise CaptureViolation(f"replay produced {tuple(result.shape)} {result.dtype}, "
                                   f"captured {tuple(self.output.shape)} {self.output.dtype}")
        self.output.copy_(result)
        self.replays += 1


def _guard(strict: bool) -> contextlib.AbstractContextManager:
    return _CaptureGuard() if strict else contextlib.nullcontext()


class EmulatedGraphBackend:
    """CPU stand-in for tests: capture runs ``fn`` once and keeps its output tensor;
    replay runs ``fn`` again (on the same static buffers) and copies the result into
    that tensor, as a replay refills a graph's output in place."""

    def __init__(self, strict: bool = True) -> None:
        self.strict = strict
        self.captured: list[_EmulatedCaptured] = []

    def capture(self, fn: Callable[[], torch.Tensor]) -> CapturedGraph:
        with _guard(self.strict):
            output = fn()
        graph = _EmulatedCaptured(fn, output, self.strict)
        self.captured.append(graph)
        return graph


def default_backend(device: torch.device) -> GraphBackend | None:
    """The backend a runner on ``device`` uses when none is injected: CUDA graphs on CUDA."""
    if device.type == "cuda" and torch.cuda.is_available():
        return CudaGraphBackend(device)
    return None


def select_backend(device: torch.device, options: KernelOptions,
                   injected: GraphBackend | None = None) -> GraphBackend | None:
    """The backend for a new runner whose attention runs the torch path (what graphs
    record), or None for eager only (switched off, no CUDA)."""
    if not options.cuda_graphs:
        return None
    return injected or default_backend(device)


# --------------------------------------------------------------------------- the decode graphs


@dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0
    eager: dict[str, int] = field(default_factory=dict)  # reason -> steps run eager

    def fallback(self, reason: str) -> None:
        self.eager[reason] = self.eager.get(reason, 0) + 1


@dataclass
class _DecodeGraph:
    batch: int
    width: int
    static: torch.Tensor  # [_FIELDS * batch + batch * width] int64 on the device
    host: torch.Tensor  # the same layout on the host (pinned on CUDA)
    graph: CapturedGraph | None = None
    # CUDA: recorded after the asynchronous host->device copy; the next step waits on it
    # before rewriting the pinned host buffer (a step that samples nothing never syncs).
    copied: "torch.cuda.Event | None" = None


class DecodeGraphRunner:
    """Pure-decode steps through captured graphs; ``try_execute`` returns None when
    a step must run eager."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, scratch_block: int, dtype: torch.dtype, device: torch.device,
                 backend: GraphBackend, attention: AttentionBackend, max_batch: int = 256, max_width: int | None = None,
                 batch_sizes: tuple[int, ...] | None = None, widths: tuple[int, ...] | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.pool_blocks = kv_caches[0][0].shape[1]
        assert scratch_block < self.pool_blocks, "the scratch block must be inside the KV pool"
        self.kv_heads = kv_caches[0][0].shape[0]
        self.dtype = dtype
        self.device = device
        self.backend = backend
        if not attention.capabilities.cuda_graphs:  # the runner asks before it builds graphs
            raise GraphCaptureUnsupported(f"the {attention.name} backend cannot be captured in a CUDA graph")
        self.attention = attention
        if max_width is None:  # a sequence never spans more than max_model_len tokens, nor the pool
            max_width = min(-(-model.rope.cos.shape[0] // block_size), scratch_block)
        self.batch_sizes = batch_sizes or batch_buckets(max_batch)
        self.widths = widths or width_buckets(max(1, max_width))
        self.graphs: dict[tuple[int, int], _DecodeGraph] = {}
        self.stats = GraphStats()

    # -- deciding -------------------------------------------------------
    def plan(self, batch: StepBatch) -> tuple[int, int] | str:
        """The (batch, width) bucket of a step, or why it runs eager."""
        if not batch or batch.num_single != len(batch):
            return "not_pure_decode"
        size = _bucket(len(batch), self.batch_sizes)
        if size is None:
            return "batch_too_large"
        bs = self.block_size
        need = max(-(-(seq.start + 1) // bs) for seq in batch.seqs)
        width = _bucket(need, self.widths)
        if width is None:
            return "context_too_long"
        if any(len(seq.block_table) < -(-(seq.start + 1) // bs) for seq in batch.seqs):
            return "short_block_table"  # not a state the scheduler makes; eager handles it as it always has
        return size, width

    # -- running --------------------------------------------------------
    def execute(self, batch: StepBatch, bucket: tuple[int, int]) -> tuple[torch.Tensor, list[Request]]:
        """Replay the graph of ``bucket`` (from ``plan``) on this step."""
        graph = self._graph(*bucket)
        self._fill(graph, batch)
        rows, sampled = batch.logits_rows, batch.sampled_requests
        graph.static.copy_(graph.host, non_blocking=graph.copied is not None)
        if graph.copied is not None:
            graph.copied.record()
        assert graph.graph is not None
        graph.graph.replay()
        self.stats.replays += 1
        out = graph.graph.output
        # A copy, not a view: the next replay of any graph may reuse this memory (shared pool).
        if len(rows) == len(batch):
            logits = out[: len(batch)].clone()
        else:  # some rows are 1-token prefill chunks short of their prompt's end (maybe all)
            logits = out[torch.tensor(rows, dtype=torch.long, device=out.device)]
        return logits, sampled

    def _fill(self, graph: _DecodeGraph, batch: StepBatch) -> None:
        """Write the step (one token per sequence) into the graph's host buffer; padded rows
        and table entries point at the scratch block."""
        b, w, bs = graph.batch, graph.width, self.block_size
        n = len(batch)
        scratch = self.scratch_block
        pad = [0] * (b - n)
        ids, positions = batch.token_ids + pad, batch.positions + pad
        slots = [scratch * bs] * b
        lens = [1] * b
        counts = [0] * b
        blocks: list[int] = []
        for row, seq in enumerate(batch.seqs):
            table, pos = seq.block_table, seq.start
            slots[row] = table[pos // bs] * bs + pos % bs
            lens[row] = pos + 1
            used = pos // bs + 1
            counts[row] = used
            blocks.extend(table[:used])
        if graph.copied is not None:
            graph.copied.synchronize()  # the previous step's copy has read the buffer
        host = graph.host
        host[: _FIELDS * b] = torch.tensor(ids + positions + slots + lens, dtype=torch.long)
        tables = host[_FIELDS * b :].view(b, w)
        tables.fill_(scratch)
        if n:
            used_mask = torch.arange(w)[None, :] < torch.tensor(counts, dtype=torch.long)[:, None]
            tables[used_mask] = torch.tensor(blocks, dtype=torch.long)

    def _graph(self, batch: int, width: int) -> _DecodeGraph:
        key = (batch, width)
        graph = self.graphs.get(key)
        if graph is None:
            size = _FIELDS * batch + batch * width
            pin = self.device.type == "cuda"
            host = torch.empty(size, dtype=torch.long, pin_memory=pin)
            graph = _DecodeGraph(batch, width, torch.empty(size, dtype=torch.long, device=self.device), host,
                                 copied=torch.cuda.Event() if pin else None)
            self._fill(graph, StepBatch(()))  # capture (and its warm-up runs) on padding: only the scratch block is written
            graph.static.copy_(graph.host)
            graph.graph = self.backend.capture(self._forward_fn(graph))
            self.graphs[key] = graph
            self.stats.captures += 1
            log.debug("cuda graphs: captured batch %d x width %d blocks", batch, width)
        return graph

    def _forward_fn(self, graph: _DecodeGraph) -> Callable[[], torch.Tensor]:
        """The recorded step: reads only the graph's static buffer, the weights and the pool."""
        b, w, bs = graph.batch, graph.width, self.block_size
        static = graph.static
        ids, positions, slots, lens = (static[i * b : (i + 1) * b] for i in range(_FIELDS))
        tables = static[_FIELDS * b :].view(b, w)
        key_pos = torch.arange(w * bs, device=self.device)[None, None, :]  # built once, outside the graph
        model, kv_caches, attention = self.model, self.kv_caches, self.attention

        def forward() -> torch.Tensor:
            # The same mask and gather index the eager path builds, computed on the device
            # from the static tensors.
            attn = attention.graph_decode_step(slots, tables, lens, key_pos, b, w, bs)
            hidden = model(ids, positions, kv_caches, attn)
            return model.compute_logits(hidden)

        return forward

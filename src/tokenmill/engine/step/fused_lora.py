"""LoRA adapters in the fused native step (``csrc/lora.c``; ``TmDelta``, ``TmSegment`` in ``csrc/tm_kernels.h``).

A step with adapter rows would otherwise leave the fused step for the eager
forward, whose per-op dispatch costs more than the adapters' arithmetic (at 64
rows the low-rank products were about a tenth of the eager step). Here each
resident adapter gets, once, a native table of its deltas per layer and fused
projection: ``at`` = A transposed (its ranks padded to whole vectors) and ``bt``
= B transposed (scaled as loaded) in panels of two vectors' columns, both float32, and where B is not zero (each part of a fused projection,
q/k/v or gate/up, has its own ranks), so that the kernel adds ``(x a^T) bt`` to
each adapted row's projection output, for whole row segments
(``StepBatch.adapter_segments``).
Tables follow the resident set: a table is rebuilt when its adapter id holds
other weights (unloaded, another loaded under the id) and dropped when the
adapter leaves.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

from ...model.lora.lora import FUSED, LoraState, LoraWeights


class TmDelta(ctypes.Structure):
    _fields_ = [("at", ctypes.c_void_p), ("bt", ctypes.c_void_p), ("r", ctypes.c_int64), ("rp", ctypes.c_int64),
                ("n_parts", ctypes.c_int64), ("part", (ctypes.c_int64 * 4) * 3)]


class TmSegment(ctypes.Structure):
    _fields_ = [("deltas", ctypes.POINTER(TmDelta)), ("row0", ctypes.c_int64), ("row1", ctypes.c_int64)]


@dataclass
class _Table:
    weights: LoraWeights  # the adapter the table was made from (identity checked)
    deltas: ctypes.Array  # type: ignore[type-arg]  # [num_layers * 4] TmDelta
    keep: list[torch.Tensor]


def _panels(bt: torch.Tensor, width: int) -> torch.Tensor:
    """B^T [r, n] as the kernel reads it (``lora_panel``): columns in panels of ``width``
    (the last padded with zeros), each panel's [r, width] block contiguous, so the ranks of
    the columns a tile updates are read as one stream."""
    r, n = bt.shape
    padded = torch.zeros(r, -(-n // width) * width)
    padded[:, :n] = bt
    return padded.reshape(r, -1, width).transpose(0, 1).contiguous()


def _table(weights: LoraWeights, num_layers: int, vector_width: int) -> _Table:
    keep: list[torch.Tensor] = []
    deltas = (TmDelta * (num_layers * len(FUSED)))()
    for li, layer in enumerate(weights.layers):
        for p, name in enumerate(FUSED):
            delta = layer.get(name)
            if delta is None:
                continue
            r = delta.a.shape[0]
            rp = -(-r // vector_width) * vector_width
            at = torch.zeros(delta.a.shape[1], rp)  # A^T, ranks padded with zeros to whole vectors
            at[:, :r] = delta.a.detach().float().t()
            bt = _panels(delta.b.detach().float().t(), 2 * vector_width)
            keep += [at, bt]
            entry = deltas[li * len(FUSED) + p]
            entry.at, entry.bt, entry.r, entry.rp, entry.n_parts = at.data_ptr(), bt.data_ptr(), r, rp, len(delta.parts)
            for i, bounds in enumerate(delta.parts):
                entry.part[i][:] = bounds
    return _Table(weights, deltas, keep)


@dataclass
class AdapterTables:
    """The native tables of the adapters the fused step has met, by adapter id."""

    num_layers: int
    vector_width: int  # the kernels' floats per vector (a table's ranks are padded to it)
    tables: dict[int, _Table] = field(default_factory=dict)

    def segments(self, state: LoraState, segments: list[tuple[int, int, int]]) -> ctypes.Array:  # type: ignore[type-arg]
        """This step's ``(adapter, first row, end row)`` runs as the kernel's segments."""
        for gone in [aid for aid in self.tables if aid not in state.adapters]:
            del self.tables[gone]
        out = (TmSegment * len(segments))()
        for i, (aid, row0, row1) in enumerate(segments):
            weights = state.adapters[aid]
            table = self.tables.get(aid)
            if table is None or table.weights is not weights:
                table = self.tables[aid] = _table(weights, self.num_layers, self.vector_width)
            out[i] = TmSegment(ctypes.cast(table.deltas, ctypes.POINTER(TmDelta)), row0, row1)
        return out

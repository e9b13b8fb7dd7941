"""The dense building blocks every decoder family shares: the projection (``Linear``, its
fused residual add), ``linear_add`` for any projection, and the gated MLP.

Their own module so that families and variants (model/models/moe.py's experts are gated MLPs)
build on them without importing the Llama model that uses them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...settings.config import ModelConfig
from ..ops import TORCH_OPS, ModelOps


class Linear(nn.Linear):
    """``nn.Linear`` whose float32 matmuls on CPU go through oneDNN's linear (what
    torch already uses for bf16) instead of MKL's sgemm. Same float32 arithmetic, in
    another summation order, measured faster at SmolLM2's shapes (most for the
    LM head; see docs/performance.md), never slower. Only when the engine's ops
    enable it (``ModelOps.onednn_linear``) and without autograd (the op has no
    backward); the engine runs in inference mode."""

    ops: ModelOps = TORCH_OPS  # bound by LlamaForCausalLM.use_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._onednn(x):
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``: through oneDNN the add is a post-op of the matmul (the
        same float32 sum, bit for bit, without a second pass over the output)."""
        if self._onednn(x) and residual.dtype == torch.float32 and residual.is_contiguous():
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight, self.bias, "add")
        return residual + self.forward(x)

    def _onednn(self, x: torch.Tensor) -> bool:
        return (x.dtype == torch.float32 and x.device.type == "cpu" and self.weight.dtype == torch.float32
                and self.ops.onednn_linear and not torch.is_grad_enabled())


def linear_add(layer: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + layer(x)`` for any projection: a layer with a fused add (dense ``Linear``,
    a LoRA wrapper) does it itself; quantized ones have none."""
    forward_add = getattr(layer, "forward_add", None)
    if forward_add is not None:
        return forward_add(x, residual)
    return residual + layer(x)


class MLP(nn.Module):
    ops: ModelOps = TORCH_OPS  # bound by LlamaForCausalLM.use_ops

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.intermediate = intermediate_size or cfg.intermediate_size  # an expert's own width (model/models/moe.py)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.intermediate, bias=False)
        self.down_proj = Linear(self.intermediate, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP's output, added to ``residual`` when one is given."""
        gate_up = self.gate_up_proj(x)
        act = self.ops.silu_mul(gate_up, self.intermediate)
        return self.down_proj(act) if residual is None else linear_add(self.down_proj, act, residual)

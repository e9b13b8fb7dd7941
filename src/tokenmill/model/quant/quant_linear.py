"""The base of every quantized projection: shapes in and out, the bias, the ops it is bound to.

Its own module so that each format's layer (quant.py's int8 / int4 / GGUF-block layers,
kquant.py's K-quant blocks) builds on it without the formats importing each other.
"""
from __future__ import annotations

import torch
from torch import nn

from ..ops import TORCH_OPS, ModelOps


class QuantLinearBase(nn.Module):
    """Common shape handling: activations go in as bf16, come back in the caller's dtype."""

    ops: ModelOps = TORCH_OPS  # bound by LlamaForCausalLM.use_ops: the C kernels, when the engine has them

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        y = self._matmul(x2) if x2.shape[0] else x2.new_zeros((0, self.out_features))
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 [out, in] weight this layer multiplies by (the test reference)."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"

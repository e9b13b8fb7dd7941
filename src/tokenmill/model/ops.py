"""The model's elementwise ops and linear choices, chosen once per engine.

A layer does not try a C kernel and fall back on every call: the engine picks
one ``ModelOps`` when it is built (``select_ops``) and binds it to the model
(``LlamaForCausalLM.use_ops``). ``TORCH_OPS`` is the plain torch formulation,
the default of a model no engine has bound (tests, conversions), and what
CUDA uses; ``ModelOps(library=...)`` runs RMSNorm, rotary and SiLU(gate) * up
through the C kernels (``cpu_kernels``, one pass each instead of two to seven
ATen ops), with the same rounding as the torch formulation.

A kernel op still hands a tensor it cannot take (another dtype, a layout the
kernel does not read, such as the 3-D per-head norms of Qwen3) to the torch
formulation: that is a property of the tensor, not a per-call decision about
the machine.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kernels import cpu_kernels
from .kernels.cpu_kernels import KernelLibrary


@dataclass(frozen=True)
class ModelOps:
    """``library``: the C kernels, or None for torch ops. ``onednn_linear``: float32 CPU
    linears through oneDNN's linear (probed once, see ``onednn_linear_available``).
    """

    library: KernelLibrary | None = None
    onednn_linear: bool = False

    @property
    def name(self) -> str:
        return "C kernels" if self.library is not None else "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.library is not None:
            out = cpu_kernels.rms_norm(x, weight, eps, self.library)
            if out is not None:
                return out
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(dtype)

    def silu_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        if self.library is not None:
            out = cpu_kernels.silu_mul(gate_up, inter, self.library)
            if out is not None:
                return out
        gate, up = gate_up.split(inter, dim=-1)
        return F.silu(gate) * up

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding (rotate-half, sign folded into ``signed_sin``); in place when the
        kernel takes ``x``, a new tensor otherwise."""
        if self.library is not None and cpu_kernels.rope_(x, cos, signed_sin, self.library):
            return x
        return rotate_half(x, cos, signed_sin)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1), with the sign in the table."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


TORCH_OPS = ModelOps()


def bind_ops(root: torch.nn.Module, ops: ModelOps) -> None:
    """Bind ``ops`` to every module under ``root`` that reads them, and let quantized layers
    make the layouts those kernels read (``prepare_kernels``: binding the same ops again
    changes nothing)."""
    for module in root.modules():
        if isinstance(getattr(type(module), "ops", None), ModelOps):
            module.ops = ops
            prepare = getattr(module, "prepare_kernels", None)
            if prepare is not None:  # layouts the bound kernels read (counted in the weights)
                prepare()


@functools.lru_cache(maxsize=1)
def onednn_linear_available() -> bool:
    """Whether torch here has oneDNN's linear and it answers a probe correctly."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    try:
        x, w = torch.randn(3, 8), torch.randn(5, 8)
        with torch.inference_mode():
            got = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        return bool(torch.allclose(got, x @ w.T, atol=1e-5))
    except (RuntimeError, NotImplementedError):
        return False


def select_ops(device: torch.device, library: KernelLibrary | None, onednn_linear: bool) -> ModelOps:
    """The ops of an engine on ``device``: the C kernels when it is a CPU and a library was
    loaded, oneDNN linears when asked for and present."""
    if device.type != "cpu":
        return TORCH_OPS
    return ModelOps(library, onednn_linear and onednn_linear_available())

"""Activation smoothing for int8 x int8 layers (SmoothQuant's idea).

Dynamic int8 activations take one scale per token, so a few input channels
with large values (RMSNorm outputs have them in every Llama) squeeze every
other channel into a handful of levels. Dividing input channel j by s_j and
multiplying the weight's column j by s_j leaves the product unchanged and
moves the range into the weights, which quantize per output channel and can
take it. The division is folded into whatever produces the input, so it
costs nothing at run time:

* q/k/v and gate/up read an RMSNorm's output: its weight is divided by s;
* down reads SiLU(gate) * up, which is linear in up: up's rows are divided by s.

(o reads the attention output, whose channels come from V rows shared by a
group of query heads; it keeps plain dynamic activations.)

s_j = max|x_j|^alpha / max|W_{:,j}|^(1 - alpha), with the activation maxima
measured by running calibration text through the float model (the engine runs
it: ``engine/loading.py: smooth_for_int8``; this module knows no scheduler).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

ALPHA = 0.5  # migration strength: measured best of 0.35-0.8 on the bundled model
CALIBRATION_TOKENS = 768

SMOOTHED = ("self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj")


@torch.no_grad()
def calibrate(model: nn.Module, run: Callable[[], None]) -> dict[str, torch.Tensor]:
    """Per-input-channel max |x| of every smoothed projection while ``run()`` feeds the model."""
    amax: dict[str, torch.Tensor] = {}
    hooks = []
    wrapped: list[nn.Module] = []
    for i, layer in enumerate(model.layers):  # type: ignore[attr-defined]
        for path in SMOOTHED:
            name = f"layers.{i}.{path}"

            def hook(_mod: nn.Module, args: tuple[torch.Tensor, ...], name: str = name) -> None:
                x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(dim=0).float()
                prev = amax.get(name)
                amax[name] = x if prev is None else torch.maximum(prev, x)

            try:
                mod = layer.get_submodule(path)
            except AttributeError:  # a mixture of experts' layer has no dense MLP: its experts stay unsmoothed
                continue
            hooks.append(mod.register_forward_pre_hook(hook))
            if hasattr(mod, "forward_add"):  # residual adds call it directly, past the hooks
                plain = mod.forward_add

                def forward_add(x: torch.Tensor, residual: torch.Tensor, mod: nn.Module = mod, plain=plain,
                                hook=hook) -> torch.Tensor:
                    hook(mod, (x,))
                    return plain(x, residual)

                mod.forward_add = forward_add
                wrapped.append(mod)
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
        for mod in wrapped:
            del mod.forward_add  # back to the class's method
    return amax


def _factors(x_max: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    w_max = weight.detach().abs().amax(dim=0).float().clamp_min(1e-5)
    s = x_max.clamp_min(1e-5).pow(alpha) / w_max.pow(1.0 - alpha)
    return s.clamp(1e-2, 1e2)


@torch.no_grad()
def smooth(model: nn.Module, amax: dict[str, torch.Tensor], alpha: float = 0.5) -> int:
    """Fold smoothing factors into the float model in place (outputs unchanged up to
    rounding); returns how many projections were smoothed."""
    done = 0
    for i, layer in enumerate(model.layers):  # type: ignore[attr-defined]
        attn, mlp = layer.self_attn, layer.mlp
        if not hasattr(mlp, "gate_up_proj"):  # experts (model/models/moe.py): the attention's input only
            x = amax.get(f"layers.{i}.self_attn.qkv_proj")
            if x is not None:
                s = _factors(x, attn.qkv_proj.weight, alpha).to(attn.qkv_proj.weight.dtype)
                layer.input_layernorm.weight.div_(s.to(layer.input_layernorm.weight.dtype))
                attn.qkv_proj.weight.mul_(s[None, :])
                done += 1
            continue
        inter = mlp.down_proj.weight.shape[1]
        # The norm whose output gate/up read: Gemma has its own before the MLP (and a
        # post-attention norm on the attention's output, which smoothing must not touch).
        mlp_norm = getattr(layer, "pre_feedforward_layernorm", None) or layer.post_attention_layernorm
        pairs = (
            ("self_attn.qkv_proj", attn.qkv_proj, layer.input_layernorm.weight),
            ("mlp.gate_up_proj", mlp.gate_up_proj, mlp_norm.weight),
        )
        for path, proj, norm_weight in pairs:
            x = amax.get(f"layers.{i}.{path}")
            if x is None:
                continue
            s = _factors(x, proj.weight, alpha).to(proj.weight.dtype)
            norm_weight.div_(s.to(norm_weight.dtype))
            proj.weight.mul_(s[None, :])
            done += 1
        x = amax.get(f"layers.{i}.mlp.down_proj")
        if x is not None:
            s = _factors(x, mlp.down_proj.weight, alpha).to(mlp.down_proj.weight.dtype)
            up = mlp.gate_up_proj.weight[inter : 2 * inter]
            up.div_(s[:, None])
            if getattr(mlp.gate_up_proj, "bias", None) is not None:
                mlp.gate_up_proj.bias[inter : 2 * inter].div_(s)
            mlp.down_proj.weight.mul_(s[None, :])
            done += 1
    return done

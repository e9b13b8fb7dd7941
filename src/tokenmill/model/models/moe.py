"""Mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks each token's top-k
experts, and each expert is an ordinary gated MLP.

Grouped, not per token: the step's rows are sorted by expert, so each expert
runs once per step on all the rows routed to it and its weights are read once,
whatever the batch. Each expert is a ``llama.MLP`` (fused gate/up and down
projections), so quantization replaces its projections like a dense layer's
(int8, int4, GGUF blocks) and their kernels (the C kernels on the CPU) apply.

Checkpoints name experts three ways; the loaders bring all of them to one:
``model.layers.{i}.mlp.gate.weight`` (the router) and
``model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight``
(``canonical_expert_names``): Mixtral's ``block_sparse_moe.experts.{j}.w1/w3/w2``,
and stacked 3-D tensors (transformers 5's ``mlp.experts.gate_up_proj``,
llama.cpp's ``ffn_*_exps``) split per expert.
"""
from __future__ import annotations

import re
from typing import Callable

import torch
from torch import nn

from ...settings.config import ModelConfig
from .layers import MLP, Linear


def is_sparse_layer(cfg: ModelConfig, index: int) -> bool:
    """Whether decoder layer ``index`` has experts (Qwen3-MoE's rule; Mixtral: every layer)."""
    return (cfg.num_experts > 0 and index not in cfg.mlp_only_layers
            and (index + 1) % max(1, cfg.decoder_sparse_step) == 0)


class SparseMoE(nn.Module):
    """Router (softmax over experts, top-k, renormalised when the config says so) and the
    experts, computed grouped by expert; the weighted outputs are summed per token in
    expert order, as transformers sums them."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.num_experts_per_tok < 1 or cfg.num_experts_per_tok > cfg.num_experts:
            raise ValueError(f"{cfg.num_experts_per_tok} experts per token out of {cfg.num_experts}")
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.normalize = cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        width = cfg.moe_intermediate_size or cfg.intermediate_size
        self.experts = nn.ModuleList(MLP(cfg, width) for _ in range(cfg.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]) of each row's top-k experts."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The experts' weighted sum per row, added to ``residual`` when one is given."""
        weights, experts = self.route(x)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (row, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token = order // self.top_k
        grouped = x.index_select(0, token)
        scale = weights.reshape(-1).index_select(0, order)[:, None]
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            end = start + count
            y = self.experts[expert](grouped[start:end]) * scale[start:end]
            out.index_add_(0, token[start:end], y.to(out.dtype))
            start = end
        return out if residual is None else residual + out


# --------------------------------------------------------------------------- checkpoint names

_MIXTRAL = re.compile(r"^(model\.layers\.\d+\.)block_sparse_moe\.(gate\.weight|experts\.\d+\.)(w[123])?(\.weight)?$")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)$")


def canonical_expert_names(weights: dict[str, torch.Tensor], types: dict[str, str]) -> None:
    """Rename (and split) expert tensors in place to ``mlp.gate.weight`` and
    ``mlp.experts.{j}.{gate,up,down}_proj.weight``; other names are left alone."""
    for name in list(weights):
        m = _MIXTRAL.match(name)
        if m:
            prefix, middle, proj, _ = m.groups()
            new = prefix + "mlp." + (middle if proj is None else f"{middle}{_MIXTRAL_PROJ[proj]}.weight")
            weights[new] = weights.pop(name)
            if name in types:
                types[new] = types.pop(name)
            continue
        m = _STACKED.match(name)
        if m:  # transformers 5's in-memory layout: [E, 2I, H] gate then up, and [E, H, I]
            stacked, kind = weights.pop(name), m.group(2)
            qtype = types.pop(name, "F32")
            for j in range(stacked.shape[0]):
                parts = stacked[j].chunk(2, dim=0) if kind == "gate_up_proj" else (stacked[j],)
                names = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
                for part, proj in zip(parts, names):
                    key = f"{m.group(1)}{j}.{proj}.weight"
                    weights[key], types[key] = part.contiguous(), qtype


def load_sparse_weights(module: SparseMoE, take: Callable[[str], torch.Tensor],
                        put: Callable[[str, torch.Tensor], None], src: str, dst: str) -> None:
    """The router and every expert of one layer: ``src`` is the checkpoint's layer prefix
    (``model.layers.{i}.``), ``dst`` the model's (``layers.{i}.``)."""
    put(dst + "mlp.gate.weight", take(src + "mlp.gate.weight"))
    for j in range(module.num_experts):
        e_src, e_dst = f"{src}mlp.experts.{j}.", f"{dst}mlp.experts.{j}."
        put(e_dst + "gate_up_proj.weight",
            torch.cat([take(e_src + "gate_proj.weight"), take(e_src + "up_proj.weight")]))
        put(e_dst + "down_proj.weight", take(e_src + "down_proj.weight"))

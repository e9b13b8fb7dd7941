"""Phi-3 (Phi-3, Phi-3.5, Phi-4-mini): a Llama-shaped decoder with two differences.

* Its checkpoints store q/k/v as one ``qkv_proj`` and gate/up as one
  ``gate_up_proj``. ``split_fused_weights`` turns them into the separate
  Hugging Face names every other loader produces (the model fuses them again,
  in the same order), so quantization, tensor parallelism and the fused step
  see the usual layout.
* Long-RoPE ("longrope", also spelled "su"): per-frequency divisors, one set
  for short contexts and one for long ones, and a constant attention factor on
  cos/sin. Which set applies is decided once, from the context the engine
  serves: the long factors when it is longer than the model's original
  context, as llama.cpp does. (transformers switches per forward pass on the
  longest position seen, so the two agree whenever a prompt alone decides it:
  prompts within the original context under a short engine context, and
  prompts past it under a long one.)
"""
from __future__ import annotations

import math
from collections.abc import MutableMapping
from typing import Any

import torch

from ...settings.config import ModelConfig
from ..support import UnsupportedModel


def longrope_inv_freq(cfg: ModelConfig, scaling: dict[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin factor of long-RoPE for a context of ``max_positions``."""
    dim = int(cfg.head_dim or 0)
    original = int(scaling.get("original_max_position_embeddings") or cfg.max_position_embeddings)
    factor = scaling.get("factor")
    if factor is None:
        factor = cfg.max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    factors = scaling["long_factor"] if max_positions > original else scaling["short_factor"]
    if len(factors) != dim // 2:
        raise ValueError(f"longrope: {len(factors)} factors for a head of {dim} (expected {dim // 2})")
    ext = torch.tensor(factors, dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * cfg.rope_theta**shape), float(attention_factor)


FUSED_SUFFIXES = ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight")


def fused_parts(name: str, rows: int, cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """The separate names a fused tensor ``name`` of ``rows`` rows splits into, each with its
    first row there and its rows, in the fused order: q/k/v_proj from ``qkv_proj``,
    gate/up_proj from ``gate_up_proj``."""
    assert cfg.head_dim is not None
    prefix = name.rsplit(".", 2)[0]
    if name.endswith("qkv_proj.weight"):
        q_size = cfg.num_attention_heads * cfg.head_dim
        kv_size = cfg.num_key_value_heads * cfg.head_dim
        parts = (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size))
    else:
        parts = (("gate_proj", rows // 2), ("up_proj", rows // 2))
    starts = [sum(n for _, n in parts[:i]) for i in range(len(parts))]
    return [(f"{prefix}.{part}.weight", start, n) for (part, n), start in zip(parts, starts)]


def split_fused_weights(weights: MutableMapping[str, torch.Tensor],
                        cfg: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """In place, on tensors held in memory: each fused tensor into its ``fused_parts``.
    Returns each new name's fused source, its first row there and its rows. (A GGUF file's
    weights are split unread instead: ``loader._split_phi3``.)"""
    sources: dict[str, tuple[str, int, int]] = {}
    for name in [n for n in weights if n.endswith(FUSED_SUFFIXES)]:
        fused = weights.pop(name)
        for part, start, rows in fused_parts(name, fused.shape[0], cfg):
            weights[part] = fused[start:start + rows].contiguous()
            sources[part] = (name, start, rows)
    return sources


def hf_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields a Phi-3 config.json sets beyond the Llama ones."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise UnsupportedModel("phi3 with partial_rotary_factor != 1 (Phi-4-mini) is not supported; "
                         "supported: Phi-3 and Phi-3.5 (full rotary)")
    window = cfg.get("sliding_window")
    return {"sliding_window": int(window) if window else None}

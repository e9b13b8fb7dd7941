"""Gemma 2 and Gemma 3 (text): the Llama-family decoder with Gemma's layer.

What differs from ``llama.py``, all read from ``ModelConfig.family`` (see
``GemmaSettings``):

* RMSNorm scales by ``1 + weight``; the checkpoint's weights are shifted by one
  at load, so the shared norm op runs unchanged;
* four norms per layer: before and after attention, before and after the MLP,
  the "after" ones applied to the block's output before the residual add;
* q/k norms per head (Gemma 3);
* the embedding is multiplied by sqrt(hidden_size);
* GeGLU (gelu, tanh approximation) instead of SwiGLU;
* attention scale ``query_pre_attn_scalar ** -0.5``;
* sliding-window layers interleaved with global ones (``ModelConfig.layer_types``),
  the local ones with their own RoPE base (Gemma 3: ``rope_local_base_freq``,
  unscaled), the global ones with the model's base and rope scaling;
* soft-capped attention scores and final logits where the config has them
  (Gemma 2): ``cap * tanh(x / cap)``.

Projections keep the Llama names and fusions (``qkv_proj``, ``gate_up_proj``),
so quantization and tensor parallelism treat the model as they treat Llama.
"""
from __future__ import annotations

import dataclasses
from collections import ChainMap
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ...settings.config import ModelConfig
from ..attention import StepAttention
from ..support import UnsupportedModel
from .llama import MLP, Attention, LlamaForCausalLM, RMSNorm, RotaryEmbedding, linear_add, set_windows

GEMMA_ARCHITECTURES = ("gemma2", "gemma3", "gemma3_text")


@dataclass(frozen=True)
class GemmaSettings:
    """Gemma's settings beyond the Llama shape (``ModelConfig.family``)."""

    query_pre_attn_scalar: float
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_base_freq: float | None = None  # Gemma 3's local layers; None: one RoPE for all
    activation: str = "gelu_pytorch_tanh"

    @classmethod
    def of(cls, cfg: ModelConfig) -> "GemmaSettings":
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in cfg.family.items() if k in fields})


def hf_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields of a Gemma 2/3 config.json beyond the Llama ones (both the
    transformers 4 spelling and 5's per-layer-type ``rope_parameters``)."""
    layers = int(cfg["num_hidden_layers"])
    gemma3 = cfg["model_type"] != "gemma2"
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        pattern = int(cfg.get("sliding_window_pattern") or (6 if gemma3 else 2))
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh", "gelu"):
        raise UnsupportedModel(f"Gemma hidden_activation {activation!r} is not supported; supported: gelu_pytorch_tanh, gelu")
    rope = cfg.get("rope_parameters") or {}
    fields: dict[str, Any] = {}
    family: dict[str, Any] = {
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar") or 256),
        "attn_logit_softcapping": cfg.get("attn_logit_softcapping"),
        "final_logit_softcapping": cfg.get("final_logit_softcapping"),
        "activation": activation,
    }
    if "full_attention" in rope or "sliding_attention" in rope:  # transformers 5: one RoPE per layer type
        full, local = dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
        fields["rope_theta"] = float(full.pop("rope_theta", cfg.get("rope_theta", 1e6)))
        kind = full.get("rope_type", "default")
        fields["rope_scaling"] = None if kind == "default" else full
        if local.get("rope_type", "default") != "default":
            raise UnsupportedModel(f"Gemma local-layer rope scaling {local.get('rope_type')!r} is not supported; "
                             "supported: default")
        if gemma3:
            family["rope_local_base_freq"] = float(local.get("rope_theta", 10000.0))
    elif gemma3:
        family["rope_local_base_freq"] = float(cfg.get("rope_local_base_freq", 10000.0))
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModel("Gemma with use_bidirectional_attention (an encoder) is not supported; "
                         "supported: causal Gemma 2/3 decoders")
    window = cfg.get("sliding_window")
    fields.update(sliding_window=int(window) if window else None, layer_types=list(layer_types), family=family,
                  qk_norm=gemma3, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)))
    return fields


def gguf_settings(arch: str, meta: Any, layers: int, head_dim: int) -> dict[str, Any]:
    """The same from llama.cpp's GGUF metadata (``meta(suffix, default)`` reads
    ``{arch}.{suffix}``). llama.cpp keeps some of these as constants of the
    architecture rather than keys: the layer pattern (every 6th layer global in
    Gemma 3, every 2nd in Gemma 2), Gemma 3's local RoPE base (10000) and the
    query scale."""
    gemma3 = arch != "gemma2"
    pattern = meta("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # one flag per layer: True = sliding
        layer_types = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        every = int(pattern or (6 if gemma3 else 2))
        layer_types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    window = meta("attention.sliding_window")
    # The 27B models scale queries by hidden / heads, the others by the head size (llama.cpp
    # tells them apart by their layer count).
    big = layers == (46 if arch == "gemma2" else 62)
    scalar = meta("embedding_length") / meta("attention.head_count") if big else head_dim
    family = {
        "query_pre_attn_scalar": float(scalar),
        "attn_logit_softcapping": meta("attn_logit_softcapping"),
        "final_logit_softcapping": meta("final_logit_softcapping"),
    }
    if gemma3:
        family["rope_local_base_freq"] = 10000.0
    return {"sliding_window": int(window) if window else None, "layer_types": layer_types, "family": family}


class GemmaAttention(Attention):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        settings = GemmaSettings.of(cfg)
        self.scale = settings.query_pre_attn_scalar**-0.5
        self.softcap = settings.attn_logit_softcapping


class GemmaMLP(MLP):
    """GeGLU: ``down(gelu(gate) * up)``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.approximate = "none" if GemmaSettings.of(cfg).activation == "gelu" else "tanh"

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        act = F.gelu(gate_up[:, : self.intermediate], approximate=self.approximate) * gate_up[:, self.intermediate :]
        return self.down_proj(act) if residual is None else linear_add(self.down_proj, act, residual)


class GemmaDecoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.self_attn = GemmaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.mlp = GemmaMLP(cfg)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)

    def forward(self, x, rope, kv_cache, attn):  # type: ignore[no-untyped-def]
        h = self.self_attn(self.input_layernorm(x), rope, kv_cache, attn)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class GemmaForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__(cfg, max_positions)
        self.settings = GemmaSettings.of(cfg)
        self.layers = torch.nn.ModuleList(GemmaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        set_windows(self, max_positions or cfg.max_position_embeddings)
        self.sliding = [cfg.layer_window(i) is not None for i in range(cfg.num_hidden_layers)]
        self.rope_local = self._local_rope(max_positions or cfg.max_position_embeddings)

    def _local_rope(self, max_positions: int) -> RotaryEmbedding | None:
        """The sliding layers' rotary tables (Gemma 3: their own base, no scaling)."""
        base = self.settings.rope_local_base_freq
        if base is None:
            return None
        local = dataclasses.replace(self.config, rope_theta=base, rope_scaling=None)
        return RotaryEmbedding(local, max_positions)

    def reset_rope(self, max_positions: int, device: torch.device) -> None:
        super().reset_rope(max_positions, device)
        local = self._local_rope(max_positions)
        self.rope_local = local.to(device) if local is not None else None

    def native_step_refusal(self) -> str | None:
        """The fused step takes Gemma's layer (its output norms, GeGLU with tanh, per-layer
        rotary tables, the embedding multiplier), not soft-capping or exact-erf gelu."""
        if self.settings.final_logit_softcapping is not None:
            return "soft-capped final logits"
        if self.settings.activation == "gelu":
            return "exact (erf) gelu in the MLP"
        return super().native_step_refusal()

    def layer_rotary(self, index: int) -> RotaryEmbedding:
        return self.rope_local if self.sliding[index] and self.rope_local is not None else self.rope

    def embedding_multiplier(self) -> float:
        return float(self.config.hidden_size**0.5)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, ...]], attn: StepAttention) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        rope = self.rope.tables(positions, x.dtype)
        local = self.rope_local.tables(positions, x.dtype) if self.rope_local is not None else rope
        for layer, sliding, kv_cache in zip(self.layers, self.sliding, kv_caches):
            x = layer(x, local if sliding else rope, kv_cache, attn)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.settings.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Hugging Face names in; every norm weight shifted by one (Gemma scales by 1 + w)."""
        norms = {name: (weights[name].float() + 1.0).to(weights[name].dtype)
                 for name in weights if name.endswith("norm.weight")}
        shifted = ChainMap(norms, weights)  # the rest read as they are, one at a time
        super().load_weights(shifted)
        params = dict(self.named_parameters())
        for i in range(self.config.num_hidden_layers):
            for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                name = f"model.layers.{i}.{norm}.weight"
                if name not in shifted:
                    raise ValueError(f"weight {name!r} missing from the checkpoint")
                params[f"layers.{i}.{norm}.weight"].copy_(shifted[name])

"""Llama-family decoder over a paged KV cache.

Covers SmolLM2, Llama 2/3, TinyLlama, Mistral (no sliding window), Qwen2 (qkv
bias) and Qwen3 (per-head q/k RMSNorm); Qwen3-MoE and Mixtral with the sparse MLP
of model/models/moe.py. Weights arrive with Hugging Face names
and are fused at load: q/k/v into one projection, gate/up into another, so a
layer is four matmuls. The model knows nothing of requests: it takes the
flattened batch (token ids, positions, attention metadata) and returns hidden
states; ``compute_logits`` turns selected rows into float32 logits.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from ...settings.config import ModelConfig
from ..attention import StepAttention
from .layers import MLP, Linear, linear_add
from ..ops import TORCH_OPS, ModelOps, bind_ops, rotate_half
from ..support import UnsupportedModel


class RMSNorm(nn.Module):
    ops: ModelOps = TORCH_OPS  # bound by LlamaForCausalLM.use_ops

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


ROPE_SCALING_KINDS = ("default", "linear", "llama3", "freq_factors", "longrope")


def _rope_inv_freq(cfg: ModelConfig, max_positions: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies with the rope scaling types Llama-family models use
    (``max_positions``: the engine's context, which picks longrope's factors)."""
    dim = cfg.head_dim
    assert dim is not None
    # float32 as the reference implementation computes it, so positions match bit for bit.
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = dict(cfg.rope_scaling or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    attention_factor = 1.0
    if kind in (None, "default"):
        pass
    elif kind == "freq_factors":  # llama.cpp stores Llama 3 scaling as per-frequency divisors
        inv_freq = inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float32)
    elif kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif kind == "longrope":
        from .phi3 import longrope_inv_freq

        inv_freq, attention_factor = longrope_inv_freq(cfg, scaling, max_positions or cfg.max_position_embeddings)
    else:
        raise UnsupportedModel(f"unsupported rope scaling type {kind!r}; supported: {', '.join(ROPE_SCALING_KINDS)}")
    return inv_freq, attention_factor


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, looked up per token (rotate-half layout)."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq, factor = _rope_inv_freq(cfg, max_positions)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * factor, persistent=False)
        self.register_buffer("sin", emb.sin() * factor, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.tables(positions, q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin ([T, 1, head_dim]) for ``_rotate``: looked up once per step
        and shared by every layer. The first half of sin is negated so that rotate-half
        becomes a plain roll (x2 * -s equals -x2 * s exactly in IEEE arithmetic)."""
        cos = self.cos.index_select(0, positions)[:, None, :].to(dtype)
        sin = self.sin.index_select(0, positions)
        half = sin.shape[-1] // 2
        sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)[:, None, :].to(dtype)
        return cos, sin


_rotate = rotate_half


class Attention(nn.Module):
    ops: ModelOps = TORCH_OPS  # bound by LlamaForCausalLM.use_ops

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.head_dim is not None
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = self.head_dim**-0.5
        self.window: int | None = None  # a sliding-window layer's window (set by the model)
        self.softcap: float | None = None  # attention-logit soft-capping (Gemma 2)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: tuple[torch.Tensor, ...], attn: StepAttention,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """The attention block's output, added to ``residual`` when one is given."""
        qkv = self.qkv_proj(x)
        tokens, d = qkv.shape[0], self.head_dim
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, self.num_kv_heads, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qkv[:, : self.q_size + self.kv_size].split([self.q_size, self.kv_size], dim=-1)
            q = self.q_norm(q.reshape(-1, self.num_heads, d))
            k = self.k_norm(k.reshape(-1, self.num_kv_heads, d))
            q, k = _rotate(q, *rope), _rotate(k, *rope)
        else:
            # q and k heads side by side: one rotation for both (in place with the C kernels).
            qk = self.ops.rotate(qkv[:, : self.q_size + self.kv_size].view(tokens, -1, d), *rope)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        kv_scales = tuple(kv_cache[2:4]) or None  # a quantized pool's scales (model/quant/kv_quant.py)
        attn.write_kv(kv_cache[0], kv_cache[1], k, v, kv_scales)
        if self.window is None and self.softcap is None:
            out = attn.attend(q, kv_cache[0], kv_cache[1], self.scale, kv_scales)
        else:
            out = attn.attend(q, kv_cache[0], kv_cache[1], self.scale, kv_scales, self.window, self.softcap)
        out = out.reshape(-1, self.q_size)
        return self.o_proj(out) if residual is None else linear_add(self.o_proj, out, residual)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        from .moe import SparseMoE, is_sparse_layer

        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = SparseMoE(cfg) if is_sparse_layer(cfg, index) else MLP(cfg)

    def forward(self, x, rope, kv_cache, attn):  # type: ignore[no-untyped-def]
        x = self.self_attn(self.input_layernorm(x), rope, kv_cache, attn, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)


def set_windows(model: nn.Module, max_positions: int) -> None:
    """Give each sliding-window layer its window; a window that covers the whole context
    (``max_positions``) is no window at all, so such a model keeps every fast path."""
    cfg = model.config
    for i, layer in enumerate(model.layers):
        window = cfg.layer_window(i)
        layer.self_attn.window = window if window is not None and window < max_positions else None


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg, max_positions or cfg.max_position_embeddings)
        set_windows(self, max_positions or cfg.max_position_embeddings)

    def reset_rope(self, max_positions: int, device: torch.device) -> None:
        """Compute the rotary tables for real (the model was built on the meta device)."""
        self.rope = RotaryEmbedding(self.config, max_positions).to(device)

    def kv_window(self) -> int | None:
        """How far behind a query any layer still reads when every layer slides (the largest
        window): K/V further back is never read again, so the scheduler frees its blocks.
        None where some layer attends the whole context (Gemma 3's global layers)."""
        windows = [layer.self_attn.window for layer in self.layers]
        return None if not windows or any(w is None for w in windows) else max(windows)

    def attention_masks(self) -> str | None:
        """What this model's attention needs beyond a causal mask (sliding windows,
        soft-capped scores), said in words; None: a plain causal mask. The C attention
        kernels and the fused CPU step take windows, not soft-capping; CUDA graphs take
        neither."""
        windows = sorted({layer.self_attn.window for layer in self.layers if layer.self_attn.window is not None})
        caps = {layer.self_attn.softcap for layer in self.layers if layer.self_attn.softcap is not None}
        parts = [f"sliding-window layers (window {', '.join(map(str, windows))})"] if windows else []
        parts += ["soft-capped attention scores"] if caps else []
        return " and ".join(parts) or None

    def softcapped_attention(self) -> bool:
        """Whether some layer soft-caps its attention scores (Gemma 2): only the torch
        backends compute that; sliding windows the C kernels and the fused step take."""
        return any(layer.self_attn.softcap is not None for layer in self.layers)

    def native_step_refusal(self) -> str | None:
        """Why the fused native step (engine/step/fused_decode.py) cannot run this model, or None."""
        return "soft-capped attention scores" if self.softcapped_attention() else None

    def layer_rotary(self, index: int) -> RotaryEmbedding:
        """The rotary tables layer ``index`` reads (one set for every layer here)."""
        return self.rope

    def embedding_multiplier(self) -> float:
        """What the embeddings are multiplied by before the first layer (1: nothing)."""
        return 1.0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, ...]], attn: StepAttention) -> torch.Tensor:
        """Hidden states of a flattened step; ``attn`` is the step's attention, prepared
        once by the engine's backend for every layer."""
        x = self.embed_tokens(input_ids)
        rope = self.rope.tables(positions, x.dtype)  # once per step, shared by all layers
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, rope, kv_cache, attn)
        return self.norm(x)

    def use_ops(self, ops: ModelOps) -> None:
        """Bind the engine's ops to every layer that reads them, and let quantized layers
        make the layouts those kernels read (at build, after any quantization or sharding
        has replaced modules; binding the same ops again changes nothing)."""
        bind_ops(self, ops)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up."""
        cfg = self.config
        params = dict(self.named_parameters())

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"weight {name!r} missing from the checkpoint")
            return weights[name]

        def put(name: str, tensor: torch.Tensor) -> None:
            param = params[name]
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}")
            param.copy_(tensor.to(param.dtype))

        put("embed_tokens.weight", take("model.embed_tokens.weight"))
        put("norm.weight", take("model.norm.weight"))
        lm_head = weights.get("lm_head.weight")
        if cfg.tie_word_embeddings or lm_head is None:
            self.lm_head.weight = self.embed_tokens.weight  # one tensor, as the checkpoint has it
        else:
            put("lm_head.weight", lm_head)
        for i in range(cfg.num_hidden_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            attn = src + "self_attn."
            put(dst + "self_attn.qkv_proj.weight", torch.cat(
                [take(attn + "q_proj.weight"), take(attn + "k_proj.weight"), take(attn + "v_proj.weight")]))
            if cfg.attention_bias:
                put(dst + "self_attn.qkv_proj.bias", torch.cat(
                    [take(attn + "q_proj.bias"), take(attn + "k_proj.bias"), take(attn + "v_proj.bias")]))
            put(dst + "self_attn.o_proj.weight", take(attn + "o_proj.weight"))
            if cfg.qk_norm:
                put(dst + "self_attn.q_norm.weight", take(attn + "q_norm.weight"))
                put(dst + "self_attn.k_norm.weight", take(attn + "k_norm.weight"))
            mlp = src + "mlp."
            if not isinstance(self.layers[i].mlp, MLP):  # experts (model/models/moe.py)
                from .moe import load_sparse_weights

                load_sparse_weights(self.layers[i].mlp, take, put, src, dst)  # type: ignore[arg-type]
            else:
                put(dst + "mlp.gate_up_proj.weight", torch.cat(
                    [take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")]))
                put(dst + "mlp.down_proj.weight", take(mlp + "down_proj.weight"))
            put(dst + "input_layernorm.weight", take(src + "input_layernorm.weight"))
            put(dst + "post_attention_layernorm.weight", take(src + "post_attention_layernorm.weight"))

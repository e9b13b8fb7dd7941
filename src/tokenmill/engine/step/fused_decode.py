"""A whole step in one native call on CPU: decode batches, and prefill chunks.

At batch 1 the eager model dispatches thousands of ATen ops per step and, on a
small CPU, their fixed costs outweigh the arithmetic (an int4 step of
SmolLM2-135M took about three times as long as reading its weights). ``csrc/
step.c`` runs every layer, the final norm and the LM head in one OpenMP
region (see its header); this module hands it the model: pointers to the
weights in their stored precision (float32, bf16, int8, int4 in the
project's own packing, read where the layer keeps it), float32 copies of the norm
weights, the rotary tables and each layer's KV pool.

The pointers are taken once, at build: a model whose modules or pool are
replaced afterwards needs a new ``build``. int8 layers on a kernel build with
VNNI (``KernelLibrary.int8_dot``) run as their eager forward does, on the same
VNNI packing: 16-bit integer activations, or 8-bit ones for w8a8 layers
(``Int8Linear``); with the rotary embedding rounded as the eager op rounds it,
a w8a8 decode row comes out bit for bit as in the eager model.

The fused step is the model's math in float32 (the eager bf16 / quantized
paths round activations to bf16 between ops), so its logits match the float32
torch forward to rounding; tests check it against the torch model for every
weight kind. Two exceptions, both on a CPU with AVX512-BF16: bf16 weights at
batch > 1 meet bf16-rounded activations (vdpbf16ps), like the eager bf16
matmuls, at ~1.3x the speed of widening the weights; and attention over a bf16
pool multiplies bf16-rounded queries and softmax weights with the pool's rows
(``KernelLibrary.bf16_attention``), as the eager path's attention kernels do.

It takes pure decode batches of up to a measured size per weight kind
(``MAX_BATCH_BY_KIND``; beyond it the eager path's matrix-matrix products win;
``KernelOptions.fused_decode_max_batch`` overrides it), and steps with prefill
chunks (``chunks``: each attended by the prefill kernel the eager attention
backend calls, so a w8a8 chunk comes out bit for bit as in the eager model; logits
only for the rows that sample). Its step executors
(``executors.FusedDecodeExecutor``, ``executors.FusedPrefillExecutor``) say which
steps; the runner gives everything else to the eager executor: steps that score
their prompt, a quantized pool's prefill chunks (its store requantizes a block's
rows together), other devices, the fused step switched off, or a model it cannot
take (``build`` logs why).
"""
from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from ...model.kernels import cpu_kernels
from ...model.models.llama import LlamaForCausalLM, Linear
from ...model.lora.lora import base_of
from ...model.quant.quant import Int4Linear, Int8GroupLinear, Int8Linear
from ...model.quant.kquant import KQuantLinear

log = logging.getLogger(__name__)

W_F32, W_BF16, W_INT8, W_INT4, W_INT8G, W_KQ = (cpu_kernels.W_F32, cpu_kernels.W_BF16, cpu_kernels.W_INT8,
                                                 cpu_kernels.W_INT4, cpu_kernels.W_INT8G, cpu_kernels.W_KQ)
# Largest decode batch each weight kind runs fused: beyond it the eager model's
# matrix-matrix products win. Measured per kind as the fused / eager step time
# on SmolLM2-135M (docs/performance.md, "The fused decode step"): every kind
# stays faster up to 64 decodes. A model takes its lowest kind's.
MAX_BATCH_BY_KIND = {W_F32: 64, W_BF16: 64, W_INT8: 64, W_INT4: 64, W_INT8G: 64,
                     W_KQ: 64}  # K-quant: the eager layer runs the same kernel (KQuantLinear), no torch matmul to lose to


_Linear = cpu_kernels.TmLinear


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear),
                ("down", _Linear), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("k_scale", ctypes.c_void_p), ("v_scale", ctypes.c_void_p), ("window", ctypes.c_int64),
                ("attn_out_norm", ctypes.c_void_p), ("mlp_out_norm", ctypes.c_void_p),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("qkv_tail", _Linear)]


class _Model(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("inter", ctypes.c_int64), ("num_layers", ctypes.c_int64),
                ("num_blocks", ctypes.c_int64), ("block_size", ctypes.c_int64), ("max_positions", ctypes.c_int64),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("cache_fmt", ctypes.c_int32),
                ("layers", ctypes.POINTER(_Layer)), ("final_norm", ctypes.c_void_p),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("head", _Linear),
                ("act", ctypes.c_int32), ("pad", ctypes.c_int32)]

ACT_SILU, ACT_GELU_TANH = 0, 1  # TmModel.act: the MLP's gate activation


class Unsupported(Exception):
    """The model has something the fused step does not implement."""


@dataclass
class FusedDecoder:
    """The native model description plus every tensor it points into (kept alive here)."""

    lib: cpu_kernels.KernelLibrary
    struct: _Model
    layers: ctypes.Array  # type: ignore[type-arg]
    keep: list[torch.Tensor] = field(default_factory=list)
    vocab_size: int = 0
    hidden_size: int = 0
    embedding_multiplier: float = 1.0  # the model's (Gemma: sqrt(hidden)), applied to the embeddings here
    max_batch: int = 1  # from the weight kinds (see MAX_BATCH_BY_KIND) or the options
    # Whether the eager forward runs every decoder projection of a prefill chunk on the
    # same C kernels as this step: int8 kinds always; int4 where the build multiplies it
    # against int8 activations at every row count (AVX2), not where large batches go to
    # torch's float32 matmuls. Then a chunk here gains the eager forward's dispatch;
    # dense float32 / bf16 layers run torch's matmuls there (oneDNN / MKL), which the
    # dense tiles here only match (measured slower on AVX2).
    prefill_on_kernels: bool = False

    def run(self, embeddings: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
            chunks: torch.Tensor | None = None, logit_rows: torch.Tensor | None = None,
            lora_segments: ctypes.Array | None = None) -> torch.Tensor:  # type: ignore[type-arg]
        """Logits (float32) of a step's B rows. ``embeddings`` [B, hidden] float32
        (overwritten: it is the residual stream), ``block_tables`` [B, W] int32 (each row's
        sequence's table), ``seq_lens`` [B] int32: context length including the row's token.
        ``chunks`` [C, 2] int32: (first row, row count) of the prefill chunks among the rows,
        attended as the eager model attends a chunk; other rows are attended one by one.
        ``logit_rows`` [R] int32: the rows whose logits are returned, [R, vocab]; None:
        every row's, [B, vocab]. ``lora_segments``: the rows that run under LoRA adapters
        (``fused_lora.AdapterTables.segments``)."""
        b = embeddings.shape[0]
        if not (embeddings.dtype == torch.float32 and embeddings.is_contiguous()
                and embeddings.shape == (b, self.hidden_size)):
            raise ValueError(f"fused step: embeddings must be contiguous float32 [B, {self.hidden_size}]")
        if not (block_tables.dtype == torch.int32 and block_tables.dim() == 2 and block_tables.shape[0] == b
                and block_tables.is_contiguous()):
            raise ValueError("fused step: block tables must be contiguous int32 [B, width]")
        if not (seq_lens.dtype == torch.int32 and seq_lens.is_contiguous() and seq_lens.shape == (b,)):
            raise ValueError("fused step: seq_lens must be contiguous int32 [B]")
        for name, t, dims in (("chunks", chunks, 2), ("logit rows", logit_rows, 1)):
            if t is not None and not (t.dtype == torch.int32 and t.is_contiguous() and t.dim() == dims
                                      and (dims == 1 or t.shape[1] == 2)):
                raise ValueError(f"fused step: {name} must be contiguous int32")
        if self.embedding_multiplier != 1.0:
            embeddings.mul_(self.embedding_multiplier)
        out_rows = b if logit_rows is None else logit_rows.shape[0]
        if logit_rows is not None and out_rows == 0:  # no logits wanted: a pointer all the same (NULL means all)
            logit_rows = torch.zeros(1, dtype=torch.int32)
        logits = torch.empty((out_rows, self.vocab_size), dtype=torch.float32)
        rc = self.lib.cdll.tm_model_step(
            ctypes.addressof(self.struct), embeddings.data_ptr(), b, block_tables.data_ptr(),
            block_tables.stride(0), block_tables.shape[1], seq_lens.data_ptr(),
            None if chunks is None else chunks.data_ptr(), 0 if chunks is None else chunks.shape[0],
            None if logit_rows is None else logit_rows.data_ptr(), out_rows, logits.data_ptr(),
            None if not lora_segments else ctypes.addressof(lora_segments),
            0 if lora_segments is None else len(lora_segments), torch.get_num_threads())
        if rc == 1:
            raise ValueError("fused step: a sequence length or block id lies outside the tables, pool or rotary "
                             "range, a chunk's rows are not one sequence's consecutive positions, or an "
                             "adapter segment is not rows of the step in order")
        if rc != 0:
            raise MemoryError("fused step: the kernel could not allocate its scratch memory")
        return logits


def _f32(t: torch.Tensor, keep: list[torch.Tensor]) -> int:
    t = t.detach().float().contiguous()
    keep.append(t)
    return t.data_ptr()


def _linear(mod: nn.Module, keep: list[torch.Tensor], name: str, lib: cpu_kernels.KernelLibrary) -> _Linear:
    """Describe one projection for the kernel, or raise Unsupported."""
    mod = base_of(mod)  # behind a LoRA wrapper: the executors give adapter rows to the eager path
    s = _Linear()
    bias = getattr(mod, "bias", None)
    s.bias = _f32(bias, keep) if bias is not None else None
    s.repeat, s.group = 1, 0
    if isinstance(mod, Int4Linear):
        if not mod.unpack_ok or mod.group_size % 32:
            raise Unsupported(f"{name}: int4 in tinygemm's packing, which the kernel cannot read")
        if not mod.kernel_takes(lib):
            raise Unsupported(f"{name}: int4 tiles of another vector width than these kernels', or five-bit codes "
                              "without the nibble kernel")
        d = mod.kernel_description()  # the layer's own buffers, no copy
        ctypes.pointer(s)[0] = d
        s.bias = _f32(bias, keep) if bias is not None else None
        keep.append(mod._desc[1])
        return s
    if isinstance(mod, Int8GroupLinear):
        ctypes.pointer(s)[0] = mod.kernel_description()  # the layer keeps the buffers it points into
        s.bias = _f32(bias, keep) if bias is not None else None
        return s
    if isinstance(mod, Int8Linear):
        vnni = mod.vnni_description()  # made only where the bound library has int8 dot products
        if vnni is not None:  # the VNNI packing (the layer keeps the buffers it points into)
            ctypes.pointer(s)[0] = vnni
            s.bias = _f32(bias, keep) if bias is not None else None
            return s
        q = mod.codes().contiguous()
        keep.append(q)
        s.kind, s.n, s.k = W_INT8, q.shape[0], q.shape[1]
        s.w, s.scale = q.data_ptr(), _f32(mod.scales, keep)
        return s
    if type(mod) in (nn.Linear, Linear):
        w = mod.weight.detach()
        if w.dtype not in (torch.float32, torch.bfloat16):
            raise Unsupported(f"{name}: weight dtype {w.dtype}")
        w = w.contiguous()
        keep.append(w)
        s.kind = W_F32 if w.dtype == torch.float32 else W_BF16
        s.n, s.k, s.w = w.shape[0], w.shape[1], w.data_ptr()
        return s
    if isinstance(mod, KQuantLinear):
        descs = mod.kernel_descriptions()  # the layer keeps the blocks they point into
        if len(descs) != 1:
            raise Unsupported(f"{name}: {mod.formats} blocks in one projection (the step's projection has one block "
                              "type; the eager forward runs each part)")
        ctypes.pointer(s)[0] = descs[0]
        s.bias = _f32(bias, keep) if bias is not None else None
        return s
    raise Unsupported(f"{name}: {type(mod).__name__} has no fused kernel")


def _qkv_linears(mod: nn.Module, keep: list[torch.Tensor], name: str,
                 lib: cpu_kernels.KernelLibrary) -> tuple[_Linear, _Linear]:
    """The q/k/v projection as the step's ``qkv`` and ``qkv_tail`` (n = 0: none): a K-quant
    projection stored in two block types (Q4_K_M's q and k in Q4_K, v in Q6_K) is two parts,
    the second's outputs after the first's."""
    base = base_of(mod)
    tail = _Linear()
    if not isinstance(base, KQuantLinear) or len(base.kernel_descriptions()) != 2:
        return _linear(mod, keep, name, lib), tail
    head, rest = base.kernel_descriptions()
    ctypes.pointer(tail)[0] = rest
    first = _Linear()
    ctypes.pointer(first)[0] = head
    bias = getattr(base, "bias", None)
    if bias is not None:  # each part adds its own rows' bias
        first.bias = _f32(bias[:head.n], keep)
        tail.bias = _f32(bias[head.n:], keep)
    return first, tail


def build(model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, ...]],
          lib: cpu_kernels.KernelLibrary, max_batch: int | None = None) -> FusedDecoder | None:
    """The fused decoder for this model and pool, or None (with the reason logged) when
    it cannot take the model. Each layer's cache is (k, v), or (k_codes, v_codes,
    k_scales, v_scales) for a quantized pool (model/quant/kv_quant.py). ``max_batch``: the
    largest decode batch to run fused (default: by weight kind)."""
    try:
        return _build(model, kv_caches, lib, max_batch)
    except Unsupported as exc:
        log.info("fused decode step off: %s", exc)
        return None


def _build(model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, ...]],
           lib: cpu_kernels.KernelLibrary, max_batch: int | None) -> FusedDecoder:
    cfg = model.config
    k0, head_dim = _check_supported(model, kv_caches, lib)
    quantized = k0.dtype not in (torch.float32, torch.bfloat16)
    keep: list[torch.Tensor] = []
    layers = (_Layer * cfg.num_hidden_layers)()
    for i, (layer, cache) in enumerate(zip(model.layers, kv_caches)):
        _fill_layer(layers[i], i, model, layer, cache, quantized, lib, keep)
    m = _model_struct(model, layers, k0, head_dim, lib, keep)
    layer_kinds = {getattr(layers[i], p).kind for i in range(cfg.num_hidden_layers)
                   for p in ("qkv", "qkv_tail", "o", "gate_up", "down") if getattr(layers[i], p).n}
    limit = min(MAX_BATCH_BY_KIND[k] for k in layer_kinds | {m.head.kind}) if max_batch is None else max_batch
    log.info("fused decode step on: batches of up to %d decodes run all %d layers in one native call",
             limit, cfg.num_hidden_layers)
    return FusedDecoder(lib, m, layers, keep, cfg.vocab_size, cfg.hidden_size, model.embedding_multiplier(), limit,
                        prefill_on_kernels=layer_kinds <= ({W_INT8, W_INT8G, W_INT4, W_KQ} if lib.q4_int8_dot
                                                            else {W_INT8, W_INT8G, W_KQ}))


def _check_supported(model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, ...]],
                     lib: cpu_kernels.KernelLibrary) -> tuple[torch.Tensor, int]:
    """The first layer's K pool and the head size, once the model, the pool and the library
    are ones the native step takes (``Unsupported`` says why not)."""
    refusal = model.native_step_refusal()
    if refusal is not None:
        raise Unsupported(refusal)
    k0 = kv_caches[0][0]
    if k0.device.type != "cpu" or k0.dtype not in cpu_kernels.KV_FORMAT:
        raise Unsupported(f"KV pool on {k0.device} in {k0.dtype}")
    head_dim = int(model.config.head_dim or 0)
    if head_dim % lib.vector_width or head_dim > 512:
        raise Unsupported(f"head_dim {head_dim}")
    expected = ctypes.sizeof(_Linear) * 1000000 + ctypes.sizeof(_Layer) * 1000 + ctypes.sizeof(_Model)
    if lib.cdll.tm_decode_struct_sizes() != expected:
        raise Unsupported("the kernel library's struct layout differs from this module's")
    return k0, head_dim


def _fill_layer(dst: _Layer, i: int, model: LlamaForCausalLM, layer: nn.Module, cache: tuple[torch.Tensor, ...],
                quantized: bool, lib: cpu_kernels.KernelLibrary, keep: list[torch.Tensor]) -> None:
    """Layer ``i``'s weights, norms, rotary tables and pool, as the native step reads them."""
    kc, vc = cache[0], cache[1]
    attn, mlp = layer.self_attn, layer.mlp
    if not hasattr(mlp, "gate_up_proj"):
        raise Unsupported(f"layers.{i} is a mixture of experts (the eager forward runs it, grouped by expert)")
    dst.window = attn.window or 0  # a sliding-window layer's (model/models/llama.py set_windows); 0: none
    dst.input_norm = _f32(layer.input_layernorm.weight, keep)
    if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma: norms of both blocks' outputs too
        dst.post_norm = _f32(layer.pre_feedforward_layernorm.weight, keep)
        dst.attn_out_norm = _f32(layer.post_attention_layernorm.weight, keep)
        dst.mlp_out_norm = _f32(layer.post_feedforward_layernorm.weight, keep)
    else:
        dst.post_norm = _f32(layer.post_attention_layernorm.weight, keep)
    rotary = model.layer_rotary(i)
    if rotary is not model.rope:
        dst.cos, dst.sin = _f32(rotary.cos, keep), _f32(rotary.sin, keep)
    dst.q_norm = _f32(attn.q_norm.weight, keep) if attn.q_norm is not None else None
    dst.k_norm = _f32(attn.k_norm.weight, keep) if attn.k_norm is not None else None
    dst.qkv, dst.qkv_tail = _qkv_linears(attn.qkv_proj, keep, f"layers.{i}.qkv_proj", lib)
    dst.o = _linear(attn.o_proj, keep, f"layers.{i}.o_proj", lib)
    dst.gate_up = _linear(mlp.gate_up_proj, keep, f"layers.{i}.gate_up_proj", lib)
    if dst.gate_up.packed and (dst.gate_up.n // 2) % lib.vector_width:
        raise Unsupported(f"layers.{i}.gate_up_proj: gate and up are not whole VNNI tiles")
    dst.down = _linear(mlp.down_proj, keep, f"layers.{i}.down_proj", lib)
    for lin, name in ((dst.qkv, "qkv"), (dst.qkv_tail, "qkv"), (dst.o, "o"), (dst.gate_up, "gate_up"),
                      (dst.down, "down")):
        if lin.n and lin.kind != W_INT4 and lin.k % lib.vector_width:
            raise Unsupported(f"layers.{i}.{name}: {lin.k} input features")
    if not (kc.is_contiguous() and vc.is_contiguous()):
        raise Unsupported("KV pool not contiguous")
    dst.k_cache, dst.v_cache = kc.data_ptr(), vc.data_ptr()
    keep += [kc, vc]
    if quantized:
        ks, vs = cache[2], cache[3]
        if not (ks.dtype == vs.dtype == torch.float32 and ks.is_contiguous() and vs.is_contiguous()
                and tuple(ks.shape) == tuple(vs.shape) == tuple(kc.shape[:2])):
            raise Unsupported("KV scales not contiguous float32 [kv_heads, num_blocks]")
        dst.k_scale, dst.v_scale = ks.data_ptr(), vs.data_ptr()
        keep += [ks, vs]


def _model_struct(model: LlamaForCausalLM, layers: ctypes.Array, k0: torch.Tensor, head_dim: int,
                  lib: cpu_kernels.KernelLibrary, keep: list[torch.Tensor]) -> _Model:
    """The whole model's part of the native step: geometry, final norm, rotary tables, LM head."""
    cfg = model.config
    m = _Model()
    m.hidden, m.heads, m.kv_heads = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    m.head_dim, m.inter, m.num_layers = head_dim, cfg.intermediate_size, cfg.num_hidden_layers
    m.num_blocks, m.block_size, m.max_positions = k0.shape[1], k0.shape[2], model.rope.cos.shape[0]
    m.eps, m.scale = float(cfg.rms_norm_eps), float(model.layers[0].self_attn.scale)
    approximate = getattr(model.layers[0].mlp, "approximate", None)  # GeGLU's gelu (model/models/gemma.py)
    m.act = ACT_SILU if approximate is None else ACT_GELU_TANH
    m.cache_fmt = cpu_kernels.KV_FORMAT[k0.dtype]
    m.layers = ctypes.cast(layers, ctypes.POINTER(_Layer))
    m.final_norm = _f32(model.norm.weight, keep)
    m.cos, m.sin = _f32(model.rope.cos, keep), _f32(model.rope.sin, keep)
    m.head = _linear(model.lm_head, keep, "lm_head", lib)
    if m.head.kind != W_INT4 and m.head.k % lib.vector_width:
        raise Unsupported(f"lm_head: {m.head.k} input features")
    return m

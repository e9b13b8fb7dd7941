"""Weights in: GGUF files and Hugging Face safetensors folders.

Everything leaves this module under Hugging Face parameter names and in
Hugging Face layout, so the model code has one naming scheme and the tests can
compare tensor-for-tensor with ``transformers``.

GGUF specifics handled here:

* block formats are dequantized (Q8_0, Q4_0 and Q4_1 with our own vectorised
  numpy; the K-quants in ``kquant.py``, the other types through ``gguf.quants``);
* llama.cpp's converter reorders the rows of ``attn_q``/``attn_k`` of Llama
  models so that each head's rotary pairs sit next to each other (its
  "interleaved" RoPE). Our model uses Hugging Face's ``rotate_half`` RoPE, where
  the pairs are the two halves of a head, so the rows are put back;
* the raw Q8_0/Q4_0/Q4_1 and Q4_K/Q5_K/Q6_K block bytes are kept (``raw_quantized``)
  so a quantized linear layer can use them without re-quantizing.
"""
from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable, Iterable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenmill.settings.config import ModelConfig
from tokenmill.files.gguf_file import GGUFFile, GGUFTensor, read_gguf  # noqa: F401 - the container, read here
from tokenmill.model.support import UnsupportedModel

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma3_text", "phi3",
                           "qwen3_moe", "mixtral")
_GEMMA = ("gemma2", "gemma3", "gemma3_text")
# llama.cpp's architecture names where they differ from Hugging Face's model_type (a llama
# file with experts is Mixtral: _gguf_config)
_GGUF_ARCHITECTURES = {"qwen3moe": "qwen3_moe"}

# GGUF block geometry: (elements per block, bytes per block)
BLOCK_SHAPES: dict[str, tuple[int, int]] = {
    "Q8_0": (32, 2 + 32),
    "Q4_0": (32, 2 + 16),
    "Q4_1": (32, 2 + 2 + 16),
    "Q5_0": (32, 2 + 4 + 16),  # fp16 d, 32 fifth bits, 16 bytes of nibbles
    "Q5_1": (32, 2 + 2 + 4 + 16),  # fp16 d and m, then as Q5_0
}
# K-quants keep their blocks too (model/quant/kquant.py, which also dequantizes them); Q5_0/Q5_1 are dequantized by gguf.quants
RAW_KEPT_TYPES = frozenset(BLOCK_SHAPES) | {"Q4_K", "Q5_K", "Q6_K"}


class CheckpointWeights(MutableMapping[str, torch.Tensor]):
    """Hugging Face-named weights, each made when it is read rather than at load.

    A GGUF file's block tensors widen four to eight times when dequantized to float32:
    held all at once, a large model's would not fit the memory of a machine that serves
    its file. Read one at a time (``model.load_weights`` copies each into its parameter
    and drops it), the dense copies never add up; layers that keep the file's blocks
    (``--quantization gguf``) never read theirs (``deferring``). Tensors stored here are
    kept as they are; nothing read is cached.
    """

    def __init__(self) -> None:
        self._values: dict[str, torch.Tensor | Callable[[], torch.Tensor]] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}

    def add_lazy(self, name: str, shape: tuple[int, ...], make: Callable[[], torch.Tensor]) -> None:
        self._values[name] = make
        self._shapes[name] = tuple(shape)

    def deferring(self, names: Iterable[str], dtype: torch.dtype) -> CheckpointWeights:
        """A view in which ``names`` read as meta tensors of their shape (no data made):
        what the parameters of layers that will be rebuilt from the file's blocks load."""
        view = CheckpointWeights()
        view._values, view._shapes = dict(self._values), dict(self._shapes)
        for name in names:
            shape = self._shapes[name]
            view._values[name] = lambda shape=shape: torch.empty(shape, dtype=dtype, device="meta")
        return view

    def shape_of(self, name: str) -> tuple[int, ...]:
        """``name``'s shape, without making it."""
        return self._shapes[name]

    def split_rows(self, name: str, parts: Sequence[tuple[str, int, int]]) -> None:
        """Replaces ``name`` by row ranges, ``(new name, first row, rows)`` each, made when
        read like the rest. A run of one source's parts read in turn (as loading reads a
        layer's q, k and v) makes the source once: it is held until its last part is read."""
        source, shape = self._values.pop(name), self._shapes.pop(name)
        pending = {part for part, _, _ in parts}
        held: list[torch.Tensor] = []

        def rows_of(part: str, start: int, rows: int) -> torch.Tensor:
            if not held:
                held.append(source if isinstance(source, torch.Tensor) else source())
            out = held[0][start:start + rows].contiguous()
            pending.discard(part)
            if not pending:
                held.clear()
            return out

        for part, start, rows in parts:
            self.add_lazy(part, (rows, *shape[1:]), lambda p=part, s=start, r=rows: rows_of(p, s, r))

    def __getitem__(self, name: str) -> torch.Tensor:
        value = self._values[name]
        return value if isinstance(value, torch.Tensor) else value()

    def __setitem__(self, name: str, tensor: torch.Tensor) -> None:
        self._values[name] = tensor
        self._shapes[name] = tuple(tensor.shape)

    def __delitem__(self, name: str) -> None:
        del self._values[name]
        del self._shapes[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


@dataclass
class LoadedModel:
    """A checkpoint read into memory, named and laid out as Hugging Face does."""

    config: ModelConfig
    weights: MutableMapping[str, torch.Tensor]
    quant_types: dict[str, str]
    raw_quantized: dict[str, tuple[str, np.ndarray, tuple[int, ...]]] = field(default_factory=dict)
    source: str = ""
    format: str = "gguf"


# --------------------------------------------------------------------------- dequantization


def _blocks(data: np.ndarray, type_name: str) -> np.ndarray:
    """View raw bytes as ``[n_blocks, bytes_per_block]`` uint8."""
    _, nbytes = BLOCK_SHAPES[type_name]
    flat = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    if flat.size % nbytes:
        raise ValueError(f"{type_name}: {flat.size} bytes is not a whole number of {nbytes}-byte blocks")
    return flat.reshape(-1, nbytes)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The little-endian fp16 at byte ``start`` of every block, as float32 ``[n, 1]``."""
    return np.ascontiguousarray(blocks[:, start : start + 2]).view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """16 packed bytes -> 32 values: low nibbles are elements 0..15, high nibbles 16..31."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=1)


def dequantize_q8_0(data: np.ndarray) -> np.ndarray:
    """Q8_0: fp16 scale d, 32 signed bytes q; x = d * q. Returns flat float32."""
    b = _blocks(data, "Q8_0")
    q = b[:, 2:].view(np.int8).astype(np.float32)
    return (_f16(b, 0) * q).reshape(-1)


def dequantize_q4_0(data: np.ndarray) -> np.ndarray:
    """Q4_0: fp16 scale d, 32 unsigned nibbles q; x = d * (q - 8). Returns flat float32."""
    b = _blocks(data, "Q4_0")
    q = _nibbles(b[:, 2:]).astype(np.int8) - np.int8(8)
    return (_f16(b, 0) * q.astype(np.float32)).reshape(-1)


def dequantize_q4_1(data: np.ndarray) -> np.ndarray:
    """Q4_1: fp16 scale d, fp16 offset m, 32 unsigned nibbles q; x = d * q + m. Returns flat float32."""
    b = _blocks(data, "Q4_1")
    q = _nibbles(b[:, 4:]).astype(np.float32)
    return (_f16(b, 0) * q + _f16(b, 2)).reshape(-1)


_FLOAT_TYPES = ("F32", "F16", "BF16")
_OWN_DEQUANT = {"Q8_0": dequantize_q8_0, "Q4_0": dequantize_q4_0, "Q4_1": dequantize_q4_1}
_GGUF_QUANTS_OK = ("Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q8_K", "Q2_K", "Q3_K")
READABLE_TYPES = (*_FLOAT_TYPES, *_OWN_DEQUANT, *_GGUF_QUANTS_OK)  # what dequantize reads


def dequantize(data: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Raw GGUF tensor data of type ``type_name`` -> float32 array of logical ``shape``."""
    data = np.asarray(data)
    if type_name == "F32":
        values = data.view(np.float32) if data.dtype == np.uint8 else data.astype(np.float32, copy=False)
        return values.reshape(shape)
    if type_name == "F16":
        return (data.view(np.float16) if data.dtype == np.uint8 else data).astype(np.float32).reshape(shape)
    if type_name == "BF16":
        bits = np.ascontiguousarray(data).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    if type_name in _OWN_DEQUANT:
        return _OWN_DEQUANT[type_name](data).reshape(shape)
    if type_name in ("Q4_K", "Q5_K", "Q6_K"):  # numpy of our own, bit for bit gguf.quants' (and faster)
        from .quant.kquant import dequantize as kquant_dequantize

        return kquant_dequantize(type_name, data, shape)
    if type_name in _GGUF_QUANTS_OK:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize as gguf_dequantize

        out = gguf_dequantize(np.asarray(data), GGMLQuantizationType[type_name])
        return np.asarray(out, dtype=np.float32).reshape(shape)
    raise _unsupported_type(type_name)


def _unsupported_type(type_name: str) -> UnsupportedModel:
    return UnsupportedModel(
        f"unsupported GGUF tensor type {type_name}; supported: {', '.join(READABLE_TYPES)} "
        "(re-quantize the file to one of these)"
    )


def check_tensor_type(type_name: str) -> None:
    """Refuse a tensor type ``dequantize`` cannot read, at load (weights are dequantized later)."""
    if type_name not in READABLE_TYPES:
        raise _unsupported_type(type_name)


# --------------------------------------------------------------------------- GGUF


_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",  # a mixture of experts' router
    # stacked [experts, rows, cols]: split per expert by load_gguf ("{}" is the expert)
    "ffn_gate_exps.weight": "mlp.experts.{}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{}.down_proj.weight",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors a GGUF may carry that Hugging Face recomputes instead of storing
# (rope_freqs becomes config.rope_scaling["freq_factors"]).
_GGUF_SKIPPED = {"rope_freqs.weight"}
# Where an architecture's layer tensors differ from Llama's: Gemma's four norms (its
# ffn_norm is the norm before the MLP), Phi-3's fused q/k/v and gate/up (split at load).
_GGUF_ARCH_LAYER_NAMES = {
    "gemma": {"ffn_norm.weight": "pre_feedforward_layernorm.weight",
              "post_attention_norm.weight": "post_attention_layernorm.weight",
              "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
    "phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
}
_GGUF_SKIPPED = _GGUF_SKIPPED | {"rope_factors_long.weight", "rope_factors_short.weight"}
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


def gguf_to_hf_name(name: str, arch: str | None = None) -> str | None:
    """GGUF tensor name -> Hugging Face parameter name (None for tensors we drop);
    ``arch``: the file's ``general.architecture``."""
    if name in _GGUF_SKIPPED:
        return None
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    m = _BLK.match(name)
    family = _GGUF_ARCH_LAYER_NAMES.get("gemma" if arch in _GEMMA else str(arch), {})
    if m and m.group(2) in family:
        return f"model.layers.{m.group(1)}.{family[m.group(2)]}"
    if m and m.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}"
    raise UnsupportedModel(f"unexpected tensor {name!r} in a {arch or 'llama'} GGUF file; tokenmill reads the decoder "
                     f"tensors of {', '.join(SUPPORTED_ARCHITECTURES)}")


def unpermute_rows(n_rows: int, n_heads: int) -> np.ndarray:
    """Row index turning llama.cpp's interleaved q/k rows back into HF's half-split order.

    Within one head of size ``hd`` llama.cpp stores rotary pairs adjacently
    (row ``2*i + p``); Hugging Face stores first halves then second halves
    (row ``p*hd/2 + i``). ``hf = gguf[index]``.
    """
    head_dim = n_rows // n_heads
    if head_dim * n_heads != n_rows or head_dim % 2:
        raise ValueError(f"cannot split {n_rows} rows into {n_heads} heads of even size")
    gguf_rows = np.arange(n_rows).reshape(n_heads, head_dim // 2, 2)  # [head, i, pair]
    return gguf_rows.transpose(0, 2, 1).reshape(-1)  # read in [head, pair, i] order


def _short_float(value: float) -> float:
    """GGUF stores float32; print-round so 1e-5 reads back as 1e-5, not 9.99999974e-06."""
    return float(str(np.float32(value)))


def _gguf_config(md: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> ModelConfig:
    arch = md.get("general.architecture")
    architecture = _GGUF_ARCHITECTURES.get(arch, arch)
    check_architecture(architecture, "GGUF architecture")

    def meta(suffix: str, default: Any = None) -> Any:
        return md.get(f"{arch}.{suffix}", default)

    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    kv_heads = meta("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer lists exist in some files; we need a uniform count
        if len(set(kv_heads)) != 1:
            raise UnsupportedModel("GGUF with per-layer KV head counts is not supported; supported: one KV head "
                               "count for every layer")
        kv_heads = kv_heads[0]
    # The embedding's row count is what the model can emit; it equals the token list's
    # length in well-formed files, and wins when they disagree.
    vocab = tensor_shapes["model.embed_tokens.weight"][0]
    rope_scaling = None
    scaling_type = meta("rope.scaling.type")
    if scaling_type and scaling_type != "none":
        rope_scaling = {"rope_type": scaling_type, "factor": float(meta("rope.scaling.factor", 1.0))}
        orig = meta("rope.scaling.original_context_length")
        if orig is not None:
            rope_scaling["original_max_position_embeddings"] = int(orig)
    elif meta("rope.scale_linear") is not None:
        rope_scaling = {"rope_type": "linear", "factor": float(meta("rope.scale_linear"))}
    ffn = meta("feed_forward_length") or meta("expert_feed_forward_length")
    if isinstance(ffn, list):
        ffn = ffn[0]
    layer0 = "model.layers.0.self_attn."
    extra: dict[str, Any] = {}
    if arch in _GEMMA:
        from .models.gemma import gguf_settings

        extra = gguf_settings(arch, meta, int(meta("block_count")),
                              int(meta("attention.key_length", hidden // heads)))
    elif arch == "phi3":
        window = meta("attention.sliding_window")
        extra = {"sliding_window": int(window) if window else None}  # long-RoPE: _phi3_gguf_rope
    experts = int(meta("expert_count", 0) or 0)
    if experts and architecture == "llama":
        architecture = "mixtral"
    sparse = sorted({int(n.split(".")[2]) for n in tensor_shapes if n.endswith("mlp.gate.weight")})
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(ffn),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads),
        head_dim=int(meta("attention.key_length", hidden // heads)),
        max_position_embeddings=int(meta("context_length", 2048)),
        rms_norm_eps=_short_float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_short_float(meta("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings="lm_head.weight" not in tensor_shapes,
        attention_bias=f"{layer0}q_proj.bias" in tensor_shapes,
        qk_norm=f"{layer0}q_norm.weight" in tensor_shapes,
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=md.get("tokenizer.ggml.eos_token_id"),
        **extra,
        num_experts=experts,
        num_experts_per_tok=int(meta("expert_used_count", 0) or 0),
        moe_intermediate_size=int(meta("expert_feed_forward_length", 0) or 0) or int(ffn),
        norm_topk_prob=bool(meta("expert_weights_norm", True)),  # llama.cpp renormalises both families
        mlp_only_layers=tuple(i for i in range(int(meta("block_count"))) if experts and i not in sparse),
    )


def check_architecture(arch: Any, what: str, where: str = "") -> None:
    """One line naming the architecture tokenmill cannot run and those it can."""
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModel(f"unsupported {what} {arch!r}{where}; tokenmill runs {', '.join(SUPPORTED_ARCHITECTURES)}")


def _phi3_gguf_rope(gguf_file: GGUFFile, config: ModelConfig) -> None:
    """Phi-3's long-RoPE factors, which llama.cpp stores as two tensors."""
    md = gguf_file.metadata
    tensors = {t.name: t for t in gguf_file.tensors}
    if "rope_factors_long.weight" not in tensors:
        return
    factors = {kind: dequantize(t.data, t.type_name, t.shape).tolist()
               for kind, t in (("long_factor", tensors["rope_factors_long.weight"]),
                               ("short_factor", tensors["rope_factors_short.weight"]))}
    original = md.get("phi3.rope.scaling.original_context_length", config.max_position_embeddings)
    config.rope_scaling = {"rope_type": "longrope", **factors, "original_max_position_embeddings": int(original)}
    if md.get("phi3.rope.scaling.attn_factor") is not None:
        config.rope_scaling["attention_factor"] = float(md["phi3.rope.scaling.attn_factor"])


def _dense(t: GGUFTensor, row_index: np.ndarray | None, dtype: torch.dtype) -> torch.Tensor:
    """One GGUF tensor dequantized, rows in Hugging Face order, in ``dtype``."""
    values = dequantize(t.data, t.type_name, t.shape)
    if row_index is not None:
        values = values[row_index]
    if not values.flags.writeable or not values.flags.c_contiguous:
        values = np.array(values, copy=True)  # F32 tensors are read-only views of the file
    return torch.from_numpy(values).to(dtype)


def load_gguf(path: str, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Read a GGUF file: metadata -> ModelConfig, tensors -> HF-named weights, each
    dequantized when read (``CheckpointWeights``), and the block tensors' raw bytes."""
    gguf_file = read_gguf(path)
    arch = gguf_file.metadata.get("general.architecture")
    check_architecture(_GGUF_ARCHITECTURES.get(arch, arch), "GGUF architecture")
    entries = []
    for t in gguf_file.tensors:
        hf = gguf_to_hf_name(t.name, arch)
        if hf is not None and "{}" in hf:  # stacked experts: one 2-D tensor each, views of the file
            entries += [(hf.format(j), GGUFTensor(t.name, t.type_name, t.shape[1:], t.data[j]))
                        for j in range(t.shape[0])]
        elif hf is not None:
            entries.append((hf, t))
    shapes = {hf: t.shape for hf, t in entries}
    if "model.embed_tokens.weight" not in shapes:
        raise ValueError(f"{path}: no token_embd.weight tensor; not a decoder-only language model")
    config = _gguf_config(gguf_file.metadata, shapes)
    freqs = next((t for t in gguf_file.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None and config.rope_scaling is None:
        # Llama 3.1+ files store the per-frequency divisors of llama3 RoPE scaling as a tensor
        # instead of the HF parameters; hand them over as-is: inv_freq[i] /= freq_factors[i].
        factors = dequantize(freqs.data, freqs.type_name, freqs.shape)
        config.rope_scaling = {"rope_type": "freq_factors", "freq_factors": factors.tolist()}
    if arch == "phi3":
        _phi3_gguf_rope(gguf_file, config)
    # Only Llama-arch files were written with the interleaving permutation; Qwen's RoPE is
    # already half-split in llama.cpp ("NEOX" style), so its rows are stored as HF has them.
    permuted = config.architecture in ("llama", "mistral", "mixtral")

    weights = CheckpointWeights()
    quant_types: dict[str, str] = {}
    raw: dict[str, tuple[str, np.ndarray, tuple[int, ...]]] = {}
    for hf, t in entries:
        type_name, shape = t.type_name, t.shape
        check_tensor_type(type_name)
        row_index = None
        if permuted and (".q_proj." in hf or ".k_proj." in hf):
            heads = config.num_attention_heads if ".q_proj." in hf else config.num_key_value_heads
            row_index = unpermute_rows(shape[0], heads)
        weights.add_lazy(hf, tuple(shape), lambda t=t, rows=row_index: _dense(t, rows, dtype))
        quant_types[hf] = type_name
        if type_name in RAW_KEPT_TYPES and len(shape) == 2:
            blocks = t.data  # [rows, bytes_per_row] uint8 view into the memory map
            if row_index is not None:
                blocks = blocks[row_index]  # small copy: q/k rows in HF order, like the weights
            raw[hf] = (type_name, blocks, shape)
    if arch in _GEMMA:  # llama.cpp stores Gemma's norms as 1 + w; Hugging Face stores w
        for name in [n for n in weights if n.endswith("norm.weight")]:
            weights[name] = weights[name] - 1.0
    if arch == "phi3":
        _split_phi3(weights, quant_types, raw, config)
    return LoadedModel(config, weights, quant_types, raw, source=str(path), format="gguf")


def _split_phi3(weights: CheckpointWeights, quant_types: dict[str, str],
                raw: dict[str, tuple[str, np.ndarray, tuple[int, ...]]], config: ModelConfig) -> None:
    """Phi-3's fused q/k/v and gate/up into the separate names, unread (``split_rows``: each
    part dequantized when loading reads it); kept blocks split by rows too."""
    from .models.phi3 import FUSED_SUFFIXES, fused_parts

    for name in [n for n in weights if n.endswith(FUSED_SUFFIXES)]:
        parts = fused_parts(name, weights.shape_of(name)[0], config)
        weights.split_rows(name, parts)
        kind = quant_types.pop(name)
        fused_raw = raw.pop(name, None)
        for part, start, rows in parts:
            quant_types[part] = kind
            if fused_raw is not None:
                _, blocks, shape = fused_raw
                raw[part] = (kind, blocks[start:start + rows], (rows, shape[1]))


# --------------------------------------------------------------------------- Hugging Face folder


def hf_config(cfg: dict[str, Any]) -> ModelConfig:
    """config.json (transformers 4 or 5 spelling) -> ModelConfig."""
    model_type = cfg.get("model_type")
    if model_type == "gemma3" and isinstance(cfg.get("text_config"), dict):  # Gemma 3 with vision: its text decoder
        cfg = {**cfg["text_config"], "model_type": "gemma3_text",
               "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}
        model_type = "gemma3_text"
    check_architecture(model_type, "model_type", " in config.json")
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        raise UnsupportedModel(f"pre-quantized Hugging Face checkpoints ({method}) are not supported; supported: "
                               "float safetensors folders, or a GGUF file")
    rope_theta, rope_scaling = _hf_rope(cfg, model_type)
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    extra = _hf_family_settings(cfg, model_type)
    if "rope_theta" in extra:  # a family that reads its own RoPE (Gemma)
        rope_theta, rope_scaling = extra.pop("rope_theta"), extra.pop("rope_scaling")
    tie = extra.pop("tie_word_embeddings", bool(cfg.get("tie_word_embeddings", False)))
    return ModelConfig(
        architecture=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        tie_word_embeddings=tie,
        attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=extra.pop("qk_norm", model_type in ("qwen3", "qwen3_moe")),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"),
        **extra,
        num_experts=experts,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]) if experts else 0,
        # Mixtral always renormalises the top-k weights; Qwen3-MoE as its config says (a dense
        # model keeps the field's default, so its config reads back the same)
        norm_topk_prob=(model_type == "mixtral" or bool(cfg.get("norm_topk_prob", False))) if experts else True,
        decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
    )


def _hf_rope(cfg: dict[str, Any], model_type: str) -> tuple[Any, dict[str, Any] | None]:
    """config.json's RoPE base and scaling (``rope_type`` spelled the current way; None for plain
    RoPE); an unsupported scaling is refused."""
    # transformers 5 moved rope_theta/rope_scaling into one "rope_parameters" dict.
    rope = dict(cfg.get("rope_parameters") or {})
    rope_theta = cfg.get("rope_theta", rope.pop("rope_theta", 10000.0))
    rope.pop("rope_theta", None)
    rope_scaling = cfg.get("rope_scaling")
    if rope_scaling is None and rope.get("rope_type", "default") != "default":
        rope_scaling = rope
    if rope_scaling is not None:
        rope_scaling = dict(rope_scaling)
        if "type" in rope_scaling and "rope_type" not in rope_scaling:
            rope_scaling["rope_type"] = rope_scaling.pop("type")
        if rope_scaling.get("rope_type") == "default":
            rope_scaling = None
    if model_type == "phi3" and rope_scaling is not None and rope_scaling.get("rope_type") in ("su", "yarn"):
        rope_scaling["rope_type"] = "longrope"  # Phi-3's older spellings of long-RoPE
    if rope_scaling is not None and "original_max_position_embeddings" not in rope_scaling \
            and cfg.get("original_max_position_embeddings"):
        rope_scaling["original_max_position_embeddings"] = int(cfg["original_max_position_embeddings"])
    if rope_scaling is not None:
        from .models.llama import ROPE_SCALING_KINDS

        kind = rope_scaling.get("rope_type")
        if kind not in ROPE_SCALING_KINDS:
            raise UnsupportedModel(f"unsupported rope scaling type {kind!r} in config.json; supported: "
                             f"{', '.join(ROPE_SCALING_KINDS)}")
    return rope_theta, rope_scaling


def _hf_family_settings(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The ModelConfig fields a model family reads its own way (Gemma, Phi-3, Mistral's window)."""
    if model_type in _GEMMA:
        from .models.gemma import hf_settings as gemma_settings

        return gemma_settings(cfg)
    if model_type == "phi3":
        from .models.phi3 import hf_settings as phi3_settings

        return phi3_settings(cfg)
    if model_type == "mistral" and cfg.get("sliding_window"):
        return {"sliding_window": int(cfg["sliding_window"])}
    return {}


_SAFETENSORS_TYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
}


def load_hf_folder(path: str, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """config.json + model.safetensors (or shards listed in model.safetensors.index.json)."""
    from safetensors import safe_open

    folder = Path(path)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{path}: not a Hugging Face model folder (no config.json)")
    config = hf_config(json.loads(config_path.read_text()))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files (PyTorch .bin checkpoints are not supported)")
    weights: dict[str, torch.Tensor] = {}
    quant_types: dict[str, str] = {}
    text_prefixes = ("model.language_model.", "language_model.model.")  # Gemma 3 with vision
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            for stored in f.keys():
                if stored.endswith("rotary_emb.inv_freq"):
                    continue
                key = stored
                if config.architecture == "gemma3_text":
                    prefix = next((p for p in text_prefixes if stored.startswith(p)), None)
                    if prefix is not None:
                        key = "model." + stored[len(prefix):]
                    elif stored.startswith(("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
                                            "multi_modal_projector.", "language_model.lm_head.")):
                        continue  # the image encoder: tokenmill serves text
                tensor = f.get_tensor(stored)
                quant_types[key] = _SAFETENSORS_TYPES.get(tensor.dtype, str(tensor.dtype))
                weights[key] = tensor.to(dtype)
    if config.architecture == "phi3":
        from .models.phi3 import split_fused_weights

        sources = split_fused_weights(weights, config)
        for part, (source, _, _) in sources.items():
            quant_types[part] = quant_types[source]
        for source in {source for source, _, _ in sources.values()}:
            quant_types.pop(source)
    if config.num_experts:
        from .models.moe import canonical_expert_names

        canonical_expert_names(weights, quant_types)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
        quant_types.pop("lm_head.weight", None)
    elif "lm_head.weight" not in weights:
        raise ValueError(f"{path}: tie_word_embeddings is false but there is no lm_head.weight")
    if "model.embed_tokens.weight" not in weights:
        raise ValueError(f"{path}: no model.embed_tokens.weight; expected a *ForCausalLM checkpoint")
    return LoadedModel(config, weights, quant_types, {}, source=str(path), format="hf")


# --------------------------------------------------------------------------- entry point


def load_model(path: str | None, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a local GGUF file or Hugging Face folder; ``None`` means the bundled SmolLM2."""
    if path is None:
        from tokenmill.files.bundled import default_model_path

        path = default_model_path()
    path = os.fspath(path)
    if os.path.isdir(path):
        return load_hf_folder(path, dtype)
    check_model_path(path, read_header=False)
    return load_gguf(path, dtype)


def check_model_path(path: str, read_header: bool = True) -> int | None:
    """Whether ``path`` is a model tokenmill can load, from its header alone (no weights read):
    a GGUF file of a supported architecture, or a Hugging Face folder with a supported
    config.json and safetensors. Returns its vocabulary size (None without ``read_header``).
    Raises FileNotFoundError or ValueError (UnsupportedModel) with one line, so a command can
    refuse a wrong path before loading anything else."""
    path = os.fspath(path)
    if os.path.isdir(path):
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ValueError(f"{path}: not a Hugging Face model folder (no config.json)")
        try:
            cfg = json.loads(config_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{config_path}: not readable JSON ({exc})") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"{config_path}: not a JSON object")
        try:
            vocab = hf_config(cfg).vocab_size
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{config_path}: not a model config ({exc!r})") from None
        if not any(Path(path).glob("*.safetensors")):
            raise ValueError(f"{path}: no *.safetensors files (PyTorch .bin checkpoints are not supported)")
        return vocab
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model path {path!r} does not exist (no hub downloads: give a local path)")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (magic {magic!r}); give a .gguf file or an HF folder")
    if not read_header:
        return None
    try:
        gguf_file = read_gguf(path)
    except (ValueError, IndexError, KeyError, OverflowError, MemoryError, struct.error) as exc:
        raise ValueError(f"{path}: a damaged GGUF file ({exc})") from None
    arch = gguf_file.metadata.get("general.architecture")
    check_architecture(_GGUF_ARCHITECTURES.get(arch, arch), "GGUF architecture", f" in {path}")
    embedding = next((t for t in gguf_file.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise ValueError(f"{path}: no token_embd.weight tensor; not a decoder-only language model")
    return int(embedding.shape[0])

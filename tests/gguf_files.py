"""Writing small GGUF files the way llama.cpp's converter lays them out (test helper).

One writer for the loader tests and the quantized-model tests: HF-named
weights in, llama.cpp tensor names, q/k rows permuted for its interleaved
rotary, each 2-D tensor stored as F32 or quantized by ``gguf.quants``.
"""
from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from tokenmill.model import loader


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (written here from its description:
    each head's two halves are interleaved pairwise)."""
    rows = w.shape[0]
    hd = rows // n_heads
    out = np.empty_like(w)
    for h in range(n_heads):
        for i in range(hd // 2):
            out[h * hd + 2 * i] = w[h * hd + i]
            out[h * hd + 2 * i + 1] = w[h * hd + hd // 2 + i]
    return out


def add_shape(w: Any, cfg: Any, head_dim: int, rope_theta: float) -> None:
    """The network's shape in a GGUF writer's metadata, as llama.cpp's converter writes it."""
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(rope_theta)


def write_gguf(path: str, weights: dict[str, Any], cfg: Any, *, arch: str = "llama",
               qtypes: dict[str, str] | None = None, bos_token_id: int | None = None,
               eos_token_id: int | None = None, extra_tensors: dict[str, np.ndarray] | None = None) -> None:
    """Write HF-named ``weights`` (numpy arrays or tensors) for ``cfg``.

    ``qtypes`` maps a substring of a weight's name to a GGUF type ("Q8_0", "Q4_1", ...; a K-quant
    type writes random blocks of the tensor's shape instead of its values);
    the first key found in the name wins ("" matches every name); 1-D tensors and
    unmatched names stay F32. ``extra_tensors`` are written under their GGUF names.
    """
    import gguf
    from gguf import GGMLQuantizationType as QT
    from gguf.quants import quantize as gguf_quantize

    top = {v: k for k, v in loader._GGUF_TOP_NAMES.items()}
    per_layer = {v: k for k, v in loader._GGUF_LAYER_NAMES.items()}
    w = gguf.GGUFWriter(path, arch)
    add_shape(w, cfg, cfg.head_dim, cfg.rope_theta)
    if bos_token_id is not None:
        w.add_bos_token_id(bos_token_id)
    if eos_token_id is not None:
        w.add_eos_token_id(eos_token_id)
    weights = _stack_experts(weights)
    if getattr(cfg, "num_experts", 0):
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if arch != "llama":
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    for name, tensor in weights.items():
        if name in top:
            gname = top[name]
        else:
            _, _, idx, rest = name.split(".", 3)
            gname = f"blk.{idx}.{per_layer[rest]}".replace(".{}", "")
        value = np.ascontiguousarray(tensor.numpy() if hasattr(tensor, "numpy") else tensor, dtype=np.float32)
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name) and value.ndim == 2:
            heads = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
            value = llama_cpp_permute(value, heads)
        qtype = next((q for key, q in (qtypes or {}).items() if key in name), "F32") if value.ndim >= 2 else "F32"
        if qtype == "F32":
            w.add_tensor(gname, value)
        elif qtype in KQUANT_SCALES:  # gguf.quants cannot make these: random blocks of the same shape
            rng = np.random.default_rng(zlib.crc32(name.encode()))  # the same blocks in every process
            blocks = random_kquant_blocks(qtype, int(np.prod(value.shape[:-1])), value.shape[-1], rng)
            w.add_tensor(gname, blocks.reshape(*value.shape[:-1], -1), raw_dtype=QT[qtype])
        else:
            w.add_tensor(gname, gguf_quantize(value, QT[qtype]), raw_dtype=QT[qtype])
    for gname, value in (extra_tensors or {}).items():
        w.add_tensor(gname, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _stack_experts(weights: dict[str, Any]) -> dict[str, Any]:
    """HF per-expert tensors (``mlp.experts.{j}.gate_proj.weight``) stacked into llama.cpp's
    3-D ``ffn_*_exps`` layout, under the loader's ``mlp.experts.{}...`` names."""
    out: dict[str, Any] = {}
    stacks: dict[str, dict[int, Any]] = {}
    for name, tensor in weights.items():
        parts = name.split(".")
        if len(parts) > 5 and parts[3:5] == ["mlp", "experts"]:
            key = ".".join(parts[:5] + ["{}"] + parts[6:])
            value = tensor.numpy() if hasattr(tensor, "numpy") else tensor
            stacks.setdefault(key, {})[int(parts[5])] = np.asarray(value, dtype=np.float32)
            if key not in out:
                out[key] = None
        else:
            out[name] = tensor
    for key, experts in stacks.items():
        out[key] = np.stack([experts[j] for j in range(len(experts))])
    return out


# d (and dmin) of random K-quant blocks: weights of roughly +-0.1, like a small model's
KQUANT_SCALES = {"Q4_K": (2e-4, 1e-3), "Q5_K": (1e-4, 1e-3), "Q6_K": (3e-5, 0.0)}
_KQUANT_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def random_kquant_blocks(type_name: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random ``type_name`` rows [rows, k / 256 * block bytes]: random codes, scales and
    mins, and finite fp16 super-block scales near ``KQUANT_SCALES``."""
    nbytes = _KQUANT_BYTES[type_name]
    blocks = rng.integers(0, 256, size=(rows, k // 256, nbytes), dtype=np.uint8)
    d, dmin = KQUANT_SCALES[type_name]
    scale = (d * rng.uniform(0.5, 1.5, size=(rows, k // 256))).astype(np.float16)
    if type_name == "Q6_K":
        blocks[..., 208:210] = scale[..., None].view(np.uint8).reshape(rows, k // 256, 2)
    else:
        low = (dmin * rng.uniform(0.5, 1.5, size=(rows, k // 256))).astype(np.float16)
        blocks[..., 0:2] = scale[..., None].view(np.uint8).reshape(rows, k // 256, 2)
        blocks[..., 2:4] = low[..., None].view(np.uint8).reshape(rows, k // 256, 2)
    return blocks.reshape(rows, -1)

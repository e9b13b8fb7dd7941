"""Tensor-parallel (Megatron-style) pieces of the model: which slice of each
weight a rank holds, the layers that exchange data, and reading a shard
straight from the checkpoint.

A rank holds whole attention heads and whole KV heads (q/k/v split by output
rows), a contiguous share of the MLP's intermediate units (gate/up by output
rows, down by input columns), the o projection's matching input columns, and
a contiguous range of the vocabulary (embedding rows and LM head rows). The
two row-parallel projections (o and down) produce partial sums that one
all-reduce each turns into the full output; the vocab-parallel embedding
all-reduces too (every token's row lives on exactly one rank); the LM head's
logit columns are gathered on rank 0, the only rank that samples. Norms and
the rotary tables are replicated.

The decoder's own modules do the rest: built with ``local_config`` (the head
and intermediate counts of one rank) they have exactly a shard's shapes, so
the attention kernels run per rank on the local heads without knowing.

Quantized weights split along their quantization groups. A column-parallel
layer (q/k/v, gate/up: output rows) keeps whole rows, hence whole blocks; a
row-parallel one (o, down: input columns) must cut each row at a multiple of
the block or group (32 columns for Q8_0/Q4_0/Q4_1, ``--quant-group-size`` for
int4), and a size that would cut one is refused before any process starts
(``check_quantization``). int8 and w8a8 have one scale per output row, so
they split anywhere. A GGUF file's blocks are sliced as bytes: rows are rows
of blocks, columns are a run of whole blocks in every row; vocabulary shards
are padded with zero bytes, which every kept format reads as zero weights.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..settings.config import ModelConfig
from .models.llama import Linear, LlamaForCausalLM
from .loader import (RAW_KEPT_TYPES, LoadedModel, dequantize, gguf_to_hf_name, hf_config,
                     read_gguf, unpermute_rows)


@dataclass
class CommStats:
    """Seconds this process spent inside the model's collectives (for benchmarks)."""

    seconds: float = 0.0
    calls: int = 0

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


COMM = CommStats()


@dataclass(frozen=True)
class TPInfo:
    """This process's place in the tensor-parallel group."""

    rank: int
    size: int
    group: object = field(default=None, compare=False)  # torch process group (None: the default one)


def _split_problems(cfg: ModelConfig, size: int) -> list[str]:
    problems = []
    if cfg.num_attention_heads % size:
        problems.append(f"{cfg.num_attention_heads} attention heads")
    kv = cfg.num_key_value_heads
    if kv % size and size % kv:
        problems.append(f"{kv} KV heads (neither a multiple nor a divisor of {size})")
    if cfg.intermediate_size % size:
        problems.append(f"an MLP of {cfg.intermediate_size} units")
    return problems


def check_divisible(cfg: ModelConfig, size: int) -> None:
    """Refuse, with the numbers, a model whose heads or MLP do not split over ``size`` ranks.

    More ranks than KV heads is allowed when they divide evenly: each KV head is then
    replicated on ``size / kv_heads`` ranks (the ones whose query heads read it)."""
    if cfg.num_experts and size > 1:
        raise ValueError(f"tensor_parallel_size {size}: this model's mixture-of-experts layers are not "
                         "sharded (tensor parallelism splits dense MLPs only); run it with 1")
    problems = _split_problems(cfg, size)
    if problems:
        sizes = [n for n in range(1, cfg.num_attention_heads + 1) if not _split_problems(cfg, n)]
        raise ValueError(f"tensor_parallel_size {size} does not divide this model's "
                         f"{' and '.join(problems)}; sizes that do: {', '.join(map(str, sizes))}")


def local_kv_heads(cfg: ModelConfig, size: int) -> int:
    return max(1, cfg.num_key_value_heads // size)


def local_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The shape of one rank's decoder: 1/size of the heads, KV heads and MLP units."""
    check_divisible(cfg, size)
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // size,
                               num_key_value_heads=local_kv_heads(cfg, size),
                               intermediate_size=cfg.intermediate_size // size, head_dim=cfg.head_dim)


def vocab_shard(vocab: int, rank: int, size: int) -> tuple[int, int, int]:
    """(first id, last id + 1, padded rows per rank) of a rank's vocabulary range."""
    per = -(-vocab // size)
    start = min(rank * per, vocab)
    return start, min(start + per, vocab), per


def shard_range(name: str, cfg: ModelConfig, rank: int, size: int) -> tuple[int, int, int] | None:
    """(dim, start, stop) of the slice of HF-named tensor ``name`` that ``rank`` holds;
    None for a replicated tensor (norms)."""
    d = cfg.head_dim
    assert d is not None

    def part(total: int) -> tuple[int, int]:
        per = total // size
        return rank * per, (rank + 1) * per

    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        start, stop, _ = vocab_shard(cfg.vocab_size, rank, size)
        return 0, start, stop
    leaf = name.rsplit(".", 2)[-2:]  # e.g. ["q_proj", "weight"]
    proj = leaf[0]
    if proj == "q_proj":
        return (0, *part(cfg.num_attention_heads * d))
    if proj in ("k_proj", "v_proj"):
        kv = cfg.num_key_value_heads
        if kv >= size:
            return (0, *part(kv * d))
        head = rank * kv // size  # replicated: the KV head this rank's query heads share
        return 0, head * d, (head + 1) * d
    if proj in ("gate_proj", "up_proj"):
        return (0, *part(cfg.intermediate_size))
    if proj == "o_proj" and leaf[1] == "weight":
        return (1, *part(cfg.num_attention_heads * d))
    if proj == "down_proj" and leaf[1] == "weight":
        return (1, *part(cfg.intermediate_size))
    return None


def _pad_vocab(name: str, tensor: torch.Tensor, cfg: ModelConfig, size: int) -> torch.Tensor:
    """Vocab shards all have the padded row count (zero rows past the vocabulary)."""
    if name not in ("model.embed_tokens.weight", "lm_head.weight"):
        return tensor
    rows = vocab_shard(cfg.vocab_size, 0, size)[2]
    if tensor.shape[0] == rows:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])


def shard_weights(weights: dict[str, torch.Tensor], cfg: ModelConfig, rank: int,
                  size: int) -> dict[str, torch.Tensor]:
    """One rank's slices of full in-memory weights (copies, so the full ones can go)."""
    out = {}
    for name, tensor in weights.items():
        spec = shard_range(name, cfg, rank, size)
        if spec is not None:
            dim, start, stop = spec
            tensor = tensor.narrow(dim, start, stop - start)
        out[name] = _pad_vocab(name, tensor.contiguous().clone(), cfg, size)
    return out


def _block_geometry(type_name: str) -> tuple[int, int]:
    """(elements, bytes) of one block of a GGUF type (1 element for the float types)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]


def slice_blocks(name: str, type_name: str, blocks: np.ndarray, shape: tuple[int, ...], cfg: ModelConfig,
                 rank: int, size: int) -> tuple[np.ndarray, tuple[int, ...]] | None:
    """``rank``'s part of a GGUF tensor's raw rows ``[rows, bytes_per_row]``, and its shape.

    Rows are rows of blocks; columns are a run of whole blocks in every row. None when
    the column range would cut a block (the caller dequantizes, or refuses)."""
    spec = shard_range(name, cfg, rank, size)
    if spec is None:
        return blocks, tuple(shape)
    dim, start, stop = spec
    if dim == 0 and len(shape) > 1:
        return blocks[start:stop], (stop - start, *shape[1:])
    # columns, or the elements of a 1-D tensor (a bias: its one row is all the bytes)
    block, type_size = _block_geometry(type_name)
    if start % block or stop % block:
        return None
    cut = slice(start // block * type_size, stop // block * type_size)
    if len(shape) == 1:
        return blocks[cut], (stop - start,)
    return blocks[:, cut], (shape[0], stop - start)


def _pad_blocks(name: str, blocks: np.ndarray, shape: tuple[int, ...], cfg: ModelConfig,
                size: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """Vocabulary shards of raw blocks padded to the common row count with zero bytes:
    a zero scale (and zero offset) is a zero weight in Q8_0, Q4_0 and Q4_1."""
    rows = vocab_shard(cfg.vocab_size, 0, size)[2]
    blocks = np.ascontiguousarray(blocks)
    if name not in ("model.embed_tokens.weight", "lm_head.weight") or blocks.shape[0] == rows:
        return blocks, tuple(shape)
    pad = np.zeros((rows - blocks.shape[0], blocks.shape[1]), dtype=blocks.dtype)
    return np.concatenate([blocks, pad]), (rows, *shape[1:])


def shard_loaded(loaded: LoadedModel, rank: int, size: int) -> LoadedModel:
    """One rank's part of an in-memory model: its weights, and its slices of the raw
    GGUF blocks (kept whole; a tensor whose column split would cut a block keeps none)."""
    cfg = loaded.config
    check_divisible(cfg, size)
    raw = {}
    for name, (type_name, blocks, shape) in loaded.raw_quantized.items():
        cut = slice_blocks(name, type_name, np.asarray(blocks), tuple(shape), cfg, rank, size)
        if cut is not None:
            raw[name] = (type_name, *_pad_blocks(name, *cut, cfg, size))
    return LoadedModel(cfg, shard_weights(loaded.weights, cfg, rank, size), dict(loaded.quant_types), raw,
                       source=loaded.source, format=loaded.format)


# --------------------------------------------------------------------------- reading a shard from the file


# Architectures whose checkpoints a rank slices as it reads them (the others: load_shard).
SLICED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


def read_config(path: str) -> ModelConfig:
    """The model's config without reading any weights."""
    if os.path.isdir(path):
        return hf_config(json.loads((Path(path) / "config.json").read_text()))
    from .loader import _gguf_config

    gguf_file = read_gguf(path)  # tensors are views of the memory map: nothing is read yet
    arch = gguf_file.metadata.get("general.architecture")
    shapes = {hf: t.shape for t in gguf_file.tensors if (hf := gguf_to_hf_name(t.name, arch)) is not None}
    cfg = _gguf_config(gguf_file.metadata, shapes)
    freqs = next((t for t in gguf_file.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None and cfg.rope_scaling is None:  # as load_gguf reads Llama 3.1+ files
        factors = dequantize(freqs.data, freqs.type_name, freqs.shape)
        cfg.rope_scaling = {"rope_type": "freq_factors", "freq_factors": factors.tolist()}
    return cfg


def load_shard(path: str | None, dtype: torch.dtype, rank: int, size: int) -> LoadedModel:
    """Read only ``rank``'s slices from a GGUF file or an HF safetensors folder: each
    tensor is sliced before it is dequantized or copied, so no rank ever holds the
    whole model."""
    if path is None:
        from ..files.bundled import default_model_path

        path = default_model_path()
    path = os.fspath(path)
    if read_config(path).architecture not in SLICED_ARCHITECTURES:
        # Gemma's GGUF norms and Phi-3's fused weights are put in Hugging Face form by the
        # loader: such a rank reads the whole model, then keeps its shard.
        from .loader import load_model

        return shard_loaded(load_model(path, dtype), rank, size)
    if os.path.isdir(path):
        return _load_hf_shard(path, dtype, rank, size)
    return _load_gguf_shard(path, dtype, rank, size)


def _load_hf_shard(path: str, dtype: torch.dtype, rank: int, size: int) -> LoadedModel:
    from safetensors import safe_open

    folder = Path(path)
    cfg = hf_config(json.loads((folder / "config.json").read_text()))
    check_divisible(cfg, size)
    index = folder / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
             else sorted(p.name for p in folder.glob("*.safetensors")))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(folder / file), framework="pt") as f:
            for key in f.keys():
                if key.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and key == "lm_head.weight"):
                    continue
                spec = shard_range(key, cfg, rank, size)
                if spec is None:
                    tensor = f.get_tensor(key)
                else:
                    dim, start, stop = spec
                    part = f.get_slice(key)
                    tensor = part[start:stop] if dim == 0 else part[:, start:stop]
                weights[key] = _pad_vocab(key, tensor.to(dtype).contiguous(), cfg, size)
    return LoadedModel(cfg, weights, {}, {}, source=path, format="hf")


def block_types(path: str) -> dict[str, str]:
    """HF name -> GGUF type of a file's tensors, read from its header (nothing for an HF folder)."""
    if os.path.isdir(path):
        return {}
    gguf_file = read_gguf(path)
    arch = gguf_file.metadata.get("general.architecture")
    return {hf: t.type_name for t in gguf_file.tensors if (hf := gguf_to_hf_name(t.name, arch)) is not None}


def _load_gguf_shard(path: str, dtype: torch.dtype, rank: int, size: int) -> LoadedModel:
    gguf_file = read_gguf(path)
    entries = [(hf, t) for t in gguf_file.tensors if (hf := gguf_to_hf_name(t.name)) is not None]
    cfg = read_config(path)
    check_divisible(cfg, size)
    permuted = cfg.architecture in ("llama", "mistral")
    weights: dict[str, torch.Tensor] = {}
    quant_types: dict[str, str] = {}
    raw: dict[str, tuple[str, np.ndarray, tuple[int, ...]]] = {}
    for hf, t in entries:
        cut = slice_blocks(hf, t.type_name, t.data, t.shape, cfg, rank, size)
        blocks: np.ndarray | None
        if cut is None:  # columns that cut a block: dequantize this tensor, then slice (dense only)
            spec = shard_range(hf, cfg, rank, size)
            assert spec is not None
            values = dequantize(t.data, t.type_name, t.shape)[:, spec[1] : spec[2]]
            blocks, shape = None, tuple(values.shape)
        else:
            blocks, shape = cut  # views of the mapped file: only this rank's bytes are read
            values = dequantize(blocks, t.type_name, shape)
        if permuted and (".q_proj." in hf or ".k_proj." in hf):
            # llama.cpp's row order is per head, so a slice of whole heads unpermutes on its own
            heads = cfg.num_attention_heads // size if ".q_proj." in hf else local_kv_heads(cfg, size)
            index = unpermute_rows(values.shape[0], heads)
            values = values[index]
            blocks = None if blocks is None else blocks[index]
        values = np.array(values, copy=True, order="C")
        weights[hf] = _pad_vocab(hf, torch.from_numpy(values).to(dtype), cfg, size)
        quant_types[hf] = t.type_name
        if blocks is not None and t.type_name in RAW_KEPT_TYPES and len(shape) == 2:
            raw[hf] = (t.type_name, *_pad_blocks(hf, blocks, shape, cfg, size))
    return LoadedModel(cfg, weights, quant_types, raw, source=path, format="gguf")


# --------------------------------------------------------------------------- layers that communicate


def all_reduce(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    started = time.perf_counter()
    dist.all_reduce(x, group=tp.group)
    COMM.seconds += time.perf_counter() - started
    COMM.calls += 1
    return x


def reduce_partial(partial: torch.Tensor, tp: TPInfo, residual: torch.Tensor | None = None) -> torch.Tensor:
    """Sum the ranks' partial outputs (plus the residual, once). On CPU, half-precision
    partials are summed in float32 and rounded once, as one device's matmul rounds its
    float32 accumulator once (summing in bf16 rounds at every addition; measured on the
    tiny model, greedy agreement with float32 fell well below one rank's bf16). On GPUs
    they are reduced in their own dtype, as vLLM does: half the bytes over the links."""
    dtype = partial.dtype
    widen = dtype != torch.float32 and partial.device.type == "cpu"
    total = all_reduce(partial.float().contiguous() if widen else partial.contiguous(), tp)
    if residual is None:
        return total.to(dtype)
    return (total + residual.float()).to(dtype) if widen else residual + total


class RowParallelLinear(Linear):
    """A projection split by input columns: each rank's product is a partial sum;
    one all-reduce gives every rank the whole output. The residual is added after
    the reduction (once, not once per rank)."""

    def __init__(self, in_features: int, out_features: int, tp: TPInfo) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_partial(super().forward(x), self.tp)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return reduce_partial(super().forward(x), self.tp, residual)


class AllReduceOutput(nn.Module):
    """All-reduces the output of a row-parallel projection that quantization replaced."""

    def __init__(self, inner: nn.Module, tp: TPInfo) -> None:
        super().__init__()
        self.inner = inner
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_partial(self.inner(x), self.tp)


class VocabParallelEmbedding(nn.Module):
    """Rows for this rank's token ids; zeros for the others; summed over ranks."""

    def __init__(self, vocab: int, hidden: int, tp: TPInfo) -> None:
        super().__init__()
        self.start, self.stop, rows = vocab_shard(vocab, tp.rank, tp.size)
        self.weight = nn.Parameter(torch.empty(rows, hidden))
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.stop - self.start)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return all_reduce(out, self.tp)


def gather_logits(local: torch.Tensor, vocab: int, tp: TPInfo) -> torch.Tensor:
    """Every rank's logit columns, concatenated on rank 0 and cut to the vocabulary;
    other ranks get their own columns back (nobody reads them)."""
    local = local.contiguous()
    started = time.perf_counter()
    if tp.rank == 0:
        parts = [torch.empty_like(local) for _ in range(tp.size)]
        dist.gather(local, parts, dst=0, group=tp.group)
        out = torch.cat(parts, dim=-1)[:, :vocab]
    else:
        dist.gather(local, None, dst=0, group=tp.group)
        out = local
    COMM.seconds += time.perf_counter() - started
    COMM.calls += 1
    return out


class ParallelLMHead(nn.Module):
    """Logits of this rank's vocabulary range, gathered on rank 0 (the sampler's rank).
    Other ranks return their local columns, which nobody reads. ``in_features`` and
    ``bias`` let quantization treat it as the linear layer it is (``rewrap_quantized``
    puts the quantized one back behind the gather)."""

    def __init__(self, vocab: int, hidden: int, tp: TPInfo) -> None:
        super().__init__()
        self.vocab = vocab
        self.in_features, self.out_features = hidden, vocab_shard(vocab, tp.rank, tp.size)[2]
        self.weight = nn.Parameter(torch.empty(self.out_features, hidden))
        self.bias = None
        self.tp = tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_logits(F.linear(hidden, self.weight), self.vocab, self.tp)


class QuantizedParallelLMHead(nn.Module):
    """A quantized layer over this rank's (padded) vocabulary rows, then the gather."""

    def __init__(self, inner: nn.Module, vocab: int, tp: TPInfo) -> None:
        super().__init__()
        self.inner = inner
        self.vocab = vocab
        self.tp = tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_logits(self.inner(hidden), self.vocab, self.tp)


class VocabParallelQuantizedEmbedding(nn.Module):
    """Token lookup through a tied, quantized LM head's local rows: rows for this rank's
    ids, zeros for the others, summed over ranks (one copy of the table, as on one device)."""

    def __init__(self, head: nn.Module, vocab: int, dtype: torch.dtype, tp: TPInfo) -> None:
        super().__init__()
        self.head = head
        self.start, self.stop, _ = vocab_shard(vocab, tp.rank, tp.size)
        self.dtype = dtype
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1) - self.start
        outside = (flat < 0) | (flat >= self.stop - self.start)
        rows = self.head.rows(flat.masked_fill(outside, 0))  # type: ignore[operator]
        out = rows.to(self.dtype).masked_fill(outside.unsqueeze(-1), 0)
        return all_reduce(out.contiguous(), self.tp).reshape(*ids.shape, -1)


def shard_model(model: LlamaForCausalLM, tp: TPInfo) -> None:
    """Turn a (meta-device) full-size decoder into one rank's shard, in place: local
    head/MLP counts, row-parallel o/down, vocab-parallel embedding and head.
    ``model.config`` becomes the local config (the runner sizes the KV pool from it)."""
    full = model.config
    cfg = local_config(full, tp.size)
    device = model.embed_tokens.weight.device
    with torch.device(device):
        model.embed_tokens = VocabParallelEmbedding(full.vocab_size, full.hidden_size, tp)
        model.lm_head = ParallelLMHead(full.vocab_size, full.hidden_size, tp)
        for layer in model.layers:
            whole = layer.self_attn
            layer.self_attn = type(whole)(cfg)  # the family's own attention and MLP, with a shard's shapes
            layer.self_attn.window, layer.self_attn.softcap, layer.self_attn.scale = whole.window, whole.softcap, whole.scale
            assert cfg.head_dim is not None
            layer.self_attn.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, full.hidden_size, tp)
            layer.mlp = type(layer.mlp)(cfg)
            layer.mlp.down_proj = RowParallelLinear(cfg.intermediate_size, full.hidden_size, tp)
    model.config = cfg


def rewrap_quantized(model: LlamaForCausalLM, tp: TPInfo) -> None:
    """After quantization replaced layers with quantized ones, put the communication back:
    the all-reduce after o/down, the logit gather after a quantized LM head, and a
    vocab-parallel lookup for an embedding tied to it."""
    from .quant.quant import QuantizedEmbedding

    for layer in model.layers:
        for parent, attr in ((layer.self_attn, "o_proj"), (layer.mlp, "down_proj")):
            mod = getattr(parent, attr)
            if not isinstance(mod, (RowParallelLinear, AllReduceOutput)):
                setattr(parent, attr, AllReduceOutput(mod, tp))
    vocab = model.config.vocab_size  # the local config splits heads and MLP units, not the vocabulary
    if not isinstance(model.lm_head, (ParallelLMHead, QuantizedParallelLMHead)):
        model.lm_head = QuantizedParallelLMHead(model.lm_head, vocab, tp)
    embed = model.embed_tokens
    if isinstance(embed, QuantizedEmbedding):
        model.embed_tokens = VocabParallelQuantizedEmbedding(embed.head, vocab, embed.dtype, tp)


def _input_group(mode: str, proj: str, group_size: int, types: dict[str, str]) -> tuple[int, str] | None:
    """(columns, description) of the quantization group a row-parallel layer's input is cut
    in, or None where the format has no groups along the input (int8, w8a8, dense)."""
    if mode == "int4":
        return group_size, f"int4 groups of {group_size}"
    if mode == "gguf":
        kinds = sorted({t for name, t in types.items() if f".{proj}." in name and t in RAW_KEPT_TYPES})
        if kinds:
            block = max(_block_geometry(kind)[0] for kind in kinds)  # a K-quant's 256 with a Q4_0's 32: 256
            return block, f"{'/'.join(kinds)} blocks of {block}"
    return None


def _group_problems(mode: str, cfg: ModelConfig, size: int, group_size: int, types: dict[str, str]) -> list[str]:
    assert cfg.head_dim is not None
    problems = []
    for proj, total in (("o_proj", cfg.num_attention_heads * cfg.head_dim), ("down_proj", cfg.intermediate_size)):
        group = _input_group(mode, proj, group_size, types)
        if group is not None and (total // size) % group[0]:
            problems.append(f"the {group[1]} columns of {proj} (a rank's share would be {total // size} "
                            f"of its {total} input columns)")
    return problems


def check_quantization(mode: str | None, cfg: ModelConfig, size: int, group_size: int = 32,
                       types: dict[str, str] | None = None) -> None:
    """Refuse, before any process starts, a quantization whose groups a rank's share of
    the o or down input columns would cut (``types``: the file's GGUF type per tensor,
    for 'gguf'), and 'gguf' for a model that has no blocks to keep."""
    mode = str(mode or "none").lower()
    types = types or {}
    if mode == "gguf" and not any(t in RAW_KEPT_TYPES for t in types.values()):
        raise ValueError("quantization 'gguf' serves a GGUF file's own Q8_0/Q4_0/Q4_1 blocks; this model has "
                         "none (use int8 or int4)")
    problems = _group_problems(mode, cfg, size, group_size, types)
    if problems:
        fits = [n for n in range(1, cfg.num_attention_heads + 1)
                if not _split_problems(cfg, n) and not _group_problems(mode, cfg, n, group_size, types)]
        hint = ", or a --quant-group-size that divides the share" if mode == "int4" else ""
        raise ValueError(f"tensor_parallel_size {size} would split {' and '.join(problems)}; a quantization "
                         f"group must stay whole on one rank. Sizes that keep them whole: "
                         f"{', '.join(map(str, fits)) or '(none)'}{hint}")


def resolve_auto(mode: str | None, cfg: ModelConfig, size: int, types: dict[str, str]) -> tuple[str, str]:
    """``--quantization auto`` under tensor parallelism, decided before the workers start
    (they must all build the same layers): the file's own blocks when it has some and
    they split whole, else dense."""
    if str(mode or "none").lower() != "auto":
        return str(mode or "none"), "as asked"
    kinds = sorted({t for t in types.values() if t in RAW_KEPT_TYPES})
    if not kinds:
        return "none", "the file holds no quantized blocks with a kernel here"
    if _group_problems("gguf", cfg, size, 32, types):
        return "none", f"{size} ranks would split the file's {'/'.join(kinds)} blocks"
    return "gguf", f"the file stores {'/'.join(kinds)} blocks, kept as they are and split whole"


def tensor_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers, shared tensors once, rotary tables left out."""
    seen: set[int] = set()
    total = 0
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if name.endswith(("rope.cos", "rope.sin")) or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


__all__ = ["COMM", "TPInfo", "check_divisible", "local_config", "shard_range", "shard_weights", "shard_loaded",
           "load_shard", "read_config", "RowParallelLinear", "VocabParallelEmbedding", "ParallelLMHead",
           "shard_model", "rewrap_quantized", "check_quantization", "resolve_auto", "block_types",
           "slice_blocks", "QuantizedParallelLMHead", "VocabParallelQuantizedEmbedding", "tensor_bytes"]

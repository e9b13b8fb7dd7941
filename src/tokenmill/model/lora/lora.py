"""LoRA adapters: their weights in the PEFT format, and the batched low-rank update.

An adapter changes a projection ``W`` to ``W + scale * B @ A`` (A: [r, in],
B: [out, r]; ``scale = lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with
rsLoRA). Weights are never merged: every targeted projection of the model is a
``LoraLinear`` around the base layer (dense, int8, int4 or GGUF blocks, it
does not matter which), which adds ``(x @ A^T) @ B^T * scale`` to the base
layer's output for the rows of each adapter. So requests for different
adapters and for the base share one step.

The model fuses q/k/v into one projection and gate/up into another, so an
adapter's A matrices of one fused projection are stacked ([sum r, in]) and its
B matrices laid out block-diagonally ([out, sum r], each scaled by its
adapter's scale): a fused projection costs two small matmuls per adapter per
step, whatever subset of q/k/v (or gate/up) the adapter targets.

The step's rows are grouped by adapter (``StepBatch.decodes_first`` orders
them so), and ``LoraState.segments`` holds ``(adapter, first row, end row)``
for the current step: each adapter's A and B are read once per segment.
Rows of the base model are in no segment and pay nothing.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from ...settings.config import ModelConfig

# Hugging Face projection name -> (the model's fused projection, which part of its output)
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
FUSED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


class LoraError(ValueError):
    """An adapter that cannot be served on this model (the message says why)."""


@dataclass(frozen=True)
class ModelShape:
    """What an adapter's tensors must fit: the base model's projection sizes."""

    num_layers: int
    hidden: int
    q_size: int
    kv_size: int
    intermediate: int
    num_heads: int = 0  # query and key/value heads: GGUF adapters store q/k rows per head
    num_kv_heads: int = 0

    @classmethod
    def of(cls, cfg: ModelConfig) -> "ModelShape":
        assert cfg.head_dim is not None
        return cls(cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim,
                   cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size,
                   cfg.num_attention_heads, cfg.num_key_value_heads)

    def parts(self, fused: str) -> tuple[int, list[int]]:
        """(input features, output sizes of the parts) of a fused projection."""
        if fused == "qkv_proj":
            return self.hidden, [self.q_size, self.kv_size, self.kv_size]
        if fused == "o_proj":
            return self.q_size, [self.hidden]
        if fused == "gate_up_proj":
            return self.hidden, [self.intermediate, self.intermediate]
        return self.intermediate, [self.hidden]


@dataclass
class FusedDelta:
    """One adapter's update of one fused projection: ``y += (x @ a^T) @ b^T``."""

    a: torch.Tensor  # [sum r, in]
    b: torch.Tensor  # [out, sum r], scaled, zero outside each part's rows and rank columns
    # (first output, end output, first rank column, end rank column) of each part targeted:
    # where b is not zero (the fused native step reads only those blocks)
    parts: tuple[tuple[int, int, int, int], ...] = ()


@dataclass
class LoraWeights:
    """A loaded adapter, ready to serve: per layer, the deltas of the projections it targets."""

    name: str
    adapter_id: int  # > 0; the base model is 0
    rank: int
    scale: float
    targets: tuple[str, ...]  # Hugging Face projection names it changes
    layers: list[dict[str, FusedDelta]]
    path: str = ""

    @property
    def nbytes(self) -> int:
        return sum(d.a.numel() * d.a.element_size() + d.b.numel() * d.b.element_size()
                   for layer in self.layers for d in layer.values())


# An adapter_config.json is a few hundred bytes nesting two or three levels; these bounds are far
# above any real one and far below what could exhaust memory or the parser's recursion.
CONFIG_MAX_BYTES = 1 << 20
CONFIG_MAX_DEPTH = 32


def nesting_depth(text: str) -> int:
    """How deep the arrays and objects of JSON ``text`` nest (brackets inside strings not
    counted): measured before parsing, since the parser recurses once per level."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def parse_config(raw: bytes) -> dict:
    """``adapter_config.json``'s bytes as a dict, size and depth bounded before parsing;
    ``LoraError`` for anything else (messages name the file, never the folder it is in)."""
    if len(raw) > CONFIG_MAX_BYTES:
        raise LoraError(f"{CONFIG_FILE}: larger than {CONFIG_MAX_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise LoraError(f"{CONFIG_FILE}: not UTF-8 text") from None
    if nesting_depth(text) > CONFIG_MAX_DEPTH:
        raise LoraError(f"{CONFIG_FILE}: nested deeper than {CONFIG_MAX_DEPTH} levels")
    try:
        config = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise LoraError(f"{CONFIG_FILE}: not valid JSON ({type(exc).__name__})") from None
    if not isinstance(config, dict):
        raise LoraError(f"{CONFIG_FILE}: not a JSON object")
    return config


def _read_config(folder: str) -> dict:
    path = os.path.join(folder, CONFIG_FILE)
    if not os.path.isdir(folder):
        raise LoraError("the adapter path is not a folder (nor a GGUF file)")
    if not os.path.isfile(path):
        raise LoraError(f"the adapter folder has no {CONFIG_FILE}")
    try:
        with open(path, "rb") as f:
            raw = f.read(CONFIG_MAX_BYTES + 1)
    except OSError as exc:
        raise LoraError(f"{CONFIG_FILE}: cannot be read ({exc.strerror})") from None
    return parse_config(raw)


def _read_tensors(folder: str) -> dict[str, torch.Tensor]:
    for name in WEIGHTS_FILES:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(path)
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - a damaged file is the adapter's fault
            raise LoraError(f"{name}: cannot be read ({type(exc).__name__})") from None
    raise LoraError(f"the adapter folder has none of {', '.join(WEIGHTS_FILES)}")


def _target_names(config: dict) -> set[str] | None:
    """The projection names ``target_modules`` lists (None: a regular expression, judged by the tensors)."""
    targets = config.get("target_modules")
    if isinstance(targets, str):
        if targets == "all-linear":
            return set(TARGETS)
        return None
    if not isinstance(targets, list) or not targets:
        raise LoraError("adapter_config.json: target_modules must be a non-empty list or a pattern")
    return {str(t).rsplit(".", 1)[-1] for t in targets}


def load_peft(folder: str, name: str, adapter_id: int, shape: ModelShape, max_rank: int,
              dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> LoraWeights:
    """Read a PEFT adapter folder and check it against the model; raises ``LoraError`` with
    the reason for anything this model cannot serve (missing files, an unsupported option,
    a rank above ``max_rank``, a target the model does not have, a tensor of the wrong shape)."""
    config = _read_config(folder)
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise LoraError(f"adapter {name!r}: peft_type {config.get('peft_type')!r} is not LORA")
    for option in ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform"):
        if config.get(option):
            raise LoraError(f"adapter {name!r}: {option} is not supported")
    if config.get("bias", "none") != "none":
        raise LoraError(f"adapter {name!r}: bias={config.get('bias')!r} is not supported (only 'none')")
    if config.get("fan_in_fan_out"):
        raise LoraError(f"adapter {name!r}: fan_in_fan_out is for Conv1D models, not Llama")
    try:
        rank = int(config["r"])
        alpha = float(config.get("lora_alpha", rank))
    except (KeyError, TypeError, ValueError):
        raise LoraError(f"adapter {name!r}: adapter_config.json needs an integer r") from None
    if rank <= 0:
        raise LoraError(f"adapter {name!r}: rank {rank} must be positive")
    if rank > max_rank:
        raise LoraError(f"adapter {name!r}: rank {rank} exceeds --max-lora-rank {max_rank}")
    declared = _target_names(config)
    if declared is not None:
        unknown = sorted(declared - set(TARGETS))
        if unknown:
            raise LoraError(f"adapter {name!r}: target modules {unknown} are not projections of this model "
                            f"(it has {', '.join(TARGETS)})")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = _read_tensors(folder)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise LoraError(f"adapter {name!r}: tensor {key!r} is not a LoRA weight of a decoder projection")
        layer, proj, which = int(m.group(1)), m.group(2), m.group(3)
        if proj not in TARGETS:
            raise LoraError(f"adapter {name!r}: {key!r} targets {proj!r}, which this model does not have")
        if layer >= shape.num_layers:
            raise LoraError(f"adapter {name!r}: {key!r} is for layer {layer}; the model has {shape.num_layers}")
        pairs.setdefault((layer, proj), {})[which] = tensor
    return build_weights(name, adapter_id, shape, rank, scale, pairs, folder, dtype, device)


def build_weights(name: str, adapter_id: int, shape: ModelShape, rank: int, scale: float,
                  pairs: dict[tuple[int, str], dict[str, torch.Tensor]], path: str,
                  dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> LoraWeights:
    """An adapter ready to serve from its ``(layer, projection) -> {"A": [r, in], "B": [out, r]}``
    matrices (Hugging Face's row order, unscaled), whatever file they came from; checked
    against the model's shapes."""
    if not pairs:
        raise LoraError(f"adapter {name!r}: no LoRA weights found")
    per_layer: list[dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]] = [{} for _ in range(shape.num_layers)]
    for (layer, proj), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoraError(f"adapter {name!r}: layers.{layer}.{proj} lacks lora_{'B' if 'A' in ab else 'A'}")
        fused, part = TARGETS[proj]
        in_features, outs = shape.parts(fused)
        a, b = ab["A"], ab["B"]
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoraError(f"adapter {name!r}: layers.{layer}.{proj} has NaN or infinite weights")
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (outs[part], rank):
            raise LoraError(f"adapter {name!r}: layers.{layer}.{proj} has A {tuple(a.shape)} and B "
                            f"{tuple(b.shape)}; this model needs A ({rank}, {in_features}) and B "
                            f"({outs[part]}, {rank})")
        per_layer[layer].setdefault(fused, {})[part] = (a, b)
    layers: list[dict[str, FusedDelta]] = []
    for parts_of in per_layer:
        deltas: dict[str, FusedDelta] = {}
        for fused, parts in parts_of.items():
            in_features, outs = shape.parts(fused)
            order = sorted(parts)
            a = torch.cat([parts[p][0].float() for p in order])
            b = torch.zeros(sum(outs), rank * len(order))
            offsets = [sum(outs[:p]) for p in range(len(outs))]
            blocks = tuple((offsets[p], offsets[p] + outs[p], col * rank, (col + 1) * rank)
                           for col, p in enumerate(order))
            for out0, out1, col0, col1 in blocks:
                part = order[col0 // rank]
                b[out0:out1, col0:col1] = parts[part][1].float() * scale
            deltas[fused] = FusedDelta(a.to(device=device, dtype=dtype).contiguous(),
                                       b.to(device=device, dtype=dtype).contiguous(), blocks)
        layers.append(deltas)
    targets = tuple(sorted({proj for (_, proj) in pairs}, key=list(TARGETS).index))
    return LoraWeights(name, adapter_id, rank, scale, targets, layers, path)


@dataclass
class LoraState:
    """The adapters resident in the model and the current step's row segments.

    Written only on the engine thread: ``install`` / ``remove`` between steps,
    ``segments`` by the runner around a forward pass."""

    max_loras: int
    max_rank: int
    shape: ModelShape
    dtype: torch.dtype
    device: torch.device
    adapters: dict[int, LoraWeights] = field(default_factory=dict)
    segments: list[tuple[LoraWeights, int, int]] = field(default_factory=list)

    def install(self, weights: LoraWeights) -> None:
        if weights.adapter_id not in self.adapters and len(self.adapters) >= self.max_loras:
            raise LoraError(f"{self.max_loras} adapters are resident already (--max-loras)")
        self.adapters[weights.adapter_id] = weights

    def remove(self, adapter_id: int) -> None:
        self.adapters.pop(adapter_id, None)

    def begin_step(self, segments: list[tuple[int, int, int]]) -> None:
        """This step's ``(adapter id, first row, end row)`` runs (adapter ids > 0)."""
        self.segments = [(self.adapters[a], s, e) for a, s, e in segments]

    def end_step(self) -> None:
        self.segments = []


class LoraLinear(nn.Module):
    """A projection plus the low-rank updates of this step's adapters, per row segment."""

    def __init__(self, base_layer: nn.Module, layer_index: int, fused: str, state: LoraState) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.layer_index = layer_index
        self.fused = fused
        self.state = state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        if self.state.segments:
            self._add_updates(x, y)
        return y

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``; without adapter rows, the base layer's fused add."""
        if not self.state.segments:
            from ..models.llama import linear_add

            return linear_add(self.base_layer, x, residual)
        return residual + self.forward(x)

    def _add_updates(self, x: torch.Tensor, y: torch.Tensor) -> None:
        for weights, start, end in self.state.segments:
            delta = weights.layers[self.layer_index].get(self.fused)
            if delta is None:
                continue
            rows = x[start:end]
            if rows.dtype != delta.a.dtype:
                rows = rows.to(delta.a.dtype)
            update = (rows @ delta.a.T) @ delta.b.T
            y[start:end] += update.to(y.dtype)


def base_of(module: nn.Module) -> nn.Module:
    """The projection under a ``LoraLinear`` (or the module itself)."""
    return module.base_layer if isinstance(module, LoraLinear) else module


def attach(model: nn.Module, state: LoraState) -> None:
    """Put every projection an adapter may target behind a ``LoraLinear`` bound to ``state``;
    ValueError for a model whose layers are not the Llama family's (Gemma, Phi-3, ...)."""
    from ..models.llama import LlamaForCausalLM

    if type(model) is not LlamaForCausalLM:
        raise ValueError(f"LoRA adapters are served for Llama-family models only, not {type(model).__name__}")
    for i, layer in enumerate(model.layers):  # type: ignore[attr-defined]
        attn, mlp = layer.self_attn, layer.mlp
        for owner, fused in ((attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj")):
            current = getattr(owner, fused)
            if not isinstance(current, LoraLinear):
                setattr(owner, fused, LoraLinear(current, i, fused, state))
    model.lora_state = state  # type: ignore[attr-defined]

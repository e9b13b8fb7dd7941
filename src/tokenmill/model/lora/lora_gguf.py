"""LoRA adapters in llama.cpp's GGUF format (as its ``convert_lora_to_gguf`` writes them).

Such a file says ``general.type = adapter`` and ``adapter.type = lora``, gives
``adapter.lora.alpha``, and holds per targeted projection two tensors named
after the base tensor: ``blk.N.attn_q.weight.lora_a`` ([r, in], PEFT's A) and
``...lora_b`` ([out, r], PEFT's B), in any GGUF type the loader dequantizes.
Two things differ from PEFT: the scale is ``alpha / r`` only when alpha is set
(llama.cpp applies the update unscaled when it is 0), and for Llama-family
files the rows of q's and k's B are in llama.cpp's interleaved rotary order, as
the base model's q/k weights are; the model here keeps Hugging Face's order, so
those rows are put back the way the base loader puts back the weights'.
"""
from __future__ import annotations

import os
import re

import torch

from ..loader import _GGUF_LAYER_NAMES, dequantize, read_gguf, unpermute_rows
from .lora import TARGETS, LoraError, LoraWeights, ModelShape, build_weights

GGUF_MAGIC = b"GGUF"
_KEY = re.compile(r"^blk\.(\d+)\.(\w+\.weight)\.lora_([ab])$")
# llama.cpp wrote these families' q/k rows interleaved (model/loader.py reads their weights likewise)
_PERMUTED_ARCHS = ("llama", "mistral", "mixtral")


def is_gguf_file(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def load_gguf_lora(path: str, name: str, adapter_id: int, shape: ModelShape, max_rank: int,
                   dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> LoraWeights:
    """Read a GGUF LoRA file and check it against the model (``LoraError`` says what is wrong)."""
    try:
        gguf = read_gguf(path)
    except Exception as exc:  # noqa: BLE001 - a damaged file is the adapter's fault
        raise LoraError(f"{os.path.basename(path)}: not a readable GGUF file ({type(exc).__name__})") from None
    meta = gguf.metadata
    if meta.get("general.type") != "adapter" or str(meta.get("adapter.type", "")).lower() != "lora":
        raise LoraError(f"adapter {name!r}: {os.path.basename(path)} is a GGUF file but not a LoRA adapter "
                        f"(general.type={meta.get('general.type')!r}, adapter.type={meta.get('adapter.type')!r})")
    arch = str(meta.get("general.architecture", "llama"))
    alpha = float(meta.get("adapter.lora.alpha", 0.0) or 0.0)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for t in gguf.tensors:
        m = _KEY.match(t.name)
        hf = _GGUF_LAYER_NAMES.get(m.group(2), "") if m else ""
        proj = hf.split(".")[1] if hf.count(".") == 2 else ""
        if m is None or proj not in TARGETS:
            raise LoraError(f"adapter {name!r}: tensor {t.name!r} is not a LoRA weight of a decoder projection "
                            f"this model has ({', '.join(TARGETS)})")
        layer, which = int(m.group(1)), m.group(3).upper()
        if layer >= shape.num_layers:
            raise LoraError(f"adapter {name!r}: {t.name!r} is for layer {layer}; the model has {shape.num_layers}")
        try:
            values = dequantize(t.data, t.type_name, t.shape)
        except Exception as exc:  # noqa: BLE001 - an unknown tensor type is the file's
            raise LoraError(f"adapter {name!r}: {t.name!r} of type {t.type_name} cannot be read ({exc})") from None
        if which == "B" and arch in _PERMUTED_ARCHS and proj in ("q_proj", "k_proj") and values.ndim == 2:
            heads = shape.num_heads if proj == "q_proj" else shape.num_kv_heads
            if heads <= 0 or values.shape[0] % heads:
                raise LoraError(f"adapter {name!r}: {t.name!r} has {values.shape[0]} rows, not whole heads")
            values = values[unpermute_rows(values.shape[0], heads)]
        pairs.setdefault((layer, proj), {})[which] = torch.from_numpy(values.copy())
    if not pairs:
        raise LoraError(f"adapter {name!r}: no LoRA weights found in {os.path.basename(path)}")
    ranks = {int(ab["A"].shape[0]) for ab in pairs.values() if "A" in ab}
    if len(ranks) != 1:
        raise LoraError(f"adapter {name!r}: its lora_a tensors have ranks {sorted(ranks)}; one rank is served")
    (rank,) = ranks
    if rank > max_rank:
        raise LoraError(f"adapter {name!r}: rank {rank} exceeds --max-lora-rank {max_rank}")
    scale = alpha / rank if alpha else 1.0
    return build_weights(name, adapter_id, shape, rank, scale, pairs, path, dtype, device)

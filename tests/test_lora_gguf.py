"""LoRA adapters as llama.cpp's GGUF files: a peft adapter written the way llama.cpp's converter
writes it (A and B per projection, q/k rows of B in llama.cpp's rotary order, alpha in the
metadata) gives the same greedy tokens as transformers + peft; bad files are refused."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from conftest import make_tiny_llm, tiny_config
from gguf_files import llama_cpp_permute
from test_lora import ADAPTERS, GREEDY, _prompts, _reference, adapters, _one_thread  # noqa: F401 - fixtures
from tokenmill import SamplingParams
from tokenmill.model import loader
from tokenmill.model.lora.lora import LoraError, ModelShape
from tokenmill.model.lora.lora_gguf import load_gguf_lora

gguf = pytest.importorskip("gguf")
_PEFT_KEY = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


def write_gguf_lora(path: str, peft_model, alpha: float, *, qtype: str = "F32", general_type: str = "adapter") -> None:
    """The adapter's A and B under llama.cpp's names, B's q/k rows permuted as its converter does."""
    cfg = tiny_config()
    per_layer = {v: k for k, v in loader._GGUF_LAYER_NAMES.items()}
    w = gguf.GGUFWriter(path, "llama")
    w.add_string("general.type", general_type)
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", alpha)
    for key, tensor in peft_model.state_dict().items():
        m = _PEFT_KEY.search(key)
        if m is None:
            continue
        layer, block, proj, which = m.groups()
        value = tensor.detach().float().numpy()
        if which == "B" and proj in ("q_proj", "k_proj"):
            value = llama_cpp_permute(value, cfg.num_attention_heads if proj == "q_proj" else cfg.num_key_value_heads)
        name = f"blk.{layer}.{per_layer[f'{block}.{proj}.weight']}.lora_{which.lower()}"
        if qtype == "F16":
            w.add_tensor(name, value.astype(np.float16))
        else:
            w.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_adapters_match_peft(adapters, tmp_path):
    """An attention adapter (q/k rows permuted in the file) and an MLP one, alone and in one batch."""
    alphas = {name: alpha for name, _, alpha, _, rslora in ADAPTERS if not rslora}
    llm = make_tiny_llm(enable_lora=True, max_loras=2, max_lora_rank=16, num_threads=1)
    names = ["attn8", "mlp4"]
    for name in names:
        path = str(tmp_path / f"{name}.gguf")
        write_gguf_lora(path, adapters[name][1], alphas[name])
        llm.load_lora(name, path)
    prompts = _prompts(2, seed=11)
    for name in names:
        for prompt in prompts:
            got = llm.generate([prompt], SamplingParams(max_tokens=10, **GREEDY), lora=name)
            assert got[0].outputs[0].token_ids == _reference(adapters[name][1], prompt, 10), name
    outs = llm.generate([prompts[0]] * 2, SamplingParams(max_tokens=10, **GREEDY), lora=names)
    assert [o.outputs[0].token_ids for o in outs] == [_reference(adapters[n][1], prompts[0], 10) for n in names]


def test_gguf_adapter_in_half_precision_and_refusals(adapters, tmp_path):
    shape = ModelShape.of(tiny_config())
    path = str(tmp_path / "attn8-f16.gguf")
    write_gguf_lora(path, adapters["attn8"][1], 16.0, qtype="F16")
    weights = load_gguf_lora(path, "attn8", 1, shape, max_rank=16)
    assert weights.rank == 8 and weights.scale == pytest.approx(2.0) and weights.targets == (
        "q_proj", "k_proj", "v_proj", "o_proj")
    with pytest.raises(LoraError, match="exceeds --max-lora-rank 4"):
        load_gguf_lora(path, "attn8", 1, shape, max_rank=4)
    model_file = str(tmp_path / "not-an-adapter.gguf")
    write_gguf_lora(model_file, adapters["attn8"][1], 16.0, general_type="model")
    with pytest.raises(LoraError, match="not a LoRA adapter"):
        load_gguf_lora(model_file, "x", 1, shape, max_rank=16)
    small = ModelShape(1, shape.hidden, shape.q_size, shape.kv_size, shape.intermediate,
                       shape.num_heads, shape.num_kv_heads)
    with pytest.raises(LoraError, match="the model has 1"):
        load_gguf_lora(path, "x", 1, small, max_rank=16)

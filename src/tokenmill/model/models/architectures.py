"""Which model class runs which architecture (``ModelConfig.architecture``).

The Llama-family decoder (``llama.py``) takes Llama, Mistral, Qwen2/3 and
Phi-3 (whose fused weights and long-RoPE are read by ``phi3.py``); Gemma 2/3
have their own layer (``gemma.py``). The loader refuses anything else, naming
what it runs (``loader.SUPPORTED_ARCHITECTURES``).
"""
from __future__ import annotations

from ...settings.config import ModelConfig
from .gemma import GEMMA_ARCHITECTURES, GemmaForCausalLM
from .llama import LlamaForCausalLM


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    """The decoder class for ``cfg``'s architecture."""
    if cfg.architecture in GEMMA_ARCHITECTURES:
        return GemmaForCausalLM
    return LlamaForCausalLM

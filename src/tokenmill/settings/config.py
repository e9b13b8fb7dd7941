"""Every knob in one place, typed.

``ModelConfig`` describes the network (read from GGUF metadata or config.json);
``CacheConfig`` the paged KV pool; ``SchedulerConfig`` the batching limits;
``EngineConfig`` bundles them with the device and dtype choices the user makes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .grammar_limits import GrammarLimits
from .options import KernelOptions

# The one dtype table: every spelling a flag, an option or a candidate may use, by canonical name.
DTYPE_ALIASES: dict[str, str] = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                                 "half": "float16"}
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def canonical_dtype(name: str) -> str:
    """A dtype's canonical name from any spelling (``bf16`` -> ``bfloat16``); other names
    (``auto``, ``int8``) come back as given, lower-cased."""
    key = str(name).strip().lower()
    return DTYPE_ALIASES.get(key, key)


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[canonical_dtype(name)]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of float32, bfloat16") from None


def parse_size(value: str | int | float | None) -> int | None:
    """'2GiB', '512M', '1.5G', 1234 -> bytes. None stays None."""
    if value is None or isinstance(value, (int, float)):
        return None if value is None else int(value)
    text = value.strip().upper().replace("IB", "").replace("B", "")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(float(text))


@dataclass
class ModelConfig:
    """Shape of a Llama-family decoder. Names follow Hugging Face's config.json."""

    architecture: str = "llama"  # llama | qwen2 | qwen3 | mistral
    vocab_size: int = 32000
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int | None = None  # defaults to hidden_size // num_attention_heads
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF rope_scaling dict (llama3, linear, ...)
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # qwen2: bias on q/k/v projections
    qk_norm: bool = False  # qwen3: RMSNorm on per-head q and k
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # Mixture of experts (qwen3_moe, mixtral; model/models/moe.py): 0 experts means dense MLPs.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's MLP width
    norm_topk_prob: bool = True  # renormalise the top-k router weights to sum to one
    decoder_sparse_step: int = 1  # every this many layers is sparse ...
    mlp_only_layers: tuple[int, ...] = ()  # ... except these, which keep a dense MLP
    # Sliding-window attention (Gemma 2/3, Phi-3, Mistral): a query at position p sees keys
    # at positions > p - sliding_window; ``layer_types`` says which layers ("sliding_attention"
    # or "full_attention"); None with a window: every layer slides.
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    family: dict[str, Any] = field(default_factory=dict)  # family-specific settings (model/models/gemma.py)

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    def layer_window(self, index: int) -> int | None:
        """The sliding window of layer ``index``, or None where it attends to the whole context."""
        if self.sliding_window is None:
            return None
        if self.layer_types is not None and self.layer_types[index] != "sliding_attention":
            return None
        return int(self.sliding_window)

    @property
    def kv_elements_per_token(self) -> int:
        """Elements of K+V stored for one token across all layers."""
        assert self.head_dim is not None
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes for the whole pool; None: derive
    kv_cache_fraction: float = 0.2  # of available memory when kv_cache_memory is None
    num_blocks: int | None = None  # explicit override (tests)
    enable_prefix_caching: bool = True
    # KV pool dtype: auto (the compute dtype), that dtype by name, or int8 / fp8 (e4m3) codes
    # with a scale per block and kv head (model/quant/kv_quant.py)
    kv_cache_dtype: str = "auto"
    # Second tier (engine/kv/kv_tier.py): evicted blocks kept on local disk, up to this many bytes,
    # in this folder (kept across restarts of the same model). 0: no tier.
    kv_offload_bytes: int = 0
    kv_offload_dir: str | None = None


# Tokens per step by device, when not given. On a small CPU a long prefill step stalls
# every running stream for its whole duration; a 512-token step bounds that stall at a
# few percent of offline throughput (see docs/performance.md). A GPU takes larger steps.
CPU_TOKEN_BUDGET = 512
CUDA_TOKEN_BUDGET = 2048


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    # Tokens per step, prefill chunks and decodes together. None: by device
    # (``token_budget``: CPU_TOKEN_BUDGET / CUDA_TOKEN_BUDGET).
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    batching: str = "continuous"  # continuous | static | dynamic
    dynamic_window_s: float = 0.05  # collection window of the dynamic policy
    max_waiting: int | None = None  # bound on the waiting queue (server returns 429 past it)
    # Prefills younger than this many steps go shortest-first; older ones go first, FCFS.
    prefill_starvation_steps: int = 4
    # Waiting-queue order (engine/sched/fairness.py): fcfs | priority (class, request priority,
    # arrival) | fair (class, tenants' weighted share of computed tokens, priority, arrival).
    scheduling_policy: str = "fcfs"
    # Under priority and fair: a request waiting this long goes first, whatever its class, and
    # admission refuses one whose queue would keep it longer (engine/sched/fairness.py: backlog).
    starvation_bound_s: float = 30.0

    def token_budget(self, device_type: str) -> int:
        """The step's token budget: as given, else the device's default (its one home)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return CPU_TOKEN_BUDGET if device_type == "cpu" else CUDA_TOKEN_BUDGET


# What ``EngineConfig.quantization`` may name besides ``auto`` (model/quant/quant.py implements them).
QUANTIZATION_MODES = ("none", "int8", "int4", "gguf", "w8a8")


@dataclass
class EngineConfig:
    model: str | None = None  # local GGUF file or HF folder; None: bundled SmolLM2
    dtype: str = "float32"
    device: str = "cpu"
    quantization: str = "none"  # none | int8 | int4 | gguf (keep the file's own blocks where a kernel exists)
    quant_group_size: int = 32  # int4 group size along the input dimension
    quantize_lm_head: bool = False
    memory_budget: int | None = None  # bytes for weights + KV pool together; KV gets what weights leave
    seed: int = 0
    # With a memory_budget: never size the KV pool past what max_num_seqs sequences of
    # max_model_len tokens can fill (a share of a large host would otherwise zero gigabytes
    # no request can reach).
    cap_kv_pool: bool = False
    num_threads: int | None = None  # torch intra-op threads; None: every core
    # Ranks (processes, one device each) that split every layer (engine/step/distributed.py); 1: no split
    tensor_parallel_size: int = 1
    # vLLM's --speculative-config (JSON text or dict), e.g. {"method": "ngram", "num_speculative_tokens": 4}
    speculative_config: Any = None
    # LoRA adapters (model/lora/lora.py, engine/adapters.py): served only when enabled; at most
    # max_loras resident at once, each of rank at most max_lora_rank
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits)  # structured outputs' compile bounds
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # How steps run (kernels, attention backend, step executors): read from the
    # environment once, here, when the config is made (tokenmill/options.py).
    kernel_options: KernelOptions = field(default_factory=KernelOptions.from_env)

    @classmethod
    def from_options(cls, **options: Any) -> "EngineConfig":
        """Build from flat keyword options (as ``LLM(...)`` and the CLI give them)."""
        cfg = cls()
        sections = (cfg.cache, cfg.scheduler)
        for key, value in options.items():
            if key in ("kv_cache_memory", "memory_budget", "kv_offload_bytes"):
                value = parse_size(value)
            if hasattr(cfg, key) and key not in ("cache", "scheduler"):
                setattr(cfg, key, value)
                continue
            for section in sections:
                if hasattr(section, key):
                    setattr(section, key, value)
                    break
            else:
                raise TypeError(f"unknown engine option {key!r}")
        return cfg

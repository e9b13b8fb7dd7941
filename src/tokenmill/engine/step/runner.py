"""Owns one engine's step machinery: the KV pool, the attention backend and the step executors.

The runner owns the KV pool tensors (allocated once, from a memory budget; on
CPU one allocation on huge pages, see host_memory.py), the engine's attention
backend and its step executors, all chosen once here from the engine's
``Kernels``. Ownership runs one way: the runner builds the executors
(``executors.py``) and hands each only what it runs on (the model, the
adapters, the fused decoder, the graphs, the eager step); no executor knows
the runner. ``execute`` takes the step's ``StepBatch`` (``step_batch.py``:
which rows sample is decided there) and gives it to the first executor that
accepts it; the last, the eager executor, runs the step through ``EagerStep``
(``eager.py``), which a tensor-parallel group (``distributed.py``) extends
with its layout broadcast instead of repeating it.

On CUDA, pure-decode steps replay captured CUDA graphs (``cuda_graphs.py``);
the pool then holds one extra block, past the ids the block pool hands out,
that padded graph rows write into.
"""
from __future__ import annotations

import logging

import torch

from ...settings.config import ModelConfig
from ...model.attention import attention_backend_class, kv_cache_shape, select_attention_backend
from ...model.quant import kv_quant
from ...model.models.llama import LlamaForCausalLM
from ...model.lora.lora import LoraState
from . import cuda_graphs, fused_decode
from .eager import EagerStep, LayoutShare, StepInputs, StepItems, StepResult
from .executors import (CudaGraphExecutor, EagerExecutor, FusedDecodeExecutor, FusedPrefillExecutor, Kernels,
                        StepExecutor)
from ..kv.host_memory import kv_pool_tensors, quantized_pool_tensors
from .step_batch import StepBatch

log = logging.getLogger("tokenmill.runner")

__all__ = ["ModelRunner", "StepInputs", "num_blocks_for_budget"]


def num_blocks_for_budget(cfg: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    """Blocks of a pool in ``dtype`` (a quantized one's scales counted) that fit the budget."""
    assert cfg.head_dim is not None
    per_block = kv_quant.bytes_per_block(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, block_size,
                                         dtype)
    return max(1, budget_bytes // per_block)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, kernels: Kernels,
                 graph_backend: cuda_graphs.GraphBackend | None = None, eager_only: bool = False,
                 kv_dtype: torch.dtype | None = None, group: LayoutShare | None = None) -> None:
        """``num_blocks``: the blocks the block pool hands out. ``kernels``: what the engine
        chose to run on. ``graph_backend``: record decode steps with it (tests inject a CPU
        stand-in); by default CUDA graphs on CUDA. ``eager_only``: neither the fused CPU
        decode step nor CUDA graphs (tensor parallelism). ``kv_dtype``: the pool's dtype,
        by default ``dtype``; int8 / float8_e4m3fn store codes with per-block scales
        (model/quant/kv_quant.py; no CUDA graphs: the store's requantization has data-dependent
        shapes); bfloat16 under float32 ``dtype`` stores rounded rows that attention widens
        (no CUDA graphs either: they were captured and measured with the pool in ``dtype``).
        ``group``: a tensor-parallel driver's layout broadcast, run before each eager forward."""
        kv_dtype = kv_dtype or dtype
        cfg = model.config
        assert cfg.head_dim is not None
        self.model = model
        self.lora: LoraState | None = getattr(model, "lora_state", None)  # adapters (model/lora/lora.py)
        self.kernels = kernels
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_dtype
        model.use_ops(kernels.ops)
        windowed = any(layer.self_attn.window is not None for layer in model.layers)
        softcapped = model.softcapped_attention()  # not in the C kernels either
        graphs_backend = None if eager_only else self._graphs_backend(graph_backend, windowed, softcapped)
        # With graphs: one scratch block past the pool's ids, for padded rows' K/V writes.
        self.scratch_block: int | None = num_blocks if graphs_backend is not None else None
        self.pool_blocks = num_blocks + (1 if graphs_backend is not None else 0)  # blocks in the KV tensors
        self.kv_heads = cfg.num_key_value_heads
        self.kv_caches = self._pool_tensors()
        self.attention = select_attention_backend(device, dtype, cfg.num_attention_heads, cfg.num_key_value_heads,
                                                  self.pool_blocks, kernels.options, kernels.library, cfg.head_dim,
                                                  kv_dtype=kv_dtype, windowed=windowed, softcapped=softcapped)
        self.graphs = (cuda_graphs.DecodeGraphRunner(model, self.kv_caches, block_size, num_blocks, dtype, device,
                                                     graphs_backend, self.attention,
                                                     kernels.options.cuda_graph_max_batch)
                       if graphs_backend is not None else None)
        self.fused: fused_decode.FusedDecoder | None = None
        if not eager_only and device.type == "cpu" and kernels.library is not None and kernels.options.fused_decode:
            # Small pure-decode batches on CPU: every layer in one native call.
            self.fused = fused_decode.build(model, self.kv_caches, kernels.library,
                                            kernels.options.fused_decode_max_batch)
        self.eager = EagerStep(model, self.kv_caches, self.attention, block_size, device, self.lora, group)
        self.executors: list[StepExecutor] = self._executors()

    def _graphs_backend(self, injected: cuda_graphs.GraphBackend | None, windowed: bool,
                        softcapped: bool) -> cuda_graphs.GraphBackend | None:
        """What records decode steps, or None: only where the attention backend can be captured,
        the pool is in the compute dtype and nothing in the step depends on the data."""
        cfg, options = self.model.config, self.kernels.options
        assert cfg.head_dim is not None
        # The backend's capabilities, asked once: graphs only where it can be captured.
        capabilities = attention_backend_class(self.device, self.dtype, options, self.kernels.library, cfg.head_dim,
                                               self.kv_dtype, windowed, softcapped).capabilities
        assert capabilities.takes(windowed, softcapped), "select_attention_backend passes over such backends"
        # Mixture-of-experts routing sizes each expert's rows from the data: nothing to record.
        if self.kv_dtype != self.dtype or not capabilities.cuda_graphs or cfg.num_experts:
            return None
        backend = cuda_graphs.select_backend(self.device, options, injected)
        masks = self.model.attention_masks()  # sliding windows, soft-capping: not in the graphs
        if backend is not None and masks:
            log.info("CUDA graphs off: the captured decode step has no %s", masks)
            return None
        return backend

    def _pool_tensors(self) -> list[tuple[torch.Tensor, ...]]:
        """Every layer's KV pool tensors (and a quantized pool's scales)."""
        cfg = self.model.config
        assert cfg.head_dim is not None
        shape = kv_cache_shape(self.pool_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        huge = self.kernels.options.huge_pages
        if kv_quant.is_quantized(self.kv_dtype):
            return quantized_pool_tensors(cfg.num_hidden_layers, shape, self.kv_dtype, self.device, huge)
        return kv_pool_tensors(cfg.num_hidden_layers, shape, self.kv_dtype, self.device, huge)  # type: ignore

    def _executors(self) -> list[StepExecutor]:
        """The step executors, in order of preference; the eager one last, taking every step."""
        executors: list[StepExecutor] = []
        if self.graphs is not None:
            executors.append(CudaGraphExecutor(self.graphs))
        if self.fused is not None:
            executors.append(FusedDecodeExecutor(self.model, self.lora, self.fused))
            # Prefill chunks too where the eager forward would run the same kernels (the
            # saved dispatch is the gain; FusedDecoder.prefill_on_kernels) and the pool is
            # not quantized (its store requantizes a chunk's rows together).
            if (self.kernels.options.fused_prefill and self.fused.prefill_on_kernels
                    and not kv_quant.is_quantized(self.kv_dtype)):
                executors.append(FusedPrefillExecutor(self.model, self.lora, self.fused))
        executors.append(EagerExecutor(self.eager))
        return executors

    @property
    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.kv_caches for t in layer)

    def prepare(self, step: StepBatch | StepItems) -> StepInputs:
        """The step flattened for the eager forward (``EagerStep.prepare``)."""
        return self.eager.prepare(step)

    @torch.inference_mode()
    def execute(self, step: StepBatch | StepItems) -> StepResult:
        """Run one step on the first executor that accepts it; return float32 logits of the
        sampled rows and their requests. Requests that asked for prompt logprobs get this
        step's appended to ``Request.prompt_logprobs`` (the eager executor's job)."""
        batch = StepBatch.of(step)
        for executor in self.executors:
            if executor.accepts(batch):
                return executor.run(batch)
        raise AssertionError("the eager executor accepts every step")

    @torch.inference_mode()
    def run_eager(self, step: StepBatch | StepItems) -> StepResult:
        """The step through the eager forward, whichever executor would take it."""
        return self.eager.run(step)

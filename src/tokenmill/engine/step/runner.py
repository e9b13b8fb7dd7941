"""Runs one step's batch on the step's executor; flattens it for the eager forward.

The runner owns the KV pool tensors (allocated once, from a memory budget; on
CPU one allocation on huge pages, see host_memory.py), the engine's attention
backend and its step executors, all chosen once here from the engine's
``Kernels`` (``executors.py``). ``execute`` takes the step's ``StepBatch``
(``step_batch.py``: which rows sample is decided there) and gives it to the
first executor that accepts it. ``prepare`` adapts the batch to the eager
forward: token ids, positions, the step layout (a slot for each new token's
K/V, block tables padded with 0, lengths) prepared by the attention backend,
and the rows whose logits are sampled. Prefill chunks and decodes go through
one forward pass.

On CUDA, pure-decode steps replay captured CUDA graphs (``cuda_graphs.py``);
the pool then holds one extra block, past the ids the block pool hands out,
that padded graph rows write into.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ...settings.config import ModelConfig
from ...model.attention import (StepAttention, StepLayout, attention_backend_class, kv_cache_shape,
                               select_attention_backend)
from ...model.quant import kv_quant
from ...model.models.llama import LlamaForCausalLM
from ...model.lora.lora import LoraState
from . import cuda_graphs, fused_decode, prompt_logprobs
from .executors import (CudaGraphExecutor, EagerExecutor, FusedDecodeExecutor, FusedPrefillExecutor, Kernels,
                        StepExecutor, StepItems, StepResult)
from ..kv.host_memory import kv_pool_tensors, quantized_pool_tensors
from ..request import Request
from .step_batch import StepBatch

log = logging.getLogger("tokenmill.runner")


def num_blocks_for_budget(cfg: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    """Blocks of a pool in ``dtype`` (a quantized one's scales counted) that fit the budget."""
    assert cfg.head_dim is not None
    per_block = kv_quant.bytes_per_block(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, block_size,
                                         dtype)
    return max(1, budget_bytes // per_block)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: StepAttention  # the step's layout, prepared by the attention backend for every layer
    logits_rows: torch.Tensor  # [S] rows of the hidden states to sample from
    sampled: list[Request]  # the requests those rows belong to, in order
    prompt_rows: list[prompt_logprobs.PromptRows] = field(default_factory=list)  # requests scoring their prompt
    lora_segments: list[tuple[int, int, int]] = field(default_factory=list)  # (adapter, first row, end row)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, kernels: Kernels,
                 graph_backend: cuda_graphs.GraphBackend | None = None, eager_only: bool = False,
                 kv_dtype: torch.dtype | None = None) -> None:
        """``num_blocks``: the blocks the block pool hands out. ``kernels``: what the engine
        chose to run on. ``graph_backend``: record decode steps with it (tests inject a CPU
        stand-in); by default CUDA graphs on CUDA. ``eager_only``: neither the fused CPU
        decode step nor CUDA graphs (tensor parallelism). ``kv_dtype``: the pool's dtype,
        by default ``dtype``; int8 / float8_e4m3fn store codes with per-block scales
        (model/quant/kv_quant.py; no CUDA graphs: the store's requantization has data-dependent
        shapes); bfloat16 under float32 ``dtype`` stores rounded rows that attention widens
        (no CUDA graphs either: they were captured and measured with the pool in ``dtype``)."""
        kv_dtype = kv_dtype or dtype
        quantized = kv_quant.is_quantized(kv_dtype)
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
        options = kernels.options
        model.use_ops(kernels.ops)
        masks = model.attention_masks()  # sliding windows, soft-capping: not in the graphs
        softcapped = model.softcapped_attention()  # not in the C kernels either
        windowed = any(layer.self_attn.window is not None for layer in model.layers)
        # The backend's capabilities, asked once: graphs only where it can be captured.
        capabilities = attention_backend_class(device, dtype, options, kernels.library, cfg.head_dim, kv_dtype,
                                               windowed, softcapped).capabilities
        assert capabilities.takes(windowed, softcapped), "select_attention_backend passes over such backends"
        graphs_backend = None
        # Mixture-of-experts routing sizes each expert's rows from the data: nothing to record.
        if not eager_only and kv_dtype == dtype and capabilities.cuda_graphs and not cfg.num_experts:
            graphs_backend = cuda_graphs.select_backend(device, options, graph_backend)
            if graphs_backend is not None and masks:
                log.info("CUDA graphs off: the captured decode step has no %s", masks)
                graphs_backend = None
        # With graphs: one scratch block past the pool's ids, for padded rows' K/V writes.
        self.scratch_block: int | None = num_blocks if graphs_backend is not None else None
        self.pool_blocks = num_blocks + (1 if graphs_backend is not None else 0)  # blocks in the KV tensors
        shape = kv_cache_shape(self.pool_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_heads = cfg.num_key_value_heads
        self.kv_caches: list[tuple[torch.Tensor, ...]] = (
            quantized_pool_tensors(cfg.num_hidden_layers, shape, kv_dtype, device, options.huge_pages) if quantized
            else kv_pool_tensors(cfg.num_hidden_layers, shape, kv_dtype, device, options.huge_pages))  # type: ignore
        self.attention = select_attention_backend(device, dtype, cfg.num_attention_heads, cfg.num_key_value_heads,
                                                  self.pool_blocks, options, kernels.library, cfg.head_dim,
                                                  kv_dtype=kv_dtype, windowed=windowed, softcapped=softcapped)
        self.graphs = (cuda_graphs.DecodeGraphRunner(model, self.kv_caches, block_size, num_blocks, dtype, device,
                                                     graphs_backend, self.attention, options.cuda_graph_max_batch)
                       if graphs_backend is not None else None)
        self.fused: fused_decode.FusedDecoder | None = None
        if (not eager_only and device.type == "cpu" and kernels.library is not None and options.fused_decode):
            # Small pure-decode batches on CPU: every layer in one native call.
            self.fused = fused_decode.build(model, self.kv_caches, kernels.library, options.fused_decode_max_batch)
        self.executors: list[StepExecutor] = []
        if self.graphs is not None:
            self.executors.append(CudaGraphExecutor(self.graphs))
        if self.fused is not None:
            self.executors.append(FusedDecodeExecutor(self, self.fused))
            # Prefill chunks too where the eager forward would run the same kernels (the
            # saved dispatch is the gain; FusedDecoder.prefill_on_kernels) and the pool is
            # not quantized (its store requantizes a chunk's rows together).
            if options.fused_prefill and self.fused.prefill_on_kernels and not quantized:
                self.executors.append(FusedPrefillExecutor(self, self.fused))
        self.executors.append(EagerExecutor(self))

    @property
    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.kv_caches for t in layer)

    def prepare(self, step: StepBatch | StepItems) -> StepInputs:
        """The step flattened for the model's forward, decodes first (the attention kernel
        batches them); block tables padded with 0."""
        batch = StepBatch.of(step).decodes_first()
        bs = self.block_size
        slots: list[int] = []
        prompt_rows: list[prompt_logprobs.PromptRows] = []
        first = 0
        for seq in batch.seqs:
            plan = prompt_logprobs.plan_rows(seq.request, seq.start, seq.end, first)
            if plan is not None:
                prompt_rows.append(plan)
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(seq.start, seq.end))
            first += seq.num_new
        # A 1-token prefill chunk is treated as a decode: same math.
        max_blocks = max(len(seq.block_table) for seq in batch.seqs)
        tables = torch.tensor([seq.block_table + (0,) * (max_blocks - len(seq.block_table)) for seq in batch.seqs],
                              dtype=torch.long)
        dev = self.device
        layout = StepLayout(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=tables.to(dev),
            seq_lens=[seq.end for seq in batch.seqs],
            query_lens=[seq.num_new for seq in batch.seqs],
            num_decodes=batch.num_single,
            block_size=bs,
        )
        return StepInputs(
            input_ids=torch.tensor(batch.token_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(batch.positions, dtype=torch.long, device=dev),
            attn=self.attention.prepare(layout),
            logits_rows=torch.tensor(batch.logits_rows, dtype=torch.long, device=dev),
            sampled=batch.sampled_requests,
            prompt_rows=prompt_rows,
            lora_segments=batch.adapter_segments,
        )

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
        inputs = self.prepare(step)
        if inputs.lora_segments:
            assert self.lora is not None, "a step with adapter rows on a model without LoRA"
            self.lora.begin_step(inputs.lora_segments)
            try:
                hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn)
            finally:
                self.lora.end_step()
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn)
        for request, entries in prompt_logprobs.compute(self.model, hidden, inputs.prompt_rows):
            request.prompt_logprobs.extend(entries)
        if not inputs.sampled:
            return torch.empty((0, self.model.config.vocab_size)), []
        logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_rows))
        return logits, inputs.sampled

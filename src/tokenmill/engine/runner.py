"""Builds the flattened batch for one step and runs the model on it.

The runner owns the KV pool tensors (allocated once, from a memory budget; on
CPU one allocation on huge pages, see host_memory.py)
and turns a scheduled batch into: token ids, positions, a slot for each new
token's K/V, padded block tables, and the row of each sequence whose logits
are sampled. Prefill chunks and decodes go through one forward pass.

On CUDA, pure-decode steps replay captured CUDA graphs (``cuda_graphs.py``);
the pool then holds one extra block, past the ids the block pool hands out,
that padded graph rows write into.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import ModelConfig
from ..model import cpu_kernels, fused_decode, kv_quant
from ..model.attention import (AttentionMetadata, decode_index, decode_mask, kernel_decode_tables,
                               kv_cache_shape)
from ..model.llama import LlamaForCausalLM
from . import cuda_graphs, prompt_logprobs
from .host_memory import kv_pool_tensors
from .request import Request, decode_rows


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
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # [S] rows of the hidden states to sample from
    sampled: list[Request]  # the requests those rows belong to, in order
    prompt_rows: list[prompt_logprobs.PromptRows] = field(default_factory=list)  # requests scoring their prompt


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device,
                 graph_backend: cuda_graphs.GraphBackend | None = None, eager_only: bool = False,
                 kv_dtype: torch.dtype | None = None) -> None:
        """``num_blocks``: the blocks the block pool hands out. ``graph_backend``: record
        decode steps with it (tests inject a CPU stand-in); by default CUDA graphs on CUDA.
        ``eager_only``: neither the fused CPU decode step nor CUDA graphs (tensor parallelism).
        ``kv_dtype``: the pool's dtype, by default ``dtype``; int8 / float8_e4m3fn store
        codes with per-block scales (model/kv_quant.py; no CUDA graphs: the store's
        requantization has data-dependent shapes)."""
        kv_dtype = kv_dtype or dtype
        quantized = kv_quant.is_quantized(kv_dtype)
        cfg = model.config
        assert cfg.head_dim is not None
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        backend = None if eager_only or quantized else cuda_graphs.select_backend(device, dtype, graph_backend)
        # With graphs: one scratch block past the pool's ids, for padded rows' K/V writes.
        self.scratch_block: int | None = num_blocks if backend is not None else None
        self.pool_blocks = num_blocks + (1 if backend is not None else 0)  # blocks in the KV tensors
        shape = kv_cache_shape(self.pool_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_heads = cfg.num_key_value_heads
        self.kv_elements_per_block = block_size * cfg.num_key_value_heads * cfg.head_dim
        self.kv_caches: list[tuple[torch.Tensor, ...]] = (
            kv_quant.pool_tensors(cfg.num_hidden_layers, shape, kv_dtype, device) if quantized
            else kv_pool_tensors(cfg.num_hidden_layers, shape, dtype, device))  # type: ignore[assignment]
        self.dtype = dtype
        self.kv_dtype = kv_dtype
        # Flat decode gather buffers, reused by every layer and step; grown (never shrunk) on demand.
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None
        # Compile (first run on this machine) or load the CPU decode kernel now, not in the first step.
        cpu_kernels.decode_kernel_usable(device, kv_dtype)
        # Small pure-decode batches on CPU: every layer in one native call (model/fused_decode.py).
        self.fused = fused_decode.build(model, self.kv_caches) if device.type == "cpu" and not eager_only else None
        self.graphs = (cuda_graphs.DecodeGraphRunner(model, self.kv_caches, block_size, num_blocks, dtype, device,
                                                     backend) if backend is not None else None)

    def _decode_workspace(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        ws = self._workspace
        need = num_blocks * self.kv_elements_per_block
        if ws is None or ws[0].numel() < need:
            size = max(num_blocks + num_blocks // 4, 64) * self.kv_elements_per_block
            ws = (torch.empty(size, dtype=self.dtype, device=self.device),
                  torch.empty(size, dtype=self.dtype, device=self.device))
            self._workspace = ws
        return ws

    @property
    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.kv_caches for t in layer)

    def prepare(self, items: list[tuple[Request, int]]) -> StepInputs:
        # Decodes (one new token) first: the attention kernel batches them.
        items = sorted(items, key=lambda item: item[1] != 1)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_lens: list[int] = []
        logits_rows: list[int] = []
        sampled: list[Request] = []
        prompt_rows: list[prompt_logprobs.PromptRows] = []
        bs = self.block_size
        for request, num_new in items:
            start = request.num_computed_tokens
            end = start + num_new
            plan = prompt_logprobs.plan_rows(request, start, end, len(ids))
            if plan is not None:
                prompt_rows.append(plan)
            ids.extend(request.step_token_ids(start, num_new))
            positions.extend(range(start, end))
            table = request.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            seq_lens.append(end)
            query_lens.append(num_new)
            if request.spec_token_ids:  # a speculative verify: every row's logits are checked
                logits_rows.extend(range(len(ids) - num_new, len(ids)))
                sampled.extend([request] * num_new)
            elif end == request.num_tokens and request.samples:  # the chunk reaches the end: sample
                logits_rows.append(len(ids) - 1)
                sampled.append(request)
        num_decodes = sum(1 for q in query_lens if q == 1)
        # A 1-token prefill chunk is treated as a decode: same math.
        max_blocks = max(len(r.block_table) for r, _ in items)
        tables = torch.tensor([r.block_table + [0] * (max_blocks - len(r.block_table)) for r, _ in items],
                              dtype=torch.long)
        dev = self.device
        decode_lens = seq_lens[:num_decodes]
        decode_blocks = -(-max(decode_lens, default=0) // bs)
        workspace = None
        kernel = bool(num_decodes) and cpu_kernels.decode_kernel_usable(dev, self.kv_dtype)
        if num_decodes and not kernel:
            workspace = self._decode_workspace(num_decodes * decode_blocks)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=tables.to(dev),
            seq_lens=seq_lens,
            query_lens=query_lens,
            num_decodes=num_decodes,
            block_size=bs,
            decode_blocks=decode_blocks,
            decode_workspace=workspace,
        )
        # Per-step decode metadata, built once here for every layer: the C kernel reads
        # the pool in place from int32 tables; the torch fallback needs a mask and a
        # gather index into the workspace.
        if kernel:
            kernel_decode_tables(meta)
        elif num_decodes:
            decode_mask(meta, self.dtype, dev)
            decode_index(meta, self.kv_heads, self.pool_blocks)
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            meta=meta,
            logits_rows=torch.tensor(logits_rows, dtype=torch.long, device=dev),
            sampled=sampled,
            prompt_rows=prompt_rows,
        )

    @torch.inference_mode()
    def execute(self, items: list[tuple[Request, int]]) -> tuple[torch.Tensor, list[Request]]:
        """Run one forward pass; return float32 logits of the sampled rows and their requests.
        Requests that asked for prompt logprobs get this step's appended to
        ``Request.prompt_logprobs``."""
        if any(r.wants_prompt_logprobs or not r.samples for r, _ in items):
            # Hidden states of prompt rows (or no sampled row) are needed: the
            # general path, never a graph replay or the fused decode.
            return self._execute_eager(items)
        if self.graphs is not None:
            replayed = self.graphs.try_execute(items)
            if replayed is not None:
                return replayed
        if (self.fused is not None and sum(n for _, n in items) <= self.fused.batch_limit()
                and all(n == 1 + len(r.spec_token_ids) for r, n in items) and fused_decode.enabled()):
            return self._execute_fused(items)
        return self._execute_eager(items)

    def _execute_eager(self, items: list[tuple[Request, int]]) -> tuple[torch.Tensor, list[Request]]:
        inputs = self.prepare(items)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        for request, entries in prompt_logprobs.compute(self.model, hidden, inputs.prompt_rows):
            request.prompt_logprobs.extend(entries)
        if not inputs.sampled:
            return torch.empty((0, self.model.config.vocab_size)), []
        logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_rows))
        return logits, inputs.sampled

    def _execute_fused(self, items: list[tuple[Request, int]]) -> tuple[torch.Tensor, list[Request]]:
        """One new token per sequence (plus its speculative proposals, one row each),
        through the fused native decode step."""
        assert self.fused is not None
        ids, positions, owners, rows, sampled = decode_rows(items)
        seq_lens = [position + 1 for position in positions]
        width = max(len(request.block_table) for request, _ in items)
        # -1 padding: a table shorter than its sequence needs is refused by the kernel
        # (ValueError before anything is written), never read as block 0.
        tables = [request.block_table + [-1] * (width - len(request.block_table)) for request in owners]
        embeddings = self.model.embed_tokens(torch.tensor(ids, dtype=torch.long)).float().contiguous()
        logits = self.fused.run(embeddings, torch.tensor(tables, dtype=torch.int32),
                                torch.tensor(seq_lens, dtype=torch.int32))
        if len(rows) != len(ids):
            logits = logits[rows]
        return logits, sampled

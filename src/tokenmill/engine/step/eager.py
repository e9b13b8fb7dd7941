"""The eager step: one step's batch flattened for the model's forward, and what runs around it.

Every step no other executor takes runs here, on one device and under tensor
parallelism alike: ``prepare`` flattens the batch decodes first (token ids,
positions, the step layout the attention backend prepares, the rows whose
logits are sampled, the requests scoring their prompt, each LoRA adapter's
rows); ``run`` runs the forward with the step's adapters, appends the
prompt logprobs of requests that asked for them, and returns the sampled
rows' logits. A tensor-parallel group adds one thing, through ``LayoutShare``:
before the forward, the driver hands the step's layout to the other ranks,
which ``follow`` it through the same forward and the same logit calls (every
one of them a collective there).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ...model.attention import AttentionBackend, StepAttention, StepLayout
from ...model.lora.lora import LoraState
from ...model.models.llama import LlamaForCausalLM
from ..request import Request
from . import prompt_logprobs
from .step_batch import StepBatch

StepItems = list[tuple[Request, int]]  # what the scheduler gives out; the runner builds a StepBatch of it
StepResult = tuple[torch.Tensor, list[Request]]


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: StepAttention  # the step's layout, prepared by the attention backend for every layer
    logits_rows: torch.Tensor  # [S] rows of the hidden states to sample from
    sampled: list[Request]  # the requests those rows belong to, in order
    prompt_rows: list[prompt_logprobs.PromptRows] = field(default_factory=list)  # requests scoring their prompt
    lora_segments: list[tuple[int, int, int]] = field(default_factory=list)  # (adapter, first row, end row)


class LayoutShare(Protocol):
    """What a parallel group adds to the eager step: the step's layout handed to the other
    ranks before the forward, so that they run the same collectives."""

    def share(self, inputs: StepInputs) -> None: ...


class EagerStep:
    """The model's forward over a flattened step, on the runner's KV pool and attention backend."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, ...]],
                 attention: AttentionBackend, block_size: int, device: torch.device,
                 lora: LoraState | None, group: LayoutShare | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.attention = attention
        self.block_size = block_size
        self.device = device
        self.lora = lora
        self.group = group  # chosen once: None on one device and on the workers of a group

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

    def run(self, step: StepBatch | StepItems) -> StepResult:
        """Float32 logits of the sampled rows and their requests; requests that asked for
        prompt logprobs get this step's appended to ``Request.prompt_logprobs``."""
        inputs = self.prepare(step)
        if self.group is not None:
            self.group.share(inputs)
        hidden = self.forward(inputs)
        for request, entries in prompt_logprobs.compute(self.model, hidden, inputs.prompt_rows):
            request.prompt_logprobs.extend(entries)
        if not inputs.sampled:
            return torch.empty((0, self.model.config.vocab_size)), []
        return self.model.compute_logits(hidden.index_select(0, inputs.logits_rows)), inputs.sampled

    def follow(self, inputs: StepInputs, prompt_spans: list[tuple[int, int]]) -> None:
        """A worker rank's part of the step the driver ``run``s: the same forward, the same
        prompt-logprob logit chunks (``prompt_spans``: each scoring request's first row and
        row count) and the sampled rows' logits, in the same order; the driver keeps the
        answers."""
        hidden = self.forward(inputs)
        prompt_logprobs.follow(self.model, hidden, prompt_spans)
        if inputs.logits_rows.numel():
            self.model.compute_logits(hidden.index_select(0, inputs.logits_rows))

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Every row's hidden state; the step's adapters applied to their rows."""
        if not inputs.lora_segments:
            return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn)
        assert self.lora is not None, "a step with adapter rows on a model without LoRA"
        self.lora.begin_step(inputs.lora_segments)
        try:
            return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn)
        finally:
            self.lora.end_step()

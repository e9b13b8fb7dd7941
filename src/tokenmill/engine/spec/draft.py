"""Draft-model proposals for speculative decoding.

A small model with the target's vocabulary runs greedily for K tokens per
sequence; the target then checks them in one step (``speculative.py``). The
draft keeps its own paged KV pool and, per target request, a shadow request
holding the same tokens. Before each proposal the shadow takes the target's
tokens as they now are and keeps its cached K/V only up to the first token
where the two differ (rejected proposals), so one catch-up chunk plus K - 1
single-token steps, batched over every proposing sequence, make the
proposals. Shadows of finished requests give their blocks back on the next
proposal; a shadow the draft pool cannot grow simply makes no proposal.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ...settings.config import EngineConfig, parse_size
from ...model.loader import load_model
from ..kv.block_pool import BlockPool
from ..request import Request, RequestStatus, SamplingParams
from ..step.executors import Kernels
from ..loading import build_model
from ..step.runner import ModelRunner, num_blocks_for_budget

_GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


class DraftModelProposer:
    def __init__(self, model_path: str, kv_cache_memory: str | int, target_vocab: int, device: torch.device,
                 max_len: int, block_size: int, kernels: Kernels) -> None:
        loaded = load_model(model_path, dtype=torch.float32)
        if loaded.config.vocab_size != target_vocab:
            raise ValueError(f"the draft model's vocabulary ({loaded.config.vocab_size} tokens) differs from the "
                             f"target's ({target_vocab}); a draft must share the target's tokenizer")
        self.block_size = block_size
        self.model = build_model(loaded, EngineConfig(), device, torch.float32, max_len)
        budget = parse_size(kv_cache_memory) or (512 << 20)
        num_blocks = num_blocks_for_budget(loaded.config, block_size, torch.float32, budget)
        self.pool = BlockPool(num_blocks)
        self.runner = ModelRunner(self.model, num_blocks, block_size, torch.float32, device, kernels)
        self._shadows: dict[int, tuple[Any, Request]] = {}  # id(target) -> (target, shadow)

    def _collect(self) -> None:
        """Give back the blocks of shadows whose target has finished."""
        for key, (target, shadow) in list(self._shadows.items()):
            if target.status is RequestStatus.FINISHED:
                self.pool.release(shadow.block_table)
                del self._shadows[key]

    def _shadow(self, target: Any) -> Request:
        """The target's shadow, holding its tokens now, K/V kept up to their first difference."""
        entry = self._shadows.get(id(target))
        if entry is None or entry[0] is not target:
            shadow = Request(f"draft-{target.request_id}", list(target.prompt_token_ids), _GREEDY)
            shadow.output_token_ids = list(target.output_token_ids)
            self._shadows[id(target)] = (target, shadow)
            return shadow
        shadow = entry[1]
        old, new = shadow.output_token_ids, target.output_token_ids
        same = len(shadow.prompt_token_ids)
        for a, b in zip(old, new):
            if a != b:
                break
            same += 1
        shadow.output_token_ids = list(new)
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, same, shadow.num_tokens - 1)
        return shadow

    def _grow(self, shadow: Request, tokens: int) -> bool:
        need = -(-tokens // self.block_size) - len(shadow.block_table)
        if need > self.pool.num_available:
            return False
        if need > 0:
            shadow.block_table.extend(self.pool.allocate(need))
        return True

    @torch.inference_mode()
    def propose(self, requests: Sequence[Any], ks: Sequence[int]) -> list[list[int]]:
        self._collect()
        shadows: list[Request | None] = []
        for target, k in zip(requests, ks):
            shadow = self._shadow(target)
            shadows.append(shadow if self._grow(shadow, shadow.num_tokens + k) else None)
        drafts: list[list[int]] = [[] for _ in requests]
        live = [i for i, s in enumerate(shadows) if s is not None]
        first = True
        while live:
            items = []
            for i in live:
                shadow = shadows[i]
                assert shadow is not None
                items.append((shadow, shadow.num_tokens - shadow.num_computed_tokens if first else 1))
            logits, sampled = self.runner.execute(items)
            picks = logits.argmax(dim=-1).tolist()
            by_shadow = {id(s): t for s, t in zip(sampled, picks)}
            for shadow, num_new in items:
                shadow.num_computed_tokens += num_new
            still = []
            for i in live:
                shadow = shadows[i]
                assert shadow is not None
                drafts[i].append(by_shadow[id(shadow)])
                shadow.output_token_ids.append(drafts[i][-1])
                if len(drafts[i]) < ks[i]:
                    still.append(i)
            live = still
            first = False
        return drafts

"""Offline API, shaped like vLLM's so users already know it.

    from tokenmill import LLM, SamplingParams
    llm = LLM(dtype="float32")
    outs = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))
    print(outs[0].outputs[0].text)

Prompt logprobs go through the same engine step as generation:
``SamplingParams(prompt_logprobs=N)`` fills ``RequestOutput.prompt_logprobs``
(one entry per prompt token, None first); with ``max_tokens=0`` nothing is
generated, which is what ``score`` does.
"""
from __future__ import annotations

import itertools
import time
from typing import Any, Sequence

from ..settings.config import EngineConfig
from ..engine.engine import LLMEngine, SequenceDelta
from ..engine.request import CompletionOutput, RequestOutput, SamplingParams
from ..model.sampler import Logprob


def vllm_options(options: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``LLM(...)`` keywords in tokenmill's terms, with the same meanings as
    `tokenmill serve`'s flags of those names (serve_config.py)."""
    import os

    from ..settings.cli_args import human_int
    from .cli.serve_config import apply_memory_share, resolve_dtype

    out = dict(options)
    device = out.get("device", "cpu")
    out["dtype"] = resolve_dtype(str(out.get("dtype", "auto")), device)
    if "kv_cache_memory_bytes" in out:
        out["kv_cache_memory"] = out.pop("kv_cache_memory_bytes")
    if isinstance(out.get("max_model_len"), str):
        out["max_model_len"] = human_int(out["max_model_len"])
    out["tensor_parallel_size"] = int(out.get("tensor_parallel_size", 1) or 1)
    apply_memory_share(out, out.pop("gpu_memory_utilization", None), device)
    if out.pop("enforce_eager", False):
        from ..settings.options import KernelOptions

        out["kernel_options"] = KernelOptions.from_env().replace(cuda_graphs=False)
    out.pop("trust_remote_code", None)  # no code from model folders is ever run
    return out


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "float32", **engine_options: Any) -> None:
        """``dtype`` defaults to float32, where `tokenmill serve` defaults to ``auto``: the
        offline API is what scripts and tests compare against Hugging Face transformers, and
        float32 with no quantization is the exact reference, the same tokens on every
        machine; a server wants this machine's fastest sound choice (engine/auto.py).
        ``dtype="auto"`` (and ``quantization="auto"``) gives an ``LLM`` the server's choice."""
        loaded = engine_options.pop("loaded_model", None)
        tokenizer = engine_options.pop("tokenizer", None)
        if isinstance(tokenizer, str):  # vLLM's tokenizer=PATH
            from ..files.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_model_path(tokenizer)
        options = vllm_options(dict(engine_options, dtype=dtype))
        config = EngineConfig.from_options(model=model, **options)
        self.engine = LLMEngine(config, loaded=loaded, tokenizer=tokenizer)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        self._adapter_ids = itertools.count(1)
        self.adapters: dict[str, int] = {}  # LoRA adapters by name (enable_lora=True)

    def load_lora(self, name: str, path: str) -> int:
        """Load an adapter (a PEFT folder or a GGUF LoRA file) under ``name`` (resident until
        ``unload_lora``); its id."""
        from ..engine.adapters import read_adapter

        if self.engine.lora is None:
            raise ValueError("LoRA adapters need enable_lora=True")
        if name in self.adapters:
            raise ValueError(f"an adapter named {name!r} is already loaded")
        weights = read_adapter(self.engine.lora, name, path, next(self._adapter_ids))
        self.engine.lora.install(weights)
        self.adapters[name] = weights.adapter_id
        return weights.adapter_id

    def unload_lora(self, name: str) -> None:
        adapter_id = self.adapters.pop(name)
        assert self.engine.lora is not None
        self.engine.lora.remove(adapter_id)

    def generate(
        self,
        prompts: str | list[int] | Sequence[str] | Sequence[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion, continuously batched.
        ``lora``: the loaded adapter (by name) to run every prompt with, or one per prompt
        (None: the base model)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (list(sampling_params) if isinstance(sampling_params, Sequence)
                       else [sampling_params] * len(prompts))
        if len(params_list) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        loras = list(lora) if lora is not None and not isinstance(lora, str) else [lora] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError("give one adapter name, or one per prompt")
        unknown = sorted({n for n in loras if n is not None and n not in self.adapters})
        if unknown:
            raise ValueError(f"LoRA adapters {unknown} are not loaded")
        outputs: dict[str, RequestOutput] = {}
        order: list[str] = []
        for prompt, params, name in zip(prompts, params_list, loras):
            rid = f"offline-{next(self._ids)}"
            reqs = self.engine.add_request(rid, prompt, params, adapter=self.adapters[name] if name else 0)
            order.append(rid)
            outputs[rid] = RequestOutput(
                request_id=rid, prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=list(reqs[0].prompt_token_ids),
                outputs=[CompletionOutput(index=i, text="", token_ids=[],
                                          logprobs=[] if params.logprobs is not None else None)
                         for i in range(params.n)])
        while self.engine.has_unfinished():
            deltas = self.engine.step()
            if not deltas and not self.engine.num_running:
                time.sleep(0.001)  # a batching policy is waiting for its window
            for delta in deltas:
                _apply_delta(outputs[delta.request_id], delta)
        return [outputs[rid] for rid in order]

    def score(self, prompts: str | list[int] | Sequence[str] | Sequence[list[int]],
              top: int = 0) -> list[list[Logprob | None]]:
        """Log-probabilities of each prompt's own tokens (None for the first), without generating."""
        params = SamplingParams(max_tokens=0, prompt_logprobs=top, temperature=0.0)
        return [out.prompt_logprobs or [] for out in self.generate(prompts, params)]

    def close(self) -> None:
        """Stop tensor-parallel worker processes (a no-op on one device)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [self.tokenizer.apply_chat_template(conv, add_generation_prompt=True)  # type: ignore[arg-type]
                   for conv in conversations]
        token_lists = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        results = self.generate(token_lists, sampling_params)
        for result, text in zip(results, prompts):
            result.prompt = text
        return results


def _apply_delta(out: RequestOutput, delta: SequenceDelta) -> None:
    completion = out.outputs[delta.index]
    completion.text += delta.text
    completion.token_ids.extend(delta.token_ids)
    if completion.logprobs is not None:
        completion.logprobs.extend(delta.logprobs)
    if delta.prompt_logprobs is not None and out.prompt_logprobs is None:
        out.prompt_logprobs = delta.prompt_logprobs
    out.num_cached_tokens = max(out.num_cached_tokens, delta.num_cached_tokens)
    if delta.finished:
        completion.finish_reason = delta.finish_reason
        completion.stop_reason = delta.stop_reason
        out.metrics = delta.metrics
        out.finished = all(c.finish_reason is not None for c in out.outputs)

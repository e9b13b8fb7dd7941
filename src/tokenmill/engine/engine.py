"""LLMEngine.step(): schedule -> run -> sample -> detokenize -> outputs.

The engine is synchronous and single-threaded; the async wrapper drives it
from its own thread. Requests with ``n > 1`` become n sequences sharing one
request id (``<id>`` and index); each step returns, per sequence that changed,
a ``SequenceDelta`` with the new tokens and text since the last step.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any
from typing import TYPE_CHECKING

import torch

from ..config import EngineConfig, parse_dtype
from ..model.kv_quant import is_quantized, resolve_kv_dtype
from ..model.llama import LlamaForCausalLM, RotaryEmbedding
from ..model.loader import LoadedModel, load_model
from ..model.sampler import Logprob, sample
from ..tokenizer import Tokenizer
from . import auto
from .block_pool import BlockPool
from .detokenizer import IncrementalDetokenizer
from .prefix_cache import PrefixCache
from .request import Request, RequestStatus, SamplingParams
from .executors import Kernels, choose_kernels
from .runner import ModelRunner, num_blocks_for_budget
from .scheduler import Scheduler
from .speculative import SpeculativeConfig, Speculator
from .stats import EngineStats, SpecSnapshot
from .structured import StructuredOutputs

if TYPE_CHECKING:
    from .distributed import TensorParallelGroup

log = logging.getLogger("tokenmill.engine")


@dataclass
class SequenceDelta:
    """What changed for one sequence in one step."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[Logprob]
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    metrics: dict[str, float] = field(default_factory=dict)
    # Once per sequence, in the first delta after the whole prompt is scored
    # (requests with SamplingParams.prompt_logprobs): one entry per prompt token, None first.
    prompt_logprobs: list[Logprob | None] | None = None


@dataclass(eq=False)
class _Sequence:
    request: Request
    index: int
    detok: IncrementalDetokenizer
    sent_tokens: int = 0
    sent_prompt_logprobs: bool = False


@dataclass
class StepStats:
    """Figures of the last step, for metrics."""

    num_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_preempted: int = 0
    duration_s: float = 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
        self.device = torch.device(config.device)
        config.scheduler.max_num_batched_tokens = config.scheduler.token_budget(self.device.type)
        dtype_choice = auto.resolve_dtype(config.dtype, self.device,
                                          auto.int8_compute(config.quantization, self.device, config.kernel_options))
        config.dtype = dtype_choice[0]
        self.dtype = parse_dtype(config.dtype)
        # Tensor parallelism: workers started, this process is rank 0 and holds its shard only.
        self.parallel: TensorParallelGroup | None = None
        if config.tensor_parallel_size > 1:
            from .distributed import TensorParallelGroup

            self.parallel = TensorParallelGroup.start(config, loaded)
            loaded = self.parallel.loaded
        loaded = loaded or load_model(config.model, dtype=self.dtype)
        quant_choice = auto.resolve_quantization(config.quantization, loaded, self.device, config.kernel_options)
        config.quantization = quant_choice[0]
        kv_choice = auto.resolve_kv_cache_dtype(config.cache.kv_cache_dtype, config.quantization, self.dtype,
                                                self.device, config.tensor_parallel_size > 1)
        config.cache.kv_cache_dtype = kv_choice[0]
        if dtype_choice[1] != "as asked" or quant_choice[1] != "as asked":
            log.info("chosen for this machine: %s", auto.describe(dtype_choice, quant_choice, kv_choice))
        self.model_config = loaded.config
        self.tokenizer = tokenizer or Tokenizer.from_model_path(config.model)
        cfg = loaded.config
        max_len = config.scheduler.max_model_len or cfg.max_position_embeddings
        self.max_model_len = max_len
        calibration = None
        if str(config.quantization).lower() == "w8a8":  # int8 activations: smooth first
            from ..model.smoothquant import calibration_text

            calibration = self.tokenizer.encode(calibration_text())
        # What steps run on (C kernels or torch, the model's ops), decided once, here.
        self.kernels = choose_kernels(self.device, config.kernel_options)
        model = build_model(loaded, config, self.device, self.dtype, max_len, calibration, self.parallel,
                            self.kernels)
        self.model = model
        model.use_ops(self.kernels.ops)  # now, so that layouts the kernels read count as weights
        self.weight_bytes = _weight_bytes(model)

        cache_cfg = config.cache
        block_size = cache_cfg.block_size
        kv_budget = cache_cfg.kv_cache_memory
        if kv_budget is None and config.memory_budget is not None:
            kv_budget = config.memory_budget - self.weight_bytes
            if kv_budget <= 0:
                raise ValueError(f"memory budget {config.memory_budget} bytes does not hold the weights "
                                 f"({self.weight_bytes} bytes)")
        self.kv_dtype = resolve_kv_dtype(cache_cfg.kv_cache_dtype, self.dtype)
        if self.kv_dtype != self.dtype and self.parallel is not None:
            raise ValueError(f"kv_cache_dtype {cache_cfg.kv_cache_dtype} is not supported with tensor parallelism "
                             "yet; use auto")
        num_blocks = cache_cfg.num_blocks or num_blocks_for_budget(
            cfg, block_size, self.kv_dtype, kv_budget or _default_kv_budget(cache_cfg.kv_cache_fraction, self.device))
        if config.cap_kv_pool and not cache_cfg.num_blocks and not cache_cfg.kv_cache_memory:
            reachable = -(-config.scheduler.max_num_seqs * max_len // block_size) + 1
            num_blocks = min(num_blocks, reachable)
        self.block_size = block_size
        self.prefix_cache = PrefixCache(block_size) if cache_cfg.enable_prefix_caching else None
        self.pool = BlockPool(num_blocks, self.prefix_cache)
        self.scheduler = Scheduler(config.scheduler, block_size, self.pool, self.prefix_cache,
                                   device_type=self.device.type)
        self.runner = (ModelRunner(model, num_blocks, block_size, self.dtype, self.device, self.kernels,
                                   kv_dtype=self.kv_dtype)
                       if self.parallel is None else
                       self.parallel.make_runner(model, num_blocks, block_size, self.dtype, self.device, self.kernels))
        log.info("steps run on: %s", ", ".join(e.name for e in self.runner.executors))
        # Uniform draws happen on the CPU (model/sampler.py), so generators live there on
        # any device: a CUDA generator would be refused by torch.rand there, and a seed
        # then gives the same draws on CPU and GPU.
        self.generator = torch.Generator()
        self.generator.manual_seed(config.seed)
        self.structured = StructuredOutputs(self.tokenizer, cfg.vocab_size, sorted(self.tokenizer.eos_token_ids),
                                            limits=config.grammar_limits)
        self._groups: dict[str, list[_Sequence]] = {}
        self._by_request: dict[int, _Sequence] = {}
        self.last_step = StepStats()
        self.total_preemptions = 0
        spec = SpeculativeConfig.parse(config.speculative_config)
        self.speculator: Speculator | None = None
        if spec is not None:
            proposer = None
            if spec.method == "draft_model":
                from .draft import DraftModelProposer

                assert spec.model is not None
                proposer = DraftModelProposer(spec.model, spec.draft_kv_cache_memory, cfg.vocab_size, self.device,
                                              max_len, block_size, self.kernels)
            self.speculator = Speculator(spec, proposer, grammar_eos=self.tokenizer.eos_token_ids)
        self._steps = 0
        self.stats = EngineStats()
        self._publish()

    # -- requests ------------------------------------------------------
    def encode_prompt(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> list[Request]:
        """Queue a request (n sequences). Raises ValueError for what cannot run."""
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already running")
        token_ids = self.encode_prompt(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.stop_token_ids or []):
            raise ValueError(f"stop_token_ids must be in [0, {vocab})")
        room = self.max_model_len - len(token_ids)
        if room < (0 if params.max_tokens == 0 else 1):
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens; this model's context length is {self.max_model_len}")
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                f"context length {self.max_model_len}")
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        eos = frozenset() if params.ignore_eos else frozenset(self.tokenizer.eos_token_ids)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        group: list[_Sequence] = []
        for index in range(params.n):
            req = Request(request_id=f"{request_id}#{index}", prompt_token_ids=token_ids, params=params,
                          arrival_time=arrival, eos_token_ids=eos, max_tokens=max_tokens)
            if params.structured is not None:
                req.grammar = self.structured.compile(params.structured)  # GrammarError is a ValueError
            if params.prompt_logprobs is not None:
                req.prompt_logprobs = [None]  # the first token has no context
            if params.seed is not None:
                req.generator = torch.Generator()  # on the CPU, like the engine's (see __init__)
                req.generator.manual_seed(params.seed + index)
            detok = IncrementalDetokenizer(self.tokenizer.backend, params.skip_special_tokens,
                                           params.stop, params.include_stop_str_in_output)  # type: ignore[arg-type]
            group.append(_Sequence(req, index, detok))
        for seq in group:
            self.scheduler.add(seq.request)  # raises before anything is registered if it can never fit
        self._groups[request_id] = group
        for seq in group:
            self._by_request[id(seq.request)] = seq
        self._publish()
        return [s.request for s in group]

    def abort_request(self, request_id: str) -> bool:
        """Finish every sequence of a request now; idempotent."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        for seq in group:
            self.scheduler.abort(seq.request)
            self._by_request.pop(id(seq.request), None)
        self._publish()
        return True

    def has_unfinished(self) -> bool:
        return bool(self._groups)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- the step ------------------------------------------------------
    def step(self) -> list[SequenceDelta]:
        started = time.monotonic()
        if self.speculator is not None:
            self.speculator.propose([r for r in self.scheduler.running if r.num_tokens - r.num_computed_tokens == 1])
        batch = self.scheduler.schedule(started)
        self.total_preemptions += len(batch.preempted)
        self._steps += 1
        if not batch:
            self.last_step = StepStats(num_preempted=len(batch.preempted))
            self._publish()
            return []
        # Grammar masks depend only on tokens already accepted (and this step's proposals):
        # compute them while the forward pass runs.
        constrained = [r for r, n in batch.items if r.grammar is not None
                       and r.num_computed_tokens + n == r.num_tokens + len(r.spec_token_ids)]
        masks = self.structured.fill_step_async(constrained) if constrained else None
        try:
            logits, sampled = self.runner.execute(batch.items)  # and prompt logprobs, for requests that ask
        finally:
            mask = self.structured.wait(masks) if masks is not None else None
        self.scheduler.after_step(batch)
        # Rows of requests that ran speculative proposals are checked, the others sampled.
        plain_rows: list[int] = []
        checks: list[tuple[Request, int]] = []
        row = 0
        while row < len(sampled):
            req = sampled[row]
            if req.spec_token_ids:
                checks.append((req, row))
                row += 1 + len(req.spec_token_ids)
            else:
                plain_rows.append(row)
                row += 1
        plain = [sampled[i] for i in plain_rows]
        if checks and plain:
            logits_plain = logits.index_select(0, torch.tensor(plain_rows, device=logits.device))
        else:
            logits_plain = logits
        token_mask = None
        rows = [row for row, r in enumerate(plain) if r.grammar is not None]
        if rows:
            if mask is None or any(not mask.has(plain[row]) for row in rows):
                # the runner sampled a row the prediction missed: fill its masks now
                token_mask = (rows, self.structured.fill([plain[row].grammar for row in rows]))
            else:
                token_mask = (rows, mask.select([plain[row] for row in rows]))
        result = sample(logits_plain, plain, self.generator, token_mask, self.kernels.library) if plain else None
        now = time.monotonic()
        deltas: list[SequenceDelta] = []
        touched: list[_Sequence] = []
        if result is not None:
            for req, token, lp in zip(plain, result.token_ids, result.logprobs):
                seq = self._by_request[id(req)]
                self._append_token(seq, token, lp, now)
                touched.append(seq)
        for req, row in checks:
            assert self.speculator is not None
            count = 1 + len(req.spec_token_ids)
            rows_mask = None
            if req.grammar is not None:
                rows_mask = (mask.of(req, count) if mask is not None and mask.has(req)
                             else self.structured.fill_step([req], [req.spec_token_ids]).rows)
            tokens = self.speculator.verify(req, logits[row : row + count], self.generator, rows_mask)
            seq = self._by_request[id(req)]
            appended = 0
            for token in tokens:
                self._append_token(seq, token, None, now)
                appended += 1
                if req.is_finished:
                    break
            self.scheduler.accept_proposals(req, appended - 1)
            touched.append(seq)
        for req, _ in batch.items:  # max_tokens=0: done once the prompt is computed
            if not req.samples and not req.is_finished and req.num_computed_tokens >= req.num_prompt_tokens:
                self._finish(req, "length", None)
                touched.append(self._by_request[id(req)])
        for seq in touched:
            deltas.append(self._delta(seq, now))
        for seq in touched:
            if seq.request.is_finished:
                self._forget(seq)
        decode_tokens = sum(1 for _, n in batch.items if n == 1)
        self.last_step = StepStats(
            num_tokens=batch.num_tokens,
            num_prefill_tokens=batch.num_tokens - decode_tokens,
            num_decode_tokens=decode_tokens,
            num_preempted=len(batch.preempted),
            duration_s=now - started,
        )
        self._publish()
        return deltas

    def _append_token(self, seq: _Sequence, token: int, lp: Logprob | None, now: float) -> None:
        req = seq.request
        req.output_token_ids.append(token)
        if lp is not None:
            req.output_logprobs.append(lp)
        if req.first_token_time is None:
            req.first_token_time = now
        stop_str = seq.detok.add_token(token)
        params = req.params
        grammar_done = False
        if req.grammar is not None and token not in req.eos_token_ids:
            req.grammar.consume_token(token)
            # stopped: the grammar allows nothing more (not even more whitespace); error: cannot go on
            grammar_done = req.grammar.is_stopped() or req.grammar.is_error()
        if stop_str is not None:
            self._finish(req, "stop", stop_str)
        elif token in req.eos_token_ids:  # the sampler masks EOS until min_tokens
            self._finish(req, "stop", None)
        elif grammar_done:
            self._finish(req, "stop", None)
        elif token in (params.stop_token_ids or []):
            self._finish(req, "stop", token)
        elif len(req.output_token_ids) >= req.max_tokens:
            self._finish(req, "length", None)
        elif req.num_tokens >= self.max_model_len:
            self._finish(req, "length", None)

    def _finish(self, req: Request, reason: str, stop_reason: int | str | None) -> None:
        req.finish_reason = reason
        req.stop_reason = stop_reason
        self.scheduler.finish(req, reason)

    def _delta(self, seq: _Sequence, now: float) -> SequenceDelta:
        req = seq.request
        finished = req.is_finished
        new_tokens = req.output_token_ids[seq.sent_tokens :]
        new_logprobs = req.output_logprobs[seq.sent_tokens :] if req.params.logprobs is not None else []
        seq.sent_tokens = len(req.output_token_ids)
        prompt_lps = None
        if req.params.prompt_logprobs is not None and not seq.sent_prompt_logprobs and not req.wants_prompt_logprobs:
            prompt_lps = list(req.prompt_logprobs)
            seq.sent_prompt_logprobs = True
        metrics: dict[str, float] = {}
        if finished:
            metrics = {
                "arrival_time": req.arrival_time,
                "queue_time": (req.first_scheduled_time or now) - req.arrival_time,
                "ttft": (req.first_token_time or now) - req.arrival_time,
                "prefill_time": (req.first_token_time or now) - (req.first_scheduled_time or now),
                "e2e": now - req.arrival_time,
                "num_preemptions": req.num_preemptions,
            }
        group_id = req.request_id.rsplit("#", 1)[0]
        return SequenceDelta(
            request_id=group_id, index=seq.index, token_ids=new_tokens,
            text=seq.detok.take_delta(finished), logprobs=new_logprobs, finished=finished,
            finish_reason=req.finish_reason if finished else None,
            stop_reason=req.stop_reason if finished else None,
            num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=req.num_cached_tokens,
            metrics=metrics, prompt_logprobs=prompt_lps,
        )

    def _forget(self, seq: _Sequence) -> None:
        self._by_request.pop(id(seq.request), None)
        group_id = seq.request.request_id.rsplit("#", 1)[0]
        group = self._groups.get(group_id)
        if group is not None and all(s.request.is_finished for s in group):
            del self._groups[group_id]

    # -- published state -------------------------------------------------
    def _publish(self) -> None:
        """Replace ``self.stats`` with a snapshot of now (see engine/stats.py)."""
        pool, cache, spec = self.pool, self.prefix_cache, self.speculator
        self.stats = EngineStats(
            steps=self._steps, num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            blocks_total=pool.num_blocks, blocks_free=pool.num_free, blocks_in_use=pool.num_in_use,
            blocks_cached_idle=pool.num_cached_idle, prefix_cache_enabled=cache is not None,
            prefix_cached_blocks=cache.num_cached if cache is not None else 0,
            prefix_queried_tokens=cache.stats.queried_tokens if cache is not None else 0,
            prefix_hit_tokens=cache.stats.hit_tokens if cache is not None else 0,
            preemptions_total=self.total_preemptions,
            prompt_tokens_computed=self.scheduler.num_prompt_tokens_computed,
            spec=None if spec is None else SpecSnapshot(
                spec.stats.num_drafts, spec.stats.num_draft_tokens, spec.stats.num_accepted_tokens,
                tuple(spec.stats.accepted_per_position)))

    def close(self) -> None:
        """Stop tensor-parallel workers and grammar compile workers; idempotent."""
        self.structured.close()
        if self.parallel is not None:
            self.parallel.close()

    # -- cache admin -----------------------------------------------------
    def reset_prefix_cache(self) -> int:
        """Drop every idle cached block; returns how many were freed."""
        if self.prefix_cache is None:
            return 0
        freed = self.prefix_cache.evict_all_idle()
        for block in freed:
            self.pool.return_evicted(block)
        self._publish()
        return len(freed)

    def check_idle_invariants(self) -> None:
        """Debug check: with nothing running, every block is free or cached-idle."""
        self.pool.check_invariants(idle=not self.scheduler.has_work())
        if self.prefix_cache is not None:
            self.prefix_cache.check_invariants(self.pool.ref_counts)


def build_model(loaded: LoadedModel, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                max_len: int, calibration: list[int] | None = None, parallel: Any = None,
                kernels: Kernels | None = None) -> LlamaForCausalLM:
    """The model on ``device`` in ``dtype``, weights loaded and quantized per ``config``;
    for int8 activations (w8a8), smoothed first on the ``calibration`` tokens; with
    ``parallel`` (tensor parallelism), this rank's shard of every layer."""
    # Build on the meta device (no random init of weights about to be overwritten),
    # then materialise and load; the rotary tables are computed for real.
    with torch.device("meta"):
        model = LlamaForCausalLM(loaded.config, max_positions=max_len)
    if parallel is not None:
        parallel.shard_model(model)
    model = model.to_empty(device=device).to(dtype)
    model.rope = RotaryEmbedding(loaded.config, max_len).to(device)
    model.load_weights(loaded.weights)
    if calibration and str(config.quantization).lower() == "w8a8":
        from ..model.smoothquant import smooth_for_int8

        if parallel is not None:
            parallel.share_calibration(calibration)  # every rank smooths its shard on these tokens, in step

        with torch.inference_mode():
            smooth_for_int8(model, calibration, config.cache.block_size, dtype, device,
                            kernels or choose_kernels(device, config.kernel_options))
    if config.quantization not in ("none", None):
        from ..model.quant import quantize_model

        quantize_model(model, loaded, config)
        if parallel is not None:
            parallel.after_quantize(model)
    model.eval()
    return model


def _weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters and buffers that hold weights (quantized layers keep
    theirs in buffers); a tied lm_head shares the embedding and counts once."""
    seen: set[int] = set()
    total = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith(("rope.cos", "rope.sin")) or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def _default_kv_budget(fraction: float, device: torch.device | None = None) -> int:
    """``fraction`` of the memory still free where the pool will live: the GPU's
    (after the weights are loaded) on CUDA, the host's available memory otherwise."""
    if device is not None and device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * fraction)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(int(line.split()[1]) * 1024 * fraction)
    except OSError:
        pass
    return 1 << 30

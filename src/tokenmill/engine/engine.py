"""LLMEngine.step(): schedule -> run -> sample -> detokenize -> outputs.

The engine is synchronous and single-threaded; the async wrapper drives it
from its own thread. Requests with ``n > 1`` become n sequences sharing one
request id (``<id>`` and index); each step returns, per sequence that changed,
a ``SequenceDelta`` with the new tokens and text since the last step.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import torch

from ..settings.config import EngineConfig
from ..model.loader import LoadedModel
from ..model.sampler import Logprob, SampleResult, sample
from ..files.tokenizer import Tokenizer
from .builder import build_engine
from .detokenizer import IncrementalDetokenizer
from .limits import RequestLimits
from .request import DEFAULT_PLACEMENT, Placement, Request, SamplingParams
from .sched.scheduler import ScheduledBatch
from .stats import EngineStats, SpecSnapshot, TierSnapshot
from .step.step_batch import StepBatch
from .grammar.structured import StepMasks

if TYPE_CHECKING:
    from .kv.kv_tier import DiskTier

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
    # Traced requests, in the finished delta: (time, prompt tokens) of each prefill chunk.
    prefill_chunks: list[tuple[float, int]] | None = None


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
        """Build every part (``builder.build_engine``); ``self.config`` is the resolved copy
        of ``config`` (what ``auto`` chose here), the caller's is left as it was."""
        parts = build_engine(config, loaded, tokenizer)
        self.config = parts.config
        self.device, self.dtype, self.kv_dtype = parts.device, parts.dtype, parts.kv_dtype
        self.parallel = parts.parallel
        self.tokenizer = parts.tokenizer
        self.model_config = parts.model_config
        self.max_model_len = parts.max_model_len
        self.limits = RequestLimits(parts.max_model_len, parts.model_config.vocab_size)
        self.kernels = parts.kernels
        self.model = parts.model
        self.weight_bytes = parts.weight_bytes
        self.block_size = parts.block_size
        self.prefix_cache = parts.prefix_cache
        self.pool = parts.pool
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.lora = parts.runner.lora  # the resident LoRA adapters, or None (model/lora/lora.py)
        self.structured = parts.structured
        self.speculator = parts.speculator
        # Uniform draws happen on the CPU (model/sampler.py), so generators live there on
        # any device: a CUDA generator would be refused by torch.rand there, and a seed
        # then gives the same draws on CPU and GPU.
        self.generator = torch.Generator()
        self.generator.manual_seed(self.config.seed)
        self._groups: dict[str, list[_Sequence]] = {}
        self._by_request: dict[int, _Sequence] = {}
        self.last_step = StepStats()
        self.total_preemptions = 0
        self._steps = 0
        self.stats = EngineStats()
        self._publish()

    # -- requests ------------------------------------------------------
    def encode_prompt(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, placement: Placement | None = None,
                    trace: bool = False, adapter: int = 0) -> list[Request]:
        """Queue a request (n sequences). Raises ValueError for what cannot run. ``placement``
        (tenant, class, weight, priority) orders it under the priority and fair policies;
        ``trace``: record its prefill chunks for its trace (the finished delta's);
        ``adapter``: the id of a resident LoRA adapter to run it with (0: the base model)."""
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already running")
        if adapter and (self.lora is None or adapter not in self.lora.adapters):
            raise ValueError(f"LoRA adapter {adapter} is not loaded")
        token_ids = self.encode_prompt(prompt) if isinstance(prompt, str) else list(prompt)
        self.limits.check_prompt_ids(token_ids)  # a LimitError (ValueError) names the field at fault
        self.limits.check_stop_ids(params.stop_token_ids)
        params.check_vocab(self.model_config.vocab_size)  # the sampler indexes the logits with these
        max_tokens = self.limits.resolve_max_tokens(len(token_ids), params.max_tokens)
        eos = frozenset() if params.ignore_eos else frozenset(self.tokenizer.eos_token_ids)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        group: list[_Sequence] = []
        for index in range(params.n):
            req = Request(request_id=f"{request_id}#{index}", prompt_token_ids=token_ids, params=params,
                          arrival_time=arrival, eos_token_ids=eos, max_tokens=max_tokens,
                          placement=placement or DEFAULT_PLACEMENT, prefill_chunks=[] if trace else None,
                          adapter_id=adapter)
            if params.structured is not None:
                req.grammar = self.structured.compile(params.structured)  # GrammarError is a ValueError
                if params.structured_after:
                    req.pending_grammar, req.grammar = req.grammar, None
            if params.prompt_logprobs is not None:
                if group:  # scored once, by the first sequence (Request.prompt_scorer)
                    req.prompt_scorer = group[0].request
                else:
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

    @contextlib.contextmanager
    def temporary_budget(self, tokens: int) -> Iterator[None]:
        """Steps of at least ``tokens`` tokens while inside (a probe that times a whole
        prompt in one step needs it), the configured budget again after. On the engine's
        own thread, between steps: the scheduler reads the budget as each step starts."""
        config = self.scheduler.config
        configured = config.max_num_batched_tokens
        config.max_num_batched_tokens = max(self.scheduler.token_budget, tokens)
        try:
            yield
        finally:
            config.max_num_batched_tokens = configured

    def tenant_shares(self) -> dict[str, dict[str, float]]:
        """Per tenant, its standing in the fair share (weight, virtual service, tokens
        computed, sequences in the scheduler; engine/sched/fairness.py); empty under FCFS.
        Safe off the engine thread: a copy of plain numbers, made on demand (the console's
        stats page) rather than published each step."""
        order = self.scheduler.order
        return order.snapshot() if order is not None else {}

    # -- the step ------------------------------------------------------
    def step(self) -> list[SequenceDelta]:
        """One step: schedule -> execute -> sample (or verify proposals) -> finish -> report."""
        started = time.monotonic()
        scheduled = self._schedule(started)
        if not scheduled:
            self.last_step = StepStats(num_preempted=len(scheduled.preempted))
            self._publish()
            return []
        batch = StepBatch.build(scheduled.items)
        logits, sampled, mask = self._execute(batch)
        self.scheduler.after_step(scheduled)
        plain, checks = _split_rows(sampled)
        result = self._sample(logits, sampled, plain, checks, mask)
        now = time.monotonic()
        touched: list[_Sequence] = []
        if result is not None:
            for req, token, lp in zip([sampled[row] for row in plain], result.token_ids, result.logprobs):
                touched.append(self._by_request[id(req)])
                self._append_token(touched[-1], token, lp, now)
        touched += self._verify(logits, checks, mask, now)
        touched += self._finish_prompt_only(batch)
        return self._report(scheduled, touched, started, now)

    def _schedule(self, now: float) -> ScheduledBatch:
        """Proposals for sequences in decode (when speculating), then the scheduler's choice."""
        if self.speculator is not None:
            self.speculator.propose([r for r in self.scheduler.running if r.num_tokens - r.num_computed_tokens == 1])
        scheduled = self.scheduler.schedule(now)
        self.total_preemptions += len(scheduled.preempted)
        self._steps += 1
        return scheduled

    def _execute(self, batch: StepBatch) -> tuple[torch.Tensor, list[Request], StepMasks | None]:
        """The forward pass (and prompt logprobs, for requests that ask); the grammar masks
        of the step's constrained rows are computed meanwhile: they depend only on tokens
        already accepted (and this step's proposals)."""
        constrained = batch.constrained
        masks = self.structured.fill_step_async(constrained) if constrained else None
        try:
            logits, sampled = self.runner.execute(batch)
        finally:
            mask = self.structured.wait(masks) if masks is not None else None
        return logits, sampled, mask

    def _sample(self, logits: torch.Tensor, sampled: list[Request], plain_rows: list[int],
                checks: list[tuple[Request, int]], mask: StepMasks | None) -> SampleResult | None:
        """Tokens of the rows that are sampled (not verified), grammar-masked where asked."""
        if not plain_rows:
            return None
        plain = [sampled[i] for i in plain_rows]
        if checks:
            logits = logits.index_select(0, torch.tensor(plain_rows, device=logits.device))
        token_mask = None
        rows = [row for row, r in enumerate(plain) if r.grammar is not None]
        if rows:
            if mask is None or any(not mask.has(plain[row]) for row in rows):
                # the runner sampled a row the prediction missed: fill its masks now
                token_mask = (rows, self.structured.fill([plain[row].grammar for row in rows]))
            else:
                token_mask = (rows, mask.select([plain[row] for row in rows]))
        return sample(logits, plain, self.generator, token_mask, self.kernels.library)

    def _verify(self, logits: torch.Tensor, checks: list[tuple[Request, int]], mask: StepMasks | None,
                now: float) -> list[_Sequence]:
        """Check each verify's proposals (exact acceptance) and append what stands."""
        touched = []
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
                pending = req.pending_grammar is not None
                self._append_token(seq, token, None, now)
                appended += 1
                if req.is_finished or (pending and req.pending_grammar is None):
                    break  # finished, or the reasoning ended: the next tokens were checked without the grammar
            self.scheduler.accept_proposals(req, appended - 1)
            touched.append(seq)
        return touched

    def _finish_prompt_only(self, batch: StepBatch) -> list[_Sequence]:
        """``max_tokens=0`` requests are done once their prompt is computed."""
        touched = []
        for seq in batch.seqs:
            req = seq.request
            if not req.samples and not req.is_finished and req.num_computed_tokens >= req.num_prompt_tokens:
                self._finish(req, "length", None)
                touched.append(self._by_request[id(req)])
        return touched

    def _report(self, scheduled: ScheduledBatch, touched: list[_Sequence], started: float,
                now: float) -> list[SequenceDelta]:
        """The step's deltas; finished sequences forgotten; the step's figures published."""
        deltas = [self._delta(seq, now) for seq in touched]
        for seq in touched:
            if seq.request.is_finished:
                self._forget(seq)
        decode_tokens = sum(1 for _, n in scheduled.items if n == 1)
        self.last_step = StepStats(
            num_tokens=scheduled.num_tokens,
            num_prefill_tokens=scheduled.num_tokens - decode_tokens,
            num_decode_tokens=decode_tokens,
            num_preempted=len(scheduled.preempted),
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
        if req.pending_grammar is not None and stop_str is None:
            marker = params.structured_after or ""
            if marker in seq.detok.text[-(len(marker) + 64):]:  # reasoning over: the format applies now
                req.grammar, req.pending_grammar = req.pending_grammar, None
        elif req.grammar is not None and token not in req.eos_token_ids:
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
        scorer = req.prompt_scorer or req
        if req.params.prompt_logprobs is not None and not seq.sent_prompt_logprobs and not scorer.wants_prompt_logprobs:
            prompt_lps = scorer.prompt_logprobs  # one list for every sequence of the prompt, not a copy each
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
            prefill_chunks=list(req.prefill_chunks) if finished and req.prefill_chunks is not None else None,
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
                tuple(spec.stats.accepted_per_position)),
            tier=_tier_snapshot(cache.tier if cache is not None else None),
            queue_heads=self.scheduler.queue_heads)  # replaced whole each step, never changed in place

    def close(self) -> None:
        """Stop tensor-parallel workers and grammar compile workers; with a disk tier, copy
        the pool's idle cached blocks there and close it, so the next process finds them.
        Idempotent."""
        self.structured.close()
        if self.parallel is not None:
            self.parallel.close()
        tier = self.prefix_cache.tier if self.prefix_cache is not None else None
        if tier is not None and not tier.closed:
            self.prefix_cache.offload_all(self.pool)
            tier.close()

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


def _tier_snapshot(tier: "DiskTier | None") -> TierSnapshot | None:
    if tier is None:
        return None
    st = tier.stats
    return TierSnapshot(tier.num_slots, tier.num_slots - len(tier.free_slots), tier.io.block_bytes,
                        st.stored_blocks, st.restored_blocks, st.restore_seconds, st.dropped_blocks,
                        st.torn_blocks + st.rejected_blocks, st.errors, tier.disabled is not None)


def _split_rows(sampled: list[Request]) -> tuple[list[int], list[tuple[Request, int]]]:
    """The logits rows that are sampled, and (request, first row) of each verify: a request
    that ran speculative proposals has one row per token it checks."""
    plain: list[int] = []
    checks: list[tuple[Request, int]] = []
    row = 0
    while row < len(sampled):
        req = sampled[row]
        if req.spec_token_ids:
            checks.append((req, row))
            row += 1 + len(req.spec_token_ids)
        else:
            plain.append(row)
            row += 1
    return plain, checks

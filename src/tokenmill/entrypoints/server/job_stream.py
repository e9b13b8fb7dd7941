"""One engine request's deltas, with the bookkeeping every request needs whatever its endpoint.

``run_job`` is what ``ServerState.stream_job`` runs: metrics as deltas arrive, one
capture record at the end, and an abort when the consumer stops early (client
disconnect, cancelled task), so blocks go back to the pool within one engine step.
Engine refusals (ValueError) surface as a 400 ``APIError`` before the first delta; a
dead engine as 503. ``merge_streams`` interleaves the jobs of one HTTP request.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator

from ...engine.async_engine import EngineDeadError
from ...engine.engine import SequenceDelta
from ...engine.request import SamplingParams
from ...gateway.tenants import DEFAULT_TENANT
from ...gateway.tracing import CURRENT_SPAN
from .errors import APIError

if TYPE_CHECKING:
    from .serving import Job, ServerState

log = logging.getLogger("tokenmill.server")


@dataclass
class _Progress:
    """What one job's stream has seen so far."""

    started: float
    first_token: float | None = None
    last_seen: dict[int, float] = field(default_factory=dict)  # per choice: when its last tokens came
    out_tokens: dict[int, int] = field(default_factory=dict)
    reasons: dict[int, str | None] = field(default_factory=dict)  # per ended choice: its finish reason
    cached: int = 0
    queue_time: float = 0.0

    @property
    def output(self) -> int:
        return sum(self.out_tokens.values())


async def run_job(state: "ServerState", job: "Job") -> AsyncIterator[SequenceDelta]:
    """Deltas of one engine request, with metrics, capture and abort-on-exit."""
    progress = _Progress(time.monotonic())
    done = failed = False
    if state.settings.log_requests:
        log.info("request %s: %s, %d prompt tokens, %s", job.request_id, job.endpoint,
                 len(job.prompt_ids), params_dict(job.params))
    if state.cutting:
        state.admission.release(job)
        raise state._shutdown_error()
    adapter = 0
    if state.adapters is not None and job.model in state.adapters:
        adapter = await state._acquire_adapter(job)
    span = CURRENT_SPAN.get() if state.tracing is not None else None
    gen = state.aengine.generate(job.request_id, job.prompt_ids, job.params, job.placement,
                                 trace=span is not None, adapter=adapter, arrival_time=job.arrival)
    state._live[job.request_id] = job
    job.streamed = True
    # release() and the generator's first step (which submits to the engine)
    # run with no await in between
    state.admission.release(job)
    try:
        async for delta in gen:
            _observe(state, job, progress, delta, adapter, span)
            yield delta
        if job.request_id in state._cut:
            log.warning("request %s cut at shutdown after %d output tokens", job.request_id, progress.output)
            raise state._shutdown_error()
        done = True
    except ValueError as exc:
        failed = True
        raise APIError(400, str(exc)) from None
    except EngineDeadError as exc:
        failed = True
        raise APIError(503, str(exc), code="engine_dead") from None
    finally:
        _settle(state, job, progress, adapter, done, failed)
        await gen.aclose()


def _observe(state: "ServerState", job: "Job", progress: _Progress, delta: SequenceDelta, adapter: int,
             span: Any) -> None:
    """One delta's metrics (and, the first time, the job's start)."""
    now = time.monotonic()
    ntok = len(delta.token_ids)
    if progress.first_token is None:
        progress.first_token = now
        if adapter and state.adapters is not None:
            state.adapters.started(adapter)
        progress.cached = delta.num_cached_tokens
        state._classify_miss(job, progress.cached)
        if job.held:
            state.admission.started(job)
        state.metrics.prompt_tokens.inc(delta.num_prompt_tokens)
        state.metrics.req_prompt.observe(delta.num_prompt_tokens)
    else:
        progress.cached = max(progress.cached, delta.num_cached_tokens)
    if ntok:
        state.metrics.generation_tokens.inc(ntok)
        prev = progress.last_seen.get(delta.index)
        if prev is not None:
            state.metrics.itl.observe((now - prev) / ntok)
        progress.last_seen[delta.index] = now
        progress.out_tokens[delta.index] = progress.out_tokens.get(delta.index, 0) + ntok
    if delta.finished:
        progress.reasons[delta.index] = delta.finish_reason
        state.metrics.finished(delta.finish_reason)
        state.metrics.observe_sequence(delta.metrics, progress.out_tokens.get(delta.index, 0))
        progress.queue_time += delta.metrics.get("queue_time", 0.0)
        if span is not None:
            state._trace_sequence(span, job, delta, progress.out_tokens.get(delta.index, 0))


def _settle(state: "ServerState", job: "Job", progress: _Progress, adapter: int, done: bool, failed: bool) -> None:
    """The job's stream ended (done, failed or abandoned): abort what still runs, count and record it."""
    started = progress.first_token is not None
    state._live.pop(job.request_id, None)
    state._cut.discard(job.request_id)
    if adapter and state.adapters is not None:
        state.adapters.release(adapter, started=started)
    # abort first: it is synchronous, so a cancellation arriving at the caller's
    # await cannot skip it
    if not done:
        state.aengine.abort(job.request_id)
        for i in range(job.params.n if not failed else 0):
            if i not in progress.reasons:
                state.metrics.finished("abort")
                progress.reasons[i] = "abort"
    _record(state, job, progress)
    state.admission.finished(job, started, progress.output)
    state.usage.record((job.tenant or DEFAULT_TENANT).name, len(job.prompt_ids) if started else 0,
                       progress.cached, progress.output, progress.queue_time, failed)


def _record(state: "ServerState", job: "Job", progress: _Progress) -> None:
    """The request log line and the traffic capture's record of a finished job."""
    end = time.monotonic()
    reasons = progress.reasons
    if state.settings.log_requests:
        log.info("request %s done: %d output tokens, finish %s, %.3fs", job.request_id,
                 progress.output, sorted({str(r) for r in reasons.values()}), end - progress.started)
    if state.capture is None:
        return
    reason = reasons.get(0) if len(set(reasons.values())) <= 1 else ",".join(
        str(reasons[i]) for i in sorted(reasons))
    first = progress.first_token
    state.capture.record(
        arrival_time=job.arrival_unix, prompt_token_ids=job.prompt_ids, cached_tokens=progress.cached,
        output_tokens=progress.output, sampling=params_dict(job.params),
        ttft=None if first is None else first - progress.started, e2e=end - progress.started,
        prompt_text=job.prompt_text, endpoint=job.endpoint, request_id=job.request_id,
        finish_reason=reason, tenant=state.tenants.label((job.tenant or DEFAULT_TENANT).name),
        miss_reason=job.miss.reason if job.miss is not None else None,
        miss_offset=job.miss.offset if job.miss is not None else None,
        session=_conversation(job.session))


def _conversation(session: str | None) -> str | None:
    """What the traffic capture keeps of a session: a named conversation only (a ``user`` may hold
    several at once, which a replay must not chain as one)."""
    return session if session and session.startswith("session:") else None


def params_dict(p: SamplingParams) -> dict[str, Any]:
    keys = ("n", "temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "seed",
            "presence_penalty", "frequency_penalty", "repetition_penalty", "stop", "logprobs", "ignore_eos")
    return {k: getattr(p, k) for k in keys}


async def merge_streams(iters: list[AsyncIterator[SequenceDelta]]) -> AsyncIterator[tuple[int, SequenceDelta]]:
    """Interleave several jobs' deltas as they come, tagged with the job index.

    Closing the merged iterator cancels the pumps, which closes each job's
    stream (and so aborts whatever is still running)."""
    if len(iters) == 1:
        async with contextlib.aclosing(iters[0]) as only:  # type: ignore[type-var]
            async for delta in only:
                yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    end = object()

    async def pump(i: int, it: AsyncIterator[SequenceDelta]) -> None:
        try:
            async with contextlib.aclosing(it) as stream:  # type: ignore[type-var]
                async for delta in stream:
                    await queue.put((i, delta))
            await queue.put((i, end))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iters)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

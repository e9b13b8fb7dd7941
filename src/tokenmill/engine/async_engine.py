"""The engine loop off the event loop, with one async stream per request.

A dedicated thread owns the ``LLMEngine``: it applies queued commands (add,
abort), runs ``step()`` while work exists, and hands each delta to the
asyncio loop of the request that asked for it. Commands are applied between
steps, so an abort that arrives during a forward pass takes effect right
after it. A failing step fails the requests in it, never the loop.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from .engine import LLMEngine, SequenceDelta
from .request import Placement, SamplingParams

log = logging.getLogger("tokenmill.async_engine")


class EngineDeadError(RuntimeError):
    pass


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Any]
    remaining: int  # sequences not yet finished

    def put(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    stream: _Stream
    arrival_time: float = field(default_factory=time.monotonic)
    placement: Placement | None = None
    adapter: int = 0  # a resident LoRA adapter's id; 0: the base model
    trace: bool = False


_FINISHED = object()


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_step: Callable[[LLMEngine, list[SequenceDelta]], None] | None = None) -> None:
        self.engine = engine
        self.on_step = on_step  # metrics hook, called in the engine thread
        self.after_call: list[Callable[[LLMEngine], None]] = []  # engine-thread hooks after each call()
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wakeup = threading.Event()
        self._queued_seqs = 0  # sequences in "add" commands not applied yet (admission counts them)
        self._queued_lock = threading.Lock()
        self._stopping = False
        self.last_heartbeat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    # -- public API (event-loop side) ----------------------------------
    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       placement: Placement | None = None, trace: bool = False,
                       adapter: int = 0, arrival_time: float | None = None) -> AsyncIterator[SequenceDelta]:
        """Yield deltas until every sequence of the request has finished; ``arrival_time``
        (time.monotonic, default now): when the caller got it, which the scheduler's
        starvation bound counts from.

        Raises ValueError (bad request) before the first delta. If the
        consumer stops early (client gone, task cancelled) the request is
        aborted.
        """
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), params.n)
        self._send("add", _Add(request_id, prompt, params, stream, placement=placement, trace=trace,
                               adapter=adapter, arrival_time=time.monotonic() if arrival_time is None else arrival_time))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if item is _FINISHED:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request; idempotent, applied after the current step."""
        self._send("abort", request_id)

    def call(self, fn: Callable[[LLMEngine], Any]) -> "asyncio.Future[Any]":
        """Run ``fn(engine)`` in the engine thread between steps (admin actions)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._send("call", (fn, loop, future))
        return future

    def fail(self, reason: str) -> None:
        """A fault outside the loop that the engine cannot survive (a tensor-parallel rank
        died): the loop stops, ``is_alive`` turns false (/health 503) and every open stream
        gets an ``EngineDeadError`` (a 503) now, whatever the engine thread is doing."""
        self._stopping = True
        self._wakeup.set()
        for _request_id, stream in list(self._streams.items()):
            stream.put(EngineDeadError(f"the engine failed: {reason}"))

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout)

    def _send(self, kind: str, payload: Any) -> None:
        if kind == "add":
            with self._queued_lock:
                self._queued_seqs += payload.params.n
        self._commands.put((kind, payload))
        self._wakeup.set()

    # -- engine thread ---------------------------------------------------
    @property
    def num_queued(self) -> int:
        """Commands handed to the engine thread but not applied yet (adds among them)."""
        return self._commands.qsize()

    @property
    def num_queued_sequences(self) -> int:
        """Sequences of the queued "add" commands (a request with ``n`` > 1 counts ``n``)."""
        return self._queued_seqs

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                self._apply(kind, payload)
            except Exception as exc:  # noqa: BLE001 - a bad command must not kill the loop
                log.exception("engine command %s failed", kind)
                if kind == "add":
                    payload.stream.put(ValueError(f"request rejected: {exc}"))
            finally:
                if kind == "add":  # after the add: its sequences are in the engine's queue now
                    with self._queued_lock:
                        self._queued_seqs -= payload.params.n

    def _apply(self, kind: str, payload: Any) -> None:
        if kind == "add":
            self._add(payload)
        elif kind == "abort":
            self._abort(payload)
        elif kind == "call":
            fn, loop, future = payload
            try:
                result = fn(self.engine)
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)
            for hook in self.after_call:  # a call may change state outside a step (a cache reset)
                hook(self.engine)

    def _add(self, cmd: _Add) -> None:
        if cmd.request_id in self._streams:
            cmd.stream.put(ValueError(f"request id {cmd.request_id!r} is already in use"))
            return
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, arrival_time=cmd.arrival_time,
                                    placement=cmd.placement, trace=cmd.trace, adapter=cmd.adapter)
        except Exception as exc:  # noqa: BLE001 - reported to the caller as a bad request
            cmd.stream.put(exc if isinstance(exc, ValueError) else ValueError(str(exc)))
            return
        self._streams[cmd.request_id] = cmd.stream

    def _abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put(_FINISHED)

    def _run(self) -> None:
        while not self._stopping:
            self.last_heartbeat = time.monotonic()
            self._apply_commands()
            if not self.engine.has_unfinished():
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            try:
                deltas = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - keep the loop alive
                log.exception("engine step failed; failing its requests")
                self._fail_all(exc)
                continue
            if not deltas and not self.engine.scheduler.running:
                self._wakeup.wait(timeout=0.002)  # a batching policy's window
                self._wakeup.clear()
            self._deliver(deltas)
            if self.on_step is not None:
                try:
                    self.on_step(self.engine, deltas)
                except Exception:  # noqa: BLE001
                    log.exception("on_step hook failed")

    def _deliver(self, deltas: list[SequenceDelta]) -> None:
        """Hand a step's deltas to their streams with one wake-up per event loop.

        One ``call_soon_threadsafe`` per delta cost a self-pipe write and a loop
        wake-up per token: at 64 streams, 64 of each per step, in the thread the
        HTTP side needs. A step's items go over as one batch, in order.
        """
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], Any]]] = {}
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue
            batch = batches.setdefault(stream.loop, [])
            batch.append((stream.queue, delta))
            if delta.finished:
                stream.remaining -= 1
                if stream.remaining == 0:
                    del self._streams[delta.request_id]
                    batch.append((stream.queue, _FINISHED))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # that loop is closed: nobody is left to read its streams
                log.warning("dropping %d deltas for a closed event loop", len(batch))

    def _fail_all(self, exc: Exception) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort_request(request_id)
            stream.put(RuntimeError(f"internal engine error: {exc}"))
        self._streams.clear()


def _put_all(batch: list[tuple["asyncio.Queue[Any]", Any]]) -> None:
    for q, item in batch:
        q.put_nowait(item)


def _settle(future: "asyncio.Future[Any]", result: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)

"""Several base models behind one server, loaded on demand: ``ModelSet`` and ``ModelSetState``.

``tokenmill serve --model A --model B`` (or ``--models-dir``) names several
models; each, once loaded, is a ``ResidentModel``: its own engine (and KV pool)
and its own ``ServerState``, the object every route already serves one model
with. ``ModelSet`` owns which of them are in memory:

- a model is loaded when a request first names it, on a worker thread, so the
  event loop (and every other model) keeps serving while it loads; requests
  for a model that is loading wait for it, up to ``--model-load-timeout``
  (then 503 with Retry-After), and at most ``--max-load-waiters`` wait at once
  (then 429);
- ``--max-loaded-models N``: loading one more first unloads the least recently
  used model that has no request in flight (none idle: the request waits, as
  above);
- ``--idle-unload-seconds S``: a loaded model with no request for S seconds is
  unloaded by a reaper thread;
- a request holds a lease on its model from the moment its model is looked up
  until its response (streamed or not) has been sent (``app.GateMiddleware``
  gives each lease back), and a model with leases is never unloaded;
- unloading stops the model's engine thread and its grammar threads
  (``StructuredOutputs.close``: a thread left running keeps what it last
  touched, and with it the model's grammar state and tokenizer), drops every
  reference to its engine and pool, then collects garbage and returns freed
  heap to the system (``heap.trim_heap``), so the process's resident memory
  drops, and stays flat over any number of loads and unloads.

``ModelSetState`` is what such a server's routes and middleware see in place
of a one-model ``ServerState``: the server-wide parts (tenants, usage, tracing,
draining, the requests in flight, ``/metrics``) and ``serving_for(name)``, which
gives the loaded model's ``ServerState``. A one-model server never builds
either: its ``ServerState`` answers ``serving_for`` itself.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from .errors import APIError
from .heap import trim_heap
from .serving import ServerSettings, ServerShared, ServerState, model_not_found
from ...gateway.tenants import is_operator, tenant_of

log = logging.getLogger("tokenmill.server")

UNLOADED, LOADING, LOADED, UNLOADING = "unloaded", "loading", "loaded", "unloading"
LEASES_KEY = "tokenmill.model_leases"  # the ASGI scope's list of a request's leases (GateMiddleware ends them)
LOAD_WORKERS = 2  # models loading or unloading at once


@dataclass(frozen=True)
class ModelSpec:
    """One configured model: the name clients use and where its weights are (None: the bundled model)."""

    name: str
    path: str | None


@dataclass
class ResidentModel:
    """A loaded model: what serves its requests and what unloading it must stop."""

    state: ServerState
    close: Callable[[], None]  # stops its engine thread and frees engine and pool


@dataclass
class ModelEntry:
    """One model's place in the set."""

    spec: ModelSpec
    status: str = UNLOADED
    resident: ResidentModel | None = None
    leases: int = 0  # requests in flight on it
    last_used: float = 0.0  # time.monotonic() of its last lease taken or given back
    job: concurrent.futures.Future | None = None  # its load or unload in progress
    loads: int = 0
    unloads: dict[str, int] = field(default_factory=dict)  # by reason: lru, idle
    max_model_len: int | None = None  # known once it has loaded
    error: str | None = None  # why its last load failed


@dataclass(frozen=True)
class ModelSetOptions:
    """The flags that govern the set (``--max-loaded-models`` and friends)."""

    max_loaded: int | None = None  # None: every configured model may be resident
    idle_unload_s: float | None = None  # None: never unloaded for idleness
    load_timeout_s: float = 300.0  # how long a request waits for its model
    max_waiters: int = 64  # requests waiting for a model at once
    retry_after_s: int = 5


class ModelSet:
    """Which configured models are in memory, and the loads and unloads between.

    Every change of an entry happens under one lock: the event loop takes
    leases, the worker threads finish loads and unloads, the reaper picks idle
    models. ``loader`` builds one model (engine, pool, ``ServerState``); it runs
    on a worker thread."""

    def __init__(self, specs: list[ModelSpec], loader: Callable[[ModelSpec], ResidentModel],
                 options: ModelSetOptions | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if not specs:
            raise ValueError("a model set needs at least one model")
        self.options = options or ModelSetOptions()
        self._loader = loader
        self._clock = clock
        self._lock = threading.Lock()
        self._entries = {spec.name: ModelEntry(spec) for spec in specs}
        self._waiters = 0
        self._workers = concurrent.futures.ThreadPoolExecutor(LOAD_WORKERS, thread_name_prefix="tokenmill-model")
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        if self.options.idle_unload_s is not None:
            self._reaper = threading.Thread(target=self._reap, name="tokenmill-model-reaper", daemon=True)
            self._reaper.start()

    # -- what is configured and what is loaded ------------------------------------
    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def entries(self) -> list[ModelEntry]:
        return list(self._entries.values())

    def status(self, name: str) -> str:
        return self._entries[name].status

    def loaded(self) -> list[ServerState]:
        """The ``ServerState`` of every model in memory now."""
        with self._lock:
            return [e.resident.state for e in self._entries.values() if e.resident is not None]

    def num_loaded(self) -> int:
        with self._lock:
            return sum(1 for e in self._entries.values() if e.status == LOADED)

    # -- leases ----------------------------------------------------------------
    async def acquire(self, name: str) -> ServerState:
        """The loaded model's state, with a lease taken on it (give it back with ``release``);
        loads the model first when it is not in memory. 429 when too many requests already
        wait for models, 503 when it is not loaded within the load timeout, 500 when its
        load fails."""
        entry = self._entries[name]
        opts = self.options
        deadline = self._clock() + opts.load_timeout_s
        waiting = False
        try:
            while True:
                with self._lock:
                    if entry.status == LOADED:
                        assert entry.resident is not None
                        entry.leases += 1
                        entry.last_used = self._clock()
                        return entry.resident.state
                    if not waiting:
                        if self._waiters >= opts.max_waiters:
                            raise APIError(429, f"{self._waiters} requests are already waiting for models to load "
                                           f"(--max-load-waiters {opts.max_waiters}); retry later",
                                           code="model_load_queue_full",
                                           headers={"Retry-After": str(opts.retry_after_s)})
                        self._waiters += 1
                        waiting = True
                    if entry.status == UNLOADED:
                        self._start_load(entry)
                    job = entry.job  # None: waiting for room (another model to become idle or unload)
                remaining = deadline - self._clock()
                if remaining <= 0:
                    raise self._timeout(entry)
                if job is None:
                    await asyncio.sleep(min(0.05, remaining))
                    continue
                wrapped = asyncio.wrap_future(job)
                wrapped.add_done_callback(_retrieve)
                done, _ = await asyncio.wait([wrapped], timeout=remaining)
                if done and wrapped.exception() is not None and entry.error is not None:
                    raise APIError(500, f"model `{name}` failed to load: {entry.error}", param="model",
                                   code="model_load_failed")
        finally:
            if waiting:
                with self._lock:
                    self._waiters -= 1

    def release(self, name: str) -> None:
        """A request on ``name`` is over: its lease goes back and its idle time starts now."""
        entry = self._entries[name]
        with self._lock:
            entry.leases -= 1
            entry.last_used = self._clock()

    def _timeout(self, entry: ModelEntry) -> APIError:
        why = ("it is still loading" if entry.status == LOADING else
               f"every loaded model has requests in flight (--max-loaded-models {self.options.max_loaded})")
        return APIError(503, f"model `{entry.spec.name}` is not loaded after {self.options.load_timeout_s:g}s: "
                        f"{why}; retry later", code="model_not_ready",
                        headers={"Retry-After": str(self.options.retry_after_s)})

    # -- loading and unloading (called with the lock held) ---------------------------
    def _start_load(self, entry: ModelEntry) -> None:
        """Start loading ``entry``, or make room for it first: unload the least recently used
        idle model when the set is full (none idle: nothing starts, the caller waits)."""
        limit = self.options.max_loaded
        resident = [e for e in self._entries.values() if e.status != UNLOADED]
        if limit is not None and len(resident) >= limit:
            idle = [e for e in resident if e.status == LOADED and e.leases == 0]
            if idle:
                self._start_unload(min(idle, key=lambda e: e.last_used), "lru")
            return
        entry.status = LOADING
        entry.error = None
        log.info("model %s: loading from %s", entry.spec.name, entry.spec.path or "the bundled model")
        entry.job = self._workers.submit(self._load, entry)

    def _start_unload(self, entry: ModelEntry, reason: str) -> None:
        entry.status = UNLOADING
        log.info("model %s: unloading (%s)", entry.spec.name, "least recently used" if reason == "lru"
                 else f"idle for {self.options.idle_unload_s:g}s")
        entry.job = self._workers.submit(self._unload, entry, reason)

    # -- on a worker thread -------------------------------------------------------
    def _load(self, entry: ModelEntry) -> None:
        started = time.monotonic()
        try:
            resident = self._loader(entry.spec)
        except BaseException as exc:
            with self._lock:
                entry.status, entry.job, entry.error = UNLOADED, None, f"{type(exc).__name__}: {exc}"
            log.exception("model %s: load failed", entry.spec.name)
            raise
        release_memory()  # what loading freed (file buffers, dequantization scratch), as a one-model server does
        with self._lock:
            entry.resident, entry.status, entry.job = resident, LOADED, None
            entry.loads += 1
            entry.last_used = self._clock()
            entry.max_model_len = resident.state.max_model_len
        log.info("model %s: loaded in %.1fs", entry.spec.name, time.monotonic() - started)

    def _unload(self, entry: ModelEntry, reason: str) -> None:
        resident = entry.resident  # no lease can be taken while it is UNLOADING
        try:
            if resident is not None:
                resident.close()
        finally:
            with self._lock:
                entry.resident, entry.status, entry.job = None, UNLOADED, None
                entry.unloads[reason] = entry.unloads.get(reason, 0) + 1
            del resident
            release_memory()
        log.info("model %s: unloaded", entry.spec.name)

    def _reap(self) -> None:
        """Unload models idle past ``--idle-unload-seconds`` (the reaper thread's loop)."""
        idle_s = self.options.idle_unload_s
        assert idle_s is not None
        while not self._stop.wait(min(1.0, max(0.05, idle_s / 4))):
            self.unload_idle()

    def unload_idle(self) -> int:
        """Start unloading every loaded model with no lease whose last use is older than the
        idle timeout; returns how many."""
        idle_s = self.options.idle_unload_s
        if idle_s is None:
            return 0
        now = self._clock()
        with self._lock:
            idle = [e for e in self._entries.values()
                    if e.status == LOADED and e.leases == 0 and now - e.last_used >= idle_s]
            for e in idle:
                self._start_unload(e, "idle")
        return len(idle)

    def close(self) -> None:
        """Stop the reaper, let loads and unloads under way finish, then unload every model."""
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(5)
        self._workers.shutdown(wait=True)
        with self._lock:
            loaded = [e for e in self._entries.values() if e.status == LOADED]
            for e in loaded:
                e.status = UNLOADING
        for e in loaded:
            self._unload(e, "shutdown")


def _retrieve(future: asyncio.Future) -> None:
    """Mark a load's failure as seen (the waiter that timed out no longer looks at it)."""
    if not future.cancelled():
        future.exception()


def release_memory() -> None:
    """Give an unloaded model's memory back: collect the cycles that still hold its tensors,
    then return the freed heap to the system."""
    gc.collect()
    trim_heap()


class ModelSetState:
    """The server-wide state of a server of several models: what its middleware and the
    routes that name no model read, and ``serving_for``, which routes that name a model
    call to get that model's ``ServerState`` (loading it when needed)."""

    adapters = None  # LoRA adapters are per base model: not with several models
    capture = None

    def __init__(self, models: ModelSet, settings: ServerSettings, shared: ServerShared | None = None) -> None:
        from .metrics import ModelSetMetrics

        self.models = models
        self.settings = settings
        self.shared = shared if shared is not None else ServerShared.from_settings(settings)
        self.tenants = self.shared.tenants
        self.tenant_gate = self.shared.tenant_gate
        self.usage = self.shared.usage
        self.tracing = self.shared.tracing
        self.model_name = models.names()[0]
        self.metrics = ModelSetMetrics(models, self.usage)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining = False
        self.cutting = False
        self.inflight_http = 0

    @property
    def max_model_len(self) -> int:
        """The longest context of the models loaded so far (0 before any): what the request
        body limit (gateway/request_guard.py) is sized by."""
        return max((e.max_model_len or 0 for e in self.models.entries()), default=0)

    async def serving_for(self, name: str | None, scope: Any = None) -> ServerState:
        """The state of model ``name``, loaded, with a lease on it that lasts until the request's
        response is sent (the lease goes into ``scope``; GateMiddleware gives it back)."""
        if not name:
            raise APIError(400, f"model: this server serves several models; name one of {', '.join(self.models.names())}",
                           param="model", code="model_required")
        if name not in self.models:
            raise model_not_found(name, self.models.names())
        leases = scope.get(LEASES_KEY) if scope is not None else None
        if leases is None:
            raise RuntimeError("a model lease needs the app's GateMiddleware to end it")
        try:
            state = await self.models.acquire(name)
        except APIError as exc:
            if exc.code == "model_load_failed" and not is_operator(tenant_of(scope)):
                # the reason may name a server path: the operator's to read (its /v1/models shows it)
                raise APIError(500, f"model `{name}` failed to load", param="model",
                               code="model_load_failed") from None
            raise
        leases.append(lambda: self.models.release(name))
        return state

    def loaded_states(self) -> list[ServerState]:
        return self.models.loaded()

    def cut_all(self) -> int:
        """End every running request of every loaded model (shutdown's grace period is over)."""
        self.cutting = True
        return sum(state.cut_all() for state in self.loaded_states())

    def close(self) -> None:
        self.models.close()
        self.shared.close()


def model_cards(models: ModelSet, show_errors: bool = True) -> Iterator[dict[str, Any]]:
    """``/v1/models`` entries of a model set: every configured model and whether it is in memory
    (llama.cpp's ``status`` field). ``root`` is the model's name, not its file: the cards show
    no server path; a failed load's reason (which may name one) only with ``show_errors``
    (the operator's cards)."""
    for entry in models.entries():
        card: dict[str, Any] = {"id": entry.spec.name, "root": entry.spec.name,
                                "max_model_len": entry.max_model_len, "status": {"value": entry.status}}
        if entry.error and entry.status == UNLOADED:
            card["status"]["failed"] = True
            if show_errors:
                card["status"]["error"] = entry.error
        yield card


# ---- which models a command line names ------------------------------------------------

def is_model_path(path: str) -> bool:
    """A GGUF file or a Hugging Face folder (one with config.json)."""
    if os.path.isfile(path):
        return path.lower().endswith(".gguf")
    return os.path.isfile(os.path.join(path, "config.json"))


def models_in_folder(folder: str) -> list[str]:
    """``--models-dir``: each GGUF file and each Hugging Face model folder in it, by name."""
    return [os.path.join(folder, name) for name in sorted(os.listdir(folder))
            if is_model_path(os.path.join(folder, name))]


def model_specs(paths: list[str], name_of: Callable[[str], str]) -> list[ModelSpec]:
    """One spec per path, named by ``name_of`` (the file's stem); two paths of one name are an error."""
    specs: dict[str, ModelSpec] = {}
    for path in dict.fromkeys(paths):
        name = name_of(path)
        if name in specs:
            raise ValueError(f"two models would be served as {name!r} ({specs[name].path} and {path}); "
                             "rename one of the files")
        specs[name] = ModelSpec(name, path)
    return list(specs.values())


def model_settings(settings: ServerSettings, spec: ModelSpec, sampling_defaults: dict[str, Any]) -> ServerSettings:
    """One model's settings within a server of several: the server's, with its own name and path."""
    return dataclasses.replace(settings, served_model_names=[spec.name], model_path=spec.path,
                               sampling_defaults=sampling_defaults, lora_modules=[])

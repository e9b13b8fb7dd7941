"""LoRA adapters served by an engine: names, the resident set (LRU), loading.

An adapter is registered under a name with the folder it comes from and gets
an id that is never reused (the prefix cache keys blocks by it, so an adapter
loaded again under the same name after an unload never meets the K/V of the
one before). At most ``max_loras`` adapters are resident (their tensors in the
model's ``LoraState``); a request for one that is not is loaded on demand,
evicting the least recently used resident adapter that no request is using.
When every resident adapter is in use, the request waits (bounded) for one to
become idle.

Reading and checking an adapter's files happens in a worker thread (off the
event loop); only the swap, ``LoraState.install`` / ``remove``, runs on the
engine thread between steps (``AsyncEngine.call``).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import torch

from ..settings.config import EngineConfig
from ..model.lora.lora import LoraError, LoraState, LoraWeights, ModelShape, attach as attach_wrappers, load_peft
from ..model.lora.lora_gguf import is_gguf_file, load_gguf_lora

log = logging.getLogger("tokenmill.adapters")

# How long a request waits for a resident slot when every resident adapter is in use.
SLOT_WAIT_S = 60.0


def attach(model: Any, config: EngineConfig, device: torch.device, dtype: torch.dtype, parallel: bool) -> LoraState:
    """Wrap the model's projections for adapters (at build, after quantization)."""
    if parallel:
        raise ValueError("LoRA adapters are not supported with tensor parallelism yet")
    if config.max_loras < 1 or config.max_lora_rank < 1:
        raise ValueError("--max-loras and --max-lora-rank must be positive")
    state = LoraState(config.max_loras, config.max_lora_rank, ModelShape.of(model.config), dtype, device)
    attach_wrappers(model, state)
    log.info("LoRA: up to %d adapters resident, rank <= %d; their rows run in the fused CPU steps where those "
             "run (CUDA graphs take base-only steps)", config.max_loras, config.max_lora_rank)
    return state


def read_adapter(state: LoraState, name: str, path: str, adapter_id: int) -> LoraWeights:
    """An adapter's tensors, checked against the model (``LoraError`` says what is wrong): a PEFT
    folder, or a GGUF LoRA file as llama.cpp writes it."""
    read = load_gguf_lora if os.path.isfile(path) and is_gguf_file(path) else load_peft
    return read(path, name, adapter_id, state.shape, state.max_rank, state.dtype, state.device)


class AdapterNotFound(KeyError):
    pass


class AdapterBusy(RuntimeError):
    """Every resident slot stayed in use past the wait."""


@dataclass
class Adapter:
    name: str
    path: str
    adapter_id: int
    resident: bool = False
    loading: bool = False
    active: int = 0  # requests holding it (acquire .. release)
    running: int = 0  # of those, the ones the engine has started (their first output arrived)
    removed: bool = False  # unloaded by name; its tensors go when its last request ends
    requests: int = 0  # served so far
    owner: str | None = None  # the tenant that loaded it over HTTP (tenants.owner_of; None: the operator)

    @property
    def in_use(self) -> bool:
        return self.active > 0 or self.loading


@dataclass
class AdapterManager:
    """The adapters a server knows, which are resident, and who is using them.

    Lives on the event loop; ``on_engine(fn)`` runs ``fn(state)`` on the engine
    thread between steps and returns an awaitable of its result."""

    state: LoraState
    on_engine: Callable[[Callable[[LoraState], Any]], Awaitable[Any]]
    adapters: dict[str, Adapter] = field(default_factory=dict)
    _lru: "OrderedDict[int, Adapter]" = field(default_factory=OrderedDict)  # resident by id, oldest use first
    _by_id: dict[int, Adapter] = field(default_factory=dict)  # every adapter a request may still hold
    _ids: Any = field(default_factory=lambda: itertools.count(1))
    _changed: asyncio.Condition | None = None
    loads: int = 0  # adapters read from disk for a request (the start's registrations not counted)

    # -- names ---------------------------------------------------------
    def names(self) -> list[str]:
        return list(self.adapters)

    def __contains__(self, name: object) -> bool:
        return name in self.adapters

    def resident_names(self) -> list[str]:
        return [a.name for a in self._lru.values()]

    def register_now(self, name: str, path: str) -> Adapter:
        """Register and, while there is room, install an adapter before the server serves
        (``--lora-modules``): checked here, so a bad one stops the start."""
        if name in self.adapters:
            raise LoraError(f"an adapter named {name!r} is already loaded")
        adapter = Adapter(name, path, next(self._ids))
        weights = read_adapter(self.state, name, path, adapter.adapter_id)
        if len(self._lru) < self.state.max_loras:
            self.state.install(weights)
            adapter.resident = True
            self._lru[adapter.adapter_id] = adapter
        self.adapters[name] = self._by_id[adapter.adapter_id] = adapter
        return adapter

    async def load(self, name: str, path: str, owner: str | None = None) -> Adapter:
        """Hot load: read and check it off the event loop, then install it (evicting an
        idle adapter if the resident set is full; when none is idle it stays registered
        and is loaded on first use). ``LoraError`` for a bad adapter."""
        if name in self.adapters:
            raise LoraError(f"an adapter named {name!r} is already loaded; unload it first")
        adapter = Adapter(name, path, next(self._ids), owner=owner)
        weights = await asyncio.to_thread(read_adapter, self.state, name, path, adapter.adapter_id)
        if name in self.adapters:  # a concurrent load of the same name won
            raise LoraError(f"an adapter named {name!r} is already loaded; unload it first")
        self.adapters[name] = self._by_id[adapter.adapter_id] = adapter
        if await self._make_room():
            await self._install(adapter, weights)
        log.info("LoRA adapter %r loaded from %s (rank %d, %s)", name, path, weights.rank, ", ".join(weights.targets))
        return adapter

    async def unload(self, name: str) -> None:
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise AdapterNotFound(name)
        adapter.removed = True
        if adapter.active == 0 and adapter.resident:
            await self._evict(adapter)
        log.info("LoRA adapter %r unloaded", name)

    # -- requests ------------------------------------------------------
    async def acquire(self, name: str, wait_s: float = SLOT_WAIT_S) -> int:
        """The id of adapter ``name``, resident, held for one request until ``release``."""
        adapter = self.adapters.get(name)
        if adapter is None:
            raise AdapterNotFound(name)
        adapter.active += 1
        try:
            deadline = asyncio.get_running_loop().time() + wait_s
            while not adapter.resident:
                if adapter.removed:
                    raise AdapterNotFound(name)
                # _make_room may await an eviction: another request may have started
                # loading this adapter meanwhile, so look again before claiming the slot.
                if not adapter.loading and await self._make_room() and not (adapter.loading or adapter.resident):
                    adapter.loading = True
                    try:
                        weights = await asyncio.to_thread(read_adapter, self.state, name, adapter.path,
                                                          adapter.adapter_id)
                        await self._install(adapter, weights)
                        self.loads += 1
                    finally:
                        adapter.loading = False
                        self._notify()
                    continue
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    raise AdapterBusy(f"all {self.state.max_loras} resident adapter slots stayed busy "
                                      f"for {wait_s:.0f}s (--max-loras)")
                await self._wait(left)
        except BaseException:
            self._drop(adapter)
            raise
        adapter.requests += 1
        self._lru.move_to_end(adapter.adapter_id)
        return adapter.adapter_id

    def started(self, adapter_id: int) -> None:
        """A request holding the adapter got its first output: it runs (metrics)."""
        adapter = self._by_id.get(adapter_id)
        if adapter is not None:
            adapter.running += 1

    def release(self, adapter_id: int, started: bool = False) -> None:
        adapter = self._by_id.get(adapter_id)
        if adapter is not None:
            if started:
                adapter.running -= 1
            self._drop(adapter)

    def request_counts(self) -> tuple[list[str], list[str]]:
        """Names of the adapters with running requests, and with waiting ones (vLLM's
        ``lora_requests_info`` labels)."""
        holders = [a for a in self._by_id.values() if a.active > 0]
        return ([a.name for a in holders if a.running > 0], [a.name for a in holders if a.active > a.running])

    def _drop(self, adapter: Adapter) -> None:
        adapter.active -= 1
        if adapter.active == 0 and adapter.removed:
            if adapter.resident:
                asyncio.get_running_loop().create_task(self._evict(adapter))
            else:
                self._by_id.pop(adapter.adapter_id, None)
        self._notify()

    # -- the resident set ------------------------------------------------
    def _slots_taken(self) -> int:
        """Resident adapters plus those being read or installed (each holds a slot)."""
        return len(self._lru) + sum(1 for a in self._by_id.values() if a.loading and not a.resident)

    async def _make_room(self) -> bool:
        """Whether a slot is free for one more adapter, evicting the least recently used
        idle one if needed. The count is taken again after the eviction: while it ran on
        the engine thread, another request may have claimed the slot it freed."""
        if self._slots_taken() < self.state.max_loras:
            return True
        victim = next((a for a in self._lru.values() if not a.in_use), None)
        if victim is None:
            return False
        await self._evict(victim)
        return self._slots_taken() < self.state.max_loras

    async def _install(self, adapter: Adapter, weights: LoraWeights) -> None:
        """Put the adapter's tensors in the model; it holds its slot (``loading``) from
        before the engine is asked until it is in the resident set."""
        held = adapter.loading
        adapter.loading = True
        try:
            await self.on_engine(lambda state: state.install(weights))
            adapter.resident = True
            self._lru[adapter.adapter_id] = adapter
        finally:
            adapter.loading = held

    async def _evict(self, adapter: Adapter) -> None:
        self._lru.pop(adapter.adapter_id, None)
        adapter.resident = False
        if adapter.removed:
            self._by_id.pop(adapter.adapter_id, None)
        await self.on_engine(lambda state: state.remove(adapter.adapter_id))
        self._notify()

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    def _notify(self) -> None:
        cond = self._condition()

        async def wake() -> None:
            async with cond:
                cond.notify_all()

        try:
            asyncio.get_running_loop().create_task(wake())
        except RuntimeError:  # no loop (start-up): nobody waits
            pass

    async def _wait(self, timeout: float) -> None:
        cond = self._condition()
        async with cond:
            try:
                await asyncio.wait_for(cond.wait(), timeout=min(timeout, 1.0))
            except asyncio.TimeoutError:
                pass


class LoraRequestsInfo:
    """vLLM's ``vllm:lora_requests_info`` gauge: which adapters have running and waiting
    requests and how many may be resident, as labels (the value is the time of the
    scrape); what a gateway reads to prefer a replica with an adapter resident."""

    def __init__(self, manager: AdapterManager) -> None:
        self.manager = manager

    def collect(self) -> Any:
        import time

        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        running, waiting = self.manager.request_counts()
        family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests.",
                                   labels=["running_lora_adapters", "max_lora", "waiting_lora_adapters"])
        family.add_metric([",".join(running), str(self.manager.state.max_loras), ",".join(waiting)], time.time())
        yield family
        resident = GaugeMetricFamily("tokenmill:lora_resident_info", "LoRA adapters resident now (labels; "
                                     "the value is their count).", labels=["resident_lora_adapters"])
        names = self.manager.resident_names()
        resident.add_metric([",".join(names)], len(names))
        yield resident
        loads = CounterMetricFamily("tokenmill:lora_loads", "LoRA adapters made resident for a request "
                                    "(each one a load from disk: few when requests find theirs resident).")
        loads.add_metric([], self.manager.loads)
        yield loads

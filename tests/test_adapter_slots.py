"""The resident set of LoRA adapters under concurrent requests: however requests for different
adapters interleave with evictions and installs running on the engine thread, the manager never
asks the model to hold more than ``max_loras`` adapters, and every request gets its adapter."""
from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.engine import adapters as adapters_mod
from tokenmill.engine.adapters import AdapterManager


@dataclass
class FakeWeights:
    adapter_id: int
    rank: int = 4
    targets: tuple[str, ...] = ("qkv_proj",)


@dataclass
class FakeState:
    """What the model holds: install refuses an adapter past ``max_loras``, like LoraState."""

    max_loras: int
    max_rank: int = 8
    shape: object = None
    dtype: object = None
    device: object = None
    adapters: dict[int, FakeWeights] = field(default_factory=dict)
    peak: int = 0

    def install(self, weights: FakeWeights) -> None:
        if weights.adapter_id not in self.adapters and len(self.adapters) >= self.max_loras:
            raise AssertionError(f"{self.max_loras} adapters are resident already")
        self.adapters[weights.adapter_id] = weights
        self.peak = max(self.peak, len(self.adapters))

    def remove(self, adapter_id: int) -> None:
        self.adapters.pop(adapter_id, None)


def _engine(state: FakeState, rng: random.Random):
    """An engine thread stand-in: calls run in the order they were made, each after a delay."""
    queue: asyncio.Queue = asyncio.Queue()

    def on_engine(fn):
        future = asyncio.get_running_loop().create_future()
        queue.put_nowait((fn, future))
        return future

    async def run() -> None:
        while True:
            fn, future = await queue.get()
            await asyncio.sleep(rng.random() * 0.002)
            try:
                future.set_result(fn(state))
            except Exception as exc:  # noqa: BLE001 - handed to the caller, as the engine does
                future.set_exception(exc)

    return on_engine, run


@contextlib.contextmanager
def _reading_stubbed():
    """Adapters "read from disk" as stand-ins (the manager only hands them to the state)."""
    original = adapters_mod.read_adapter
    adapters_mod.read_adapter = lambda state, name, path, adapter_id: FakeWeights(adapter_id)
    try:
        yield
    finally:
        adapters_mod.read_adapter = original


async def _serve(max_loras: int, names: list[str], requests: list[int], seed: int) -> FakeState:
    with _reading_stubbed():
        return await _serve_stubbed(max_loras, names, requests, seed)


async def _serve_stubbed(max_loras: int, names: list[str], requests: list[int], seed: int) -> FakeState:
    rng = random.Random(seed)
    state = FakeState(max_loras)
    on_engine, run = _engine(state, rng)
    worker = asyncio.get_running_loop().create_task(run())
    manager = AdapterManager(state, on_engine)  # type: ignore[arg-type]
    for name in names[:max_loras]:
        manager.register_now(name, f"/adapters/{name}")
    for name in names[max_loras:]:
        await manager.load(name, f"/adapters/{name}")

    async def one(name: str) -> None:
        await asyncio.sleep(rng.random() * 0.003)
        adapter_id = await manager.acquire(name, wait_s=30)
        assert adapter_id in state.adapters  # resident while held
        await asyncio.sleep(rng.random() * 0.003)
        manager.release(adapter_id)

    await asyncio.gather(*(one(names[i % len(names)]) for i in requests))
    worker.cancel()
    return state


@settings(max_examples=40, deadline=None)
@given(max_loras=st.integers(1, 3), n_adapters=st.integers(2, 6),
       requests=st.lists(st.integers(0, 5), min_size=1, max_size=24), seed=st.integers(0, 2**16))
def test_concurrent_requests_never_overfill_the_resident_set(max_loras, n_adapters, requests, seed):
    names = [f"a{i}" for i in range(n_adapters)]
    state = asyncio.run(_serve(max_loras, names, requests, seed))
    assert state.peak <= max_loras


def test_a_slot_freed_by_an_eviction_is_taken_once():
    # The interleaving that overfilled the set: one request evicts to make room and, while
    # the eviction runs on the engine thread, another takes the slot it freed.
    state = asyncio.run(_serve(2, ["a", "b", "c", "d"], [2, 3, 2, 3, 0, 1, 2, 3], seed=1))
    assert state.peak <= 2

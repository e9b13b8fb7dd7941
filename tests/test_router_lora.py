"""The router over three real servers (tiny model, in-process) serving eight LoRA adapters, two
resident per replica: requests go to replicas that hold their adapter (the servers' own load
counters say how often one had to be read from disk), and the prefix cache's hit rate is no lower
than for the same prompts on the base model."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest

from test_lora import make_adapters
from test_server_support import ThreadServer, make_tiny_app, metric
from tokenmill.router.config import RouterConfig
from tokenmill.router.server import RouterServer
from tokenmill.router.workload import run_workload, shared_prefix_workload

ADAPTERS = [f"a{i}" for i in range(8)]
MAX_LORAS = 3  # nine slots over three replicas: room for every adapter somewhere, not everywhere


@pytest.fixture(scope="module")
def replicas(hf_tiny, tmp_path_factory):
    made = make_adapters(hf_tiny, tmp_path_factory.mktemp("routed_adapters"),
                         {name: (4, 8, ["q_proj", "v_proj"]) for name in ADAPTERS}, 40)
    modules = [(name, folder) for name, (folder, _) in made.items()]
    apps = [make_tiny_app({"enable_lora": True, "max_loras": MAX_LORAS, "max_lora_rank": 8, "num_threads": 1,
                           "num_blocks": 256}, lora_modules=modules) for _ in range(3)]
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(ThreadServer(app)) for app in apps]
        yield [s.url for s in servers]
    for app in apps:
        app.state.tokenmill.aengine.shutdown()


def _loads(urls: list[str]) -> float:
    import httpx

    return sum(metric(httpx.get(u + "/metrics", timeout=10).text, "tokenmill:lora_loads_total") for u in urls)


def _run(urls, items):
    import httpx

    for u in urls:
        assert httpx.post(u + "/reset_prefix_cache", timeout=30).status_code == 200
    router = RouterServer(RouterConfig(backends=urls, port=0, policy="prefix", health_interval=0.3,
                                       remote_tokenize=False))
    router.start_in_thread()
    try:
        return asyncio.run(run_workload(router.url, items, concurrency=4, max_tokens=4, backends=urls, timeout=120))
    finally:
        router.stop()


def test_adapters_stay_on_replicas_that_hold_them_and_keep_the_hit_rate(replicas):
    base_items = shared_prefix_workload(len(ADAPTERS), per_prefix=6, prefix_words=40, seed=3)
    lora_items = [dataclasses.replace(it, model=ADAPTERS[it.prefix_id]) for it in base_items]
    before = _loads(replicas)
    lora = _run(replicas, lora_items)
    loads = _loads(replicas) - before
    base = _run(replicas, base_items)
    assert lora.ok == base.ok == len(base_items), [r.error for r in lora.results + base.results if not r.ok][:3]
    resident_share = 1 - loads / len(lora_items)
    print(f"8 adapters over 3 replicas ({MAX_LORAS} resident each): {loads:.0f} loads for {len(lora_items)} "
          f"requests, {resident_share:.2f} found theirs resident; prefix hit rate {lora.hit_rate:.3f} with "
          f"adapters vs {base.hit_rate:.3f} on the base model; per replica {lora.per_backend}")
    # each adapter is read about once (eight first uses, a few more while the router learns who holds what)
    assert loads <= len(ADAPTERS) + 4 and resident_share >= 0.75
    assert lora.hit_rate is not None and base.hit_rate is not None
    assert lora.hit_rate >= base.hit_rate - 0.05

"""The router's acceptance test with real servers: three `tokenmill serve`
replicas of the bundled model on loopback, each with a KV cache too small to
hold all eight shared prefixes, and the router in front.

Measured from the replicas' own prefix-cache counters: the prefix policy's
hit rate is at least twice round-robin's on the same workload, and when one
prefix is hot no replica takes more than a bounded share. Slow: a real model
prefills every prompt on the CPU.
"""
from __future__ import annotations

import asyncio

import httpx
import pytest

from test_server_support import metric, real_servers
from tokenmill.router.config import RouterConfig
from tokenmill.router.server import RouterServer
from tokenmill.router.workload import run_workload, shared_prefix_workload

pytestmark = pytest.mark.slow

N_PREFIXES = 8
PREFIX_WORDS = 80  # about 180 tokens (11 blocks) with the bundled model's tokenizer
CACHE_BLOCKS = 40  # room for three prefixes plus the running requests' own blocks, not for eight


def _cache_args() -> list[str]:
    """--kv-cache-memory-bytes for a pool of exactly CACHE_BLOCKS blocks of 16 tokens.

    SmolLM2-135M with a float32 pool: 30 layers x 3 KV heads x 64 dims x (K, V) x 4 bytes = 46,080 bytes
    per token."""
    return ["--kv-cache-memory-bytes", str(CACHE_BLOCKS * 16 * 46080), "--block-size", "16", "--dtype", "float32",
            "--kv-cache-dtype", "float32"]


@pytest.fixture(scope="module")
def replicas():
    with real_servers(*[_cache_args()] * 3, startup_timeout=300, env={"OMP_NUM_THREADS": "1"}) as servers:
        urls = [s.url for s in servers]
        for u in urls:  # the flags sized the pool as intended, or the hit rates below mean nothing
            text = httpx.get(u + "/metrics", timeout=10).text
            assert metric(text, "vllm:cache_config_info", num_gpu_blocks=str(CACHE_BLOCKS)) == 1, u
        yield urls


def _run(urls, items, policy, concurrency=3, **kw):
    for u in urls:
        assert httpx.post(u + "/reset_prefix_cache", timeout=30).status_code == 200
    router = RouterServer(RouterConfig(backends=urls, port=0, policy=policy, health_interval=1.0, **kw))
    router.start_in_thread()
    try:
        return asyncio.run(run_workload(router.url, items, concurrency, max_tokens=4, backends=urls, timeout=300))
    finally:
        router.stop()


def test_real_replicas_prefix_hit_rate_and_hot_prefix_share(replicas):
    items = shared_prefix_workload(N_PREFIXES, per_prefix=6, prefix_words=PREFIX_WORDS, seed=7)
    rr = _run(replicas, items, "round-robin")
    px = _run(replicas, items, "prefix")
    assert rr.ok == px.ok == len(items), [r.error for r in rr.results + px.results if not r.ok][:3]
    print(f"real replicas: hit rate prefix {px.hit_rate:.3f} vs round-robin {rr.hit_rate:.3f}; "
          f"TTFT p50 {px.ttft_pct(50):.2f}s vs {rr.ttft_pct(50):.2f}s; wall {px.wall_s:.1f}s vs {rr.wall_s:.1f}s")
    assert px.hit_rate is not None and rr.hit_rate is not None
    assert px.hit_rate >= 2 * rr.hit_rate

    hot = shared_prefix_workload(N_PREFIXES, per_prefix=3, prefix_words=PREFIX_WORDS, seed=8, hot_share=0.75)
    h = _run(replicas, hot, "prefix", concurrency=9)
    print(f"hot prefix: max share {h.max_share():.2f}, hit rate {h.hit_rate:.3f}, per backend {h.per_backend}")
    assert h.ok == len(hot)
    assert h.max_share() <= 0.6

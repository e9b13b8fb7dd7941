"""KV events end to end: `tokenmill serve --kv-events-config` replicas and `tokenmill route
--prefix-source events` in front. The router's view of each replica is what the replica says it
holds: a chat's blocks (tokenized as the replica renders them) after it ran, nothing after the
replica's cache was reset, and the router falls back to its guess for a replica without a stream.
Slow: real servers with the bundled model."""
from __future__ import annotations

import json

import httpx
import pytest

from conftest import wait_until
from fake_backend import free_port
from test_server_support import real_servers
from tokenmill.router.config import RouterConfig
from tokenmill.router.cache.kv_index import RoutingIndex
from tokenmill.router.server import RouterServer

pytestmark = pytest.mark.slow



def test_router_index_follows_replicas_events():
    streams = [f"tcp://127.0.0.1:{free_port()}"]  # one replica: its events alone must tell the router
    args = [["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "endpoint": ep}),
             "--dtype", "float32", "--max-num-seqs", "4"] for ep in streams]
    with real_servers(*args, startup_timeout=300, env={"OMP_NUM_THREADS": "1"}) as servers:
        urls = [s.url for s in servers]
        router = RouterServer(RouterConfig(backends=urls, port=0, health_interval=0.5, prefix_source="events",
                                           kv_events={u: (ep, None) for u, ep in zip(urls, streams)}))
        router.start_in_thread()
        try:
            system = "You are a careful assistant. " * 30
            body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Say hi."}],
                    "max_tokens": 4, "temperature": 0}
            r = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            served = r.headers.get("x-tokenmill-backend") or ""
            indexes = {u: b.index for u, b in router.router.pool.backends.items()}
            assert all(isinstance(ix, RoutingIndex) for ix in indexes.values())

            async def keys():
                return await router.router.block_keys("/v1/chat/completions", body, list(
                    router.router.pool.backends.values()))

            import asyncio
            fut = asyncio.run_coroutine_threadsafe(keys(), router._loop)
            chat_keys = fut.result(30)
            assert len(chat_keys) >= 10  # ~200 tokens of system prompt
            # The replica says (in events) it holds every full block of the prompt: the router's keys
            # (the chat tokenized as the replica renders it) and the replica's blocks line up.
            holder = [u for u, ix in indexes.items() if wait_until(lambda ix=ix: ix.events.match(chat_keys, now=0.0)
                                                              == len(chat_keys), 5)]
            assert len(holder) == 1, {u: ix.events.match(chat_keys, now=0.0) for u, ix in indexes.items()}
            assert served and holder[0].endswith(served)
            assert indexes[holder[0]].live()
            # The same conversation again hits the replica's cache.
            r2 = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=120)
            assert r2.status_code == 200 and r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * 10
            # A reset empties the replica's cache: its events say so and the router forgets it.
            assert httpx.post(holder[0] + "/reset_prefix_cache", timeout=30).status_code == 200
            assert wait_until(lambda: indexes[holder[0]].events.match(chat_keys, now=0.0) == 0, 10)
            # A conversation whose second turn changes a nonce inside its system prompt: the replica
            # names the miss (volatile span) in its metrics.
            for turn, nonce in enumerate(("a81f3c9e", "5d20b7e4")):
                msgs = [{"role": "system", "content": system[:200] + f" Request {nonce}. " + system[200:]},
                        {"role": "user", "content": "Say hi." if turn == 0 else "Again."}]
                r = httpx.post(holder[0] + "/v1/chat/completions", headers={"x-session-id": "conv-1"},
                               json={"messages": msgs, "max_tokens": 2}, timeout=120)
                assert r.status_code == 200, r.text
            text = httpx.get(holder[0] + "/metrics", timeout=10).text
            assert 'tokenmill:prefix_cache_misses_total{reason="volatile_span"} 1.0' in text, [
                line for line in text.splitlines() if "misses" in line]
        finally:
            router.stop()

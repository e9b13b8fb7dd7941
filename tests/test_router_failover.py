"""Failures: a backend killed mid-run (what it held is refused, not replayed), a stream broken after its first byte,
a backend failing its health check, and DNS-discovered backends.

Fake backends run as subprocesses so a test can SIGKILL one, which is what a
crashed replica looks like to the router: refused connections and resets.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from fake_backend import FakeProcess, start_fakes
from tokenmill.router.config import RouterConfig
from tokenmill.router.server import RouterServer
from tokenmill.router.workload import Result, one_request, shared_prefix_workload

INTERVAL = 0.5


def _router(urls, **kw) -> RouterServer:
    kw.setdefault("health_interval", INTERVAL)
    return RouterServer(RouterConfig(backends=urls, port=0, **kw)).start_in_thread()


def _state(router: RouterServer) -> dict[str, dict]:
    return {b["url"]: b for b in httpx.get(router.url + "/router/backends").json()["backends"]}


def _sample(text: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def _wait(pred, timeout: float) -> float:
    """Seconds until ``pred()`` held; fails after ``timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError("condition not reached in time")


def test_backend_killed_mid_run_then_restarted():
    # Two sequences at a time and 12 tokens each: many requests queue on every
    # replica, so the killed one has both streaming and not-yet-started requests.
    fakes = start_fakes(3, max_num_seqs=2, decode_s_per_token=0.02)
    urls = [f.url for f in fakes]
    victim = fakes[1]
    victim_ep = victim.url.split("//")[1]
    router = _router(urls, policy="round-robin")
    try:
        items = shared_prefix_workload(n_prefixes=4, per_prefix=9, prefix_words=60, seed=3)
        kill_at: list[float] = []

        async def go() -> list[Result]:
            async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as c:
                tasks = []
                for it in items:
                    tasks.append(asyncio.create_task(one_request(c, router.url, it.prompt, 12, timeout=20)))
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.15)
                kill_at.append(time.monotonic())
                # Kill off the event loop so the client keeps timestamping bytes meanwhile.
                await asyncio.get_running_loop().run_in_executor(None, victim.kill)
                return await asyncio.gather(*tasks)

        results = asyncio.run(go())
        # A byte the router relayed just before the kill reaches the client a
        # moment later (longer on a loaded machine). The victim sends nothing once
        # killed, so a stream whose first byte came from it started before the kill.
        killed = kill_at[0] + 2.0
        streaming_on_victim = [r for r in results if r.backend == victim_ep and r.first_byte_at
                               and r.first_byte_at < killed]
        others = [r for r in results if r not in streaming_on_victim]
        print(f"streaming on victim at kill: {len(streaming_on_victim)}, failed: {sum(not r.ok for r in streaming_on_victim)}, others ok: {sum(r.ok for r in others)}/{len(others)}")
        assert streaming_on_victim, "the kill should catch some streams in flight"
        # Requests the victim held when it died are refused (502 backend_died), never replayed on
        # another replica: one of them may be what killed it. Everything else succeeded elsewhere.
        refused = [r for r in others if not r.ok]
        assert all(r.error and r.error.startswith("HTTP 502") and "while handling this request" in r.error for r in refused), \
            [r.error for r in refused]
        assert len(refused) < len(others) // 2, [r.error for r in refused]
        assert not any(r.backend == victim_ep for r in others if r.first_byte_at and r.first_byte_at > killed)
        # Streams cut by the kill ended with an error event, promptly (no hang).
        for r in streaming_on_victim:
            if not r.ok:
                assert r.error and r.error.startswith("stream error"), r.error
                assert r.latency < 10
        text = httpx.get(router.url + "/metrics").text
        poisoned = _sample(text, "tokenmill_router_poisoned_requests_total")
        print("refused as poisoned", poisoned, "retried", _sample(text, "tokenmill_router_retries_total"))
        assert poisoned == len(refused)
        assert _state(router)[victim.url]["healthy"] is False

        # Restart on the same port: back in rotation within the health interval.
        restarted = FakeProcess(victim.port, victim.name, victim.args)
        fakes.append(restarted)  # killed in the finally block with the others
        restarted.start().wait_ready()
        restarted_at = time.monotonic()
        _wait(lambda: _state(router)[victim.url]["healthy"], INTERVAL + 1.0)
        assert time.monotonic() - restarted_at <= INTERVAL + 1.0
        served = set()
        for i in range(6):
            r = httpx.post(router.url + "/v1/completions", json={"prompt": f"fresh {i}", "max_tokens": 1}, timeout=10)
            assert r.status_code == 200
            served.add(r.headers["x-tokenmill-backend"])
        assert victim_ep in served
    finally:
        router.stop()
        for f in fakes:
            f.kill()


def test_idle_dead_backend_leaves_rotation_within_health_interval():
    fakes = start_fakes(2)
    router = _router([f.url for f in fakes])
    try:
        _wait(lambda: all(b["healthy"] for b in _state(router).values()), 5)
        fakes[0].kill()  # no traffic: only the periodic check can notice
        took = _wait(lambda: not _state(router)[fakes[0].url]["healthy"], INTERVAL + 1.0)
        assert took <= INTERVAL + 1.0
        for i in range(4):
            r = httpx.post(router.url + "/v1/completions", json={"prompt": f"p {i}", "max_tokens": 1}, timeout=10)
            assert r.status_code == 200 and r.headers["x-tokenmill-backend"] == fakes[1].url.split("//")[1]
    finally:
        router.stop()
        for f in fakes:
            f.kill()


def test_stream_broken_after_first_byte_ends_with_error_event():
    (fake,) = start_fakes(1, decode_s_per_token=0.2)
    router = _router([fake.url])
    try:
        events = []
        t0 = time.monotonic()
        body = {"prompt": "tell me a long story", "max_tokens": 50, "stream": True}
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=15) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 2:
                    fake.kill()
        assert time.monotonic() - t0 < 10
        last = json.loads(events[-1])
        assert "error" in last and last["error"]["code"] == "backend_stream_broken"
        assert "[DONE]" not in events
    finally:
        router.stop()
        fake.kill()


def test_failing_health_check_takes_backend_out_and_back():
    fakes = start_fakes(2)
    router = _router([f.url for f in fakes], policy="round-robin")
    try:
        _wait(lambda: all(b["healthy"] for b in _state(router).values()), 5)
        httpx.post(fakes[0].url + "/admin/health", json={"healthy": False})
        _wait(lambda: not _state(router)[fakes[0].url]["healthy"], INTERVAL + 1.0)
        eps = {httpx.post(router.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
               .headers["x-tokenmill-backend"] for _ in range(4)}
        assert eps == {fakes[1].url.split("//")[1]}
        httpx.post(fakes[0].url + "/admin/health", json={"healthy": True})
        _wait(lambda: _state(router)[fakes[0].url]["healthy"], INTERVAL + 1.0)
        assert "tokenmill_router_backend_health_changes_total" in httpx.get(router.url + "/metrics").text
    finally:
        router.stop()
        for f in fakes:
            f.kill()


def test_backends_discovered_through_dns():
    (fake,) = start_fakes(1)
    router = _router([], backend_dns=[f"localhost:{fake.port}"])
    try:
        want = f"http://127.0.0.1:{fake.port}"
        _wait(lambda: _state(router).get(want, {}).get("healthy", False), 5)
        r = httpx.post(router.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 1}, timeout=10)
        assert r.status_code == 200
    finally:
        router.stop()
        fake.kill()


def test_client_disconnect_releases_backend_and_aborts_upstream():
    (fake,) = start_fakes(1, decode_s_per_token=0.1)
    router = _router([fake.url])
    try:
        body = {"prompt": "a long answer please", "max_tokens": 100, "stream": True}
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=15) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # hang up after the first event
        _wait(lambda: _state(router)[fake.url]["in_flight"] == 0, 3)

        def backend_idle() -> bool:
            m = httpx.get(fake.url + "/metrics").text
            return 'vllm:num_requests_running{model_name="fake-model"} 0' in m

        # The router closed its upstream stream too, so the backend stopped generating.
        _wait(backend_idle, 3)
    finally:
        router.stop()
        fake.kill()


def test_rejecting_backend_is_retried_elsewhere_or_passed_through():
    fakes = start_fakes(2)
    httpx.post(fakes[0].url + "/admin/reject", json={"status": 429})
    both = _router([f.url for f in fakes], policy="round-robin")
    alone = _router([fakes[0].url])
    try:
        for i in range(4):
            r = httpx.post(both.url + "/v1/completions", json={"prompt": f"q {i}", "max_tokens": 1}, timeout=10)
            assert r.status_code == 200 and r.headers["x-tokenmill-backend"] == fakes[1].url.split("//")[1]
        # Every attempt on the rejecting replica was retried once on the other.
        text = httpx.get(both.url + "/metrics").text
        tried_on_rejecting = _state(both)[fakes[0].url]["requests_total"]
        assert tried_on_rejecting >= 2  # round-robin offered it at least every other time
        assert _sample(text, "tokenmill_router_retries_total") == tried_on_rejecting
        r = httpx.post(alone.url + "/v1/completions", json={"prompt": "q", "max_tokens": 1}, timeout=10)
        assert r.status_code == 429 and r.json()["error"]["message"] == "rejected"
    finally:
        both.stop()
        alone.stop()
        for f in fakes:
            f.kill()

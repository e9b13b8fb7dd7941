"""Fair before admission (tiny model): one tenant's flood is refused for its share of the waiting
room (``tenant_queue_share``) before it takes a quiet tenant's place or the best class's, and a
tenant past its limits is refused before its grammar is compiled, so it never fills the
grammar-compile queue another tenant's new schema needs."""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import pytest

from test_grammar_safety import wide_schema
from test_server_support import ThreadServer, make_tiny_app

from tokenmill.settings.grammar_limits import GrammarLimits
from tokenmill.gateway.tenants import hash_key

KEYS = {"flood-key": "flood", "quiet-key": "quiet", "crit-key": "crit", "limited-key": "limited"}
TENANTS = ("tenants:\n"
           "  flood: {priority_class: normal}\n"
           "  quiet: {priority_class: normal}\n"
           "  crit: {priority_class: critical}\n"
           "  limited: {priority_class: normal, max_inflight: 1}\n")


def keys_file(tmp_path: Any) -> str:
    path = tmp_path / "keys.yaml"
    path.write_text(TENANTS + "keys:\n" + "".join(f"  - {{sha256: {hash_key(k)}, tenant: {t}}}\n"
                                                  for k, t in KEYS.items()))
    return str(path)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def completion(i: int, max_tokens: int = 2, **extra: Any) -> dict[str, Any]:
    return {"prompt": f"tiny {i}", "max_tokens": max_tokens, "temperature": 0, **extra}


def schema_request(schema: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


async def _until(predicate: Any, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def test_a_flood_is_refused_for_its_share_and_the_quiet_and_critical_tenants_get_in(tmp_path):
    """The engine thread is stalled, so what is admitted stays in the waiting room: the flood
    fills its share and the open part, then gets ``tenant_queue_share`` while room is left;
    the quiet tenant and the critical one are admitted into what is kept for them."""
    app = make_tiny_app(max_waiting=8, api_keys_file=keys_file(tmp_path))
    state = app.state.tokenmill

    async def scenario() -> tuple[list[httpx.Response], list[httpx.Response]]:
        release = threading.Event()
        stall = state.aengine.call(lambda engine: release.wait(60))
        await asyncio.sleep(0.05)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     timeout=60) as client:
            def post(i: int, key: str) -> asyncio.Task:
                return asyncio.create_task(client.post("/v1/completions", json=completion(i), headers=auth(key)))

            flood = [post(i, "flood-key") for i in range(12)]
            # every flood request is either refused or waiting behind the stalled engine
            assert await _until(lambda: sum(t.done() for t in flood) + state.num_waiting() == len(flood))
            others = []
            for i, key in enumerate(["quiet-key", "crit-key", "crit-key"]):
                before = state.num_waiting()
                task = post(100 + i, key)
                others.append(task)
                assert await _until(lambda: task.done() or state.num_waiting() == before + 1)
                assert not task.done(), task.result().text  # admitted: it waits like the flood
            release.set()
            await stall
            return list(await asyncio.gather(*flood)), list(await asyncio.gather(*others))

    try:
        flood, others = asyncio.run(scenario())
        assert [r.status_code for r in others] == [200, 200, 200], [r.text for r in others]
        refused = [r for r in flood if r.status_code == 429]
        assert refused and all(r.status_code in (200, 429) for r in flood)
        for r in refused:
            assert r.json()["error"]["code"] == "tenant_queue_share", r.text
            assert int(r.headers["retry-after"]) >= 1
        assert state.admission.room.total == 0 and state.admission.pending == 0
    finally:
        state.aengine.shutdown()


def test_a_tenant_at_its_limit_is_refused_before_its_grammar_is_compiled(tmp_path):
    """A tenant at ``max_inflight`` gets its 429 before compiling: even a schema the compiler
    would refuse is not looked at, and nothing of its reaches the grammar workers."""
    app = make_tiny_app(api_keys_file=keys_file(tmp_path))
    state = app.state.tokenmill
    structured = state.engine.structured
    state.tenant_gate.load("limited").inflight = 1  # at its max_inflight: one request in flight

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     timeout=60) as client:
            bad = schema_request({"type": "object", "properties": {"a": {"type": "no-such-type"}}})
            fresh = [schema_request(wide_schema(40, 9000 + i)) for i in range(6)]
            return list(await asyncio.gather(*(client.post("/v1/chat/completions", json=body,
                                                           headers=auth("limited-key"))
                                               for body in [bad, *fresh])))

    try:
        compiled = structured.workers.compiled
        for r in asyncio.run(scenario()):
            assert r.status_code == 429, r.text
            assert r.json()["error"]["code"] == "tenant_inflight_limit"
        assert structured.workers.compiled == compiled and not state.admission.compiles.held
        state.tenant_gate.load("limited").inflight = 0
    finally:
        state.aengine.shutdown()


@pytest.mark.slow  # a real server on loopback under a bounded flood
def test_over_loopback_a_flood_and_a_tenant_at_its_limit_do_not_crowd_out_the_others(tmp_path):
    """One tenant floods tiny requests (each refusal retried at once; bounded in count and time)
    while a quiet tenant sends a handful and the critical one a few: every one of theirs is
    served and the flood gets 429s. Then a tenant at its ``max_inflight`` sends new schemas
    while another tenant sends one: theirs get the tenant's 429 without compiling, the other's
    compiles (the compile queue holds two)."""
    options = {"max_num_seqs": 1, "grammar_limits": GrammarLimits(queue_size=2, workers=1)}
    app = make_tiny_app(options, max_waiting=6, api_keys_file=keys_file(tmp_path))
    state = app.state.tokenmill
    with ThreadServer(app) as srv:
        stop = threading.Event()
        flood_codes: list[int] = []

        def flooder(worker: int) -> None:
            with httpx.Client(base_url=srv.url, timeout=60) as client:
                for attempt in range(200):
                    if stop.is_set():
                        return
                    r = client.post("/v1/completions", headers=auth("flood-key"),
                                    json=completion(worker * 1000 + attempt, max_tokens=8, ignore_eos=True))
                    flood_codes.append(r.status_code)

        threads = [threading.Thread(target=flooder, args=(w,)) for w in range(12)]
        for t in threads:
            t.start()
        try:
            deadline = time.monotonic() + 30
            while 429 not in flood_codes and time.monotonic() < deadline:  # the room is full of the flood
                time.sleep(0.01)
            with httpx.Client(base_url=srv.url, timeout=60) as client:
                served = [client.post("/v1/completions", headers=auth(key), json=completion(i)).status_code
                          for i, key in enumerate(["quiet-key"] * 5 + ["crit-key"] * 3)]
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert served == [200] * 8, served
        assert 429 in flood_codes and set(flood_codes) <= {200, 429}

        state.tenant_gate.load("limited").inflight = 1  # at its max_inflight

        async def schemas() -> tuple[list[httpx.Response], httpx.Response]:
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
                limited = [asyncio.create_task(client.post("/v1/chat/completions", headers=auth("limited-key"),
                                                           json=schema_request(wide_schema(300, 100 + i))))
                           for i in range(8)]
                await asyncio.sleep(0.2)
                other = await client.post("/v1/chat/completions", headers=auth("quiet-key"),
                                          json=schema_request(wide_schema(300, 999)))
                return list(await asyncio.gather(*limited)), other

        limited, other = asyncio.run(schemas())
        state.tenant_gate.load("limited").inflight = 0
        assert other.status_code == 200, other.text
        for r in limited:
            assert r.status_code == 429 and r.json()["error"]["code"] == "tenant_inflight_limit", r.text
    state.aengine.shutdown()
    state.engine.close()

"""Responses API conversations through the router: a continuation (``previous_response_id``)
reaches the replica that stores the conversation even while that replica is the busiest,
whether the id was learned from a plain answer or a stream; a conversation whose replica
is gone is a 502 that says so, never another replica's 404. Two fake replicas
(tests/fake_backend.py) on loopback, the router in a thread."""
from __future__ import annotations

import json

import httpx
import pytest

from conftest import wait_until
from fake_backend import start_fakes
from tokenmill.router.config import RouterConfig
from tokenmill.router.server import RouterServer
from tokenmill.router.sessions import ResponseIdSniffer, SessionTable

# One request in flight makes a replica "overloaded" next to an idle one, so without
# conversation affinity every continuation sent while its replica is busy would move.
TOUCHY = {"policy": "least-load", "imbalance_abs": 0.0, "imbalance_rel": 1.0}


@pytest.fixture
def two_replicas():
    fakes = start_fakes(2, decode_s_per_token=0.002)
    router = RouterServer(RouterConfig(backends=[f.url for f in fakes], port=0, health_interval=0.3,
                                       remote_tokenize=False, **TOUCHY)).start_in_thread()
    try:
        yield router, {f.url: f for f in fakes}
    finally:
        router.stop()
        for f in fakes:
            f.kill()


def respond(client: httpx.Client, url: str, previous: str | None = None, **extra) -> httpx.Response:
    body = {"model": "fake-model", "input": "hello there", "max_output_tokens": 2, **extra}
    if previous is not None:
        body["previous_response_id"] = previous
    return client.post(url + "/v1/responses", json=body, timeout=30)


def streamed_id(client: httpx.Client, url: str, previous: str) -> tuple[str, str]:
    """A streamed continuation read to its end: (its response id, the replica that served it)."""
    body = {"model": "fake-model", "input": "streamed", "max_output_tokens": 3, "stream": True,
            "previous_response_id": previous}
    with client.stream("POST", url + "/v1/responses", json=body, timeout=30) as r:
        assert r.status_code == 200
        text = "".join(r.iter_text())
        served = r.headers["x-fake-backend"]
    created = next(json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:"))
    return created["response"]["id"], served


@pytest.mark.timeout(120)
def test_a_continuation_reaches_its_busy_replica_and_a_gone_one_is_a_clear_502(two_replicas):
    router, fakes = two_replicas
    with httpx.Client() as client:
        first = respond(client, router.url)
        assert first.status_code == 200, first.text
        rid, home = first.json()["id"], first.headers["x-fake-backend"]
        # keep the conversation's replica busy: a long streamed turn of the same conversation
        busy = {"model": "fake-model", "input": "long", "max_output_tokens": 100000, "stream": True,
                "previous_response_id": rid}
        with client.stream("POST", router.url + "/v1/responses", json=busy, timeout=30) as long_turn:
            assert long_turn.status_code == 200 and long_turn.headers["x-fake-backend"] == home
            chunks = long_turn.iter_raw()  # held: a dropped iterator would close the stream
            next(chunks)
            loads = {b["url"]: b["in_flight"] for b in router.call(router.router.snapshot)["backends"]}
            assert sorted(loads.values()) == [0, 1]  # the home is the busier replica
            again = respond(client, router.url, rid)
            assert again.status_code == 200, again.text
            assert again.headers["x-fake-backend"] == home
            # an id learned from a stream's events: its continuation goes home too
            sid, served = streamed_id(client, router.url, again.json()["id"])
            assert served == home
            after_stream = respond(client, router.url, sid)
            assert after_stream.status_code == 200 and after_stream.headers["x-fake-backend"] == home
            stored = client.get(router.url + f"/v1/responses/{sid}", timeout=30)
            assert stored.status_code == 200 and stored.headers["x-fake-backend"] == home
        # the conversation's replica dies: the router says so rather than ask another replica
        home_url = next(url for url, f in fakes.items() if f.name == home)
        fakes[home_url].kill()
        assert wait_until(lambda: not any(b["healthy"] for b in router.call(router.router.snapshot)["backends"]
                                          if b["url"] == home_url), timeout=20)
        gone = respond(client, router.url, after_stream.json()["id"])
        assert gone.status_code == 502, gone.text
        err = gone.json()["error"]
        assert err["code"] == "conversation_replica_unavailable" and home_url in err["message"]
        fresh = respond(client, router.url)  # a new conversation is served by the replica left
        assert fresh.status_code == 200


def test_the_id_is_found_however_the_stream_is_split_and_the_table_is_bounded():
    event = (b'event: response.created\ndata: {"type":"response.created","sequence_number":0,'
             b'"response":{"id":"resp_abc","object":"response","status":"in_progress"}}\n\n')
    for size in (1, 7, 64, len(event)):
        sniffer = ResponseIdSniffer()
        found = [sniffer.feed(event[i:i + size]) for i in range(0, len(event), size)]
        assert [f for f in found if f] == ["resp_abc"]
    big = b'data: {"type":"response.output_text.delta","delta":"' + b"x" * (1 << 20) + b'"}\n\n'
    sniffer = ResponseIdSniffer()
    assert sniffer.feed(big) is None and len(sniffer._line) == 0  # an over-long line is not held
    assert sniffer.feed(event) == "resp_abc"
    table = SessionTable(responses=2)
    for rid in ("r1", "r2", "r3"):
        table.learn_response(rid, "http://replica")
    assert table.response_home("r1") is None and table.response_home("r3") == "http://replica"
    for i in range(5):  # sessions do not evict conversations
        table.settle(f"session:{i}", "http://other", kept=False)
    assert table.response_home("r2") == "http://replica"


@pytest.mark.timeout(60)
def test_an_id_the_router_never_saw_is_found_by_asking_each_replica_then_remembered(two_replicas):
    router, fakes = two_replicas
    url, fake = next(iter(fakes.items()))
    with httpx.Client() as client:
        made = respond(client, url)  # straight to one replica: the router never saw it
        rid = made.json()["id"]
        assert router.call(router.router.sessions.response_home, rid) is None
        found = client.get(router.url + f"/v1/responses/{rid}", timeout=30)
        assert found.status_code == 200 and found.headers["x-fake-backend"] == fake.name
        assert router.call(router.router.sessions.response_home, rid) == url
        assert client.get(router.url + "/v1/responses/resp_nobody", timeout=30).status_code == 404

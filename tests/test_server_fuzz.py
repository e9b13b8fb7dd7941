"""Fuzz the server with request bodies generated from its own OpenAPI schema
(schemathesis): whatever a client sends, the answer is never a 5xx, and the
engine is alive and leak-free afterwards.

Runs in-process on the tiny random model with outputs capped at 4 tokens
(``--max-output-tokens``), so a few hundred requests take seconds.
"""
from __future__ import annotations

import time
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings

from test_server_support import make_tiny_app

schemathesis = pytest.importorskip("schemathesis")

APP = make_tiny_app(engine_options={"num_blocks": 256, "max_num_batched_tokens": 512}, max_output_tokens=4)
STATUSES: Counter[tuple[str, int]] = Counter()
schema = schemathesis.openapi.from_asgi("/openapi.json", APP).include(method="POST")


@schema.parametrize()
@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_fuzz_no_server_errors(case):
    response = case.call()
    STATUSES[(case.path, response.status_code)] += 1
    assert response.status_code < 500, (case.body, response.status_code, response.text[:500])
    if response.status_code >= 400 and case.path.startswith("/v1/messages"):  # Anthropic's shape
        body = response.json()
        assert body["type"] == "error" and {"type", "message"} <= set(body["error"])
    elif response.status_code >= 400:
        err = response.json()["error"]
        assert {"message", "type", "param", "code"} <= set(err)


def test_engine_alive_and_clean_after_fuzz():
    """Runs after the fuzz test (file order): the engine survived all of it."""
    from starlette.testclient import TestClient

    state = APP.state.tokenmill
    print(sorted(STATUSES.items()))
    # the fuzzer got past validation too, not only into 400s
    # (chat's schema now holds tools, response formats and guided fields: most random chat
    # bodies are rightly refused, and only a few get through to the engine)
    assert STATUSES[("/v1/completions", 200)] >= 5 and STATUSES[("/v1/chat/completions", 200)] >= 2
    client = TestClient(APP)
    assert client.get("/health").status_code == 200
    r = client.post("/v1/completions", json={"prompt": "still here", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    deadline = time.monotonic() + 5
    while state.engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert state.engine.pool.usage == 0
    state.engine.check_idle_invariants()
    assert state.admission.pending == 0

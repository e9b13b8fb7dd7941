"""Canary split over two real `tokenmill serve` replicas of the bundled model.

The base serves float32 weights, the canary int4 (`--quantization int4`); the
router splits 50/50. Per-variant request and token counters must add up to the
router's totals and to what the clients received, and a session key must keep
every request of a session on one variant. ``N_REQUESTS`` bounds the CPU time.
"""
from __future__ import annotations

import asyncio
import os
from collections import Counter

import httpx
import pytest

from test_server_support import metric, real_servers
from tokenmill.router.canary.canary import CanaryConfig
from tokenmill.router.config import RouterConfig
from tokenmill.router.server import RouterServer
from tokenmill.router.canary.variants import parse_variant

pytestmark = pytest.mark.slow

N_REQUESTS = int(os.environ.get("TOKENMILL_CANARY_REQUESTS", "40"))


@pytest.fixture(scope="module")
def servers():
    # both pinned to float32 around their weights, as the offline eval they are compared with
    with real_servers(["--max-num-seqs", "8", "--dtype", "float32", "--quantization", "none"],
                      ["--max-num-seqs", "8", "--dtype", "float32", "--quantization", "int4"],
                      startup_timeout=300, env={"OMP_NUM_THREADS": "1"}) as (base, int4):
        yield {"base": base.url, "int4": int4.url}


async def _drive(url: str, n: int, model: str) -> list[tuple[int, str | None, str, int]]:
    """n streamed chat requests, half with a session header (8 sessions); (status, variant, session, tokens)."""
    sem = asyncio.Semaphore(4)
    out = []

    async def one(i: int, client: httpx.AsyncClient) -> None:
        session = f"s{i % 8}" if i % 2 else ""
        headers = {"x-session-id": session} if session else {}
        body = {"model": model, "messages": [{"role": "user", "content": f"Say a word about the number {i}."}],
                "max_tokens": 3, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        async with sem:
            tokens = 0
            async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"usage"' in line:
                        import json

                        usage = json.loads(line[6:]).get("usage") or {}
                        tokens = usage.get("completion_tokens") or tokens
            out.append((r.status_code, r.headers.get("x-tokenmill-variant"), session, tokens))

    async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
        await asyncio.gather(*(one(i, client) for i in range(n)))
    return out


def test_float32_and_int4_replicas_at_50_50(servers):
    canary = CanaryConfig([parse_variant(f"base={servers['base']}"), parse_variant(f"int4={servers['int4']}")],
                          {"int4": 50})
    router = RouterServer(RouterConfig(port=0, canary=canary, health_interval=1.0)).start_in_thread()
    try:
        model = httpx.get(servers["base"] + "/v1/models").json()["data"][0]["id"]
        res = asyncio.run(_drive(router.url, N_REQUESTS, model))
        text = httpx.get(router.url + "/metrics").text
    finally:
        router.stop()
    assert [r for r in res if r[0] != 200] == []
    counts = Counter(v for _, v, _, _ in res)
    print(f"{N_REQUESTS} requests: {dict(counts)}")
    assert set(counts) == {"base", "int4"}
    sessions: dict[str, set] = {}
    for _, v, s, _ in res:
        if s:
            sessions.setdefault(s, set()).add(v)
    assert all(len(v) == 1 for v in sessions.values()), sessions
    # Requests without a session key split exactly by weight.
    unkeyed = Counter(v for _, v, s, _ in res if not s)
    assert abs(unkeyed["base"] - unkeyed["int4"]) <= 1
    per_variant = {v: metric(text, "tokenmill_router_variant_requests_total", variant=v) for v in ("base", "int4")}
    assert per_variant == {v: float(counts[v]) for v in ("base", "int4")}
    assert sum(per_variant.values()) == metric(text, "tokenmill_router_requests_total") == N_REQUESTS
    assert sum(per_variant.values()) == metric(text, "tokenmill_router_responses_total", code="200")
    assert metric(text, "tokenmill_router_variant_output_tokens_total") == sum(t for *_, t in res) > 0
    assert metric(text, "tokenmill_router_variant_ttft_seconds_count") == N_REQUESTS


EVAL_ITEMS = [
    {"id": "capital-france", "messages": [{"role": "user", "content": "What is the capital of France?"}],
     "answer": "Paris", "match": "contains", "max_tokens": 12},
    {"id": "sky", "messages": [{"role": "user", "content": "What color is the sky on a clear day?"}],
     "answer": "blue", "match": "contains", "max_tokens": 12},
    {"id": "count", "prompt": "1, 2, 3, 4,", "answer": r"\b5\b", "match": "regex", "max_tokens": 4},
    {"id": "mc-spain", "prompt": "The capital of Spain is", "choices": [" Madrid", " Paris", " Lisbon"],
     "answer": " Madrid", "match": "choice"},
]


def test_http_eval_on_the_two_servers_matches_offline(servers, tmp_path, capsys):
    """`tokenmill eval --url --candidate-url` on the float32 and int4 servers against the offline eval
    of the same configurations. Items that need prompt logprobs run only where the server has them."""
    import json

    from tokenmill.entrypoints.cli.main import main

    data = tmp_path / "set.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in EVAL_ITEMS))
    off, on = tmp_path / "off.json", tmp_path / "on.json"
    assert main(["eval", "--eval-set", str(data), "--no-text", "--no-speed", "--candidate", "int4",
                 "--threads", "1", "--no-safety", "--output", str(off)]) in (0, 1)
    capsys.readouterr()
    assert main(["eval", "--url", servers["base"], "--candidate-url", servers["int4"], "--eval-set", str(data),
                 "--no-text", "--no-safety", "--output", str(on)]) in (0, 1)
    notes = capsys.readouterr().err
    a, b = json.loads(off.read_text()), json.loads(on.read_text())
    served = {i["id"] for i in b["base"]["items"]}
    if "mc-spain" not in served:
        assert "choice items and perplexity skipped" in notes
    print(f"offline {a['base']['accuracy']}/{a['candidates'][0]['accuracy']} "
          f"agreement {a['comparisons'][0]['agreement']}; over HTTP {b['base']['accuracy']}/"
          f"{b['candidates'][0]['accuracy']} agreement {b['comparisons'][0]['agreement']} ({sorted(served)})")
    for x, y in ((a["base"], b["base"]), (a["candidates"][0], b["candidates"][0])):
        got = {i["id"]: i for i in y["items"]}
        for item in x["items"]:
            if item["id"] in got:
                assert got[item["id"]]["correct"] == item["correct"], (x["label"], item["id"])
    # The float32 base answers exactly as offline.
    got = {i["id"]: i["output"] for i in b["base"]["items"]}
    assert all(got[i["id"]] == i["output"] for i in a["base"]["items"] if i["id"] in got)

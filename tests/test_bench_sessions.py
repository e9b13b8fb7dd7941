"""Session-aware replay and Mooncake traces: conversations replay as chains (each turn after the
previous answer, extending it), and hash-only traces round-trip with their prefix structure."""
from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from fake_openai_server import FakeConfig, FakeServer  # noqa: E402

from tokenmill.bench.client import Target  # noqa: E402
from tokenmill.bench.loadgen import LoadShape  # noqa: E402
from tokenmill.bench.traces.mooncake import is_mooncake, read_mooncake, to_mooncake  # noqa: E402
from tokenmill.bench.runner import BenchConfig, BenchResult, run_bench  # noqa: E402
from tokenmill.bench.traces.sessions import chains  # noqa: E402
from tokenmill.bench.tokens import TextBuilder, TokenCounter  # noqa: E402
from tokenmill.bench.types import RequestSpec  # noqa: E402
from tokenmill.bench.workloads import load_trace  # noqa: E402
from tokenmill.traffic.capture import TrafficCapture, read_capture  # noqa: E402


class WordCounter(TokenCounter):
    exact = True
    name = "words"

    def count(self, text: str) -> int:
        return len(text.split())


def _lines(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _replay(trace: str, endpoint: str = "completions", **shape) -> list:
    cfg = BenchConfig(shapes=[LoadShape(trace=True, **shape)], num_requests=1 << 20, trace=trace,
                      salt=False, progress=False)
    with FakeServer(FakeConfig(ttft=0.02, itl=0.005)) as srv:
        result = BenchResult(target={}, config={})
        asyncio.run(run_bench(cfg, Target(srv.url, "fake-model", endpoint), WordCounter(), result))
        sent = list(srv.state.requests)
    return sorted(result.points[0].run.records, key=lambda r: r.index), sent


def test_chains_group_turns_in_order() -> None:
    specs = [RequestSpec(prompt="a", session="s1"), RequestSpec(prompt="x"),
             RequestSpec(prompt="b", session="s1", turn=1), RequestSpec(prompt="c", session="s2"),
             RequestSpec(prompt="d", session="s1", turn=2)]
    assert chains(specs) == [[0, 2, 4], [1], [3]]


def test_mooncake_replay_keeps_lengths_timing_and_prefix_sharing(tmp_path) -> None:
    rows = [{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]},
            {"timestamp": 100, "input_length": 1100, "output_length": 4, "hash_ids": [0, 2, 3]},
            {"timestamp": 200, "input_length": 530, "output_length": 2, "hash_ids": [0, 4]},
            {"timestamp": 300, "input_length": 40, "output_length": 2, "hash_ids": [5]}]
    trace = _lines(tmp_path / "mc.jsonl", rows)
    assert is_mooncake(trace)
    recs, _ = _replay(trace)
    assert all(r.ok for r in recs)
    assert [r.prompt_tokens for r in recs] == [600, 1100, 530, 40]
    assert [r.output_tokens for r in recs] == [3, 4, 2, 2]
    # block 0 (512 tokens) is shared by the first three: the fake server's cache sees exactly that
    assert [r.cached_tokens for r in recs] == [0, 512, 512, 0]
    gaps = [b.start - a.start for a, b in zip(recs, recs[1:])]
    assert all(abs(g - 0.1) < 0.04 for g in gaps)
    bad = _lines(tmp_path / "bad.jsonl", [{"timestamp": 0, "input_length": 5, "hash_ids": ["x"]}])
    with pytest.raises(ValueError, match="bad.jsonl:1: 'hash_ids'"):
        read_mooncake(bad)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_multi_turn_replay_waits_for_the_answer_and_extends_it(tmp_path, endpoint: str) -> None:
    rows = [{"session_id": "a", "timestamp": 0, "input_length": 40, "output_length": 6, "hash_ids": [0]},
            {"session_id": "b", "timestamp": 10, "input_length": 30, "output_length": 4, "hash_ids": [1]},
            {"session_id": "a", "delay": 150, "input_length": 70, "output_length": 5, "hash_ids": [0]},
            {"session_id": "a", "delay": 50, "input_length": 100, "output_length": 3, "hash_ids": [0]},
            {"session_id": "b", "delay": 0, "input_length": 50, "output_length": 2, "hash_ids": [1]}]
    recs, sent = _replay(_lines(tmp_path / "conv.jsonl", rows), endpoint)
    assert all(r.ok for r in recs)
    by = {(r.session, r.turn): r for r in recs}
    assert sorted(by) == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1)]
    for s, t, think in (("a", 1, 0.15), ("a", 2, 0.05), ("b", 1, 0.0)):
        prev, cur = by[(s, t - 1)], by[(s, t)]
        ended = prev.start + prev.e2e
        assert cur.start >= ended + think - 0.005, (s, t)  # never before the answer and its think time
        assert cur.start < ended + think + 0.2
    # each turn's prompt is the previous prompt, the answer the server gave and the new words
    texts = [(" ".join(m["content"] for m in r["messages"]) if endpoint == "chat" else r["prompt"]) for r in sent]
    a0 = next(t for t in texts if len(t.split()) == 40)
    a1 = next(t for t in texts if len(t.split()) == 70)
    a2 = next(t for t in texts if len(t.split()) == 100)
    assert a1.startswith(a0) and " w0 w1 w2 w3 w4 w5" in a1[len(a0):] and a2.startswith(a1)
    if endpoint == "chat":
        roles = [m["role"] for m in sent[-1]["messages"]] if len(sent[-1]["messages"]) > 1 else None
        assert roles is None or roles[:3] == ["user", "assistant", "user"]
    # ...so the server's prefix cache hits what the conversation already computed
    assert by[("a", 1)].cached_tokens == 32 and by[("a", 2)].cached_tokens == 64
    assert [r.prompt_tokens for r in recs] == [40, 30, 70, 100, 50]


def test_capture_sessions_replay_as_conversations(tmp_path) -> None:
    """A capture with sessions: think time = the next arrival less the previous turn's end."""
    path = tmp_path / "cap.jsonl"
    with TrafficCapture(path, hash_key=b"") as cap:
        first = list(range(100, 140))
        cap.record(10.0, first, 0, 5, {}, 0.01, 0.3, session="conv")
        cap.record(10.1, list(range(500, 520)), 0, 2, {}, 0.01, 0.05)
        cap.record(10.5, first + list(range(900, 930)), 32, 4, {}, 0.01, 0.2, session="conv")
    records = read_capture([str(path)])
    assert records[0]["session"] == records[2]["session"] and "session" not in records[1]
    specs = load_trace(str(path), WordCounter(), TextBuilder(WordCounter(), seed=1), "")
    assert [(s.session is not None, s.turn) for s in specs] == [(True, 0), (False, 0), (True, 1)]
    follow = specs[2]
    assert follow.think == pytest.approx(0.2) and follow.prompt_len == 70 - 40 - 5
    assert len(follow.prompt.split()) == 25


def test_mooncake_round_trip_keeps_the_prefix_structure(real_tokenizer, tmp_path) -> None:
    """Import a Mooncake trace, build the prompts the replay sends, let a capture hash them as the
    server would (16-token blocks of the real tokenizer's ids), export: the same hash-id structure."""

    class BundledCounter(TokenCounter):
        exact = True
        name = "bundled"

        def count(self, text: str) -> int:
            return len(real_tokenizer.encode(text))

    rows = [{"timestamp": 0, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 2]},
            {"timestamp": 50, "input_length": 1300, "output_length": 5, "hash_ids": [0, 1, 3]},
            {"timestamp": 120, "input_length": 700, "output_length": 2, "hash_ids": [0, 4]},
            {"timestamp": 200, "input_length": 1536, "output_length": 2, "hash_ids": [5, 6, 7]},
            {"timestamp": 260, "input_length": 1100, "output_length": 2, "hash_ids": [5, 6, 8]}]
    trace = _lines(tmp_path / "mc.jsonl", rows)
    counter = BundledCounter()
    specs = load_trace(trace, counter, TextBuilder(counter, seed=0), "")
    path = tmp_path / "cap.jsonl"
    with TrafficCapture(path) as cap:
        for spec, row in zip(specs, rows):
            ids = real_tokenizer.encode(spec.prompt)
            assert len(ids) == row["input_length"]
            cap.record(1000.0 + row["timestamp"] / 1000, ids, 0, row["output_length"], {}, 0.01, 0.02)
    out = to_mooncake(read_capture([str(path)]))
    assert [o["input_length"] for o in out] == [r["input_length"] for r in rows]
    assert [o["output_length"] for o in out] == [r["output_length"] for r in rows]
    assert [o["timestamp"] for o in out] == [r["timestamp"] for r in rows]
    assert [o["hash_ids"] for o in out] == [r["hash_ids"] for r in rows]  # numbered alike, shared alike
    again = to_mooncake(read_mooncake(_lines(tmp_path / "again.jsonl", out)))
    assert [o["hash_ids"] for o in again] == [r["hash_ids"] for r in rows]


def test_export_cli_and_sessions(tmp_path, capsys) -> None:
    from tokenmill.entrypoints.cli.main import main

    path = tmp_path / "cap.jsonl"
    with TrafficCapture(path, hash_key=b"") as cap:
        base = list(range(2000, 2064))
        cap.record(5.0, base, 0, 4, {}, 0.01, 0.2, session="s")
        cap.record(5.5, base + list(range(10)) + list(range(50, 70)), 64, 3, {}, 0.01, 0.1, session="s")
    out = tmp_path / "mc.jsonl"
    assert main(["trace", "export", str(path), "--output", str(out), "--block-size", "32"]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0]["hash_ids"] == [0, 1] and lines[1]["hash_ids"][:2] == [0, 1] and len(lines[1]["hash_ids"]) == 3
    assert lines[1]["session_id"] == lines[0]["session_id"] and lines[1]["delay"] == 300
    assert "timestamp" in lines[0] and "2 requests" in capsys.readouterr().out
    assert main(["trace", "export", str(path), "--output", str(out), "--block-size", "20"]) == 1

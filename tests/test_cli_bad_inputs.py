"""Commands given a malformed file or a dead server stop with one clear line on stderr and a
non-zero status, never a traceback: `tokenmill trace analyze|export` on captures whose records
have the wrong field types, `tokenmill bench --trace` on such captures and on malformed Mooncake
traces (refused before any server is contacted), and `tokenmill plan` against a server that is
not there. Each runs the real command line in a subprocess."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fake_backend import free_port

GOOD = {"v": 1, "arrival_time": 100.0, "prompt_tokens": 40, "output_tokens": 8, "cached_tokens": 0,
        "ttft": 0.1, "e2e": 0.5, "block_size": 16, "block_hashes": ["a1", "b2"], "block_content_hashes": ["c", "d"]}


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli.main", *args], capture_output=True,
                          text=True, timeout=timeout)


def _clear_failure(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode != 0, proc.stdout[-1000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for needle in needles:
        assert needle in proc.stderr, proc.stderr[-3000:]


def _capture(tmp_path: Path, bad: dict) -> str:
    path = tmp_path / "capture.jsonl"
    lines = [GOOD, {**GOOD, "arrival_time": 101.0, **bad}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


BAD_RECORDS = [
    ({"block_hashes": [{"a": 1}]}, "'block_hashes' must be a list of strings"),
    ({"e2e": [1]}, "'e2e' must be a finite number"),
    ({"ttft": "slow"}, "'ttft' must be a finite number"),
    ({"prompt_text": 5}, "'prompt_text' must be a string"),
    ({"cached_tokens": [3]}, "'cached_tokens' must be a whole number"),
    ({"block_content_hashes": 7}, "'block_content_hashes' must be a list of strings"),
    ({"miss_reason": "cold", "miss_offset": "x"}, "'miss_offset' must be a whole number"),
    ({"block_size": 0}, "'block_size' must be a whole number >= 1"),
    ({"sampling": [1]}, "'sampling' must be an object"),
]


@pytest.mark.parametrize("bad, needle", BAD_RECORDS)
def test_trace_analyze_refuses_a_malformed_record_by_line(tmp_path, bad, needle):
    path = _capture(tmp_path, bad)
    _clear_failure(_cli("trace", "analyze", path), f"{path} line 2: {needle}")


@pytest.mark.parametrize("bad, needle", BAD_RECORDS[:2] + BAD_RECORDS[-2:])
def test_trace_export_refuses_a_malformed_record_by_line(tmp_path, bad, needle):
    path = _capture(tmp_path, bad)
    _clear_failure(_cli("trace", "export", path, "--output", str(tmp_path / "out.jsonl")),
                   f"{path} line 2: {needle}")


def test_trace_export_refuses_a_block_size_below_one(tmp_path):
    path = _capture(tmp_path, {})
    _clear_failure(_cli("trace", "export", path, "--output", str(tmp_path / "out.jsonl"), "--block-size", "0"),
                   "--block-size")


def _bench_trace(path: str) -> subprocess.CompletedProcess:
    # a port nothing listens on: the trace must be refused before the server is contacted
    return _cli("bench", "--url", f"http://127.0.0.1:{free_port()}", "--model", "m", "--trace", path)


@pytest.mark.parametrize("bad, needle", BAD_RECORDS[:3])
def test_bench_refuses_a_malformed_capture_before_starting(tmp_path, bad, needle):
    path = _capture(tmp_path, bad)
    _clear_failure(_bench_trace(path), f"{path} line 2: {needle}")


@pytest.mark.parametrize("line, needle", [
    ({"timestamp": 0, "input_length": 10, "output_length": 5, "delay": [3], "session_id": "s"},
     "'delay' must be a finite number"),
    ({"timestamp": {"ms": 1}, "input_length": 10, "output_length": 5}, "'timestamp' must be a finite number"),
    ({"timestamp": 0, "input_length": 10, "output_length": [5]}, "'output_length' must be a whole number"),
    ({"timestamp": 0, "input_length": 10, "output_length": "5"}, "'output_length' must be a whole number"),
    ({"timestamp": 0, "text_input": ["hi"]}, "'text_input' must be a string"),
    ({"timestamp": 0, "input_length": 10, "hash_ids": [1, True]}, "'hash_ids' must be a list of integers"),
    ({"timestamp": 0, "input_length": 10, "session_id": {"a": 1}}, "'session_id' must be a string"),
])
def test_bench_refuses_a_malformed_mooncake_trace_by_line(tmp_path, line, needle):
    path = tmp_path / "mooncake.jsonl"
    first = {"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [0]}
    path.write_text(json.dumps(first) + "\n" + json.dumps(line) + "\n")
    _clear_failure(_bench_trace(str(path)), f"{path}:2: {needle}")


def test_bench_refuses_a_mooncake_trace_that_is_not_text(tmp_path):
    path = tmp_path / "mooncake.jsonl"
    path.write_bytes(b'{"timestamp": 0, "input_length": 10}\n\xff\xfe\x00garbage\n')
    _clear_failure(_bench_trace(str(path)), "not UTF-8 text")


@pytest.mark.parametrize("model", [[], ["--model", "m"]])
def test_plan_against_a_dead_server_fails(model):
    url = f"http://127.0.0.1:{free_port()}"
    proc = _cli("plan", "--candidate", f"a={url}", "--slo", "ttft=1", *model, "--probe-requests", "4",
                "--probe-seconds", "1", "--steady-seconds", "0", "--rate-min", "1", "--rate-max", "2")
    _clear_failure(proc, f"tokenmill plan: error: a: cannot reach {url}")

"""A real `vllm serve` launch line starts tokenmill, and a real `vllm bench serve` line
load-tests it; the saved result reads with vLLM's key names and in `tokenmill bench --compare`.

Slow: one server with the bundled model for the module; a few short requests.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from test_server_support import real_server

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "tokenmill.entrypoints.cli.main"]


@pytest.fixture(scope="module")
def vllm_style_server(bundled_model_path):
    # the launch line a vLLM user has (--max-num-seqs keeps the CPU's KV pool small on a shared machine);
    # the helper adds --host 127.0.0.1 --port N
    line = [bundled_model_path, "--dtype", "auto", "--max-model-len", "4k",
            "--enable-prefix-caching", "--gpu-memory-utilization", "0.5", "--api-key", "a", "b",
            "--uvicorn-log-level", "warning", "--enable-log-requests", "--seed", "0", "--max-num-seqs", "4"]
    with real_server(*line, startup_timeout=240) as server:
        yield server.url, server


def test_launch_line_settings_hold(vllm_style_server, bundled_model_path):
    url, _ = vllm_style_server
    assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
    for key in ("a", "b"):
        models = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10).json()
        names = [m["id"] for m in models["data"]]
        assert names[0] == bundled_model_path  # served under the name it was launched with, as vLLM does
        assert models["data"][0]["max_model_len"] == 4000  # 4k = 4,000


def test_vllm_bench_serve_line_and_its_result(vllm_style_server, bundled_model_path, tmp_path):
    url, server = vllm_style_server
    env = dict(os.environ, OPENAI_API_KEY="b")  # where `vllm bench serve` reads the key
    line = [*CLI, "bench", "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions", "--dataset-name", "random", "--random-input-len", "32",
            "--random-output-len", "8", "--num-prompts", "6", "--max-concurrency", "2", "--request-rate", "inf",
            "--goodput", "ttft:60000", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles",
            "50,99", "--ignore-eos", "--seed", "0", "--save-result", "--result-dir", str(tmp_path),
            "--result-filename", "vllm-run.json", "--label", "cpu", "--disable-tqdm"]
    proc = subprocess.run(line, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "vllm-run.json").read_text())
    assert (result["completed"], result["failed"], result["num_prompts"]) == (6, 0, 6)
    assert result["model_id"] == bundled_model_path  # asked of /v1/models, with the key
    assert result["total_output_tokens"] == 48 and result["output_lens"] == [8] * 6
    assert all(30 <= n <= 34 for n in result["input_lens"])  # the server's own prompt counts
    assert result["request_rate"] == "inf" and result["max_concurrency"] == 2 and result["label"] == "cpu"
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["output_throughput"] > 0 and result["duration"] > 0
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99"):
            assert f"{stat}_{metric}_ms" in result
    assert 0 < result["median_ttft_ms"] <= result["p99_ttft_ms"] < 60_000
    assert 0 < result["mean_tpot_ms"] < result["mean_e2el_ms"]
    assert len(result["ttfts"]) == 6 and all(0 < t < 60 for t in result["ttfts"])  # seconds
    assert sum(len(row) for row in result["itls"]) == 6 * 7
    middle = sorted(result["ttfts"])[2:4]
    assert result["median_ttft_ms"] == pytest.approx((middle[0] + middle[1]) * 500)  # ms from the s list
    # tokenmill's own file sits beside it; --compare reads both
    compare = subprocess.run([*CLI, "bench", "--compare", str(tmp_path / "vllm-run.json"),
                              str(tmp_path / "vllm-run.tokenmill.json")], capture_output=True, text=True,
                             timeout=120)
    assert compare.returncode == 0, compare.stderr
    rows = {line.split("  ")[0]: line.split() for line in compare.stdout.splitlines()}
    assert rows["completed"][-2:] == ["6", "6"]
    ttft = rows["TTFT mean ms"]
    assert ttft[-1] == ttft[-2] == f"{result['mean_ttft_ms']:.1f}"
    logged = [ln for ln in server.lines if "prompt tokens" in ln and "request " in ln]
    assert len(logged) >= 6  # --enable-log-requests: one line per request

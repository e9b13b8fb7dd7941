"""`tokenmill bench` takes `vllm bench serve` and guidellm command lines; vLLM's result file both ways."""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from fake_openai_server import FakeConfig, FakeServer  # noqa: E402

from tokenmill.bench.cli import _normalize  # noqa: E402
from tokenmill.bench.traces.vllm_format import parse_goodput, summary_from_vllm  # noqa: E402
from tokenmill.entrypoints.cli.main import build_parser, main  # noqa: E402

# what `vllm bench serve --save-result` writes, trimmed to two requests (values made up)
VLLM_RESULT = {
    "date": "20260101-120000", "backend": "vllm", "label": None, "model_id": "m", "tokenizer_id": "m",
    "num_prompts": 2, "request_rate": "inf", "burstiness": 1.0, "max_concurrency": None,
    "duration": 2.0, "completed": 2, "failed": 0, "total_input_tokens": 64, "total_output_tokens": 32,
    "request_throughput": 1.0, "request_goodput": None, "output_throughput": 16.0,
    "total_token_throughput": 48.0, "max_output_tokens_per_s": 20.0, "max_concurrent_requests": 2,
    "input_lens": [32, 32], "output_lens": [16, 16], "ttfts": [0.1, 0.3], "itls": [[0.02] * 15, [0.04] * 15],
    "generated_texts": ["", ""], "errors": ["", ""],
    "mean_ttft_ms": 200.0, "median_ttft_ms": 200.0, "std_ttft_ms": 100.0, "p99_ttft_ms": 298.0,
    "mean_tpot_ms": 30.0, "median_tpot_ms": 30.0, "std_tpot_ms": 10.0, "p99_tpot_ms": 39.8,
    "mean_itl_ms": 30.0, "median_itl_ms": 30.0, "std_itl_ms": 10.0, "p99_itl_ms": 40.0,
}


def parse_bench(*argv: str):
    return _normalize(build_parser().parse_args(["bench", *argv]))


def test_vllm_names_fold_into_tokenmills():
    a = parse_bench("--backend", "openai-chat", "--base-url", "http://h:1", "--dataset-name", "random",
                    "--num-prompts", "7", "--random-input-len", "100", "--random-output-len", "20",
                    "--random-prefix-len", "30", "--num-warmups", "2", "--disable-tqdm", "--goodput", "ttft:500",
                    "e2el:2000", "--header", "X-A=1", "--endpoint", "/v1/chat/completions")
    assert (a.url, a.endpoint, a.num_requests, a.input_len, a.output_len, a.prefix_len, a.warmup) == (
        "http://h:1", "chat", 7, "100", "20", 30, 2)
    assert a.no_progress and a.headers == {"X-A": "1"} and a.slo_dict == {"ttft": 0.5, "e2e": 2.0}
    assert a.rate == "inf"  # vLLM's default: every prompt at once
    b = parse_bench("--url", "http://h:1", "--num-requests", "7")  # tokenmill's own defaults stay
    assert (b.rate, b.concurrency, b.input_len, b.endpoint) == (None, None, "512", "completions")
    c = parse_bench("--dataset-name", "random", "--random-input-len", "100", "--random-range-ratio", "0.5")
    assert c.input_len == "uniform:50:150" and c.num_requests == 1000 and c.url == "http://127.0.0.1:8000"


def test_guidellm_habits():
    a = parse_bench("--target", "http://h:2", "--rate-type", "concurrent", "--rate", "4", "--max-seconds", "5",
                    "--data", "prompt_tokens=64,output_tokens=8")
    assert (a.url, a.concurrency, a.rate, a.duration, a.input_len, a.output_len) == (
        "http://h:2", "4", None, 5.0, "64", "8")
    assert parse_bench("--rate-type", "synchronous").concurrency == "1"
    assert parse_bench("--rate-type", "throughput").rate == "inf"
    with pytest.raises(ValueError, match="--rate 1,2,4,8"):
        parse_bench("--rate-type", "sweep")


@pytest.mark.parametrize("argv, expected", [
    (["--dataset-name", "sonnet"], "--dataset-name sonnet"),
    (["--dataset-name", "sharegpt"], "needs --dataset-path"),
    (["--goodput", "ttft=5"], "ttft:MS"),
    (["--endpoint", "/v1/embeddings"], "--endpoint /v1/embeddings"),
    (["--rate", "2", "--request-rate", "3"], "give one of the two"),
])
def test_bad_vllm_lines_are_one_line_errors(argv, expected, capsys):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err


def test_data_is_not_read_as_dataset(capsys):
    """No prefix matching: --datas is not --dataset (and --data means guidellm's)."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--datas", "x.json"])
    assert parse_bench("--data", "x.json").dataset == "x.json"


def test_goodput_in_ms():
    assert parse_goodput(["ttft:250", "tpot:50"]) == {"ttft": 0.25, "tpot": 0.05}


def test_vllm_result_from_vllm_reads_as_a_summary():
    s = summary_from_vllm(VLLM_RESULT)
    assert (s.completed, s.failed, s.output_tokens) == (2, 0, 32)
    assert s.ttft.mean == pytest.approx(0.2) and s.ttft.p99 == pytest.approx(0.298)
    assert s.ttft.max == pytest.approx(0.3) and s.itl.n == 30
    assert s.tpot.p99 == pytest.approx(0.0398)


def test_vllm_command_line_against_a_server_saves_vllm_keys_and_compares(tmp_path, capsys):
    with FakeServer(FakeConfig(ttft=0.02, itl=0.005)) as srv:
        rc = main(["bench", "--backend", "vllm", "--base-url", srv.url, "--endpoint", "/v1/completions",
                   "--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "6",
                   "--num-prompts", "5", "--request-rate", "inf", "--max-concurrency", "2", "--goodput",
                   "ttft:1000", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
                   "--ignore-eos", "--save-result", "--result-dir", str(tmp_path), "--result-filename",
                   "run.json", "--label", "fake", "--metadata", "gpu=none", "--disable-tqdm"])
    assert rc == 0
    saved = json.loads((tmp_path / "run.json").read_text())
    assert (saved["completed"], saved["failed"], saved["num_prompts"], saved["max_concurrency"]) == (5, 0, 5, 2)
    assert saved["label"] == "fake" and saved["gpu"] == "none" and saved["backend"] == "vllm"
    assert saved["total_output_tokens"] == 30 and saved["output_throughput"] > 0
    assert saved["request_goodput"] == pytest.approx(saved["request_throughput"])  # every one met 1 s
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99"):
            assert isinstance(saved[f"{stat}_{metric}_ms"], float), (stat, metric)
    assert 15 <= saved["median_ttft_ms"] < 500 and saved["mean_tpot_ms"] > 1  # ms, not seconds
    assert len(saved["ttfts"]) == 5 and all(0.01 < t < 0.5 for t in saved["ttfts"])  # seconds
    assert len(saved["itls"]) == 5 and all(len(row) == 5 for row in saved["itls"])
    assert saved["output_lens"] == [6] * 5 and saved["errors"] == [""] * 5
    assert 1 <= saved["max_concurrent_requests"] <= 2
    own = json.loads((tmp_path / "run.tokenmill.json").read_text())  # tokenmill's richer file beside it
    assert own["points"][0]["summary"]["completed"] == 5
    (tmp_path / "vllm.json").write_text(json.dumps(VLLM_RESULT))
    capsys.readouterr()
    assert main(["bench", "--compare", str(tmp_path / "vllm.json"), str(tmp_path / "run.json"),
                 str(tmp_path / "run.tokenmill.json")]) == 0
    table = capsys.readouterr().out
    assert "vllm" in table and "run" in table and "run.tokenmill" in table
    ttft_row = next(line for line in table.splitlines() if line.startswith("TTFT mean ms"))
    assert "200.0" in ttft_row and ttft_row.split()[-1] == ttft_row.split()[-2]  # same run, two formats


def test_default_result_name_follows_vllm(tmp_path):
    from tokenmill.bench.traces.vllm_format import result_filename

    name = result_filename(None, "vllm", {"rate": None, "max_concurrency": 4}, "org/Model-1B", 0.0)
    assert name.startswith("vllm-infqps-concurrency4-Model-1B-") and name.endswith(".json")


def test_extra_headers_are_sent():
    from tokenmill.bench.client import Target

    assert Target("http://h", "m", extra_headers={"X-Team": "a"}).headers()["X-Team"] == "a"

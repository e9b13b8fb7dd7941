"""`tokenmill eval` end to end: a tiny model folder (fast) and the bundled SmolLM2 (slow)."""
from __future__ import annotations

import json
import math

import pytest

from conftest import save_tiny_hf_folder
from tokenmill.entrypoints.cli.main import main

EVAL_SET = [
    {"id": "gen-contains", "prompt": "The keeper lit the", "answer": "lamp", "match": "contains", "max_tokens": 6},
    {"id": "gen-regex", "prompt": "Count: 1 2 3", "answer": r"\d", "match": "regex", "max_tokens": 6},
    {"id": "gen-exact", "prompt": "Say yes:", "answer": "yes", "match": "exact", "max_tokens": 4},
    {"id": "mc", "prompt": "Ships pass in the", "choices": [" dark", " soup", " xq"], "answer": " dark"},
    {"id": "mc-chat", "messages": [{"role": "user", "content": "Day or night?"}], "choices": ["Day.", "Night."],
     "answer_index": 1},
]
TEXT = "The keeper climbed the stairs each evening and lit the lamp before supper.\n" * 12


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    """The tiny random Llama saved as a Hugging Face folder, so the CLI can load it by path."""
    return save_tiny_hf_folder(tmp_path_factory.mktemp("tiny-hf"))


@pytest.fixture(scope="module")
def data_files(tmp_path_factory) -> tuple[str, str]:
    d = tmp_path_factory.mktemp("eval-data")
    (d / "set.jsonl").write_text("\n".join(json.dumps(x) for x in EVAL_SET) + "\n")
    (d / "text.txt").write_text(TEXT)
    return str(d / "set.jsonl"), str(d / "text.txt")


def _args(folder: str, data: tuple[str, str], out: str, *extra: str) -> list[str]:
    return ["eval", "--model", folder, "--eval-set", data[0], "--text", data[1], "--window", "64", "--stride", "32",
            "--decode-tokens", "4", "--prefill-tokens", "32", "--decode-batch", "1,3", "--output", out,
            "--threads", "1", "--no-safety", *extra]


def test_eval_cli_table_and_json(tiny_folder, data_files, tmp_path, capsys) -> None:
    out = str(tmp_path / "result.json")
    rc = main(_args(tiny_folder, data_files, out, "--candidate", "int8", "--candidate", "int4:g64",
                    "--max-ppl-increase", "1000%", "--max-accuracy-drop", "100pt"))
    table = capsys.readouterr().out
    assert rc == 0
    for row in ("weights", "perplexity", "next-token agreement", "accuracy (5 items)", "agreement with base",
                "mean first divergence", "decode tok/s (batch 3)", "prefill tok/s", "verdict"):
        assert row in table
    doc = json.loads(open(out).read())
    assert doc["passed"] is True and [c["label"] for c in doc["candidates"]] == ["int8", "int4:g64"]
    base = doc["base"]
    assert base["perplexity"]["num_tokens"] == base["perplexity"]["num_text_tokens"] - 1
    assert base["perplexity"]["num_windows"] > 1
    for res in [base, *doc["candidates"]]:
        ppl = res["perplexity"]["perplexity"]
        assert math.isfinite(ppl) and ppl > 1  # random weights: a huge value, but a real one
        assert res["num_items"] == 5 and 0 <= res["accuracy"] <= 100
        assert all(v > 0 for v in res["speed"]["decode_tps"].values()) and res["speed"]["prefill_tps"] > 0
    int8, int4 = doc["candidates"]
    assert int4["weight_bytes"] < int8["weight_bytes"] < base["weight_bytes"]
    assert int4["group_size"] == 64 and "int4 g64" in int4["quant_summary"]
    for comp in doc["comparisons"]:
        assert 0 <= comp["agreement"] <= 1 and comp["passed"]


def test_eval_cli_threshold_failure_exits_nonzero(tiny_folder, data_files, tmp_path, capsys) -> None:
    out = str(tmp_path / "result.json")
    # the base against itself passes a zero threshold (nothing changed)...
    assert main(_args(tiny_folder, data_files, out, "--candidate", "none", "--no-speed", "--no-eval-set",
                      "--max-ppl-increase", "0%")) == 0
    assert "PASS" in capsys.readouterr().out
    # ...while int4 with coarse groups on this tiny random model loses more than 0.5% perplexity (+2.3% measured)
    rc = main(_args(tiny_folder, data_files, out, "--candidate", "int4:g64", "--no-speed", "--no-eval-set",
                    "--max-ppl-increase", "0.5%"))
    text = capsys.readouterr().out
    assert rc == 1
    assert "FAIL int4:g64: perplexity +" in text
    doc = json.loads(open(out).read())
    assert doc["passed"] is False and doc["comparisons"][0]["ppl_increase"] > 0.005


def test_eval_cli_bad_input_exits_2(tiny_folder, data_files, tmp_path, capsys) -> None:
    out = str(tmp_path / "r.json")
    assert main(_args(tiny_folder, data_files, out, "--candidate", "int4:g128")) == 2
    assert "does not divide the input size 64" in capsys.readouterr().err
    assert main(_args(tiny_folder, data_files, out, "--candidate", "gguf")) == 2
    assert main(_args(tiny_folder, data_files, out, "--max-ppl-increase", "lots")) == 2


@pytest.mark.slow
def test_eval_cli_bundled_model_int8_int4(tmp_path, capsys) -> None:
    """The real model, the bundled data (trimmed for time), real forward passes for every figure."""
    out = str(tmp_path / "result.json")
    rc = main(["eval", "--candidate", "int8", "--candidate", "int4", "--max-text-tokens", "600", "--limit", "14",
               "--decode-tokens", "8", "--prefill-tokens", "64", "--threads", "1", "--output", out, "--no-safety",
               "--max-ppl-increase", "5%", "--max-accuracy-drop", "30pt"])
    table = capsys.readouterr().out
    doc = json.loads(open(out).read())
    base, (int8, int4) = doc["base"], doc["candidates"]
    p0 = base["perplexity"]["perplexity"]
    assert 3 < p0 < 200  # SmolLM2-135M on plain English prose
    for cand in (int8, int4):
        assert abs(cand["perplexity"]["perplexity"] / p0 - 1) < 0.05, table
        assert cand["perplexity"]["num_tokens"] == 599
        assert cand["accuracy"] is not None and cand["speed"]["decode_tps"]["1"] > 0
    assert base["accuracy"] >= 40  # the sample questions are easy ones
    assert int4["weight_bytes"] < int8["weight_bytes"] < 0.5 * base["weight_bytes"]
    for comp in doc["comparisons"]:
        assert comp["next_token_agreement"] >= 0.9  # 96.9% (int8) and 97.5% (int4) on the whole text
        assert comp["agreement"] >= 0.3 and comp["token_agreement"] > 0.3  # long answers drift apart
    assert rc == (0 if doc["passed"] else 1)

"""The prepared GPU check script keeps working between GPU sessions: its CPU dry run."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_cuda_check_dry_run_on_cpu_reports_parity_and_throughput(tmp_path) -> None:
    import cuda_check

    out = tmp_path / "cuda.json"
    assert cuda_check.main(["--device", "cpu", "--quick", "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["parity_float32"]["identical"] == summary["parity_float32"]["prompts"] == 2
    assert summary["parity_float32"]["max_logprob_diff_top20"] < 1e-3
    assert summary["throughput"]["output_tok_s"] > 0 and summary["throughput"]["single_stream_decode_tok_s"] > 0


def test_cuda_check_says_so_when_there_is_no_gpu(capsys) -> None:
    import torch

    import cuda_check

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert cuda_check.main(["--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err

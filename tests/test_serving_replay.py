"""benchmarks/serving_replay.py keeps running: a tiny replay of the many-stream
workload on the bundled model, parts table included (slow: loads the model).

In a subprocess, because ``--parts`` wraps the model's functions in place."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serving_replay.py"


@pytest.mark.slow
def test_replay_prints_steps_and_parts() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--streams", "3", "--input-len", "40", "--output-len", "5",
                           "--kv-cache-memory", "64MiB", "--parts"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "output tok/s, preemptions 0" in out
    assert "| mixed | " in out and "| decode | " in out
    parts = out.split("| part of the mixed steps |")[1]
    for label in ("linear (LM head included)", "linear + residual", "attention (C kernels)", "rms_norm", "rope"):
        assert f"| {label} | " in parts, label

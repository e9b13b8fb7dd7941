"""`tokenmill serve --help`, `tokenmill generate` and `python -m tokenmill.demo`."""
from __future__ import annotations

import io
import subprocess
import sys

import pytest

from conftest import tiny_loaded, tiny_tokenizer


def test_serve_flags_parse():
    from tokenmill.entrypoints.cli.main import build_parser
    from tokenmill.entrypoints.cli.serve_config import engine_config_from_args, settings_from_args

    args = build_parser().parse_args([
        "serve", "--port", "9", "--served-model-name", "a", "b", "--api-key", "k", "--dtype", "bfloat16",
        "--max-model-len", "512", "--kv-cache-memory", "64MiB", "--block-size", "32", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "128", "--max-waiting", "3", "--max-output-tokens", "7", "--log-requests",
        "--no-prefix-caching", "--capture-traffic", "/tmp/x.jsonl", "--capture-text", "--batching", "dynamic",
        "--quantization", "int8", "--no-ui"])
    settings = settings_from_args(args)
    assert settings.served_model_names == ["a", "b"] and settings.api_key == "k"
    assert (settings.max_waiting, settings.max_output_tokens, settings.capture_text) == (3, 7, True)
    cfg = engine_config_from_args(args)
    assert cfg.dtype == "bfloat16" and cfg.quantization == "int8"
    assert cfg.cache.block_size == 32 and cfg.cache.kv_cache_memory == 64 << 20
    assert cfg.cache.enable_prefix_caching is False
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_model_len,
            cfg.scheduler.batching) == (8, 128, 512, "dynamic")


def test_api_key_from_environment(monkeypatch):
    from tokenmill.entrypoints.cli.main import build_parser
    from tokenmill.entrypoints.cli.serve_config import settings_from_args

    monkeypatch.setenv("TOKENMILL_API_KEY", "from-env")
    args = build_parser().parse_args(["serve", "--served-model-name", "m"])
    assert settings_from_args(args).api_key == "from-env"


def test_generate_streams_the_answer():
    from tokenmill.settings.config import EngineConfig
    from tokenmill.engine.engine import LLMEngine
    from tokenmill.entrypoints.cli.generate_cli import generate

    engine = LLMEngine(EngineConfig.from_options(num_blocks=32), loaded=tiny_loaded(), tokenizer=tiny_tokenizer())
    out = io.StringIO()
    text = generate("hi", max_tokens=5, engine=engine, out=out)
    assert out.getvalue() == text + "\n"
    again = generate("hi", max_tokens=5, engine=engine, out=io.StringIO())
    assert again == text  # greedy by default


@pytest.mark.slow
def test_generate_cli_with_bundled_model():
    proc = subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli.main", "generate",
                           "Name the capital of France.", "--max-tokens", "12"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout

"""Configuration is checked before the model loads: every bad field on its own line, exit status 2,
no traceback (the CLI as a subprocess), and the same checks for the offline API's engine."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from conftest import save_tiny_hf_folder
from tokenmill.engine.spec.speculative import SpeculativeConfig


@pytest.mark.parametrize("value, expected", [
    ('{"method": "ngram", "num_speculative_tokens": 4.5}',
     ["num_speculative_tokens must be an integer in [1, 16] (got 4.5)"]),
    ('{"method": "ngram", "num_speculative_tokens": "four"}',
     ["num_speculative_tokens must be an integer in [1, 16] (got 'four')"]),
    ('{"method": "ngram", "num_speculative_tokens": true}', ["num_speculative_tokens must be an integer"]),
    ('{"method": 3, "prompt_lookup_max": 0, "max_verify_rows": 1.5}',
     ["method 3 is not supported", "prompt_lookup_max must be an integer >= 1", "max_verify_rows must be an integer"]),
    ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}', ["prompt_lookup_min must be at most prompt_lookup_max"]),
    ('{"speculative_tokens": 4}', ["unknown keys 'speculative_tokens'"]),
    ('{"method": "draft_model"}', ["needs \"model\""]),
    ("{}", ["say which method"]),
    ('{"num_speculative_tokens": 2}', ["say which method"]),
    ("[4]", ["must be a JSON object"]),
    ("{", ["is not JSON"]),
    ("[" * 5000, ["is not JSON"]),
])
def test_every_bad_speculative_field_is_named(value, expected):
    problems = SpeculativeConfig.check(value)
    assert len(problems) == len(expected), problems
    for line, want in zip(problems, expected):
        assert want in line and "\n" not in line
    with pytest.raises(ValueError):
        SpeculativeConfig.parse(value)


def test_good_speculative_configs_pass():
    assert SpeculativeConfig.check('{"method": "ngram", "num_speculative_tokens": 3}') == []
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2}).num_speculative_tokens == 2
    assert SpeculativeConfig.parse({"model": "./draft.gguf"}).method == "draft_model"  # vLLM's shorthand


def _serve(*flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli.main", "serve", "--port", "1", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_the_cli_refuses_bad_fields_before_loading_with_status_2():
    started = time.monotonic()
    done = _serve("--speculative-config", '{"method": "ngram", "num_speculative_tokens": "four", '
                  '"max_backoff_steps": -1}',
                  "--grammar-max-rules", "5", "--grammar-compile-timeout", "-1", "--shutdown-grace", "-2")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr and all(line.startswith("tokenmill serve: error: ") for line in lines)
    text = "\n".join(lines)
    for want in ("num_speculative_tokens must be an integer", "max_backoff_steps must be an integer >= 0",
                 "--grammar-compile-timeout must be a positive number", "--shutdown-grace"):
        assert want in text, text
    assert len(lines) == 4, lines
    assert time.monotonic() - started < 60  # nothing was loaded


@pytest.mark.parametrize("spec, want", [
    ("{}", "say which method"),
    ('{"method": "draft_model", "model": "TINY"}', "the draft model's vocabulary (256 tokens) differs from the target's"),
    ('{"method": "draft_model", "model": "NOTAMODEL"}', "is not a model tokenmill can load: "),
    ('{"method": "draft_model", "model": "FOLDER"}', "no config.json"),
    ('{"method": "draft_model", "model": "/nonexistent/draft.gguf"}', "no such file or folder")])
def test_the_cli_refuses_a_draft_that_is_not_a_model_before_loading(tmp_path, spec, want):
    not_a_model = tmp_path / "draft.gguf"
    not_a_model.write_text("these are not weights\n")
    tiny = save_tiny_hf_folder(tmp_path / "tiny", vocab_size=256)  # the bundled model's vocabulary is larger
    spec = spec.replace("NOTAMODEL", str(not_a_model)).replace("FOLDER", str(tmp_path)).replace("TINY", tiny)
    started = time.monotonic()
    done = _serve("--speculative-config", spec)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tokenmill serve: error: --speculative-config") and want in lines[0]
    assert time.monotonic() - started < 60  # refused before the target model loads


def test_the_offline_engine_refuses_a_bad_speculative_config_before_loading():
    from tokenmill.settings.config import EngineConfig
    from tokenmill.engine.engine import LLMEngine

    config = EngineConfig.from_options(speculative_config='{"method": "ngram", "num_speculative_tokens": 4.5}',
                                       model="/nonexistent")
    with pytest.raises(ValueError, match="num_speculative_tokens"):  # not "no such model": checked first
        LLMEngine(config)


def test_a_draft_with_the_targets_vocabulary_passes_the_header_check():
    from tokenmill.files.bundled import default_model_path
    from tokenmill.entrypoints.cli.serve_cli import _draft_model_problems
    from tokenmill.model.loader import check_model_path

    bundled = default_model_path()
    assert check_model_path(bundled) == 49152  # SmolLM2's vocabulary, from the header alone
    assert _draft_model_problems(bundled, None) == []

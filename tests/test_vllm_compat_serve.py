"""`tokenmill serve` takes a `vllm serve` launch line: flag names, meanings, errors."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from tokenmill.settings.cli_args import human_int
from tokenmill.entrypoints.cli.main import build_parser, main
from tokenmill.entrypoints.cli.serve_cli import finalize_serve_args, parse_origins
from tokenmill.entrypoints.cli.serve_config import generation_defaults

VLLM_LINE = ["--dtype", "auto", "--max-model-len", "4k", "--enable-prefix-caching",
             "--gpu-memory-utilization", "0.5", "--api-key", "a", "b", "--uvicorn-log-level", "warning",
             "--enable-log-requests", "--seed", "7"]


def parse_serve(argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args(["serve", *argv])
    problem = finalize_serve_args(args)
    assert problem is None, problem
    return args


def serve_error(argv: list[str], capsys) -> str:
    try:
        code = main(["serve", *argv])
    except SystemExit as exc:  # argparse's own errors exit; ours return
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_human_int_follows_vllm_suffixes():
    assert [human_int(x) for x in ("512", "4k", "4K", "1.5m", "25.6k", "2G")] == [
        512, 4000, 4096, 1_500_000, 25_600, 2 << 30]
    with pytest.raises(argparse.ArgumentTypeError):
        human_int("lots")


def test_vllm_launch_line_means_what_it_means_in_vllm(bundled_model_path):
    from tokenmill.entrypoints.cli.serve_config import engine_config_from_args, settings_from_args
    from tokenmill.entrypoints.cli.serve_config import device_memory_bytes

    args = parse_serve([bundled_model_path, *VLLM_LINE])
    assert args.model == bundled_model_path
    cfg = engine_config_from_args(args)
    assert cfg.dtype == "auto" and cfg.scheduler.max_model_len == 4000 and cfg.seed == 7  # the engine decides
    assert cfg.cache.enable_prefix_caching is True and cfg.cap_kv_pool is True
    # half of the memory available now (other processes move it a little between the two reads)
    assert abs(cfg.memory_budget - device_memory_bytes("cpu") // 2) < 512 << 20
    settings = settings_from_args(args)
    assert settings.api_key == ["a", "b"] and settings.log_requests is True
    assert args.uvicorn_log_level == "warning"


def test_old_flag_names_stay_as_aliases():
    from tokenmill.entrypoints.cli.serve_config import engine_config_from_args

    old = parse_serve(["--no-prefix-caching", "--kv-cache-memory", "64MiB", "--log-requests"])
    new = parse_serve(["--no-enable-prefix-caching", "--kv-cache-memory-bytes", "64M", "--enable-log-requests"])
    for args in (old, new):
        cfg = engine_config_from_args(args)
        assert cfg.cache.enable_prefix_caching is False and cfg.cache.kv_cache_memory == 64 << 20
        assert args.log_requests is True
    # --kv-cache-memory-bytes wins over --gpu-memory-utilization, as in vLLM
    cfg = engine_config_from_args(parse_serve(["--gpu-memory-utilization", "0.9", "--kv-cache-memory-bytes", "1G"]))
    assert cfg.cache.kv_cache_memory == 1 << 30 and cfg.memory_budget is None


def test_hub_name_of_the_bundled_model_serves_the_bundled_copy():
    args = parse_serve(["HuggingFaceTB/SmolLM2-135M-Instruct"])
    assert args.model is None and args.served_model_name == ["HuggingFaceTB/SmolLM2-135M-Instruct"]


@pytest.mark.parametrize("argv, expected", [
    (["--foo", "1"], "unknown flag --foo"),
    (["--max-model", "4k"], "unknown flag --max-model"),  # no prefix matching
    (["-pp", "2"], "-pp is a vLLM flag"),
    (["-tp", "2"], "attention heads"),  # the bundled model's 9 heads do not split in two
    (["--tensor-parallel-size", "4"], "attention heads"),
    (["--kv-cache-dtype", "int4"], "--kv-cache-dtype: kv_cache_dtype 'int4': choose one of"),
    (["--kv-cache-dtype", "float16"], "a float pool is stored in the compute dtype (float32)"),
    (["no/such-model"], "is not a local file or folder"),
    (["--ssl-keyfile", "/nonexistent.key", "--ssl-certfile", "/nonexistent.crt"], "no such file"),
    (["--chat-template", "/nonexistent.jinja"], "--chat-template /nonexistent.jinja: no such file"),
    (["--allowed-origins", "[oops"], "--allowed-origins: not a JSON list"),
    (["--max-model-len", "lots"], "is not a number"),
])
def test_bad_launch_lines_get_one_line(argv, expected, capsys):
    err = serve_error(argv, capsys)
    assert expected in err and err.startswith("tokenmill serve: error:"), err


def test_pool_dtype_flags_that_match_are_accepted():
    parse_serve(["-tp", "1", "--kv-cache-dtype", "auto"])
    parse_serve(["--dtype", "bfloat16", "--kv-cache-dtype", "bf16", "--enforce-eager"])
    parse_serve(["--dtype", "half", "--kv-cache-dtype", "float16"])
    parse_serve(["--dtype", "float32", "--kv-cache-dtype", "bfloat16"])  # half the bytes, widened when read
    for quantized in ("int8", "fp8", "FP8"):
        assert parse_serve(["--kv-cache-dtype", quantized]).kv_cache_dtype == quantized


def test_config_file_holds_the_same_keys_and_the_command_line_wins(tmp_path, monkeypatch):
    conf = tmp_path / "serve.yaml"
    conf.write_text("max-model-len: 2k\nenable_prefix_caching: false\napi-key: [x, y]\nport: 9001\n"
                    "enable-log-requests: true\nseed: 3\n")
    seen: dict[str, argparse.Namespace] = {}

    def fake_build():  # the real parser, whose serve command records its arguments instead of serving
        p = build_parser()
        serve = p._subparsers._group_actions[0].choices["serve"]
        serve.set_defaults(func=lambda a: seen.setdefault("args", a) and 0)
        return p

    monkeypatch.setattr("tokenmill.entrypoints.cli.main.build_parser", fake_build)
    assert main(["serve", "--port", "9002", "--config", str(conf)]) == 0  # the command line wins, wherever
    args = seen["args"]
    assert (args.max_model_len, args.enable_prefix_caching, args.api_key, args.port, args.log_requests,
            args.seed) == (2000, False, ["x", "y"], 9002, True, 3)
    seen.clear()
    conf.write_text("api-key: [x, y]\nno-prefix-caching: true\ndtype: bfloat16\n")
    assert main(["serve", "--config", str(conf), "some/model.gguf", "--api-key", "z"]) == 0
    args = seen["args"]
    assert (args.model_tag, args.api_key, args.enable_prefix_caching, args.dtype) == (
        "some/model.gguf", ["z"], False, "bfloat16")


@pytest.mark.parametrize("text, expected", [
    ("max-model-len: 2k\nwarp-drive: 9\n", "unknown key 'warp-drive'"),
    ("dtype: fp8\n", "dtype: 'fp8' is not one of"),
    ("enable-log-requests: maybe\n", "enable-log-requests: expects true or false"),
    ("port: [1, 2]\n", "port: takes one value, not a list"),
])
def test_config_file_mistakes_are_one_line(tmp_path, capsys, text, expected):
    conf = tmp_path / "serve.yaml"
    conf.write_text(text)
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--config", str(conf)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == f"tokenmill serve: error: --config {conf}: {expected}" or (
        err.startswith(f"tokenmill serve: error: --config {conf}: ") and expected in err), err
    assert len(err.splitlines()) == 1


def _walk(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _walk(sub)


def test_no_parser_does_prefix_matching():
    parsers = list(_walk(build_parser()))
    assert len(parsers) >= 6  # tokenmill, serve, generate, bench, trace, route, ...
    assert all(p.allow_abbrev is False for p in parsers), [p.prog for p in parsers if p.allow_abbrev]


def test_every_parser_in_the_project_turns_prefix_matching_off():
    """Scripts too: each ArgumentParser(...) and add_parser(...) call says allow_abbrev=False."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = [*(root / "src").rglob("*.py"), *(root / "benchmarks").glob("*.py"), root / "tests" / "fake_backend.py"]
    calls = 0
    for path in files:
        text = path.read_text()
        for m in re.finditer(r"(ArgumentParser|add_parser)\(", text):
            calls += 1
            window = text[m.end():m.end() + 400].split("\n\n")[0]
            assert "allow_abbrev=False" in window or path.name == "settings/cli_args.py", f"{path}: {text[m.start():m.end() + 60]}"
    assert calls >= 15


def test_version():
    proc = subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli.main", "--version"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("tokenmill ")


def test_several_api_keys_each_open_the_api():
    from tokenmill.entrypoints.console.console_auth import ConsoleSessions

    sessions = ConsoleSessions(["a", "b"])

    def scope(key: str) -> dict:
        return {"type": "http", "method": "POST", "headers": [(b"authorization", f"Bearer {key}".encode())]}

    assert sessions.enabled
    assert [sessions.check(scope(k)) for k in ("a", "b", "c")] == ["ok", "ok", "unauthorized"]
    assert sessions.key_matches("b") and not sessions.key_matches("ab")
    assert ConsoleSessions("a").check(scope("a")) == "ok" and not ConsoleSessions(None).enabled


def test_chat_template_flag_replaces_the_models(tmp_path, bundled_model_path):
    from tokenmill.entrypoints.cli.serve_config import tokenizer_from_args

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    args = parse_serve([bundled_model_path, "--chat-template", str(template)])
    tok = tokenizer_from_args(args)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<<hi>>"
    inline = parse_serve([bundled_model_path, "--chat-template", "{{ messages[0]['content'] }}!"])
    assert tokenizer_from_args(inline).apply_chat_template([{"role": "user", "content": "yo"}]) == "yo!"
    assert tokenizer_from_args(parse_serve([bundled_model_path])) is None  # the model's own


def test_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 0, "do_sample": True, "max_new_tokens": 9}))
    assert generation_defaults("auto", str(tmp_path)) == {"temperature": 0.6, "top_p": 0.9, "top_k": -1}
    assert generation_defaults("vllm", str(tmp_path)) == {}
    assert generation_defaults(str(tmp_path), "model.gguf")["temperature"] == 0.6
    assert generation_defaults("auto", "model.gguf") == {}


def test_generation_defaults_apply_only_to_what_a_request_leaves_unset():
    from types import SimpleNamespace

    from tokenmill.entrypoints.openai.openai_routes import sampling_params
    from tokenmill.entrypoints.openai.protocol import CompletionRequest

    state = SimpleNamespace(vocab_size=100, settings=SimpleNamespace(sampling_defaults={"temperature": 0.25,
                                                                                         "top_k": 5}))
    p = sampling_params(state, CompletionRequest(model="m", prompt="x"), 4, None)
    assert (p.temperature, p.top_k, p.top_p) == (0.25, 5, 1.0)
    p = sampling_params(state, CompletionRequest(model="m", prompt="x", temperature=0.0), 4, None)
    assert p.temperature == 0.0


def test_allowed_origins_forms_and_cors():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from tokenmill.entrypoints.server.app import add_cors

    assert parse_origins(['["https://a.example", "https://b.example"]']) == ["https://a.example",
                                                                             "https://b.example"]
    assert parse_origins(["https://a.example,https://b.example"]) == parse_origins(
        ["https://a.example", "https://b.example"])
    app = FastAPI()
    app.get("/x")(lambda: {"ok": True})
    add_cors(app, ["https://a.example"])
    client = TestClient(app)
    ok = client.options("/x", headers={"Origin": "https://a.example", "Access-Control-Request-Method": "GET"})
    assert ok.headers.get("access-control-allow-origin") == "https://a.example"
    other = client.get("/x", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_offline_llm_takes_vllm_keywords():
    from tokenmill.entrypoints.llm import vllm_options

    opts = vllm_options({"dtype": "auto", "max_model_len": "2k", "gpu_memory_utilization": 0.25,
                         "tensor_parallel_size": 1, "trust_remote_code": True, "enforce_eager": False})
    assert opts["dtype"] == "auto" and opts["max_model_len"] == 2000 and opts["cap_kv_pool"] is True
    assert opts["memory_budget"] > 0 and "trust_remote_code" not in opts
    assert vllm_options({"dtype": "half", "kv_cache_memory_bytes": "1G",
                         "gpu_memory_utilization": 0.9})["kv_cache_memory"] == "1G"
    assert vllm_options({"tensor_parallel_size": 2})["tensor_parallel_size"] == 2


def test_offline_llm_with_auto_dtype_runs(tiny_llm_factory):
    from tokenmill.engine.auto import resolve_dtype

    llm = tiny_llm_factory(dtype="auto", max_model_len="512")
    assert llm.engine.config.dtype == resolve_dtype("auto", llm.engine.device)[0] and llm.engine.max_model_len == 512
    from tokenmill import SamplingParams

    out = llm.generate(["ab"], SamplingParams(max_tokens=3, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 3

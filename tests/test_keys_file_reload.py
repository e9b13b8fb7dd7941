"""A keys file nested past reason, as real processes meet it: at startup `tokenmill serve`
and `tokenmill route` exit with a one-line error, and on SIGHUP both keep running with
the keys they had, counting the refused reload in /metrics."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

from conftest import save_tiny_hf_folder, wait_until
from fake_backend import free_port, start_fakes
from test_server_support import metric, real_servers
from tokenmill.gateway.tenants import hash_key

DEEP = '{"tenants": {"chat": {}}, "keys": ' + "[" * 100000 + "]" * 100000 + "}"


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokenmill.entrypoints.cli.main", *args]


def good_keys(tmp_path) -> str:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": {"chat": {"priority_class": "high"}},
                                "keys": [{"sha256": hash_key("chat-key"), "tenant": "chat"}]}))
    return str(path)


def tiny_args(tmp_path) -> list[str]:
    return ["--model", save_tiny_hf_folder(tmp_path / "tiny"), "--max-model-len", "256", "--num-blocks", "32",
            "--threads", "1", "--no-ui", "--dtype", "float32", "--quantization", "none"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_nested_keys_file_at_startup_is_a_clear_error_exit(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text(DEEP)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for command in (cli("serve", *tiny_args(tmp_path), "--api-keys-file", str(deep)),
                    cli("route", "--backend", "http://127.0.0.1:9", "--port", str(free_port()),
                        "--api-keys-file", str(deep))):
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=100)
        assert done.returncode == 2, done.stderr[-2000:]
        assert "nested deeper" in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sighup_with_a_nested_keys_file_keeps_server_and_router_alive_with_the_old_keys(tmp_path):
    keys = good_keys(tmp_path)
    fakes = start_fakes(1)
    router_port = free_port()
    router = subprocess.Popen(cli("route", "--backend", fakes[0].url, "--port", str(router_port),
                                  "--api-keys-file", keys, "--health-interval", "0.5", "--no-remote-tokenize"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    router_url = f"http://127.0.0.1:{router_port}"
    try:
        with real_servers(tiny_args(tmp_path) + ["--api-keys-file", keys, "--api-key", "operator"]) as (server,):
            assert wait_until(lambda: _status(router_url + "/health") == 200, timeout=60)
            with open(keys, "w") as f:
                f.write(DEEP)
            for proc in (server.proc, router):
                proc.send_signal(signal.SIGHUP)
            assert wait_until(lambda: _failures(server.url, "tokenmill:keys_file_reload_failures_total") == 1
                              and _failures(router_url, "tokenmill_router_keys_file_reload_failures_total") == 1,
                              timeout=30)
            assert server.proc.poll() is None and router.poll() is None
            body = {"prompt": "hello", "max_tokens": 2}
            for url in (server.url, router_url):  # the old keys still open both
                r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer chat-key"},
                               timeout=60)
                assert r.status_code == 200, (url, r.text)
            assert any("not reloaded, keeping the previous one" in line for line in server.lines)
    finally:
        router.kill()
        router.wait(10)
        for f in fakes:
            f.kill()


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return 0


def _failures(url: str, name: str) -> float:
    try:
        return metric(httpx.get(url + "/metrics", timeout=5).text, name)
    except (httpx.HTTPError, KeyError):
        return -1

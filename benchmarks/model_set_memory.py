"""Resident memory of a `tokenmill serve` of two models as they load and unload.

Serves the bundled SmolLM2-135M GGUF twice, under two names (two links to the
one file in a temporary folder, so each loads as its own model with its own
engine and KV pool), with ``--idle-unload-seconds``, and reads the server
process's RSS (``/proc/PID/status``):

1. started, no model loaded;
2. after a request for the first model (it loads);
3. after a request for the second (both loaded);
4. once both are idle past the timeout and unloaded;
5. after the first is loaded again (memory is reused, not leaked);
6. with ``--swaps N``: N requests alternating between the two models, each a
   completion and a JSON-schema-constrained chat (so each model compiles a
   grammar and fills masks on its own threads), RSS and the process's thread
   count every tenth; with ``--max-loaded-models 1`` each request swaps them.

Usage (extra flags go to `tokenmill serve`):

    python benchmarks/model_set_memory.py --kv-cache-memory 64MiB
    python benchmarks/model_set_memory.py --swaps 110 --kv-cache-memory 64MiB --max-loaded-models 1

It starts and stops the server itself and binds loopback only. Prints one
line per step and a JSON summary.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def states(url: str) -> dict[str, str]:
    return {c["id"]: c["status"]["value"] for c in httpx.get(url + "/v1/models", timeout=10).json()["data"]}


def wait_until(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out")
        time.sleep(0.25)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--idle", type=float, default=30.0, help="--idle-unload-seconds of the server")
    p.add_argument("--settle", type=float, default=1.0, help="seconds to wait before each reading")
    p.add_argument("--swaps", type=int, default=0, help="then this many requests alternating between the models")
    args, serve_flags = p.parse_known_args()
    sys.path.insert(0, str(ROOT / "src"))
    from tokenmill.files.bundled import default_model_path

    bundled = default_model_path()
    with tempfile.TemporaryDirectory() as tmp:
        names = ["smol-a", "smol-b"]
        for name in names:
            os.symlink(bundled, os.path.join(tmp, name + ".gguf"))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli.main", "serve", "--host", "127.0.0.1", "--port",
               str(port), "--models-dir", tmp, "--idle-unload-seconds", str(args.idle), *serve_flags]
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        readings: dict[str, float] = {}
        try:
            wait_until(lambda: _healthy(url), 120)

            def read(step: str) -> None:
                time.sleep(args.settle)
                readings[step] = round(rss_mib(proc.pid), 1)
                print(f"{step:34s} rss {readings[step]:7.1f} MiB  {states(url)}", flush=True)

            def ask(model: str) -> None:
                r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 8},
                               timeout=300)
                r.raise_for_status()

            read("started, none loaded")
            ask(names[0])
            read(f"{names[0]} loaded")
            ask(names[1])
            read("both loaded")
            wait_until(lambda: set(states(url).values()) == {"unloaded"}, args.idle + 60)
            read("both unloaded (idle)")
            ask(names[0])
            read(f"{names[0]} loaded again")
            for i in range(args.swaps):
                name = names[(i + 1) % 2]
                ask(name)
                constrained(url, name)
                if i % 10 == 9 or i == args.swaps - 1:
                    read(f"swap {i + 1} (threads {threads(proc.pid)})")
        finally:
            proc.terminate()
            proc.wait(60)
    print(json.dumps({"rss_mib": readings, "serve_flags": serve_flags}, indent=1))
    return 0


def constrained(url: str, model: str) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "model": model, "messages": [{"role": "user", "content": "a number"}], "max_tokens": 6,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})
    r.raise_for_status()


def threads(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("Threads:"))


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    sys.exit(main())

"""A bounded soak of the fleet: every API through the router to three `tokenmill serve` replicas
(benchmarks/soak.py soaks one server).

Mixes plain and streamed completions and chat, grammars (JSON schema, regex,
choice, Lark), tools, echo with logprobs and n > 1, prompt logprobs, the
Responses API, a replica with n-gram speculation, clients that hang up
(streaming and not), grammar bombs and oversized bodies, and reports:

- responses by status, and every 5xx (the goal: none);
- each replica's resident memory after warm-up and at the end (goal: growth
  under 5%). The server hands freed heap back to the OS every half minute
  (entrypoints/server/heap.py), so one reading swings by about 4% with the moment it
  is taken; each end is therefore the highest of the readings taken every
  5 seconds over its first and last minute of traffic (the working set's
  high-water mark at each end, whatever the trim's phase). The single readings
  (right after warm-up, and once idle at the end) are reported too;
- KV blocks still in use once the traffic stops (goal: 0 on every replica);
- whether every replica kept its process id.

The replicas serve a tiny random Llama written to a temporary folder (the
soak is about the serving machinery, not the model), so it runs on a small
CPU machine. Usage:

    python benchmarks/router_soak.py --minutes 10 --concurrency 6

It starts and stops everything itself and binds loopback only.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

TEMPLATE = ("{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\\n' }}{% endif %}"
            "{% for m in messages %}{{ m.role }}: {{ m.content or '' }}{{ '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def chained_lark(n: int) -> str:
    return "start: r0\n" + "\n".join(f'r{i}: "a" r{i + 1}' for i in range(n)) + f'\nr{n}: "b"\n'


def chained_schema(n: int) -> dict:
    defs: dict = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def workload(rng: random.Random) -> tuple[str, str, dict, str]:
    """(kind, path, body, how): how is 'whole', 'stream', 'hangup' or 'hangup_stream'."""
    words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "omega"]) for _ in range(rng.randint(3, 30)))
    n = rng.random()
    if n < 0.14:
        return "plain", "/v1/completions", {"prompt": words, "max_tokens": rng.randint(1, 24)}, "whole"
    if n < 0.28:
        return "stream", "/v1/completions", {"prompt": words, "max_tokens": 24, "stream": True,
                                             "stream_options": {"include_usage": True}}, "stream"
    if n < 0.38:
        return "chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": words}],
                                                "max_tokens": 12, "stream": rng.random() < 0.5}, "stream"
    if n < 0.48:
        grammar = rng.choice([{"guided_json": {"type": "object", "properties": {"k": {"type": "integer"}},
                                               "required": ["k"]}},
                              {"guided_regex": "[a-c]{3,6}"}, {"guided_choice": ["yes", "no"]},
                              {"guided_grammar": 'start: "x" ("y" | "z")+\n'}])
        return "grammar", "/v1/completions", {"prompt": words, "max_tokens": 10, **grammar}, "whole"
    if n < 0.55:
        choice = rng.choice(["required", "none", "auto", {"type": "function", "function": {"name": "weather"}}])
        return "tools", "/v1/chat/completions", {"messages": USER, "tools": [WEATHER], "tool_choice": choice,
                                                 "max_tokens": 16}, "whole"
    if n < 0.62:
        return "echo", "/v1/completions", {"prompt": words, "max_tokens": 2, "echo": True, "logprobs": 2,
                                           "n": 4, "prompt_logprobs": 1}, "whole"
    if n < 0.70:
        return "responses", "/v1/responses", {"input": words, "max_output_tokens": 8,
                                              "stream": rng.random() < 0.5}, "stream"
    if n < 0.76:  # repetitive text: the speculating replica finds n-grams in it
        return "speculation", "/v1/completions", {"prompt": "one two three one two three one two",
                                                  "max_tokens": 24, "temperature": 0}, "whole"
    if n < 0.84:
        return "abort", "/v1/completions", {"prompt": words, "max_tokens": 200, "stream": rng.random() < 0.5},\
            rng.choice(["hangup", "hangup_stream"])
    if n < 0.92:
        bomb = rng.choice([{"guided_grammar": chained_lark(3000)}, {"guided_json": chained_schema(1000)}])
        return "bomb", "/v1/completions", {"prompt": "x", "max_tokens": 2, **bomb}, "whole"
    if n < 0.96:
        return "oversize", "/v1/completions", {"prompt": "z " * (600 << 10), "max_tokens": 1}, "whole"
    return "bad_json", "/v1/completions", {"__raw__": "[" * 5000}, "whole"


async def one(client: httpx.AsyncClient, url: str, kind: str, path: str, body: dict, how: str) -> int:
    if "__raw__" in body:
        r = await client.post(url + path, content=body["__raw__"], headers={"content-type": "application/json"})
        return r.status_code
    if how == "whole":
        return (await client.post(url + path, json=body)).status_code
    if how in ("stream", "hangup_stream"):
        async with client.stream("POST", url + path, json=body) as r:
            async for line in r.aiter_lines():
                if how == "hangup_stream" and line.startswith("data: "):
                    break  # the client leaves after the first event
                if line.startswith("data: ") and '"error"' in line and '"backend_' in line:
                    return 599  # an error event mid-stream counts as a server failure
            return r.status_code
    try:  # "hangup": a non-streaming client that gives up
        return (await client.post(url + path, json=body, timeout=0.3)).status_code
    except httpx.TimeoutException:
        return 499


async def drive(url: str, seconds: float, concurrency: int, seed: int, on_progress) -> Counter:
    statuses: Counter = Counter()
    deadline = time.monotonic() + seconds
    rng = random.Random(seed)

    async def worker(k: int) -> None:
        local = random.Random(rng.random())
        async with httpx.AsyncClient(timeout=120) as client:
            while time.monotonic() < deadline:
                kind, path, body, how = workload(local)
                try:
                    status = await one(client, url, kind, path, body, how)
                except httpx.HTTPError as exc:
                    status = 598
                    print(f"  {kind}: {type(exc).__name__}: {exc}", flush=True)
                statuses[(kind, status)] += 1

    ticker = asyncio.create_task(_tick(on_progress, deadline))
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    ticker.cancel()
    return statuses


class RssSampler:
    """Each replica's RSS every ``every_s`` seconds, in a thread, while the traffic runs."""

    def __init__(self, pids: list[int], started: float, every_s: float = 5.0) -> None:
        self.pids, self.started, self.every_s = pids, started, every_s
        self.samples: list[tuple[float, list[int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self.samples.append((time.monotonic() - self.started, [rss_bytes(pid) for pid in self.pids]))
            if self._stop.wait(self.every_s):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def window_max(self, start_s: float, end_s: float | None) -> list[int]:
        """Each replica's highest reading taken between ``start_s`` and ``end_s`` (None: the end)."""
        rows = [r for t, r in self.samples if t >= start_s and (end_s is None or t <= end_s)]
        return [max(col) for col in zip(*rows)]


async def _tick(on_progress, deadline: float) -> None:
    while time.monotonic() < deadline:
        await asyncio.sleep(15)
        on_progress()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--warmup-minutes", type=float, default=1.0, help="traffic before the first RSS reading")
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the report as JSON here too")
    a = p.parse_args()

    from conftest import save_tiny_hf_folder
    from tokenmill.router.config import RouterConfig
    from tokenmill.router.server import RouterServer

    work = Path(tempfile.mkdtemp(prefix="tokenmill-soak-"))
    model = save_tiny_hf_folder(work / "tiny")
    (work / "template.jinja").write_text(TEMPLATE)
    common = ["--model", model, "--dtype", "float32", "--quantization", "none", "--max-model-len", "1024",
              "--num-blocks", "256", "--threads", "1", "--no-ui", "--chat-template", str(work / "template.jinja"),
              "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--max-request-bytes", str(1 << 20)]
    extra = [[], [], ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3})]]
    procs: list[tuple[str, subprocess.Popen]] = []
    router = None
    try:
        for args in extra:
            port = free_port()
            proc = subprocess.Popen([sys.executable, "-m", "tokenmill.entrypoints.cli.main", "serve", "--host",
                                     "127.0.0.1", "--port", str(port), *common, *args],
                                    stdout=subprocess.DEVNULL, stderr=open(work / f"serve-{port}.log", "w"),
                                    env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
            procs.append((f"http://127.0.0.1:{port}", proc))
        for url, proc in procs:
            deadline = time.monotonic() + 300
            while True:
                assert proc.poll() is None, f"a replica exited: see {work}"
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "a replica did not start"
                time.sleep(0.5)
        router = RouterServer(RouterConfig(backends=[u for u, _ in procs], port=0, health_interval=1.0)
                              ).start_in_thread()
        pids = [proc.pid for _, proc in procs]
        print(f"replicas {pids} behind {router.url}; warm-up {a.warmup_minutes} min", flush=True)
        warm = asyncio.run(drive(router.url, a.warmup_minutes * 60, a.concurrency, a.seed, lambda: None))
        rss_start = [rss_bytes(pid) for pid in pids]
        started = time.monotonic()
        sampler = RssSampler(pids, started)

        def progress() -> None:
            now = [rss_bytes(pid) for pid in pids]
            print(f"  {time.monotonic() - started:5.0f} s  rss MiB {[round(r / 2**20) for r in now]}", flush=True)

        statuses = asyncio.run(drive(router.url, a.minutes * 60, a.concurrency, a.seed + 1, progress))
        sampler.stop()
        first_minute, last_minute = sampler.window_max(0, 60), sampler.window_max(a.minutes * 60 - 60, None)
        time.sleep(3)  # let aborted work and the last streams finish
        rss_end = [rss_bytes(pid) for pid in pids]
        leaked = []
        for url, _ in procs:
            stats = httpx.get(url + "/v1/engine/stats", timeout=10).json()
            leaked.append(stats["kv_blocks"]["in_use"])
        alive = [proc.poll() is None for _, proc in procs]
        by_status: Counter = Counter()
        for (_, status), count in statuses.items():
            by_status[status] += count
        five_xx = {f"{k} {s}": c for (k, s), c in sorted(statuses.items()) if s >= 500}
        report = {
            "minutes": a.minutes, "concurrency": a.concurrency, "requests": sum(statuses.values()),
            "warmup_requests": sum(warm.values()),
            "by_status": dict(sorted(by_status.items())),
            "by_kind_status": {f"{k} {s}": c for (k, s), c in sorted(statuses.items())},
            "5xx": five_xx,
            "rss_first_minute_max_mib": [round(r / 2**20, 1) for r in first_minute],
            "rss_last_minute_max_mib": [round(r / 2**20, 1) for r in last_minute],
            "rss_growth_pct": [round(100.0 * (e - s) / s, 2) for s, e in zip(first_minute, last_minute)],
            "rss_after_warmup_mib": [round(r / 2**20, 1) for r in rss_start],
            "rss_end_idle_mib": [round(r / 2**20, 1) for r in rss_end],
            "rss_growth_single_readings_pct": [round(100.0 * (e - s) / s, 2) for s, e in zip(rss_start, rss_end)],
            "leaked_blocks": leaked, "replicas_alive_same_pid": alive,
        }
        print(json.dumps(report, indent=2))
        if a.out:
            Path(a.out).write_text(json.dumps(report, indent=2))
        ok = not five_xx and all(alive) and not any(leaked) and all(g < 5 for g in report["rss_growth_pct"])
        return 0 if ok else 1
    finally:
        if router is not None:
            router.stop()
        for _, proc in procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()


if __name__ == "__main__":
    sys.exit(main())

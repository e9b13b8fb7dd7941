"""Many streams through the servers: `tokenmill serve` against llama.cpp's `llama-server` on the
same GGUF file and threads, the same client, turn about, in one run.

Both servers run on loopback with room for ``--concurrency`` sequences (llama-server:
``--parallel`` slots and a context of that many times the longest request; tokenmill:
``--max-num-seqs``). The client is tokenmill's load generator (which takes `vllm bench serve`'s
command lines) in a closed loop of ``--concurrency`` streams over ``/v1/completions``: random
prompts of ``--input-len`` tokens that share no prefix, exactly ``--output-len`` new tokens
(``ignore_eos``, which llama-server honours too), greedy. With ``--vllm-bench CMD`` the client is
vLLM's own instead: ``CMD`` (``vllm bench serve``, or a command that runs it) with its random
dataset at the same lengths, ``--max-concurrency``, ``--ignore-eos`` and temperature 0, the
file's tokenizer written to a temporary Hugging Face folder for it, and the figures read from
its ``--save-result`` file. Each round runs every server once, in turn; the figure is each
server's output tokens per second summed over rounds, and tokenmill's ratio against
llama-server's.

``--shape`` writes a random-weight GGUF in a real model's shape (benchmarks/real_sizes.py) into
a temporary folder and deletes it afterwards; ``--model`` takes a file you have.

    .venv/bin/python benchmarks/llama_server.py --llama-server PATH/llama-server --shape 1.1b --qtype Q4_0
        [--concurrency 64] [--requests 128] [--input-len 128] [--output-len 64] [--threads 2] [--rounds 2]
        [--tokenmill-args "--quantization gguf"] [--vllm-bench "vllm bench serve"]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode_speed  # noqa: E402  (first: it notes the caller's OpenMP wait policy before tokenmill sets one)
from tokenmill.bench.client import Target  # noqa: E402
from tokenmill.bench.lengths import parse_length  # noqa: E402
from tokenmill.bench.loadgen import LoadShape  # noqa: E402
from tokenmill.bench.runner import BenchConfig, BenchResult, run_bench  # noqa: E402
from tokenmill.bench.tokens import make_counter  # noqa: E402
from tokenmill.bench.workloads import SyntheticConfig  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    name: str
    cmd: list[str]
    port: int
    env: dict[str, str] | None = None  # None: this process's
    proc: subprocess.Popen | None = None
    log: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 900.0) -> None:
        fd, self.log = tempfile.mkstemp(prefix=f"{self.name}-", suffix=".log")
        self.proc = subprocess.Popen(self.cmd, stdout=fd, stderr=subprocess.STDOUT, env=self.env)
        os.close(fd)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); see {self.log}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} did not start in {timeout:g} s; see {self.log}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def measure(server: Server, counter, args: argparse.Namespace, seed: int) -> tuple[int, float]:
    """Output tokens and seconds of one closed-loop run against ``server``."""
    async with httpx.AsyncClient(trust_env=False) as client:
        models = (await client.get(server.url + "/v1/models", timeout=10.0)).json()["data"]
    target = Target(server.url, models[0]["id"], "completions", None, ignore_eos=True, temperature=0.0)
    cfg = BenchConfig(shapes=[LoadShape(concurrency=args.concurrency)], num_requests=args.requests,
                      synthetic=SyntheticConfig(parse_length(args.input_len), parse_length(args.output_len)),
                      output_len=parse_length(args.output_len), seed=seed, timeout=1800.0, progress=False,
                      warmup=min(4, args.concurrency))
    result = BenchResult(target={}, config={})
    await run_bench(cfg, target, counter, result)
    point = result.points[0]
    s = point.summary
    if s.failed:
        errors = {r.error for r in point.run.records if not r.ok}
        raise RuntimeError(f"{server.name}: {s.failed} requests failed: {sorted(errors)[:3]}")
    return s.output_tokens, s.duration


def measure_with_vllm(server: Server, args: argparse.Namespace, tokenizer: str, seed: int,
                      folder: str) -> tuple[int, float, int]:
    """Output tokens, seconds and failed requests of one run of vLLM's ``vllm bench serve`` against
    ``server`` (its output throughput: the completed requests' tokens over the run's time)."""
    model = httpx.get(server.url + "/v1/models", timeout=10.0, trust_env=False).json()["data"][0]["id"]
    name = f"{server.name}-{seed}.json"
    cmd = [*shlex.split(args.vllm_bench), "--backend", "openai", "--base-url", server.url, "--endpoint",
           "/v1/completions", "--model", model, "--tokenizer", tokenizer, "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(args.requests), "--max-concurrency", str(args.concurrency), "--ignore-eos",
           "--temperature", "0", "--seed", str(seed), "--disable-tqdm", "--save-result", "--result-dir", folder,
           "--result-filename", name]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve against {server.name} failed:\n{done.stdout[-2000:]}\n"
                           f"{done.stderr[-2000:]}")
    with open(os.path.join(folder, name)) as f:
        result = json.load(f)
    failed = int(result.get("failed") or 0)
    if failed:
        errors = sorted({e for e in result.get("errors", []) if e})
        print(f"  {server.name}: {failed} requests failed under vllm bench serve {errors[:3]}; its summary:\n"
              + "\n".join(done.stdout.splitlines()[-30:]), flush=True)
    return int(result["total_output_tokens"]), float(result["duration"]), failed


def tokenizer_folder(path: str, folder: str) -> str:
    """The GGUF file's tokenizer as a Hugging Face folder (what vLLM's client loads; no hub here)."""
    import transformers

    out = os.path.join(folder, "tokenizer")
    tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tok.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--llama-server", required=True, help="the llama-server binary")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a GGUF file")
    src.add_argument("--shape", choices=["1.1b", "3b", "8b", "tiny"], help="write a random-weight GGUF this shape")
    ap.add_argument("--qtype", default="Q4_0", choices=["Q4_0", "Q5_0", "Q4_K_M", "Q5_K_M", "Q8_0"])  # real_sizes.QTYPES
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=128, help="requests per run (closed loop)")
    ap.add_argument("--input-len", default="128")
    ap.add_argument("--output-len", default="64")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokenmill-args", default="", help="extra `tokenmill serve` flags")
    ap.add_argument("--llama-server-args", default="", help="extra llama-server flags")
    ap.add_argument("--vllm-bench", default="", help="drive both servers with vLLM's client: the command that runs "
                    "`vllm bench serve` (e.g. 'vllm bench serve')")
    args = ap.parse_args(argv)

    tmp = tempfile.TemporaryDirectory(prefix="llama-server-bench-")
    try:
        path = args.model
        if path is None:
            from real_sizes import SHAPES, write_model

            path = os.path.join(tmp.name, f"{args.shape}-{args.qtype}.gguf")
            write_model(path, SHAPES[args.shape], args.qtype)
        # room for a prompt that the server's tokenizer makes longer than the client counted (vLLM's
        # random prompts are token ids decoded to text)
        per_seq = 2 * int(args.input_len) + int(args.output_len) + 64
        tm = Server("tokenmill", [sys.executable, "-m", "tokenmill.entrypoints.cli.main", "serve", "--model", path,
                                  "--host", "127.0.0.1", "--port", str(_free_port()), "--threads", str(args.threads),
                                  "--max-num-seqs", str(args.concurrency), *shlex.split(args.tokenmill_args)],
                    0)
        tm.port = int(tm.cmd[tm.cmd.index("--port") + 1])
        port = _free_port()
        ll = Server("llama-server", [args.llama_server, "-m", path, "--host", "127.0.0.1", "--port", str(port),
                                     "-t", str(args.threads), "-tb", str(args.threads),
                                     "--parallel", str(args.concurrency), "-c", str(args.concurrency * per_seq),
                                     "--cont-batching", "--no-webui", *shlex.split(args.llama_server_args)], port,
                    env=decode_speed.llama_cpp_env())
        servers = [tm, ll]
        for s in servers:
            s.start()
        counter = make_counter(None, tm.url, None, None, True)  # tokenmill's /tokenize: the file's tokenizer
        tokenizer = tokenizer_folder(path, tmp.name) if args.vllm_bench else ""
        totals = {s.name: [0, 0.0] for s in servers}
        client = "vLLM's `vllm bench serve`" if args.vllm_bench else "tokenmill's load generator"
        print(f"{path}: {args.concurrency} streams, {args.requests} requests of {args.input_len} -> "
              f"{args.output_len} tokens, {args.threads} threads each, {args.rounds} rounds turn about; "
              f"client: {client}")
        for r in range(args.rounds):
            for s in servers:
                failed = 0
                if args.vllm_bench:
                    tokens, seconds, failed = measure_with_vllm(s, args, tokenizer, 100 * r, tmp.name)
                else:
                    tokens, seconds = asyncio.run(measure(s, counter, args, seed=100 * r))
                totals[s.name][0] += tokens
                totals[s.name][1] += seconds
                note = f", {failed} requests failed" if failed else ""
                print(f"  round {r + 1} {s.name:>12}: {tokens / seconds:8.1f} output tok/s ({tokens} tokens{note})",
                      flush=True)
        rates = {name: t / sec for name, (t, sec) in totals.items()}
        for name, rate in rates.items():
            print(f"{name:>12}: {rate:8.1f} output tok/s")
        print(f"tokenmill / llama-server: {rates['tokenmill'] / rates['llama-server']:.2f}x")
        for s in servers:
            s.stop()
        return 0
    finally:
        for s in locals().get("servers", []):
            s.stop()
        tmp.cleanup()


if __name__ == "__main__":
    raise SystemExit(main())

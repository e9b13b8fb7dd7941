"""Router benchmark: prefix-aware vs round-robin over 3 local replicas, one run.

    python benchmarks/router.py                    # real `tokenmill serve` replicas if possible
    python benchmarks/router.py --backends fake    # simulated replicas (tests/fake_backend.py)

Sends the same shared-prefix workload (8 long prefixes, short unique
suffixes, random order) through the router once per policy, resetting the
replicas' prefix caches in between, and prints throughput, TTFT p50/p99 and
the replicas' own prefix-cache hit rate for each policy, then the ratios
prefix / round-robin. Real replicas are started with a small KV cache so that
one replica cannot hold every prefix (``--cache-blocks``), which is the
situation a router is for.
With fake replicas the figures come from a cost model, and the output says so.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

from tokenmill.router.config import RouterConfig  # noqa: E402
from tokenmill.router.server import RouterServer  # noqa: E402
from tokenmill.router.workload import RunSummary, run_workload, shared_prefix_workload  # noqa: E402


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tokenmill_cmd() -> list[str] | None:
    """How to run `tokenmill serve` here, or None when the server is not available."""
    try:
        import tokenmill.entrypoints.cli.serve_cli  # noqa: F401
    except ModuleNotFoundError:
        return None
    exe = shutil.which("tokenmill") or str(Path(sys.executable).with_name("tokenmill"))
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "tokenmill.entrypoints.cli.main"]


class Replicas:
    """Three (or n) local replicas as subprocesses; stopped on exit."""

    def __init__(self, kind: str, n: int, args: argparse.Namespace) -> None:
        self.kind = kind
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []
        for _ in range(n):
            port = _free_port()
            if kind == "real":
                cmd = [*_tokenmill_cmd(), "serve", "--host", "127.0.0.1", "--port", str(port),
                       "--num-blocks", str(args.cache_blocks)]
                if args.model:
                    cmd += ["--model", args.model]
                cmd += args.serve_arg
                env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // n)))
            else:
                cmd = [sys.executable, str(ROOT / "tests" / "fake_backend.py"), "--port", str(port),
                       "--name", f"r{len(self.procs)}", "--num-blocks", str(args.cache_blocks)]
                env = dict(os.environ)
            log = open(os.devnull, "w") if not args.verbose else None
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=log, env=env))
            self.urls.append(f"http://127.0.0.1:{port}")

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = set(self.urls)
        while pending and time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a replica exited with code {p.returncode}: {p.args}")
            for u in list(pending):
                try:
                    if httpx.get(u + "/health", timeout=2).status_code == 200:
                        pending.discard(u)
                except httpx.HTTPError:
                    pass
            time.sleep(0.5)
        if pending:
            raise TimeoutError(f"replicas not ready: {sorted(pending)}")

    def reset_caches(self) -> None:
        for u in self.urls:
            httpx.post(u + "/reset_prefix_cache", timeout=30)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


def run_policy(policy: str, replicas: Replicas, items, args: argparse.Namespace) -> RunSummary:
    replicas.reset_caches()
    cfg = RouterConfig(backends=replicas.urls, port=0, policy=policy, health_interval=1.0)
    router = RouterServer(cfg).start_in_thread()
    try:
        return asyncio.run(run_workload(router.url, items, args.concurrency, max_tokens=args.max_tokens,
                                        backends=replicas.urls, timeout=args.request_timeout))
    finally:
        router.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--backends", choices=["auto", "real", "fake"], default="auto",
                   help="real `tokenmill serve` replicas, fake ones, or real when available (default)")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--model", default=None, help="model for real replicas (default: the bundled one)")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="extra argument for `tokenmill serve` (repeat), e.g. --serve-arg=--kv-cache-memory=64M")
    p.add_argument("--prefixes", type=int, default=8)
    p.add_argument("--per-prefix", type=int, default=6)
    p.add_argument("--prefix-words", type=int, default=80,
                   help="words per shared prefix (80: about 180 tokens of the bundled model, 11 blocks)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--cache-blocks", type=int, default=None,
                   help="KV blocks per replica: room for about three prefixes, not eight "
                        "(default 40 for real replicas, 18 for fake ones, whose tokens are words)")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    p.add_argument("--verbose", action="store_true", help="show replica logs")
    args = p.parse_args(argv)

    kind = args.backends
    if kind == "auto":
        kind = "real" if _tokenmill_cmd() else "fake"
    if kind == "real" and not _tokenmill_cmd():
        print("tokenmill serve is not available; use --backends fake", file=sys.stderr)
        return 2
    if args.cache_blocks is None:
        args.cache_blocks = 40 if kind == "real" else 18
    label = ("real `tokenmill serve` replicas" if kind == "real"
             else "FAKE replicas (tests/fake_backend.py: simulated cache and cost model, not a model)")
    items = shared_prefix_workload(args.prefixes, args.per_prefix, args.prefix_words, seed=args.seed)
    print(f"router benchmark: {len(items)} requests, {args.prefixes} shared prefixes of {args.prefix_words} words, "
          f"concurrency {args.concurrency}, {args.max_tokens} output tokens, {args.replicas} x {label} "
          f"with {args.cache_blocks} KV blocks each")
    replicas = Replicas(kind, args.replicas, args)
    results: dict[str, RunSummary] = {}
    try:
        replicas.wait_ready(args.ready_timeout)
        # One small request per replica so first-request costs do not land in one policy's figures.
        for u in replicas.urls:
            httpx.post(u + "/v1/completions", json={"prompt": "warm up", "max_tokens": 1}, timeout=args.request_timeout)
        for policy in ("round-robin", "prefix"):
            results[policy] = run_policy(policy, replicas, items, args)
    finally:
        replicas.stop()

    def row(name: str, s: RunSummary) -> str:
        hit = f"{s.hit_rate:.3f}" if s.hit_rate is not None else "n/a"
        return (f"{name:<12} {s.ok:>4}/{len(s.results):<4} {s.wall_s:>8.2f} {s.throughput:>9.2f} "
                f"{s.ttft_pct(50) * 1e3:>9.1f} {s.ttft_pct(99) * 1e3:>9.1f} {hit:>8} {s.max_share():>9.2f}")

    print(f"{'policy':<12} {'ok':>9} {'wall s':>8} {'req/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'hit':>8} {'max share':>9}")
    for name, s in results.items():
        print(row(name, s))
    px, rr = results["prefix"], results["round-robin"]

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b not in (None, 0) else None

    ratios = {
        "throughput": ratio(px.throughput, rr.throughput),
        "ttft_p50": ratio(px.ttft_pct(50), rr.ttft_pct(50)),
        "ttft_p99": ratio(px.ttft_pct(99), rr.ttft_pct(99)),
        "hit_rate": ratio(px.hit_rate, rr.hit_rate),
    }
    fmt = {k: (f"{v:.2f}x" if v is not None else "n/a") for k, v in ratios.items()}
    print(f"prefix / round-robin: throughput {fmt['throughput']}, TTFT p50 {fmt['ttft_p50']}, "
          f"TTFT p99 {fmt['ttft_p99']}, hit rate {fmt['hit_rate']}  ({label})")
    if args.json:
        print(json.dumps({"backends": kind, "ratios": ratios, "policies": {
            k: {"ok": s.ok, "n": len(s.results), "wall_s": s.wall_s, "throughput_rps": s.throughput,
                "ttft_p50_s": s.ttft_pct(50), "ttft_p99_s": s.ttft_pct(99), "hit_rate": s.hit_rate,
                "max_share": s.max_share()} for k, s in results.items()}}))
    return 0 if all(s.ok == len(s.results) for s in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

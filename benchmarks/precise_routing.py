"""Routing on replicas' KV events against routing on the router's guess, in one run.

    python benchmarks/precise_routing.py                 # 3 replicas, evictions, bypass traffic, a restart

Three `tokenmill serve` replicas of the bundled model, each with a pool too small for every
shared prefix (``--cache-blocks``) and publishing KV events. The same shared-prefix workload goes
through `tokenmill route` once per prefix source (``approximate``: what the router sent where;
``events``: what the replicas say they hold), caches reset in between. In each run a share of the
requests (``--bypass``) go straight to a replica, as another router or client would send them, and
one replica is restarted halfway (its cache is then empty). Figures: the routed requests' prompt
hit rate (cached prompt tokens / prompt tokens, from the responses' usage), that rate as a share
of an ideal shared cache (one LRU prefix cache as large as the three pools together, fed the same
requests in the same order: the baseline), and TTFT p50/p90.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from tokenmill.router.config import RouterConfig  # noqa: E402
from tokenmill.router.cache.prefix_index import PrefixIndex, block_hashes  # noqa: E402
from tokenmill.router.server import RouterServer  # noqa: E402
from tokenmill.router.workload import one_request, shared_prefix_workload  # noqa: E402

BLOCK = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Replica:
    port: int
    events: str
    replay: str
    cache_blocks: int
    threads: int
    tier_dir: str | None = None  # --kv-offload-dir: the replica keeps its cache across the restart
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        config = {"enable_kv_cache_events": True, "endpoint": self.events, "replay_endpoint": self.replay}
        cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli.main", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), "--num-blocks", str(self.cache_blocks), "--dtype", "float32",
               "--kv-events-config", json.dumps(config)]
        if self.tier_dir:
            cmd += ["--kv-offload-bytes", "1G", "--kv-offload-dir", self.tier_dir]
        env = dict(os.environ, OMP_NUM_THREADS=str(self.threads), PYTHONPATH=str(ROOT / "src"))
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"replica on {self.port} exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"replica on {self.port} not ready")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def ideal_hit_rate(token_lists: list[list[int]], capacity_blocks: int) -> float:
    """Hit rate of one shared LRU prefix cache of ``capacity_blocks`` over these prompts, in order
    (the last prompt token is always computed, as a replica's cache caps a hit)."""
    cache = PrefixIndex(capacity_blocks)
    hit = total = 0
    for ids in token_lists:
        keys = block_hashes(ids, BLOCK)
        hit += min(cache.match(keys) * BLOCK, len(ids) - 1)
        total += len(ids)
        cache.insert(keys)
    return hit / total


async def run(mode: str, replicas: list[Replica], items, prompt_tokens: dict[str, int], args) -> dict:
    for r in replicas:
        httpx.post(r.url + "/reset_prefix_cache", timeout=30)
    cfg = RouterConfig(backends=[r.url for r in replicas], port=0, health_interval=0.5, prefix_source=mode,
                       kv_events={r.url: (r.events, r.replay) for r in replicas})
    router = RouterServer(cfg).start_in_thread()
    rng = random.Random(args.seed)
    routed: list = []
    try:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=32), trust_env=False) as client:
            queue: asyncio.Queue = asyncio.Queue()
            for it in items:
                queue.put_nowait(it)
            done = 0
            restarted = asyncio.Event()

            async def worker() -> None:
                nonlocal done
                while not queue.empty():
                    it = queue.get_nowait()
                    if rng.random() < args.bypass:  # another client, straight to a replica
                        target = rng.choice(replicas).url
                        await one_request(client, target, it.prompt, args.max_tokens, timeout=300)
                    else:
                        res = await one_request(client, router.url, it.prompt, args.max_tokens, timeout=300)
                        routed.append((it.prompt, res))
                    done += 1
                    if args.restart and done == len(items) // 2 and not restarted.is_set():
                        restarted.set()
                        victim = replicas[-1]
                        await asyncio.to_thread(victim.stop)
                        victim.start()
                        await asyncio.to_thread(victim.wait_ready)

            await asyncio.gather(*[worker() for _ in range(args.concurrency)])
    finally:
        router.stop()
    ok = [(p, r) for p, r in routed if r.ok and r.cached_tokens is not None]
    hit = sum(r.cached_tokens for _, r in ok)
    total = sum(prompt_tokens[p] for p, _ in ok)
    ttfts = sorted(r.ttft for _, r in ok if r.ttft is not None)

    def pct(q: float) -> float:
        return ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else float("nan")

    return {"mode": mode, "routed": len(routed), "ok": len(ok), "hit_rate": hit / total if total else 0.0,
            "ttft_p50": pct(0.5), "ttft_p90": pct(0.9)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--prefixes", type=int, default=8)
    p.add_argument("--per-prefix", type=int, default=8)
    p.add_argument("--prefix-words", type=int, default=80, help="about 180 tokens of the bundled model each")
    p.add_argument("--cache-blocks", type=int, default=40, help="KV blocks per replica (room for ~3 prefixes)")
    p.add_argument("--concurrency", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--bypass", type=float, default=0.2, help="share of requests sent straight to a replica")
    p.add_argument("--no-restart", dest="restart", action="store_false", help="no replica restart halfway")
    p.add_argument("--disk-tier", action="store_true",
                   help="replicas keep a disk tier (--kv-offload-bytes), so the restarted one comes back warm")
    p.add_argument("--seed", type=int, default=3)
    args = p.parse_args(argv)

    threads = max(1, (os.cpu_count() or 1) // 3)
    tiers = tempfile.TemporaryDirectory() if args.disk_tier else None
    replicas = [Replica(_free_port(), f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}",
                        args.cache_blocks, threads, os.path.join(tiers.name, str(i)) if tiers else None)
                for i in range(3)]
    for r in replicas:
        r.start()
    try:
        for r in replicas:
            r.wait_ready()
        items = shared_prefix_workload(args.prefixes, per_prefix=args.per_prefix, prefix_words=args.prefix_words,
                                       seed=args.seed)
        tokens = {it.prompt: httpx.post(replicas[0].url + "/tokenize", json={"prompt": it.prompt},
                                        timeout=30).json()["tokens"] for it in items}
        ideal = ideal_hit_rate([tokens[it.prompt] for it in items], 3 * args.cache_blocks)
        lengths = {k: len(v) for k, v in tokens.items()}
        rows = [asyncio.run(run(mode, replicas, items, lengths, args)) for mode in ("approximate", "events")]
    finally:
        for r in replicas:
            r.stop()
        if tiers is not None:
            tiers.cleanup()
    print(f"{len(items)} requests, {args.prefixes} prefixes, 3 replicas x {args.cache_blocks} blocks, "
          f"bypass {args.bypass:.0%}, restart halfway: {args.restart}, disk tier: {args.disk_tier}")
    print(f"baseline: an ideal shared cache of {3 * args.cache_blocks} blocks, hit rate {ideal:.3f}")
    print(f"{'prefix source':<14} {'routed ok':>9} {'hit rate':>9} {'of ideal':>9} {'TTFT p50':>9} {'TTFT p90':>9}")
    for row in rows:
        print(f"{row['mode']:<14} {row['ok']:>9} {row['hit_rate']:>9.3f} {row['hit_rate'] / ideal:>9.2f} "
              f"{row['ttft_p50']:>8.2f}s {row['ttft_p90']:>8.2f}s")
    approx, events = rows
    if approx["hit_rate"] > 0:
        print(f"events / approximate hit rate: {events['hit_rate'] / approx['hit_rate']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Soak: minutes of mixed traffic with aborts against `tokenmill serve`; does memory stay flat?

Starts `tokenmill serve` (bundled SmolLM2 unless ``--model``) on a free
loopback port and keeps ``--concurrency`` clients busy for ``--minutes``
with a mix of what real traffic holds:

- chat and completions, streaming and not, prompts of a few to a few hundred
  tokens (some sharing a long prefix, so the prefix cache takes part),
  outputs of 1 to 128 tokens, now and then ``n`` > 1, stop strings, logprobs;
- aborts on purpose: streams cut after a few chunks, non-streaming requests
  given up on before they finish; a few bad requests that must get a 4xx.

Every ``--sample-every`` seconds it reads the server's RSS (``/proc``) and
its KV blocks in use (``/metrics``). Errors are anything not caused on
purpose: a 5xx, a 4xx to a valid request, a stream that ends without
``[DONE]``, a transport error on a request we did not cut.

At the end the load stops, the server gets a few seconds to settle, and it
reports: requests by kind, errors, KV blocks in use once idle (must be 0),
RSS at the end of the warm-up (``--warmup-minutes``) and at the end, growth
after warm-up as a ratio, and the post-warm-up slope from a least-squares fit.

    PYTHONPATH=src .venv/bin/python benchmarks/soak.py --minutes 30 [--warmup-minutes 5]
        [--concurrency 8] [--json soak.json] [-- extra serve flags]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

WORDS = ("the quick brown fox jumps over a lazy dog while seven bright lanterns hang above an old stone "
         "bridge and rivers carry quiet boats toward distant markets full of spice bread and copper pots").split()
SHARED = " ".join(random.Random(7).choice(WORDS) for _ in range(300))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


_IN_USE = re.compile(r'^tokenmill:kv_cache_blocks\{[^}]*state="in_use"[^}]*\}\s+([0-9.e+]+)', re.M)


async def kv_in_use(client: httpx.AsyncClient, url: str) -> int:
    text = (await client.get(url + "/metrics", timeout=10)).text
    m = _IN_USE.search(text)
    return int(float(m.group(1))) if m else -1


@dataclass
class Tally:
    kinds: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    def error(self, kind: str, what: str) -> None:
        self.errors[kind] += 1
        if len(self.examples) < 20:
            self.examples.append(f"{kind}: {what[:300]}")


def _prompt(rng: random.Random) -> str:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.choice((3, 20, 60, 150, 300))))
    return (SHARED + " " + words) if rng.random() < 0.3 else words


def _request(rng: random.Random) -> tuple[str, dict[str, Any], str]:
    """(path, body, plan): plan is 'full', 'cut' (stop reading early) or 'bad' (expect a 4xx)."""
    chat = rng.random() < 0.5
    body: dict[str, Any] = {"max_tokens": rng.choice((1, 8, 32, 64, 128)),
                            "temperature": rng.choice((0.0, 0.7, 1.0)), "stream": rng.random() < 0.6}
    if chat:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": _prompt(rng)}]
        if rng.random() < 0.15:
            body["logprobs"], body["top_logprobs"] = True, 3
    else:
        path = "/v1/completions"
        body["prompt"] = _prompt(rng) if rng.random() < 0.85 else [_prompt(rng), _prompt(rng)]
        if rng.random() < 0.15:
            body["logprobs"] = 2
    if rng.random() < 0.15:
        body["n"] = rng.choice((2, 4))
    if rng.random() < 0.2:
        body["stop"] = [rng.choice(WORDS)]
    roll = rng.random()
    if roll < 0.03:
        body["max_tokens"] = -5
        return path, body, "bad"
    if roll < 0.25:
        return path, body, "cut"
    return path, body, "full"


async def one(client: httpx.AsyncClient, url: str, rng: random.Random, tally: Tally) -> None:
    path, body, plan = _request(rng)
    kind = f"{'chat' if 'chat' in path else 'cmpl'}-{'stream' if body['stream'] else 'plain'}-{plan}"
    tally.kinds[kind] += 1
    try:
        if body["stream"]:
            async with client.stream("POST", url + path, json=body, timeout=300) as resp:
                if plan == "bad":
                    if not 400 <= resp.status_code < 500:
                        tally.error("bad request not refused", f"{resp.status_code}")
                    await resp.aread()
                    return
                if resp.status_code != 200:
                    tally.error(f"http {resp.status_code}", (await resp.aread()).decode(errors="replace"))
                    return
                cut_after = rng.randint(1, 6) if plan == "cut" else None
                chunks, done = 0, False
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    if '"error"' in line[:20]:
                        tally.error("stream error event", line)
                    chunks += 1
                    if cut_after is not None and chunks >= cut_after:
                        return  # leaving the block closes the connection mid-stream
                if not done and cut_after is None:
                    tally.error("stream without [DONE]", f"{chunks} chunks")
            return
        if plan == "cut":
            try:
                await client.post(url + path, json=body, timeout=rng.uniform(0.05, 0.5))
            except httpx.TimeoutException:
                pass  # given up on purpose: the server sees a disconnect and aborts
            return
        resp = await client.post(url + path, json=body, timeout=300)
        if plan == "bad":
            if not 400 <= resp.status_code < 500:
                tally.error("bad request not refused", f"{resp.status_code}")
        elif resp.status_code != 200:
            tally.error(f"http {resp.status_code}", resp.text)
    except httpx.HTTPError as exc:
        tally.error(type(exc).__name__, f"{kind}: {exc}")


async def drive(url: str, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    tally = Tally()
    samples: list[tuple[float, float, int]] = []  # (seconds since start, RSS MB, KV blocks in use)
    t0 = time.monotonic()
    end = t0 + args.minutes * 60
    limits = httpx.Limits(max_connections=args.concurrency * 2 + 4)

    async def worker(i: int) -> None:
        rng = random.Random(args.seed * 1000 + i)
        # each request on its own connection when it may be cut, like a client that goes away
        async with httpx.AsyncClient(limits=limits) as client:
            while time.monotonic() < end:
                await one(client, url, rng, tally)

    async def sampler() -> None:
        async with httpx.AsyncClient() as client:
            while time.monotonic() < end:
                try:
                    samples.append((time.monotonic() - t0, rss_mb(pid), await kv_in_use(client, url)))
                except (httpx.HTTPError, OSError) as exc:
                    tally.error("sampling", str(exc))
                last = samples[-1] if samples else None
                if last and args.verbose:
                    print(f"  t={last[0]:7.0f}s rss={last[1]:8.1f} MB kv_in_use={last[2]:4d} "
                          f"requests={sum(tally.kinds.values())} errors={sum(tally.errors.values())}", flush=True)
                await asyncio.sleep(args.sample_every)

    await asyncio.gather(sampler(), *[worker(i) for i in range(args.concurrency)])
    await asyncio.sleep(args.settle)
    async with httpx.AsyncClient() as client:
        idle_in_use = await kv_in_use(client, url)
    final_rss = rss_mb(pid)
    samples.append((time.monotonic() - t0, final_rss, idle_in_use))
    return summarise(samples, tally, idle_in_use, args)


def summarise(samples: list[tuple[float, float, int]], tally: Tally, idle_in_use: int,
              args: argparse.Namespace) -> dict[str, Any]:
    warm = args.warmup_minutes * 60
    after = [s for s in samples if s[0] >= warm] or samples[-1:]
    base = after[0][1]
    last = samples[-1][1]
    xs = [s[0] / 60 for s in after]
    ys = [s[1] for s in after]
    slope = 0.0
    if len(xs) > 2:
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        den = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0
    return {
        "minutes": args.minutes, "warmup_minutes": args.warmup_minutes, "concurrency": args.concurrency,
        "requests": sum(tally.kinds.values()), "by_kind": dict(sorted(tally.kinds.items())),
        "errors": sum(tally.errors.values()), "errors_by_kind": dict(tally.errors), "error_examples": tally.examples,
        "kv_blocks_in_use_idle": idle_in_use, "kv_blocks_in_use_peak": max(s[2] for s in samples),
        "rss_start_mb": samples[0][1], "rss_after_warmup_mb": base, "rss_peak_mb": max(s[1] for s in samples),
        "rss_end_mb": last, "growth_after_warmup": last / base - 1 if base else None,
        "slope_mb_per_min_after_warmup": slope, "samples": samples,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--warmup-minutes", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--sample-every", type=float, default=10.0, help="seconds between RSS/KV samples")
    p.add_argument("--settle", type=float, default=5.0, help="seconds idle before the last sample")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the summary (with every sample) here")
    p.add_argument("--server-log", help="append the server's output to this file")
    p.add_argument("--url", help="soak an already running server instead (RSS then needs --pid)")
    p.add_argument("--pid", type=int, help="the running server's pid, with --url")
    p.add_argument("-q", "--quiet", dest="verbose", action="store_false")
    args, serve_flags = p.parse_known_args()
    serve_flags = [f for f in serve_flags if f != "--"]
    proc = None
    if args.url:
        url, pid = args.url.rstrip("/"), args.pid
        if pid is None:
            p.error("--url needs --pid")
    else:
        port = free_port()
        cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli.main", "serve", "--host", "127.0.0.1",
               "--port", str(port), *serve_flags]
        log = open(args.server_log, "ab") if args.server_log else subprocess.DEVNULL
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        url, pid = f"http://127.0.0.1:{port}", proc.pid
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"tokenmill serve exited with {proc.returncode}: {' '.join(cmd)}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                proc.kill()
                raise SystemExit("the server did not start in 300 s")
            time.sleep(0.25)
    print(f"soak: {args.minutes:g} min at concurrency {args.concurrency} against {url} (pid {pid})", flush=True)
    try:
        result = asyncio.run(drive(url, pid, args))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    shown = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(shown, indent=1))
    growth = result["growth_after_warmup"]
    print(f"\nrequests {result['requests']}, errors {result['errors']}, KV blocks in use when idle "
          f"{result['kv_blocks_in_use_idle']}; RSS {result['rss_start_mb']:.0f} MB at start, "
          f"{result['rss_after_warmup_mb']:.0f} MB after warm-up, {result['rss_end_mb']:.0f} MB at the end: "
          f"growth after warm-up {growth:+.2%} ({result['slope_mb_per_min_after_warmup']:+.2f} MB/min)")
    ok = result["errors"] == 0 and result["kv_blocks_in_use_idle"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Tenant soak: three tenants, one flooding, every API, through the router; do the bounds hold?

Starts a real `tokenmill serve` (bundled SmolLM2 unless ``--model``) with
``--api-keys-file`` naming three tenants of different classes and an operator
``--api-key``, and `tokenmill route --api-keys-file ... --backend-api-key ...`
in front of it, both on free loopback ports. For ``--minutes`` (default 30):

- the two quiet tenants (``oncall``, critical; ``chat``, normal) each keep
  ``--quiet-concurrency`` clients cycling through every API, with a pause
  between requests: chat completions streamed and whole, completions, chat
  with tools, the Responses API with ``store`` and a follow-up naming their own
  ``previous_response_id``, Anthropic's ``/v1/messages``, and ``/v1/embeddings``
  when the server has it;
- the flooding tenant (``bulk``, batch class, with per-tenant limits) keeps
  ``--flood-concurrency`` clients sending tiny completions with no pause;
- every ``--probe-every`` seconds each tenant tries to reach the responses the
  others stored, at the router and at the server directly: GET, GET
  ``input_items`` (the server's route), a new response naming it as
  ``previous_response_id``, DELETE. Any 2xx is a cross-tenant read.

All traffic goes to 127.0.0.1; the run stops at ``--minutes`` or after
``--max-requests`` requests, whichever comes first. It prints, and with
``--json`` writes, the counts by status per tenant, the 5xx count (bound: 0),
whether every quiet tenant's request was served (a 2xx; a quiet tenant's 429
is not served), the cross-tenant reads (bound: 0), and the server's RSS after
warm-up (``--warmup-minutes``) and at the end (bound: under 5% growth). It
exits 1 when a bound fails.

    PYTHONPATH=src .venv/bin/python benchmarks/tenant_soak.py [--minutes 30] [--json out.json]
        [--model PATH] [-- extra serve flags]
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the quick brown fox jumps over a lazy dog near seven lanterns and an old stone bridge".split()
TENANTS = {  # name -> its keys-file entry; the last floods
    "oncall": {"priority_class": "critical", "weight": 1},
    "chat": {"priority_class": "normal", "weight": 2},
    "bulk": {"priority_class": "batch", "weight": 1, "max_inflight": 8, "max_queued": 16},
}
QUIET, FLOOD = ("oncall", "chat"), "bulk"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
GROWTH_BOUND = 0.05


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class Keys:
    """Every key of the run (made here, never written anywhere but the hashed keys file)."""

    tenants: dict[str, str] = field(default_factory=lambda: {t: "sk-" + secrets.token_urlsafe(18) for t in TENANTS})
    operator: str = field(default_factory=lambda: "sk-op-" + secrets.token_urlsafe(18))
    router: str = field(default_factory=lambda: "sk-router-" + secrets.token_urlsafe(18))

    def write_file(self, folder: str) -> str:
        path = os.path.join(folder, "keys.json")
        entries = [{"sha256": hashlib.sha256(key.encode()).hexdigest(), "tenant": tenant}
                   for tenant, key in self.tenants.items()]
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({"tenants": TENANTS, "keys": entries}, fh)
        return path


@dataclass
class Tally:
    """What happened, by tenant: statuses of their own requests, of their probes, and what went wrong."""

    statuses: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    probes: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    by_api: Counter[str] = field(default_factory=Counter)
    cross_reads: list[str] = field(default_factory=list)
    cross_kinds: Counter[str] = field(default_factory=Counter)  # "entry METHOD what" -> reads
    examples: list[str] = field(default_factory=list)
    sent: int = 0

    def record(self, tenant: str, api: str, status: str, detail: str = "") -> None:
        self.statuses[tenant][status] += 1
        self.by_api[f"{api} {status}"] += 1
        bad = not status.startswith("2") and (tenant in QUIET or status[0] == "5" or not status[0].isdigit())
        if bad and len(self.examples) < 30:
            self.examples.append(f"{tenant} {api} {status}: {detail[:240]}")


@dataclass
class Stored:
    """Response ids each tenant stored (the newest few), which the others probe."""

    ids: dict[str, deque[str]] = field(default_factory=lambda: defaultdict(lambda: deque(maxlen=8)))


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def quiet_requests(rng: random.Random, embeddings: bool) -> list[tuple[str, str, dict[str, Any]]]:
    """(api, path, body) of one round of a quiet tenant: every API once, in a shuffled order."""
    chat = [{"role": "user", "content": _text(rng, rng.randint(4, 40))}]
    out = [("chat", "/v1/chat/completions", {"messages": chat, "max_tokens": 16}),
           ("chat-stream", "/v1/chat/completions", {"messages": chat, "max_tokens": 16, "stream": True}),
           ("completions", "/v1/completions", {"prompt": _text(rng, 20), "max_tokens": 16}),
           ("tools", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Weather in Paris?"}],
                                              "tools": TOOLS, "tool_choice": "required", "max_tokens": 32}),
           ("responses", "/v1/responses", {"input": _text(rng, 12), "max_output_tokens": 16, "store": True}),
           ("messages", "/v1/messages", {"messages": chat, "max_tokens": 16})]
    if embeddings:
        out.append(("embeddings", "/v1/embeddings", {"input": _text(rng, 8)}))
    rng.shuffle(out)
    return out


async def send(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> tuple[str, Any]:
    """POST ``body``; (status, parsed body or None). A stream must end with [DONE] ("broken" otherwise)."""
    try:
        if body.get("stream"):
            async with client.stream("POST", path, json=body) as resp:
                if resp.status_code != 200:
                    return str(resp.status_code), (await resp.aread()).decode(errors="replace")
                lines = [line async for line in resp.aiter_lines() if line.startswith("data: ")]
                done = bool(lines) and lines[-1] == "data: [DONE]" and not any('"error"' in x[:20] for x in lines)
                return ("200" if done else "broken"), None
        resp = await client.post(path, json=body)
        try:
            parsed = resp.json()
        except ValueError:
            parsed = resp.text
        return str(resp.status_code), parsed
    except httpx.HTTPError as exc:
        return type(exc).__name__, str(exc)


class Soak:
    """The clients, the probes and the RSS samples of one run."""

    def __init__(self, args: argparse.Namespace, keys: Keys, router_url: str, server_url: str, server_pid: int,
                 embeddings: bool) -> None:
        self.args = args
        self.keys = keys
        self.urls = {"router": router_url, "server": server_url}
        self.pid = server_pid
        self.embeddings = embeddings
        self.tally = Tally()
        self.stored = Stored()
        self.t0 = time.monotonic()
        self.end = self.t0 + args.minutes * 60
        self.rss_warm: float | None = None
        self.samples: list[tuple[float, float]] = []

    def running(self) -> bool:
        return time.monotonic() < self.end and self.tally.sent < self.args.max_requests

    def client(self, tenant: str, entry: str, connections: int) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.urls[entry], timeout=self.args.request_timeout,
                                 headers={"Authorization": f"Bearer {self.keys.tenants[tenant]}"},
                                 limits=httpx.Limits(max_connections=connections))

    async def quiet(self, tenant: str, i: int) -> None:
        rng = random.Random(f"{tenant}-{i}")
        async with self.client(tenant, "router", 4) as client:
            while self.running():
                for api, path, body in quiet_requests(rng, self.embeddings):
                    if not self.running():
                        return
                    await self.one(client, tenant, api, path, {**body, "model": self.args.served_name}, rng)
                    await asyncio.sleep(rng.uniform(0, 2 * self.args.quiet_pause))

    async def one(self, client: httpx.AsyncClient, tenant: str, api: str, path: str, body: dict[str, Any],
                  rng: random.Random) -> str:
        self.tally.sent += 1
        status, parsed = await send(client, path, body)
        self.tally.record(tenant, api, status, json.dumps(parsed) if not isinstance(parsed, str) else parsed)
        first = status
        if api == "responses" and status == "200" and isinstance(parsed, dict):
            self.stored.ids[tenant].append(parsed["id"])
            follow = {"model": body["model"], "input": _text(rng, 6), "max_output_tokens": 8, "store": True,
                      "previous_response_id": parsed["id"]}
            self.tally.sent += 1
            status, parsed = await send(client, path, follow)
            self.tally.record(tenant, "responses-previous", status, str(parsed))
            if status == "200" and isinstance(parsed, dict):
                self.stored.ids[tenant].append(parsed["id"])
        return first

    async def flood(self, i: int) -> None:
        rng = random.Random(f"flood-{i}")
        async with self.client(FLOOD, "router", 2) as client:
            while self.running():
                body = {"model": self.args.served_name, "prompt": _text(rng, rng.randint(1, 6)),
                        "max_tokens": rng.randint(1, 3)}
                status = await self.one(client, FLOOD, "flood", "/v1/completions", body, rng)
                if status == "429":  # refused at once: a moment before the next, or the loop only spins
                    await asyncio.sleep(self.args.flood_backoff)

    async def probes(self) -> None:
        """Every --probe-every seconds: each tenant reaches for the others' stored responses."""
        while self.running():
            await asyncio.sleep(self.args.probe_every)
            for tenant in TENANTS:
                for owner in (o for o in TENANTS if o != tenant):
                    # the newest id at the server, the one before at the router: a DELETE that works
                    # at one entry must not hide what the other would have let through
                    newest = list(self.stored.ids[owner])[-2:][::-1]
                    for entry, rid in zip(("server", "router"), newest):
                        await self.probe(tenant, owner, rid, entry)

    async def probe(self, tenant: str, owner: str, rid: str, entry: str) -> None:
        tries = [("GET", f"/v1/responses/{rid}", None), ("GET", f"/v1/responses/{rid}/input_items", None),
                 ("POST", "/v1/responses", {"model": self.args.served_name, "input": "and then?",
                                            "max_output_tokens": 4, "previous_response_id": rid}),
                 ("DELETE", f"/v1/responses/{rid}", None)]
        async with self.client(tenant, entry, 2) as client:
            for method, path, body in tries:
                if entry == "router" and path.endswith("input_items"):
                    continue  # the router relays GET and DELETE of a stored response, not its items
                try:
                    resp = await client.request(method, path, json=body)
                    status = str(resp.status_code)
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                self.tally.probes[tenant][status] += 1
                if status.startswith("2"):
                    what = "input_items" if path.endswith("input_items") else \
                        "previous_response_id" if method == "POST" else "response"
                    self.tally.cross_kinds[f"{entry} {method} {what}"] += 1
                    self.tally.cross_reads.append(f"{tenant} read {owner}'s {rid}: {method} {path} at the "
                                                  f"{entry} -> {status}")

    async def sampler(self) -> None:
        warm_at = self.t0 + self.args.warmup_minutes * 60
        while self.running():
            await asyncio.sleep(min(5.0, max(0.1, self.end - time.monotonic())))
            now = time.monotonic()
            self.samples.append((round(now - self.t0, 1), round(rss_mib(self.pid), 1)))
            if self.rss_warm is None and now >= warm_at:
                self.rss_warm = self.samples[-1][1]

    async def run(self) -> None:
        a = self.args
        tasks = [self.quiet(t, i) for t in QUIET for i in range(a.quiet_concurrency)]
        tasks += [self.flood(i) for i in range(a.flood_concurrency)]
        await asyncio.gather(*tasks, self.probes(), self.sampler())


# ---- the processes -------------------------------------------------------------------------

def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url}: not healthy after {timeout:.0f} s")


def _cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "tokenmill.entrypoints.cli.main", *argv]


def start_processes(args: argparse.Namespace, keys: Keys, folder: str, serve_flags: list[str]
                    ) -> tuple[subprocess.Popen, subprocess.Popen, str, str]:
    """The server, then the router in front of it; both healthy. Their logs go to ``folder``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), PYTHONUNBUFFERED="1")
    keys_file = keys.write_file(folder)
    help_text = subprocess.run(_cli("serve", "--help"), env=env, capture_output=True, text=True).stdout
    # where the server tells a router's key from the operator's, the router gets its own
    router_flags = ["--router-api-key", keys.router] if "--router-api-key" in help_text else []
    backend_key = keys.router if router_flags else keys.operator
    sport, rport = free_port(), free_port()
    model = ["--model", args.model] if args.model else []
    server = subprocess.Popen(
        _cli("serve", "--host", "127.0.0.1", "--port", str(sport), *model, "--served-model-name", args.served_name,
             "--api-keys-file", keys_file, "--api-key", keys.operator, *router_flags, "--no-ui", *serve_flags),
        env=env, stdout=subprocess.DEVNULL, stderr=open(os.path.join(folder, "serve.log"), "wb"))
    server_url, router_url = f"http://127.0.0.1:{sport}", f"http://127.0.0.1:{rport}"
    router: subprocess.Popen | None = None
    try:
        _wait_healthy(server_url, server, 600)
        router = subprocess.Popen(
            _cli("route", "--host", "127.0.0.1", "--port", str(rport), "--backend", server_url,
                 "--api-keys-file", keys_file, "--backend-api-key", backend_key, "--log-level", "warning"),
            env=env, stdout=subprocess.DEVNULL, stderr=open(os.path.join(folder, "route.log"), "wb"))
        _wait_healthy(router_url, router, 120)
    except BaseException:
        stop(server, router)
        raise
    return server, router, server_url, router_url


def stop(*procs: subprocess.Popen | None) -> None:
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proc.terminate()
    for proc in procs:
        if proc is not None:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def has_embeddings(server_url: str, keys: Keys, model: str) -> bool:
    r = httpx.post(server_url + "/v1/embeddings", json={"model": model, "input": "probe"}, timeout=60,
                   headers={"Authorization": f"Bearer {keys.operator}"})
    return r.status_code == 200


# ---- the report ---------------------------------------------------------------------------

def report(soak: Soak, rss_end: float, died: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The summary and the bounds that failed."""
    t = soak.tally
    quiet_sent = sum(sum(t.statuses[q].values()) for q in QUIET)
    quiet_served = sum(n for q in QUIET for s, n in t.statuses[q].items() if s.startswith("2"))
    five = sum(n for c in (*t.statuses.values(), *t.probes.values()) for s, n in c.items() if s.startswith("5"))
    warm = soak.rss_warm if soak.rss_warm is not None else (soak.samples[0][1] if soak.samples else float("nan"))
    growth = (rss_end - warm) / warm
    summary = {
        "minutes": round((time.monotonic() - soak.t0) / 60, 2), "requests": t.sent,
        "statuses": {k: dict(v) for k, v in t.statuses.items()},
        "probe_statuses": {k: dict(v) for k, v in t.probes.items()}, "by_api": dict(sorted(t.by_api.items())),
        "5xx": five, "quiet_sent": quiet_sent, "quiet_served": quiet_served,
        "cross_tenant_reads": len(t.cross_reads), "cross_tenant_by_kind": dict(sorted(t.cross_kinds.items())),
        "cross_tenant_examples": t.cross_reads[:10],
        "rss_mib_after_warmup": warm, "rss_mib_end": rss_end, "rss_growth_pct": round(100 * growth, 2),
        "rss_samples": soak.samples, "examples": t.examples, "processes_died": died}
    failed = []
    if five:
        failed.append(f"{five} responses were 5xx (bound: 0)")
    if quiet_served < quiet_sent:
        failed.append(f"quiet tenants: {quiet_sent - quiet_served} of {quiet_sent} requests not served (bound: 0)")
    if t.cross_reads:
        failed.append(f"{len(t.cross_reads)} cross-tenant reads (bound: 0)")
    if not growth < GROWTH_BOUND:
        failed.append(f"server RSS grew {100 * growth:.1f}% after warm-up (bound: {100 * GROWTH_BOUND:.0f}%)")
    failed += [f"{name} exited during the run" for name in died]
    return summary, failed


def print_report(summary: dict[str, Any], failed: list[str]) -> None:
    print(f"\n{summary['requests']} requests in {summary['minutes']} min")
    for tenant in TENANTS:
        statuses = summary["statuses"].get(tenant, {})
        probes = summary["probe_statuses"].get(tenant, {})
        print(f"  {tenant:7s} ({TENANTS[tenant]['priority_class']:8s}) requests {dict(sorted(statuses.items()))}"
              f"  probes {dict(sorted(probes.items()))}")
    print(f"5xx: {summary['5xx']}")
    print(f"quiet tenants served (2xx): {summary['quiet_served']} of {summary['quiet_sent']}")
    print(f"cross-tenant reads: {summary['cross_tenant_reads']} {summary['cross_tenant_by_kind'] or ''}")
    for line in summary["cross_tenant_examples"][:4]:
        print(f"  {line}")
    print(f"server RSS: {summary['rss_mib_after_warmup']:.1f} MiB after warm-up, {summary['rss_mib_end']:.1f} MiB at "
          f"the end ({summary['rss_growth_pct']:+.2f}%)")
    for line in summary["examples"][:10]:
        print(f"  e.g. {line}")
    print("PASS" if not failed else "FAIL: " + "; ".join(failed))


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--warmup-minutes", type=float, default=None,
                   help="RSS is compared from here on (default: a sixth of the run, at most 5)")
    p.add_argument("--model", default=None, help="the server's model (default: the bundled SmolLM2)")
    p.add_argument("--served-name", default="soak")
    p.add_argument("--quiet-concurrency", type=int, default=2, help="clients of each quiet tenant")
    p.add_argument("--quiet-pause", type=float, default=1.0, help="mean seconds between a quiet client's requests")
    p.add_argument("--flood-concurrency", type=int, default=32, help="clients of the flooding tenant")
    p.add_argument("--flood-backoff", type=float, default=0.05, help="seconds a flood client waits after a 429")
    p.add_argument("--probe-every", type=float, default=20.0, help="seconds between cross-tenant probe rounds")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--max-requests", type=int, default=500_000, help="stop after this many requests")
    p.add_argument("--json", default=None, help="write the summary here")
    args, serve_flags = p.parse_known_args(argv)
    if args.warmup_minutes is None:
        args.warmup_minutes = min(5.0, args.minutes / 6)
    return args, [f for f in serve_flags if f != "--"]


def main(argv: list[str] | None = None) -> int:
    args, serve_flags = parse_args(argv)
    keys = Keys()
    with tempfile.TemporaryDirectory(prefix="tenant-soak-") as folder:
        server, router, server_url, router_url = start_processes(args, keys, folder, serve_flags)
        try:
            soak = Soak(args, keys, router_url, server_url, server.pid,
                        has_embeddings(server_url, keys, args.served_name))
            print(f"server {server_url} (pid {server.pid}), router {router_url}; {args.minutes:g} min, "
                  f"embeddings {'on' if soak.embeddings else 'absent'}", flush=True)
            asyncio.run(soak.run())
            time.sleep(3)  # the last requests' memory settles
            died = [name for name, proc in (("the server", server), ("the router", router)) if proc.poll() is not None]
            summary, failed = report(soak, rss_mib(server.pid) if not died else float("nan"), died)
        finally:
            stop(router, server)
        if failed and any("5xx" in f or "exited" in f for f in failed):
            for name in ("serve.log", "route.log"):  # the tail of what the processes logged, for the 5xx
                lines = Path(folder, name).read_text(errors="replace").splitlines()
                summary[name] = lines[-40:]
    print_report(summary, failed)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Server throughput under many streams, against one stream, in one run.

Starts `tokenmill serve` (bundled SmolLM2 unless ``--model``) on loopback with
``--max-num-seqs`` equal to the largest concurrency, then drives streaming
``/v1/completions`` requests (prompts of ``--input-len`` tokens that share no
prefix, exactly ``--output-len`` output tokens, ``ignore_eos``, greedy):

1. one stream (``--single-requests`` requests, one after another): the
   single-stream decode rate, output tokens / wall time, is the baseline;
2. each concurrency in ``--concurrency`` (default 16 and 64): ``--waves`` x
   concurrency requests, closed loop;
3. one stream again: this host's speed drifts within a run, so the last line
   also gives each level's ratio against the mean of both single-stream rates.

Each level starts with one uncounted warm-up request with a prompt of its own,
so no counted request finds its prompt in the prefix cache (a warm-up that
repeated the level's first prompt would let one of the two single-stream
requests skip its prefill).

Printed per row: output tok/s, the ratio to the single-stream rate, TPOT p50
and p99 (per request: (end - first token) / (tokens - 1)), TTFT p50. The aim
is >= 5x the single stream at 64 streams with TPOT p99 < 3x its p50.
Absolute figures drift on a shared machine: compare the ratios.

``--against-reference``: two servers instead, the configuration under test
(the server's defaults plus ``--dtype`` / ``--server-args`` when given) and the
exact float32 reference (``--dtype float32 --quantization none``), taking turns
at each concurrency level for ``--rounds`` rounds; the last line gives the
tested configuration's output tok/s against the reference's (sum over rounds).

    .venv/bin/python benchmarks/serving_throughput.py [--concurrency 16,64] [--input-len 256] [--output-len 128]
        [--dtype float32] [--waves 1] [--single-requests 2] [--kv-cache-memory 2GiB]
    .venv/bin/python benchmarks/serving_throughput.py --against-reference [--concurrency 64] [--rounds 2]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys

import httpx

from tokenmill.bench.server_metrics import parse_prometheus

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving import Result, _drive_server, launch_server, make_prompts, percentile, stop_server  # noqa: E402


REFERENCE_FLAGS = ["--dtype", "float32", "--quantization", "none"]


def start_server(args: argparse.Namespace, max_seqs: int, reference: bool = False) -> tuple[subprocess.Popen, str]:
    flags = ["--max-num-seqs", str(max_seqs), "--kv-cache-memory", args.kv_cache_memory]
    if reference:
        flags += REFERENCE_FLAGS
    elif args.dtype:
        flags += ["--dtype", args.dtype]
    if args.no_prefix_cache:
        flags.append("--no-prefix-caching")
    if args.model:
        flags += ["--model", args.model]
    return launch_server(flags + ([] if reference else args.server_args.split()))


def preemptions(url: str) -> str:
    """The server's preemption counter, from its Prometheus metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return f"{parse_prometheus(text).get('vllm:num_preemptions_total', float('nan')):.0f}"


def row(label: str, res: Result, base: float | None) -> str:
    rate = res.tokens / res.wall
    tpot = [s.tpot for s in res.samples]
    ratio = f"{rate / base:.2f}x" if base else "1.00x"
    p50, p99 = percentile(tpot, 50), percentile(tpot, 99)
    return (f"| {label} | {len(res.samples)} | {rate:.1f} | {ratio} | {p50 * 1000:.1f} | {p99 * 1000:.1f} | "
            f"{p99 / p50:.2f} | {percentile([s.ttft for s in res.samples], 50) * 1000:.0f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default=None, help="the server's --dtype (default: the server's own default)")
    ap.add_argument("--concurrency", default="16,64")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--waves", type=int, default=1)
    ap.add_argument("--single-requests", type=int, default=2)
    # 64 streams x (256 + 128) tokens of SmolLM2's float32 K/V (46 KB a token) need 1.1 GiB; with
    # the 1 GiB this used to give, the 64-stream level preempted (and recomputed) sequences.
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--server-args", default="", help="extra `tokenmill serve` flags, one string")
    ap.add_argument("--no-prefix-cache", action="store_true", help="(prompts share no prefix anyway)")
    ap.add_argument("--against-reference", action="store_true",
                    help="compare with the float32 reference server instead of one stream")
    ap.add_argument("--rounds", type=int, default=2, help="--against-reference: turns per server and level")
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]

    from tokenmill.files.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_path(args.model)
    if args.against_reference:
        return against_reference(args, levels, tokenizer)
    # a warm-up prompt per level; the single stream runs at the start and again at the end
    total = 2 * (1 + args.single_requests) + sum(1 + c * args.waves for c in levels)
    prompts = make_prompts(tokenizer, total, args.input_len)
    proc, url = start_server(args, max(levels))
    print(f"# serving_throughput: dtype {args.dtype}, prompts {args.input_len} tokens, {args.output_len} output "
          f"tokens (ignore_eos), max-num-seqs {max(levels)}, load {os.getloadavg()[0]:.2f}, cpus {os.cpu_count()}, "
          f"server flags: {args.server_args or 'defaults'}")
    print("| streams | requests | output tok/s | vs 1 stream | TPOT p50 ms | TPOT p99 ms | p99/p50 | TTFT p50 ms |")
    print("|---|---|---|---|---|---|---|---|")
    try:
        used = 0

        def take(n: int) -> list[list[int]]:
            nonlocal used
            out = prompts[used : used + n]
            used += n
            return out

        single = asyncio.run(_drive_server(url, take(args.single_requests), args.output_len, 1, take(1)[0]))
        base = single.tokens / single.wall
        print(row("1", single, None), flush=True)
        rates: dict[int, float] = {}
        for c in levels:
            res = asyncio.run(_drive_server(url, take(c * args.waves), args.output_len, c, take(1)[0]))
            rates[c] = res.tokens / res.wall
            print(row(str(c), res, base), flush=True)
        # This host's speed drifts within a run: the single stream again, and the ratios
        # against the mean of both single-stream measurements.
        end = asyncio.run(_drive_server(url, take(args.single_requests), args.output_len, 1, take(1)[0]))
        print(row("1 (again, at the end)", end, base), flush=True)
        mean = (base + end.tokens / end.wall) / 2
        ratios = ", ".join(f"{c} streams {rate / mean:.2f}x" for c, rate in rates.items())
        print(f"\nsingle stream {base:.1f} tok/s at the start, {end.tokens / end.wall:.1f} at the end; "
              f"against their mean ({mean:.1f}): {ratios}", flush=True)
        print(f"preemptions over the run (recomputed sequences; 0 unless the KV pool is too small): "
              f"{preemptions(url)}", flush=True)
    finally:
        stop_server(proc)
    return 0


def against_reference(args: argparse.Namespace, levels: list[int], tokenizer) -> int:
    """The configuration under test and the float32 reference, turn about, per level."""
    per_turn = sum(1 + c * args.waves for c in levels)
    prompts = make_prompts(tokenizer, 2 * args.rounds * per_turn, args.input_len)
    servers = {"tested": start_server(args, max(levels)), "reference": start_server(args, max(levels), True)}
    print(f"# serving_throughput --against-reference: tested = server defaults + "
          f"{' '.join(filter(None, [args.dtype and '--dtype ' + args.dtype, args.server_args])) or 'nothing'}; "
          f"reference = {' '.join(REFERENCE_FLAGS)}; prompts {args.input_len} tokens, {args.output_len} output tokens "
          f"(ignore_eos), load {os.getloadavg()[0]:.2f}, cpus {os.cpu_count()}")
    print("| server | round | streams | requests | output tok/s | - | TPOT p50 ms | TPOT p99 ms | p99/p50 | TTFT p50 ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    totals: dict[tuple[str, int], list[float]] = {}
    tpot: dict[int, list[float]] = {}
    used = 0
    try:
        for rnd in range(args.rounds):
            for c in levels:
                for name, (_, url) in servers.items():
                    batch = prompts[used : used + 1 + c * args.waves]
                    used += len(batch)
                    res = asyncio.run(_drive_server(url, batch[1:], args.output_len, c, batch[0]))
                    acc = totals.setdefault((name, c), [0.0, 0.0])
                    acc[0] += res.tokens
                    acc[1] += res.wall
                    if name == "tested":
                        tpot.setdefault(c, []).extend(s.tpot for s in res.samples)
                    print(row(f"{name} | {rnd + 1} | {c}", res, None).replace("| 1.00x |", "| - |"), flush=True)
        for c in levels:
            tested, ref = (totals[(n, c)][0] / totals[(n, c)][1] for n in ("tested", "reference"))
            t = tpot[c]
            print(f"\n{c} streams: tested {tested:.1f} tok/s, reference {ref:.1f} tok/s: {tested / ref:.2f}x "
                  f"the float32 reference; tested TPOT p99/p50 {percentile(t, 99) / percentile(t, 50):.2f}", flush=True)
        print(f"preemptions (tested, reference): {preemptions(servers['tested'][1])}, "
              f"{preemptions(servers['reference'][1])}", flush=True)
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())

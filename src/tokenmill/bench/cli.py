"""`tokenmill bench` (load tester) and `tokenmill trace analyze` (capture analysis).

Plain HTTP only: this module and everything it imports stay clear of torch
and the engine, so the load tester runs anywhere against any
OpenAI-compatible server.
"""
from __future__ import annotations

import argparse
import asyncio
import glob
import os
import sys
from typing import Any

EPILOG = """examples:
  tokenmill bench --url http://127.0.0.1:8000 --concurrency 1,4,16 --num-requests 64 \\
      --input-len 512 --output-len 128 --slo ttft=0.5,tpot=0.05 --cost-per-hour 2.5 \\
      --output run.json --plot run.png
  tokenmill bench --rate 2,4,8 --burstiness 0.5 --duration 60 --prefix-len 256 --num-prefixes 4
  tokenmill bench --dataset sharegpt.json --endpoint chat --concurrency 8
  tokenmill bench --trace capture.jsonl --trace-speed 2
  tokenmill bench --compare vllm.json tokenmill.json
length specs: N | uniform:LO:HI | normal:MEAN:STD | hist:LEN=W,... | hist:FILE
"""


def _floats(text: str) -> list[float]:
    return [float("inf") if x.strip() == "inf" else float(x) for x in text.split(",") if x.strip()]


def add_bench_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="load-test an OpenAI-compatible server",
                       description="Measure TTFT, TPOT, throughput, goodput and cost under load.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    t = p.add_argument_group("target")
    t.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    t.add_argument("--model", help="model name (default: the first of /v1/models)")
    t.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    t.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    t.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s")
    t.add_argument("--temperature", type=float, default=0.0)
    t.add_argument("--no-ignore-eos", action="store_true",
                   help="let requests stop at EOS (output lengths then vary)")
    lo = p.add_argument_group("load shape")
    lo.add_argument("--concurrency", help="closed loop: N users, or a sweep 1,4,16,64")
    lo.add_argument("--rate", help="open loop: requests/s (Poisson), or a sweep 1,2,4; 'inf'")
    lo.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of inter-arrival times: 1 Poisson, <1 burstier")
    lo.add_argument("--max-concurrency", type=int, help="cap in-flight requests (open loop)")
    lo.add_argument("--num-requests", type=int,
                    help="requests per point (default 100; a trace: all)")
    lo.add_argument("--duration", type=float, help="seconds per load point instead of a count")
    lo.add_argument("--warmup", type=int, default=0, help="unmeasured requests before each point")
    w = p.add_argument_group("workload")
    w.add_argument("--input-len", default="512", help="prompt tokens (length spec)")
    w.add_argument("--output-len", default="128", help="output tokens (length spec)")
    w.add_argument("--prefix-len", type=int, default=0, help="shared prefix tokens per prompt")
    w.add_argument("--num-prefixes", type=int, default=1, help="distinct shared prefixes")
    w.add_argument("--prefix-pick", choices=["uniform", "zipf", "round-robin"], default="uniform")
    w.add_argument("--dataset", help="ShareGPT JSON, or JSON/JSONL of prompts/messages")
    w.add_argument("--trace", help="replay a capture from `tokenmill serve --capture-traffic`")
    w.add_argument("--trace-speed", type=float, default=1.0, help="replay this many times faster")
    w.add_argument("--tokenizer", help="tokenizer.json (or its folder) for exact token counts")
    w.add_argument("--seed", type=int, default=0)
    c = p.add_argument_group("cache")
    c.add_argument("--reset-cache", action="store_true", help="POST /reset_prefix_cache per point")
    c.add_argument("--no-salt", action="store_true",
                   help="do not salt prompts (runs may then share the server's prefix cache)")
    o = p.add_argument_group("targets and output")
    o.add_argument("--slo", help="goodput targets, e.g. ttft=0.5,tpot=0.05,e2e=10 (seconds)")
    o.add_argument("--cost-per-hour", type=float, help="dollars per hour for the deployment")
    o.add_argument("--max-error-rate", type=float, default=0.0,
                   help="exit non-zero when more than this fraction of requests fail")
    o.add_argument("--output", help="write every request record and the summary as JSON")
    o.add_argument("--plot", help="write a figure: .png, or .html for a self-contained report")
    o.add_argument("--compare", nargs="+", metavar="RESULT.json",
                   help="print saved runs side by side (no load is sent)")
    o.add_argument("--eval-result", metavar="EVAL.json",
                   help="with --compare: `tokenmill eval` JSON whose base and candidates (in order) give the "
                        "compared runs' task accuracy, for cost per successful task")
    o.add_argument("--variant-cost", action="append", metavar="NAME=DOLLARS",
                   help="with --compare: dollars per hour of a router variant's replicas")
    o.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=bench_main)


def add_trace_parser(sub: Any) -> None:
    p = sub.add_parser("trace", help="analyse traffic captures")
    tsub = p.add_subparsers(dest="trace_command", metavar="ACTION")
    a = tsub.add_parser("analyze", help="lengths, arrivals, prefix sharing, prompt-layout checks")
    a.add_argument("files", nargs="+", help="capture JSONL files (rotated parts: FILE.1, ...)")
    a.add_argument("--top", type=int, default=5, help="how many shared prefixes to list")
    a.add_argument("--json", dest="json_out", help="also write the analysis as JSON")
    a.set_defaults(func=trace_main)


def register(subparsers: Any) -> None:
    add_bench_parser(subparsers)
    add_trace_parser(subparsers)


def _fail(msg: str, code: int = 1) -> int:
    print(f"tokenmill bench: {msg}", file=sys.stderr)
    return code


def _shapes(args: argparse.Namespace) -> list[Any]:
    from tokenmill.bench.loadgen import LoadShape

    if args.concurrency and args.rate:
        raise ValueError("give --concurrency or --rate, not both")
    common = dict(burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                  duration=args.duration, trace=bool(args.trace))
    if args.rate:
        return [LoadShape(rate=r, **common) for r in _floats(args.rate)]
    if args.trace:
        return [LoadShape(**common)]
    conc = [int(x) for x in _floats(args.concurrency or "1")]
    if any(c < 1 for c in conc):
        raise ValueError("--concurrency must be >= 1")
    return [LoadShape(concurrency=c, **common) for c in conc]


def bench_main(args: argparse.Namespace) -> int:
    from tokenmill.bench import report

    if args.compare:
        try:
            from tokenmill.bench.success import parse_variant_costs

            print(report.compare(args.compare, args.eval_result, parse_variant_costs(args.variant_cost)))
        except (OSError, ValueError, KeyError) as exc:
            return _fail(f"cannot compare: {exc}")
        return 0
    from tokenmill.bench.client import Target, normalize_base_url
    from tokenmill.bench.lengths import parse_length
    from tokenmill.bench.runner import BenchConfig, BenchResult, resolve_model, run_bench
    from tokenmill.bench.stats import parse_slo
    from tokenmill.bench.tokens import make_counter
    from tokenmill.bench.workloads import SyntheticConfig

    try:
        shapes = _shapes(args)
        slo = parse_slo(args.slo)
        in_len, out_len = parse_length(args.input_len), parse_length(args.output_len)
        for path in (args.dataset, args.trace):
            if path and not os.path.exists(path):
                raise ValueError(f"{path}: no such file")
    except ValueError as exc:
        return _fail(str(exc), 2)
    base = normalize_base_url(args.url)
    # A duration-bound closed loop needs enough prompts to last: a generous cap.
    num = args.num_requests or (2000 if args.duration and not args.rate else 100)
    if args.trace and not args.num_requests:
        num = 1 << 40  # the whole capture
    cfg = BenchConfig(
        shapes=shapes, num_requests=num, warmup=args.warmup,
        synthetic=SyntheticConfig(in_len, out_len, args.prefix_len, args.num_prefixes,
                                  args.prefix_pick),
        dataset=args.dataset, trace=args.trace, trace_speed=args.trace_speed,
        output_len=out_len, slo=slo, cost_per_hour=args.cost_per_hour,
        reset_cache=args.reset_cache, salt=not args.no_salt, seed=args.seed,
        timeout=args.timeout, progress=False if args.no_progress else None)
    target = Target(base, args.model or "", args.endpoint, args.api_key,
                    ignore_eos=not args.no_ignore_eos, temperature=args.temperature)
    result = BenchResult(target={"base_url": base, "model": args.model,
                                 "endpoint": args.endpoint}, config=cfg.describe())

    async def main() -> None:
        import httpx

        if not target.model:
            async with httpx.AsyncClient() as client:
                target.model = await resolve_model(client, base)
        result.target["model"] = target.model
        counter = await asyncio.to_thread(make_counter, args.tokenizer, base, target.model,
                                          args.api_key)
        try:
            await run_bench(cfg, target, counter, result)
        finally:
            counter.close()

    interrupted = False
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        interrupted = True
        result.aborted = "interrupted by the user"
    except RuntimeError as exc:
        return _fail(str(exc))
    except (OSError, ValueError) as exc:
        if not result.points:
            return _fail(str(exc))
        result.aborted = f"{type(exc).__name__}: {exc}"
    return _finish(args, result, interrupted)


def _finish(args: argparse.Namespace, result: Any, interrupted: bool) -> int:
    from tokenmill.bench import report

    data = result.to_dict()
    text = report.render(data)
    print(text)
    if args.output:
        report.save(data, args.output)
        print(f"wrote {args.output}")
    if args.plot and data["points"]:
        try:
            from tokenmill.bench.plot import write_plot

            write_plot(data, args.plot, text)
            print(f"wrote {args.plot}")
        except (ImportError, OSError, ValueError) as exc:
            print(f"warning: could not write the plot: {exc}", file=sys.stderr)
    total = sum(p.summary.completed + p.summary.failed for p in result.points)
    failed = sum(p.summary.failed for p in result.points)
    if interrupted:
        print("tokenmill bench: interrupted; the results above are partial", file=sys.stderr)
        return 130
    if result.aborted:
        print(f"tokenmill bench: stopped early: {result.aborted}", file=sys.stderr)
        return 1
    if total == 0 or failed / total > args.max_error_rate:
        if total:
            print(f"tokenmill bench: {failed} of {total} requests failed", file=sys.stderr)
        return 1
    return 0


def trace_main(args: argparse.Namespace) -> int:
    import json

    from tokenmill.bench.trace_analysis import analyze, render
    from tokenmill.capture import read_capture

    paths: list[str] = []
    for f in args.files:
        matched = sorted(glob.glob(f)) or [f]
        paths += matched
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        return _fail(f"no such capture file: {', '.join(missing)}")
    try:
        rep = analyze(read_capture(paths), top=args.top)
    except (OSError, ValueError) as exc:
        return _fail(str(exc))
    print(render(rep))
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as fh:
            json.dump(rep.to_dict(), fh, indent=1)
    return 0

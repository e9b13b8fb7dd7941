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
import signal
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
a `vllm bench serve` line runs as is (vLLM's defaults: all prompts at once, 1000 prompts, 1024/128 tokens):
  tokenmill bench --backend vllm --base-url http://127.0.0.1:8000 --dataset-name random \\
      --random-input-len 256 --random-output-len 64 --num-prompts 100 --request-rate 4 \\
      --goodput ttft:500 --save-result --result-dir results
guidellm habits: --target URL, --rate-type {synchronous,concurrent,throughput,constant,poisson}
  with --rate, --max-seconds, --max-requests, --data prompt_tokens=N,output_tokens=M
length specs: N | uniform:LO:HI | normal:MEAN:STD | hist:LEN=W,... | hist:FILE
"""

# vLLM's `bench serve` spellings with their own dest: seeing one means the command
# line was written for vLLM, whose defaults then apply (see _normalize).
VLLM_DESTS = ("base_url", "backend", "num_prompts", "request_rate", "dataset_name", "dataset_path",
              "random_input_len", "random_output_len", "random_prefix_len", "random_range_ratio",
              "goodput", "save_result", "result_dir", "result_filename", "num_warmups")
RATE_TYPES = ("synchronous", "concurrent", "throughput", "constant", "poisson", "sweep")


def _floats(text: str) -> list[float]:
    return [float("inf") if x.strip() == "inf" else float(x) for x in text.split(",") if x.strip()]


def add_bench_parser(sub: Any) -> None:
    p = sub.add_parser("bench", allow_abbrev=False, help="load-test an OpenAI-compatible server",
                       description="Measure TTFT, TPOT, throughput, goodput and cost under load. "
                                   "Takes `vllm bench serve` command lines.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _target_arguments(p.add_argument_group("target"))
    _load_arguments(p.add_argument_group("load shape"))
    from tokenmill.bench.workloads import add_workload_arguments

    add_workload_arguments(p.add_argument_group("workload"))
    c = p.add_argument_group("cache")
    c.add_argument("--reset-cache", action="store_true", help="POST /reset_prefix_cache per point")
    c.add_argument("--no-salt", action="store_true",
                   help="do not salt prompts (runs may then share the server's prefix cache)")
    _output_arguments(p.add_argument_group("targets and output"))
    p.set_defaults(func=bench_main)


def _target_arguments(t: Any) -> None:
    t.add_argument("--url", "--target", dest="url", default=None,
                   help="server base URL (default http://127.0.0.1:8000; guidellm's --target)")
    t.add_argument("--base-url", default=None, help="vLLM's name for --url")
    t.add_argument("--host", default="127.0.0.1", help="with --port, the server when no URL is given")
    t.add_argument("--port", type=int, default=8000)
    t.add_argument("--backend", default=None,
                   help="vLLM's backend: openai-chat sends chat requests, the others (vllm, openai, "
                        "tokenmill, sglang, ...) completions")
    t.add_argument("--model", help="model name (default: the first of /v1/models)")
    t.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    t.add_argument("--endpoint", default=None,
                   help="completions or chat, or the path: /v1/completions, /v1/chat/completions "
                        "(default completions)")
    t.add_argument("--header", nargs="+", default=None, metavar="KEY=VALUE", help="extra HTTP headers")
    t.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s")
    t.add_argument("--temperature", type=float, default=0.0)
    t.add_argument("--ignore-eos", action="store_true",
                   help="requests run to their output length (the default; see --no-ignore-eos)")
    t.add_argument("--no-ignore-eos", action="store_true",
                   help="let requests stop at EOS (output lengths then vary)")


def _load_arguments(lo: Any) -> None:
    lo.add_argument("--concurrency", help="closed loop: N users, or a sweep 1,4,16,64")
    lo.add_argument("--rate", help="open loop: requests/s (Poisson), or a sweep 1,2,4; 'inf'")
    lo.add_argument("--request-rate", default=None, help="vLLM's name for --rate")
    lo.add_argument("--rate-type", choices=RATE_TYPES, default=None,
                    help="guidellm's load type: synchronous (one user), concurrent (--rate users), "
                         "throughput (all at once), constant / poisson (--rate per second)")
    lo.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of inter-arrival times: 1 Poisson, <1 burstier")
    lo.add_argument("--max-concurrency", type=int, help="cap in-flight requests (open loop)")
    lo.add_argument("--num-requests", "--max-requests", dest="num_requests", type=int,
                    help="requests per point (default 100; a trace: all; vLLM style: 1000)")
    lo.add_argument("--num-prompts", type=int, default=None, help="vLLM's name for --num-requests")
    lo.add_argument("--duration", "--max-seconds", dest="duration", type=float,
                    help="seconds per load point instead of a count (guidellm's --max-seconds)")
    lo.add_argument("--warmup", type=int, default=0, help="unmeasured requests before each point")
    lo.add_argument("--num-warmups", type=int, default=None, help="vLLM's name for --warmup")


def _output_arguments(o: Any) -> None:
    o.add_argument("--slo", help="goodput targets, e.g. ttft=0.5,tpot=0.05,e2e=10 (seconds)")
    o.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="vLLM's goodput targets in milliseconds: ttft:500 tpot:50 e2el:10000")
    o.add_argument("--percentile-metrics", default=None,
                   help="metrics whose percentiles the vLLM result holds (default ttft,tpot,itl,e2el)")
    o.add_argument("--metric-percentiles", default=None, help="percentiles for them (default 99)")
    o.add_argument("--cost-per-hour", type=float, help="dollars per hour for the deployment")
    o.add_argument("--max-error-rate", type=float, default=0.0,
                   help="exit non-zero when more than this fraction of requests fail")
    o.add_argument("--output", help="write every request record and the summary as JSON")
    o.add_argument("--save-result", action="store_true",
                   help="also write vLLM's result JSON (mean_ttft_ms, ttfts, ...) per load point, "
                        "with tokenmill's own file beside it (NAME.tokenmill.json unless --output)")
    o.add_argument("--save-detailed", action="store_true",
                   help="accepted for vLLM command lines: per-request lists are always saved")
    o.add_argument("--result-dir", default=None, help="folder for --save-result files (default .)")
    o.add_argument("--result-filename", default=None,
                   help="name of the --save-result file (default: vLLM's LABEL-RATEqps-MODEL-DATE.json)")
    o.add_argument("--label", default=None, help="label in the vLLM result and its file name")
    o.add_argument("--metadata", nargs="+", default=None, metavar="KEY=VALUE",
                   help="extra keys for the vLLM result")
    o.add_argument("--plot", help="write a figure: .png, or .html for a self-contained report")
    o.add_argument("--compare", nargs="+", metavar="RESULT.json",
                   help="print saved runs side by side, tokenmill's or vLLM's (no load is sent)")
    o.add_argument("--eval-result", metavar="EVAL.json",
                   help="with --compare: `tokenmill eval` JSON whose base and candidates (in order) give the "
                        "compared runs' task accuracy, for cost per successful task")
    o.add_argument("--variant-cost", action="append", metavar="NAME=DOLLARS",
                   help="with --compare: dollars per hour of a router variant's replicas")
    o.add_argument("--no-progress", "--disable-tqdm", dest="no_progress", action="store_true")


def _pairs(items: list[str] | None, flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} {item!r}: use KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def _alias(args: argparse.Namespace, old: str, new: str, flags: str) -> None:
    """Fold vLLM's spelling ``new`` into tokenmill's ``old``; both given differently is an error."""
    value = getattr(args, new)
    if value is None or value is False:
        return
    if getattr(args, old) not in (None, value) and getattr(args, old) != _DEFAULTS.get(old):
        raise ValueError(f"{flags}: give one of the two")
    setattr(args, old, value)


_DEFAULTS: dict[str, Any] = {"warmup": 0, "prefix_len": 0}


def _normalize(args: argparse.Namespace) -> argparse.Namespace:
    """One meaning per setting, whichever tool's spelling the command line used.
    Raises ValueError with a one-line message."""
    vllm_style = any(getattr(args, d, None) not in (None, False) for d in VLLM_DESTS)
    args.vllm_style = vllm_style
    _alias(args, "url", "base_url", "--url/--base-url")
    if args.url is None:
        args.url = f"http://{args.host}:{args.port}"
    _alias(args, "rate", "request_rate", "--rate/--request-rate")
    _alias(args, "num_requests", "num_prompts", "--num-requests/--num-prompts")
    _alias(args, "warmup", "num_warmups", "--warmup/--num-warmups")
    _alias(args, "dataset", "dataset_path", "--dataset/--dataset-path")
    if args.random_prefix_len is not None:
        args.prefix_len = args.random_prefix_len
    for mine, theirs in (("input_len", "random_input_len"), ("output_len", "random_output_len")):
        value = getattr(args, theirs)
        if value is not None:
            r = args.random_range_ratio or 0.0
            spec = str(value) if r <= 0 else f"uniform:{max(1, int(value * (1 - r)))}:{int(value * (1 + r))}"
            setattr(args, mine, spec)
    if args.input_len is None:
        args.input_len = "1024" if vllm_style else "512"
    if args.output_len is None:
        args.output_len = "128"
    # endpoint: tokenmill's words, vLLM's paths, or the backend's kind
    endpoint = (args.endpoint or "").strip()
    if endpoint in ("", None):
        endpoint = "chat" if (args.backend or "").endswith("chat") else "completions"
    elif endpoint.rstrip("/").endswith("chat/completions") or endpoint == "chat":
        endpoint = "chat"
    elif endpoint.rstrip("/").endswith("completions") or endpoint == "completions":
        endpoint = "completions"
    else:
        raise ValueError(f"--endpoint {args.endpoint}: use completions, chat, /v1/completions or "
                         "/v1/chat/completions")
    args.endpoint = endpoint
    if args.dataset_name not in (None, "random", "sharegpt", "custom"):
        raise ValueError(f"--dataset-name {args.dataset_name}: tokenmill generates 'random' prompts and reads "
                         "'sharegpt' / 'custom' files (--dataset-path); use one of those")
    if args.dataset_name in ("sharegpt", "custom") and not args.dataset:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path")
    if args.dataset_name == "random":
        args.dataset = None
    if args.data:
        _guidellm_data(args)
    if args.goodput:
        from tokenmill.bench.traces.vllm_format import parse_goodput

        if args.slo:
            raise ValueError("give --slo or --goodput, not both")
        args.slo_dict = parse_goodput(args.goodput)
    args.headers = _pairs(args.header, "--header")
    args.metadata_dict = _pairs(args.metadata, "--metadata")
    if args.rate_type:
        _guidellm_rate_type(args)
    if vllm_style:
        if not args.concurrency and not args.rate:
            args.rate = "inf"  # vLLM sends every prompt at once unless told a rate
        if args.num_requests is None and not args.duration and not args.trace:
            args.num_requests = 1000
    return args


def _guidellm_data(args: argparse.Namespace) -> None:
    """guidellm's --data: 'prompt_tokens=256,output_tokens=128' or a file."""
    if "=" in args.data and not os.path.exists(args.data):
        fields = _pairs(args.data.split(","), "--data")
        names = {"prompt_tokens": "input_len", "output_tokens": "output_len"}
        unknown = [k for k in fields if k not in names]
        if unknown:
            raise ValueError(f"--data: tokenmill reads prompt_tokens and output_tokens, not {', '.join(unknown)}")
        for key, value in fields.items():
            setattr(args, names[key], value)
    else:
        args.dataset = args.data


def _guidellm_rate_type(args: argparse.Namespace) -> None:
    kind = args.rate_type
    if kind == "sweep":
        raise ValueError("--rate-type sweep: give the points instead, e.g. --rate 1,2,4,8 or --concurrency 1,4,16")
    if kind == "synchronous":
        args.concurrency, args.rate = "1", None
    elif kind == "concurrent":
        if not args.rate:
            raise ValueError("--rate-type concurrent needs --rate N (the number of users)")
        args.concurrency, args.rate = args.rate, None
    elif kind == "throughput":
        args.rate = "inf"
    elif not args.rate:
        raise ValueError(f"--rate-type {kind} needs --rate (requests per second)")
    elif kind == "constant":
        args.burstiness = 1000.0  # gamma arrivals with a huge shape: evenly spaced


def add_trace_parser(sub: Any) -> None:
    p = sub.add_parser("trace", allow_abbrev=False, help="analyse traffic captures")
    tsub = p.add_subparsers(dest="trace_command", metavar="ACTION")
    a = tsub.add_parser("analyze", allow_abbrev=False, help="lengths, arrivals, prefix sharing, prompt-layout checks")
    a.add_argument("files", nargs="+", help="capture JSONL files (rotated parts: FILE.1, ...)")
    a.add_argument("--top", type=int, default=5, help="how many shared prefixes to list")
    a.add_argument("--json", dest="json_out", help="also write the analysis as JSON")
    a.set_defaults(func=trace_main)
    e = tsub.add_parser("export", allow_abbrev=False,
                        help="write a capture as a Mooncake hash_ids trace (prefix structure and sessions kept)")
    e.add_argument("files", nargs="+", help="capture JSONL files (rotated parts: FILE.1, ...)")
    e.add_argument("--output", required=True, help="the Mooncake JSONL to write")
    e.add_argument("--format", default="mooncake", choices=["mooncake"], help="trace format (mooncake)")
    e.add_argument("--block-size", type=_positive_int, default=512,
                   help="tokens per hash id, a multiple of the capture's 16 (default 512, Mooncake's)")
    e.set_defaults(func=trace_export_main)


def _positive_int(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {value}")
    return n


def register(subparsers: Any) -> None:
    add_bench_parser(subparsers)
    add_trace_parser(subparsers)
    from tokenmill.bench.plan import add_plan_parser

    add_plan_parser(subparsers)
    from tokenmill.bench.usage import add_usage_parser

    add_usage_parser(subparsers)


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
    if args.compare:
        return _compare(args)
    from tokenmill.bench.client import Target, normalize_base_url
    from tokenmill.bench.runner import BenchResult

    try:
        checked = _checked(args)
    except (OSError, ValueError) as exc:
        return _fail(str(exc), 2)
    base = normalize_base_url(args.url)
    cfg = _bench_config(args, *checked)
    target = Target(base, args.model or "", args.endpoint, args.api_key,
                    ignore_eos=not args.no_ignore_eos, temperature=args.temperature,
                    extra_headers=args.headers)
    result = BenchResult(target={"base_url": base, "model": args.model,
                                 "endpoint": args.endpoint}, config=cfg.describe())
    return _run(args, cfg, target, result)


def _compare(args: argparse.Namespace) -> int:
    """``--compare``: print saved results side by side; no server is contacted."""
    from tokenmill.bench import report
    from tokenmill.bench.success import parse_variant_costs

    try:
        print(report.compare(args.compare, args.eval_result, parse_variant_costs(args.variant_cost)))
    except (OSError, ValueError, KeyError) as exc:
        return _fail(f"cannot compare: {exc}")
    return 0


def _checked(args: argparse.Namespace) -> tuple[list[Any], Any, Any, Any]:
    """Every argument read and checked before any server is contacted: the load shapes, the
    SLO and the prompt and output lengths; raises OSError or ValueError saying what is wrong."""
    from tokenmill.bench.lengths import parse_length
    from tokenmill.bench.stats import parse_slo

    _normalize(args)
    shapes = _shapes(args)
    slo = getattr(args, "slo_dict", None) or parse_slo(args.slo)
    if args.save_result:
        from tokenmill.bench.traces.vllm_format import parse_metrics, parse_percentiles

        parse_metrics(args.percentile_metrics), parse_percentiles(args.metric_percentiles)
    in_len, out_len = parse_length(args.input_len), parse_length(args.output_len)
    for path in (args.dataset, args.trace):
        if path and not os.path.exists(path):
            raise ValueError(f"{path}: no such file")
    if args.trace:  # a malformed trace is refused before any server is contacted
        from tokenmill.bench.workloads import read_trace

        read_trace(args.trace)
    return shapes, slo, in_len, out_len


def _bench_config(args: argparse.Namespace, shapes: list[Any], slo: Any, in_len: Any, out_len: Any) -> Any:
    from tokenmill.bench.runner import BenchConfig
    from tokenmill.bench.workloads import SyntheticConfig

    # A duration-bound closed loop needs enough prompts to last: a generous cap.
    num = args.num_requests or (2000 if args.duration and not args.rate else 100)
    if args.trace and not args.num_requests:
        num = 1 << 40  # the whole capture
    return BenchConfig(
        shapes=shapes, num_requests=num, warmup=args.warmup,
        synthetic=SyntheticConfig(in_len, out_len, args.prefix_len, args.num_prefixes,
                                  args.prefix_pick),
        dataset=args.dataset, trace=args.trace, trace_speed=args.trace_speed,
        output_len=out_len, slo=slo, cost_per_hour=args.cost_per_hour,
        reset_cache=args.reset_cache, salt=not args.no_salt, seed=args.seed,
        timeout=args.timeout, progress=False if args.no_progress else None)


def _run(args: argparse.Namespace, cfg: Any, target: Any, result: Any) -> int:
    """Run the benchmark into ``result`` and report it; Ctrl-C or an error after some points
    still reports what was measured, marked partial."""
    from tokenmill.bench.runner import resolve_model, run_bench
    from tokenmill.bench.tokens import make_counter

    interrupted = False

    def on_ctrl_c(task: asyncio.Task[Any]) -> None:
        """Ctrl-C: no new requests (the point running now stops sending), the run is
        cancelled, and the report says it is partial, whatever the cancellation meets
        on its way out."""
        nonlocal interrupted
        interrupted = True
        result.aborted = "interrupted by the user"
        if result.points:
            result.points[-1].run.aborted = result.aborted
        task.cancel()

    async def main() -> None:
        import httpx

        task = asyncio.current_task()
        if task is not None and hasattr(signal, "SIGINT"):
            try:
                asyncio.get_running_loop().add_signal_handler(signal.SIGINT, on_ctrl_c, task)
            except (NotImplementedError, RuntimeError):  # no signal handlers here (not the main thread)
                pass
        if not target.model:
            async with httpx.AsyncClient() as client:
                target.model = await resolve_model(client, target.base_url, args.api_key)
        result.target["model"] = target.model
        counter = await asyncio.to_thread(make_counter, args.tokenizer, target.base_url, target.model,
                                          args.api_key)
        try:
            await run_bench(cfg, target, counter, result)
        finally:
            counter.close()

    try:
        asyncio.run(main())
    except (KeyboardInterrupt, asyncio.CancelledError):
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
    output = args.output
    if args.save_result and result.points:
        written = _save_vllm_results(args, result)
        for path in written:
            print(f"wrote {path}")
        if not output:  # tokenmill's own, richer file beside the first vLLM one
            output = os.path.splitext(written[0])[0] + ".tokenmill.json"
    if output:
        report.save(data, output)
        print(f"wrote {output}")
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


_SHOW_PROBLEMS = 20


def _save_vllm_results(args: argparse.Namespace, result: Any) -> list[str]:
    """One vLLM-format file per load point (vLLM writes one per run)."""
    import json

    from tokenmill.bench.traces.vllm_format import parse_metrics, parse_percentiles, result_filename, to_vllm

    folder = args.result_dir or "."
    os.makedirs(folder, exist_ok=True)
    model = result.target.get("model") or ""
    backend = args.backend or "tokenmill"
    paths: list[str] = []
    for k, point in enumerate(result.points):
        shape = point.shape
        if args.result_filename:
            stem, ext = os.path.splitext(args.result_filename)
            name = args.result_filename if len(result.points) == 1 else f"{stem}-{k}{ext or '.json'}"
        else:
            name = result_filename(args.label, backend, shape, model, result.started_at)
            if len(result.points) > 1:
                name = name[:-5] + f"-{k}.json"
        data = to_vllm(point.run.records, point.summary, shape=shape, model=model,
                       endpoint="/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions",
                       backend=backend, label=args.label, tokenizer=args.tokenizer,
                       metrics=parse_metrics(args.percentile_metrics),
                       percentiles=parse_percentiles(args.metric_percentiles),
                       goodput=bool(point.summary.good is not None), metadata=args.metadata_dict,
                       started_at=result.started_at)
        path = os.path.join(folder, name)
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=1)
        paths.append(path)
    return paths


def _capture_paths(files: list[str]) -> list[str]:
    paths: list[str] = []
    for f in files:
        paths += sorted(glob.glob(f)) or [f]
    return paths


def trace_export_main(args: argparse.Namespace) -> int:
    from tokenmill.bench.traces.mooncake import write_mooncake
    from tokenmill.traffic.capture import read_capture

    paths = _capture_paths(args.files)
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        return _fail(f"no such capture file: {', '.join(missing)}")
    try:
        records = read_capture(paths)
        if not records:
            raise ValueError("no capture records")
        n = write_mooncake(records, args.output, args.block_size)
    except (OSError, ValueError, KeyError) as exc:
        return _fail(f"cannot export: {exc}")
    sessions = len({r["session"] for r in records if r.get("session")})
    print(f"wrote {n} requests ({sessions} sessions) to {args.output} as a Mooncake trace, "
          f"{args.block_size} tokens per hash id")
    return 0


def trace_main(args: argparse.Namespace) -> int:
    import json

    from tokenmill.bench.traces.trace_analysis import analyze, render
    from tokenmill.traffic.capture import read_capture

    paths: list[str] = []
    for f in args.files:
        matched = sorted(glob.glob(f)) or [f]
        paths += matched
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        return _fail(f"no such capture file: {', '.join(missing)}")
    problems: list[tuple[str, int, str]] = []
    try:
        records = read_capture(paths, problems)
        for path, number, reason in problems[:_SHOW_PROBLEMS]:
            print(f"tokenmill trace: {path} line {number}: skipped, {reason}", file=sys.stderr)
        if len(problems) > _SHOW_PROBLEMS:
            print(f"tokenmill trace: ... and {len(problems) - _SHOW_PROBLEMS} more unreadable lines",
                  file=sys.stderr)
        rep = analyze(records, top=args.top)
    except (OSError, ValueError) as exc:
        return _fail(str(exc))
    if problems:
        where = ", ".join(f"{path}:{number}" for path, number, _ in problems[:_SHOW_PROBLEMS])
        more = f" and {len(problems) - _SHOW_PROBLEMS} more" if len(problems) > _SHOW_PROBLEMS else ""
        rep.warnings.append(f"{len(problems)} unreadable lines skipped (torn or corrupt): {where}{more}")
    keys = {r.get("key_id") for r in records}
    if len(keys) > 1:
        rep.warnings.append(f"the records were hashed with {len(keys)} different keys; prefix sharing is "
                            "only seen between records hashed with the same key (give replicas one --capture-key)")
    print(render(rep))
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as fh:
            json.dump(rep.to_dict(), fh, indent=1)
    return 0

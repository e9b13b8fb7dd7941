"""Quantization benchmark: none / int8 / int4 (and more) on the bundled model, one run.

    python benchmarks/quantization.py                      # none, int8, int4, gguf
    python benchmarks/quantization.py --configs none,int8:lm_head,int4:lm_head
    python benchmarks/quantization.py --threads 2          # default 1: steadier on a shared machine

All engines stay loaded; speed is measured in rounds in which every
configuration takes its turn, and each keeps its best round.

For every configuration, in the same process and on the same loaded weights:
weight bytes, decode tokens/s at batch 1 and 32, prefill tokens/s (one
prompt in one step), perplexity on the bundled sample text (sliding window),
and the ratio of each figure against ``none`` measured in this run (absolute
speed drifts with the machine's load; the ratios are the result).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from tokenmill.evaluate.cli import sample_path  # noqa: E402
from tokenmill.evaluate.harness import CandidateSpec, EvalOptions, engine_config  # noqa: E402
from tokenmill.evaluate.scoring import Scorer, perplexity  # noqa: E402
from tokenmill.evaluate.speed import measure_decode, measure_prefill  # noqa: E402


def build_and_score(spec, opts, loaded, tokenizer, text_ids):  # type: ignore[no-untyped-def]
    """One configuration's engine and its perplexity on the sample text."""
    import torch

    from tokenmill.engine.engine import LLMEngine
    from tokenmill.evaluate.harness import CandidateResult

    t0 = time.monotonic()
    engine = LLMEngine(engine_config(spec, opts), loaded=loaded, tokenizer=tokenizer)
    torch.set_num_threads(opts.threads)
    load_s = time.monotonic() - t0
    ppl = perplexity(Scorer(engine), text_ids, opts.window, opts.stride)
    report = getattr(engine.model, "quant_report", None)
    res = CandidateResult(spec.label, spec.quantization, "", None, False, engine.weight_bytes, engine.pool.num_blocks,
                          load_s, report.summary() if report else spec.quantization, ppl, None, 0)
    return engine, res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: bundled SmolLM2-135M)")
    p.add_argument("--configs", default="none,int8,int4,gguf",
                   help="comma-separated configurations, the first is the baseline (default none,int8,int4,gguf)")
    p.add_argument("--dtype", default="float32", help="dtype of the unquantized parts (default float32)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--decode-batches", default="1,32")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--text-tokens", type=int, default=None, help="score only the first N tokens of the sample text")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--stride", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3, help="speed rounds; the best of each configuration counts")
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)

    import torch

    from tokenmill.model.loader import load_model
    from tokenmill.files.tokenizer import Tokenizer

    specs = [CandidateSpec.parse(c) for c in args.configs.split(",") if c.strip()]
    opts = EvalOptions(model=args.model, dtype=args.dtype, window=args.window, stride=args.stride,
                       decode_batches=tuple(int(b) for b in args.decode_batches.split(",")),
                       decode_tokens=args.decode_tokens, prefill_tokens=args.prefill_tokens, threads=args.threads)
    loaded = load_model(args.model, dtype=torch.float32)
    tokenizer = Tokenizer.from_model_path(args.model)
    text_ids = tokenizer.encode(sample_path("sample_text.txt").read_text(), add_special_tokens=True)
    if args.text_tokens:
        text_ids = text_ids[: args.text_tokens]
    started = time.monotonic()
    engines = []
    rows = []
    for spec in specs:  # quality first, one configuration after the other
        print(f"... {spec.label}: load, perplexity", file=sys.stderr, flush=True)
        engine, res = build_and_score(spec, opts, loaded, tokenizer, text_ids)
        engines.append(engine)
        rows.append({"config": spec.label, "weight_bytes": res.weight_bytes, "perplexity": res.perplexity.perplexity,
                     "ppl_tokens": res.perplexity.num_tokens, "load_s": res.load_s, "summary": res.quant_summary})
    # Speed: configurations take turns within each round and the best round counts, so a
    # burst of load from elsewhere on the machine hits all of them rather than one.
    for r in range(args.rounds):
        print(f"... speed round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        for engine, row in zip(engines, rows):
            for b in opts.decode_batches:
                tps = measure_decode(engine, b, opts.decode_tokens, text_ids, repeats=1)
                row[f"decode_b{b}"] = max(row.get(f"decode_b{b}", 0.0), tps)
            row["prefill"] = max(row.get("prefill", 0.0), measure_prefill(engine, opts.prefill_tokens, text_ids, 1))
    base = rows[0]
    keys = ["weight_bytes"] + [f"decode_b{b}" for b in opts.decode_batches] + ["prefill", "perplexity"]
    names = {"weight_bytes": "weights MB", "prefill": f"prefill tok/s ({args.prefill_tokens})",
             "perplexity": f"ppl ({base['ppl_tokens']} tok)",
             **{f"decode_b{b}": f"decode tok/s b={b}" for b in opts.decode_batches}}
    print(f"model: {args.model or 'bundled SmolLM2-135M-Instruct (Q4_1 GGUF)'}; dtype {args.dtype}; "
          f"torch threads {args.threads}; decode {args.decode_tokens} tokens/seq; "
          f"ppl window {args.window} stride {args.stride}; {time.monotonic() - started:.0f}s")
    header = f"{'config':<14}" + "".join(f"{names[k]:>22}" for k in keys)
    print(header)
    print("-" * len(header))
    for row in rows:
        cells = []
        for k in keys:
            v = row[k]
            shown = f"{v / 1e6:.1f}" if k == "weight_bytes" else f"{v:.3f}" if k == "perplexity" else f"{v:.1f}"
            ratio = v / base[k] if base[k] else float("nan")
            cells.append(f"{shown} (x{ratio:.2f})" if row is not base else shown)
        print(f"{row['config']:<14}" + "".join(f"{c:>22}" for c in cells))
    print()
    for row in rows:
        print(f"{row['config']:<14} {row['summary']}  (load {row['load_s']:.1f}s)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Two source trees' engines, alternated round by round: has a change kept the speed?

Each round runs every tree once, in its own process (``PYTHONPATH=TREE/src``, the tree's own
``benchmarks/decode_speed.py`` and its own C kernel build), so a slow spell of this shared
host falls on both trees alike; the ratios are medians over the rounds of new / old.

Figures per tree and round, on one engine built as `tokenmill serve` builds it (``default``):

* one stream: prefill tok/s of a ``--prefill-len`` prompt and decode tok/s of the next
  ``--decode-len`` greedy tokens (``decode_speed.measure``, best of ``--repeats``);
* ``--streams`` streams: output tok/s of that many requests of ``--decode-len`` tokens each,
  added at once and stepped to the end (greedy, EOS ignored): the continuous batching a
  server does.

    python benchmarks/compare_trees.py --old /path/to/old-checkout --new . --rounds 6
    python benchmarks/compare_trees.py --old OLD --new . --isa avx2   # as an AVX2-only CPU runs

``--model`` measures another GGUF file (a real-size shape from ``real_sizes.py``) instead of
the bundled model.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

# Run inside each tree's process: its own decode_speed module and its own package.
PROBE = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import decode_speed as d
from tokenmill import SamplingParams
args = json.loads(sys.argv[2])
d.MODEL = args["model"]
engine = d.make_engine("default")
d.measure(engine, 64, 8, seed=99)
runs = [d.measure(engine, args["prefill_len"], args["decode_len"], seed) for seed in range(args["repeats"])]
params = SamplingParams(temperature=0.0, max_tokens=args["decode_len"], ignore_eos=True)


def batch(n, tag):
    for i in range(n):
        engine.add_request(f"{tag}{i}", [100 + (7 * i + j) % 1000 for j in range(32)], params)
    made = 0
    while engine.has_unfinished():
        made += sum(len(delta.token_ids) for delta in engine.step())
    return made


batch(4, "warm")
t = time.perf_counter()
streams = batch(args["streams"], "s") / (time.perf_counter() - t)
print("RESULT " + json.dumps({"prefill": max(r[0] for r in runs), "decode": max(r[1] for r in runs),
                              "streams": streams}))
"""


def run_tree(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    """One process of ``tree``: its figures."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    if args.isa == "avx2":
        env.update(ATEN_CPU_CAPABILITY="avx2", TOKENMILL_KERNEL_ISA="avx2")
    spec = {"model": args.model, "prefill_len": args.prefill_len, "decode_len": args.decode_len,
            "repeats": args.repeats, "streams": args.streams}
    out = subprocess.run([sys.executable, "-c", PROBE, str(tree / "benchmarks"), json.dumps(spec)], env=env,
                         capture_output=True, text=True, timeout=args.timeout)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"{tree}: the probe failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, type=Path, help="the baseline checkout (its src/ and benchmarks/)")
    ap.add_argument("--new", default=Path("."), type=Path, help="the changed checkout (default: this one)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--isa", choices=("native", "avx2"), default="native")
    ap.add_argument("--model", default=None, help="a GGUF file instead of the bundled model")
    ap.add_argument("--prefill-len", type=int, default=128)
    ap.add_argument("--decode-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one tree's process may take")
    args = ap.parse_args(argv)
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    figures: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    print(f"# {args.isa} build, {args.rounds} rounds, old {trees['old']}, new {trees['new']}", flush=True)
    for r in range(args.rounds):
        order = ("old", "new") if r % 2 == 0 else ("new", "old")  # who goes first alternates too
        for name in order:
            figures[name].append(run_tree(trees[name], args))
        old, new = figures["old"][-1], figures["new"][-1]
        print(f"round {r + 1}: " + ", ".join(f"{k} {old[k]:.1f} -> {new[k]:.1f} ({new[k] / old[k]:.2f}x)"
                                             for k in ("prefill", "decode", "streams")), flush=True)
    print("\n| figure | old (median) | new (median) | new / old (median of rounds) |\n|---|---|---|---|")
    for k in ("prefill", "decode", "streams"):
        olds, news = [f[k] for f in figures["old"]], [f[k] for f in figures["new"]]
        ratio = statistics.median(n / o for n, o in zip(news, olds))
        print(f"| {k} tok/s | {statistics.median(olds):.1f} | {statistics.median(news):.1f} | {ratio:.3f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

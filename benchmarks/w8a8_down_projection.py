"""w8a8's down projections: 8-bit activations per 32 inputs against 16-bit ones, in one run.

Builds the default engine (w8a8 on a CPU whose kernels have VNNI) twice: as it is, with
the down projections int8 per 32 inputs taking 8-bit activations with a scale per 32
inputs (``Int8GroupLinear(dynamic=True)``), and as the baseline, with them weight-only
int8 per output channel at 16-bit activations (what w8a8 built before; here by telling
``quantize_model`` that the kernels have no VNNI while the baseline is built). Then the
two take turns: a fused batch-64 decode step at context 256 and a 512-token eager prefill
step (two 256-token prompts), best of ``--rounds``, and the ratio of each.

    .venv/bin/python benchmarks/w8a8_down_projection.py [--rounds 10]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_step import make_batch  # noqa: E402

from tokenmill.settings.config import EngineConfig  # noqa: E402
from tokenmill.engine.engine import LLMEngine  # noqa: E402
from tokenmill.engine.step.executors import FusedDecodeExecutor  # noqa: E402
from tokenmill.engine.request import Request, SamplingParams  # noqa: E402
from tokenmill.model.quant import quant  # noqa: E402


def build(grouped: bool) -> LLMEngine:
    real = quant._vnni
    if not grouped:
        quant._vnni = lambda options: False  # the down projections then stay weight-only
    try:
        return LLMEngine(EngineConfig.from_options(dtype="auto", quantization="auto", kv_cache_memory="1GiB",
                                                   enable_prefix_caching=False))
    finally:
        quant._vnni = real


def prefill_items(engine: LLMEngine) -> list[tuple[Request, int]]:
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    items = []
    for i in range(2):
        req = Request(str(i), [rng.randrange(vocab) for _ in range(256)], SamplingParams())
        req.block_table = list(range(i * 16, (i + 1) * 16))
        items.append((req, 256))
    return items


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    engines = {"16-bit (baseline)": build(False), "8-bit per 32": build(True)}
    kinds = {name: type(e.model.layers[0].mlp.down_proj).__name__ for name, e in engines.items()}
    if len(set(kinds.values())) == 1:
        print(f"both engines built the same down projections ({kinds}): this CPU's kernels have no VNNI")
        return 1
    runs = {}
    for name, engine in engines.items():
        fused = next(e for e in engine.runner.executors if isinstance(e, FusedDecodeExecutor))
        runs[name] = (fused, make_batch(engine, 64, 256, random.Random(0)), engine, prefill_items(engine))
    best = {(name, part): float("inf") for name in runs for part in ("decode", "prefill")}
    for round_ in range(args.rounds + 1):  # the first round warms up
        for name, (fused, decodes, engine, prompts) in runs.items():
            steps = (("decode", lambda: fused.run(decodes)), ("prefill", lambda: engine.runner.run_eager(prompts)))
            for part, run in steps:
                t = time.perf_counter()
                run()
                if round_:
                    best[(name, part)] = min(best[(name, part)], time.perf_counter() - t)
    base, new = engines
    print(f"# w8a8 down projections, best of {args.rounds} rounds, load {os.getloadavg()[0]:.2f}, "
          f"cpus {os.cpu_count()}")
    for part, what in (("decode", "fused decode step, 64 streams at context 256"),
                       ("prefill", "eager prefill step, 2 x 256 tokens")):
        b, n = best[(base, part)], best[(new, part)]
        print(f"{what}: {base} {b * 1e3:.1f} ms, {new} {n * 1e3:.1f} ms: {b / n:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

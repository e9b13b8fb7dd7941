"""Where one engine step's time goes: decode batches of 1, 16 and 64 at context ~256.

Drives ``ModelRunner.execute`` directly with synthetic decode requests (random
token ids, block tables scattered over the pool the way a busy server leaves
them), so the figures are the forward pass plus batch building, without
scheduling or sampling. Two measurements per case:

* wall time per step: best of repeated steps, no profiler attached, through
  the eager torch model and through the fused native decode step
  (engine/step/fused_decode.py; measured here at every batch size, whatever the
  engine's ``TOKENMILL_FUSED_DECODE_MAX_BATCH`` cut-off);
* a torch.profiler breakdown of the eager step by part (labels inserted
  around the model's pieces), as shares of the profiled step, and the number
  of ATen ops dispatched per step (the fused step dispatches a handful).

The machine's absolute speed drifts (2 shared cores): compare rows of one run.

    .venv/bin/python benchmarks/profile_step.py [--dtypes float32,bfloat16,int4+lm_head] [--batches 1,16,64] [--context 256]
    TOKENMILL_ATTENTION=reference .venv/bin/python benchmarks/profile_step.py   # the plain reference attention
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections import defaultdict
from typing import Any, Callable

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from tokenmill.settings.config import EngineConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.request import Request, SamplingParams
from tokenmill.engine.step.executors import FusedDecodeExecutor
from tokenmill.model import attention as attention_mod
from tokenmill.model.ops import ModelOps

PARTS = ["prepare", "linear", "lm_head", "attention", "kv_write", "rope", "norm"]


def _label(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with record_function("tm::" + name):
            return fn(*args, **kwargs)
    return wrapped


_STEP_CLASSES = (attention_mod.CpuKernelStep, attention_mod.TorchPagedStep, attention_mod.reference.ReferenceStep)


def instrument(engine: LLMEngine) -> list[tuple[Any, str, Any]]:
    """Wrap the model's pieces in profiler labels (adds a few us per call); returns what
    to restore (class-level wrappers) once the profile is taken."""
    model = engine.model
    for layer in model.modules():
        if isinstance(layer, nn.Linear) or type(layer).__name__.endswith("Linear"):
            name = "lm_head" if layer is model.lm_head else "linear"
            layer.forward = _label(name, layer.forward)  # type: ignore[method-assign]
            if hasattr(layer, "forward_add"):  # o and down projections with the residual add fused
                layer.forward_add = _label(name, layer.forward_add)  # type: ignore[method-assign]
    model.rope.tables = _label("rope", model.rope.tables)  # type: ignore[method-assign]
    saved: list[tuple[Any, str, Any]] = []
    for owner, attr, part in [(ModelOps, "rotate", "rope"), (ModelOps, "rms_norm", "norm"),
                              *[(cls, "attend", "attention") for cls in _STEP_CLASSES],
                              *[(cls, "write_kv", "kv_write") for cls in _STEP_CLASSES]]:
        saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, _label(part, getattr(owner, attr)))
    engine.runner.prepare = _label("prepare", engine.runner.prepare)  # type: ignore[method-assign]
    return saved


def make_batch(engine: LLMEngine, batch: int, context: int, rng: random.Random) -> list[tuple[Request, int]]:
    bs = engine.block_size
    per_seq = -(-(context + 1) // bs)
    blocks = list(range(engine.runner.num_blocks))
    rng.shuffle(blocks)
    vocab = engine.model_config.vocab_size
    items = []
    for i in range(batch):
        req = Request(request_id=str(i), prompt_token_ids=[rng.randrange(vocab) for _ in range(context)],
                      params=SamplingParams())
        req.num_computed_tokens = context - 1
        req.block_table = blocks[i * per_seq : (i + 1) * per_seq]
        items.append((req, 1))
    return items


def _step_fn(engine: LLMEngine, fused: bool) -> Callable[[list[tuple[Request, int]]], Any]:
    """The fused decode step (whatever its batch cut-off) or the eager one."""
    if not fused:
        return engine.runner.run_eager
    executor = next(e for e in engine.runner.executors if isinstance(e, FusedDecodeExecutor))
    return executor.run


def time_steps(engine: LLMEngine, items: list[tuple[Request, int]], steps: int, fused: bool = False) -> float:
    """Best of ``steps``: on a shared machine other processes only ever add time."""
    run = _step_fn(engine, fused)
    for _ in range(2):
        run(items)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        run(items)
        times.append(time.perf_counter() - t)
    return min(times)


def ab_steps(engine: LLMEngine, items: list[tuple[Request, int]], steps: int) -> tuple[float, float]:
    """Best step time with the reference attention and with the default path, interleaved
    step by step so that both see the same machine load (eager model, fused step off)."""
    runner = engine.runner
    backends = {True: attention_mod.ReferenceAttention(), False: runner.attention}
    best = {True: float("inf"), False: float("inf")}
    for flag in (True, False):
        runner.attention = backends[flag]
        runner.run_eager(items)
    for _ in range(steps):
        for flag in (True, False):
            runner.attention = backends[flag]
            t = time.perf_counter()
            runner.run_eager(items)
            best[flag] = min(best[flag], time.perf_counter() - t)
    runner.attention = backends[False]
    return best[True], best[False]


def profile_steps(engine: LLMEngine, items: list[tuple[Request, int]], steps: int) -> tuple[dict[str, float], int, float]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with record_function("tm::step"):
                engine.runner.run_eager(items)
    totals: dict[str, float] = defaultdict(float)
    ops = 0
    for ev in prof.events():
        if ev.name.startswith("tm::"):
            totals[ev.name[4:]] += ev.cpu_time_total
        elif ev.name.startswith("aten::"):
            ops += 1
    step_us = totals["step"]
    # lm_head is wrapped inside nothing else; linear excludes it. Nested labels: none overlap.
    shares = {p: totals.get(p, 0.0) / step_us for p in PARTS}
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    # aten ops counted include nested ones (e.g. linear -> addmm): report top-level-ish count
    return shares, ops // steps, step_us / steps / 1000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--kv-cache-dtype", default="auto", help="the KV pool's dtype (auto, int8, fp8)")
    ap.add_argument("--steps", type=int, default=0, help="timed steps per case (0: by batch size)")
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: the engine's choice, all cores)")
    ap.add_argument("--ab", action="store_true",
                    help="only time the reference attention against the default path, interleaved")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"# torch {torch.__version__}, threads {args.threads or torch.get_num_threads()}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
          f"attention={os.environ.get('TOKENMILL_ATTENTION', 'default')}, load {os.getloadavg()[0]:.2f}")
    header = ["config", "batch", "eager ms/step", "fused ms/step", "fused speed-up", "ops/step (eager)",
              *PARTS, "other"]
    if args.ab:
        header = ["dtype", "batch", "ms/step reference attention", "ms/step default", "speed-up"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for dtype in args.dtypes.split(","):
        need = max(batches) * (-(-(args.context + 1) // 16)) + 8
        name, _, extra = dtype.partition("+")
        quant = (dict(quantization=name, quantize_lm_head=extra == "lm_head")
                 if name in ("int8", "int4", "w8a8", "gguf", "auto") else {})
        if name == "default":  # what `tokenmill serve` runs with no flags on this machine
            quant = dict(quantization="auto")
        # quantized configs: the rest of the model in this CPU's own choice (bf16 where native)
        cfg = EngineConfig.from_options(dtype="auto" if quant else name, num_blocks=need,
                                        kv_cache_dtype=args.kv_cache_dtype,
                                        enable_prefix_caching=False, max_num_seqs=max(batches), **quant)
        engine = LLMEngine(cfg)
        if args.threads:
            torch.set_num_threads(args.threads)
        rng = random.Random(0)
        for batch in batches:
            items = make_batch(engine, batch, args.context, rng)
            steps = args.steps or (20 if batch == 1 else 8 if batch <= 16 else 5)
            if args.ab:
                ref, new = ab_steps(engine, items, steps)
                print(f"| {dtype} | {batch} | {ref * 1000:.1f} | {new * 1000:.1f} | {ref / new:.2f}x |", flush=True)
                continue
            wall = time_steps(engine, items, steps)
            fused = time_steps(engine, items, steps, fused=True) if engine.runner.fused is not None else float("nan")
            # Profile the eager step, instrumented (labels are wrappers, removed again after).
            saved = instrument(engine)
            shares, ops, _ = profile_steps(engine, items, 3)
            for owner, attr, fn in saved:
                setattr(owner, attr, fn)
            engine = _strip(engine)
            row = [dtype, str(batch), f"{wall * 1000:.1f}", f"{fused * 1000:.1f}", f"{wall / fused:.2f}x", str(ops)]
            row += [f"{shares[p] * 100:.0f}%" for p in [*PARTS, "other"]]
            print("| " + " | ".join(row) + " |", flush=True)
    return 0


def _strip(engine: LLMEngine) -> LLMEngine:
    """Remove the per-instance profiler wrappers again."""
    for m in engine.model.modules():
        m.__dict__.pop("forward", None)
        m.__dict__.pop("tables", None)
    engine.runner.__dict__.pop("prepare", None)
    return engine


if __name__ == "__main__":
    sys.exit(main())

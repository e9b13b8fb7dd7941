"""Where a many-stream run's time goes: serving_throughput's workload replayed
offline through ``LLMEngine.step``, timed step by step.

``--streams`` prompts of ``--input-len`` tokens (no shared prefix) arrive
together, each asking for exactly ``--output-len`` tokens (greedy,
ignore_eos), as the 64-stream level of ``serving_throughput.py`` sends them,
without HTTP. Printed:

* wall time and output tok/s, the preemptions the KV pool forced;
* steps by kind: mixed (prefill chunks, decodes riding along) and
  decode-only (the fused native step up to its batch limit), with their time
  and tokens a step, and the decode-only steps by batch size (the drain at
  the end runs at small batches);
* the mixed steps' time by part (``--parts``): each part's wall time summed
  over the timed steps, with wrappers around the model's pieces (a few us a
  call). Linear and linear + residual are the oneDNN matmuls; the LM head is
  inside "logits".

Same engine settings as the server's defaults otherwise. The machine's speed
drifts: compare runs interleaved (an old checkout on PYTHONPATH), not across
sessions.

    .venv/bin/python benchmarks/serving_replay.py [--streams 64] [--dtype float32] [--kv-cache-memory 2GiB] [--parts]
"""
from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving import make_prompts  # noqa: E402

import tokenmill.model.attention as attention_mod  # noqa: E402
import tokenmill.model.kernels.cpu_kernels as kernels_mod  # noqa: E402
import tokenmill.model.models.llama as llama_mod  # noqa: E402
from tokenmill.settings.config import EngineConfig  # noqa: E402
from tokenmill.engine.engine import LLMEngine  # noqa: E402
from tokenmill.engine.request import SamplingParams  # noqa: E402

# (module or class, attribute, label): what --parts times in mixed steps
PARTS: list[tuple[Any, str, str]] = [
    (llama_mod.Linear, "forward", "linear (LM head included)"),
    (llama_mod.Linear, "forward_add", "linear + residual"),
    (llama_mod.LlamaForCausalLM, "compute_logits", "logits"),
    (attention_mod.CpuKernelStep, "attend", "attention (C kernels)"),
    (attention_mod.TorchPagedStep, "attend", "attention (torch)"),
    (kernels_mod, "rms_norm", "rms_norm"),
    (kernels_mod, "silu_mul", "silu_mul"),
    (kernels_mod, "rope_", "rope"),
    (kernels_mod, "store_kv", "kv store"),
]


class PartTimer:
    """Wall time per labelled function, summed while ``on``."""

    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self.on = False

    def wrap(self, owner: Any, name: str, label: str) -> None:
        fn: Callable[..., Any] | None = getattr(owner, name, None)
        if fn is None:  # an older checkout (interleaved A/B runs) may lack the piece
            return

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start

        setattr(owner, name, timed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--parts", action="store_true", help="time the mixed steps' parts")
    args = ap.parse_args(argv)

    timer = PartTimer()
    if args.parts:
        for owner, name, label in PARTS:
            timer.wrap(owner, name, label)
    config = EngineConfig.from_options(model=args.model, dtype=args.dtype, max_num_seqs=args.streams,
                                       kv_cache_memory=args.kv_cache_memory)
    engine = LLMEngine(config)
    prompts = make_prompts(engine.tokenizer, args.streams + 1, args.input_len)
    engine.add_request("warm-up", prompts[-1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for i in range(args.streams):
        engine.add_request(str(i), prompts[i], params)

    kinds: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0])
    by_batch: dict[int, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0])
    preempted_before = engine.total_preemptions
    start = time.perf_counter()
    while engine.has_unfinished():
        before = collections.Counter(timer.seconds)
        t0 = time.perf_counter()
        timer.on = args.parts
        engine.step()
        timer.on = False
        took = time.perf_counter() - t0
        stats = engine.last_step
        kind = "mixed" if stats.num_prefill_tokens else "decode"
        if kind == "decode":  # the parts table is of mixed steps
            timer.seconds = before
        row = kinds[kind]
        row[0] += 1
        row[1] += took
        row[2] += stats.num_tokens
        if kind == "decode":
            b = by_batch[stats.num_tokens // 8 * 8]
            b[0] += 1
            b[1] += took
            b[2] += stats.num_tokens
    wall = time.perf_counter() - start

    produced = args.streams * args.output_len
    print(f"# serving_replay: {args.streams} x {args.input_len}-token prompts, {args.output_len} out, {args.dtype}, "
          f"KV pool {args.kv_cache_memory} ({engine.pool.num_blocks} blocks), load {os.getloadavg()[0]:.2f}")
    print(f"wall {wall:.2f} s, {produced / wall:.1f} output tok/s, "
          f"preemptions {engine.total_preemptions - preempted_before}")
    print("\n| steps | count | seconds | ms a step | tokens a step |\n|---|---|---|---|---|")
    for kind, (count, secs, tokens) in kinds.items():
        print(f"| {kind} | {count} | {secs:.2f} | {1000 * secs / count:.1f} | {tokens / count:.1f} |")
    print("\n| decode-only batch | steps | seconds | ms a token |\n|---|---|---|---|")
    for low in sorted(by_batch):
        count, secs, tokens = by_batch[low]
        print(f"| {low}-{low + 7} | {count} | {secs:.2f} | {1000 * secs / tokens:.2f} |")
    if args.parts:
        count, secs, _ = kinds["mixed"]
        print("\n| part of the mixed steps | ms a step | share |\n|---|---|---|")
        for label, spent in timer.seconds.most_common():
            print(f"| {label} | {1000 * spent / count:.1f} | {100 * spent / secs:.0f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

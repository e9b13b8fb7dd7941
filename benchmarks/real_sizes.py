"""Decode and prefill speed at real models' sizes, tokenmill against llama.cpp, in one run.

The bundled model is small enough to sit in cache-friendly sizes; a real 1B-8B model is
bound by memory bandwidth instead. This script writes a random-weight GGUF file in a real
model's shape (``--shape``: TinyLlama-1.1B, a 3B or an 8B Llama shape; ``tiny`` for a quick
check of the script itself) with the bundled SmolLM2's tokenizer (copied from its GGUF
metadata, so both engines load the file), in ``--qtype`` blocks (Q4_0, Q5_0, Q8_0, Q4_K_M or Q5_K_M:
Q4_K or Q5_K with Q6_K for the output head and about half the layers' ``attn_v``/``ffn_down``,
as llama.cpp's mixes have them), into
a temporary folder that is deleted afterwards.

Rows, on the same file and the same number of threads, measured in rounds (each engine
once per round, best of ``--repeats``, as ``decode_speed.py`` does):

* tokenmill with ``--quantization auto`` (what ``serve`` picks) and ``gguf`` (the file's
  own blocks);
* llama.cpp through llama-cpp-python (``--llamacpp-path`` to import it from a folder), or
  through its own ``llama-bench`` binary (``--llama-bench PATH``: prefill from an empty
  context, decode at a depth of the prompt's length, ``-d``), which keeps llama.cpp's
  repacked weight layouts, or through ``llama-server`` (``--llama-server PATH``: one request a
  round, its prompt prefilled once and decoded on at its depth, from the server's own timings).

tokenmill's rows, like llama.cpp's, decode at the prompt's depth: one request, its prompt's
steps (to the first token) for prefill, its next ``--decode-len`` steps for decode.

``--kv-cache-dtypes auto,int8`` adds a tokenmill row per KV pool dtype (the pool a long
context reads every step). With ``--prefill-len 16384`` the rows are a long prompt's: its
prefill (TTFT = 16384 / the prefill rate), then decode at that context; ``--llama-server``
then saves llama-bench's second prefill of the prompt.

Each row gives prefill tok/s for a ``--prefill-len``-token prompt and decode tok/s, both
as a ratio against llama.cpp, and decode as a fraction of the bandwidth limit: the rate
the same threads read a 1 GiB buffer (``memory_bandwidth.read_bandwidth``, measured at the
start of every round: a VM's bandwidth drifts with its neighbours, by up to 2x within
minutes; the highest reading is the limit, so the fraction errs low) divided by the bytes of
weights one decode token reads (every tensor of the file except the token embedding, of
which one row is read).

    .venv/bin/python benchmarks/real_sizes.py --shape 1.1b --qtype Q4_0 --llamacpp-path /work/llamacpp
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode_speed  # noqa: E402  (its OpenMP note and measure())
import memory_bandwidth  # noqa: E402
import torch  # noqa: E402

from tokenmill.files.bundled import default_model_path  # noqa: E402
from tokenmill.settings.config import EngineConfig  # noqa: E402
from tokenmill.engine.engine import LLMEngine  # noqa: E402


@dataclass(frozen=True)
class Shape:
    """A Llama-family model's sizes (the vocabulary is the bundled tokenizer's)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int


SHAPES = {
    "tiny": Shape(256, 768, 2, 4, 2),
    "1.1b": Shape(2048, 5632, 22, 32, 4),  # TinyLlama-1.1B
    "3b": Shape(3072, 8192, 28, 24, 8),  # Llama-3.2-3B
    "8b": Shape(4096, 14336, 32, 32, 8),  # Llama-3.1-8B
}

# bytes per block and elements per block of each type written here
_BLOCKS = {"Q4_0": (18, 32), "Q5_0": (22, 32), "Q8_0": (34, 32), "Q4_K": (144, 256), "Q5_K": (176, 256), "Q6_K": (210, 256)}


# the block types and mixes write_model takes (--qtype)
QTYPES = ("Q4_0", "Q5_0", "Q4_K_M", "Q5_K_M", "Q8_0")
# the K-quant mixes written here and the block type of their bulk
_K_MIXES = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}


def _qtype_of(gguf_name: str, mix: str, layers: int) -> str:
    """A tensor's block type in the file. Q4_K_M and Q5_K_M as llama.cpp's quantizer mixes
    them: Q6_K for the output head, and for ``attn_v`` and ``ffn_down`` in the layers it gives
    more bits (the first and last eighth, and every third between), the mix's own type (Q4_K,
    Q5_K) for everything else."""
    if mix not in _K_MIXES:
        return mix
    base = _K_MIXES[mix]
    if gguf_name == "output.weight":
        return "Q6_K"
    if gguf_name.endswith(("attn_v.weight", "ffn_down.weight")):
        i = int(gguf_name.split(".")[1])
        more_bits = i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2
        return "Q6_K" if more_bits else base
    return base


def _random_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random codes with finite fp16 scales that keep weights near +-0.05, so activations
    stay finite through every layer (the values do not matter for speed, NaNs would)."""
    nbytes, per = _BLOCKS[qtype]
    if qtype in ("Q4_K", "Q5_K", "Q6_K"):
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from gguf_files import random_kquant_blocks
        return random_kquant_blocks(qtype, rows, cols, rng)
    blocks = rng.integers(0, 256, size=(rows, cols // per, nbytes), dtype=np.uint8)
    scale = {"Q4_0": 6e-3, "Q5_0": 3e-3, "Q8_0": 4e-4}[qtype]
    d = (scale * rng.uniform(0.5, 1.5, size=(rows, cols // per))).astype(np.float16)
    blocks[..., 0:2] = d[..., None].view(np.uint8).reshape(rows, cols // per, 2)
    return blocks.reshape(rows, -1)


def write_model(path: str, shape: Shape, mix: str, seed: int = 0, context: int = 4096) -> int:
    """Write the file (its context length ``context``); returns the bytes one decode token reads
    (all weights but the embedding table, plus one row of it)."""
    import gguf
    from gguf import GGMLQuantizationType as QT

    source = gguf.GGUFReader(default_model_path())
    vocab = 0
    w = gguf.GGUFWriter(path, "llama")
    for name, field in source.fields.items():
        if name.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            w.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
            if name == "tokenizer.ggml.tokens":
                vocab = len(field.data)
    assert vocab, "the bundled GGUF has no tokenizer.ggml.tokens"
    head_dim = shape.hidden // shape.heads
    w.add_block_count(shape.layers)
    w.add_context_length(context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.intermediate)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(2)  # llama.cpp only reads it for display
    rng = np.random.default_rng(seed)
    read_per_token = 0
    h, kv = shape.hidden, shape.kv_heads * head_dim

    def matrix(name: str, rows: int, cols: int) -> None:
        nonlocal read_per_token
        qtype = _qtype_of(name, mix, shape.layers)
        if name == "token_embd.weight" and qtype in ("Q4_K", "Q5_K", "Q6_K"):
            qtype = _K_MIXES[mix]
        blocks = _random_blocks(qtype, rows, cols, rng)
        w.add_tensor(name, blocks, raw_dtype=QT[qtype])
        read_per_token += blocks[0].nbytes if name == "token_embd.weight" else blocks.nbytes

    def norm(name: str) -> None:
        nonlocal read_per_token
        w.add_tensor(name, np.ones(h, dtype=np.float32))
        read_per_token += h * 4

    matrix("token_embd.weight", vocab, h)
    for i in range(shape.layers):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", h, h)
        matrix(f"blk.{i}.attn_k.weight", kv, h)
        matrix(f"blk.{i}.attn_v.weight", kv, h)
        matrix(f"blk.{i}.attn_output.weight", h, h)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", shape.intermediate, h)
        matrix(f"blk.{i}.ffn_up.weight", shape.intermediate, h)
        matrix(f"blk.{i}.ffn_down.weight", h, shape.intermediate)
    norm("output_norm.weight")
    matrix("output.weight", vocab, h)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return read_per_token


def kv_pool_mib(shape: Shape, tokens: int) -> int:
    """A KV pool for one sequence of ``tokens`` (float32 rows, the widest a pool holds), at least
    256 MiB: long prompts (``--prefill-len 16384``) fit."""
    per_token = shape.layers * 2 * shape.kv_heads * (shape.hidden // shape.heads) * 4
    return max(256, -(-tokens * per_token // 2**20))


def tokenmill_runner(path: str, quantization: str, kv_dtype: str, args: argparse.Namespace) -> decode_speed.Runner:
    engine = LLMEngine(EngineConfig.from_options(
        model=path, dtype="auto", quantization=quantization, kv_cache_dtype=kv_dtype, enable_prefix_caching=False,
        kv_cache_memory=f"{kv_pool_mib(SHAPES[args.shape], args.prefill_len + args.decode_len + 256)}MiB",
        max_num_batched_tokens=max(1024, args.prefill_len)))
    print(f"# tokenmill --quantization {quantization} --kv-cache-dtype {kv_dtype}: runs dtype {engine.config.dtype}, "
          f"quantization {engine.config.quantization}, KV pool {engine.config.cache.kv_cache_dtype}", flush=True)
    torch.set_num_threads(args.threads)

    def run(seed: int) -> tuple[float, float]:
        return decode_speed.measure(engine, args.prefill_len, args.decode_len, seed)

    decode_speed.measure(engine, 16, 4, seed=99)  # warm-up
    return run


def llama_server_runner(path: str, args: argparse.Namespace) -> tuple[decode_speed.Runner, Callable[[], None]]:
    """llama.cpp's ``llama-server`` on the file with one slot, and a function that stops it. Each
    call sends one ``/completion`` of ``--prefill-len`` random token ids for ``--decode-len`` new
    tokens (greedy, ``ignore_eos``, prompt cache off) and reads the server's own timings:
    prefill tok/s (``prompt_per_second``) and decode tok/s at the prompt's depth
    (``predicted_per_second``). A long prompt is prefilled once a round, where llama-bench's
    decode at depth (``-d``) prefills it again first."""
    import random

    import httpx
    from llama_server import Server, _free_port

    port = _free_port()
    server = Server("llama-server", [args.llama_server, "-m", path, "--host", "127.0.0.1", "--port", str(port),
                                     "-t", str(args.threads), "-tb", str(args.threads), "--parallel", "1",
                                     "-c", str(args.prefill_len + args.decode_len + 64), "--no-webui",
                                     *shlex.split(args.llama_server_args)], port, env=decode_speed.llama_cpp_env())
    server.start()

    def run(seed: int) -> tuple[float, float]:
        rng = random.Random(seed)
        prompt = [rng.randrange(100, 40000) for _ in range(args.prefill_len)]
        body = {"prompt": prompt, "n_predict": args.decode_len, "ignore_eos": True, "cache_prompt": False,
                "temperature": 0.0, "top_k": 1}
        r = httpx.post(server.url + "/completion", json=body, timeout=7200.0, trust_env=False)
        r.raise_for_status()
        timings = r.json()["timings"]
        assert timings["prompt_n"] == args.prefill_len, timings
        return float(timings["prompt_per_second"]), float(timings["predicted_per_second"])

    return run, server.stop


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1.1b")
    ap.add_argument("--qtype", choices=QTYPES, default="Q4_0")
    ap.add_argument("--quantizations", default="auto,gguf", help="tokenmill rows, comma-separated")
    ap.add_argument("--kv-cache-dtypes", default="auto",
                    help="tokenmill's KV pool dtypes, comma-separated (a row for each with each quantization)")
    ap.add_argument("--prefill-len", type=int, default=128)
    ap.add_argument("--decode-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="threads for both engines (0: all cores)")
    ap.add_argument("--llamacpp-path", default="", help="folder holding a llama_cpp package to import first")
    ap.add_argument("--skip-llamacpp", action="store_true", help="tokenmill rows only (no ratios)")
    ap.add_argument("--llamacpp-no-extra-bufts", action="store_true",
                    help="llama.cpp without its extra weight buffers (AMX, repacked layouts)")
    ap.add_argument("--llama-bench", default="",
                    help="llama.cpp's llama-bench binary: the llama.cpp row from it instead of llama-cpp-python")
    ap.add_argument("--llama-bench-args", default="", help="extra llama-bench flags, e.g. \"--repack 0\"")
    ap.add_argument("--llama-server", default="",
                    help="llama.cpp's llama-server binary: the llama.cpp row from one request a round "
                         "(one prefill, then decode at its depth: long prompts)")
    ap.add_argument("--llama-server-args", default="", help="extra llama-server flags")
    args = ap.parse_args(argv)
    args.threads = args.threads or torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="tokenmill-real-sizes-") as tmp:
        path = os.path.join(tmp, f"{args.shape}-{args.qtype}.gguf")
        t = time.perf_counter()
        per_token = write_model(path, SHAPES[args.shape], args.qtype,
                                context=max(4096, args.prefill_len + args.decode_len + 64))
        print(f"# real_sizes: shape {args.shape}, {args.qtype}, file {os.path.getsize(path) / 2**20:.0f} MiB "
              f"(written in {time.perf_counter() - t:.0f} s), {per_token / 2**20:.0f} MiB read per decode token, "
              f"threads {args.threads}, prefill {args.prefill_len}, decode {args.decode_len}, best of "
              f"{args.repeats}, load {os.getloadavg()[0]:.2f}", flush=True)
        runners: list[tuple[str, decode_speed.Runner]] = [
            (f"tokenmill --quantization {q}" + (f" --kv-cache-dtype {kv}" if kv != "auto" else ""),
             tokenmill_runner(path, q, kv, args))
            for q in args.quantizations.split(",") for kv in args.kv_cache_dtypes.split(",")]
        stop_llama_server: Callable[[], None] = lambda: None
        kind = "llama-server" if args.llama_server else "llama-bench" if args.llama_bench else "llama-cpp-python"
        if args.skip_llamacpp:
            lc: decode_speed.Runner | str = "skipped (--skip-llamacpp)"
        elif args.llama_server:
            lc, stop_llama_server = llama_server_runner(path, args)
        elif args.llama_bench:
            lc = decode_speed.llama_bench_runner(path, args)
        else:
            lc = decode_speed.llamacpp_runner(args, args.threads, model_path=path)
        if not isinstance(lc, str):
            runners.append((f"llama.cpp ({kind})", lc))
        best = {name: (0.0, 0.0) for name, _ in runners}
        readings: list[float] = []
        try:
            for seed in range(args.repeats):  # rounds: every engine once per round
                readings.append(memory_bandwidth.read_bandwidth(args.threads))
                for name, run in runners:
                    p, d = run(seed)
                    best[name] = (max(best[name][0], p), max(best[name][1], d))
        finally:
            stop_llama_server()
        bw = max(readings)
        print(f"read bandwidth, {args.threads} threads, at each round's start: "
              f"{', '.join(f'{r / 1e9:.1f}' for r in readings)} GB/s -> limit {bw / per_token:.1f} tok/s "
              f"({bw / 1e9:.1f} GB/s over {per_token / 2**20:.0f} MiB a token)")
        lc_p, lc_d = best[runners[-1][0]] if not isinstance(lc, str) else (None, None)
        ratio = decode_speed.ratio
        print("| engine | prefill tok/s | vs llama.cpp | decode tok/s | vs llama.cpp | of bandwidth limit |")
        print("|---|---|---|---|---|---|")
        for name, _ in runners:
            p, d = best[name]
            print(f"| {name} | {p:.0f} | {ratio(p, lc_p)} | {d:.1f} | {ratio(d, lc_d)} | {d * per_token / bw:.0%} |")
        if isinstance(lc, str):
            print(f"llama.cpp rows skipped: {lc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

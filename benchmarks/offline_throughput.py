"""Offline throughput: tokenmill's continuous batching vs transformers' generate.

Workload: 64 prompts of ~256 tokens, 64 output tokens each (ignore EOS), the
bundled SmolLM2 in the chosen dtype. Baseline, measured in the same run:
transformers `generate` on the same dequantized weights with static batches
of 32, left padding. Prints output tokens/s for both and the ratio, plus
tokenmill's single-request decode tokens/s.

    .venv/bin/python benchmarks/offline_throughput.py [--dtype float32] [--num-prompts 64]
"""
from __future__ import annotations

import argparse
import os
import random
import time

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.files.bundled import default_model_path
from tokenmill.model.loader import load_model
from tokenmill.files.tokenizer import Tokenizer

WORDS = ("river stone lantern harbor winter orchard signal copper meadow engine valley "
         "thunder paper garden market silver bridge forest candle window").split()


def make_prompts(tokenizer: Tokenizer, count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        text = f"Story {i}: " + " ".join(rng.choice(WORDS) for _ in range(length * 2))
        prompts.append(tokenizer.encode(text)[:length])
    return prompts


def run_tokenmill(llm: LLM, prompts: list[list[int]], out_len: int) -> tuple[float, int]:
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def run_transformers(path: str, dtype: torch.dtype, prompts: list[list[int]], out_len: int,
                     batch_size: int) -> tuple[float, int]:
    import transformers

    folder, name = os.path.split(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=dtype,
        quantization_config=transformers.GgufConfig(gguf_file=name, dequantize=True)).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    produced = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        group = prompts[i : i + batch_size]
        width = max(map(len, group))
        ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(group):  # left padding
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=out_len, min_new_tokens=out_len,
                                 do_sample=False)
        produced += (out.shape[1] - width) * len(group)
    return time.perf_counter() - start, produced


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    path = default_model_path()
    dtype = torch.bfloat16 if args.dtype in ("bfloat16", "bf16") else torch.float32
    tokenizer = Tokenizer.from_gguf(path)
    prompts = make_prompts(tokenizer, args.num_prompts, args.prompt_len)
    llm = LLM(loaded_model=load_model(path, dtype=dtype), tokenizer=tokenizer, dtype=args.dtype,
              kv_cache_memory="2GiB", max_num_seqs=64, enable_prefix_caching=False)
    run_tokenmill(llm, prompts[:2], 4)  # warm-up
    tm_time, tm_tokens = run_tokenmill(llm, prompts, args.output_len)
    single_time, single_tokens = run_tokenmill(llm, prompts[:1], 128)
    hf_time, hf_tokens = run_transformers(path, dtype, prompts, args.output_len, args.hf_batch)
    tm_tps, hf_tps = tm_tokens / tm_time, hf_tokens / hf_time
    print(f"workload: {args.num_prompts} prompts x {args.prompt_len} tokens, {args.output_len} output tokens, "
          f"dtype {args.dtype}, {torch.get_num_threads()} threads")
    print(f"tokenmill (continuous batching)     : {tm_tps:8.1f} output tok/s  ({tm_time:.1f} s)")
    print(f"transformers generate (static b={args.hf_batch}): {hf_tps:8.1f} output tok/s  ({hf_time:.1f} s)  [baseline]")
    print(f"ratio tokenmill / transformers      : {tm_tps / hf_tps:8.2f}x")
    print(f"tokenmill single-request decode     : {single_tokens / single_time:8.1f} tok/s "
          f"(incl. a {args.prompt_len}-token prefill)")


if __name__ == "__main__":
    main()

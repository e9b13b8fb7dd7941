"""The one prepared GPU check (issue 9): greedy parity and throughput on a device.

Meant for a session lent a GPU for a few minutes: one command, one JSON
summary. On ``--device cpu`` it runs the same steps here (a dry run that keeps
the script working between GPU sessions; ``--quick`` shrinks it).

1. Parity: the bundled SmolLM2 in float32 on the device against transformers
   in float32 on the CPU (the reference; same GGUF, dequantized by both):
   greedy tokens for ``--parity-prompts`` prompts, ``--parity-tokens`` each,
   and the largest logit difference at the last prompt position.
2. Offline throughput on the device in ``--dtype`` (default bfloat16): many
   prompts at once through ``LLM.generate``; output tokens/s.
3. Single-stream decode on the device: tokens/s of one greedy request after
   a short prompt (first token excluded).

    python benchmarks/cuda_check.py                      # on a GPU machine
    python benchmarks/cuda_check.py --device cpu --quick  # dry run here
    python benchmarks/cuda_check.py --out $OUT/cuda.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.model.bundled import default_model_path
from tokenmill.model.loader import load_model
from tokenmill.tokenizer import Tokenizer

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "List three colors of the rainbow:\n1.",
    "Once upon a time, in a small village by the sea,",
    "The three laws of thermodynamics are",
    "Q: What is 17 times 23?\nA:",
    "A haiku about autumn leaves:\n",
    "import numpy as np\n\n# compute the mean of each column\n",
]


def reference_model(path: str):  # type: ignore[no-untyped-def]
    import transformers

    folder, name = os.path.split(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32,
        quantization_config=transformers.GgufConfig(gguf_file=name, dequantize=True)).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def parity(args: argparse.Namespace, path: str, tokenizer: Tokenizer) -> dict:
    loaded = load_model(path, dtype=torch.float32)
    llm = LLM(loaded_model=loaded, tokenizer=tokenizer, dtype="float32", device=args.device,
              kv_cache_memory="512MiB")
    ref = reference_model(path)
    prompts = [tokenizer.encode(p) for p in PROMPTS[: args.parity_prompts]]
    params = SamplingParams(temperature=0.0, max_tokens=args.parity_tokens, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params)
    matched, first_diff, max_logit_diff = 0, [], 0.0
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            t = torch.tensor([ids])
            want = ref.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=args.parity_tokens,
                                do_sample=False)[0, len(ids):].tolist()
        got = out.outputs[0].token_ids
        matched += got == want
        first_diff.append(next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None))
    # Last-prompt-position logits, engine on the device vs reference on the CPU.
    engine = llm.engine
    for ids in prompts:
        with torch.no_grad():
            ref_logits = ref(torch.tensor([ids])).logits[0, -1].float()
        one = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=20))[0]
        lp = one.outputs[0].logprobs[0]
        ref_lp = torch.log_softmax(ref_logits, -1)
        for token_id, value in lp.top.items():
            max_logit_diff = max(max_logit_diff, abs(value - float(ref_lp[token_id])))
    del engine
    return {"prompts": len(prompts), "tokens_each": args.parity_tokens, "identical": matched,
            "first_divergence": first_diff, "max_logprob_diff_top20": max_logit_diff}


def throughput(args: argparse.Namespace, path: str, tokenizer: Tokenizer) -> dict:
    llm = LLM(model=path, dtype=args.dtype, device=args.device, kv_cache_memory=args.kv_cache_memory,
              max_num_seqs=args.num_prompts)
    rng = random.Random(0)
    vocab = tokenizer.vocab_size
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True))
    elapsed = time.perf_counter() - t
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    # Single stream: time from the first token to the last.
    engine = llm.engine
    engine.add_request("single", prompts[0][:32], SamplingParams(temperature=0.0, max_tokens=args.single_tokens + 1,
                                                                 ignore_eos=True))
    engine.step()
    t1, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    single = steps / (time.perf_counter() - t1)
    return {"dtype": args.dtype, "prompts": args.num_prompts, "prompt_len": args.prompt_len,
            "output_len": args.output_len, "seconds": round(elapsed, 3), "output_tok_s": round(produced / elapsed, 1),
            "single_stream_decode_tok_s": round(single, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", help="throughput runs (parity is always float32)")
    ap.add_argument("--parity-prompts", type=int, default=8)
    ap.add_argument("--parity-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--single-tokens", type=int, default=128)
    ap.add_argument("--kv-cache-memory", default="8GiB")
    ap.add_argument("--quick", action="store_true", help="small sizes (the CPU dry run)")
    ap.add_argument("--out", default=None, help="also write the JSON summary here")
    args = ap.parse_args(argv)
    if args.quick:
        args.parity_prompts, args.parity_tokens = 2, 8
        args.num_prompts, args.prompt_len, args.output_len, args.single_tokens = 4, 32, 8, 8
        args.kv_cache_memory = "256MiB"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("cuda_check: no CUDA device here (torch.cuda.is_available() is False); "
              "use --device cpu for a dry run", file=sys.stderr)
        return 2
    path = default_model_path()
    tokenizer = Tokenizer.from_gguf(path)
    summary: dict = {"device": args.device, "torch": torch.__version__}
    if args.device.startswith("cuda"):
        summary["gpu"] = torch.cuda.get_device_name()
    summary["parity_float32"] = parity(args, path, tokenizer)
    summary["throughput"] = throughput(args, path, tokenizer)
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    ok = summary["parity_float32"]["identical"] == summary["parity_float32"]["prompts"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Mixture-of-experts throughput: a tiny-expert Qwen3-MoE model (random weights, made with
transformers' own class) at N concurrent streams, the serve default (``--dtype auto
--quantization auto``) against its own float32 reference, in one run.

    .venv/bin/python benchmarks/moe_throughput.py [--streams 64] [--out-len 32]

Prints output tokens/s of both configurations, what auto chose, and the ratio.
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.model.loader import load_model


def make_model(folder: str, layers: int, experts: int, top_k: int, hidden: int, expert_width: int) -> None:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=8192, hidden_size=hidden, intermediate_size=4 * expert_width, moe_intermediate_size=expert_width,
        num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
        head_dim=64, num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True,
        max_position_embeddings=2048, tie_word_embeddings=False)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(folder)


def run(llm: LLM, prompts: list[list[int]], out_len: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # warm up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--out-len", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--expert-width", type=int, default=256)
    args = ap.parse_args()
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers import models

    from tokenmill.files.tokenizer import Tokenizer

    tokenizer = Tokenizer(FastTokenizer(models.WordLevel({f"t{i}": i for i in range(8192)}, unk_token="t0")),
                          bos_token_id=None, eos_token_id=None, vocab_size=8192)
    rng = random.Random(0)
    prompts = [[rng.randrange(8192) for _ in range(args.prompt_len)] for _ in range(args.streams)]
    with tempfile.TemporaryDirectory() as folder:
        make_model(folder, args.layers, args.experts, args.top_k, args.hidden, args.expert_width)
        loaded = load_model(folder)
    results = {}
    for label, options in (("float32 reference", dict(dtype="float32", quantization="none")),
                           ("serve default (auto)", dict(dtype="auto", quantization="auto"))):
        llm = LLM(loaded_model=loaded, tokenizer=tokenizer, max_num_seqs=args.streams,
                  kv_cache_memory="512MiB", **options)
        chosen = f"dtype={llm.engine.dtype}, quantization={llm.engine.config.quantization}"
        results[label] = run(llm, prompts, args.out_len)
        print(f"{label:22s} {results[label]:8.1f} tokens/s  ({chosen})", flush=True)
        del llm
    print(f"ratio: {results['serve default (auto)'] / results['float32 reference']:.2f}x "
          f"({args.streams} streams, {args.experts} experts of {args.expert_width}, top-{args.top_k})")


if __name__ == "__main__":
    main()

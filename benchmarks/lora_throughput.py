"""Multi-LoRA throughput: streams spread over several adapters against the same streams on the base.

    python benchmarks/lora_throughput.py                    # bundled model, 64 streams, 8 adapters of rank 16
    python benchmarks/lora_throughput.py --quantization none --max-tokens 16 --threads 1

One engine with ``enable_lora``; random adapters in the PEFT format (every projection targeted,
written to a temporary folder). Two runs in the same process, interleaved ``--rounds`` times: 64
streams on the base model, then 64 streams with stream i on adapter i mod 8 (so each step mixes
all 8 adapters). Figures: output tokens per second of each, and their ratio (adapters / base).
Steps with adapter rows run in the fused CPU step like the base's (engine/step/fused_lora.py); with
TOKENMILL_FUSED_DECODE=0 both run on the eager path.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, cfg, rank: int, seed: int) -> None:
    """A random PEFT adapter for every projection of every layer."""
    g = torch.Generator().manual_seed(seed)
    hd = cfg.head_dim
    shapes = {"q_proj": (cfg.hidden_size, cfg.num_attention_heads * hd),
              "k_proj": (cfg.hidden_size, cfg.num_key_value_heads * hd),
              "v_proj": (cfg.hidden_size, cfg.num_key_value_heads * hd),
              "o_proj": (cfg.num_attention_heads * hd, cfg.hidden_size),
              "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
              "up_proj": (cfg.hidden_size, cfg.intermediate_size),
              "down_proj": (cfg.intermediate_size, cfg.hidden_size)}
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for proj, (fan_in, fan_out) in shapes.items():
            part = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}))


def run(llm: LLM, prompts: list[str], params: SamplingParams, lora: list[str | None] | None) -> float:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora=lora)
    elapsed = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: the bundled model)")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: every core)")
    args = p.parse_args()

    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, enable_lora=True,
              max_loras=args.adapters, max_lora_rank=args.rank, enable_prefix_caching=False,
              max_num_seqs=args.streams, num_threads=args.threads)
    cfg = llm.engine.model_config
    rng = random.Random(0)
    words = "the a report ships order plan river city light music table number story garden".split()
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(8, 24))) for _ in range(args.streams)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        names = []
        for i in range(args.adapters):
            folder = Path(tmp) / f"adapter{i}"
            write_adapter(folder, cfg, args.rank, seed=i)
            names.append(f"adapter{i}")
            llm.load_lora(names[-1], str(folder))
        lora = [names[i % len(names)] for i in range(args.streams)]
        run(llm, prompts[:4], params, None)  # warm-up (kernels, first allocations)
        run(llm, prompts[:4], params, lora[:4])
        base, mixed = [], []
        for _ in range(args.rounds):
            base.append(run(llm, prompts, params, None))
            mixed.append(run(llm, prompts, params, lora))
    b, m = statistics.median(base), statistics.median(mixed)
    print(f"config: {llm.engine.config.quantization}, dtype {llm.engine.config.dtype}, "
          f"{args.streams} streams x {args.max_tokens} tokens, {args.adapters} adapters of rank {args.rank}")
    print(f"steps run on: {', '.join(e.name for e in llm.engine.runner.executors)}")
    print(f"base:     {b:8.1f} tok/s  (rounds: {', '.join(f'{x:.1f}' for x in base)})")
    print(f"adapters: {m:8.1f} tok/s  (rounds: {', '.join(f'{x:.1f}' for x in mixed)})")
    print(f"ratio adapters / base: {m / b:.2f}")
    llm.close()


if __name__ == "__main__":
    main()

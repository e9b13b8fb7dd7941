"""Speculative decoding (n-gram proposals) against plain decoding, one user, in one run.

Two workloads on the bundled model, greedy, one request at a time:

* input-grounded: the chat model is asked to rewrite a given paragraph with
  one detail changed, so its answer repeats long spans of the prompt (where
  prompt lookup pays off);
* random text: prompts of random words, where few n-grams repeat (what the
  back-off has to keep cheap).

Each workload runs on an engine with ``--speculative-config`` and on one
without (the baseline), alternating in rounds so a slow spell of this shared
host falls on both alike; the best round of each is kept. Prints output
tokens/s with and without, their ratio, the acceptance rate, and whether the
greedy texts are identical.

    .venv/bin/python benchmarks/speculative.py [--rounds 3] [--max-tokens 128] [--k 4]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

from tokenmill import LLM, SamplingParams

PARAGRAPHS = [
    "The old lighthouse stood at the edge of the cliff for more than a hundred years. Every night its keeper "
    "climbed the narrow stairs, cleaned the great lens, and lit the lamp so that the fishing boats could find "
    "their way home through the fog. The keeper's cat followed him up the stairs each evening and slept beside "
    "the lamp until morning.",
    "Our team meets every Monday at nine in the small conference room on the second floor. We review the "
    "tickets from the previous week, agree on the priorities for the coming days, and write the plan on the "
    "whiteboard. Anyone who cannot attend sends a short written update to the team channel before the meeting.",
    "To bake the bread, mix the flour, water, salt and yeast in a large bowl until no dry flour remains. Cover "
    "the bowl and let the dough rest for two hours at room temperature. Then shape it into a round loaf, place "
    "it in a hot oven, and bake it for forty minutes until the crust is deep brown.",
]
CHANGES = ["the cat with a dog", "Monday with Tuesday", "two hours with three hours"]
WORDS = ("archive ledger harbor copper meadow lantern orchard signal valley winter thunder garden market silver "
         "bridge forest candle window engine river stone paper").split()


def grounded_prompts(llm: LLM) -> list[str]:
    tok = llm.engine.tokenizer
    out = []
    for text, change in zip(PARAGRAPHS, CHANGES):
        messages = [{"role": "user", "content": f"Rewrite the following paragraph, replacing {change}. Keep "
                     f"everything else exactly the same.\n\n{text}"}]
        out.append(tok.apply_chat_template(messages, add_generation_prompt=True))
    return out


def random_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(60)) for _ in range(n)]


def run(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[float, list[list[int]]]:
    """Output tokens/s over the prompts sent one at a time, and the texts."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    tokens = 0
    texts = []
    elapsed = 0.0
    for p in prompts:
        t = time.perf_counter()
        out = llm.generate([p], params)[0].outputs[0]
        elapsed += time.perf_counter() - t
        tokens += len(out.token_ids)
        texts.append(out.token_ids)
    return tokens / elapsed, texts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default="none")
    args = ap.parse_args(argv)
    spec_cfg = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max,
                "prompt_lookup_min": 2}
    common = dict(dtype=args.dtype, quantization=args.quantization, enable_prefix_caching=False,
                  kv_cache_memory="256MiB")
    plain = LLM(**common)
    spec = LLM(speculative_config=spec_cfg, **common)
    workloads = {"input-grounded": grounded_prompts(plain), "random text": random_prompts(3)}
    print(f"# speculative: {json.dumps(spec_cfg)}, {args.dtype}/{args.quantization}, {args.max_tokens} tokens, "
          f"best of {args.rounds} rounds, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    print("| workload | plain tok/s (baseline) | speculative tok/s | ratio | acceptance | identical |")
    print("|---|---|---|---|---|---|")
    for name, prompts in workloads.items():
        best_plain = best_spec = 0.0
        stats = spec.engine.speculator.stats
        drafted0, accepted0 = stats.num_draft_tokens, stats.num_accepted_tokens
        same = True
        for _ in range(args.rounds):
            rate, want = run(plain, prompts, args.max_tokens)
            best_plain = max(best_plain, rate)
            rate, got = run(spec, prompts, args.max_tokens)
            best_spec = max(best_spec, rate)
            same &= got == want
        drafted = stats.num_draft_tokens - drafted0
        accepted = stats.num_accepted_tokens - accepted0
        acc = accepted / drafted if drafted else 0.0
        print(f"| {name} | {best_plain:.1f} | {best_spec:.1f} | {best_spec / best_plain:.2f}x | "
              f"{acc:.0%} of {drafted} | {'yes' if same else 'NO'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

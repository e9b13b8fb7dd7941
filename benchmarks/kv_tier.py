"""The disk tier against recompute, on shared documents that do not fit the pool, in one run.

    python benchmarks/kv_tier.py                     # bundled model, 8 documents of ~900 tokens, 64-block pool

Each document is asked about twice, in two rounds; the pool (``--pool-blocks``) holds about one
document, so by the second round every document was evicted. The baseline is the same engine
without a tier (the second round recomputes). Figures: TTFT (a 1-token answer: the prefill) p50 of
the second round with the tier / without it. Then the tiered engine shuts down cleanly (its pool's
cached blocks go to disk), a new process-like engine opens the same folder, and the first request on
a known document is timed against one on a document never seen (cold): the warm-restart ratio.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from tokenmill import LLM, SamplingParams  # noqa: E402

WORDS = ("parcel order invoice refund carrier depot address weekday customer contract clause warranty "
         "delivery support ticket billing account region service policy").split()


def documents(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"Document {d}. " + " ".join(rng.choice(WORDS) for _ in range(words)) for d in range(n)]


def ttft(llm: LLM, prompt: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))[0]
    return time.perf_counter() - t0, out.num_cached_tokens


def second_round(llm: LLM, docs: list[str]) -> tuple[list[float], list[int]]:
    for d in docs:  # round one: every document computed once
        ttft(llm, d + "\nQuestion 1: what is it about?")
    times, cached = [], []
    for d in docs:
        t, c = ttft(llm, d + "\nQuestion 2: who is it for?")
        times.append(t)
        cached.append(c)
    return times, cached


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--documents", type=int, default=8)
    p.add_argument("--words", type=int, default=450, help="words per document (~2 tokens each)")
    p.add_argument("--pool-blocks", type=int, default=64)
    p.add_argument("--tier-bytes", default="2G")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    docs = documents(args.documents + 1, args.words, args.seed)
    known, cold = docs[:-1], docs[-1]
    common = dict(num_blocks=args.pool_blocks, dtype=args.dtype)
    with tempfile.TemporaryDirectory() as folder:
        recompute = LLM(**common)
        base_times, base_cached = second_round(recompute, known)
        recompute.engine.close()
        del recompute
        tiered = LLM(**common, kv_offload_bytes=args.tier_bytes, kv_offload_dir=folder)
        tier_times, tier_cached = second_round(tiered, known)
        st = tiered.engine.prefix_cache.tier.stats
        stored, restored, restore_s = st.stored_blocks, st.restored_blocks, st.restore_seconds
        tiered.engine.close()
        del tiered
        restarted = LLM(**common, kv_offload_bytes=args.tier_bytes, kv_offload_dir=folder)
        on_disk = restarted.engine.prefix_cache.num_on_disk
        warm, warm_cached = ttft(restarted, known[0] + "\nQuestion 3: when?")
        cold_t, _ = ttft(restarted, cold + "\nQuestion 3: when?")
        restarted.engine.close()
    b50, t50 = statistics.median(base_times), statistics.median(tier_times)
    print(f"{len(known)} documents, pool {args.pool_blocks} blocks, second round (each document evicted since):")
    print(f"  recompute (baseline): TTFT p50 {b50 * 1000:.0f} ms, cached tokens {sum(base_cached)}")
    print(f"  disk tier:            TTFT p50 {t50 * 1000:.0f} ms, cached tokens {sum(tier_cached)} "
          f"({stored} blocks stored, {restored} restored in {restore_s * 1000:.0f} ms)")
    print(f"  disk tier / recompute TTFT p50: {t50 / b50:.2f}x")
    print(f"after a clean restart ({on_disk} blocks found on disk): first request on a known document "
          f"{warm * 1000:.0f} ms ({warm_cached} cached tokens), on a cold one {cold_t * 1000:.0f} ms: "
          f"{warm / cold_t:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Claimed chunks against fixed shares: how the C kernels split work between threads.

The kernels' threads claim chunks of a projection's output rows (and of the decode
step's attention items) as they come free; before, each thread had a fixed share.
On a machine whose cores also run the server's HTTP thread and its clients, a thread
descheduled for a moment then held the others at the next barrier with its share
undone. This script builds the kernels both ways (the default, and
``-DTM_STATIC_SHARES``) and times, on the bundled model under the default
configuration, alternating the two builds round by round:

* ``prefill projections``: the 120 projections of one 512-token prefill (``tm_linear``,
  512 rows each, the engine's own weights);
* ``decode step``: the fused decode step at batch 64, context 300.

Each case runs quiet and with a competing process that keeps a core busy for
``--busy-ms`` of every 10 ms (a stand-in for the server's other threads). Printed:
median ms per build and the claims build's speed-up over the fixed shares (the
baseline, same run).

    .venv/bin/python benchmarks/thread_claims.py [--rounds 6] [--busy-ms 2]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import time

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.engine.step.executors import FusedDecodeExecutor
from tokenmill.model.kernels import cpu_kernels

BUSY_LOOP = """
import sys, time
busy, end = float(sys.argv[1]) / 1000, time.time() + float(sys.argv[2])
while time.time() < end:
    t = time.perf_counter()
    while time.perf_counter() - t < busy:
        pass
    time.sleep(0.010 - busy)
"""


def prefill_projections(llm: LLM) -> list[cpu_kernels.TmLinear]:
    """The layer descriptions one prefill passes to ``tm_linear`` (captured from a real step)."""
    seen: list[cpu_kernels.TmLinear] = []
    linear = cpu_kernels.linear

    def capture(desc, x, library=None):  # type: ignore[no-untyped-def]
        if x.shape[0] > 1:
            seen.append(desc)
        return linear(desc, x, library)

    cpu_kernels.linear = capture
    try:
        llm.generate([[7, 8, 9, 10] * 64], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    finally:
        cpu_kernels.linear = linear
    return seen


def time_projections(lib: cpu_kernels.KernelLibrary, descs: list[cpu_kernels.TmLinear], rows: int) -> float:
    xs = {d.k: torch.randn(rows, d.k) for d in descs}
    ys = {d.n: torch.empty(rows, d.n) for d in descs}
    start = time.perf_counter()
    for d in descs:
        rc = lib.cdll.tm_linear(ctypes.addressof(d), xs[d.k].data_ptr(), d.k, rows, ys[d.n].data_ptr(), d.n,
                                torch.get_num_threads())
        if rc:
            raise RuntimeError(f"tm_linear returned {rc}")
    return time.perf_counter() - start


def time_step(executor: FusedDecodeExecutor, lib: cpu_kernels.KernelLibrary, batch: int, context: int,
              block_size: int, steps: int = 4) -> float:
    decoder = executor.decoder
    width = -(-context // block_size)
    tables = torch.arange(batch * width, dtype=torch.int32).reshape(batch, width).contiguous()
    lens = torch.full((batch,), context, dtype=torch.int32)
    embeddings = torch.randn(batch, decoder.hidden_size)
    own = decoder.lib
    decoder.lib = lib
    try:
        start = time.perf_counter()
        for _ in range(steps):
            decoder.run(embeddings.clone(), tables, lens)
        return (time.perf_counter() - start) / steps
    finally:
        decoder.lib = own


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--busy-ms", type=float, default=2.0, help="the competing process's busy time per 10 ms")
    args = ap.parse_args()

    llm = LLM(None, max_num_seqs=64, kv_cache_memory="2GiB", dtype="auto", quantization="auto")
    engine = llm.engine
    executor = next((e for e in engine.runner.executors if isinstance(e, FusedDecodeExecutor)), None)
    if executor is None:
        print("the default configuration has no fused decode step here (kernels off?)")
        return 1
    builds = {"fixed shares": cpu_kernels.build(("-DTM_STATIC_SHARES",)), "claims": cpu_kernels.build()}
    descs = prefill_projections(llm)
    # the pool must hold 64 sequences of 300 tokens in distinct blocks
    if engine.pool.num_blocks < 64 * -(-300 // engine.block_size):
        print("KV pool too small for the decode case")
        return 1
    cases = {
        f"prefill projections ({len(descs)} x 512 rows)": lambda lib: time_projections(lib, descs, 512),
        "decode step (batch 64, context 300)": lambda lib: time_step(executor, lib, 64, 300, engine.block_size),
    }
    print(f"# thread_claims: threads {torch.get_num_threads()}, cpus {os.cpu_count()}, rounds {args.rounds}, "
          f"load {os.getloadavg()[0]:.2f}, competing process busy {args.busy_ms:g} ms of every 10 ms")
    print("| case | competing load | fixed shares ms (baseline) | claims ms | speed-up |")
    print("|---|---|---|---|---|")
    for loaded in (False, True):
        noise = None
        if loaded:
            noise = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(args.busy_ms), "3600"])
        try:
            for name, run in cases.items():
                for lib in builds.values():
                    run(lib)  # warm-up
                times: dict[str, list[float]] = {b: [] for b in builds}
                for _ in range(args.rounds):
                    for build, lib in builds.items():
                        times[build].append(run(lib))
                base, claims = (statistics.median(times[b]) * 1e3 for b in builds)
                print(f"| {name} | {'yes' if loaded else 'no'} | {base:.1f} | {claims:.1f} | {base / claims:.2f}x |",
                      flush=True)
        finally:
            if noise is not None:
                noise.kill()
                noise.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

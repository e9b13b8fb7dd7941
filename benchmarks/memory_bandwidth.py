"""How fast this machine reads memory: the limit a memory-bound decode step is measured against.

A decode step of a 1B-8B model reads every weight byte once and writes almost nothing, so its
ceiling is the rate at which the given threads can *read* a buffer far larger than the caches.
A torch ``copy_`` (read plus write) or a torch ``sum`` understates that: the copy pays for its
writes (and the reads for ownership they cause), the sum for its arithmetic. This module
compiles a small OpenMP reader with the system gcc (as the kernels are built): each thread
streams its contiguous share of a 1 GiB buffer through wide loads into eight independent OR
accumulators, so the loop waits on memory and nothing else. The median of several passes.

    .venv/bin/python benchmarks/memory_bandwidth.py --threads 2
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

_READER = r"""
#include <stdint.h>
#include <omp.h>
typedef long long v8 __attribute__((vector_size(64)));

/* ORs every 64-byte line of buf[0 .. bytes) into one value (so no load is dead code);
 * each thread its contiguous share, eight accumulators a thread. */
long long tm_read_all(const char *buf, int64_t bytes, int threads) {
    const int64_t lines = bytes / 64;
    long long result = 0;
#pragma omp parallel num_threads(threads) reduction(| : result)
    {
        const int t = omp_get_thread_num(), n = omp_get_num_threads();
        const int64_t lo = lines * t / n, hi = lines * (t + 1) / n;
        v8 acc[8] = {{0}};
        int64_t i = lo;
        for (; i + 8 <= hi; i += 8)
            for (int k = 0; k < 8; k++) acc[k] |= *(const v8 *)(buf + (i + k) * 64);
        for (; i < hi; i++) acc[0] |= *(const v8 *)(buf + i * 64);
        for (int k = 1; k < 8; k++) acc[0] |= acc[k];
        for (int k = 0; k < 8; k++) result |= acc[0][k];
    }
    return result;
}
"""


def compile_probe(source: str, stem: str, flags: tuple[str, ...]) -> ctypes.CDLL:
    """A small C probe compiled with the system gcc (``-O2 -march=native`` and ``flags``), cached
    by its source's hash in the temporary folder: the benchmarks' own measuring code, not the
    kernel library."""
    cc = shutil.which("gcc")
    if cc is None:
        raise RuntimeError("gcc not found on PATH")
    digest = hashlib.sha256((source + " ".join(flags)).encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / "tokenmill-bench-probes"
    folder.mkdir(exist_ok=True)
    lib = folder / f"{stem}-{digest}.so"
    if not lib.exists():
        src = folder / f"{stem}-{digest}.c"
        src.write_text(source)
        tmp = folder / f"{stem}-{digest}.{os.getpid()}.tmp"
        subprocess.run([cc, "-O2", "-march=native", *flags, "-shared", "-fPIC", str(src), "-o", str(tmp)],
                       check=True, capture_output=True, timeout=120)
        os.replace(tmp, lib)
    return ctypes.CDLL(str(lib))


def _reader() -> ctypes.CDLL:
    """The compiled reader."""
    cdll = compile_probe(_READER, "reader", ("-fopenmp",))
    cdll.tm_read_all.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    cdll.tm_read_all.restype = ctypes.c_longlong
    return cdll


def _median_seconds(run: Callable[[], object], repeats: int) -> float:
    """The median time of ``repeats`` calls of ``run``."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def read_bandwidth(threads: int, nbytes: int = 1 << 30, repeats: int = 15) -> float:
    """Bytes/s ``threads`` threads sustain reading a buffer of ``nbytes``: the median of
    ``repeats`` passes (about half a second). Not the best pass: a VM can read several times
    faster for single passes amid minutes at its usual rate, bursts no decode of many tokens
    holds (docs/performance.md has the readings)."""
    reader = _reader()
    # Every 8 bytes distinct, as weights are: pages of one value could be merged by the host
    # (a VM's same-page merging), and reading one page over and over is a cache's rate.
    buf = torch.arange(nbytes // 8, dtype=torch.int64)
    ptr, size = buf.data_ptr(), buf.numel() * 8
    return size / _median_seconds(lambda: reader.tm_read_all(ptr, size, threads), repeats)


def copy_bandwidth(threads: int, nbytes: int = 1 << 30, repeats: int = 15) -> float:
    """Bytes/s of a torch ``copy_`` (read + write counted), the median of ``repeats``: for comparison."""
    torch.set_num_threads(threads)
    src = torch.arange(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_seconds(lambda: dst.copy_(src), repeats)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--threads", type=int, default=0, help="threads (0: torch's count, all cores)")
    args = ap.parse_args(argv)
    threads = args.threads or torch.get_num_threads()
    for n in sorted({1, threads}):
        print(f"threads {n}: read {read_bandwidth(n) / 1e9:.1f} GB/s, "
              f"torch copy_ {copy_bandwidth(n) / 1e9:.1f} GB/s (read + write)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

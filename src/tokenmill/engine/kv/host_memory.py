"""Large host tensors on transparent huge pages (Linux), for the CPU KV pool.

Decode attention reads each sequence's K/V blocks (4 KB per block and kv head
for SmolLM2 in float32) scattered over a pool of up to gigabytes. With 4 KB
pages every block is its own page, so every block read is also a TLB miss and
a page walk. One core reads scattered 4 KB blocks clearly faster from 2 MB
pages than from 4 KB pages (a C loop over a shuffled 512 MB buffer, software
prefetch two blocks ahead; figures in docs/performance.md).

Where transparent huge pages are set to ``madvise`` (the common default),
memory only gets them if asked before it is first touched. So the pool is its
own anonymous mapping (fresh pages, never recycled from the heap, where a
previous owner may already have faulted them in as 4 KB pages),
``madvise(MADV_HUGEPAGE)``-ed, then zeroed. Anything that cannot be done
(another OS, THP ``never``) leaves ordinary pages with the same contents.
``TOKENMILL_HUGE_PAGES=0`` turns it off.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap

import torch

from ...model.quant import kv_quant

HUGE_PAGE = 2 << 20


def zeros_on_huge_pages(numel: int, dtype: torch.dtype, huge_pages: bool = True) -> torch.Tensor:
    """A zeroed, contiguous 1-D CPU tensor of ``numel`` elements whose pages are
    huge pages where the kernel allows it and ``huge_pages`` asks for them (same
    contents either way). The tensor keeps its mapping alive."""
    nbytes = numel * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
    if (not huge_pages or nbytes < HUGE_PAGE or advice is None
            or not hasattr(mmap, "MAP_ANONYMOUS")):
        return torch.zeros(numel, dtype=dtype)
    length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    # Private and anonymous (a plain mmap(-1, n) is shared, and shared memory has its own
    # THP setting); 2 MB of slack for an aligned start.
    region = mmap.mmap(-1, length + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()
    offset = -base % HUGE_PAGE  # base is page-aligned, so is the offset
    try:
        region.madvise(advice, offset, length)
    except OSError:
        pass  # e.g. a kernel without THP: ordinary pages
    view = torch.frombuffer(region, dtype=dtype, count=numel, offset=offset)
    view.zero_()  # first touch now: the page faults hand out huge pages
    return view


def kv_pool_tensors(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype,
                    device: torch.device, huge_pages: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's zeroed (K, V) pool. On CPU they are views of one allocation on
    huge pages; elsewhere one tensor each."""
    if device.type != "cpu":
        return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(num_layers)]
    flat = zeros_on_huge_pages(2 * num_layers * math.prod(shape), dtype, huge_pages)
    parts = flat.view(num_layers, 2, *shape)
    return [(parts[i, 0], parts[i, 1]) for i in range(num_layers)]


def quantized_pool_tensors(num_layers: int, shape: tuple[int, int, int, int], dtype: torch.dtype,
                           device: torch.device, huge_pages: bool = True) -> list[tuple[torch.Tensor, ...]]:
    """Every layer's zeroed quantized pool (model/quant/kv_quant.py's format): (k_codes, v_codes,
    k_scales, v_scales). On CPU the codes are views of one allocation on huge pages, as a
    float pool is."""
    codes = kv_pool_tensors(num_layers, shape, torch.int8, device, huge_pages)
    heads, num_blocks = shape[0], shape[1]
    scales = torch.zeros((num_layers, 2, heads, num_blocks), dtype=kv_quant.SCALE_DTYPE, device=device)
    return [(k.view(dtype), v.view(dtype), scales[i, 0], scales[i, 1]) for i, (k, v) in enumerate(codes)]


def release_freed_heap() -> None:
    """Hand the heap's freed pages back to the OS (glibc's ``malloc_trim``; elsewhere nothing).

    Building a quantized model frees gigabytes of conversion scratch (a GGUF file's blocks
    unpacked, repacked into the kernels' tiles) in pieces the allocator keeps mapped; left
    there, the process's resident memory after load stays near twice the weights'."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = getattr(libc, "malloc_trim", None)
    except OSError:
        trim = None
    if trim is not None:
        trim(0)

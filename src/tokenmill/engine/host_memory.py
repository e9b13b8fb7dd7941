"""Large host tensors on transparent huge pages (Linux), for the CPU KV pool.

Decode attention reads each sequence's K/V blocks (4 KB per block and kv head
for SmolLM2 in float32) scattered over a pool of up to gigabytes. With 4 KB
pages every block is its own page, so every block read is also a TLB miss and
a page walk. On this machine one core reads scattered 4 KB blocks at 10-13
GB/s with 4 KB pages and 16-17 GB/s with 2 MB pages (a C loop over a shuffled
512 MB buffer, software prefetch two blocks ahead).

Where transparent huge pages are set to ``madvise`` (the common default),
memory only gets them if asked before it is first touched: the pool is
allocated once, ``madvise(MADV_HUGEPAGE)``-ed, then zeroed. Anything that
cannot be done (another OS, THP ``never``, an old kernel) leaves ordinary
pages, with the same contents. ``TOKENMILL_HUGE_PAGES=0`` turns it off.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

import torch

from ..config import env_switch_on

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


def _madvise_huge(address: int, length: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        return libc.madvise(address, length, MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def zeros_on_huge_pages(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed, contiguous 1-D CPU tensor of ``numel`` elements whose pages are
    huge pages where the kernel allows it (same contents either way)."""
    if not env_switch_on("TOKENMILL_HUGE_PAGES") or numel * torch.empty((), dtype=dtype).element_size() < HUGE_PAGE:
        return torch.zeros(numel, dtype=dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    # Slack for a 2 MB-aligned start and a whole number of huge pages after it.
    raw = torch.empty(numel + 2 * HUGE_PAGE // itemsize, dtype=dtype)
    start = (raw.data_ptr() + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    offset = (start - raw.data_ptr()) // itemsize  # torch's CPU buffers are at least itemsize-aligned
    length = (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    if not _madvise_huge(start, length):
        log.debug("madvise(MADV_HUGEPAGE) refused; the KV pool stays on ordinary pages")
    view = raw[offset:offset + numel]
    view.zero_()  # first touch: the page faults hand out huge pages now
    return view


def kv_pool_tensors(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype,
                    device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's zeroed (K, V) pool. On CPU they are views of one allocation on
    huge pages; elsewhere one tensor each."""
    if device.type != "cpu":
        return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(num_layers)]
    per_tensor = 1
    for size in shape:
        per_tensor *= size
    flat = zeros_on_huge_pages(2 * num_layers * per_tensor, dtype)
    parts = flat.view(num_layers, 2, *shape)
    return [(parts[i, 0], parts[i, 1]) for i in range(num_layers)]

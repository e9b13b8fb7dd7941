"""Handing freed heap memory back to the OS (glibc), once and periodically.

Why: glibc keeps memory that Python, torch and the C kernels free in its
arenas for reuse and returns it to the OS only when the top of a heap is
free. A server's RSS then reflects its high-water marks, not what it holds:
after loading a model (hundreds of megabytes of file buffers and
dequantization scratch), after one large request, and slowly over hours of
mixed traffic whose varying shapes leave free holes behind live blocks.
``malloc_trim(0)`` releases the free pages of every arena, holes included.

It walks the heaps under their locks, so it runs in a worker or background
thread; a no-op where the C library is not glibc.

The other thing that grew under mixed traffic was oneDNN's caches: float32
CPU linears go through oneDNN, which builds (JIT-compiles) one primitive per
input shape and keeps up to 1024 of them in each of two caches (oneDNN's own
and ideep's per-thread one). A prefill step's token count varies with every
batch, so a server that ran for hours accumulated hundreds of megabytes of
primitives for shapes it may never see again. ``bound_onednn_caches`` caps
both unless the operator set them; measured on the bundled model, RSS after
trimming stayed flat with the cap and requests ran no slower.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
from typing import Callable

log = logging.getLogger("tokenmill.server")


ONEDNN_CACHE_ENTRIES = 64
_ONEDNN_CACHE_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_onednn_caches(entries: int = ONEDNN_CACHE_ENTRIES) -> None:
    """Cap oneDNN's primitive caches (environment variables an operator may still set).

    Both are read when the first primitive is made, so call this before the
    model runs anything."""
    for name in _ONEDNN_CACHE_VARS:
        os.environ.setdefault(name, str(entries))


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_MALLOC_TRIM = _load_malloc_trim()


def trim_heap() -> bool:
    """Give freed heap memory back to the OS; whether anything could be released."""
    return bool(_MALLOC_TRIM(0)) if _MALLOC_TRIM is not None else False


class HeapTrimmer:
    """A daemon thread that calls ``trim_heap`` every ``interval_s`` seconds until ``stop``."""

    def __init__(self, interval_s: float = 30.0) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenmill-heap-trim", daemon=True)

    def start(self) -> "HeapTrimmer":
        if _MALLOC_TRIM is not None:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                trim_heap()
            except Exception:  # noqa: BLE001 - never take the server down over housekeeping
                log.exception("malloc_trim failed")
                return

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
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from typing import Callable

log = logging.getLogger("tokenmill.server")


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

"""Native CPU kernels, compiled on first use and called through ctypes.

Five kernels, one library:

* ``csrc/paged_attention.c`` (and ``paged_run.c``, its runs and entry points): decode
  attention reading the KV blocks in place through the block table (copying every
  sequence's blocks into a contiguous workspace first dominated decode attention on CPU);
* ``csrc/prefill_attention.c``: causal attention of one prefill chunk, also
  reading its context in place, with register-tiled matmuls (faster than
  torch's SDPA plus the gather it needed; docs/performance.md);
* ``csrc/argmax.c``: greedy sampling's row argmax (torch's CPU argmax does
  not vectorize its index tracking, which costs milliseconds at vocabulary width);
* ``csrc/elementwise.c``: RMSNorm, rotary, SiLU(gate) * up and the K/V
  stores of the eager model's prefill and mixed steps, one pass each instead
  of two to seven ATen ops (the fused decode step inlines the same one-row
  routines);
* ``csrc/step.c``: a whole decode step, every layer in one call, for small batches
  (``engine/step/fused_decode.py``), over the projections of ``linear.c`` (one layer's
  dispatch and ``tm_linear``), ``dense.c`` (weights widened to float32), ``int8.c`` and
  ``int4.c`` (integer codes against int8 activations), ``kquant.c`` and
  ``kquant_tiles.c`` (GGUF K-quant blocks), ``amx_int8.c`` (AMX tiles), ``lora.c``
  (adapters) and ``threads.c`` (the barrier and the claims of work).

``csrc/tm_kernels.h`` holds what they share: the build's instruction-set features, decided
once; the vector vocabulary the kernels are written in (VW-lane float and int vectors and
their loads, FMA and reduction, the u8 x s8 dot step); the structures this module mirrors.

One translation unit: ``csrc/kernels.c`` includes the files in order, and each includes the
header so it reads on its own. Separate units compiled apart would cost speed: the step
inlines attention's item routine, the elementwise one-row routines and the matmul tiles into
its loops (always-inline static functions), and across units gcc would call them instead
unless the library were linked with LTO, whose partitioning of an OpenMP library is one
more thing to hold steady; one unit gives the compiler every body with no link step.

C with no torch headers and no build step at install time: the first call
compiles ``kernels.c`` with the system gcc into a cache directory
(``TOKENMILL_KERNEL_CACHE``, default ``~/.cache/tokenmill/kernels``) under a
name keyed by a hash of every source file, the flags, the compiler version and the
CPU (``-march=native``), so an edited source, another compiler or another
machine never loads a stale library. Compiling to a temporary name and
``os.replace``-ing it makes concurrent processes (servers started by tests)
safe.

Whether the kernels are used at all, and which instruction-set build, is
decided once per engine from its ``KernelOptions`` (``tokenmill/options.py``):
the engine loads one library and hands it to the model's ops, its attention
backend and its step executors. Each entry point here still returns ``False``
or None (nothing written) for tensors it cannot take (not on CPU, another
dtype or layout), so a caller keeps a torch path for those shapes; no gcc or
a failed compile makes :func:`load` return None and the engine chooses the
torch ops and attention backend instead.

The library links OpenMP by soname (``libgomp.so.1``); torch's wheel ships
its own ``libgomp.so.1`` and has it loaded already, so the dynamic linker
hands the kernel torch's runtime and thread pool rather than starting a
second pool that would fight torch's for the cores.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from ...settings.options import KernelOptions

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "kernels.c"  # includes every other file: one library, one translation unit
# An older tree's root (a benchmark's baseline), compiled when its folder has no kernels.c.
_OLD_SOURCE = "decode_step.c"
# -fno-trapping-math: no floating-point trap is ever enabled here, and under gcc's default
# (traps possible) a loop whose body selects between float results (exp_nonpos's range
# check, SiLU's sign cases, the softmax's causal mask) is vectorized only where the ISA has
# masked operations: AVX-512 builds vectorized them, AVX2 and portable builds ran them one
# float at a time. The flag only lets gcc compute both sides of such a select and keep
# the one chosen; it rounds nothing differently (a vectorized sum adds in lanes, as the
# AVX-512 build's always did).
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-fno-trapping-math")
# Instruction-set builds: "native" takes everything this CPU has; "avx512" leaves
# AMX out, so a machine with tiles runs (and tests, and measures against) what an
# AVX-512 one without them runs; "avx2" leaves AVX-512 out, the same for an
# AVX2-only one; "portable" targets baseline x86-64 (SSE2) and runs anywhere.
NO_AMX = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")
ISA_FLAGS = {"native": (), "avx512": NO_AMX, "avx2": ("-mno-avx512f", *NO_AMX),
             "portable": ("-march=x86-64", "-mtune=generic")}
_ABI_VERSION = 14
_ENTRY = {torch.float32: "tm_paged_decode_f32", torch.bfloat16: "tm_paged_decode_bf16"}
# Quantized pools (model/quant/kv_quant.py): the kernels' format codes (KV_I8, KV_FP8 in paged_attention.c).
KV_FORMAT = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.float8_e4m3fn: 3}
_QUANT_KV = (torch.int8, torch.float8_e4m3fn)
PREFILL_MAX_GROUP = 192  # query heads per kv head the prefill kernel takes (PF_ROWS in prefill_attention.c)
_PREFILL_ENTRY = {torch.float32: "tm_paged_prefill_f32", torch.bfloat16: "tm_paged_prefill_bf16"}


@dataclass(frozen=True)
class KernelLibrary:
    cdll: ctypes.CDLL
    path: Path
    vector_width: int  # floats per vector register; head_dim must be a multiple of it
    q8_activations: bool = False  # int4/int8 matmuls of few rows quantize activations to int8 (AVX2 builds)
    int8_dot: bool = False  # int8 layers in the VNNI packing multiply integer activations (TmLinear.a8/a16_rows)
    amx: bool = False  # those products run on AMX tiles from 16 activation rows (csrc/amx_int8.c)
    int8_dot_unit: str = ""  # what computes those sums: "VNNI", or "AVX2 16-bit" products (the same sums)
    bf16_attention: bool = False  # decode attention over a bf16 pool multiplies bf16-rounded q and weights (vdpbf16ps)
    q4_int8_dot: bool = False  # int4 layers in the nibble packing multiply codes by int8 activations (AVX2, AVX-512 VNNI)
    kquant_int8_rows: int = 0  # K-quant layers multiply codes by int8 activations below this many rows (kquant.c)
    kquant_int8_tiles: bool = False  # from that many rows, Q4_K / Q5_K tiles run on the int8g kernels (kq_int8g_rows)
    q6_tiles: bool = False  # Q6_K layers given pack_q6_tiles' copy multiply it by int8 activations (AVX2, AVX-512 VNNI)


_lock = threading.Lock()
_libs: dict[tuple[str, Path], KernelLibrary | None] = {}


def process_options() -> KernelOptions:
    """The options of callers outside an engine (tests, benchmarks, tools), read from the
    environment at each call; an engine passes its own, read once at its build."""
    return KernelOptions.from_env()


def isa(options: KernelOptions | None = None) -> str:
    """The kernels' instruction-set build (native, avx2, portable): see ``KernelOptions``."""
    return (options or process_options()).kernel_isa


def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def native_bf16(options: KernelOptions | None = None) -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX) and the
    process is not narrowed below AVX-512: only then is a bf16 matmul faster
    than float32 here (elsewhere oneDNN emulates it, several times slower)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    flags = _cpu_flags()
    return bool({"avx512_bf16", "amx_bf16"} & flags) and isa(options) in ("native", "avx512") and \
        torch.backends.cpu.get_cpu_capability().upper().startswith("AVX512")


def cache_dir(options: KernelOptions | None = None) -> Path:
    return (options or process_options()).kernel_cache_dir


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU model and its feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.machine() + platform.processor()
    keep = [line.split(":", 1)[1].strip() for line in text.splitlines()
            if line.startswith(("model name", "flags", "Features"))][:2]
    return platform.machine() + "|" + "|".join(keep)


def _compiler() -> str:
    cc = shutil.which("gcc")
    if cc is None:
        raise RuntimeError("gcc not found on PATH")
    return cc


def _sources(csrc: Path | None) -> tuple[Path, tuple[Path, ...]]:
    """The translation unit compiled and the files the cache key hashes (every C source and
    header beside it), from this package's ``csrc`` or another folder of the kernels (a
    benchmark's other tree, whose root may be the older ``decode_step.c``)."""
    folder = csrc if csrc is not None else CSRC
    root = folder / SOURCE.name
    if not root.exists() and (folder / _OLD_SOURCE).exists():
        root = folder / _OLD_SOURCE
    return root, tuple(sorted((*folder.glob("*.c"), *folder.glob("*.h"))))


def _library_path(cc: str, flags: tuple[str, ...], directory: Path, csrc: Path | None = None) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256()
    parts = [src.read_bytes() for src in _sources(csrc)[1]]
    for part in (*parts, " ".join(flags).encode(), version.encode(), _cpu_signature().encode()):
        digest.update(part)
        digest.update(b"\0")
    return directory / f"tokenmill_cpu-{digest.hexdigest()[:20]}.so"


def _compile(cc: str, flags: tuple[str, ...], target: Path, csrc: Path | None = None) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, str(_sources(csrc)[0]), "-o", tmp, "-lm"],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"gcc failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: a concurrent process sees no file or a whole one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _isa_flags(kernel_isa: str, extra_flags: tuple[str, ...]) -> tuple[str, ...]:
    """The process's instruction-set flags, unless the extra flags already carry them or name
    a target of their own (``-march=``): the same library then has the same flags, so one
    compile serves a narrowed process and a full one (the cache key hashes the flags)."""
    isa = ISA_FLAGS[kernel_isa]
    if any(f.startswith("-march=") for f in extra_flags) or set(isa) <= set(extra_flags):
        return ()
    return isa


def _without_idle_amx_flags(flags: tuple[str, ...]) -> tuple[str, ...]:
    """``flags`` less the ``-mno-amx-*`` ones where this CPU has no AMX: ``-march=native``
    enables none there, so they change nothing but the cache key, and the AVX-512 build and
    the native one are one library, compiled once."""
    if "amx_tile" in _cpu_flags():
        return flags
    return tuple(f for f in flags if f not in NO_AMX)


def build(extra_flags: tuple[str, ...] = (), options: KernelOptions | None = None,
          csrc: Path | None = None) -> KernelLibrary:
    """Compile (unless cached) and load the kernel library; raises on failure.
    ``extra_flags`` serve tests, e.g. ``("-mno-avx512f",)`` for the 8-lane path; ``csrc``,
    benchmarks: another folder of the same C files (another tree's), cached apart."""
    options = options or process_options()
    cc = _compiler()
    flags = CFLAGS + _isa_flags(options.kernel_isa, tuple(extra_flags)) + tuple(extra_flags)
    flags = _without_idle_amx_flags(flags)
    path = _library_path(cc, flags, options.kernel_cache_dir, csrc)
    if not path.exists():
        _compile(cc, flags, path, csrc)
    cdll = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    args = [ptr, i64, ptr, ptr, ptr, i64, i64, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float, ptr, i64,
            ctypes.c_int, i64]
    for name in _ENTRY.values():
        fn = getattr(cdll, name)
        fn.argtypes = args
        fn.restype = ctypes.c_int
    prefill_args = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, ptr, i64,
                    ctypes.c_int, i64]
    for name in _PREFILL_ENTRY.values():
        fn = getattr(cdll, name)
        fn.argtypes = prefill_args
        fn.restype = ctypes.c_int
    cdll.tm_argmax_rows.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_int]
    cdll.tm_argmax_rows.restype = ctypes.c_int
    cint = ctypes.c_int
    cdll.tm_rms_norm_rows.argtypes = [ptr, i64, ptr, i64, i64, ctypes.c_float, ptr, i64, cint, cint]
    cdll.tm_silu_mul_rows.argtypes = [ptr, i64, i64, i64, ptr, i64, cint, cint]
    cdll.tm_rope_rows.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, cint, cint]
    cdll.tm_store_kv_rows.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, ptr, ptr, ptr, i64, i64, i64, cint]
    cdll.tm_store_kv_quant_rows.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, i64, i64,
                                            cint, cint, cint]
    cdll.tm_paged_decode_convert.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, cint, cint, ptr, i64, i64, ptr, i64, i64,
                                             i64, i64, i64, i64, ctypes.c_float, ptr, i64, cint, i64]
    cdll.tm_paged_prefill_convert.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, cint, cint, ptr, i64, i64, i64, i64, i64,
                                              i64, i64, i64, ctypes.c_float, ptr, i64, cint, i64]
    for fn in (cdll.tm_rms_norm_rows, cdll.tm_silu_mul_rows, cdll.tm_rope_rows, cdll.tm_store_kv_rows,
               cdll.tm_store_kv_quant_rows, cdll.tm_paged_decode_convert, cdll.tm_paged_prefill_convert):
        fn.restype = ctypes.c_int
    cdll.tm_model_step.argtypes = [ptr, ptr, i64, ptr, i64, i64, ptr, ptr, i64, ptr, i64, ptr, ptr, i64,
                                    ctypes.c_int]
    cdll.tm_model_step.restype = ctypes.c_int
    cdll.tm_linear.argtypes = [ptr, ptr, i64, i64, ptr, i64, cint]
    cdll.tm_linear.restype = ctypes.c_int
    cdll.tm_decode_struct_sizes.restype = ctypes.c_int64
    cdll.tm_kernels_abi_version.restype = ctypes.c_int
    cdll.tm_kernels_vector_width.restype = ctypes.c_int
    cdll.tm_kernels_q8_activations.restype = ctypes.c_int
    cdll.tm_kernels_q4_int8_dot.restype = ctypes.c_int
    cdll.tm_kernels_kquant_int8_rows.restype = ctypes.c_int
    cdll.tm_kernels_kquant_int8_tiles.restype = ctypes.c_int
    cdll.tm_kernels_q6_tiles.restype = ctypes.c_int
    cdll.tm_kernels_int8_dot.restype = ctypes.c_int
    cdll.tm_kernels_bf16_attention.restype = ctypes.c_int
    cdll.tm_kernels_amx_init.argtypes = [ctypes.c_int]
    cdll.tm_kernels_amx_init.restype = ctypes.c_int
    if cdll.tm_kernels_abi_version() != _ABI_VERSION:
        raise RuntimeError(f"{path} has ABI {cdll.tm_kernels_abi_version()}, expected {_ABI_VERSION}")
    int8_dot_code = cdll.tm_kernels_int8_dot()
    int8_dot = int8_dot_code > 0
    # The tiles' permission is the process's: asked for once, here, where the library is bound.
    amx = int8_dot and bool(cdll.tm_kernels_amx_init(1))
    return KernelLibrary(cdll, path, cdll.tm_kernels_vector_width(), bool(cdll.tm_kernels_q8_activations()),
                         int8_dot, amx, {1: "VNNI", 2: "AVX2 16-bit"}.get(int8_dot_code, ""),
                         bool(cdll.tm_kernels_bf16_attention()), bool(cdll.tm_kernels_q4_int8_dot()),
                         cdll.tm_kernels_kquant_int8_rows(), bool(cdll.tm_kernels_kquant_int8_tiles()),
                         bool(cdll.tm_kernels_q6_tiles()))


def load(options: KernelOptions | None = None) -> KernelLibrary | None:
    """The kernel library of ``options``' instruction-set build, built on first call and
    kept; None when it cannot be had (reason logged once) or the options turn the
    kernels off."""
    options = options or process_options()
    if not options.cpu_kernels:
        return None
    key = (options.kernel_isa, options.kernel_cache_dir)
    if key in _libs:
        return _libs[key]
    with _lock:
        if key not in _libs:
            lib: KernelLibrary | None
            try:
                lib = build(options=options)
                log.info("CPU kernels: %s build, %d-float vectors%s%s%s (%s)", options.kernel_isa, lib.vector_width,
                         ", int4/int8 x int8 integer dot products" if lib.q8_activations else
                         ", int4 x int8 integer dot products" if lib.q4_int8_dot else "",
                         f", int8 x int8 {lib.int8_dot_unit} products" if lib.int8_dot else "",
                         ", AMX int8 tiles from 16 rows" if lib.amx else "", lib.path)
            except Exception as exc:  # any failure: the engine keeps the torch path
                lib = None
                log.warning("CPU kernels unavailable (%s); using the torch ops and attention", exc)
            _libs[key] = lib
    return _libs[key]


def available(options: KernelOptions | None = None) -> bool:
    """True when the options enable the kernels and they compiled (compiles on first call)."""
    return load(options) is not None


def attention_dtype_ok(dtype: torch.dtype) -> bool:
    """Whether the attention kernels take a KV pool of ``dtype`` (float32, bf16, or int8 /
    fp8 codes with their scales, model/quant/kv_quant.py)."""
    return dtype in KV_FORMAT


def widens(pool: torch.Tensor | torch.dtype, compute: torch.dtype) -> bool:
    """A bf16 pool under float32 compute: rows rounded to bf16 when stored, widened back
    when read (half the bytes of a float32 pool, float32 arithmetic; with
    ``KernelLibrary.bf16_attention`` the C kernels multiply bf16 pairs instead)."""
    dtype = pool if isinstance(pool, torch.dtype) else pool.dtype
    return dtype == torch.bfloat16 and compute == torch.float32


def _scales_ok(k_cache: torch.Tensor, kv_scales: tuple[torch.Tensor, ...] | None) -> bool:
    """A quantized pool comes with contiguous float32 CPU scales [kv_heads, num_blocks] for
    K and V; a float pool with none."""
    if k_cache.dtype not in _QUANT_KV:
        return not kv_scales
    return (kv_scales is not None and len(kv_scales) == 2
            and all(s.dtype == torch.float32 and s.device.type == "cpu" and s.is_contiguous()
                    and tuple(s.shape) == tuple(k_cache.shape[:2]) for s in kv_scales))


def _usable_library(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                    index_tensors: tuple[torch.Tensor, ...], library: KernelLibrary | None,
                    kv_scales: tuple[torch.Tensor, ...] | None = None) -> KernelLibrary | None:
    """The library to run an attention kernel on these tensors with, or None when it
    cannot take them. Both kernels want: q and out [tokens, heads, head_dim] in the
    pool's dtype (float32 or bf16; over a quantized pool, float32 or bf16; over a bf16
    pool, float32 too), each head's row contiguous (token rows may be strided);
    contiguous K and V pools [kv_heads, num_blocks, block_size, head_dim] (with their
    scales when quantized); everything,
    the int32 tables included, on the CPU; a head size that is a multiple of the vector
    width. ``library``: a specific build (tests); by default the cached one for the
    process's options."""
    if k_cache.dtype not in KV_FORMAT:
        return None
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads, cache_dim = k_cache.shape[0], k_cache.shape[3]
    if any(t.device.type != "cpu" for t in (q, k_cache, v_cache, out, *index_tensors)):
        return None
    io_dtype = k_cache.dtype if k_cache.dtype in _ENTRY and not widens(k_cache.dtype, q.dtype) else q.dtype
    if not (q.dtype == out.dtype == io_dtype and io_dtype in _ENTRY and v_cache.dtype == k_cache.dtype
            and _scales_ok(k_cache, kv_scales) and (k_cache.dtype in _ENTRY or head_dim <= 512)
            and v_cache.shape == k_cache.shape and cache_dim == head_dim and heads % kv_heads == 0
            and out.shape == q.shape
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and q.stride(2) == 1 and q.stride(1) == head_dim and out.stride(2) == 1 and out.stride(1) == head_dim):
        return None
    lib = library or load()
    if lib is None or head_dim % lib.vector_width:
        return None
    return lib


def _raise_for(rc: int, name: str, bad_arguments: str) -> None:
    """The kernels' return codes: 1 refused arguments (nothing written), 2 no scratch memory."""
    if rc == 1:
        raise ValueError(f"{name}: {bad_arguments}")
    if rc != 0:
        raise MemoryError(f"{name}: the kernel could not allocate its scratch memory")


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           out: torch.Tensor, library: KernelLibrary | None = None,
                           kv_scales: tuple[torch.Tensor, ...] | None = None, window: int | None = None) -> bool:
    """Decode attention straight from the pool; returns False (nothing written)
    when the kernel cannot take these tensors, so the caller falls back.

    q, out: [num_decodes, heads, head_dim] in the pool's dtype, each head's row
    contiguous (token rows may be strided, as q is when sliced out of a fused
    q/k tensor). k_cache, v_cache: [kv_heads, num_blocks, block_size,
    head_dim], contiguous. block_tables: [>= num_decodes, >= blocks used] int32
    with unit inner stride. seq_lens: [>= num_decodes] int32, contiguous:
    context length including the new token. ``library``: a specific build
    (tests); by default the cached one. A quantized pool (int8 / fp8 codes) needs
    ``kv_scales``: its (K, V) float32 scales [kv_heads, num_blocks]; q and out are
    then float32 or bf16. A bf16 pool also takes float32 q and out (``widens``).
    ``window``: a sliding-window layer's window (only each context's last ``window``
    positions are read); None: the whole context.
    """
    lib = _usable_library(q, k_cache, v_cache, out, (block_tables, seq_lens), library, kv_scales)
    nd, heads, head_dim = q.shape
    if lib is None or not (
            block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()
            and block_tables.dim() == 2 and block_tables.shape[0] >= nd and seq_lens.numel() >= nd
            and (block_tables.stride(1) == 1 or block_tables.shape[1] <= 1)):
        return False
    if nd == 0:
        return True
    kv_heads, num_blocks, block_size, _ = k_cache.shape
    if k_cache.dtype in _QUANT_KV or widens(k_cache, q.dtype):
        k_scale, v_scale = (kv_scales[0].data_ptr(), kv_scales[1].data_ptr()) if kv_scales else (None, None)
        rc = lib.cdll.tm_paged_decode_convert(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), k_scale,
            v_scale, KV_FORMAT[k_cache.dtype], int(q.dtype == torch.bfloat16),
            block_tables.data_ptr(), block_tables.stride(0), block_tables.shape[1], seq_lens.data_ptr(),
            nd, heads, kv_heads, head_dim, num_blocks, block_size, float(scale),
            out.data_ptr(), out.stride(0), torch.get_num_threads(), window or 0)
    else:
        rc = getattr(lib.cdll, _ENTRY[k_cache.dtype])(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            block_tables.data_ptr(), block_tables.stride(0), block_tables.shape[1], seq_lens.data_ptr(),
            nd, heads, kv_heads, head_dim, num_blocks, block_size, float(scale),
            out.data_ptr(), out.stride(0), torch.get_num_threads(), window or 0)
    _raise_for(rc, "paged_decode_attention", "a sequence length or block id lies outside the table or pool")
    return True


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                            seq_len: int, scale: float, out: torch.Tensor,
                            library: KernelLibrary | None = None,
                            kv_scales: tuple[torch.Tensor, ...] | None = None, window: int | None = None) -> bool:
    """Causal attention of one prefill chunk straight from the pool (its own K/V
    already written there); returns False (nothing written) when the kernel cannot
    take these tensors, so the caller falls back.

    q, out: [q_len, heads, head_dim] in the pool's dtype, each head's row
    contiguous (token rows may be strided); query j sits at absolute position
    seq_len - q_len + j and sees keys 0 .. that position (the last ``window`` of them in a
    sliding-window layer). table: 1-D int32 block
    ids of the sequence, contiguous. k_cache, v_cache (and kv_scales) as for
    :func:`paged_decode_attention`.
    """
    lib = _usable_library(q, k_cache, v_cache, out, (table,), library, kv_scales)
    q_len, heads, head_dim = q.shape
    kv_heads, num_blocks, block_size, _ = k_cache.shape
    if lib is None or not (table.dtype == torch.int32 and table.dim() == 1 and table.is_contiguous()
                           and heads // kv_heads <= PREFILL_MAX_GROUP):
        return False
    if q_len == 0:
        return True
    if k_cache.dtype in _QUANT_KV or widens(k_cache, q.dtype):
        k_scale, v_scale = (kv_scales[0].data_ptr(), kv_scales[1].data_ptr()) if kv_scales else (None, None)
        rc = lib.cdll.tm_paged_prefill_convert(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), k_scale,
            v_scale, KV_FORMAT[k_cache.dtype], int(q.dtype == torch.bfloat16), table.data_ptr(),
            table.numel(), int(seq_len), q_len, heads, kv_heads, head_dim, num_blocks, block_size, float(scale),
            out.data_ptr(), out.stride(0), torch.get_num_threads(), window or 0)
    else:
        rc = getattr(lib.cdll, _PREFILL_ENTRY[k_cache.dtype])(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), table.numel(),
            int(seq_len), q_len, heads, kv_heads, head_dim, num_blocks, block_size, float(scale),
            out.data_ptr(), out.stride(0), torch.get_num_threads(), window or 0)
    _raise_for(rc, "paged_prefill_attention", "the chunk, its length or a block id lies outside the table or pool")
    return True


def _cpu_same_float(*tensors: torch.Tensor) -> bool:
    """All on the CPU, all float32 or all bfloat16 (what the elementwise kernels take)."""
    dtype = tensors[0].dtype
    return dtype in _ENTRY and all(t.device.type == "cpu" and t.dtype == dtype for t in tensors)


def _rows_ok(x: torch.Tensor) -> bool:
    """2-D with unit inner stride (rows may be strided, as slices of a fused projection are)."""
    return x.dim() == 2 and (x.stride(1) == 1 or x.shape[1] <= 1) and x.stride(0) >= x.shape[1]


def _enabled_library(library: KernelLibrary | None) -> KernelLibrary | None:
    """``library`` (the engine's), else the process's (callers outside an engine)."""
    return library or load()


def argmax_rows(logits: torch.Tensor, library: KernelLibrary | None = None) -> torch.Tensor | None:
    """``logits.argmax(dim=-1)`` for a 2-D float32 CPU tensor with unit inner stride,
    the same indices as torch gives (first of equal maxima; NaN wins), as int64; None
    when the kernel is off or cannot take the tensor (the caller uses torch)."""
    if not (logits.device.type == "cpu" and logits.dtype == torch.float32 and _rows_ok(logits)
            and logits.shape[1] > 0):
        return None
    lib = _enabled_library(library)
    if lib is None:
        return None
    rows, cols = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        rc = lib.cdll.tm_argmax_rows(logits.data_ptr(), rows, cols, logits.stride(0), out.data_ptr(),
                                     torch.get_num_threads())
        _raise_for(rc, "argmax_rows", "bad shape or stride")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             library: KernelLibrary | None = None) -> torch.Tensor | None:
    """``weight * x / rms(x)`` over the last dimension of a 2-D float32 or bf16 CPU tensor
    (weight in the same dtype), in one pass, rounding as model/models/llama.py's RMSNorm rounds
    (a new contiguous tensor); None when the kernel is off or cannot take it."""
    if not (_cpu_same_float(x, weight) and _rows_ok(x) and weight.is_contiguous() and weight.shape == x.shape[1:]):
        return None
    lib = _enabled_library(library)
    if lib is None:
        return None
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=x.dtype)
    rc = lib.cdll.tm_rms_norm_rows(x.data_ptr(), x.stride(0), weight.data_ptr(), rows, n, float(eps),
                                   out.data_ptr(), n, int(x.dtype == torch.bfloat16), torch.get_num_threads())
    _raise_for(rc, "rms_norm", "bad shape or stride")
    return out


def silu_mul(gate_up: torch.Tensor, inter: int, library: KernelLibrary | None = None) -> torch.Tensor | None:
    """``silu(gate_up[:, :inter]) * gate_up[:, inter:2 * inter]`` for a 2-D float32 or bf16
    CPU tensor, in one pass (a new [rows, inter] tensor; bf16 rounds after the SiLU and
    after the product, as torch's two ops do); None when the kernel is off or cannot take it."""
    if not (_cpu_same_float(gate_up) and _rows_ok(gate_up) and gate_up.shape[1] == 2 * inter and inter > 0):
        return None
    lib = _enabled_library(library)
    if lib is None:
        return None
    rows = gate_up.shape[0]
    out = torch.empty((rows, inter), dtype=gate_up.dtype)
    rc = lib.cdll.tm_silu_mul_rows(gate_up.data_ptr(), gate_up.stride(0), rows, inter, out.data_ptr(), inter,
                                   int(gate_up.dtype == torch.bfloat16), torch.get_num_threads())
    _raise_for(rc, "silu_mul", "bad shape or stride")
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, library: KernelLibrary | None = None) -> bool:
    """Rotary embedding in place, bit-identical to ``x * cos + x.roll(D // 2, -1) * signed_sin``
    (model/models/llama.py's ``_rotate``), float32 or bf16: x [tokens, heads, D] on CPU, each token's
    heads contiguous (token rows may be strided); cos, signed_sin: [tokens, 1, D] (or
    [tokens, D]), contiguous, in x's dtype. False (nothing written) when the kernel is off or
    cannot take them."""
    if not (_cpu_same_float(x, cos, signed_sin) and x.dim() == 3
            and cos.is_contiguous() and signed_sin.is_contiguous()):
        return False
    tokens, heads, d = x.shape
    if not (x.stride(2) == 1 and x.stride(1) == d and x.stride(0) >= heads * d
            and cos.numel() == tokens * d and signed_sin.numel() == tokens * d and d % 2 == 0 and d <= 512):
        return False
    lib = _enabled_library(library)
    if lib is None:
        return False
    if tokens:
        rc = lib.cdll.tm_rope_rows(x.data_ptr(), x.stride(0), tokens, heads, d, cos.data_ptr(),
                                   signed_sin.data_ptr(), int(x.dtype == torch.bfloat16), torch.get_num_threads())
        _raise_for(rc, "rope_", "bad shape or stride")
    return True


def _new_rows_ok(k: torch.Tensor, v: torch.Tensor, pool: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """What both K/V stores need of the new rows: k, v [tokens, kv_heads, head_dim] with the
    pool's head count and size, each token's heads contiguous (token rows may be strided),
    and one contiguous int64 slot per token on the CPU."""
    if not (k.dim() == 3 and v.shape == k.shape and slot_mapping.dtype == torch.int64
            and slot_mapping.device.type == "cpu" and slot_mapping.is_contiguous()
            and slot_mapping.numel() == k.shape[0]):
        return False
    _, kv_heads, d = k.shape
    return (pool.shape[0] == kv_heads and pool.shape[3] == d
            and all(t.stride(2) == 1 and t.stride(1) == d and t.stride(0) >= kv_heads * d for t in (k, v)))


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, library: KernelLibrary | None = None) -> bool:
    """``attention.write_kv`` in one pass: k, v [tokens, kv_heads, head_dim] on CPU, each
    token's heads contiguous (token rows may be strided); pools [kv_heads, num_blocks,
    block_size, head_dim], contiguous, in k's dtype (float32 or bf16), or bf16 under
    float32 k and v (rounded to nearest even, as ``Tensor.to`` rounds); slot_mapping int64
    [tokens]. False (nothing written) when the kernel is off or cannot take them;
    ValueError for a slot outside the pool, as index_copy_ would raise."""
    pools_ok = k_cache.dtype == k.dtype or widens(k_cache, k.dtype)
    if not (pools_ok and _cpu_same_float(k, v) and _cpu_same_float(k_cache, v_cache)
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and k_cache.shape == v_cache.shape and _new_rows_ok(k, v, k_cache, slot_mapping)):
        return False
    tokens, kv_heads, d = k.shape
    lib = _enabled_library(library)
    if lib is None:
        return False
    if tokens:
        num_slots = k_cache.shape[1] * k_cache.shape[2]
        rc = lib.cdll.tm_store_kv_rows(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), tokens, kv_heads, d,
                                       slot_mapping.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), num_slots,
                                       k.element_size(), k_cache.element_size(), torch.get_num_threads())
        _raise_for(rc, "store_kv", "a slot lies outside the pool")
    return True


def store_kv_quant(k_codes: torch.Tensor, v_codes: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                   library: KernelLibrary | None = None) -> bool:
    """``kv_quant.store`` for K and V in one C pass (the same codes and scales): k, v
    [tokens, kv_heads, head_dim] float32 or bf16 on CPU, each token's heads contiguous;
    codes int8 / float8_e4m3fn [kv_heads, num_blocks, block_size, head_dim] and float32
    scales [kv_heads, num_blocks], contiguous; slot_mapping int64 [tokens]. False
    (nothing written) when the kernel is off or cannot take them; ValueError for a slot
    outside the pool."""
    if not (k_codes.dtype in _QUANT_KV and v_codes.dtype == k_codes.dtype and k.dtype in _ENTRY
            and v.dtype == k.dtype and k.dim() == 3 and v.shape == k.shape
            and all(t.device.type == "cpu" and t.is_contiguous() for t in (k_codes, v_codes, k_scale, v_scale))
            and k.device.type == "cpu" and v.device.type == "cpu" and k_codes.shape == v_codes.shape
            and _scales_ok(k_codes, (k_scale, v_scale)) and _new_rows_ok(k, v, k_codes, slot_mapping)):
        return False
    tokens, kv_heads, d = k.shape
    lib = _enabled_library(library)
    if lib is None:
        return False
    if tokens:
        rc = lib.cdll.tm_store_kv_quant_rows(
            k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), tokens, kv_heads, d, slot_mapping.data_ptr(),
            k_codes.data_ptr(), v_codes.data_ptr(), k_scale.data_ptr(), v_scale.data_ptr(), k_codes.shape[1],
            k_codes.shape[2], int(k_codes.dtype == torch.float8_e4m3fn), int(k.dtype == torch.bfloat16),
            torch.get_num_threads())
        _raise_for(rc, "store_kv_quant", "a slot lies outside the pool")
    return True


# --------------------------------------------------------------------------- one projection

W_F32, W_BF16, W_INT8, W_INT4, W_INT8G, W_KQ = 0, 1, 2, 3, 4, 5  # TmLinear.kind (W_KQ: csrc/kquant.c)
Q4_SYMMETRIC, Q4_F16, Q4_KSCALES, Q4_FIFTH = 1, 2, 4, 8  # TmLinear.q4_form bits (csrc/int4.c's int4_q8_block)


class TmLinear(ctypes.Structure):
    """csrc/tm_kernels.h's description of one projection (weights stay in their stored
    precision; int4 in :func:`pack_int4`'s order with float32 scale and ``z - 8 s``)."""

    _fields_ = [("kind", ctypes.c_int32), ("group", ctypes.c_int32), ("repeat", ctypes.c_int32),
                ("a8_rows", ctypes.c_int32), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                ("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("row_sums", ctypes.c_void_p), ("packed", ctypes.c_void_p),
                ("a16_rows", ctypes.c_int32), ("q4_form", ctypes.c_int32),
                ("packed_scale", ctypes.c_void_p), ("packed_zero", ctypes.c_void_p)]


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (K % 32 == 0) -> [N, K / 2] bytes, the project's int4 packing:
    in each 32-column chunk, byte i holds code i (low nibble) and code i + 16 (high
    nibble), so one byte load gives the kernels two vectors' worth of codes. It is
    the same on every CPU, unlike torch's int4pack, which changes with its ISA dispatch."""
    n, k = codes.shape
    c = codes.reshape(n, k // 32, 2, 16).to(torch.uint8)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def pack_vnni(q: torch.Tensor, vector_width: int) -> torch.Tensor | None:
    """int8 codes [N, K] -> the VNNI packing the kernels read, [N / VW, K / 4, VW, 4] (VW =
    the build's floats per vector): one vector load gives 4 consecutive columns of VW
    output rows, the layout vpdpbusd multiplies against 4 broadcast activation bytes.
    None when N or K does not divide."""
    n, k = q.shape
    if n % vector_width or k % 4:
        return None
    return q.reshape(n // vector_width, vector_width, k // 4, 4).permute(0, 2, 1, 3).contiguous()


def pack_int4_q8(codes: torch.Tensor, vector_width: int, fifth: bool = False) -> torch.Tensor | None:
    """uint8 int4 codes [N, K'] -> the nibble packing AVX2 and AVX-512 VNNI builds multiply
    against int8 activations (csrc/int4.c's int4_q8_rows), [N / VW, K' / 32, 4, 4 VW]
    bytes: per output tile and 32-input block, four steps of VW rows x 4 inputs, byte
    4r + i of step s holding input 4s + i of row r (low nibble) and input 16 + 4s + i
    (high nibble). None when N or K' does not divide.

    ``fifth``: five-bit codes (0..31, the ``Q4_FIFTH`` form), [N / VW, K' / 32, 20 VW]: each
    block's four steps of low nibbles, then one 4 VW-byte vector of the fifth bits, byte 4r + i
    holding in bit s the fifth bit of step s's low-nibble input and in bit 4 + s its
    high-nibble input's."""
    n, kp = codes.shape
    vw = vector_width
    if n % vw or kp % 32:
        return None
    c = codes.to(torch.uint8).reshape(n // vw, vw, kp // 32, 2, 4, 4)  # [tile, row, block, half, step, input]
    low = c & 15
    both = low[:, :, :, 0] | (low[:, :, :, 1] << 4)  # [tiles, row, block, step, input]
    nibbles = both.permute(0, 2, 3, 1, 4).reshape(n // vw, kp // 32, 4, vw * 4).contiguous()
    if not fifth:
        return nibbles
    bits = (c >> 4) << _fifth_bit_places()
    plane = bits.sum(dim=(3, 4), dtype=torch.uint8)  # [tile, row, block, input]: distinct bits, so the sum is their OR
    plane = plane.permute(0, 2, 1, 3).reshape(n // vw, kp // 32, 4 * vw)
    return torch.cat([nibbles.reshape(n // vw, kp // 32, 16 * vw), plane], dim=2).contiguous()


def _fifth_bit_places() -> torch.Tensor:
    """The bit of a fifth-bit byte that each (half, step) of a block's inputs takes: 4 half + step,
    [2, 4, 1] to broadcast over [..., half, step, input]."""
    return (torch.tensor([0, 4], dtype=torch.uint8).view(2, 1, 1) + torch.arange(4, dtype=torch.uint8).view(4, 1))


def fifth_bits(packed: torch.Tensor, vector_width: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Five-bit tiles (``pack_int4_q8(..., fifth=True)``) -> their fifth bits in input order,
    uint8 [N, K'] of 0 / 1, or those of the rows ``rows`` picks."""
    vw = vector_width
    t, c = packed.shape[:2]
    plane = packed.reshape(t, c, -1)[:, :, 16 * vw:20 * vw].reshape(t, c, vw, 4)  # [tile, block, row, input]
    plane = plane.permute(0, 2, 1, 3).reshape(t * vw, c, 4) if rows is None else plane[rows // vw, :, rows % vw]
    bits = (plane[:, :, None, None, :] >> _fifth_bit_places()) & 1  # [row, block, half, step, input]
    return bits.reshape(plane.shape[0], c * 32)


def tile_major(per_row: torch.Tensor, vector_width: int) -> torch.Tensor:
    """[N, G] per-row values (an int4 layer's group scales or zeros, a K-quant's factors) ->
    [N / VW, G, VW], the order int4_q8_rows and q6k_rows load them: one vector per tile and
    group. fp16 and byte values keep their type (Q4_F16's scales, the K-quant factors)."""
    n, g = per_row.shape
    keep = per_row if per_row.dtype in (torch.float16, torch.uint8, torch.int8) else per_row.float()
    return keep.reshape(n // vector_width, vector_width, g).permute(0, 2, 1).contiguous()


def inline_factors(tiles: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                   vector_width: int) -> torch.Tensor:
    """``Q4_F16``'s tiles: nibble tiles (:func:`pack_int4_q8`, four- or five-bit) with each 32-input
    block's fp16 scales (VW values), and its zeros unless symmetric, after its codes: uint8
    [N / VW, K' / 32, code bytes + 2 VW (+ 2 VW)]. One stream of memory a tile, as a GGUF file's
    blocks are: the kernel's single-row pass read codes and factors from two places, and the
    hardware prefetchers kept up with that worse (docs/performance.md, "Factors in the tiles")."""
    t, c = tiles.shape[:2]
    parts = [tiles.reshape(t, c, -1)] + [tile_major(f.to(torch.float16), vector_width).view(torch.uint8)
                                        for f in (scales, zeros) if f is not None]
    return torch.cat(parts, dim=2).contiguous()


def inlined_factors(packed: torch.Tensor, vector_width: int, form: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The inverse of :func:`inline_factors`' additions: ``Q4_F16`` tiles -> their fp16 (scales,
    zeros or None) [N / VW, K' / 32, VW], as :func:`tile_major` orders them."""
    vw = vector_width
    at = (20 if form & Q4_FIFTH else 16) * vw
    t, c = packed.shape[:2]
    flat = packed.reshape(t, c, -1)
    scales = flat[:, :, at:at + 2 * vw].contiguous().view(torch.float16)
    zeros = None if form & Q4_SYMMETRIC else flat[:, :, at + 2 * vw:at + 4 * vw].contiguous().view(torch.float16)
    return scales, zeros


def pack_kscales(d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, m: torch.Tensor,
                 vector_width: int) -> torch.Tensor:
    """Q4_K's factors (float16 d, dmin [N, S]; uint8 sc, m [N, 8 S], S super-blocks a row) ->
    the ``Q4_KSCALES`` layout int4_q8_rows reads, uint8 [N / VW, S, 20 VW]: per tile and
    super-block d and dmin (VW float16 each), then the 8 groups' sc (VW bytes each), then
    their m."""
    n, s = d.shape
    tiles = n // vector_width

    def per_tile(t: torch.Tensor) -> torch.Tensor:  # [N, S x j] -> [tiles, S, j VW values as bytes]
        return tile_major(t, vector_width).view(torch.uint8).reshape(tiles, s, -1)

    return torch.cat([per_tile(d.to(torch.float16)), per_tile(dmin.to(torch.float16)),
                      per_tile(sc.to(torch.uint8)), per_tile(m.to(torch.uint8))], dim=2).contiguous()


def pack_q6_tiles(q: torch.Tensor, sc: torch.Tensor, d: torch.Tensor,
                  vector_width: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Q6_K rows as codes (uint8 q [N, K], 0..63), sub-block scales (int8 sc [N, K / 16]) and
    super-block scales (float16 d [N, K / 256]) -> the tiles csrc/kquant_tiles.c's q6k_rows reads:
    codes uint8 [N / VW, K / 32, 24 VW] (per block the low nibbles in the int4 nibble packing,
    then two 4 VW-byte vectors of the top two bits: byte 4r + i, bits 2s..2s+1, step s's
    input i of row r, for the block's first 16 inputs and then its last 16) and scales uint8
    [N / VW, K / 256, 18 VW] (d as VW float16, then the 16 sub-blocks' sc, VW bytes each).
    None when N is not whole tiles."""
    n, k = q.shape
    vw = vector_width
    if n % vw or k % 256:
        return None
    nibbles = pack_int4_q8(q & 15, vw)
    assert nibbles is not None
    top = (q >> 4).to(torch.uint8).reshape(n // vw, vw, k // 32, 2, 4, 4)  # [tile, row, block, half, step, input]
    top = top[:, :, :, :, 0] | (top[:, :, :, :, 1] << 2) | (top[:, :, :, :, 2] << 4) | (top[:, :, :, :, 3] << 6)
    top = top.permute(0, 2, 3, 1, 4).reshape(n // vw, k // 32, 8 * vw)
    codes = torch.cat([nibbles.reshape(n // vw, k // 32, 16 * vw), top], dim=2).contiguous()
    d_tiles = tile_major(d.to(torch.float16), vw).view(torch.uint8)  # [tiles, S, 2 VW]
    sc_tiles = tile_major(sc.to(torch.int8), vw).view(torch.uint8).reshape(n // vw, k // 256, 16 * vw)
    return codes, torch.cat([d_tiles, sc_tiles], dim=2).contiguous()


def untile_int4_q8(packed: torch.Tensor, vector_width: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of :func:`pack_int4_q8`'s reordering: [N / VW, K' / 32, 4, 4 VW] (or
    [N / VW, K' / 32, 16 VW or more]: five-bit tiles, factors in the tiles; their first 16 VW
    bytes a block) bytes -> :func:`pack_int4`'s row-major bytes [N, K' / 2]: a
    row's bytes are the same in both, in the same order within it. ``rows``: only those rows
    (row r lives in tile r // VW at lane r % VW)."""
    t, c = packed.shape[:2]
    if packed.dim() == 3:  # five-bit tiles, factors in the tiles: their nibbles
        packed = packed[:, :, :16 * vector_width]
    steps = packed.reshape(t, c, 4, vector_width, 4)  # [tile, block, step, row, input]
    if rows is not None:
        return steps[rows // vector_width, :, :, rows % vector_width].reshape(rows.shape[0], c * 16)
    return steps.permute(0, 3, 1, 2, 4).reshape(t * vector_width, c * 16)


def unpack_q6_tiles(codes: torch.Tensor, scales: torch.Tensor, vector_width: int,
                    rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_q6_tiles`: its tiles -> (uint8 q [N, K], int8 sc [N, K / 16],
    float16 d [N, K / 256]), exactly; or those of the rows ``rows`` picks (a row lives in tile
    r // VW at lane r % VW: only its bytes are read)."""
    vw = vector_width
    t, c = codes.shape[:2]
    s = scales.shape[1]
    low = untile_int4_q8(codes[:, :, :16 * vw], vw, rows)  # the low nibbles, row-major
    top = codes[:, :, 16 * vw:].reshape(t, c, 2, vw, 4)  # [tile, block, half, row, input]
    d = scales[:, :, :2 * vw].contiguous().view(torch.float16)  # [tile, super-block, row]
    sc = scales[:, :, 2 * vw:].contiguous().view(torch.int8).reshape(t, s, 16, vw)
    if rows is None:
        top, d, sc = top.permute(0, 3, 1, 2, 4), d.permute(0, 2, 1), sc.permute(0, 3, 1, 2)
    else:
        tile, lane = rows // vw, rows % vw
        top, d, sc = top[tile, :, :, lane], d[tile, :, lane], sc[tile, :, :, lane]
    n = low.shape[0]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 1, 4, 1)
    high = (top.reshape(n, c, 2, 1, 4) >> shifts) & 3  # [row, block, half, step, input]
    q = unpack_int4(low) | (high.reshape(n, c * 32) << 4)
    return q, sc.reshape(n, s * 16).contiguous(), d.reshape(n, s).contiguous()


def int4_q8_form(scales: torch.Tensor, zeros: torch.Tensor, bits: int = 4,
                 group: int = 32) -> tuple[int, torch.Tensor, torch.Tensor | None]:
    """An int4 layer's nibble-packing scales and kernel zeros (``z - 8 s``, [N, G] each, groups of
    ``group`` inputs) -> its ``q4_form`` and the per-row arrays: no zeros when every zero is
    ``-8 s`` (``Q4_SYMMETRIC``: GGUF Q4_0, where the kernel takes the -8 on the activations'
    code sums), and fp16 in groups of 32 when that holds every value exactly (``Q4_F16``: Q4_0's
    own ``d``; :func:`inline_factors` puts them in the tiles), so a decode step reads the file's
    4.5 bits a weight rather than 6; else float32 (:func:`tile_major`). Five-bit codes (``bits``
    5: ``Q4_FIFTH``) are symmetric about 16 (GGUF Q5_0), and only in fp16 (the kernel's cases)."""
    form, kept = (Q4_FIFTH if bits == 5 else 0), [scales.float()]
    symmetric = bool(torch.equal(zeros.float(), -(2.0 ** (bits - 1)) * scales.float()))
    if not symmetric:
        kept.append(zeros.float())
    if group == 32 and all(bool(torch.equal(t.half().float(), t)) for t in kept):
        form |= Q4_F16 | (Q4_SYMMETRIC if symmetric else 0)
        kept = [t.half() for t in kept]
    elif symmetric and bits == 5:  # no float32 symmetric five-bit case: zeros kept
        kept.append(zeros.float())
    elif symmetric:
        form |= Q4_SYMMETRIC
    return form, kept[0], kept[1] if len(kept) > 1 else None


def unpack_int4(packed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of :func:`pack_int4`: [N, K / 2] bytes -> uint8 codes [N, K] (into ``out``)."""
    n, half = packed.shape
    dst = out if out is not None else torch.empty((n, 2 * half), dtype=torch.uint8, device=packed.device)
    chunks = dst.view(n, half // 16, 2, 16)
    src = packed.view(n, half // 16, 16)
    chunks[:, :, 0].copy_(src).bitwise_and_(15)
    chunks[:, :, 1].copy_(src).bitwise_right_shift_(4)
    return dst


def linear(desc: TmLinear, x: torch.Tensor, library: KernelLibrary | None = None) -> torch.Tensor | None:
    """``desc`` applied to float32 CPU rows x [B, k] (unit inner stride) -> a new float32
    [B, n] tensor; None when the kernels are off or cannot take it (the caller uses torch)."""
    if not (x.device.type == "cpu" and x.dtype == torch.float32 and _rows_ok(x) and x.shape[1] == desc.k):
        return None
    lib = _enabled_library(library)
    if lib is None:
        return None
    out = torch.empty((x.shape[0], desc.n), dtype=torch.float32)
    rc = lib.cdll.tm_linear(ctypes.addressof(desc), x.data_ptr(), max(x.stride(0), desc.k), x.shape[0],
                            out.data_ptr(), desc.n, torch.get_num_threads())
    if rc == 1:
        return None
    _raise_for(rc, "linear", "bad layer description")
    return out

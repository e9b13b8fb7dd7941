"""How the engine runs a step, read once: the environment switches in one frozen object.

Every ``TOKENMILL_*`` switch that changes how a step runs (which kernels, which
attention backend, which step executors) is read here, once, when an engine
config is made (``EngineConfig.kernel_options``), and validated: a bad value
is an error at start, naming the variable. engine/ and model/ receive this
object and read no environment themselves, so what was decided at build is
what every step does.

| variable | field | default |
|---|---|---|
| ``TOKENMILL_CPU_KERNELS=0`` | ``cpu_kernels`` | on: the C kernels (attention, elementwise, quantized matmuls) |
| ``TOKENMILL_KERNEL_ISA`` | ``kernel_isa`` | ``native``; ``avx512`` (native without AMX), ``avx2``, ``portable``; follows ``ATEN_CPU_CAPABILITY=avx2/default`` |
| ``TOKENMILL_KERNEL_CACHE`` | ``kernel_cache`` | ``~/.cache/tokenmill/kernels`` |
| ``TOKENMILL_ATTENTION=reference`` | ``attention`` | ``auto``: the fastest backend for the device |
| ``TOKENMILL_BATCHED_PREFILL=0`` | ``batched_prefill`` | on (GPU: prefill chunks in one padded call) |
| ``TOKENMILL_FUSED_DECODE=0`` | ``fused_decode`` | on (CPU: a decode step in one native call) |
| ``TOKENMILL_FUSED_DECODE_MAX_BATCH`` | ``fused_decode_max_batch`` | per weight kind |
| ``TOKENMILL_FUSED_PREFILL=0`` | ``fused_prefill`` | on (CPU: steps with prefill chunks through the same native call, for int8 layers (int4 on AVX2) and an unquantized KV pool) |
| ``TOKENMILL_ONEDNN_LINEAR=0`` | ``onednn_linear`` | on (float32 CPU linears through oneDNN) |
| ``TOKENMILL_CUDA_GRAPHS=0`` | ``cuda_graphs`` | on (CUDA: decode steps replay graphs) |
| ``TOKENMILL_CUDA_GRAPH_MAX_BATCH`` | ``cuda_graph_max_batch`` | 256 |
| ``TOKENMILL_HUGE_PAGES=0`` | ``huge_pages`` | on (KV pool on transparent huge pages) |
| ``TOKENMILL_TP_TIMEOUT`` | ``tp_step_timeout_s`` | 60 s: a tensor-parallel collective's limit |
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ISAS = ("native", "avx512", "avx2", "portable")
ATTENTION_BACKENDS = ("auto", "reference")
DEFAULT_CUDA_GRAPH_MAX_BATCH = 256
DEFAULT_TP_STEP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class KernelOptions:
    """The switches of how a step runs; see the module docstring for the variables."""

    cpu_kernels: bool = True
    kernel_isa: str = "native"
    kernel_cache: Path | None = None
    attention: str = "auto"
    batched_prefill: bool = True
    fused_decode: bool = True
    fused_decode_max_batch: int | None = None
    fused_prefill: bool = True
    onednn_linear: bool = True
    cuda_graphs: bool = True
    cuda_graph_max_batch: int = DEFAULT_CUDA_GRAPH_MAX_BATCH
    huge_pages: bool = True
    tp_step_timeout_s: float = DEFAULT_TP_STEP_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.kernel_isa not in ISAS:
            raise ValueError(f"kernel ISA {self.kernel_isa!r}: choose one of {', '.join(ISAS)}")
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention backend {self.attention!r}: choose one of {', '.join(ATTENTION_BACKENDS)}")
        if self.fused_decode_max_batch is not None and self.fused_decode_max_batch < 0:
            raise ValueError("fused decode max batch must be >= 0")
        if self.cuda_graph_max_batch < 1:
            raise ValueError("CUDA graph max batch must be >= 1")
        if self.tp_step_timeout_s <= 0:
            raise ValueError("tensor-parallel step timeout must be > 0")

    @property
    def kernel_cache_dir(self) -> Path:
        return self.kernel_cache or Path.home() / ".cache" / "tokenmill" / "kernels"

    def replace(self, **changes: object) -> "KernelOptions":
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "KernelOptions":
        """Read the switches from ``env`` (the process environment by default)."""
        env = os.environ if env is None else env
        return cls(
            cpu_kernels=_switch(env, "TOKENMILL_CPU_KERNELS"),
            kernel_isa=_isa(env),
            kernel_cache=Path(env["TOKENMILL_KERNEL_CACHE"]).expanduser() if env.get("TOKENMILL_KERNEL_CACHE")
            else None,
            attention=_choice(env, "TOKENMILL_ATTENTION", ATTENTION_BACKENDS),
            batched_prefill=_switch(env, "TOKENMILL_BATCHED_PREFILL"),
            fused_decode=_switch(env, "TOKENMILL_FUSED_DECODE"),
            fused_decode_max_batch=_int(env, "TOKENMILL_FUSED_DECODE_MAX_BATCH", None),
            fused_prefill=_switch(env, "TOKENMILL_FUSED_PREFILL"),
            onednn_linear=_switch(env, "TOKENMILL_ONEDNN_LINEAR"),
            cuda_graphs=_switch(env, "TOKENMILL_CUDA_GRAPHS"),
            cuda_graph_max_batch=_int(env, "TOKENMILL_CUDA_GRAPH_MAX_BATCH", DEFAULT_CUDA_GRAPH_MAX_BATCH) or 1,
            huge_pages=_switch(env, "TOKENMILL_HUGE_PAGES"),
            tp_step_timeout_s=_float(env, "TOKENMILL_TP_TIMEOUT", DEFAULT_TP_STEP_TIMEOUT_S),
        )


def bundled_model_override(env: Mapping[str, str] | None = None) -> str | None:
    """``TOKENMILL_DEFAULT_MODEL``: a file to serve in place of the bundled model."""
    value = (os.environ if env is None else env).get("TOKENMILL_DEFAULT_MODEL", "").strip()
    return value or None


def _switch(env: Mapping[str, str], name: str) -> bool:
    """An on/off switch that defaults to on: off for 0, false, no, off."""
    return env.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str:
    value = env.get(name, "").strip().lower() or choices[0]
    if value not in choices:
        raise ValueError(f"{name}={value!r}: choose one of {', '.join(choices)}")
    return value


def _isa(env: Mapping[str, str]) -> str:
    """``TOKENMILL_KERNEL_ISA``; unset, it follows torch's ``ATEN_CPU_CAPABILITY`` when that
    narrows torch to AVX2 or less, so one variable makes the whole process the narrower machine."""
    name = env.get("TOKENMILL_KERNEL_ISA", "").strip().lower()
    if not name:
        aten = env.get("ATEN_CPU_CAPABILITY", "").strip().lower()
        name = {"avx2": "avx2", "default": "portable"}.get(aten, "native")
    if name not in ISAS:
        raise ValueError(f"TOKENMILL_KERNEL_ISA={name!r}: choose one of {', '.join(ISAS)}")
    return name


def _int(env: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a whole number") from None


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None

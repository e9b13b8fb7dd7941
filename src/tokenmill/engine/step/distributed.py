"""Tensor parallelism across processes on ``torch.distributed``.

Rank 0 is the engine's own process (the driver): it keeps the scheduler, the
block tables and the prefix cache, and runs every step through the same eager
step a single device runs (``eager.EagerStep``: prompt logprobs, speculative
verify rows, grammar-constrained rows alike); the group adds one hook to it,
``ParallelRunner.share``, which broadcasts the step's layout (``StepInputs``
without the requests, plus the rows scoring prompts) before the driver's
forward. Ranks 1..N-1 are worker processes started and supervised here; each
loads only its slices of the weights from the checkpoint
(``model/parallel.py``), holds its share of the KV pool (the same block ids,
its own KV heads), and ``follow``s every layout it receives through the same
forward and the same LM-head calls. Logits are gathered on rank 0, which
samples and turns prompt logits into logprobs. LoRA adapters are refused at
build time (``engine/adapters.py``): only the driver would hold them.

Two process groups: the default one (gloo on CPU, NCCL on CUDA) carries the
model's all-reduces and the logit gather under a short timeout, so a stuck
peer cannot hang a step; a gloo "control" group carries the step layouts and
has a long timeout, because a worker waits on it whenever the server is idle.

Failure: a watchdog thread in the driver waits on the workers' process
sentinels. A worker that dies fails the step in flight (its peers' collectives
raise), marks the group failed (every later step raises at once) and calls the
``on_failure`` hooks; ``supervise_server`` uses one to turn /health to 503,
answer open requests with 503 and stop the server with a non-zero exit. A
worker whose driver dies exits on its own (parent watchdog).

The fused CPU decode step and CUDA graphs run the whole model in one call, with
no place for the all-reduces, so a tensor-parallel runner takes the eager path
(logged once at startup: ``executor_note``); the C attention kernels work per
head and run on each rank's local heads, the quantized layers' kernels on each
rank's shard.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from ...settings.config import EngineConfig, parse_dtype
from ...model import parallel
from ...model.models.architectures import model_class
from ...model.models.llama import LlamaForCausalLM
from ...model.attention import StepLayout
from ...model.loader import LoadedModel
from .eager import StepInputs, StepItems, StepResult
from .executors import Kernels, choose_kernels
from .runner import ModelRunner
from .step_batch import StepBatch

log = logging.getLogger("tokenmill.tp")

CONTROL_TIMEOUT = timedelta(days=7)  # an idle server's workers wait this long for the next step


class TensorParallelError(RuntimeError):
    """A rank of the tensor-parallel group failed; the replica cannot continue."""


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r uses cuda:r on CUDA; every rank uses the CPU otherwise."""
    dev = torch.device(device)
    return torch.device("cuda", rank) if dev.type == "cuda" else dev


def _step_timeout(config: EngineConfig) -> timedelta:
    return timedelta(seconds=config.kernel_options.tp_step_timeout_s)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _join_group(rank: int, size: int, port: int, config: EngineConfig) -> tuple[parallel.TPInfo, Any]:
    dist.init_process_group(backend_for(config.device), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=_step_timeout(config))
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return parallel.TPInfo(rank, size, None), control


def _join_watching(procs: list[Any], size: int, port: int, config: EngineConfig) -> tuple[parallel.TPInfo, Any]:
    """Rank 0 joins the group while watching the workers: one that dies before joining
    (an import error, no memory) fails startup at once instead of after the timeout."""
    joined: dict[str, Any] = {}

    def join() -> None:
        try:
            joined["group"] = _join_group(0, size, port, config)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            joined["error"] = exc

    thread = threading.Thread(target=join, name="tokenmill-tp-join", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
        dead = [(rank, p) for rank, p in enumerate(procs, start=1) if p.exitcode is not None]
        if dead and thread.is_alive():
            rank, proc = dead[0]
            raise TensorParallelError(f"tensor-parallel worker rank {rank} exited with code {proc.exitcode} "
                                      "while starting (see its log above)")
    if "error" in joined:
        raise joined["error"]
    return joined["group"]


def threads_per_rank(config: EngineConfig) -> int:
    """Intra-op threads of each rank: the configured count, else the cores split evenly."""
    if config.num_threads:
        return int(config.num_threads)
    return max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)


# --------------------------------------------------------------------------- the model of one rank


def build_rank_model(config: EngineConfig, loaded: LoadedModel, tp: parallel.TPInfo,
                     device: torch.device, control: Any = None) -> LlamaForCausalLM | None:
    """One rank's shard of the decoder, as the engine builds a whole one (workers use this;
    the driver goes through the engine with the same hooks). None: the driver stopped
    the group before the model was finished."""
    cfg = loaded.config
    dtype = parse_dtype(config.dtype)
    max_len = config.scheduler.max_model_len or cfg.max_position_embeddings
    with torch.device("meta"):
        model = model_class(cfg)(cfg, max_positions=max_len)
    parallel.shard_model(model, tp)
    model = model.to_empty(device=device).to(dtype)
    model.reset_rope(max_len, device)
    model.load_weights(loaded.weights)
    if str(config.quantization).lower() == "w8a8" and control is not None:
        tokens = _receive_calibration(control)
        if tokens is None:
            return None
        from ..loading import smooth_for_int8

        with torch.inference_mode():
            done = smooth_for_int8(model, tokens, config.cache.block_size, dtype, device,
                                   choose_kernels(device, config.kernel_options))
        log.info("w8a8: smoothed %d projections of rank %d's shard on %d calibration tokens", done, tp.rank,
                 len(tokens))
    quantize_shard(model, loaded, config, tp)
    return model.eval()


def _receive_calibration(control: Any) -> list[int] | None:
    """The driver's calibration tokens (``TensorParallelGroup.share_calibration``); None
    when the driver sent the stop message instead."""
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=control)
    if box[0] is None:
        return None
    dist.barrier(group=control)
    return list(box[0])


def quantize_shard(model: LlamaForCausalLM, loaded: LoadedModel, config: EngineConfig, tp: parallel.TPInfo) -> None:
    if config.quantization in ("none", None):
        return
    from ...model.quant.quant import quantize_model

    quantize_model(model, loaded, config)
    parallel.rewrap_quantized(model, tp)


# --------------------------------------------------------------------------- the runner


@dataclass
class _Layout:
    """What a worker needs of a step: the tensors of ``StepInputs`` without the requests."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    layout: StepLayout  # on the CPU; each rank's attention backend prepares it for itself
    logits_rows: torch.Tensor
    prompt_spans: list[tuple[int, int]]  # (first row, row count) of each request scoring its prompt


class ParallelRunner(ModelRunner):
    """A ``ModelRunner`` on one rank's shard, on the eager step (``eager.EagerStep``). On the
    driver the eager step ``share``s each step's layout before running its part; on a
    worker ``serve`` follows the layouts until told to stop."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, kernels: Kernels, tp: parallel.TPInfo, control: Any,
                 group: "TensorParallelGroup | None" = None) -> None:
        self.tp = tp
        self.control = control
        self.group = group
        self.broadcast_s = 0.0  # driver: seconds spent handing layouts to the workers
        super().__init__(model, num_blocks, block_size, dtype, device, kernels, eager_only=True,
                         group=self if tp.rank == 0 else None)

    def execute(self, step: StepBatch | StepItems) -> StepResult:
        """The step on every rank; a failed collective says which rank died."""
        if self.group is not None and self.group.failure is not None:
            raise TensorParallelError(self.group.failure)
        try:
            return super().execute(step)
        except RuntimeError as exc:
            raise TensorParallelError(self._failure_reason() or f"tensor-parallel step failed: {exc}") from exc

    def share(self, inputs: StepInputs) -> None:
        """``LayoutShare``: hand the step's layout to the workers, before the driver's forward."""
        layout = _Layout(inputs.input_ids.cpu(), inputs.positions.cpu(), inputs.attn.layout.to(torch.device("cpu")),
                         inputs.logits_rows.cpu(), [(p.row, p.count) for p in inputs.prompt_rows])
        started = time.perf_counter()
        dist.broadcast_object_list([layout], src=0, group=self.control)
        self.broadcast_s += time.perf_counter() - started

    def _failure_reason(self, wait_s: float = 1.0) -> str | None:
        """Which rank died, once the watchdog has seen it (a peer's collective usually
        fails a moment before the process sentinel fires)."""
        deadline = time.monotonic() + wait_s
        while self.group is not None and self.group.failure is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.group.failure if self.group is not None else None

    def serve(self) -> None:
        """Worker loop: follow every broadcast layout; return on the stop message (None)."""
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=self.control)
            layout = box[0]
            if layout is None:
                return
            with torch.inference_mode():
                dev = self.device
                inputs = StepInputs(layout.input_ids.to(dev), layout.positions.to(dev),
                                    self.attention.prepare(layout.layout.to(dev)), layout.logits_rows.to(dev), [])
                self.eager.follow(inputs, layout.prompt_spans)


def executor_note(device: torch.device) -> str:
    """The startup line saying which step executor tensor parallelism gives up, and why."""
    skipped = "CUDA graphs are" if torch.device(device).type == "cuda" else "the fused CPU decode step is"
    return (f"eager forward on every rank; {skipped} off (it runs the whole model in one call, with no place "
            "for the all-reduces between layers)")


def _memory_report(runner: ModelRunner) -> tuple[int, int]:
    return parallel.tensor_bytes(runner.model), runner.kv_cache_bytes


# --------------------------------------------------------------------------- worker processes


@dataclass
class _WorkerSpec:
    rank: int
    size: int
    port: int
    config: EngineConfig
    shard: LoadedModel | None  # given for in-memory models; None: read from config.model
    parent_pid: int


def _watch_parent(parent_pid: int) -> None:
    """Exit when the driver is gone (its collectives may never come)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(3)


def _worker_main(spec: _WorkerSpec) -> None:
    # Ctrl-C reaches the whole process group; the driver decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s tp-rank{spec.rank}: %(message)s")
    threading.Thread(target=_watch_parent, args=(spec.parent_pid,), daemon=True).start()
    config = spec.config
    torch.set_num_threads(threads_per_rank(config))
    device = rank_device(config.device, spec.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tp, control = _join_group(spec.rank, spec.size, spec.port, config)
    try:
        loaded = spec.shard or parallel.load_shard(config.model, parse_dtype(config.dtype), spec.rank, spec.size)
        model = build_rank_model(config, loaded, tp, device, control)
        del loaded
        if model is None:
            dist.destroy_process_group()
            return
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=control)  # the pool's geometry, from the driver
        num_blocks, block_size = box[0]
        runner = ParallelRunner(model, num_blocks, block_size, parse_dtype(config.dtype), device,
                                choose_kernels(device, config.kernel_options), tp, control)
        dist.gather_object(_memory_report(runner), None, dst=0, group=control)
        runner.serve()
    except Exception:  # noqa: BLE001 - a worker that cannot go on must end, loudly
        log.exception("tensor-parallel rank %d failed", spec.rank)
        os._exit(1)
    dist.destroy_process_group()


# --------------------------------------------------------------------------- the driver's view


@dataclass
class RankMemory:
    rank: int
    weight_bytes: int
    kv_bytes: int


class TensorParallelGroup:
    """The driver's handle on the group: its own shard, the workers, their health."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel, tp: parallel.TPInfo, control: Any,
                 procs: list[multiprocessing.process.BaseProcess]) -> None:
        self.config = config
        self.loaded: LoadedModel | None = loaded  # rank 0's shard until the engine has built from it
        self.tp = tp
        self.control = control
        self.procs = procs
        self.failure: str | None = None
        self.memory: list[RankMemory] = []
        self.runner: ParallelRunner | None = None
        self._closing = False
        self._hooks: list[Callable[[str], None]] = []
        self._watchdog = threading.Thread(target=self._watch, name="tokenmill-tp-watchdog", daemon=True)
        self._watchdog.start()

    @classmethod
    def start(cls, config: EngineConfig, loaded: LoadedModel | None) -> "TensorParallelGroup":
        """Check the model splits, start ranks 1..N-1, join the group as rank 0 and read
        rank 0's shard. ``loaded``: an in-memory model (tests) whose shards are handed to
        the workers; None: every rank reads its own slices from ``config.model``."""
        size = config.tensor_parallel_size
        device = torch.device(config.device)
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs; "
                             f"{torch.cuda.device_count()} are visible")
        cfg = loaded.config if loaded is not None else parallel.read_config(_model_path(config))
        parallel.check_divisible(cfg, size)
        _settle_quantization(config, cfg, _tensor_types(config, loaded))
        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel group is already running in this process; close it first")
        torch.set_num_threads(threads_per_rank(config))
        port = _free_port()
        ctx = multiprocessing.get_context("spawn")
        procs = []
        for rank in range(1, size):
            shard = parallel.shard_loaded(loaded, rank, size) if loaded is not None else None
            spec = _WorkerSpec(rank, size, port, config, shard, os.getpid())
            proc = ctx.Process(target=_worker_main, args=(spec,), name=f"tokenmill-tp{rank}", daemon=True)
            proc.start()
            procs.append(proc)
        try:
            tp, control = _join_watching(procs, size, port, config)
            shard = (parallel.shard_loaded(loaded, 0, size) if loaded is not None
                     else parallel.load_shard(config.model, parse_dtype(config.dtype), 0, size))
        except BaseException:
            for proc in procs:
                proc.kill()
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        log.info("tensor parallel: %d ranks on %s (%s), %d threads each; worker pids %s", size, config.device,
                 backend_for(config.device), threads_per_rank(config), [p.pid for p in procs])
        group = cls(config, shard, tp, control, procs)
        atexit.register(group.close)  # before multiprocessing's own handler kills daemonic workers
        return group

    # -- engine hooks ------------------------------------------------------
    def shard_model(self, model: LlamaForCausalLM) -> None:
        """Engine hook: make the freshly built (meta) model this rank's shard."""
        parallel.shard_model(model, self.tp)

    def share_calibration(self, tokens: list[int]) -> None:
        """Engine hook (w8a8): hand the workers the calibration tokens and wait until every
        rank's model is loaded, so the smoothing forwards, whose all-reduces have the short
        step timeout, start together on every rank. Each rank then smooths its own shard:
        its norms feed only its own q/k/v and gate/up rows, so its factors may differ."""
        dist.broadcast_object_list([list(tokens)], src=0, group=self.control)
        dist.barrier(group=self.control)

    def after_quantize(self, model: LlamaForCausalLM) -> None:
        parallel.rewrap_quantized(model, self.tp)

    def make_runner(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, dtype: torch.dtype,
                    device: torch.device, kernels: Kernels) -> ParallelRunner:
        """Engine hook: tell the workers the pool's geometry, build rank 0's runner and
        collect every rank's memory."""
        self.loaded = None  # the weights now live in the model
        dist.broadcast_object_list([(num_blocks, block_size)], src=0, group=self.control)
        runner = ParallelRunner(model, num_blocks, block_size, dtype, device, kernels, self.tp, self.control, self)
        reports: list[Any] = [None] * self.tp.size
        dist.gather_object(_memory_report(runner), reports, dst=0, group=self.control)
        self.memory = [RankMemory(rank, w, kv) for rank, (w, kv) in enumerate(reports)]
        for m in self.memory:
            log.info("tensor parallel rank %d/%d: weights %.1f MiB, kv pool %.1f MiB (%d blocks)", m.rank,
                     self.tp.size, m.weight_bytes / 2**20, m.kv_bytes / 2**20, num_blocks)
        log.info("tensor parallel: %s", executor_note(device))
        self.runner = runner
        return runner

    # -- health ------------------------------------------------------------
    def on_failure(self, hook: Callable[[str], None]) -> None:
        """Call ``hook(reason)`` (from the watchdog thread) when a worker dies."""
        self._hooks.append(hook)
        if self.failure is not None:
            hook(self.failure)

    def _watch(self) -> None:
        pending = {p.sentinel: (rank, p) for rank, p in enumerate(self.procs, start=1)}
        while pending and not self._closing:
            ready = multiprocessing.connection.wait(list(pending), timeout=0.5)
            for sentinel in ready:
                rank, proc = pending.pop(sentinel)  # type: ignore[index]
                if self._closing:
                    return
                proc.join(0.1)
                self._fail(f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}")
                return

    def _fail(self, reason: str) -> None:
        if self.failure is not None:
            return
        self.failure = reason
        log.error("%s; this replica cannot continue", reason)
        for hook in self._hooks:
            try:
                hook(reason)
            except Exception:  # noqa: BLE001 - every hook gets its turn
                log.exception("tensor-parallel failure hook failed")
        for proc in self.procs:  # the survivors cannot do anything useful without it
            if proc.is_alive():
                proc.kill()

    def _send_stop(self) -> None:
        try:
            dist.broadcast_object_list([None], src=0, group=self.control)
        except RuntimeError:
            log.warning("tensor parallel: workers did not take the stop message")

    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers and leave the group; idempotent."""
        if self._closing:
            return
        self._closing = True
        if self.failure is None and dist.is_initialized():
            # In a thread: at interpreter exit a step may still hold the group; never wait on it.
            stop = threading.Thread(target=self._send_stop, daemon=True)
            stop.start()
            stop.join(timeout / 2)
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except RuntimeError:
                pass


def startup_problem(config: EngineConfig) -> str | None:
    """Why ``config`` cannot start a tensor-parallel group (the model's heads do not split,
    a quantization mode it does not take, too few GPUs), or None: for a one-line error
    from the command line before anything is loaded."""
    if config.tensor_parallel_size <= 1:
        return None
    try:
        cfg = parallel.read_config(_model_path(config))
        parallel.check_divisible(cfg, config.tensor_parallel_size)
        types = _tensor_types(config, None)
        mode = parallel.resolve_auto(config.quantization, cfg, config.tensor_parallel_size, types)[0]
        parallel.check_quantization(mode, cfg, config.tensor_parallel_size, config.quant_group_size, types)
    except (ValueError, OSError) as exc:
        return str(exc)
    if torch.device(config.device).type == "cuda" and torch.cuda.device_count() < config.tensor_parallel_size:
        return (f"tensor_parallel_size {config.tensor_parallel_size} needs as many GPUs; "
                f"{torch.cuda.device_count()} are visible")
    return None


def _tensor_types(config: EngineConfig, loaded: LoadedModel | None) -> dict[str, str]:
    """The checkpoint's storage type per tensor (GGUF block types decide how o/down may split)."""
    if loaded is not None:
        return {**loaded.quant_types, **{name: entry[0] for name, entry in loaded.raw_quantized.items()}}
    return parallel.block_types(_model_path(config))


def _settle_quantization(config: EngineConfig, cfg: Any, types: dict[str, str]) -> None:
    """Resolve ``auto`` once, here, so every rank builds the same layers, and refuse a mode
    whose groups a rank's share would cut, before any worker starts."""
    size = config.tensor_parallel_size
    mode, why = parallel.resolve_auto(config.quantization, cfg, size, types)
    if why != "as asked":
        log.info("tensor parallel: quantization %s (%s)", mode, why)
    parallel.check_quantization(mode, cfg, size, config.quant_group_size, types)
    config.quantization = mode


def _model_path(config: EngineConfig) -> str:
    if config.model is not None:
        return os.fspath(config.model)
    from ...files.bundled import default_model_path

    return default_model_path()


class FailableEngine(Protocol):
    """The async engine as the supervisor sees it: something a fault can be reported to."""

    def fail(self, reason: str) -> None: ...


class StoppableServer(Protocol):
    """The HTTP server as the supervisor sees it (uvicorn.Server): a flag that stops it."""

    should_exit: bool


def supervise_server(group: TensorParallelGroup, aengine: FailableEngine, server: StoppableServer,
                     grace_s: float = 1.0, hard_exit_s: float = 20.0) -> None:
    """A dead rank ends the server: /health answers 503 and open requests get a 503 at once
    (``aengine.fail``), uvicorn stops ``grace_s`` later so those answers go out, and the
    caller exits non-zero (``group.failure`` is set). Should shutting down itself hang,
    the process exits with status 1 after ``hard_exit_s``."""

    def failed(reason: str) -> None:
        aengine.fail(reason)

        def stop() -> None:
            time.sleep(grace_s)
            server.should_exit = True
            time.sleep(hard_exit_s)
            log.error("shutdown after a tensor-parallel failure did not finish; exiting")
            os._exit(1)

        threading.Thread(target=stop, name="tokenmill-tp-stop", daemon=True).start()

    group.on_failure(failed)

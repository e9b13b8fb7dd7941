"""Building an engine: every choice resolved once, then the model, the pool and the parts.

``build_engine`` takes the caller's ``EngineConfig`` and leaves it as it was: it
works on a copy in which every ``auto`` is replaced by what it resolved to on
this machine (dtype, quantization, KV pool dtype, the step's token budget), and
returns that copy with the parts built on it (``EngineParts``). ``LLMEngine``
keeps the parts; ``engine.config`` is the resolved configuration, which the
server's startup line and its stats page report.

Order matters where a choice depends on another: the dtype (and the token
budget) first, from the device; tensor-parallel workers start with it; the
quantization once the model file is read (it depends on what the file holds);
the KV pool dtype from both; the pool's size once the weights are on the device.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..settings.config import EngineConfig, ModelConfig, parse_dtype
from ..model.quant.kv_quant import resolve_kv_dtype
from ..model.models.llama import LlamaForCausalLM
from ..model.loader import LoadedModel, load_model
from ..files.tokenizer import Tokenizer
from . import adapters, auto
from .kv.block_pool import BlockPool
from .spec.draft import DraftModelProposer
from .step.executors import Kernels, choose_kernels
from .kv.host_memory import release_freed_heap
from .loading import build_model, calibration_text, weight_bytes
from .kv.prefix_cache import PrefixCache
from .step.runner import ModelRunner, num_blocks_for_budget
from .sched.scheduler import Scheduler
from .spec.speculative import SpeculativeConfig, Speculator
from .grammar.structured import StructuredOutputs

if TYPE_CHECKING:
    from .step.distributed import TensorParallelGroup

log = logging.getLogger("tokenmill.engine")


@dataclass
class EngineParts:
    """An engine's parts, built on ``config``: the resolved configuration (no ``auto`` left)."""

    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    parallel: "TensorParallelGroup | None"
    tokenizer: Tokenizer
    model_config: ModelConfig
    max_model_len: int
    kernels: Kernels
    model: LlamaForCausalLM
    weight_bytes: int
    block_size: int
    prefix_cache: PrefixCache | None
    pool: BlockPool
    scheduler: Scheduler
    runner: ModelRunner
    structured: StructuredOutputs
    speculator: Speculator | None


def build_engine(config: EngineConfig, loaded: LoadedModel | None = None,
                 tokenizer: Tokenizer | None = None) -> EngineParts:
    """Resolve ``config`` for this machine (a copy; the caller's is not touched) and build
    the model, the KV pool and every part of an engine on it."""
    config = dataclasses.replace(config, cache=dataclasses.replace(config.cache),
                                 scheduler=dataclasses.replace(config.scheduler))
    # what can be wrong with the configuration is said now, not after minutes of loading
    config.speculative_config = SpeculativeConfig.parse(config.speculative_config)
    problems = config.grammar_limits.problems()
    if problems:
        raise ValueError("grammar limits: " + "; ".join(problems))
    if config.cache.kv_offload_bytes and config.cache.enable_prefix_caching:
        check_disk_tier(config)
    torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
    device = torch.device(config.device)
    dtype_choice = _resolve_before_load(config, device)
    dtype = parse_dtype(config.dtype)
    # Tensor parallelism: workers started, this process is rank 0 and holds its shard only.
    parallel: TensorParallelGroup | None = None
    if config.tensor_parallel_size > 1:
        from .step.distributed import TensorParallelGroup

        parallel = TensorParallelGroup.start(config, loaded)
        loaded = parallel.loaded
    loaded = loaded or load_model(config.model, dtype=dtype)
    _resolve_after_load(config, loaded, device, dtype, dtype_choice)
    tokenizer = tokenizer or Tokenizer.from_model_path(config.model)
    max_len = config.scheduler.max_model_len or loaded.config.max_position_embeddings
    calibration = tokenizer.encode(calibration_text()) if str(config.quantization).lower() == "w8a8" else None
    # What steps run on (C kernels or torch, the model's ops), decided once, here.
    kernels = choose_kernels(device, config.kernel_options)
    model = build_model(loaded, config, device, dtype, max_len, calibration, parallel, kernels)
    model.use_ops(kernels.ops)  # now, so that layouts the kernels read count as weights
    release_freed_heap()  # the load's conversion scratch, before the KV pool is sized and made
    weights = weight_bytes(model)
    if config.enable_lora:  # every targeted projection behind a LoRA wrapper (model/lora/lora.py)
        adapters.attach(model, config, device, dtype, parallel is not None)
    log.info("model weights take %.1f MiB in memory", weights / 2**20)
    kv_dtype = resolve_kv_dtype(config.cache.kv_cache_dtype, dtype)
    if kv_dtype != dtype and parallel is not None:
        raise ValueError(f"kv_cache_dtype {config.cache.kv_cache_dtype} is not supported with tensor parallelism "
                         "yet; use auto")
    num_blocks = pool_blocks(config, loaded.config, kv_dtype, weights, max_len, device)
    block_size = config.cache.block_size
    prefix_cache = PrefixCache(block_size) if config.cache.enable_prefix_caching else None
    pool = BlockPool(num_blocks, prefix_cache)
    runner = (ModelRunner(model, num_blocks, block_size, dtype, device, kernels, kv_dtype=kv_dtype)
              if parallel is None else parallel.make_runner(model, num_blocks, block_size, dtype, device, kernels))
    log.info("steps run on: %s", ", ".join(e.name for e in runner.executors))
    if config.cache.kv_offload_bytes and prefix_cache is not None:
        attach_disk_tier(config, prefix_cache, runner, parallel is not None, kv_dtype)
    return EngineParts(
        config=config, device=device, dtype=dtype, kv_dtype=kv_dtype, parallel=parallel, tokenizer=tokenizer,
        model_config=loaded.config, max_model_len=max_len, kernels=kernels, model=model, weight_bytes=weights,
        block_size=block_size, prefix_cache=prefix_cache, pool=pool,
        scheduler=Scheduler(config.scheduler, block_size, pool, prefix_cache, device_type=device.type,
                            kv_window=model.kv_window()),
        runner=runner,
        structured=StructuredOutputs(tokenizer, loaded.config.vocab_size, sorted(tokenizer.eos_token_ids),
                                     limits=config.grammar_limits),
        speculator=build_speculator(config, loaded.config.vocab_size, device, max_len, kernels, tokenizer))


def check_disk_tier(config: EngineConfig) -> None:
    """What can be wrong with the disk tier's folder (another process holds it, it is not
    ours, too little room), said before the model loads; ``attach_disk_tier`` holds it later."""
    from .kv.tier_files import TierFolder

    if config.tensor_parallel_size > 1:
        raise ValueError("--kv-offload-bytes is not supported with tensor parallelism yet")
    if not config.cache.kv_offload_dir:
        raise ValueError("--kv-offload-bytes needs --kv-offload-dir (a local folder)")
    folder = TierFolder.open(config.cache.kv_offload_dir)
    try:
        folder.check_room(int(config.cache.kv_offload_bytes or 0))
    finally:
        folder.close()


def attach_disk_tier(config: EngineConfig, prefix_cache: PrefixCache, runner: ModelRunner, parallel: bool,
                     kv_dtype: torch.dtype) -> None:
    """The prefix cache's second tier on disk (engine/kv/kv_tier.py), with what a previous process
    of the same model left there."""
    from .kv.kv_tier import BlockIO, DiskTier, TierIdentity, model_digest

    if parallel:
        raise ValueError("--kv-offload-bytes is not supported with tensor parallelism yet")
    folder = config.cache.kv_offload_dir
    if not folder:
        raise ValueError("--kv-offload-bytes needs --kv-offload-dir (a local folder)")
    io = BlockIO(runner.kv_caches)
    identity = TierIdentity(model=model_digest(config.model), dtype=str(config.dtype), kv_dtype=str(kv_dtype),
                            block_size=config.cache.block_size, shapes=io.shapes())
    tier = DiskTier(folder, config.cache.kv_offload_bytes, io, identity)
    adopted = prefix_cache.attach_tier(tier)
    log.info("KV disk tier: %d slots of %d bytes in %s; %d blocks kept from before%s", tier.num_slots,
             io.block_bytes, folder, adopted, f" ({tier.stats.torn_blocks} torn, dropped)" if tier.stats.torn_blocks
             else "")


def _resolve_before_load(config: EngineConfig, device: torch.device) -> tuple[str, str]:
    """The token budget and the dtype (what the model is loaded in); returns the dtype's
    (choice, why) for the startup line."""
    config.scheduler.max_num_batched_tokens = config.scheduler.token_budget(device.type)
    choice = auto.resolve_engine_dtype(config, device)
    config.dtype = choice[0]
    return choice


def _resolve_after_load(config: EngineConfig, loaded: LoadedModel, device: torch.device, dtype: torch.dtype,
                        dtype_choice: tuple[str, str]) -> None:
    """Quantization (what the file holds counts) and the KV pool's dtype; logs what
    ``auto`` chose and why."""
    quant_choice = auto.resolve_quantization(config.quantization, loaded, device, config.kernel_options)
    config.quantization = quant_choice[0]
    kv_choice = auto.resolve_kv_cache_dtype(config.cache.kv_cache_dtype, config.quantization, dtype, device,
                                            config.tensor_parallel_size > 1)
    config.cache.kv_cache_dtype = kv_choice[0]
    if dtype_choice[1] != "as asked" or quant_choice[1] != "as asked":
        log.info("chosen for this machine: %s", auto.describe(dtype_choice, quant_choice, kv_choice))


def pool_blocks(config: EngineConfig, model_config: ModelConfig, kv_dtype: torch.dtype, weights: int,
                max_len: int, device: torch.device) -> int:
    """Blocks of the KV pool: as given, else what the KV budget holds (the budget: as
    given, else what the memory budget leaves after the weights, else a share of the
    memory free where the pool lives), capped at what the sequences can reach when asked."""
    cache = config.cache
    kv_budget = cache.kv_cache_memory
    if kv_budget is None and config.memory_budget is not None:
        kv_budget = config.memory_budget - weights
        if kv_budget <= 0:
            raise ValueError(f"memory budget {config.memory_budget} bytes does not hold the weights "
                             f"({weights} bytes)")
    num_blocks = cache.num_blocks or num_blocks_for_budget(
        model_config, cache.block_size, kv_dtype, kv_budget or default_kv_budget(cache.kv_cache_fraction, device))
    if config.cap_kv_pool and not cache.num_blocks and not cache.kv_cache_memory:
        reachable = -(-config.scheduler.max_num_seqs * max_len // cache.block_size) + 1
        num_blocks = min(num_blocks, reachable)
    return num_blocks


def build_speculator(config: EngineConfig, vocab_size: int, device: torch.device, max_len: int, kernels: Kernels,
                     tokenizer: Tokenizer) -> Speculator | None:
    """The speculative decoder ``config.speculative_config`` asks for, or None."""
    spec = SpeculativeConfig.parse(config.speculative_config)
    if spec is None:
        return None
    proposer = None
    if spec.method == "draft_model":
        assert spec.model is not None
        proposer = DraftModelProposer(spec.model, spec.draft_kv_cache_memory, vocab_size, device, max_len,
                                      config.cache.block_size, kernels)
    return Speculator(spec, proposer, grammar_eos=tokenizer.eos_token_ids)


def default_kv_budget(fraction: float, device: torch.device | None = None) -> int:
    """``fraction`` of the memory still free where the pool will live: the GPU's
    (after the weights are loaded) on CUDA, the host's available memory otherwise."""
    if device is not None and device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * fraction)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(int(line.split()[1]) * 1024 * fraction)
    except OSError:
        pass
    return 1 << 30

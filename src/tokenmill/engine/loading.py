"""The model on its device: built, loaded, smoothed and quantized per the resolved config.

Used by the engine's builder (``builder.py``), the draft model of speculative
decoding (``draft.py``) and tensor-parallel workers (``distributed.py``). The
calibration run of w8a8's smoothing lives here, not in ``model/``: it pushes
text through a paged runner, which is the engine's business (``model/quant/smoothquant.py``
keeps the math: measuring maxima and folding the factors in).
"""
from __future__ import annotations

from typing import Any

import torch

from ..settings.config import EngineConfig
from ..files.corpus import corpus_text
from ..model.quant import smoothquant
from ..model.models.architectures import model_class
from ..model.models.llama import LlamaForCausalLM
from ..model.loader import CheckpointWeights
from ..model.loader import LoadedModel, load_model  # noqa: F401 - how tools outside the engine read a checkpoint
from .step.executors import Kernels, choose_kernels
from .request import Request, SamplingParams
from .step.runner import ModelRunner


def calibration_text() -> str:
    """Text to measure activations on: the bundled corpus the load tester also cuts
    prompts from (not the quality re-test's perplexity text, so the re-test stays a
    held-out measurement)."""
    return corpus_text()


def build_model(loaded: LoadedModel, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                max_len: int, calibration: list[int] | None = None, parallel: Any = None,
                kernels: Kernels | None = None) -> LlamaForCausalLM:
    """The model on ``device`` in ``dtype``, weights loaded and quantized per ``config``;
    for int8 activations (w8a8), smoothed first on the ``calibration`` tokens; with
    ``parallel`` (tensor parallelism), this rank's shard of every layer."""
    # Build on the meta device (no random init of weights about to be overwritten),
    # then materialise and load; the rotary tables are computed for real.
    with torch.device("meta"):
        model = model_class(loaded.config)(loaded.config, max_positions=max_len)
    if parallel is not None:
        parallel.shard_model(model)
    from ..model.quant.quant import block_backed_layers

    # Layers `gguf` rebuilds from the file's blocks stay on meta: their dense weights are
    # never made (a 4-bit file's, widened to float32, take eight times its bytes).
    # (weights handed over as a plain dict, or sharded across ranks, are loaded as they are)
    weights = loaded.weights
    deferred = (block_backed_layers(model, loaded, config, device)
                if parallel is None and isinstance(weights, CheckpointWeights) else {})
    model = _materialize(model, device, dtype, {f"{name}.weight" for name in deferred})
    model.reset_rope(max_len, device)
    if deferred:
        weights = weights.deferring([s for sources in deferred.values() for s in sources], dtype)
    model.load_weights(weights)
    if calibration and str(config.quantization).lower() == "w8a8":
        if parallel is not None:
            parallel.share_calibration(calibration)  # every rank smooths its shard on these tokens, in step

        with torch.inference_mode():
            smooth_for_int8(model, calibration, config.cache.block_size, dtype, device,
                            kernels or choose_kernels(device, config.kernel_options))
    if config.quantization not in ("none", None):
        from ..model.quant.quant import quantize_model

        quantize_model(model, loaded, config, None if kernels is None or parallel is not None else kernels.ops)
        if parallel is not None:
            parallel.after_quantize(model)
    left = [name for name, p in model.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"{len(left)} weights were never loaded (first: {left[0]}); "
                           "a layer left for the file's blocks was not rebuilt from them")
    model.eval()
    return model


def _materialize(model: LlamaForCausalLM, device: torch.device, dtype: torch.dtype,
                 keep_meta: set[str]) -> LlamaForCausalLM:
    """``model`` (built on meta) with storage on ``device`` in ``dtype`` for every
    parameter and buffer but the ``keep_meta`` parameters (by name)."""
    if not keep_meta:
        return model.to_empty(device=device).to(dtype)
    held = []
    for name in keep_meta:
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        held.append((module, attr, module._parameters.pop(attr)))
    model = model.to_empty(device=device).to(dtype)
    for module, attr, param in held:
        module._parameters[attr] = torch.nn.Parameter(param.to(dtype), requires_grad=False)
    return model


@torch.no_grad()
def smooth_for_int8(model: LlamaForCausalLM, token_ids: list[int], block_size: int, dtype: torch.dtype,
                    device: torch.device, kernels: Kernels) -> int:
    """Calibrate on ``token_ids`` (256-token prefills through a scratch paged cache) and
    fold the smoothing factors into the float model; returns the projections smoothed."""
    chunk = min(256, model.rope.cos.shape[0])  # within the positions the model was built for
    seqs = [token_ids[i : i + chunk] for i in range(0, min(len(token_ids), smoothquant.CALIBRATION_TOKENS), chunk)]
    seqs = [s for s in seqs if len(s) > 1]
    blocks = -(-chunk // block_size)
    # prefills only: no fused decode step or CUDA graphs to build (and, under tensor
    # parallelism, none that could run)
    runner = ModelRunner(model, blocks, block_size, dtype, device, kernels, eager_only=True)

    def run() -> None:
        for seq in seqs:
            req = Request("calibration", list(seq), SamplingParams(max_tokens=1))
            req.block_table = list(range(-(-len(seq) // block_size)))
            runner.execute([(req, len(seq))])

    return smoothquant.smooth(model, smoothquant.calibrate(model, run), smoothquant.ALPHA)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters and buffers that hold weights (quantized layers keep
    theirs in buffers); a tied lm_head shares the embedding and counts once."""
    seen: set[int] = set()
    total = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith(("rope.cos", "rope.sin")) or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total

"""Activation smoothing for w8a8: the float model's outputs do not change, and int8
activations come closer to float once outlier channels move into the weights."""
from __future__ import annotations

import random

from conftest import tiny_loaded, tiny_tokenizer
from tokenmill import LLM, SamplingParams
from tokenmill.model import smoothquant
from tokenmill.model.quant import Int8Linear

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _outlier_loaded():
    """The tiny model with a few large channels in every RMSNorm's output, as real
    checkpoints have."""
    loaded = tiny_loaded(seed=6)
    for name, w in loaded.weights.items():
        if name.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")):
            w[[3, 17, 40]] *= 30.0
    return loaded


def _llm(**opts) -> LLM:
    return LLM(loaded_model=_outlier_loaded(), tokenizer=tiny_tokenizer(), num_blocks=64, **opts)


def _texts(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]


def test_smoothing_keeps_the_float_model_and_helps_int8_activations():
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(40)] for _ in range(6)]
    calib = [rng.randrange(256) for _ in range(300)]
    want = _texts(_llm(), prompts)

    smoothed = _llm()
    engine = smoothed.engine
    n = smoothquant.smooth_for_int8(engine.model, calib, engine.block_size, engine.dtype, engine.device,
                                    engine.kernels)
    assert n == 3 * engine.model_config.num_hidden_layers
    assert _texts(smoothed, prompts) == want  # the same float model, rescaled

    engine_w8a8 = _llm(quantization="w8a8")  # the engine smooths (on its calibration text), then quantizes
    layers = [m for m in engine_w8a8.engine.model.modules() if isinstance(m, Int8Linear)]
    assert layers and all(m.dynamic for m in layers)
    # The quality gain is measured on the bundled model by `tokenmill eval` (docs/quantization.md):
    # a random tiny model has no systematic outlier structure for the factors to follow.

"""Activation smoothing for w8a8: the float model's outputs do not change, and int8
activations come closer to float once outlier channels move into the weights."""
from __future__ import annotations

import random

import pytest

from conftest import bundled_quality, tiny_loaded, tiny_tokenizer
from tokenmill import LLM, SamplingParams
from tokenmill.model.quant import smoothquant
from tokenmill.engine import loading
from tokenmill.model.quant.quant import W8A8_WEIGHT_ONLY_LAST_LAYERS, Int8Linear

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
    n = loading.smooth_for_int8(engine.model, calib, engine.block_size, engine.dtype, engine.device,
                                    engine.kernels)
    assert n == 3 * engine.model_config.num_hidden_layers
    assert _texts(smoothed, prompts) == want  # the same float model, rescaled

    engine_w8a8 = _llm(quantization="w8a8")  # the engine smooths (on its calibration text), then quantizes
    model = engine_w8a8.engine.model
    kept = {f"layers.{len(model.layers) - 1 - i}." for i in range(W8A8_WEIGHT_ONLY_LAST_LAYERS)}
    for name, m in model.named_modules():
        if isinstance(m, Int8Linear):  # int8 activations everywhere but the last layers, which feed the head
            assert m.dynamic == (not any(name.startswith(k) for k in kept)), name
    # The quality gain is measured on the bundled model by `tokenmill eval` (docs/quantization.md,
    # held by test_w8a8_holds_the_bundled_models_quality): a random tiny model has no systematic
    # outlier structure for the factors to follow.


# Quality bounds for w8a8 on the bundled model against float32 (docs/quantization.md):
# perplexity of the bundled sample text at most this much higher, and the same top-1
# next token at least this often.
W8A8_MAX_PPL_INCREASE = 0.02
W8A8_MIN_NEXT_TOKEN_AGREEMENT = 0.95


@pytest.mark.slow
def test_w8a8_holds_the_bundled_models_quality(real_loaded, real_tokenizer) -> None:
    comp = bundled_quality(real_loaded, real_tokenizer, "w8a8", W8A8_MAX_PPL_INCREASE)  # the whole sample text
    assert comp.ppl_increase <= W8A8_MAX_PPL_INCREASE, comp
    assert comp.next_token_agreement >= W8A8_MIN_NEXT_TOKEN_AGREEMENT, comp

"""Mixture-of-experts models (Qwen3-MoE, Mixtral) against transformers' own classes:
tiny random models, float32 greedy tokens identical on several prompts, with the
prefix cache cold and warm, batched with other requests, under forced preemption;
from Hugging Face folders and from GGUF files (llama.cpp's stacked expert tensors);
quantized experts; the fast paths that do not take them say so."""
from __future__ import annotations

import logging
import random

import pytest
import torch

from conftest import TINY_VOCAB, tiny_tokenizer
from gguf_files import write_gguf
from tokenmill import LLM, SamplingParams
from tokenmill.model.loader import load_model
from tokenmill.model.models.moe import SparseMoE

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)
FAMILIES = {
    # Qwen3-MoE without renormalised router weights, one dense layer among the sparse ones
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                       norm_topk_prob=False, mlp_only_layers=[1])),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)),
}


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(rng.randint(3, 70))] for _ in range(count)]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, transformers model, its saved folder)."""
    config_cls, model_cls, extra = FAMILIES[request.param]
    torch.manual_seed(1)
    model = model_cls(config_cls(**COMMON, **extra)).eval()
    with torch.no_grad():  # random norms, so that every weight matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return request.param, model, str(folder)


def _reference(model, prompts: list[list[int]], new: int = 12) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            out.append(gen[0, len(prompt):].tolist())
    return out


def _tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_matches_transformers_cold_warm_batched_preempted(family, caplog):
    name, model, folder = family
    loaded = load_model(folder)
    assert loaded.config.architecture == name and loaded.config.num_experts > 0
    prompts = _prompts(4, seed=3)
    want = _reference(model, prompts)
    with caplog.at_level(logging.INFO):
        llm = LLM(loaded_model=loaded, tokenizer=tiny_tokenizer(), dtype="float32", num_blocks=128,
                  max_num_batched_tokens=64)
    assert any("mixture of experts" in r.getMessage() for r in caplog.records)  # the fused step says why not
    assert [type(layer.mlp).__name__ for layer in llm.engine.runner.model.layers][:2] == (
        ["SparseMoE", "MLP"] if name == "qwen3_moe" else ["SparseMoE", "SparseMoE"])
    alone = [_tokens(llm, [p])[0] for p in prompts]  # prefix cache cold
    assert alone == want
    assert _tokens(llm, prompts) == want  # warm, all together
    others = _prompts(6, seed=4)
    mixed = _tokens(llm, others[:3] + prompts + others[3:])
    assert mixed[3:7] == want
    small = LLM(loaded_model=loaded, tokenizer=tiny_tokenizer(), dtype="float32", num_blocks=8,
                max_num_batched_tokens=48, enable_prefix_caching=False)
    assert _tokens(small, others[:3] + prompts)[3:] == want
    assert small.engine.total_preemptions > 0


def test_gguf_stacked_experts_match_hf_folder(family, tmp_path):
    name, model, folder = family
    hf = load_model(folder)
    path = str(tmp_path / "moe.gguf")
    write_gguf(path, hf.weights, hf.config, arch="llama" if name == "mixtral" else "qwen3moe",
               eos_token_id=None)
    loaded = load_model(path)
    cfg = loaded.config
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok) == (
        name, hf.config.num_experts, hf.config.num_experts_per_tok)
    assert cfg.mlp_only_layers == hf.config.mlp_only_layers
    for key, value in hf.weights.items():
        assert torch.equal(loaded.weights[key], value), key
    prompts = _prompts(3, seed=5)
    # llama.cpp renormalises Qwen3-MoE's router weights; transformers does as the config says
    if name == "mixtral":
        llm = LLM(loaded_model=loaded, tokenizer=tiny_tokenizer(), dtype="float32", num_blocks=64)
        assert _tokens(llm, prompts) == _reference(model, prompts)
    else:
        assert cfg.norm_topk_prob


def test_router_normalisation_and_grouping():
    from tokenmill.settings.config import ModelConfig

    cfg = ModelConfig(hidden_size=32, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1,
                      num_experts=6, num_experts_per_tok=3, moe_intermediate_size=8, norm_topk_prob=True)
    torch.manual_seed(0)
    moe = SparseMoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(11, 32)
    weights, experts = moe.route(x)
    assert torch.allclose(weights.sum(-1), torch.ones(11)) and experts.shape == (11, 3)
    # the grouped computation equals a per-token loop over its experts
    want = torch.stack([sum(w * moe.experts[int(e)](x[t : t + 1])[0] for w, e in zip(weights[t], experts[t]))
                        for t in range(11)])
    assert torch.allclose(moe(x), want, atol=1e-6)


def test_quantized_experts(family):
    """int8, int4 and w8a8 (the CPU default where the kernels multiply integers) replace each
    expert's projections; next-token agreement with the float32 reference on 8 prompts."""
    name, model, folder = family
    loaded = load_model(folder)
    prompts = _prompts(8, seed=6)
    want = _reference(model, prompts, new=1)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for mode in ("int8", "int4", "w8a8"):
        llm = LLM(loaded_model=loaded, tokenizer=tiny_tokenizer(), dtype="float32", quantization=mode,
                  quant_group_size=32, num_blocks=64)
        report = llm.engine.runner.model.quant_report
        experts = [k for k in report.quantized if ".experts." in k]
        assert len(experts) == 2 * loaded.config.num_experts * (2 if name == "qwen3_moe" else 3), mode
        same = sum(g == w for g, w in zip(_tokens(llm, prompts, one), want)) / len(want)
        assert same >= 0.6, (mode, same)  # tiny random weights: a loose floor (float32 is exact, above)


def test_gguf_quantized_expert_blocks(family, tmp_path):
    name, model, folder = family
    hf = load_model(folder)
    path = str(tmp_path / "moe-q8.gguf")
    write_gguf(path, hf.weights, hf.config, arch="llama" if name == "mixtral" else "qwen3moe",
               qtypes={"experts": "Q8_0"})
    loaded = load_model(path)
    assert any(".experts.3.down_proj" in k for k in loaded.raw_quantized)
    llm = LLM(loaded_model=loaded, tokenizer=tiny_tokenizer(), dtype="float32", quantization="gguf",
              num_blocks=64)
    report = llm.engine.runner.model.quant_report
    assert any(".experts." in k and "Q8_0" in v for k, v in report.quantized.items())
    assert all(len(t) == 12 for t in _tokens(llm, _prompts(2, seed=7)))


def test_tensor_parallel_refused_with_reason():
    from tokenmill.settings.config import ModelConfig
    from tokenmill.model.parallel import check_divisible

    cfg = ModelConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        check_divisible(cfg, 2)
    check_divisible(cfg, 1)

"""Gemma 2, Gemma 3 and Phi-3 against transformers: tiny random models written with
transformers' own classes, saved as Hugging Face folders, loaded by tokenmill, float32
greedy tokens compared on prompts longer than the sliding window (so windows are
really exercised), with the prefix cache cold and warm, batched, under preemption,
and on every attention backend that takes the model."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import TINY_VOCAB, tiny_tokenizer  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.model.loader import load_model  # noqa: E402

WINDOW = 8
COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=None,
              eos_token_id=None, pad_token_id=0)


def _gemma3():
    cfg = transformers.Gemma3TextConfig(
        **COMMON, num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})
    return transformers.Gemma3ForCausalLM(cfg)


def _gemma2():
    cfg = transformers.Gemma2Config(**COMMON, num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=16,
                                    attn_logit_softcapping=0.8, final_logit_softcapping=3.0)
    return transformers.Gemma2ForCausalLM(cfg)


def _phi3(window: int | None = WINDOW, longrope: bool = False):
    common = {**COMMON, "head_dim": None}
    common.pop("head_dim")
    extra = {}
    if longrope:
        extra = dict(original_max_position_embeddings=32, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.5 + 0.4 * i for i in range(8)]})
    cfg = transformers.Phi3Config(**common, num_hidden_layers=2, sliding_window=window, **extra)
    return transformers.Phi3ForCausalLM(cfg)


FAMILIES = {"gemma3": _gemma3, "gemma2": _gemma2, "phi3": _phi3,
            "phi3_longrope": lambda: _phi3(window=None, longrope=True)}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that norms, windows and soft-capping change the argmax."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Gemma multiplies the embedding by sqrt(hidden): a small one leaves room for attention
            # to change the argmax.
            scale = 0.5 if "norm" in name else (0.15 if "embed" in name else 0.3)
            p.copy_(torch.randn(p.shape, generator=g) * scale)


def _prompts(n: int = 4, length: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(1, TINY_VOCAB - 1, (length + 5 * i,), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, transformers model, tokenmill LoadedModel of its saved folder)."""
    torch.manual_seed(0)
    model = FAMILIES[request.param]().float().eval()
    _randomize(model, 1)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return request.param, model, load_model(str(folder))


def _reference(model, prompts: list[list[int]], new: int) -> list[list[int]]:
    out = []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            ref = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False)
        out.append(ref[0, len(ids):].tolist())
    return out


GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _llm(loaded, **options) -> LLM:
    options.setdefault("num_blocks", 128)
    options.setdefault("block_size", 4)
    options.setdefault("max_model_len", 128)
    return LLM(loaded_model=loaded, tokenizer=tiny_tokenizer(), **options)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_equals_transformers_cold_warm_batched_preempted(family):
    name, model, loaded = family
    prompts = _prompts()
    expected = _reference(model, prompts, GREEDY.max_tokens)
    llm = _llm(loaded)
    assert _tokens(llm.generate(prompts[:1], GREEDY)) == expected[:1]  # alone, cold
    warm = llm.generate(prompts, GREEDY)  # batched; the first prompt's blocks are cached
    assert warm[0].num_cached_tokens > WINDOW
    assert _tokens(warm) == expected, name
    # A pool too small for the batch: preemption by recompute, no prefix cache.
    squeezed = _llm(loaded, num_blocks=40, enable_prefix_caching=False, max_num_seqs=4)
    assert _tokens(squeezed.generate(prompts, GREEDY)) == expected
    assert squeezed.engine.total_preemptions > 0
    squeezed.engine.check_idle_invariants()


def test_backends_agree(family, monkeypatch):
    """The reference attention (fresh gathers) gives the same tokens as the engine's choice,
    and small prefill chunks (windows cut across chunk and block edges) change nothing."""
    name, model, loaded = family
    prompts = _prompts(2)
    expected = _reference(model, prompts, 8)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    chunked = _llm(loaded, max_num_batched_tokens=7)
    assert _tokens(chunked.generate(prompts, params)) == expected
    from tokenmill.options import KernelOptions

    reference = _llm(loaded, kernel_options=KernelOptions(attention="reference"))
    assert _tokens(reference.generate(prompts, params)) == expected


def test_attention_masks_choose_the_backend(family):
    name, _model, loaded = family
    llm = _llm(loaded)
    masks = llm.engine.model.attention_masks()
    runner = llm.engine.runner
    if name == "phi3_longrope":
        assert masks is None
    else:
        assert masks is not None and "window" in masks
        assert runner.attention.name == "torch paged attention"
        assert runner.fused is None


def test_unsupported_rope_scaling_is_one_clear_line():
    from tokenmill.model.loader import hf_config

    cfg = {"model_type": "phi3", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2, "rope_scaling": {"rope_type": "yarnish"}}
    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarnish'.*supported: default"):
        hf_config(cfg)
    with pytest.raises(ValueError, match="unsupported model_type 'falcon'.*gemma3"):
        hf_config({**cfg, "model_type": "falcon"})


def test_last_position_logits_match(family):
    """Logits, not just their argmax: Gemma 2's final soft-capping is monotonic, so only the
    values show it."""
    _name, model, loaded = family
    llm = _llm(loaded)
    engine = llm.engine
    from tokenmill.engine.request import Request

    for ids in _prompts(2):
        req = Request("logits", ids, SamplingParams(max_tokens=1), max_tokens=1)
        req.block_table = engine.pool.allocate(-(-len(ids) // engine.block_size))
        try:
            logits, _ = engine.runner.execute([(req, len(ids))])
        finally:
            engine.pool.release(req.block_table)
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0, -1].float()
        assert (logits[0] - ref).abs().max().item() < 1e-4


def test_longrope_short_factors_within_the_original_context():
    """An engine context within Phi-3's original one uses the short factors, as transformers
    does for sequences that stay within it."""
    torch.manual_seed(0)
    model = _phi3(window=None, longrope=True).float().eval()
    _randomize(model, 2)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        loaded = load_model(folder)
    prompts = _prompts(2, length=16)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert _tokens(_llm(loaded, max_model_len=32).generate(prompts, params)) == _reference(model, prompts, 8)


def test_unsupported_architecture_one_line_exit_2(tmp_path, capsys):
    import json

    from tokenmill.entrypoints.cli import main
    from tokenmill.model.support import UnsupportedModel

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "falcon", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
        "num_attention_heads": 2}))
    assert main(["generate", "--model", str(tmp_path), "hello"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("tokenmill generate: error: unsupported model_type 'falcon'")
    assert "Traceback" not in "\n".join(err) and "gemma3" in err[-1]
    with pytest.raises(UnsupportedModel, match="unsupported model_type 'falcon'"):
        LLM(str(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3", "phi3"])
def test_two_ranks_match_transformers(name, tmp_path):
    """Tensor parallelism (two CPU ranks) on the family's own layers, read from the folder."""
    torch.manual_seed(0)
    model = FAMILIES[name]().float().eval()
    _randomize(model, 1)
    model.save_pretrained(tmp_path)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    prompts = _prompts(2)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(str(tmp_path), tokenizer=tiny_tokenizer(), tensor_parallel_size=2, num_threads=1, num_blocks=64,
             block_size=4, max_model_len=128) as llm:
        assert _tokens(llm.generate(prompts, params)) == _reference(model, prompts, 8)

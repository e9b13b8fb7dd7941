"""Gemma 2, Gemma 3 and Phi-3 against transformers: tiny random models written with
transformers' own classes, saved as Hugging Face folders, loaded by tokenmill, float32
greedy tokens compared on prompts longer than the sliding window (so windows are
really exercised), with the prefix cache cold and warm, batched, under preemption,
and on every attention backend that takes the model."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import TINY_VOCAB, prompt_last_logits, tiny_tokenizer  # noqa: E402

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


def _prompts(n: int = 3, length: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(1, TINY_VOCAB - 1, (length + 5 * i,), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, transformers model, tokenmill LoadedModel of its saved folder, transformers'
    greedy tokens for ``_prompts()``)."""
    torch.manual_seed(0)
    model = FAMILIES[request.param]().float().eval()
    _randomize(model, 1)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return request.param, model, load_model(str(folder)), _reference(model, _prompts(), GREEDY.max_tokens)


def _reference(model, prompts: list[list[int]], new: int) -> list[list[int]]:
    out = []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            ref = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False)
        out.append(ref[0, len(ids):].tolist())
    return out


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _llm(loaded, **options) -> LLM:
    options.setdefault("num_blocks", 128)
    options.setdefault("block_size", 4)
    options.setdefault("max_model_len", 128)
    return LLM(loaded_model=loaded, tokenizer=tiny_tokenizer(), **options)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_equals_transformers_cold_warm_batched_preempted(family):
    name, _model, loaded, expected = family
    prompts = _prompts()
    llm = _llm(loaded)
    assert _tokens(llm.generate(prompts[:1], GREEDY)) == expected[:1]  # alone, cold
    warm = llm.generate(prompts, GREEDY)  # batched; the first prompt's blocks are cached
    # (where every layer slides, as Phi-3's here, the cache indexes a window's blocks of a path)
    assert warm[0].num_cached_tokens >= WINDOW
    assert _tokens(warm) == expected, name
    # A pool too small for the batch: preemption by recompute, no prefix cache. Where every
    # layer slides (Phi-3 here), requests release the blocks behind the window and the same
    # pool holds all three (the scheduler's property tests preempt windowed requests).
    squeezed = _llm(loaded, num_blocks=26, enable_prefix_caching=False, max_num_seqs=3)
    assert _tokens(squeezed.generate(prompts, GREEDY)) == expected
    sliding = squeezed.engine.model.kv_window() is not None
    assert (squeezed.engine.total_preemptions == 0) if sliding else (squeezed.engine.total_preemptions > 0)
    squeezed.engine.check_idle_invariants()


def test_backends_agree(family, monkeypatch):
    """The reference attention (fresh gathers) gives the same tokens as the engine's choice,
    and small prefill chunks (windows cut across chunk and block edges) change nothing."""
    _name, _model, loaded, expected = family
    prompts = _prompts()[:2]
    expected = [tokens[:8] for tokens in expected[:2]]  # greedy output is prefix-consistent
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    chunked = _llm(loaded, max_num_batched_tokens=7)
    assert _tokens(chunked.generate(prompts, params)) == expected
    from tokenmill.settings.options import KernelOptions

    reference = _llm(loaded, kernel_options=KernelOptions(attention="reference"))
    assert _tokens(reference.generate(prompts, params)) == expected


def test_attention_masks_choose_the_backend(family):
    """Sliding windows run on the C kernels and in the fused step (Phi-3's Llama-shaped layer
    and Gemma 3's, so the greedy tests above cover windows there too); soft-capped scores
    (Gemma 2) only on torch paged attention, and not in the fused step."""
    from tokenmill.model.kernels import cpu_kernels

    name, _model, loaded, _expected = family
    llm = _llm(loaded)
    masks = llm.engine.model.attention_masks()
    runner = llm.engine.runner
    if name == "phi3_longrope":
        assert masks is None
        return
    assert masks is not None and "window" in masks
    if name == "gemma2":
        assert runner.attention.name == "torch paged attention"
        assert runner.fused is None
    elif cpu_kernels.load() is not None:
        assert runner.attention.name == "C kernels (paged, in place)"
        assert (runner.fused is not None) == (name in ("phi3", "gemma3"))


def test_blocks_behind_every_window_are_freed_while_generating(family):
    """Phi-3 with every layer sliding (window 8, blocks of 4): a request holds about a window's
    blocks however long it runs, and its tokens stay transformers'; Gemma 3's global layer
    reads the whole context, so nothing is freed there."""
    name, model, loaded, _expected = family
    if name not in ("phi3", "gemma3"):
        pytest.skip("one family with every layer sliding, one with a global layer")
    prompt = _prompts(1, length=30)[0]
    new = 40
    want = _reference(model, [prompt], new)[0]
    llm = _llm(loaded)
    window = llm.engine.model.kv_window()
    assert (window == WINDOW) if name == "phi3" else window is None
    engine = llm.engine
    engine.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
    held, tokens = [], []
    while engine.has_unfinished():
        for delta in engine.step():
            tokens.extend(delta.token_ids)
        held.append(engine.pool.num_in_use)
    assert tokens == want
    total = -(-(len(prompt) + new) // 4)
    if name == "phi3":  # the cached path (two blocks) until it is behind, then the window and the block written
        assert max(held[-20:]) <= WINDOW // 4 + 2 < total
    else:  # nothing released while it runs: every computed position's block is held at the end
        assert held[:-1] == sorted(held[:-1]) and max(held) >= (len(prompt) + new - 2) // 4
    engine.check_idle_invariants()


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
    _name, model, loaded, _expected = family
    llm = _llm(loaded)
    for ids in _prompts()[:1]:
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0, -1].float()
        assert (prompt_last_logits(llm.engine, ids) - ref).abs().max().item() < 1e-4


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

    from tokenmill.entrypoints.cli.main import main
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


# --------------------------------------------------------------------------- the same families from GGUF files


def _gguf_of(model, path: str, arch: str) -> None:
    """``model``'s weights as llama.cpp's converter writes them: its tensor names, Gemma's
    norms stored as 1 + w, Phi-3's q/k/v and gate/up fused, long-RoPE factors as tensors."""
    import gguf
    import numpy as np

    from gguf_files import add_shape
    from tokenmill.model import loader

    cfg = model.config
    per_layer = {v: k for k, v in loader._GGUF_LAYER_NAMES.items()}
    family = "gemma" if arch.startswith("gemma") else arch
    per_layer |= {v: k for k, v in loader._GGUF_ARCH_LAYER_NAMES.get(family, {}).items()}
    top = {v: k for k, v in loader._GGUF_TOP_NAMES.items()}
    w = gguf.GGUFWriter(path, arch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters
    add_shape(w, cfg, head_dim, (rope.get("full_attention") or rope)["rope_theta"])
    if cfg.sliding_window:
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_float32("gemma2.attn_logit_softcapping", cfg.attn_logit_softcapping)
        w.add_float32("gemma2.final_logit_softcapping", cfg.final_logit_softcapping)
    if rope.get("rope_type") == "longrope":
        w.add_uint32("phi3.rope.scaling.original_context_length", cfg.original_max_position_embeddings)
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()
          if k != "lm_head.weight" or not cfg.tie_word_embeddings}
    for name, value in sd.items():
        if family == "gemma" and name.endswith("norm.weight"):
            value = value + 1.0
        if name in top:
            w.add_tensor(top[name], np.ascontiguousarray(value))
            continue
        _, _, idx, rest = name.split(".", 3)
        w.add_tensor(f"blk.{idx}.{per_layer[rest]}", np.ascontiguousarray(value))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _gemma3_llama_cpp():
    """A Gemma 3 with the settings llama.cpp keeps as constants: every 6th layer global,
    local RoPE base 10000, queries scaled by the head size."""
    cfg = transformers.Gemma3TextConfig(
        **COMMON, num_hidden_layers=6, sliding_window=WINDOW, query_pre_attn_scalar=16,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 50000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    return transformers.Gemma3ForCausalLM(cfg)


@pytest.mark.parametrize("arch,make", [("gemma3", _gemma3_llama_cpp), ("gemma2", _gemma2),
                                       ("phi3", lambda: _phi3(window=None, longrope=True))])
def test_gguf_files_equal_transformers(arch, make, tmp_path):
    torch.manual_seed(0)
    model = make().float().eval()
    _randomize(model, 3)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    path = str(tmp_path / "tiny.gguf")
    _gguf_of(model, path, arch)
    loaded = load_model(path)
    prompts = _prompts(2)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert _tokens(_llm(loaded).generate(prompts, params)) == _reference(model, prompts, 8)


def test_phi3_gguf_fused_tensors_split_unread_and_each_read_once(tmp_path, monkeypatch):
    """Loading a Phi-3 GGUF dequantizes nothing (a 3.8B file's fused q/k/v and gate/up would
    be most of its weights in float32); reading a layer's q, k and v in turn dequantizes
    their fused tensor once, and the parts are its rows."""
    from tokenmill.model import loader

    torch.manual_seed(0)
    model = _phi3(window=None).float().eval()
    path = str(tmp_path / "tiny.gguf")
    _gguf_of(model, path, "phi3")
    made: list[str] = []
    dense = loader._dense
    monkeypatch.setattr(loader, "_dense", lambda t, *a: made.append(t.name) or dense(t, *a))
    loaded = load_model(path)
    assert made == []
    weights = loaded.weights
    assert "model.layers.0.self_attn.qkv_proj.weight" not in weights
    parts = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    assert [weights.shape_of(p) for p in parts] == [(4 * 16, 64), (2 * 16, 64), (2 * 16, 64)]
    fused = model.model.layers[0].self_attn.qkv_proj.weight.detach()
    rows = torch.cat([weights[p] for p in parts])
    assert made == ["blk.0.attn_qkv.weight"]
    torch.testing.assert_close(rows.float(), fused.float())
    assert weights[parts[0]].shape == weights.shape_of(parts[0])
    assert made == ["blk.0.attn_qkv.weight"] * 2  # read again after its last part: made again, not held
    gate, up = weights["model.layers.1.mlp.gate_proj.weight"], weights["model.layers.1.mlp.up_proj.weight"]
    torch.testing.assert_close(torch.cat([gate, up]).float(),
                               model.model.layers[1].mlp.gate_up_proj.weight.detach().float())


@pytest.mark.parametrize("make", [_phi3, _gemma3], ids=["phi3", "gemma3"])
def test_windowed_layers_in_the_fused_step_match_the_eager_forward(make):
    """Phi-3 with a sliding window, and Gemma 3 (its output norms, GeGLU, local and global
    rotary tables, scaled embedding), int8 weights: the fused native step (its decode rows and,
    at int8, its prefill chunks too, windows cut across chunk and block edges) gives the
    eager forward's greedy tokens, on the same quantized weights."""
    from tokenmill.model.kernels import cpu_kernels
    from tokenmill.settings.options import KernelOptions

    if cpu_kernels.load() is None:
        pytest.skip("the C kernels are not built here")
    torch.manual_seed(0)
    model = make().float().eval()
    _randomize(model, 2)
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        loaded = load_model(folder)
        prompts = _prompts()
        fused = _llm(loaded, quantization="int8", max_num_batched_tokens=11)
        runner = fused.engine.runner
        assert runner.fused is not None and runner.fused.prefill_on_kernels
        assert {type(ex).__name__ for ex in runner.executors} >= {"FusedDecodeExecutor", "FusedPrefillExecutor"}
        eager = _llm(load_model(folder), quantization="int8", max_num_batched_tokens=11,
                     kernel_options=KernelOptions.from_env().replace(fused_decode=False))
        assert eager.engine.runner.fused is None
        assert _tokens(fused.generate(prompts, GREEDY)) == _tokens(eager.generate(prompts, GREEDY))

"""LoRA adapters: adapters made with peft on the tiny random Llama give the same greedy
tokens as transformers + peft, alone and mixed with each other and the base in one step,
with the prefix cache warm; bad adapters are refused with the reason."""
from __future__ import annotations

import copy
import json
import random

import pytest
import torch

from conftest import make_tiny_llm
from tokenmill import SamplingParams
from tokenmill.engine.step.step_batch import StepBatch
from tokenmill.model.lora.lora import LoraError, ModelShape, load_peft

peft = pytest.importorskip("peft")

GREEDY = dict(temperature=0.0, ignore_eos=True)
# (name, rank, alpha, targets, rslora)
ADAPTERS = [
    ("attn8", 8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], False),
    ("mlp4", 4, 8, ["gate_proj", "up_proj", "down_proj"], False),
    ("all16", 16, 32, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
    ("qv2", 2, 4, ["q_proj", "v_proj"], False),
]


def _make_adapter(hf_model, folder, seed, rank, alpha, targets, rslora):
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                             init_lora_weights=False, use_rslora=rslora)
    model = peft.get_peft_model(copy.deepcopy(hf_model), config).eval()
    with torch.no_grad():  # B scaled up so that the update changes the greedy tokens
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(4.0)
    model.save_pretrained(str(folder))
    return model


def make_adapters(hf_model, root, specs: dict, first_seed: int) -> dict:
    """name -> (folder, peft model) for ``specs`` (name -> (rank, alpha, targets)), made on one
    thread (a tiny model: many times faster than two on a loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {name: (str(root / name), _make_adapter(hf_model, root / name, first_seed + i, r, alpha, targets, False))
                for i, (name, (r, alpha, targets)) in enumerate(specs.items())}
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """A tiny model: one thread is many times faster than two on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def adapters(hf_tiny, tmp_path_factory):
    """name -> (folder, peft model) for each of ADAPTERS."""
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for seed, (name, rank, alpha, targets, rslora) in enumerate(ADAPTERS, start=1):
        out[name] = (str(root / name), _make_adapter(hf_tiny, root / name, seed, rank, alpha, targets, rslora))
    return out


@pytest.fixture(scope="module")
def lora_llm(adapters):
    llm = make_tiny_llm(enable_lora=True, max_loras=len(ADAPTERS), max_lora_rank=16, num_threads=1)
    for name, (folder, _) in adapters.items():
        llm.load_lora(name, folder)
    return llm


def _prompts(count, seed=0, lo=5, hi=60):
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def _reference(model, prompt, max_tokens):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is many times faster on a loaded machine
    try:
        return _generate(model, prompt, max_tokens)
    finally:
        torch.set_num_threads(threads)


def _generate(model, prompt, max_tokens):
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             do_sample=False)
    return out[0, len(prompt):].tolist()


def test_each_adapter_alone_matches_peft(lora_llm, adapters, hf_tiny):
    prompts = _prompts(2, seed=3)
    for name, (_, model) in adapters.items():
        for prompt in prompts:
            got = lora_llm.generate([prompt], SamplingParams(max_tokens=12, **GREEDY), lora=name)
            assert got[0].outputs[0].token_ids == _reference(model, prompt, 12), name
    # the adapters do change the output (a test of nothing otherwise)
    base = lora_llm.generate([prompts[0]], SamplingParams(max_tokens=12, **GREEDY))[0].outputs[0].token_ids
    assert base == _reference(hf_tiny, prompts[0], 12)
    assert all(_reference(m, prompts[0], 12) != base for _, m in adapters.values())


def test_mixed_batch_with_warm_prefix_cache_matches_peft(lora_llm, adapters, hf_tiny):
    shared = _prompts(1, seed=7, lo=40, hi=40)[0]  # 2.5 blocks shared by every request
    prompts = [shared + p for p in _prompts(11, seed=8, lo=2, hi=20)]
    names = [None, *adapters, None, *adapters, None]
    models = {None: hf_tiny, **{n: m for n, (_, m) in adapters.items()}}
    steps: list[StepBatch] = []
    runner = lora_llm.engine.runner
    plain = runner.execute

    def spy(step):
        steps.append(StepBatch.of(step))
        return plain(step)

    ran: list[str] = []  # which executor ran each step with adapter rows
    for executor in runner.executors:
        def spied(batch, _run=executor.run, _name=executor.name):
            if batch.has_adapters:
                ran.append(_name)
            return _run(batch)
        executor.run = spied
    runner.execute = spy
    try:
        for _ in range(2):  # the second round finds every prefix cached (per adapter)
            outs = lora_llm.generate(prompts, SamplingParams(max_tokens=8, **GREEDY), lora=names)
            for prompt, name, out in zip(prompts, names, outs):
                assert out.outputs[0].token_ids == _reference(models[name], prompt, 8), name
    finally:
        runner.execute = plain
        for executor in runner.executors:
            del executor.run
    fused = {e.name for e in runner.executors if e.name.startswith("fused")}
    assert fused <= set(ran), (fused, set(ran))  # adapters' rows run in the fused native step where it runs
    # one step held the base and several adapters; the second round hit the cache
    assert any(len({s.adapter for s in b.seqs}) >= 4 and 0 in {s.adapter for s in b.seqs} for b in steps)
    assert outs[0].num_cached_tokens > 0 and outs[1].num_cached_tokens > 0


def test_prefix_cache_keeps_adapters_apart(lora_llm, adapters):
    prompt = _prompts(1, seed=11, lo=50, hi=50)[0]
    lora_llm.engine.reset_prefix_cache()
    first = lora_llm.generate([prompt], SamplingParams(max_tokens=2, **GREEDY), lora="attn8")[0]
    other = lora_llm.generate([prompt], SamplingParams(max_tokens=2, **GREEDY), lora="mlp4")[0]
    base = lora_llm.generate([prompt], SamplingParams(max_tokens=2, **GREEDY))[0]
    again = lora_llm.generate([prompt], SamplingParams(max_tokens=2, **GREEDY), lora="attn8")[0]
    assert (first.num_cached_tokens, other.num_cached_tokens, base.num_cached_tokens) == (0, 0, 0)
    assert again.num_cached_tokens == 48


def test_step_batch_groups_rows_by_adapter():
    from tokenmill.engine.request import Request

    reqs = []
    for i, adapter in enumerate([2, 0, 1, 2, 1]):
        r = Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=4), adapter_id=adapter)
        r.num_computed_tokens = 2
        r.block_table = [0]
        reqs.append(r)
    batch = StepBatch.build([(r, 1) for r in reqs]).decodes_first()
    assert [s.adapter for s in batch.seqs] == [0, 1, 1, 2, 2]
    assert batch.adapter_segments == [(1, 1, 3), (2, 3, 5)]


def _write(folder, config, tensors):
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, str(folder / "adapter_model.safetensors"))


def test_bad_adapters_are_refused_with_the_reason(tmp_path, adapters):
    from conftest import tiny_config

    shape = ModelShape.of(tiny_config())
    good = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    a = torch.zeros(4, 64)
    b = torch.zeros(64, 4)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    cases = {
        "missing": (None, None, "is not a folder"),
        "noconfig": ({}, None, "no adapter_config.json"),
        "rank": ({**good, "r": 32}, {key.format("A"): torch.zeros(32, 64), key.format("B"): torch.zeros(64, 32)},
                 "exceeds --max-lora-rank 16"),
        "target": ({**good, "target_modules": ["c_attn"]}, {key.format("A"): a, key.format("B"): b},
                   "not projections of this model"),
        "shape": (good, {key.format("A"): torch.zeros(4, 65), key.format("B"): b}, "this model needs A (4, 64)"),
        "noweights": (good, None, "has none of"),
        "half": (good, {key.format("A"): a}, "lacks lora_B"),
        "layer": (good, {key.replace("layers.0", "layers.7").format("A"): a,
                         key.replace("layers.0", "layers.7").format("B"): b}, "the model has 2"),
    }
    for name, (config, tensors, message) in cases.items():
        folder = tmp_path / name
        if config == {}:
            folder.mkdir()
        elif config is not None:
            _write(folder, config, tensors)
        with pytest.raises(LoraError) as err:
            load_peft(str(folder), name, 1, shape, max_rank=16)
        assert message in str(err.value), (name, str(err.value))
    weights = load_peft(adapters["qv2"][0], "qv2", 1, shape, max_rank=16)
    assert weights.rank == 2 and weights.targets == ("q_proj", "v_proj")


def test_adapters_in_the_fused_w8a8_step_match_the_eager_forward(adapters, monkeypatch):
    """Under the quantized default (w8a8): a batch mixing adapters and the base gives the same
    greedy tokens whether its steps run in the fused native step (adapters' updates in
    csrc/lora.c) or through the eager forward (model/lora/lora.py)."""
    from tokenmill.model.kernels import cpu_kernels

    lib = cpu_kernels.load()
    if lib is None or not lib.int8_dot:
        pytest.skip("w8a8 needs the int8 kernels")
    prompts = _prompts(10, seed=21, lo=5, hi=50)
    names = [None, *adapters, None, *adapters, None][: len(prompts)]
    params = SamplingParams(max_tokens=10, **GREEDY)

    def run(fused: bool):
        monkeypatch.setenv("TOKENMILL_FUSED_DECODE", "1" if fused else "0")
        llm = make_tiny_llm(quantization="w8a8", enable_lora=True, max_loras=len(ADAPTERS), max_lora_rank=16,
                            num_threads=1, max_num_batched_tokens=64)
        for name, (folder, _) in adapters.items():
            llm.load_lora(name, folder)
        used = {e.name for e in llm.engine.runner.executors}
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora=names)], used

    fused, used = run(True)
    eager, used_eager = run(False)
    assert "fused CPU decode" in used and not any(n.startswith("fused") for n in used_eager)
    assert fused == eager


def test_fused_adapters_on_shapes_off_the_vector_grid(tmp_path, monkeypatch):
    """Projection parts that start and end off the kernel's panels of B^T (two vectors wide
    on either build): a 48-wide model of three 16-wide heads and one KV head (k and v 16
    columns each), 80 MLP columns. The fused step's adapter updates give the eager forward's
    greedy tokens."""
    transformers = pytest.importorskip("transformers")
    from conftest import tiny_config

    shape = dict(hidden_size=48, intermediate_size=80, num_attention_heads=3, num_key_value_heads=1)
    cfg = tiny_config(**shape)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, num_hidden_layers=cfg.num_hidden_layers,
        max_position_embeddings=cfg.max_position_embeddings, **shape)).eval()
    specs = {"all3": (3, 6, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
             "kv5": (5, 10, ["k_proj", "v_proj", "up_proj"])}
    made = make_adapters(hf, tmp_path, specs, first_seed=40)
    prompts = _prompts(6, seed=5, lo=3, hi=30)
    names = ["all3", "kv5", None, "all3", "kv5", "all3"]

    def run(fused: bool):
        monkeypatch.setenv("TOKENMILL_FUSED_DECODE", "1" if fused else "0")
        llm = make_tiny_llm(enable_lora=True, max_loras=2, max_lora_rank=8, num_threads=1,
                            model_overrides=shape)
        for name, (folder, _) in made.items():
            llm.load_lora(name, folder)
        used = {e.name for e in llm.engine.runner.executors}
        return [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8, **GREEDY),
                                                             lora=names)], used

    fused, used = run(True)
    eager, _ = run(False)
    assert "fused CPU decode" in used
    assert fused == eager

"""Shared fixtures: a tiny random Llama (fast unit tests) and the bundled model."""
from __future__ import annotations

import time

import os
import tempfile

import pytest

# Kernel builds go to a temporary folder, never the user's ~/.cache: one folder shared by
# every test session on this machine (the library's name is keyed by its sources, flags,
# compiler and CPU), so the suite compiles once, not once per session. Set before anything
# reads the options; servers and workers the tests start inherit it.
os.environ.setdefault("TOKENMILL_KERNEL_CACHE", os.path.join(tempfile.gettempdir(), "tokenmill-test-kernels"))

try:
    import torch
except ImportError:  # the router's and the load tester's tests also run where torch is not installed
    torch = None
else:
    from tokenmill.settings.config import ModelConfig
    from tokenmill.model.loader import LoadedModel

TINY_VOCAB = 257
TINY_EOS = 256


def tiny_tokenizer():
    """A real byte-level BPE tokenizer with no merges: one token per UTF-8 byte,
    so multi-byte characters always span tokens (good for detokenizer tests)."""
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from tokenmill.files.tokenizer import Tokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda ch: ord(ch))
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    backend = FastTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<eos>"])
    assert backend.token_to_id("<eos>") == TINY_EOS
    return Tokenizer(backend, bos_token_id=None, eos_token_id=TINY_EOS, vocab_size=TINY_VOCAB)


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def tiny_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=TINY_EOS)
    base.update(overrides)
    return ModelConfig(**base)


def tiny_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 0.15) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    hd = cfg.head_dim
    w = {"model.embed_tokens.weight": rnd(cfg.vocab_size, cfg.hidden_size, scale=1.0),
         "model.norm.weight": 1 + rnd(cfg.hidden_size, scale=0.1),
         "lm_head.weight": rnd(cfg.vocab_size, cfg.hidden_size, scale=0.5)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rnd(cfg.num_attention_heads * hd, cfg.hidden_size)
        w[p + "self_attn.k_proj.weight"] = rnd(cfg.num_key_value_heads * hd, cfg.hidden_size)
        w[p + "self_attn.v_proj.weight"] = rnd(cfg.num_key_value_heads * hd, cfg.hidden_size)
        w[p + "self_attn.o_proj.weight"] = rnd(cfg.hidden_size, cfg.num_attention_heads * hd)
        w[p + "mlp.gate_proj.weight"] = rnd(cfg.intermediate_size, cfg.hidden_size)
        w[p + "mlp.up_proj.weight"] = rnd(cfg.intermediate_size, cfg.hidden_size)
        w[p + "mlp.down_proj.weight"] = rnd(cfg.hidden_size, cfg.intermediate_size)
        w[p + "input_layernorm.weight"] = 1 + rnd(cfg.hidden_size, scale=0.1)
        w[p + "post_attention_layernorm.weight"] = 1 + rnd(cfg.hidden_size, scale=0.1)
    return w


def tiny_loaded(seed: int = 0, **overrides) -> LoadedModel:
    cfg = tiny_config(**overrides)
    return LoadedModel(config=cfg, weights=tiny_weights(cfg, seed), quant_types={}, source="tiny", format="hf")


def save_tiny_hf_folder(folder, seed: int = 0, **overrides) -> str:
    """The tiny random Llama (weights of ``seed``, config ``overrides``) saved as a Hugging
    Face folder, so anything that loads a model by path can load it."""
    import json

    from safetensors.torch import save_file

    cfg = tiny_config(**overrides)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "tie_word_embeddings": False, "eos_token_id": TINY_EOS}))
    save_file({k: v.contiguous() for k, v in tiny_weights(cfg, seed).items()}, str(folder / "model.safetensors"))
    tiny_tokenizer().backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "add_bos_token": False}))
    return str(folder)


def make_tiny_llm(**options):
    """An LLM over the tiny random model (fp32 unless told otherwise)."""
    from tokenmill import LLM

    options.setdefault("num_blocks", 256)
    options.setdefault("max_num_batched_tokens", 256)
    seed = options.pop("weights_seed", 0)
    overrides = options.pop("model_overrides", {})
    return LLM(loaded_model=tiny_loaded(seed, **overrides), tokenizer=tiny_tokenizer(), **options)


def prompt_last_logits(engine, ids: list[int]) -> torch.Tensor:
    """The engine's logits at a prompt's last position, from one prefill step on blocks taken
    and given back here (the parity tests compare them with transformers')."""
    from tokenmill import SamplingParams
    from tokenmill.engine.request import Request

    req = Request("logits", ids, SamplingParams(max_tokens=1), max_tokens=1)
    req.block_table = engine.pool.allocate(-(-len(ids) // engine.block_size))
    try:
        logits, _ = engine.runner.execute([(req, len(ids))])
    finally:
        engine.pool.release(req.block_table)
    return logits[0]


@pytest.fixture(scope="session")
def tiny_llm_factory():
    return make_tiny_llm


@pytest.fixture(scope="session")
def bundled_model_path() -> str:
    from tokenmill.files.bundled import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def real_loaded(bundled_model_path):
    """The bundled SmolLM2 weights, dequantized to fp32 (loaded once per session)."""
    from tokenmill.model.loader import load_model

    return load_model(bundled_model_path, dtype=torch.float32)


@pytest.fixture(scope="session")
def real_tokenizer(bundled_model_path):
    from tokenmill.files.tokenizer import Tokenizer

    return Tokenizer.from_gguf(bundled_model_path)


_QUALITY_BASELINES: dict = {}


def bundled_quality(loaded, tokenizer, candidate: str, max_ppl_increase: float, max_tokens: int | None = None):
    """``tokenmill eval``'s comparison of ``candidate`` (e.g. "w8a8", "none:kv=int8") with
    float32 on the bundled sample text (its first ``max_tokens`` tokens)."""
    from tokenmill.evaluate.cli import sample_path
    from tokenmill.evaluate.harness import CandidateSpec, EvalOptions, compare, run_config

    text_ids = tokenizer.encode(sample_path("sample_text.txt").read_text(encoding="utf-8"),
                                add_special_tokens=True)[:max_tokens]
    opts = EvalOptions(speed=False)
    key = (id(loaded), max_tokens)  # the float32 baseline, run once a session per text
    if key not in _QUALITY_BASELINES:
        _QUALITY_BASELINES[key] = run_config(CandidateSpec.parse("none"), opts, loaded, tokenizer, text_ids, [])
    base = _QUALITY_BASELINES[key]
    cand = run_config(CandidateSpec.parse(candidate), opts, loaded, tokenizer, text_ids, [])
    comp = compare(base, cand, max_ppl_increase, None)
    assert comp.ppl_increase is not None and comp.next_token_agreement is not None
    return comp


@pytest.fixture(scope="session", autouse=True)
def _threads():
    if torch is not None:
        torch.set_num_threads(os.cpu_count() or 1)


@pytest.fixture(scope="session")
def hf_tiny():
    """The tiny random Llama in transformers (the reference the engine is compared with)."""
    transformers = pytest.importorskip("transformers")
    cfg = tiny_config()
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    missing, unexpected = model.load_state_dict(tiny_weights(cfg), strict=False)
    assert not unexpected and all("rotary" in m for m in missing)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model

"""Pieces of ``cuda_check.py`` that need no device: the synthetic model, its tokenizer,
the transformers reference, a logit recorder on the engine and the comparisons.

Why a synthetic model: the check must run on a CUDA host with no network and no
``gguf`` package, from the source tree alone, so the bundled SmolLM2 GGUF
(98 MB, in a separate package) is not assumed there. Parity and speed only need SmolLM2-135M's *shape*
(which sets every kernel's sizes and the launch count), not its trained
weights; a seeded random model of that shape, built in memory, is the same
work for the GPU and an exact-same-weights target for transformers.

Nothing here imports ``gguf``, ``fastapi``, ``uvicorn`` or ``pydantic``.
"""
from __future__ import annotations

import inspect
import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tokenmill.settings.config import ModelConfig
from tokenmill.model.loader import LoadedModel
from tokenmill.files.tokenizer import Tokenizer

# SmolLM2-135M(-Instruct)'s config.json, in ModelConfig's (Hugging Face's) names.
SMOLLM2_135M = dict(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)

# Standard deviation of the (tied) embedding: the logits are normed hidden states
# (rms ~1) dotted with embedding rows, so their spread is about EMBED_STD *
# sqrt(hidden) = 0.125 * 24 = 3: a clear argmax at most positions, yet not so
# peaked that every row's softmax is one-hot (which would hide logit errors).
EMBED_STD = 0.125


def synthetic_config(num_layers: int | None = None) -> ModelConfig:
    shape = dict(SMOLLM2_135M)
    if num_layers is not None:
        shape["num_hidden_layers"] = num_layers
    return ModelConfig(**shape)


def synthetic_loaded(seed: int = 0, num_layers: int | None = None) -> LoadedModel:
    """A seeded random model with SmolLM2-135M's shape, Hugging Face-named, float32.

    Input projections (q, k, v, gate, up) have std 1/sqrt(fan_in) so activations and
    attention scores stay O(1) (scores of spread ~1: attention neither uniform nor
    one-hot, so a wrong position or a stale cache entry changes the output); the
    projections back into the residual (o, down) are scaled down by sqrt(2 * layers),
    so 30 layers neither blow up the residual nor drown the embedding.
    """
    cfg = synthetic_config(num_layers)
    g = torch.Generator().manual_seed(seed)
    hidden, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    assert hd is not None
    depth = math.sqrt(2 * cfg.num_hidden_layers)

    def rnd(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g).mul_(std)

    def norm() -> torch.Tensor:
        return rnd(hidden, std=0.1).add_(1.0)

    # The final norm's weights are signed (std 1, mean 0): with tied embeddings and a
    # positive final norm, a random model's residual keeps its own input embedding and
    # every greedy sequence repeats one token forever. Signed weights cancel that
    # self-match, so greedy runs wander over the vocabulary (more positions, contexts and
    # cache contents exercised) while the logits keep their spread of ~3.
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rnd(cfg.vocab_size, hidden, std=EMBED_STD),
                                  "model.norm.weight": rnd(hidden, std=1.0)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rnd(cfg.num_attention_heads * hd, hidden, std=hidden ** -0.5)
        w[p + "self_attn.k_proj.weight"] = rnd(cfg.num_key_value_heads * hd, hidden, std=hidden ** -0.5)
        w[p + "self_attn.v_proj.weight"] = rnd(cfg.num_key_value_heads * hd, hidden, std=hidden ** -0.5)
        w[p + "self_attn.o_proj.weight"] = rnd(hidden, cfg.num_attention_heads * hd,
                                               std=(cfg.num_attention_heads * hd) ** -0.5 / depth)
        w[p + "mlp.gate_proj.weight"] = rnd(inter, hidden, std=hidden ** -0.5)
        w[p + "mlp.up_proj.weight"] = rnd(inter, hidden, std=hidden ** -0.5)
        w[p + "mlp.down_proj.weight"] = rnd(hidden, inter, std=inter ** -0.5 / depth)
        w[p + "input_layernorm.weight"] = norm()
        w[p + "post_attention_layernorm.weight"] = norm()
    return LoadedModel(config=cfg, weights=w, quant_types={}, source=f"synthetic-smollm2-135m-seed{seed}",
                       format="hf")


def synthetic_tokenizer(vocab_size: int) -> Tokenizer:
    """A real byte-level BPE tokenizer of exactly ``vocab_size`` ids, built in memory:
    the 256 byte symbols, then two-byte merges, then one end-of-text special at the last
    id. Every id decodes (the detokenizer runs on whatever the model picks)."""
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=ord)
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []
    for a in alphabet:
        for b in alphabet:
            if len(vocab) >= vocab_size - 1:
                break
            vocab[a + b] = len(vocab)
            merges.append((a, b))
    backend = FastTokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|endoftext|>"])
    eos = backend.token_to_id("<|endoftext|>")
    assert eos == vocab_size - 1 and backend.get_vocab_size() == vocab_size, (eos, backend.get_vocab_size())
    return Tokenizer(backend, bos_token_id=None, eos_token_id=eos, vocab_size=vocab_size)


def write_synthetic_folder(folder: str, seed: int = 0, num_layers: int | None = None) -> None:
    """The synthetic model and tokenizer as a Hugging Face folder (config.json,
    model.safetensors, tokenizer.json, tokenizer_config.json), so that ``tokenmill
    serve --model FOLDER`` and the serving benchmarks run on a CUDA host without
    the bundled GGUF. About 540 MB (float32)."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    loaded = synthetic_loaded(seed, num_layers)
    cfg = loaded.config
    tokenizer = synthetic_tokenizer(cfg.vocab_size)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": cfg.vocab_size,
              "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
              "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
              "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
              "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
              "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_word_embeddings,
              "eos_token_id": tokenizer.eos_token_id, "torch_dtype": "float32"}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in loaded.weights.items()}, str(out / "model.safetensors"))
    tokenizer.backend.save(str(out / "tokenizer.json"))
    eos = tokenizer.backend.id_to_token(tokenizer.eos_token_id)
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos, "add_bos_token": False}))


def random_prompts(lengths: list[int], vocab_size: int, seed: int) -> list[list[int]]:
    """Token-id prompts of the given lengths (ids clear of the last, special, id)."""
    rng = random.Random(seed)
    return [[rng.randrange(0, vocab_size - 1) for _ in range(n)] for n in lengths]


# --------------------------------------------------------------------------- reference


def reference_from_loaded(loaded: LoadedModel) -> Any:
    """transformers' LlamaForCausalLM in float32 on the CPU with the same weights
    (the LoadedModel is Hugging Face-named already: nothing to unfuse)."""
    import transformers

    cfg = loaded.config
    if cfg.architecture != "llama" or cfg.rope_scaling or cfg.attention_bias or cfg.qk_norm:
        raise ValueError(f"the in-memory reference covers plain Llama only, not {cfg.architecture}")
    # transformers 5 takes rope settings as ``rope_parameters``; older versions as rope_theta.
    if "rope_parameters" in inspect.signature(transformers.LlamaConfig.__init__).parameters:
        rope: dict[str, Any] = {"rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}}
    else:
        rope = {"rope_theta": cfg.rope_theta}
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=False, mlp_bias=False, **rope)
    model = transformers.LlamaForCausalLM(hf_cfg).to(torch.float32).eval()
    weights = {k: v.float() for k, v in loaded.weights.items()}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    allowed_missing = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    bad = [m for m in missing if m not in allowed_missing and "rotary" not in m]
    if bad or unexpected:
        raise ValueError(f"reference weights: missing {bad[:5]}, unexpected {list(unexpected)[:5]}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    _check_reference_rope(model, cfg)
    _plain_generation(model)
    return model


def reference_from_path(path: str) -> Any:
    """transformers' own loader on a real checkpoint (an independent reading of the file):
    a Hugging Face folder, or a GGUF file dequantized to float32."""
    import os

    import transformers

    if os.path.isdir(path):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        folder, name = os.path.split(path)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32,
            quantization_config=transformers.GgufConfig(gguf_file=name, dequantize=True))
    model = model.eval()
    _plain_generation(model)
    return model


def _plain_generation(model: Any) -> None:
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0


def _check_reference_rope(model: Any, cfg: ModelConfig) -> None:
    """transformers renamed its rope settings between versions; make sure the reference
    really uses cfg.rope_theta (a wrong theta would look like an engine bug)."""
    rotary = getattr(model.model, "rotary_emb", None)
    inv = getattr(rotary, "inv_freq", None)
    if inv is None:
        return
    hd = cfg.head_dim
    assert hd is not None
    want = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    if not torch.allclose(inv.double().cpu(), want, rtol=1e-5):
        raise ValueError("the transformers reference did not take rope_theta "
                         f"{cfg.rope_theta} (inv_freq[1] {float(inv[1])} vs {float(want[1])})")


@torch.inference_mode()
def reference_logits(model: Any, ids: list[int], start: int) -> torch.Tensor:
    """float32 logits of positions ``start..len(ids)-1`` (each predicts the next token)."""
    out = model(torch.tensor([ids]))
    return out.logits[0, start:].float()


@torch.inference_mode()
def reference_greedy(model: Any, prompt: list[int], tokens: int) -> list[int]:
    t = torch.tensor([prompt])
    out = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


# --------------------------------------------------------------------------- the engine side


@dataclass
class LogitRecorder:
    """Wraps one engine's ``runner.execute`` (on the instance) to keep the float32
    logits of every sampled row, per request id, on the CPU. With ``forced`` (request id
    -> token list) it also teacher-forces: the logits handed to the sampler are replaced
    so that greedy picks the given token, while the recorded logits stay the model's own.
    That runs the engine's real decode path (paged cache, graphs) over a fixed sequence."""

    engine: Any
    forced: dict[str, list[int]] = field(default_factory=dict)
    rows: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    _original: Callable | None = None

    def __enter__(self) -> "LogitRecorder":
        runner = self.engine.runner
        self._original = runner.execute
        original = self._original

        def execute(items):  # type: ignore[no-untyped-def]
            logits, sampled = original(items)
            if not sampled:
                return logits, sampled
            host = logits.detach().float().cpu()
            picks: list[tuple[int, int]] = []
            for row, req in enumerate(sampled):
                self.rows.setdefault(req.request_id, []).append(host[row].clone())
                want = self.forced.get(req.request_id)
                if want is not None:
                    picks.append((row, want[len(req.output_token_ids)]))
            if picks:
                logits = torch.full_like(logits, -1e4)
                r = torch.tensor([p[0] for p in picks], device=logits.device)
                t = torch.tensor([p[1] for p in picks], device=logits.device)
                logits[r, t] = 0.0
            return logits, sampled

        runner.execute = execute
        return self

    def __exit__(self, *exc: object) -> None:
        # Drop the instance attribute: the class's method shows through again; and let go
        # of the engine, so that deleting the LLM frees its device memory.
        self.engine.runner.__dict__.pop("execute", None)
        self.engine = None

    def logits(self, request_id: str) -> torch.Tensor:
        return torch.stack(self.rows[request_id])


def run_requests(engine: Any, prompts: list[list[int]], params: Any, prefix: str) -> list[Any]:
    """Queue the prompts on the engine and step it until they finish; the Requests back."""
    reqs = [engine.add_request(f"{prefix}{i}", ids, params)[0] for i, ids in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    return reqs


# --------------------------------------------------------------------------- comparisons


def compare_logits(got: list[torch.Tensor], want: list[torch.Tensor], rel_tolerance: float) -> dict:
    """Teacher-forced comparison of per-position logits (one [T, V] pair per prompt).

    The gate is ``max_abs_diff <= rel_tolerance * logit_scale`` where logit_scale is the
    largest |reference logit| seen: float32 differences grow with the logits' size.
    ``argmax_agreement``: share of positions where both sides' top token is the same;
    where they differ, ``disagreement_top2_gaps`` says how near a tie the reference had."""
    max_abs, scale, positions, agree = 0.0, 0.0, 0, 0
    first_over: list[int | None] = []
    per_prompt: list[float] = []
    gaps: list[float] = []
    for a, b in zip(got, want):
        if a.shape != b.shape:
            raise ValueError(f"logit shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
        diff = (a - b).abs().amax(dim=-1)  # [T]
        scale = max(scale, float(b.abs().max()))
        per_prompt.append(float(diff.max()))
        max_abs = max(max_abs, float(diff.max()))
        positions += a.shape[0]
        same = a.argmax(-1) == b.argmax(-1)
        agree += int(same.sum())
        for pos in (~same).nonzero().flatten().tolist():
            top2 = torch.topk(b[pos], 2).values
            gaps.append(round(float(top2[0] - top2[1]), 6))
        first_over.append(None)
    limit = rel_tolerance * scale
    for i, (a, b) in enumerate(zip(got, want)):
        over = ((a - b).abs().amax(dim=-1) > limit).nonzero().flatten()
        first_over[i] = int(over[0]) if len(over) else None
    return {"positions": positions, "max_abs_logit_diff": max_abs, "logit_scale": scale,
            "rel_logit_diff": max_abs / scale if scale else None, "rel_tolerance": rel_tolerance,
            "max_abs_logit_diff_per_prompt": per_prompt, "first_position_over_tolerance": first_over,
            "argmax_agreement": agree / positions if positions else None,
            "disagreement_top2_gaps": gaps[:20], "passed": bool(positions and max_abs <= limit)}


def compare_tokens(got: list[list[int]], want: list[list[int]]) -> dict:
    """Free-running greedy tokens, engine against reference: identical share of positions
    (counted up to each pair's shorter length) and the first differing index per prompt."""
    same = total = 0
    first: list[int | None] = []
    for a, b in zip(got, want):
        n = min(len(a), len(b))
        total += max(len(a), len(b))
        same += sum(x == y for x, y in zip(a[:n], b[:n]))
        first.append(next((i for i in range(n) if a[i] != b[i]), None if len(a) == len(b) else n))
    return {"prompts": len(got), "identical_sequences": sum(f is None for f in first),
            "identical_token_fraction": same / total if total else None, "first_divergence": first,
            "distinct_tokens": len({t for seq in got for t in seq})}


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(allow_abbrev=False,
                                 description="write the synthetic SmolLM2-shaped model as a Hugging Face folder")
    ap.add_argument("folder")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None)
    a = ap.parse_args()
    write_synthetic_folder(a.folder, a.seed, a.layers)
    print(f"wrote {a.folder}")

"""Grammar engines at this vocabulary: setup, compile and mask cost (how llguidance was chosen).

For each engine installed (llguidance, xgrammar), with the bundled SmolLM2
tokenizer (49,152 tokens): build the tokenizer index, compile a JSON schema,
then walk a valid answer token by token, filling the next-token mask before
each token, for 1 and 16 concurrent sequences. Also checks which engine
refuses JSON-schema keywords it cannot enforce (the server must answer those
with a 400, not free text).

    PYTHONPATH=src .venv/bin/python benchmarks/grammar_engines.py
"""
from __future__ import annotations

import json
import time
from typing import Any

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"}, "summary": {"type": "string"}, "score": {"type": "number"},
    "kind": {"enum": ["a", "b", "c"]},
    "items": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer"},
                                                                          "y": {"type": "boolean"}},
                                         "required": ["x", "y"]}}},
    "required": ["title", "summary", "score", "kind", "items"]}
ANSWER = {"title": "The quick brown fox jumps over the lazy dog",
          "summary": "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor",
          "score": 3.25, "kind": "b", "items": [{"x": 1, "y": True}, {"x": 22, "y": False}]}
UNENFORCEABLE = [{"type": "object", "not": {"required": ["a"]}},
                 {"type": "object", "properties": {"a": {"$ref": "http://example.invalid/s"}}},
                 {"allOf": [{"type": "string"}, {"type": "integer"}]}]


def _timed(fn: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - started


def bench_llguidance(tok: Any, ids: list[int]) -> dict[str, Any]:
    import llguidance
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask_par

    ll_tok, setup = _timed(lambda: llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size,
                                                           eos_token=sorted(tok.eos_token_ids)))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    template, compile_s = _timed(lambda: llguidance.LLMatcher(ll_tok, grammar))
    executor = llguidance.LLExecutor(2)
    out: dict[str, Any] = {"setup_s": setup, "compile_ms": compile_s * 1e3}
    for batch in (1, 16):
        matchers = [template.deep_copy() for _ in range(batch)]
        mask = allocate_token_bitmask(batch, tok.vocab_size)
        spent = 0.0
        for t in ids:
            _, s = _timed(lambda: fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)],
                                                              mask))
            spent += s
            assert all(m.consume_token(t) for m in matchers)
        out[f"mask_ms_per_step_batch{batch}"] = spent / len(ids) * 1e3
    refused = 0
    for schema in UNENFORCEABLE:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            llguidance.LLMatcher.grammar_from_json_schema(schema), ll_tok)
        refused += bool(is_error or messages)
    out["refuses_unenforceable"] = f"{refused}/{len(UNENFORCEABLE)}"
    return out


def bench_xgrammar(tok: Any, ids: list[int]) -> dict[str, Any]:
    import xgrammar as xgr

    vocab = [tok.id_to_token(i) for i in range(tok.vocab_size)]
    compiler, setup = _timed(lambda: xgr.GrammarCompiler(xgr.TokenizerInfo(
        vocab, vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=tok.vocab_size,
        stop_token_ids=sorted(tok.eos_token_ids)), max_threads=2))
    compiled, compile_s = _timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                                      separators=(",", ":")))
    out: dict[str, Any] = {"setup_s": setup, "compile_ms": compile_s * 1e3}
    for batch in (1, 16):
        matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
        mask = xgr.allocate_token_bitmask(batch, tok.vocab_size)
        spent = 0.0
        for t in ids:
            started = time.perf_counter()
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(mask, i)
            spent += time.perf_counter() - started
            assert all(m.accept_token(t) for m in matchers)
        out[f"mask_ms_per_step_batch{batch}"] = spent / len(ids) * 1e3
    refused = 0
    for schema in UNENFORCEABLE:
        try:
            compiler.compile_json_schema(json.dumps(schema))
        except Exception:  # noqa: BLE001 - any refusal counts
            refused += 1
    out["refuses_unenforceable"] = f"{refused}/{len(UNENFORCEABLE)}"
    return out


def main() -> None:
    from tokenmill.files.tokenizer import Tokenizer

    tok = Tokenizer.from_model_path(None)
    ids = tok.encode(json.dumps(ANSWER, separators=(",", ":")), add_special_tokens=False)
    print(f"vocabulary {tok.vocab_size}, answer {len(ids)} tokens")
    for name, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        try:
            result = fn(tok, ids)
        except ImportError:
            print(f"{name}: not installed")
            continue
        print(name, json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()

"""Grammar-constrained sampling in the engine, with the tiny random model: whatever
the random weights prefer, the output must match the grammar."""
from __future__ import annotations

import json
import re

import pytest

from tokenmill.engine.request import SamplingParams
from tokenmill.engine.grammar.structured import GrammarError, GrammarSpec

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(tiny_llm_factory):
    return tiny_llm_factory()


def _gen(llm, prompts, params):
    return [o.outputs for o in llm.generate(prompts, params)]


def test_json_schema_output_validates_in_a_mixed_batch(llm):
    free = SamplingParams(temperature=1.0, seed=1, max_tokens=40)
    schema = SamplingParams(temperature=1.0, seed=2, max_tokens=200, n=2, structured=GrammarSpec("json", SCHEMA))
    regex = SamplingParams(temperature=0.8, seed=3, max_tokens=40, structured=GrammarSpec("regex", r"[a-c]{3}-\d{2}"))
    choice = SamplingParams(temperature=0.0, max_tokens=40, structured=GrammarSpec("choice", ["yes", "no", "maybe"]))
    outs = _gen(llm, ["hello", "json please", "code", "pick"], [free, schema, regex, choice])
    for seq in outs[1]:
        obj = json.loads(seq.text)
        assert set(obj) == {"name", "age", "ok"} and isinstance(obj["age"], int) and 0 <= obj["age"] <= 120
        assert seq.finish_reason == "stop"
    assert re.fullmatch(r"[a-c]{3}-\d{2}", outs[2][0].text), outs[2][0].text
    assert outs[3][0].text in {"yes", "no", "maybe"}
    assert outs[0][0].finish_reason is not None


def test_json_object_and_length_mid_object(llm):
    out = _gen(llm, ["x"], SamplingParams(temperature=0.0, max_tokens=14,
                                          structured=GrammarSpec("json", {"type": "object", "properties": {
                                              "long": {"type": "string", "minLength": 50}}, "required": ["long"]})))
    assert out[0][0].finish_reason == "length"
    assert out[0][0].text.startswith('{"long": "') and len(out[0][0].token_ids) == 14
    obj = _gen(llm, ["y"], SamplingParams(temperature=1.0, seed=5, max_tokens=300,
                                          structured=GrammarSpec("json_object")))[0][0]
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.text.startswith("{")


def test_lark_and_gbnf_grammars(llm):
    lark = GrammarSpec("grammar", 'start: "x" NUM\nNUM: /[0-9]{2}/\n')
    gbnf = GrammarSpec("grammar", 'root ::= "ab" [0-9]')
    outs = _gen(llm, ["g", "h"], [SamplingParams(temperature=1.0, seed=7, max_tokens=10, structured=lark),
                                  SamplingParams(temperature=1.0, seed=8, max_tokens=10, structured=gbnf)])
    assert re.fullmatch(r"x[0-9]{2}", outs[0][0].text)
    assert re.fullmatch(r"ab[0-9]", outs[1][0].text)


@pytest.mark.parametrize("spec, words", [
    (GrammarSpec("json", {"type": "object", "not": {"required": ["a"]}}), "not"),
    (GrammarSpec("json", {"type": "strin"}), "strin"),
    (GrammarSpec("json", "{not json"), "JSON"),
    (GrammarSpec("regex", r"(a)\1"), "backreferences"),
    (GrammarSpec("regex", r"(?<=a)b"), "look-around"),
    (GrammarSpec("grammar", "start: undefined_rule\n"), "undefined_rule"),
    (GrammarSpec("choice", []), "choice"),
])
def test_unenforceable_grammars_are_refused_with_the_reason(llm, spec, words):
    with pytest.raises(GrammarError, match=words):
        llm.engine.structured.compile(spec)
    with pytest.raises(ValueError):
        llm.engine.add_request("bad", "x", SamplingParams(structured=spec))
    assert not llm.engine.has_unfinished()
    # and the engine keeps serving
    assert _gen(llm, ["still"], SamplingParams(temperature=0.0, max_tokens=3))[0][0].token_ids


def test_eos_only_when_the_grammar_accepts(llm):
    # the tiny model's EOS is a normal logit; a grammar needing 4 digits must get all 4 first
    params = SamplingParams(temperature=1.5, seed=11, max_tokens=20, structured=GrammarSpec("regex", r"[0-9]{4}"))
    for out in _gen(llm, ["a", "b", "c"], params):
        assert re.fullmatch(r"[0-9]{4}", out[0].text)


def test_objects_are_closed_unless_the_schema_opens_them(llm):
    from tokenmill.engine.grammar.structured import closed_schema

    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "c": {"type": "array", "items": {"type": "object",
                                                                                "properties": {}}}},
              "$defs": {"D": {"type": "object", "properties": {"x": {}}, "additionalProperties": True}}}
    closed = closed_schema(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["c"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["D"]["additionalProperties"] is True
    assert "additionalProperties" not in schema  # the caller's schema is not modified
    # through the engine: only the listed key can appear
    spec = GrammarSpec("json", {"type": "object", "properties": {"k": {"type": "boolean"}}})
    for out in _gen(llm, ["p", "q"], SamplingParams(temperature=1.0, seed=3, max_tokens=60, structured=spec)):
        assert set(json.loads(out[0].text)) <= {"k"}


def test_grammar_state_survives_preemption(tiny_llm_factory):
    llm = tiny_llm_factory(num_blocks=10, max_num_batched_tokens=64)
    spec = GrammarSpec("regex", r"(ab|cd){20}[0-9]{10}")
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=60, structured=spec)
    outs = llm.generate([f"prompt {i}" for i in range(6)], params)
    assert llm.engine.total_preemptions > 0
    for out in outs:
        assert re.fullmatch(r"(ab|cd){20}[0-9]{10}", out.outputs[0].text), out.outputs[0].text


def test_apply_bitmask_masks_exactly_the_cleared_bits():
    import torch

    from tokenmill.model.sampler import apply_bitmask

    vocab = 70  # not a multiple of 32: the last word is partly padding
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=g)
    allowed = torch.rand(2, 96, generator=g) < 0.3
    allowed[1] = False  # a row allowing nothing is left as it was
    words = (allowed.view(2, 3, 32).long() << torch.arange(32)).sum(-1)
    mask = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    out = logits.clone()
    apply_bitmask(out, [2, 0], mask)
    assert torch.equal(out[1], logits[1]) and torch.equal(out[0], logits[0])
    expect = logits[2].masked_fill(~allowed[0, :vocab], float("-inf"))
    assert torch.equal(out[2], expect)

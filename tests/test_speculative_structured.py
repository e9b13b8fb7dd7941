"""Speculative decoding of grammar-constrained requests, with the tiny random model.

The random weights rarely continue a prompt the way n-gram lookup guesses, and
the prompts are built so that lookup proposes text the grammar refuses: the
proposals are cut at the grammar, the verify rows are masked, and the output
must be token for token what constrained decoding without speculation gives."""
from __future__ import annotations

import json
import re

import pytest
import torch

from conftest import make_tiny_llm
from tokenmill import SamplingParams
from tokenmill.engine.step.executors import FusedDecodeExecutor
from tokenmill.engine.step.step_batch import RowKind
from tokenmill.engine.spec.speculative import SpeculativeConfig, Speculator
from tokenmill.engine.grammar.structured import GrammarSpec, grammar_prefix

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                                                    "maxItems": 5}},
          "required": ["name", "tags"]}
JSON = GrammarSpec("json", SCHEMA)
REGEX = GrammarSpec("regex", r"(ab|[0-9]{2}|x)+")
# Lookup finds the JSON and regex fragments repeated here, and free text the grammar refuses.
PROMPTS = ['{"name": "abc", "tags": ["ab", "ab"]} ' * 3, "aaaa bbbb aaaa bbbb 1212 1212 ab ab x",
           'xyz"xyz"xyz qq qq qq', "The cat sat. The cat sat. The cat"]


class _Recording:
    """Wraps a proposer and keeps what it proposed, before the grammar cut it."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.raw: list[tuple[object, list[int]]] = []

    def propose(self, requests, ks):
        drafts = self.inner.propose(requests, ks)
        self.raw += [(r, list(d)) for r, d in zip(requests, drafts)]
        return drafts


def _tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def plain():
    return make_tiny_llm()


@pytest.mark.parametrize("grammar", [JSON, REGEX], ids=["json_schema", "regex"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
def test_greedy_output_is_the_plain_constrained_output(plain, grammar, fused, monkeypatch):
    if not fused:
        monkeypatch.setenv("TOKENMILL_FUSED_DECODE", "0")
    params = SamplingParams(temperature=0.0, max_tokens=48, structured=grammar)
    want = _tokens(plain, PROMPTS, params)
    llm = make_tiny_llm(speculative_config=SPEC)
    runner = llm.engine.runner
    fused_executors = [e for e in runner.executors if isinstance(e, FusedDecodeExecutor)]
    assert bool(fused_executors) == fused
    fused_verifies = 0

    for executor in fused_executors:
        real_fused = executor.run

        def counting(batch, real_fused=real_fused):
            nonlocal fused_verifies
            fused_verifies += sum(1 for s in batch.seqs if s.kind is RowKind.VERIFY and s.grammar is not None)
            return real_fused(batch)

        monkeypatch.setattr(executor, "run", counting)
    spec = llm.engine.speculator
    spec.proposer = _Recording(spec.proposer)
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    assert [o.token_ids for o in outs] == want
    assert spec.stats.num_draft_tokens > 0 and spec.stats.num_accepted_tokens > 0
    assert spec.stats.num_accepted_tokens < spec.stats.num_draft_tokens  # some proposals were wrong
    # lookup proposed tokens the grammar refused, and those never reached a verify
    cut = sum(1 for _, d in spec.proposer.raw if d) - spec.stats.num_drafts
    assert cut > 0
    assert (fused_verifies > 0) == fused
    if grammar is REGEX:
        assert all(re.fullmatch(r"(ab|[0-9]{2}|x)+", o.text) for o in outs if o.finish_reason == "stop")
    llm.engine.check_idle_invariants()


def test_draft_model_proposals_with_a_grammar(plain, tmp_path):
    """A draft model proposes unconstrained text (here the target's own weights, whose
    free argmax the grammar refuses); cut at the grammar, nothing it proposes reaches a
    verify, and the output is the plain constrained output."""
    from conftest import save_tiny_hf_folder

    params = SamplingParams(temperature=0.0, max_tokens=30, structured=REGEX)
    want = _tokens(plain, PROMPTS, params)
    llm = make_tiny_llm(speculative_config={"method": "draft_model", "model": save_tiny_hf_folder(tmp_path),
                                            "num_speculative_tokens": 3, "draft_kv_cache_memory": "16MiB"})
    spec = llm.engine.speculator
    spec.proposer = _Recording(spec.proposer)
    assert _tokens(llm, PROMPTS, params) == want
    assert any(d for _, d in spec.proposer.raw)
    assert spec.stats.num_draft_tokens == 0
    llm.engine.check_idle_invariants()


def test_matcher_holds_exactly_the_emitted_tokens_after_every_step():
    llm = make_tiny_llm(speculative_config=SPEC)
    engine = llm.engine
    fresh = {}
    for i, p in enumerate(PROMPTS):
        grammar = JSON if i % 2 == 0 else REGEX
        (req,) = engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=40, structured=grammar))
        fresh[req.request_id] = (req, grammar)
    checked = 0
    while engine.has_unfinished():
        engine.step()
        for req, grammar in fresh.values():
            if req.is_finished:
                continue
            replay = engine.structured.compile(grammar)
            assert replay.consume_tokens(req.output_token_ids)
            assert req.grammar.compute_bitmask() == replay.compute_bitmask()
            assert req.grammar.is_accepting() == replay.is_accepting()
            assert not req.spec_token_ids  # nothing left over from a verify
            checked += 1
    assert checked > 20 and engine.speculator.stats.num_accepted_tokens > 0
    engine.check_idle_invariants()


def test_preemption_and_abort_mid_speculation_with_a_grammar(plain):
    params = SamplingParams(temperature=0.0, max_tokens=40, structured=JSON)
    prompts = PROMPTS * 2
    want = _tokens(plain, prompts, params)
    tight = make_tiny_llm(speculative_config=SPEC, num_blocks=16, max_num_seqs=8)
    assert _tokens(tight, prompts, params) == want
    assert tight.engine.total_preemptions > 0 and tight.engine.speculator.stats.num_draft_tokens > 0
    tight.engine.check_idle_invariants()

    # An older request's prefill chunk takes the blocks of a newer one already scheduled
    # with its proposals: the victim is preempted holding them.
    loop = SamplingParams(temperature=0.0, max_tokens=30, structured=GrammarSpec("regex", r"(ab12)+"))
    pair = ["x" * 150, "ab12" * 5]
    want = _tokens(plain, pair, loop)
    tight = make_tiny_llm(speculative_config=SPEC, num_blocks=12, max_num_batched_tokens=32)
    scheduler = tight.engine.scheduler
    real_preempt = scheduler._preempt
    holding = []

    def preempt(request):
        holding.append(bool(request.spec_token_ids))
        real_preempt(request)

    scheduler._preempt = preempt
    assert _tokens(tight, pair, loop) == want
    assert any(holding)
    tight.engine.check_idle_invariants()

    llm = make_tiny_llm(speculative_config=SPEC)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", p, SamplingParams(temperature=0.0, max_tokens=60, structured=REGEX))
    for _ in range(12):
        engine.step()
    # proposals made for a step that never runs: the abort finds them pending
    engine.speculator.propose([r for r in engine.scheduler.running if r.num_tokens - r.num_computed_tokens == 1])
    assert any(r.spec_token_ids for r in engine.scheduler.running)
    for i in range(len(prompts)):
        engine.abort_request(f"a{i}")
    assert not engine.has_unfinished()
    engine.check_idle_invariants()


def test_sampled_rows_keep_the_constrained_distribution():
    """With a mask, the first token follows the masked row's distribution and a
    proposal outside the mask is never accepted, whatever is proposed."""
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=1))
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0], [0.0, 0.3, 2.5, 0.1, -0.5]])
    allowed = [0b01110, 0b11111]  # row 0: tokens 1, 2, 3 only
    mask = torch.tensor([[a] for a in allowed], dtype=torch.int32)
    p0 = torch.full((5,), float("-inf"))
    p0[[1, 2, 3]] = logits[0, [1, 2, 3]]
    p0 = p0.softmax(-1)
    gen = torch.Generator().manual_seed(0)
    n = 1000
    first = torch.zeros(5)
    for proposal in ([1], [0]):
        for _ in range(n // 2):
            req = _request(proposal)
            out = spec.verify(req, logits, gen, mask)
            first[out[0]] += 1
            assert out[0] != 0
    assert float((first / n - p0).abs().max()) < 0.06  # ~3.5 standard errors


def _request(draft):
    from types import SimpleNamespace

    return SimpleNamespace(params=SamplingParams(temperature=1.0), spec_token_ids=list(draft), generator=None,
                           spec_misses=0, spec_backoff_until=0, output_token_ids=[], max_tokens=100)


def test_grammar_prefix_cuts_at_the_first_refused_token_and_before_eos(plain):
    structured = plain.engine.structured
    tok = plain.engine.tokenizer
    eos = structured.eos_token_ids
    matcher = structured.compile(GrammarSpec("regex", r"ab[0-9]{2}"))
    ids = tok.encode("ab12", add_special_tokens=False)
    assert grammar_prefix(matcher, ids, eos) == len(ids)
    assert grammar_prefix(matcher, ids + [eos[0]], eos) == len(ids)  # EOS is never proposed
    assert grammar_prefix(matcher, ids[:1] + tok.encode("zz", add_special_tokens=False), eos) == 1
    assert grammar_prefix(matcher, [], eos) == 0
    assert matcher.consume_tokens(ids)  # the checks left the matcher where it was
    assert grammar_prefix(matcher, ids, eos) == 0  # the grammar is complete: nothing more fits


def test_step_masks_are_the_masks_at_each_verify_position(plain):
    """A step mixing a request with proposals and one without: the first gets the mask
    before each proposal and after the last, the second its one mask; neither matcher moves."""
    from types import SimpleNamespace

    structured = plain.engine.structured
    tok = plain.engine.tokenizer
    draft = tok.encode('{"name": "ab', add_special_tokens=False)
    a = SimpleNamespace(grammar=structured.compile(JSON), spec_token_ids=draft)
    b = SimpleNamespace(grammar=structured.compile(REGEX), spec_token_ids=[])
    masks = structured.fill_step([b, a], [b.spec_token_ids, a.spec_token_ids])
    replay = structured.compile(JSON)
    for i in range(len(draft) + 1):
        assert masks.of(a, len(draft) + 1)[i].numpy().tobytes() == replay.compute_bitmask()
        if i < len(draft):
            assert replay.consume_token(draft[i])
    assert masks.of(b).numpy().tobytes() == structured.compile(REGEX).compute_bitmask()
    assert a.grammar.compute_bitmask() == structured.compile(JSON).compute_bitmask()
    assert torch.equal(masks.select([a, b]), torch.stack([masks.of(a)[0], masks.of(b)[0]]))


def test_sampled_constrained_speculation_stays_in_the_grammar():
    llm = make_tiny_llm(speculative_config=SPEC)
    params = SamplingParams(temperature=0.7, seed=11, max_tokens=120, structured=JSON, n=2)
    outs = llm.generate(PROMPTS[:2], params)
    for out in outs:
        for seq in out.outputs:
            if seq.finish_reason == "stop":
                obj = json.loads(seq.text)
                assert set(obj) == {"name", "tags"}
            else:
                assert seq.text.startswith('{"name": "')
    assert llm.engine.speculator.stats.num_drafts > 0
    llm.engine.check_idle_invariants()


@pytest.mark.slow
def test_real_server_json_schema_with_speculation():
    """The bundled model behind `tokenmill serve --speculative-config`: a JSON-schema
    answer that repeats spans of the prompt (so proposals are accepted) is the text the
    same request gives with speculation off, and it validates."""
    openai = pytest.importorskip("openai")
    from test_server_support import metric, real_server

    import httpx

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                                               "job": {"type": "string"}},
              "required": ["name", "city", "job"]}
    prompt = ('Copy this JSON exactly: {"name": "Maria Oliveira", "city": "Porto Alegre", '
              '"job": "marine biologist"}')
    with real_server("--served-model-name", "smol", "--kv-cache-memory", "128MiB", "--speculative-config", json.dumps(
            {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
        texts = []
        for speculative in (True, False):
            r = client.chat.completions.create(
                model="smol", messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=80,
                response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
                extra_body={"speculative": speculative})
            texts.append(r.choices[0].message.content)
            assert r.choices[0].finish_reason == "stop"
        assert texts[0] == texts[1]
        obj = json.loads(texts[0])
        assert obj == {"name": "Maria Oliveira", "city": "Porto Alegre", "job": "marine biologist"}
        text = httpx.get(server.url + "/metrics").text
        assert metric(text, "vllm:spec_decode_num_accepted_tokens_total") > 0

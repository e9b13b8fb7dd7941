"""Speculative decoding (n-gram proposals): the proposer, exact acceptance, and the
engine's output with it on, against the same engine with it off."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from conftest import make_tiny_llm
from tokenmill import SamplingParams
from tokenmill.engine.spec.speculative import SpeculativeConfig, Speculator, propose_ngram

GREEDY = dict(temperature=0.0, ignore_eos=True)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def test_proposer_takes_the_latest_longest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    # suffix [1, 2, 3] last seen at 4..6, followed by 7, 8, 5
    assert propose_ngram(tokens, 3, 3, 1) == [7, 8, 5]
    assert propose_ngram(tokens, 10, 3, 1) == [7, 8, 5, 1, 2, 3]  # runs to the end of the history
    assert propose_ngram([4, 5, 6], 3, 3, 1) == []
    assert propose_ngram([4, 5, 4], 2, 3, 2) == []  # n below prompt_lookup_min does not count
    assert propose_ngram([4, 5, 4], 2, 3, 1) == [5, 4]


def test_config_parses_vllm_json_and_refuses_what_it_cannot_do():
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}')
    assert cfg is not None and cfg.num_speculative_tokens == 5 and cfg.prompt_lookup_max == 4
    with pytest.raises(ValueError, match="not JSON"):
        SpeculativeConfig.parse("{method: ngram}")
    with pytest.raises(ValueError, match="unknown keys"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokenz": 3})
    with pytest.raises(ValueError, match="not supported"):
        SpeculativeConfig.parse({"method": "eagle"})
    with pytest.raises(ValueError, match="draft model"):
        SpeculativeConfig.parse({"method": "ngram", "model": "some/model"})
    with pytest.raises(ValueError, match="needs"):
        SpeculativeConfig.parse({"method": "draft_model"})
    assert SpeculativeConfig.parse({"model": "/m", "num_speculative_tokens": 2}).method == "draft_model"
    assert SpeculativeConfig.parse({"model": "[ngram]"}).method == "ngram"


def _request(draft, temperature=1.0, top_k=-1, generator=None):
    params = SamplingParams(temperature=temperature, top_k=top_k)
    return SimpleNamespace(params=params, spec_token_ids=list(draft), generator=generator, spec_misses=0,
                           spec_backoff_until=0, output_token_ids=[], max_tokens=100)


def test_rejection_sampling_keeps_the_distribution():
    """Whatever is proposed, the first token's frequencies follow the row's distribution,
    and the token after an accepted proposal follows the next row's."""
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=2))
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0], [0.0, 0.3, 2.5, 0.1, -0.5], [1.0, 1.0, 1.0, 1.0, 1.0]])
    p0, p1 = logits[0].softmax(-1), logits[1].softmax(-1)
    gen = torch.Generator().manual_seed(0)
    n = 20000
    first = torch.zeros(5)
    second = torch.zeros(5)
    for _ in range(n):
        out = spec.verify(_request([1, 3]), logits, gen)
        first[out[0]] += 1
        if out[0] == 1:
            second[out[1]] += 1
    assert float((first / n - p0).abs().max()) < 0.015
    assert float((second / second.sum() - p1).abs().max()) < 0.02
    assert spec.stats.num_drafts == n and 0 < spec.stats.acceptance_rate < 1


def test_top_k_is_respected_by_acceptance():
    """A proposal outside the top-k has probability 0: always rejected."""
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=1))
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        out = spec.verify(_request([3], top_k=2), logits, gen)
        assert len(out) == 1 and out[0] in (0, 1)


def test_greedy_takes_proposals_while_they_match_and_backs_off_on_misses():
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=3, max_backoff_steps=8))
    logits = torch.full((4, 6), -5.0)
    for row, best in enumerate([2, 4, 1, 5]):
        logits[row, best] = 5.0
    assert spec.verify(_request([2, 4, 0], temperature=0.0), logits, None) == [2, 4, 1]
    assert spec.verify(_request([2, 4, 1], temperature=0.0), logits, None) == [2, 4, 1, 5]
    req = _request([3, 3, 3], temperature=0.0)
    assert spec.verify(req, logits, None) == [2]
    assert req.spec_misses == 1 and req.spec_backoff_until > spec._step


def _repetitive_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a span, so n-gram lookup finds proposals."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        span = [rng.randrange(256) for _ in range(rng.randint(6, 14))]
        out.append([rng.randrange(256) for _ in range(5)] + span * 3 + span[:3])
    return out


@pytest.mark.parametrize("engine_opts", [{}, {"num_blocks": 14, "max_num_seqs": 6}, {"enable_prefix_caching": False}],
                         ids=["default", "preempting", "no-prefix-cache"])
def test_greedy_text_is_identical_with_and_without_speculation(engine_opts):
    prompts = _repetitive_prompts(6, seed=3)
    params = SamplingParams(max_tokens=24, **GREEDY)
    plain = make_tiny_llm(**engine_opts)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    spec = make_tiny_llm(speculative_config=SPEC, **engine_opts)
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    assert got == want
    stats = spec.engine.speculator.stats
    assert stats.num_draft_tokens > 0
    spec.engine.check_idle_invariants()
    if "num_blocks" in engine_opts:
        assert spec.engine.total_preemptions > 0


def test_eager_verify_path_matches_too(monkeypatch):
    """With the fused CPU decode step off, proposals are checked as prefill chunks."""
    monkeypatch.setenv("TOKENMILL_FUSED_DECODE", "0")
    prompts = _repetitive_prompts(3, seed=4)
    params = SamplingParams(max_tokens=20, **GREEDY)
    want = [o.outputs[0].token_ids for o in make_tiny_llm().generate(prompts, params)]
    spec = make_tiny_llm(speculative_config=SPEC)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == want
    assert spec.engine.speculator.stats.num_draft_tokens > 0


def test_opt_out_penalties_and_stops():
    """speculative=False and penalties decode one token at a time; a stop token inside
    accepted proposals ends the text where the plain engine ends it."""
    prompts = _repetitive_prompts(2, seed=5)
    spec = make_tiny_llm(speculative_config=SPEC)
    spec.generate(prompts, SamplingParams(max_tokens=12, speculative=False, **GREEDY))
    spec.generate(prompts, SamplingParams(max_tokens=12, repetition_penalty=1.3, **GREEDY))
    assert spec.engine.speculator.stats.num_drafts == 0
    plain = make_tiny_llm()
    free = [o.outputs[0].token_ids for o in plain.generate(prompts, SamplingParams(max_tokens=16, **GREEDY))]
    stop = free[0][5]
    params = SamplingParams(max_tokens=16, stop_token_ids=[stop], **GREEDY)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == want
    spec.engine.check_idle_invariants()


def test_abort_mid_speculation_frees_everything():
    spec = make_tiny_llm(speculative_config=SPEC)
    engine = spec.engine
    for i, p in enumerate(_repetitive_prompts(4, seed=6)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=40, **GREEDY))
    for _ in range(6):
        engine.step()
    for i in range(4):
        engine.abort_request(f"r{i}")
    assert not engine.has_unfinished()
    engine.check_idle_invariants()


def test_server_reports_speculation_in_metrics_and_console():
    import asyncio

    import httpx

    from test_server_support import make_tiny_app, metric

    from tokenmill.entrypoints.console.console import mount_console

    app = make_tiny_app({"speculative_config": SPEC})
    mount_console(app, ui=False)
    try:
        async def go() -> tuple[str, dict, dict]:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                         timeout=60) as client:
                prompt = "abcdefgh " * 6
                done = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 24,
                                                                  "temperature": 0})
                off = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 24,
                                                                 "temperature": 0, "speculative": False})
                assert done.status_code == off.status_code == 200
                assert done.json()["choices"][0]["text"] == off.json()["choices"][0]["text"]
                return ((await client.get("/metrics")).text, (await client.get("/v1/engine/stats")).json(),
                        done.json())
        text, stats, _ = asyncio.run(go())
        drafted = metric(text, "vllm:spec_decode_num_draft_tokens_total")
        assert drafted > 0
        assert metric(text, "vllm:spec_decode_num_accepted_tokens_total") <= drafted
        assert stats["speculative"]["enabled"] and stats["speculative"]["draft_tokens"] == drafted
    finally:
        app.state.tokenmill.aengine.shutdown()


def test_draft_model_proposals(tmp_path):
    """A draft model (here the target's own weights, saved to disk): every greedy
    proposal is accepted and the text is the plain engine's; a different draft
    (other weights) is often rejected and the text is still the plain engine's."""
    from conftest import save_tiny_hf_folder

    prompts = [[(7 * i + j) % 250 for j in range(20 + 3 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=20, **GREEDY)
    want = [o.outputs[0].token_ids for o in make_tiny_llm().generate(prompts, params)]
    same = save_tiny_hf_folder(tmp_path / "same") if (tmp_path / "same").mkdir() is None else ""
    llm = make_tiny_llm(speculative_config={"model": same, "num_speculative_tokens": 3,
                                            "draft_kv_cache_memory": "16MiB"})
    assert llm.engine.speculator.config.method == "draft_model"
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > 20 and stats.num_accepted_tokens == stats.num_draft_tokens
    (tmp_path / "other").mkdir()
    other = save_tiny_hf_folder(tmp_path / "other", seed=9)
    llm2 = make_tiny_llm(speculative_config={"method": "draft_model", "model": other, "num_speculative_tokens": 3})
    assert [o.outputs[0].token_ids for o in llm2.generate(prompts, params)] == want
    assert llm2.engine.speculator.stats.num_accepted_tokens < llm2.engine.speculator.stats.num_draft_tokens
    assert not llm2.engine.speculator.proposer._shadows or all(
        t.is_finished for t, _ in llm2.engine.speculator.proposer._shadows.values())
    llm2.engine.check_idle_invariants()

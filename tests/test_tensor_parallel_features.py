"""Per-row step features under tensor parallelism: three ranks on gloo answer as one does.

Prompt logprobs (``SamplingParams.prompt_logprobs``, what ``LLM.score``, echo with
logprobs and lm-eval's loglikelihood read), speculative verify rows and
grammar-constrained rows go through the same eager step on one device and on a
group; the tiny random Llama (float32, six heads over three KV heads, one thread
per rank) must give the same tokens, ranks and top alternatives, and logprobs
within float32 reduction noise.
Slow: the group starts two worker processes.
"""
from __future__ import annotations

import pytest

from conftest import make_tiny_llm
from tokenmill import SamplingParams
from tokenmill.engine.grammar.structured import GrammarSpec

pytestmark = pytest.mark.slow

SPLITS_BY_3 = {"hidden_size": 96, "intermediate_size": 192, "num_attention_heads": 6, "num_key_value_heads": 3}
PROMPTS = [[5, 9, 14, 200, 31, 31, 7], list(range(40, 75)), [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
TOLERANCE = 1e-4
# An ngram proposer that finds matches in these prompts: verify rows in the steps.
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}


def answers(tp: int) -> dict[str, object]:
    """Everything compared, from one engine of ``tp`` ranks (closed before the next starts)."""
    with make_tiny_llm(tensor_parallel_size=tp, num_threads=1, model_overrides=SPLITS_BY_3,
                       speculative_config=SPEC) as llm:
        echoed = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                      prompt_logprobs=2, logprobs=2))
        scored = llm.score(PROMPTS, top=3)
        chosen = llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=6,
                                                          structured=GrammarSpec("choice", ("ab", "ba", "aab"))))
        return {"drafts": llm.engine.speculator.stats.num_draft_tokens,
                "echo_prompt": [o.prompt_logprobs for o in echoed],
                "echo_tokens": [o.outputs[0].token_ids for o in echoed],
                "echo_logprobs": [o.outputs[0].logprobs for o in echoed],
                "score": scored,
                "grammar": [o.outputs[0].text for o in chosen]}


@pytest.fixture(scope="module")
def one_and_three():
    return answers(1), answers(3)


def assert_same_logprobs(got, want) -> None:
    """Lists of ``Logprob`` (or None) per prompt: same tokens, ranks and alternatives."""
    assert len(got) == len(want)
    for g_seq, w_seq in zip(got, want):
        assert g_seq is not None and len(g_seq) == len(w_seq)
        for g, w in zip(g_seq, w_seq):
            if w is None:
                assert g is None
                continue
            assert g.token_id == w.token_id and g.rank == w.rank and set(g.top) == set(w.top)
            assert abs(g.logprob - w.logprob) < TOLERANCE
            assert all(abs(g.top[t] - w.top[t]) < TOLERANCE for t in w.top)


def test_prompt_logprobs_match_one_rank(one_and_three):
    one, three = one_and_three
    assert all(p is not None and len(p) == len(q) for p, q in zip(one["echo_prompt"], PROMPTS))
    assert_same_logprobs(three["echo_prompt"], one["echo_prompt"])


def test_echo_with_logprobs_matches_one_rank(one_and_three):
    """What the completions endpoint's ``echo`` with ``logprobs`` reads: prompt and output
    logprobs; the outputs come through speculative verify rows."""
    one, three = one_and_three
    assert one["drafts"] > 0 and three["drafts"] == one["drafts"]
    assert three["echo_tokens"] == one["echo_tokens"]
    assert_same_logprobs(three["echo_prompt"], one["echo_prompt"])
    assert_same_logprobs(three["echo_logprobs"], one["echo_logprobs"])


def test_score_matches_one_rank(one_and_three):
    one, three = one_and_three
    assert all(len(s) == len(p) for s, p in zip(one["score"], PROMPTS))
    assert_same_logprobs(three["score"], one["score"])


def test_grammar_rows_match_one_rank(one_and_three):
    one, three = one_and_three
    assert all(text in ("ab", "ba", "aab") for text in one["grammar"])
    assert three["grammar"] == one["grammar"]


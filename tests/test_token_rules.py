"""logit_bias, allowed_token_ids and bad_words in the sampler (batched rows with
different rules) and through the engine on the tiny model, greedy and random."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from conftest import make_tiny_llm
from tokenmill import SamplingParams
from tokenmill.model.sampler import sample


@dataclass
class Row:
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    eos_token_ids: frozenset[int] = frozenset()

    @property
    def all_token_ids(self) -> list[int]:
        return self.output_token_ids


def _greedy(**rules) -> SamplingParams:
    return SamplingParams(temperature=0.0, **rules)


def test_each_row_keeps_its_own_rules_in_one_batch() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]]).repeat(5, 1)
    rows = [Row(_greedy(logit_bias={0: -100})),  # ban the best
            Row(_greedy(logit_bias={4: 100})),  # force the worst
            Row(_greedy(allowed_token_ids=[2, 3])),
            Row(_greedy(bad_words_token_ids=[[0], [1]])),
            Row(_greedy())]
    assert sample(logits, rows).token_ids == [1, 4, 2, 2, 0]


def test_a_bad_word_of_several_tokens_bans_its_last_token_only_after_its_head() -> None:
    logits = torch.tensor([[1.0, 5.0, 2.0]])
    word = [[2, 1]]  # "2 then 1"
    assert sample(logits, [Row(_greedy(bad_words_token_ids=word), output_token_ids=[0])]).token_ids == [1]
    assert sample(logits, [Row(_greedy(bad_words_token_ids=word), output_token_ids=[0, 2])]).token_ids == [2]


def test_random_rows_never_leave_the_allowed_set_or_draw_a_banned_token() -> None:
    logits = torch.zeros(200, 50)
    gen = torch.Generator().manual_seed(0)
    allowed = [Row(SamplingParams(temperature=1.0, allowed_token_ids=[3, 7, 11])) for _ in range(100)]
    banned = [Row(SamplingParams(temperature=1.0, logit_bias={t: -100 for t in range(25)})) for _ in range(100)]
    picked = sample(logits, allowed + banned, gen).token_ids
    assert set(picked[:100]) == {3, 7, 11}
    assert min(picked[100:]) >= 25


def test_bad_values_are_refused() -> None:
    with pytest.raises(ValueError, match="outside \\[-100, 100\\]"):
        SamplingParams(logit_bias={5: 1000})
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="out of range"):
        SamplingParams(logit_bias={10**6: 1}).check_vocab(1000)


@pytest.fixture(scope="module")
def llm():
    return make_tiny_llm()


def test_engine_honours_the_rules_greedy_and_random(llm) -> None:
    prompt = [[5, 6, 7, 8, 9]]
    base = llm.generate(prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12))[0]
    tokens = base.outputs[0].token_ids
    first = tokens[0]
    banned = llm.generate(prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12,
                                                 logit_bias={t: -100 for t in set(tokens)}))[0]
    assert not set(banned.outputs[0].token_ids) & set(tokens)
    forced = llm.generate(prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6,
                                                 logit_bias={42: 100}))[0]
    assert forced.outputs[0].token_ids == [42] * 6
    kept = llm.generate(prompt, SamplingParams(temperature=1.0, seed=3, ignore_eos=True, max_tokens=24, n=3,
                                               allowed_token_ids=[17, 18, 19]))[0]
    assert all(set(o.token_ids) <= {17, 18, 19} for o in kept.outputs)
    words = llm.generate(prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12,
                                                bad_words_token_ids=[[first]]))[0]
    assert first not in words.outputs[0].token_ids
    with pytest.raises(ValueError, match="out of range"):
        llm.generate(prompt, SamplingParams(logit_bias={10**6: 1.0}))

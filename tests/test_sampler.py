"""The sampler's random path draws tokens with the right frequencies, honours its
filters, and a seeded row is reproducible whatever shares its batch."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.engine.request import SamplingParams
from tokenmill.model.sampler import sample


@dataclass
class Row:
    params: SamplingParams
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: frozenset[int] = frozenset()

    @property
    def all_token_ids(self) -> list[int]:
        return self.output_token_ids


def test_frequencies_follow_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05])
    logits = probs.clamp_min(1e-30).log()[None].repeat(400, 1)
    rows = [Row(SamplingParams(temperature=1.0)) for _ in range(400)]
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(5)
    for _ in range(10):
        for t in sample(logits, rows, gen).token_ids:
            counts[t] += 1
    freq = counts / counts.sum()
    assert counts[1] == 0  # a zero-probability token is never drawn
    torch.testing.assert_close(freq, probs, atol=0.02, rtol=0)


def test_top_k_and_temperature_limit_the_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 2.8, -1.0, 0.5]]).repeat(200, 1)
    rows = [Row(SamplingParams(temperature=1.0, top_k=2)) for _ in range(200)]
    picked = set(sample(logits, rows, torch.Generator().manual_seed(1)).token_ids)
    assert picked == {0, 1}
    cold = [Row(SamplingParams(temperature=1e-4)) for _ in range(50)]
    assert set(sample(logits[:50], cold, torch.Generator().manual_seed(2)).token_ids) == {0}


def test_seeded_row_is_reproducible_whatever_shares_the_batch() -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(3))

    def seeded() -> Row:
        return Row(SamplingParams(temperature=1.0, seed=7), torch.Generator().manual_seed(7))

    others = [Row(SamplingParams(temperature=1.0)) for _ in range(5)]
    shared = torch.Generator().manual_seed(99)
    # The seeded row's draws depend only on its generator and its own logits row.
    row_a, row_b = seeded(), seeded()
    a = [sample(logits[:1], [row_a], None).token_ids[0] for _ in range(20)]
    b = [sample(torch.cat([logits[1:3], logits[:1]]), [*others[:2], row_b], shared).token_ids[2] for _ in range(20)]
    assert a == b
    assert len(set(a)) > 1  # it is actually sampling

"""The step batch (engine/step/step_batch.py): built once, every executor's view derived from it."""
from __future__ import annotations

import pytest

from tokenmill.engine.request import Request, SamplingParams
from tokenmill.engine.step.step_batch import RowKind, StepBatch


def _request(rid: str, prompt: int, computed: int, output: int = 0, spec: int = 0, max_tokens: int = 8) -> Request:
    req = Request(rid, list(range(10, 10 + prompt)), SamplingParams(max_tokens=max_tokens, prompt_logprobs=0))
    req.max_tokens = max_tokens
    req.output_token_ids = [90 + i for i in range(output)]
    req.spec_token_ids = [70 + i for i in range(spec)]
    req.num_computed_tokens = computed
    req.block_table = list(range(100, 100 + -(-(req.num_tokens + spec) // 4)))
    return req


def test_kinds_rows_and_orders() -> None:
    verify = _request("v", 5, 6, output=2, spec=2)  # one token plus two proposals
    chunk = _request("c", 9, 4)  # a prompt's second chunk, reaching its end
    partial = _request("p", 9, 0)  # a first chunk short of the prompt's end: samples nothing
    decode = _request("d", 3, 4, output=2)
    score = _request("s", 6, 0, max_tokens=0)  # scores its prompt only
    batch = StepBatch.build([(verify, 3), (chunk, 5), (partial, 4), (decode, 1), (score, 6)])
    assert [s.kind for s in batch.seqs] == [RowKind.VERIFY, RowKind.PREFILL, RowKind.PREFILL, RowKind.DECODE,
                                            RowKind.PREFILL]
    assert batch.logits_rows == [0, 1, 2, 7, 12] and batch.sampled_requests == [verify] * 3 + [chunk, decode]
    assert batch.token_ids[:3] == [91, 70, 71] and batch.positions[3:8] == [4, 5, 6, 7, 8]
    assert batch.num_tokens == 19 and batch.num_single == 1 and not batch.all_decodes
    assert not batch.samples_every_seq and batch.scores_prompt
    first = batch.decodes_first()
    assert [s.request for s in first.seqs] == [decode, verify, chunk, partial, score]
    assert first.logits_rows == [0, 1, 2, 3, 8] and first.sampled_requests == [decode] + [verify] * 3 + [chunk]
    assert StepBatch.build([(decode, 1), (chunk, 5)]).decodes_first().seqs[0].request is decode


def test_the_batch_is_a_snapshot() -> None:
    req = _request("d", 3, 4, output=2)
    batch = StepBatch.build([(req, 1)])
    req.block_table.append(999)
    req.output_token_ids.append(5)
    assert batch.seqs[0].block_table == (100, 101) and batch.token_ids == [91]
    with pytest.raises(AttributeError):
        batch.seqs[0].num_new = 2  # type: ignore[misc]

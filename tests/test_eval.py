"""tokenmill eval: scoring, perplexity windows, eval-set checks, comparisons, and the CLI on a tiny model."""
from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import tiny_loaded, tiny_tokenizer
from tokenmill.settings.config import EngineConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.request import SamplingParams
from tokenmill.evaluate.evalset import EvalItem, ItemResult, check_answer, load_eval_set, normalize
from tokenmill.evaluate.harness import (
    CandidateResult,
    CandidateSpec,
    compare,
    parse_percent,
    parse_points,
)
from tokenmill.evaluate.scoring import Scorer, perplexity, windows

TEXT = ("The keeper climbed the stairs each evening and lit the lamp before supper. "
        "Ships passed in the dark, and the beam swung across the water. ") * 3


def _engine(**options) -> LLMEngine:
    options.setdefault("num_blocks", 96)
    return LLMEngine(EngineConfig.from_options(**options), loaded=tiny_loaded(), tokenizer=tiny_tokenizer())


# --------------------------------------------------------------------------- scoring


@pytest.mark.parametrize("n,window,stride", [(10, 4, 2), (100, 16, 8), (17, 16, 15), (5, 64, 32), (300, 32, 1)])
def test_windows_score_every_token_once_with_bounded_context(n: int, window: int, stride: int) -> None:
    spans = windows(n, window, stride)
    scored = [p for b, e, s in spans for p in range(s, e)]
    assert scored == list(range(1, n))
    for b, e, s in spans:
        assert e - b <= window and b < s  # each scored token has at least one token of context


def test_windows_reject_stride_that_skips_tokens() -> None:
    with pytest.raises(ValueError):
        windows(100, 16, 16)


def test_scorer_logprobs_equal_the_engines_own_sampling_logprobs() -> None:
    """Scoring a greedy continuation gives back the logprobs the engine reported while generating it."""
    engine = _engine()
    prompt = engine.tokenizer.encode("Ships passed in the dark", add_special_tokens=False)
    engine.add_request("g", prompt, SamplingParams(temperature=0.0, max_tokens=12, logprobs=0, ignore_eos=True))
    gen, reported = [], []
    while engine.has_unfinished():
        for d in engine.step():
            gen += d.token_ids
            reported += [lp.logprob for lp in d.logprobs]
    scored = Scorer(engine).logprobs([prompt + gen], [len(prompt)])[0]
    assert scored.shape == (12,)
    assert torch.allclose(scored, torch.tensor(reported, dtype=torch.float64), atol=1e-4)
    engine.check_idle_invariants()  # borrowed blocks went back


def test_packing_does_not_change_scores_and_blocks_are_returned() -> None:
    engine = _engine()
    ids = engine.tokenizer.encode(TEXT, add_special_tokens=False)
    seqs = [ids[:40], ids[5:70], ids[:2], ids[10:11 + 30]]
    one_by_one = Scorer(engine, max_batch_tokens=1).logprobs(seqs, [1, 3, 1, 30])
    packed = Scorer(engine, max_batch_tokens=4096).logprobs(seqs, [1, 3, 1, 30])
    for a, b in zip(one_by_one, packed):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)
    assert [len(x) for x in packed] == [39, 62, 1, 1]
    assert engine.pool.num_available == engine.pool.num_blocks  # free, or idle in the prefix cache


def test_perplexity_is_exact_about_token_counts() -> None:
    engine = _engine()
    ids = engine.tokenizer.encode(TEXT, add_special_tokens=False)
    whole = perplexity(Scorer(engine), ids, window=1024, stride=512)
    assert whole.num_windows == 1 and whole.num_tokens == len(ids) - 1
    lp = Scorer(engine).logprobs([ids])[0]
    assert whole.perplexity == pytest.approx(math.exp(-float(lp.mean())), rel=1e-9)
    logits_top1 = Scorer(engine).score([ids])[0][1]
    assert whole.top1 == logits_top1.tolist() and len(whole.top1) == len(ids) - 1
    short = perplexity(Scorer(engine), ids, window=32, stride=16)
    assert short.num_tokens == len(ids) - 1 and short.num_windows > 1
    assert short.forward_tokens > len(ids)  # overlapping context is recomputed
    assert math.isfinite(short.perplexity) and short.perplexity != whole.perplexity  # less context, other value


# --------------------------------------------------------------------------- eval set


def _write(tmp_path, lines: list) -> str:
    path = tmp_path / "set.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return str(path)


def test_bundled_sample_set_loads() -> None:
    from tokenmill.evaluate.cli import sample_path

    items = load_eval_set(sample_path("sample_eval.jsonl"))
    assert len(items) >= 30 and {"exact", "contains", "regex", "choice"} <= {i.match for i in items}
    text = sample_path("sample_text.txt").read_text()
    assert len(text.splitlines()) >= 200


@pytest.mark.parametrize("line,message", [
    ("{not json", r"set.jsonl:2: not JSON"),
    ({"prompt": "x"}, "'answer' is required"),
    ({"prompt": "x", "messages": [{"role": "user", "content": "y"}], "answer": "a"}, "exactly one"),
    ({"prompt": "x", "choices": [" a", " b"], "answer": " c"}, "one of the choices"),
    ({"prompt": "x", "answer": "(", "match": "regex"}, "bad regex"),
    ({"prompt": "x", "answer": "a", "match": "fuzzy"}, "match must be one of"),
    ({"id": "dup", "prompt": "x", "answer": "a"}, "duplicate id"),
])
def test_eval_set_errors_name_the_line(tmp_path, line, message: str) -> None:
    path = _write(tmp_path, [{"id": "dup", "prompt": "ok", "answer": "a"}, line])
    with pytest.raises(ValueError, match=message):
        load_eval_set(path)


def test_answer_checks() -> None:
    exact = EvalItem("e", "exact", ["Down"])
    assert check_answer(exact, "  down.\nBecause up is up.") and not check_answer(exact, "It is down.")
    contains = EvalItem("c", "contains", ["4", "four"])
    assert check_answer(contains, "The answer is 4.") and check_answer(contains, "FOUR!")
    assert not check_answer(contains, "It is 14 or 40.")  # whole words only
    regex = EvalItem("r", "regex", [r"\b(7|[Ss]even)\b"])
    assert check_answer(regex, "Seven days") and not check_answer(regex, "17 days")
    assert normalize('  "Paris."  ') == "paris"


# --------------------------------------------------------------------------- comparison


def _result(label: str, ppl: float | None, acc: float | None, items: list[ItemResult], wb: int = 100,
            top1: list[int] | None = None) -> CandidateResult:
    from tokenmill.evaluate.scoring import PerplexityResult

    p = PerplexityResult(ppl, math.log(ppl), 10, 11, 1, 512, 256, 11, top1 or []) if ppl else None
    return CandidateResult(label, "none", "float32", None, False, wb, 10, 0.0, "", p, acc, len(items), items)


def test_compare_agreement_and_thresholds() -> None:
    base_items = [ItemResult("a", "contains", True, "x", [1, 2, 3, 4]), ItemResult("b", "contains", True, "y", [5, 6]),
                  ItemResult("c", "choice", True, " yes", [], 0, [-1.0, -2.0])]
    cand_items = [ItemResult("a", "contains", True, "x", [1, 2, 9, 9]), ItemResult("b", "contains", False, "y", [5, 6]),
                  ItemResult("c", "choice", False, " no", [], 1, [-2.0, -1.0])]
    base = _result("none", 10.0, 100.0, base_items, wb=400, top1=[1, 2, 3, 4])
    cand = _result("int4", 10.6, 66.7, cand_items, wb=100, top1=[1, 2, 0, 4])
    k = compare(base, cand, max_ppl_increase=0.05, max_accuracy_drop=2.0)
    assert k.ppl_increase == pytest.approx(0.06) and k.accuracy_drop == pytest.approx(33.3)
    assert k.agreement == pytest.approx(1 / 3)  # only b's tokens match
    assert k.token_agreement == pytest.approx((2 + 2) / 6)
    assert k.mean_first_divergence == 2 and k.num_diverged == 1
    assert k.weight_ratio == 0.25 and k.next_token_agreement == 0.75
    assert not k.passed and len(k.failures) == 2
    lenient = compare(base, cand, max_ppl_increase=0.07, max_accuracy_drop=40)
    assert lenient.passed


def test_threshold_and_candidate_parsing() -> None:
    assert parse_percent("5%") == pytest.approx(0.05) and parse_percent("0.5") == pytest.approx(0.005)
    assert parse_points("2pt") == 2.0 and parse_points("1.5") == 1.5
    with pytest.raises(ValueError):
        parse_percent("five")
    spec = CandidateSpec.parse("int4:g64:lm_head")
    assert (spec.quantization, spec.group_size, spec.quantize_lm_head) == ("int4", 64, True)
    assert CandidateSpec.parse("bf16").dtype == "bfloat16"
    with pytest.raises(ValueError, match="quantization must be"):
        CandidateSpec.parse("fp8")
    with pytest.raises(ValueError, match="unknown option"):
        CandidateSpec.parse("int8:fast")

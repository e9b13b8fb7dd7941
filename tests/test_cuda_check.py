"""The prepared GPU check script keeps working between GPU sessions: its CPU dry run
(slow: a SmolLM2-shaped model, ~15 s on 2 cores), its failure handling, and the
comparison and teacher-forcing pieces it is built from (fast)."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from conftest import make_tiny_llm  # noqa: E402

SECTIONS = ("env", "model", "parity", "graphs_parity", "decode", "throughput", "step_profile")


@pytest.mark.slow
def test_cuda_check_dry_run_on_cpu_writes_every_section(tmp_path) -> None:
    pytest.importorskip("transformers")
    import cuda_check

    out = tmp_path / "cuda.json"
    assert cuda_check.main(["--device", "cpu", "--quick", "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    for name in SECTIONS:
        assert summary[name]["ok"] is True, (name, summary[name].get("error"))
        assert summary[name]["seconds"] >= 0
    assert summary["ok"] is True and summary["gates"] == {"parity": True, "graphs_parity": True}

    model = summary["model"]
    assert model["synthetic"] and (model["vocab_size"], model["hidden_size"], model["intermediate_size"]) == (
        49152, 576, 1536)
    assert (model["num_hidden_layers"], model["num_attention_heads"], model["num_key_value_heads"],
            model["head_dim"]) == (30, 9, 3, 64)
    assert model["tie_word_embeddings"] and model["rope_theta"] == 100000.0
    assert 134_000_000 < model["parameters"] < 135_000_000  # SmolLM2-135M's count with tied embeddings

    parity = summary["parity"]
    tf = parity["teacher_forced"]
    assert tf["passed"] and tf["positions"] == parity["prompts"] * parity["tokens_each"] == 3 * 8
    assert tf["rel_logit_diff"] < tf["rel_tolerance"] == 1e-3 and tf["logit_scale"] > 1
    assert tf["first_position_over_tolerance"] == [None] * 3
    assert tf["argmax_agreement"] == 1.0  # CPU against CPU in float32: no near-tie flips
    greedy = parity["greedy"]
    assert greedy["identical_token_fraction"] == 1.0 and greedy["first_divergence"] == [None] * 3
    assert greedy["distinct_tokens"] > 3  # the synthetic model does not repeat one token forever
    assert parity["reference_logit_std"] > 1

    graphs = summary["graphs_parity"]
    assert graphs["passed"] and graphs["graphs_replayed"] and graphs["teacher_forced"]["passed"]
    assert graphs["graphs_on"]["active"] and graphs["graphs_on"]["replays"] > 0
    assert graphs["graphs_off"] == {"active": False}

    decode = summary["decode"]
    assert decode["batches"] == [1, 3] and decode["timed_captures"] == 0
    for b in (1, 3):
        on, off = decode["on"][f"batch_{b}"], decode["off"][f"batch_{b}"]
        assert on["tok_s"] > 0 and off["tok_s"] > 0 and on["tokens"] == b * 8
        assert on["timed"]["captures"] == 0 and on["timed"]["replays"] == on["steps"]
        assert off["timed"] == {"active": False}
    assert set(decode["on_over_off"]) == {"batch_1", "batch_3"}
    assert summary["throughput"]["output_tok_s"] > 0 and summary["throughput"]["total_tok_s"] > 0

    profile = summary["step_profile"]
    for b in (1, 3):
        row = profile[f"batch_{b}"]
        assert row["step_ms"] > 0 and row["replay_ms"] > 0 and row["bucket"][0] >= b
        assert row["host_profile"] and all(r["own_ms_per_step"] >= 0 for r in row["host_profile"])
        assert row["eager"]["per_step"] > 100 and row["eager"]["top"]  # a 30-layer step is many ops


@pytest.mark.slow
def test_a_failing_section_is_recorded_and_the_rest_still_run(tmp_path, monkeypatch) -> None:
    pytest.importorskip("transformers")
    import cuda_check

    def broken(ctx):  # type: ignore[no-untyped-def]
        raise RuntimeError("planted failure")

    monkeypatch.setattr(cuda_check, "parity_section", broken)
    out = tmp_path / "cuda.json"
    code = cuda_check.main(["--device", "cpu", "--quick", "--layers", "2", "--sections", "parity,graphs_parity",
                            "--out", str(out)])
    assert code == 1
    summary = json.loads(out.read_text())
    assert summary["parity"]["ok"] is False and "planted failure" in summary["parity"]["error"]
    assert summary["graphs_parity"]["ok"] is True and summary["gates"]["graphs_parity"] is True
    assert summary["gates"]["parity"] is False and summary["ok"] is False
    assert "decode" not in summary and "throughput" not in summary  # not asked for


def test_unknown_section_is_refused() -> None:
    import cuda_check

    with pytest.raises(SystemExit):
        cuda_check.parse_args(["--sections", "parity,nonsense"])


def test_cuda_check_says_so_when_there_is_no_gpu(capsys, tmp_path) -> None:
    import cuda_check

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    out = tmp_path / "cuda.json"
    assert cuda_check.main(["--device", "cuda", "--out", str(out)]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    summary = json.loads(out.read_text())
    assert summary["env"]["ok"] and summary["env"]["cuda_available"] is False and summary["ok"] is False


def test_compare_logits_gates_on_the_tolerance_and_finds_the_position() -> None:
    import cuda_check_support as support

    g = torch.Generator().manual_seed(0)
    want = [torch.randn(6, 50, generator=g) * 3 for _ in range(2)]
    close = [w + 1e-6 for w in want]
    result = support.compare_logits(close, want, 1e-3)
    assert result["passed"] and result["first_position_over_tolerance"] == [None, None]
    assert result["argmax_agreement"] == 1.0 and result["positions"] == 12
    bad = [w.clone() for w in want]
    bad[1][4, 7] += 0.5  # one wrong logit at position 4 of the second prompt
    result = support.compare_logits(bad, want, 1e-3)
    assert not result["passed"] and result["first_position_over_tolerance"] == [None, 4]
    assert result["max_abs_logit_diff"] == pytest.approx(0.5, rel=1e-5)


def test_compare_tokens_counts_identity_and_first_divergence() -> None:
    import cuda_check_support as support

    result = support.compare_tokens([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 3, 4], [5, 6, 9, 8]])
    assert result["identical_sequences"] == 1 and result["first_divergence"] == [None, 2]
    assert result["identical_token_fraction"] == 7 / 8


def test_synthetic_tokenizer_covers_the_whole_vocabulary() -> None:
    import cuda_check_support as support

    tok = support.synthetic_tokenizer(49152)
    assert tok.vocab_size == 49152 and tok.eos_token_id == 49151
    ids = tok.encode("hello, world", add_special_tokens=False)
    assert tok.decode(ids) == "hello, world" and max(ids) > 255  # two-byte merges are used
    assert isinstance(tok.decode([300, 40000, 49150]), str)


def test_synthetic_folder_loads_back_as_the_same_model_and_tokenizer(tmp_path) -> None:
    """What cuda_serving.sh serves on the GPU: the folder must load through the server's
    own loaders into exactly the in-memory synthetic model."""
    import cuda_check_support as support
    from tokenmill.model.loader import load_model
    from tokenmill.files.tokenizer import Tokenizer

    support.write_synthetic_folder(str(tmp_path), seed=3, num_layers=1)
    want = support.synthetic_loaded(seed=3, num_layers=1)
    got = load_model(str(tmp_path))
    # the folder names the synthetic tokenizer's own end-of-text id (SmolLM2's 1 and 2 mean nothing there)
    assert got.config == dataclasses.replace(want.config, bos_token_id=None, eos_token_id=49151)
    assert got.weights.keys() == want.weights.keys()
    assert all(torch.equal(got.weights[k], want.weights[k]) for k in want.weights)
    tok = Tokenizer.from_model_path(str(tmp_path))
    assert tok.vocab_size == 49152 and tok.eos_token_id == 49151 and not tok.add_bos
    assert tok.decode(tok.encode("Request 7. alpha beta", add_special_tokens=False)) == "Request 7. alpha beta"


def test_teacher_forcing_drives_the_engine_and_records_its_own_logits() -> None:
    import cuda_check_support as support
    from tokenmill import SamplingParams

    prompt = [3, 14, 15, 92, 65, 35]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    free = make_tiny_llm()
    with support.LogitRecorder(free.engine) as rec:
        (req,) = support.run_requests(free.engine, [prompt], params, "free")
    free_logits = rec.logits(req.request_id)
    assert free_logits.shape == (5, 257)
    assert list(req.output_token_ids) == free_logits.argmax(-1).tolist()
    assert "execute" not in free.engine.runner.__dict__  # unwrapped on exit

    forced_tokens = [7, 8, 9, 10, 11]
    forced = make_tiny_llm()
    with support.LogitRecorder(forced.engine, forced={"forced0#0": forced_tokens}) as rec:
        (req,) = support.run_requests(forced.engine, [prompt], params, "forced")
    assert list(req.output_token_ids) == forced_tokens
    got = rec.logits(req.request_id)
    # The first position's context is the prompt alone: the same logits as the free run;
    # later ones follow the forced tokens, so they differ from the free run's.
    torch.testing.assert_close(got[0], free_logits[0])
    assert not torch.allclose(got[1:], free_logits[1:])

"""lm-evaluation-harness against a real `tokenmill serve`: a multiple-choice task it scores
with ``local-completions`` (``echo`` + ``logprobs`` + ``max_tokens: 1`` per choice).

No hub: the task and its items are local files (``--include_path``), the tokenizer is
exported from the bundled GGUF to a folder. Judged: no request fails, and lm-eval's
accuracy (and each item's log-likelihoods) equal what the offline ``LLM`` computes
from prompt logprobs on the same token ids.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tokenmill import LLM
from test_server_support import metric, real_server

pytestmark = pytest.mark.slow

MODEL = "smollm2"
ITEMS = [
    {"question": "Question: What color is the sky on a clear day?\nAnswer:", "choices": ["blue", "green", "purple"],
     "answer": 0},
    {"question": "Question: How many legs does a spider have?\nAnswer:", "choices": ["six", "eight", "ten", "four"],
     "answer": 1},
    {"question": "Question: Water freezes at how many degrees Celsius?\nAnswer:", "choices": ["100", "50", "0"],
     "answer": 2},
    {"question": "Question: Which animal says moo?\nAnswer:", "choices": ["a cat", "a cow", "a dog"], "answer": 1},
    {"question": "The opposite of hot is", "choices": ["cold", "warm", "loud"], "answer": 0},
    {"question": "Question: What is the capital of France?\nAnswer:", "choices": ["Berlin", "Madrid", "Paris"],
     "answer": 2},
]
TASK_YAML = """task: tokenmill_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: question
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def tokenizer_dir(bundled_model_path, tmp_path_factory) -> str:
    """The bundled model's tokenizer as a Hugging Face folder (what lm-eval loads)."""
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(bundled_model_path)
    out = tmp_path_factory.mktemp("tokenizer")
    transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("lm-eval-task")
    (d / "items.jsonl").write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    (d / "tokenmill_mc.yaml").write_text(TASK_YAML.format(data=d / "items.jsonl"))
    return str(d)


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split: trailing spaces go to the continuation; the whole is encoded once."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx):]


def offline_loglikelihoods(llm: LLM, tok) -> list[list[float]]:
    """Per item, per choice: the sum of the continuation's prompt logprobs."""
    seqs, spans = [], []
    for item in ITEMS:
        for choice in item["choices"]:
            ctx, cont = encode_pair(tok, item["question"], " " + choice)
            seqs.append(ctx + cont)
            spans.append(len(ctx))
    scored = llm.score(seqs)
    sums = [sum(e.logprob for e in entries[start:]) for entries, start in zip(scored, spans)]
    out, i = [], 0
    for item in ITEMS:
        out.append(sums[i : i + len(item["choices"])])
        i += len(item["choices"])
    return out


def test_lm_eval_local_completions_accuracy_equals_offline(real_loaded, real_tokenizer, tokenizer_dir, task_dir,
                                                           tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("lm_eval")
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    llm = LLM(loaded_model=real_loaded, tokenizer=real_tokenizer, kv_cache_memory="128MiB")
    expected = offline_loglikelihoods(llm, tok)
    picks = [max(range(len(s)), key=s.__getitem__) for s in expected]
    offline_acc = sum(p == item["answer"] for p, item in zip(picks, ITEMS)) / len(ITEMS)
    del llm

    out = tmp_path / "out"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_CACHE=str(tmp_path / "datasets"), HF_HOME=str(tmp_path / "hf"))
    # the reference configuration, as the offline LLM's defaults
    with real_server("--served-model-name", MODEL, "--kv-cache-memory", "128MiB", "--dtype", "float32",
                     "--quantization", "none") as server:
        model_args = ",".join([
            f"model={MODEL}", f"base_url={server.url}/v1/completions", "tokenizer_backend=huggingface",
            f"tokenizer={tokenizer_dir}", "num_concurrent=1", "max_retries=1"])
        run = subprocess.run(
            [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
             "--tasks", "tokenmill_mc", "--include_path", task_dir,
             "--batch_size", "4",  # four prompts per request: a batch of token-id lists
             "--output_path", str(out), "--log_samples"],
            env=env, capture_output=True, text=True, timeout=900)
        log = run.stdout + run.stderr
        assert run.returncode == 0, log[-4000:]
        metrics_text = httpx.get(server.url + "/metrics").text
    num_requests = sum(len(item["choices"]) for item in ITEMS)
    assert "API request failed" not in log
    # Every request reached the engine and finished; none was refused.
    assert metric(metrics_text, "vllm:request_success_total") == num_requests
    rejected = [line for line in metrics_text.splitlines()
                if line.startswith("tokenmill:requests_rejected_total") and not line.rstrip().endswith(" 0.0")]
    assert not rejected

    results = json.loads(next(out.rglob("results_*.json")).read_text())
    lm_eval_acc = results["results"]["tokenmill_mc"]["acc,none"]
    print(f"lm-eval acc {lm_eval_acc:.4f}, offline acc {offline_acc:.4f}, picks {picks}")
    assert lm_eval_acc == pytest.approx(offline_acc, abs=1e-9)
    samples = [json.loads(line) for line in next(out.rglob("samples_tokenmill_mc_*.jsonl")).read_text().splitlines()]
    assert len(samples) == len(ITEMS)
    for sample in samples:
        doc_id = sample["doc_id"]
        got = [float(r[0][0]) for r in sample["resps"]]
        assert all(math.isfinite(x) for x in got)
        assert got == pytest.approx(expected[doc_id], abs=1e-3), (doc_id, got, expected[doc_id])

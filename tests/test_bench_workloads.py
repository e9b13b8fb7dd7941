"""Workloads: exact-length text, shared prefixes, dataset files, trace replay."""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from fake_openai_server import FakeConfig, FakeServer  # noqa: E402

from tokenmill.bench.client import Target  # noqa: E402
from tokenmill.bench.lengths import parse_length  # noqa: E402
from tokenmill.bench.loadgen import LoadShape  # noqa: E402
from tokenmill.bench.runner import BenchConfig, BenchResult, run_bench  # noqa: E402
from tokenmill.bench.tokens import (LocalTokenizer, TextBuilder, TokenCounter,  # noqa: E402
                                    corpus_words)
from tokenmill.bench.workloads import (SyntheticConfig, load_dataset, make_salt,  # noqa: E402
                                       synthetic)
from tokenmill.traffic.capture import TrafficCapture  # noqa: E402


class WordCounter(TokenCounter):
    exact = True
    name = "words"

    def count(self, text: str) -> int:
        return len(text.split())


@pytest.fixture(scope="module")
def bpe_tokenizer(tmp_path_factory) -> str:
    """A small byte-level BPE trained on the bundled corpus, saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(corpus_words())] * 3, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def test_text_builder_hits_exact_token_counts_with_a_real_bpe(bpe_tokenizer):
    counter = LocalTokenizer(bpe_tokenizer)
    builder = TextBuilder(counter, seed=1)
    rng = random.Random(0)
    for n in [1, 2, 7, 16, 100, 333, 1024, 2500] + [rng.randint(3, 800) for _ in range(20)]:
        text, count = builder.build(n)
        assert count == n == counter.count(text), n
    head = make_salt(random.Random(5)) + "You are a helpful assistant."
    text, count = builder.build(200, head=head)
    assert text.startswith(head) and count == 200 == counter.count(text)


def test_synthetic_prefixes_are_shared_token_for_token(bpe_tokenizer):
    counter = LocalTokenizer(bpe_tokenizer)
    cfg = SyntheticConfig(parse_length("uniform:200:300"), parse_length("10"), prefix_len=64,
                          num_prefixes=3, prefix_pick="round-robin")
    salt = make_salt(random.Random(1))
    specs = synthetic(cfg, 9, TextBuilder(counter, seed=2), salt, random.Random(3))
    assert [s.prefix_id for s in specs] == [0, 1, 2] * 3
    assert all(s.prompt.startswith(salt) and s.prompt_len == counter.count(s.prompt)
               and 200 <= s.prompt_len <= 300 for s in specs)
    tok = counter._tok
    ids = [tok.encode(s.prompt).ids for s in specs]
    same = [ids[0][:64] == ids[k][:64] for k in (3, 6)]
    assert same == [True, True]
    assert ids[0][:64] != ids[1][:64]
    # beyond the prefix, prompts differ quickly (no accidental sharing)
    assert ids[0][:80] != ids[3][:80]


def test_dataset_formats(tmp_path):
    sharegpt = [{"conversations": [{"from": "system", "value": "be brief"},
                                   {"from": "human", "value": "what is a ferry"},
                                   {"from": "gpt", "value": "a boat that carries people"}]},
                {"conversations": [{"from": "gpt", "value": "orphan answer"}]}]
    (tmp_path / "sg.json").write_text(json.dumps(sharegpt))
    specs = load_dataset(str(tmp_path / "sg.json"), 2, WordCounter(), "S1.", random.Random(0),
                         parse_length("9"))
    assert len(specs) == 2  # the unusable entry is skipped; the good one reused
    s = specs[0]
    assert s.messages == [{"role": "system", "content": "S1.be brief"},
                          {"role": "user", "content": "what is a ferry"}]
    assert s.output_len == 5  # words of the gpt answer
    lines = [{"prompt": "one two three", "output_len": 4}, {"messages": [
        {"role": "user", "content": "hi there"}]}]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    specs = load_dataset(str(tmp_path / "p.jsonl"), 2, WordCounter(), "", random.Random(0),
                         parse_length("9"))
    by_kind = {("prompt" if s.prompt else "messages"): s for s in specs}
    assert by_kind["prompt"].output_len == 4 and by_kind["prompt"].prompt_len == 3
    assert by_kind["messages"].output_len == 9  # default length when none is given
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="no usable prompts"):
        load_dataset(str(tmp_path / "bad.json"), 1, WordCounter(), "", random.Random(0),
                     parse_length("9"))


def test_trace_replay_keeps_lengths_timing_and_sharing(tmp_path):
    shared = list(range(100, 164))  # 4 blocks shared by every prompt
    rng = random.Random(0)
    path = tmp_path / "cap.jsonl"
    with TrafficCapture(path) as cap:
        for i in range(6):
            ids = shared + [rng.randrange(1000, 9000) for _ in range(20 + 5 * i)]
            cap.record(500.0 + 0.2 * i, ids, 0, 3 + i, {"temperature": 0.0, "max_tokens": 99},
                       0.01, 0.05)
    cfg = BenchConfig(shapes=[LoadShape(trace=True)], num_requests=6, trace=str(path),
                      trace_speed=2.0, progress=False)
    with FakeServer(FakeConfig(ttft=0.005, itl=0.001)) as srv:
        result = BenchResult(target={}, config={})
        asyncio.run(run_bench(cfg, Target(srv.url, "fake-model"), WordCounter(), result))
    recs = sorted(result.points[0].run.records, key=lambda r: r.index)
    assert all(r.ok for r in recs)
    assert [r.prompt_tokens for r in recs] == [84 + 5 * i for i in range(6)]
    assert [r.output_tokens for r in recs] == [3 + i for i in range(6)]
    assert [r.cached_tokens for r in recs] == [0] + [64] * 5
    gaps = [b.start - a.start for a, b in zip(recs, recs[1:])]
    assert all(abs(g - 0.1) < 0.03 for g in gaps)  # 0.2 s apart, replayed 2x faster


def test_replayed_prompts_keep_their_length_whatever_word_comes_first(real_tokenizer, tmp_path):
    """The first synthetic word follows the salt's newline with no space before it;
    a word that is one token only after a space would make the prompt one token
    longer than the capture says (this was flaky against the real server)."""
    from tokenmill.bench.workloads import load_trace

    class BundledCounter(TokenCounter):
        exact = True
        name = "bundled"

        def count(self, text: str) -> int:
            return len(real_tokenizer.encode(text))

    counter = BundledCounter()
    builder = TextBuilder(counter, seed=3)
    rng = random.Random(7)
    path = tmp_path / "cap.jsonl"
    with open(path, "w") as fh:
        for i in range(60):  # random block hashes pick random first words
            blocks = rng.randint(1, 4)
            record = {"arrival_time": 10.0 + i, "prompt_tokens": 16 * blocks + rng.randint(0, 9),
                      "output_tokens": 2, "block_size": 16,
                      "block_hashes": [f"{rng.getrandbits(64):016x}" for _ in range(blocks)]}
            fh.write(json.dumps(record) + "\n")
    wanted = [json.loads(line)["prompt_tokens"] for line in open(path)]
    for seed in range(5):
        salt = make_salt(random.Random(seed))
        specs = load_trace(str(path), counter, builder, salt)
        assert [counter.count(s.prompt) for s in specs] == wanted, salt


@pytest.mark.parametrize("entry, needle", [
    ({"conversations": "hello"}, "'conversations' must be a list"),
    ({"conversations": ["hello"]}, "each of 'conversations' must be an object"),
    ({"messages": 5}, "'messages' must be a list"),
    ({"prompt": "hi", "output_len": [4]}, "'output_len' must be a whole number"),
    ({"prompt": "hi", "max_tokens": "four"}, "'max_tokens' must be a whole number")])
def test_a_malformed_dataset_entry_is_named(tmp_path, entry, needle):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps(entry) + "\n")
    with pytest.raises(ValueError, match=f"entry 2: {re.escape(needle)}"):
        load_dataset(str(path), 2, WordCounter(), "", random.Random(0), parse_length("9"))

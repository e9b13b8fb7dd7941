"""Tokenizer: same ids and chat prompts as transformers on the bundled SmolLM2 GGUF,
HF folders, SentencePiece-style GGUF vocabularies, and template rendering rules."""
from __future__ import annotations

import json
import os

import pytest

from tokenmill.files.tokenizer import FALLBACK_CHAT_TEMPLATE, Tokenizer, render_chat_template

TEXTS = [
    "Hello, world!",
    "What is the capital of France?",
    "def square(x):\n    return x ** 2  # comment\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "12345 678 3.14159 1,000,000 and 2024-06-01",
    " 123",
    "x1 y22 z333",
    "emoji 😀🎉👍🏽 and flags 🇫🇷",
    "中文字符测试，日本語のテキスト",
    "한국어 텍스트",
    "   leading  and   trailing   ",
    "tabs\t\tand\nnewlines\n\n\nend",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|endoftext|>next document",
    "Ünïcödé façade naïve café",
    "don't I'll we've they're",
    "https://example.com/a?b=c&d=e#frag",
    "",
    " ",
    "\n",
    "ÀÉÎ€£¥ ∑∫√ → ∞",
    "مرحبا بالعالم",
    "Привет, мир!",
]

CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}],
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another, in 中文?"}],
]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    from tokenmill.files.bundled import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def ours(gguf_path: str) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def reference(gguf_path: str):
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(gguf_path)
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


# --------------------------------------------------------------------------- bundled SmolLM2 vs transformers


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers(ours: Tokenizer, reference, text: str) -> None:
    assert ours.encode(text) == reference.encode(text, add_special_tokens=True)
    assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(ours: Tokenizer, reference, text: str) -> None:
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(ours: Tokenizer, reference, messages) -> None:
    want = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == want
    want = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=False) == want


def test_smollm2_special_tokens(ours: Tokenizer) -> None:
    im_end = ours.token_to_id("<|im_end|>")
    assert im_end == 2 and im_end in ours.eos_token_ids
    assert ours.eos_token_id == 2 and ours.bos_token_id == 1
    assert ours.add_bos is False and ours.vocab_size == 49152
    assert ours.has_chat_template
    # specials written in the text are one token each, and skipped on decode
    ids = ours.encode("<|im_start|>assistant\nOK<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert ours.decode(ids) == "assistant\nOK"
    assert ours.token_to_text(ours.encode(" world")[0]) == " world"
    # the default system prompt of this template is present when none is given
    assert "SmolLM" in ours.apply_chat_template([{"role": "user", "content": "x"}])


def test_digits_are_split_one_by_one(ours: Tokenizer) -> None:
    """SmolLM's pre-tokenizer ('smollm') cuts numbers into single digits."""
    ids = ours.encode("2024")
    assert [ours.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_from_model_path_dispatch(ours: Tokenizer, gguf_path: str) -> None:
    default = Tokenizer.from_model_path(None)
    assert default.encode(TEXTS[2]) == ours.encode(TEXTS[2])
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_model_path("/nonexistent/model.gguf")


def test_from_dir_of_saved_reference(tmp_path, ours: Tokenizer, reference) -> None:
    """The HF-folder path: transformers writes tokenizer.json etc.; we read them back."""
    reference.save_pretrained(tmp_path)
    tok = Tokenizer.from_dir(str(tmp_path))
    for text in TEXTS:
        assert tok.encode(text) == ours.encode(text), text
    assert tok.eos_token_id == 2 and 2 in tok.eos_token_ids and tok.bos_token_id == 1
    for messages in CONVERSATIONS:
        assert tok.apply_chat_template(messages) == ours.apply_chat_template(messages)


# --------------------------------------------------------------------------- a hand-made HF folder


def _write_folder(path, *, template, add_bos: bool, gen_eos: list[int] | None = None) -> None:
    from tokenizers import Tokenizer as Fast
    from tokenizers import decoders, models, pre_tokenizers, trainers

    fast = Fast(models.BPE())
    fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    fast.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<|eot_id|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    fast.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20 + TEXTS, trainer)
    if add_bos:  # as real Llama folders do: the post-processor writes BOS too
        from tokenizers.processors import TemplateProcessing

        fast.post_processor = TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                 special_tokens=[("<s>", 0)])
    fast.save(str(path / "tokenizer.json"))
    cfg = {"bos_token": {"__type": "AddedToken", "content": "<s>", "special": True}, "eos_token": "</s>",
           "chat_template": template, "tokenizer_class": "PreTrainedTokenizerFast"}
    if not add_bos:
        cfg["add_bos_token"] = False
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    if gen_eos is not None:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": gen_eos}))


LLAMA3_LIKE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def test_from_dir_bos_eos_and_template(tmp_path) -> None:
    _write_folder(tmp_path, template=[{"name": "default", "template": LLAMA3_LIKE},
                                      {"name": "tool_use", "template": "tools"}],
                  add_bos=True, gen_eos=[1, 2])
    tok = Tokenizer.from_dir(str(tmp_path))
    assert (tok.bos_token_id, tok.eos_token_id, tok.add_bos) == (0, 1, True)
    assert tok.eos_token_ids == {1, 2}
    ids = tok.encode("the fox")
    assert ids[0] == 0 and tok.decode(ids) == "the fox"
    assert tok.encode("the fox", add_special_tokens=False) == ids[1:]
    # a prompt that already starts with BOS (template wrote it) does not get a second one
    prompt = tok.apply_chat_template([{"role": "user", "content": " hi "}])
    assert prompt == "<s><|user|>\nhi<|eot_id|><|assistant|>\n"
    assert tok.encode(prompt).count(0) == 1

    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text), text
    msgs = CONVERSATIONS[2]
    assert tok.apply_chat_template(msgs) == ref.apply_chat_template(msgs, tokenize=False,
                                                                    add_generation_prompt=True)


def test_from_dir_without_template_uses_fallback(tmp_path) -> None:
    _write_folder(tmp_path, template=None, add_bos=False)
    tok = Tokenizer.from_dir(str(tmp_path))
    assert not tok.has_chat_template and tok.chat_template == FALLBACK_CHAT_TEMPLATE
    assert tok.eos_token_ids == {1, 2}  # </s>, and <|eot_id|> as a known end-of-turn special
    out = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert out == "user: hi\nassistant: "
    assert tok.encode("the")[0] != 0


def test_from_dir_requires_tokenizer_json(tmp_path) -> None:
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_dir(str(tmp_path))


# --------------------------------------------------------------------------- template rendering rules


def test_template_errors_are_value_errors() -> None:
    with pytest.raises(ValueError, match="only user and assistant"):
        render_chat_template("{{ raise_exception('only user and assistant') }}", [])
    with pytest.raises(ValueError, match="chat template error"):
        render_chat_template("{% for m in messages %}", [])
    # the sandbox refuses to reach Python internals
    with pytest.raises(ValueError):
        render_chat_template("{{ messages.__class__.__mro__[1].__subclasses__() }}", [])
    with pytest.raises(ValueError):
        render_chat_template("{% set x = messages.append(1) %}", [])


def test_template_helpers_and_whitespace() -> None:
    msgs = [{"role": "user", "content": "<b>&\"é"}]
    assert render_chat_template("{{ messages[0] | tojson }}", msgs) == '{"role": "user", "content": "<b>&\\"é"}'
    assert render_chat_template("{{ {'a': 1} | tojson(indent=2) }}", msgs) == '{\n  "a": 1\n}'
    assert len(render_chat_template("{{ strftime_now('%Y') }}", msgs)) == 4
    # trim_blocks + lstrip_blocks: block tags leave no newline or indentation behind
    src = "{% for m in messages %}\n    {% if true %}\n[{{ m.role }}]\n    {% endif %}\n{% endfor %}"
    assert render_chat_template(src, msgs) == "[user]\n"
    assert render_chat_template("{% generation %}x{% endgeneration %}", msgs) == "x"
    assert render_chat_template("{% for i in [1,2,3] %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}",
                                msgs) == "1"


def test_kwargs_reach_the_template(ours: Tokenizer) -> None:
    src = "{% if tools %}{{ tools | length }} tools{% endif %}|{{ bos_token }}|{{ eos_token }}"
    tok = Tokenizer(ours.backend, bos_token_id=1, eos_token_id=2, chat_template=src)
    assert tok.apply_chat_template([], tools=[{"name": "a"}, {"name": "b"}]) == "2 tools|<|im_start|>|<|im_end|>"


# --------------------------------------------------------------------------- SentencePiece-style GGUF vocabularies


def test_sentencepiece_gguf_vocab(tmp_path) -> None:
    gguf = pytest.importorskip("gguf")
    tokens = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "ab", "\u2581a", "\u2581ab", "\u2581b", "<0x63>", "<0x0A>"]
    scores = [0.0, 0.0, 0.0, -1.0, -2.0, -2.0, -1.5, -1.2, -0.5, -3.0, 0.0, 0.0]
    types = [2, 3, 3, 1, 1, 1, 1, 1, 1, 1, 6, 6]
    path = str(tmp_path / "spm.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = Tokenizer.from_gguf(path)
    assert tok.add_bos and tok.bos_token_id == 1 and tok.eos_token_ids == {2}
    # "ab ab" -> "▁ab▁ab": the highest-scoring merges win; 'c' and newline fall back to bytes
    assert tok.encode("ab ab") == [1, 8, 8]
    assert tok.encode("abc\nb", add_special_tokens=False) == [8, 10, 11, 5]
    assert tok.decode(tok.encode("ab abc\nb")) == "ab abc\nb"
    assert tok.encode("ba", add_special_tokens=False) == [9, 4]


def test_the_bpe_word_cache_is_bounded_when_whole_prompts_are_words():
    """The tiny tokenizer splits nothing (byte-level BPE without its regex), so every distinct
    prompt is one cached word; the cap keeps what those pin to a few MiB (tokenizer.bound_word_cache)."""
    import ctypes
    import gc
    import random

    from conftest import tiny_tokenizer
    from tokenmill.files.tokenizer import BPE_CACHE_WORDS

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                          "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        pytest.skip("needs glibc's mallinfo2")
    mallinfo2.restype = MallInfo2

    def heap_in_use() -> int:
        gc.collect()
        info = mallinfo2()
        return info.uordblks + info.hblkhd

    def prompts(n: int) -> list[str]:
        rng = random.Random(n)
        return [" ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(20)) for _ in range(n)]

    def growth(tok, texts: list[str]) -> int:
        before = heap_in_use()
        for text in texts:
            tok.encode(text)
        return heap_in_use() - before

    texts = prompts(6 * BPE_CACHE_WORDS)
    capped = growth(tiny_tokenizer(), texts)
    uncapped_tok = tiny_tokenizer()
    uncapped_tok.backend.model._resize_cache(10_000)  # the library's default
    uncapped = growth(uncapped_tok, texts)
    assert uncapped > 4 * capped  # the default kept every prompt; the cap stops at BPE_CACHE_WORDS of them
    assert capped < 16 << 20

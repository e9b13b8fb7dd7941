"""Text <-> token ids, and the chat template.

Two sources, one result (a fast ``tokenizers.Tokenizer`` plus the facts the
engine needs: BOS/EOS, which tokens end a turn, the chat template):

* a GGUF file: vocabulary, merges, token types and the pre-tokenizer name are
  llama.cpp metadata (``tokenizer.ggml.*``); we rebuild the byte-level BPE (or
  SentencePiece-style BPE) they describe;
* a Hugging Face folder: ``tokenizer.json`` is loaded as is, the rest comes from
  ``tokenizer_config.json`` (and ``generation_config.json`` for extra EOS ids).

Chat templates are rendered the way ``transformers`` renders them (sandboxed
Jinja, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``strftime_now``,
a ``tojson`` that does not HTML-escape) so prompts are byte-identical.
"""
from __future__ import annotations

import json
import logging
import os
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as FastTokenizer

log = logging.getLogger(__name__)

# Token texts that end a turn or a document in common chat models. They stop generation
# when the model defines them as special tokens (llama.cpp's "end of generation" idea).
END_OF_TURN_TOKENS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>",
    "<end_of_turn>", "<|end|>", "<|return|>", "</s>", "<EOT>", "<|END_OF_TURN_TOKEN|>",
)

# Pre-tokenizer split patterns (public, widely documented regexes) by llama.cpp pre name.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "megrez": _QWEN2_SPLIT,
    "gpt-4o": _O200K_SPLIT, "llama4": _O200K_SPLIT,
}
# Pre names whose split is GPT-2's regex after cutting digits one by one (SmolLM, StarCoder).
_DIGIT_FIRST = {"smollm", "starcoder", "refact"}

# GGUF token types (llama.cpp's enum)
_TT_CONTROL, _TT_USER_DEFINED, _TT_BYTE = 3, 4, 6

FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

# The turn format of an architecture whose GGUF files may come without a template
# (llama.cpp falls back the same way). Gemma has no system turn: a system message
# opens the first user turn.
ARCHITECTURE_CHAT_TEMPLATES = {
    "gemma3": (
        "{{ bos_token }}"
        "{% if messages and messages[0]['role'] == 'system' %}"
        "{% set system = messages[0]['content'] ~ '\n\n' %}{% set turns = messages[1:] %}"
        "{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
        "{% for message in turns %}"
        "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else 'user' }}\n"
        "{{ (system if loop.first else '') ~ (message['content'] | trim) }}<end_of_turn>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    ),
}
ARCHITECTURE_CHAT_TEMPLATES["gemma2"] = ARCHITECTURE_CHAT_TEMPLATES["gemma3"]


# --------------------------------------------------------------------------- chat templates


@lru_cache(maxsize=16)
def _compile_template(source: str) -> Any:
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (assistant-mask markers): render the body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def render_chat_template(template: str, messages: list[dict], **context: Any) -> str:
    """Render ``template``; any Jinja failure becomes a ValueError naming the cause."""
    import jinja2

    try:
        compiled = _compile_template(template)
        return compiled.render(messages=messages, **context)
    except jinja2.exceptions.TemplateError as exc:
        raise ValueError(f"chat template error: {exc}") from exc
    except (TypeError, KeyError, AttributeError, IndexError) as exc:
        raise ValueError(f"chat template could not render these messages: {exc!r}") from exc


# --------------------------------------------------------------------------- GGUF vocabularies


def _gguf_fields(path: str) -> dict[str, Any]:
    from tokenmill.files.gguf_file import read_gguf

    return read_gguf(path, with_tensors=False).metadata


def _byte_level_backend(tokens: list[str], merges: list[str], pre: str | None) -> FastTokenizer:
    """GPT-2 style byte-level BPE: tokens are already spelled in the byte alphabet."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = FastTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    pre = (pre or "default").lower()
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"), byte_level]
        )
    elif pre in _DIGIT_FIRST:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
    else:
        if pre not in ("default", "gpt-2", "gpt2"):
            log.warning("GGUF pre-tokenizer %r unknown to tokenmill; using GPT-2's split", pre)
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return backend


def _merges_from_scores(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece BPE files carry scores, not merges: a merge (a, b) ranks by the score of a+b."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    ranked = []
    for tok, score, ttype in zip(tokens, scores, types):
        if ttype in (_TT_CONTROL, _TT_BYTE) or len(tok) < 2:
            continue
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _sentencepiece_backend(fields: dict[str, Any]) -> FastTokenizer:
    """Llama-2 style SentencePiece BPE with byte fallback (``tokenizer.ggml.model == 'llama'``)."""
    tokens = fields["tokenizer.ggml.tokens"]
    types = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = fields.get("tokenizer.ggml.merges")
    if merges:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        pairs = _merges_from_scores(tokens, fields.get("tokenizer.ggml.scores") or [0.0] * len(tokens), types)
    unk_id = fields.get("tokenizer.ggml.unknown_token_id", 0)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = FastTokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=tokens[unk_id],
                                       fuse_unk=True, byte_fallback=True))
    prefix = fields.get("tokenizer.ggml.add_space_prefix", True)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


# --------------------------------------------------------------------------- the tokenizer


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


# Words a BPE model's cache may hold (the ``tokenizers`` default is 10,000); see bound_word_cache.
BPE_CACHE_WORDS = 1024


def bound_word_cache(backend: FastTokenizer, words: int = BPE_CACHE_WORDS) -> None:
    """Cap the BPE model's word cache, which would otherwise pin memory a server never gets back.

    ``tokenizers`` caches each pre-tokenized "word" it encodes (under 256
    characters) with its symbols, about 35 bytes a character, and never evicts:
    it fills up to its capacity with the first words it sees and stays full. With
    a regex pre-tokenizer the words are short and repeat, and the cache stays
    small. Where nothing splits the text (SentencePiece-style files with no
    pre-tokenizer, byte-level BPE without its regex) a word is a whole prompt,
    so a server filled the cache with prompts it would never see again: up to
    10,000 of them, tens of megabytes, growing for as long as traffic brought
    new prompts. A thousand words keep what the cache is for (the bundled
    model's tokenizer encodes as fast) and bound the worst case to a few MiB.
    Unigram models keep the same kind of cache and get the same cap; WordPiece
    and WordLevel have none."""
    resize = getattr(backend.model, "_resize_cache", None)
    if resize is not None:
        resize(words)


class Tokenizer:
    """A fast tokenizer plus BOS/EOS facts and the chat template of one model."""

    def __init__(
        self,
        backend: FastTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        extra_eos_ids: set[int] | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.backend = backend
        bound_word_cache(backend)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos = add_bos
        self.vocab_size = vocab_size or backend.get_vocab_size(with_added_tokens=True)
        self.has_chat_template = chat_template is not None
        self.chat_template = chat_template or FALLBACK_CHAT_TEMPLATE
        self.eos_token_ids: set[int] = set(extra_eos_ids or ())
        if eos_token_id is not None:
            self.eos_token_ids.add(eos_token_id)
        specials = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self.eos_token_ids.update(specials[text] for text in END_OF_TURN_TOKENS if text in specials)
        self.special_token_ids: set[int] = set(specials.values())

    # ---- construction

    @classmethod
    def from_gguf(cls, path: str) -> "Tokenizer":
        fields = _gguf_fields(path)
        kind = fields.get("tokenizer.ggml.model")
        tokens = fields.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError(f"{path}: GGUF file carries no tokenizer (tokenizer.ggml.tokens missing)")
        if kind == "gpt2":
            backend = _byte_level_backend(tokens, fields.get("tokenizer.ggml.merges") or [],
                                          fields.get("tokenizer.ggml.pre"))
            add_bos_default = False
        elif kind == "llama":
            backend = _sentencepiece_backend(fields)
            add_bos_default = True
        else:
            from tokenmill.files.unsupported import UnsupportedModel

            raise UnsupportedModel(f"{path}: unsupported GGUF tokenizer model {kind!r}; supported: gpt2, llama")
        types = fields.get("tokenizer.ggml.token_type") or []
        control = [AddedToken(tokens[i], special=True, normalized=False)
                   for i, t in enumerate(types) if t == _TT_CONTROL]
        user = [AddedToken(tokens[i], special=False, normalized=False)
                for i, t in enumerate(types) if t == _TT_USER_DEFINED]
        if control:
            backend.add_special_tokens(control)
        if user:
            backend.add_tokens(user)
        extra = {int(fields[k]) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
                 if fields.get(k) is not None}
        return cls(
            backend,
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=fields.get("tokenizer.ggml.eos_token_id"),
            extra_eos_ids=extra,
            add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", add_bos_default)),
            chat_template=(fields.get("tokenizer.chat_template")
                           or ARCHITECTURE_CHAT_TEMPLATES.get(fields.get("general.architecture"))),
            vocab_size=len(tokens),
        )

    @classmethod
    def from_dir(cls, path: str) -> "Tokenizer":
        folder = Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise ValueError(f"{path}: no tokenizer.json (only fast tokenizers are supported)")
        backend = FastTokenizer.from_file(str(folder / "tokenizer.json"))
        cfg: dict[str, Any] = {}
        if (folder / "tokenizer_config.json").is_file():
            cfg = json.loads((folder / "tokenizer_config.json").read_text())

        def token_id(name: str) -> int | None:
            text = _token_text(cfg.get(name))
            return backend.token_to_id(text) if text else None

        bos_id, eos_id = token_id("bos_token"), token_id("eos_token")
        extra: set[int] = set()
        for extra_file in ("generation_config.json", "config.json"):
            if (folder / extra_file).is_file():
                value = json.loads((folder / extra_file).read_text()).get("eos_token_id")
                extra.update(value if isinstance(value, list) else [value] if value is not None else [])
        if eos_id is None and extra:
            eos_id = min(extra)
        if "add_bos_token" in cfg:
            add_bos = bool(cfg["add_bos_token"])
        else:  # the post-processor may prepend BOS (Llama's TemplateProcessing)
            probe = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos_id is not None and bool(probe) and probe[0] == bos_id
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            extra_eos_ids=extra,
            add_bos=add_bos,
            chat_template=_dir_chat_template(folder, cfg),
        )

    @classmethod
    def from_model_path(cls, path: str | None) -> "Tokenizer":
        """A GGUF file, an HF folder, or ``None`` for the bundled model."""
        if path is None:
            from tokenmill.files.bundled import default_model_path

            path = default_model_path()
        path = os.fspath(path)
        if os.path.isdir(path):
            return cls.from_dir(path)
        if os.path.isfile(path):
            return cls.from_gguf(path)
        raise FileNotFoundError(f"model path {path!r} does not exist")

    # ---- use

    @property
    def bos_token(self) -> str | None:
        return self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else None

    @property
    def eos_token(self) -> str | None:
        return self.id_to_token(self.eos_token_id) if self.eos_token_id is not None else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in the text become their ids.

        With ``add_special_tokens`` and a model that wants BOS, BOS is prepended,
        unless the text already starts with it (a chat template that writes BOS
        itself must not end up with two).
        """
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary spelling (byte alphabet for byte-level BPE), not the decoded text."""
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def token_to_text(self, token_id: int) -> str:
        """The text one token decodes to on its own (may hold U+FFFD for partial UTF-8)."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            template: str | None = None, **kwargs: Any) -> str:
        """The prompt string for a conversation, as ``transformers`` renders it
        (with ``template`` instead of the model's own when given)."""
        context: dict[str, Any] = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "add_generation_prompt": add_generation_prompt,
        }
        context.update(kwargs)
        return render_chat_template(template or self.chat_template, messages, **context)


def _dir_chat_template(folder: Path, cfg: dict[str, Any]) -> str | None:
    """tokenizer_config.json's template (string or named list), else chat_template.jinja/.json."""
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    if template:
        return template
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    if (folder / "chat_template.json").is_file():
        return json.loads((folder / "chat_template.json").read_text()).get("chat_template")
    return None

"""Token counting and exact-length prompt text for synthetic workloads.

Why exact: a benchmark that asks for 512-token prompts but sends 470 or 560
measures the wrong thing, and a shared prefix that is not block-aligned in
tokens shares fewer blocks than intended. We count with the model's own
tokenizer: a local ``tokenizer.json`` (``tokenizers`` library) or the server's
``POST /tokenize``; failing both, an approximate count with a warning.
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

import httpx

from ..files.corpus import corpus_text


class TokenCounter:
    """Counts tokens of a text. ``exact`` says whether the count is the model's."""

    exact = False
    name = "approximate (4 characters per token)"

    def count(self, text: str) -> int:
        return max(1, round(len(text) / 4)) if text else 0

    def close(self) -> None:
        """Release any connection the counter holds."""


class LocalTokenizer(TokenCounter):
    """A ``tokenizer.json`` file (or a folder holding one)."""

    exact = True

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        self._tok = Tokenizer.from_file(str(p))
        self.name = f"local tokenizer {p}"
        self._cache: dict[str, int] = {}

    def count(self, text: str) -> int:
        n = self._cache.get(text)
        if n is None:
            n = len(self._tok.encode(text).ids)
            if len(self._cache) < 100_000:
                self._cache[text] = n
        return n


class ServerTokenizer(TokenCounter):
    """The server's ``POST /tokenize`` (vLLM's shape: ``{"count": n, ...}``)."""

    exact = True

    def __init__(self, base_url: str, model: str, api_key: str | None = None,
                 timeout: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=base_url, headers=headers, timeout=timeout)
        self._model = model
        self._cache: dict[str, int] = {}
        self.name = f"server {base_url}/tokenize"
        self.max_model_len: int | None = None

    def count(self, text: str) -> int:
        n = self._cache.get(text)
        if n is None:
            resp = self._client.post("/tokenize", json={"model": self._model, "prompt": text})
            resp.raise_for_status()
            obj = resp.json()
            n = int(obj["count"]) if "count" in obj else len(obj["tokens"])
            self.max_model_len = obj.get("max_model_len", self.max_model_len)
            self._cache[text] = n
        return n

    def close(self) -> None:
        self._client.close()


def make_counter(tokenizer: str | None, base_url: str | None, model: str | None,
                 api_key: str | None = None, quiet: bool = False) -> TokenCounter:
    """Local tokenizer if given; else the server's /tokenize if it answers; else
    the approximation (with a warning, since lengths will then be off)."""
    if tokenizer:
        return LocalTokenizer(tokenizer)
    if base_url and model:
        server = ServerTokenizer(base_url, model, api_key)
        try:
            if server.count("hello world") > 0:  # a different /tokenize shape counts 0
                return server
        except (httpx.HTTPError, KeyError, ValueError, TypeError):
            pass
        server.close()
    if not quiet:
        print("warning: no tokenizer (--tokenizer) and the server has no /tokenize; "
              "prompt lengths are approximate", file=sys.stderr)
    return TokenCounter()


def corpus_words() -> list[str]:
    """Words of the bundled prose text that synthetic prompts are cut from."""
    return corpus_text().split()


FILLERS = ("the", "a", "and", ".", "x")


class TextBuilder:
    """Cuts prompt text of an exact token count out of the corpus."""

    def __init__(self, counter: TokenCounter, seed: int = 0, words: list[str] | None = None):
        self.counter = counter
        self.words = words or corpus_words()
        self.rng = random.Random(seed)
        sample = " ".join(self.words[:400])
        self.ratio = max(0.2, counter.count(sample) / 400)  # tokens per word

    def _slice(self, start: int, k: int) -> list[str]:
        n = len(self.words)
        return [self.words[(start + i) % n] for i in range(k)]

    def build(self, n_tokens: int, head: str = "") -> tuple[str, int]:
        """Text of ``n_tokens`` tokens (as the counter counts the whole text)
        starting with ``head``. Returns (text, counted tokens); the count
        differs from the target only if the head alone is longer, or the
        tokenizer refuses to land on it within a few tries."""
        sep = "" if not head or head[-1].isspace() else " "
        start = self.rng.randrange(len(self.words))
        count = self.counter.count

        def make(k: int, pad: int, filler: str = FILLERS[0]) -> str:
            body = " ".join(self._slice(start, k) + [filler] * pad)
            return head + (sep + body if body else "")

        base = count(head) if head else 0
        best: tuple[str, int] = (head, base)
        if base >= n_tokens:
            return best
        # Bracket the word count: lo = most words still <= target, hi = fewest over it.
        lo: tuple[int, int] = (0, base)
        hi: int | None = None
        k = max(1, int((n_tokens - base) / self.ratio))
        for _ in range(40):
            text = make(k, 0)
            c = count(text)
            if abs(c - n_tokens) < abs(best[1] - n_tokens) or c == n_tokens:
                best = (text, c)
            if c == n_tokens:
                return best
            if c < n_tokens and k >= lo[0]:
                lo = (k, c)
            elif c > n_tokens and (hi is None or k < hi):
                hi = k
            if hi is not None and hi - lo[0] <= 1:
                break
            step = int(round((n_tokens - c) / self.ratio)) or (1 if c < n_tokens else -1)
            nxt = k + step
            if nxt <= lo[0] or (hi is not None and nxt >= hi):
                nxt = (lo[0] + hi) // 2 if hi is not None else lo[0] + 1
            k = nxt
        k, c = lo
        # Below the target by a little: pad with a filler word that is one token.
        for filler in FILLERS:
            pad = n_tokens - c
            for _ in range(6):
                if pad < 0:
                    break
                text = make(k, pad, filler)
                c2 = count(text)
                if abs(c2 - n_tokens) < abs(best[1] - n_tokens):
                    best = (text, c2)
                if c2 == n_tokens:
                    return best
                pad += n_tokens - c2
        return best

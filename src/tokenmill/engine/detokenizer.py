"""Incremental, UTF-8-safe detokenization and stop strings.

Byte-level BPE splits multi-byte characters (emoji, CJK) across tokens, so
decoding token by token would emit U+FFFD. The `tokenizers` streaming decoder
holds such bytes back until the character is complete. On top of it, text
that could be the start of a stop string is held back (longest stop string
minus one characters) so a stop string spanning tokens is never half-sent,
and the sent offset only ever moves forward.
"""
from __future__ import annotations

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, backend: HFTokenizer, skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop: bool = False) -> None:
        self.backend = backend
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.stop = list(stop or [])
        self.include_stop = include_stop
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.sent = 0

    def add_token(self, token_id: int) -> str | None:
        """Append one token's text; return the stop string if one now appears
        (the text is then cut just before it, or after it if included)."""
        chunk = self.stream.step(self.backend, token_id)
        if not chunk:
            return None
        before = len(self.text)
        self.text += chunk
        if not self.stop:
            return None
        window_start = max(0, before - self.hold)
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.text.find(s, window_start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
        return s

    def take_delta(self, finished: bool) -> str:
        """Text not yet sent that is safe to send now."""
        limit = len(self.text) if finished else len(self.text) - self.hold
        if limit <= self.sent:
            return ""
        delta = self.text[self.sent : limit]
        self.sent = limit
        return delta

"""Reasoning output: a thinking model's ``<think>...</think>`` kept apart from its answer.

Chosen with ``--reasoning-parser NAME`` (vLLM's names):

- ``deepseek_r1``: the output is reasoning from its first token (the chat template
  opened the ``<think>`` section, or the model writes it first) until ``</think>``;
  output that never closes the section is all reasoning, cut short;
- ``qwen3``: reasoning only when the section is open: the output begins with
  ``<think>``, or the rendered prompt ends with it (thinking models whose template
  opens it); otherwise, e.g. ``enable_thinking: false``, everything is answer.

A prompt that ends with ``</think>`` (a template that closed an empty section)
means no reasoning whatever the family. The endpoints show the two parts their
own way: ``reasoning_content`` beside ``content`` in chat (streamed as deltas of
their own), a ``reasoning`` item in Responses, a ``thinking`` block in Messages.

One state machine (``ReasoningSplit``) serves streaming and whole texts, so a
streamed reply always reassembles to the non-streamed one. The answer is what
the rest of the server sees: tool-call parsing, and structured outputs, whose
grammar the engine applies only once the reasoning has ended
(``SamplingParams.structured_after``). ``max_tokens`` counts every output token,
reasoning included, as vLLM does: a reply cut while thinking has reasoning and
an empty answer, finish reason ``length``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

_State = Literal["start", "reasoning", "answer_start", "answer"]


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    implicit_start: bool = False  # the output is reasoning from its first token, tag or not


PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ReasoningParser("deepseek_r1", implicit_start=True),
    "qwen3": ReasoningParser("qwen3"),
}


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name is None:
        return None
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r} (known: {', '.join(sorted(PARSERS))})") from None


def _held(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that could still grow into ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


@dataclass
class ReasoningSplit:
    """One choice's output split into (reasoning, answer) as it arrives."""

    parser: ReasoningParser
    prompt_text: str | None = None
    state: _State = "start"
    buffer: str = ""
    reasoning: str | None = None  # None: the output has no reasoning section
    answer: str = ""
    _inside: bool = field(init=False)

    def __post_init__(self) -> None:
        tail = (self.prompt_text or "").rstrip()
        if tail.endswith(self.parser.end):
            self._inside = False
        elif tail.endswith(self.parser.start):
            self._inside = True
        else:
            self._inside = self.parser.implicit_start
        if not self._inside and tail.endswith(self.parser.end):
            self.state = "answer"  # the template closed the section: no reasoning at all

    @property
    def starts_inside(self) -> bool:
        """The output begins inside the reasoning section (the grammar of a structured
        request must wait for its end)."""
        return self._inside and self.state == "start"

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The (reasoning, answer) pieces ``text`` adds; ``final`` releases held-back text."""
        self.buffer += text
        thought, said = [], []
        while True:
            buf = self.buffer
            if self.state == "start":
                stripped = buf.lstrip()
                if stripped.startswith(self.parser.start):
                    self.buffer = stripped[len(self.parser.start):]
                    self.state = "reasoning"
                    self.reasoning = ""
                    continue
                if not final and self.parser.start.startswith(stripped):
                    break  # still could be the opening tag (or only whitespace so far)
                self.state = "reasoning" if self._inside else "answer"
                if self._inside:
                    self.reasoning = ""
                continue
            if self.state == "reasoning":
                at = buf.find(self.parser.end)
                if at >= 0:
                    thought.append(buf[:at])
                    self.buffer = buf[at + len(self.parser.end):]
                    self.state = "answer_start"
                    continue
                keep = 0 if final else _held(buf, self.parser.end)
                thought.append(buf[: len(buf) - keep])
                self.buffer = buf[len(buf) - keep:]
                break
            if self.state == "answer_start":  # the blank lines models put after </think>
                stripped = buf.lstrip()
                if not stripped:
                    self.buffer = ""
                    break
                self.buffer = stripped
                self.state = "answer"
                continue
            said.append(buf)
            self.buffer = ""
            break
        r, a = "".join(thought), "".join(said)
        if r:
            self.reasoning = (self.reasoning or "") + r
        self.answer += a
        return r, a


def split_reasoning(parser: ReasoningParser, text: str, prompt_text: str | None = None) -> tuple[str | None, str]:
    """A whole output as (reasoning or None, answer)."""
    split = ReasoningSplit(parser, prompt_text)
    split.feed(text, final=True)
    return split.reasoning, split.answer


def reasoning_for_grammar(settings: Any, params: Any, prompt_text: str | None) -> str | None:
    """``SamplingParams.structured_after`` for a request: the end tag when the server splits
    reasoning, the request has a grammar, and its output begins inside the reasoning.

    When the output may or may not open a section (``qwen3`` with a prompt that opens
    none), the grammar applies from the first token, so the answer is in the format."""
    parser = get_reasoning_parser(getattr(settings, "reasoning_parser", None))
    if parser is None or params.structured is None:
        return None
    return parser.end if ReasoningSplit(parser, prompt_text).starts_inside else None

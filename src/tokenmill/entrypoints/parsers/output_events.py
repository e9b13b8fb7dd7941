"""The neutral events a model's output becomes, whatever API carries it.

Why a vocabulary of its own: chat completions, completions, the Responses API and
Anthropic Messages show the same output (reasoning, answer text, tool calls, how it
ended, what it cost) in different shapes. The assembler (assembler.py) turns engine
deltas into these events once; each API encodes them, streamed as its SSE events or
folded into its whole body, so a streamed answer and a whole one cannot differ.

``index`` is the choice (for a request of several prompts, prompt x ``n`` + choice);
``call`` is a tool call's position within its choice. Events are not frozen (a frozen
dataclass costs several times as much to make, and one is made per token); nothing
changes one once made.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from ...model.sampler import Logprob


@dataclass(slots=True)
class TextDelta:
    """Answer text (never empty)."""

    index: int
    text: str


@dataclass(slots=True)
class ThinkingDelta:
    """Reasoning text. A choice's first one may be empty: it says the output has a
    reasoning section (which the APIs show, empty or not)."""

    index: int
    text: str


@dataclass(slots=True)
class ToolCallStart:
    index: int
    call: int
    id: str
    name: str


@dataclass(slots=True)
class ToolArgsDelta:
    """A piece of a call's arguments (JSON text)."""

    index: int
    call: int
    arguments: str


@dataclass(slots=True)
class ToolCallEnd:
    index: int
    call: int


@dataclass(slots=True)
class Logprobs:
    """The sampled tokens' logprobs of one engine delta, after that delta's text events and
    before those its end releases; ``prompt_logprobs`` once, when the engine scored the prompt."""

    index: int
    job: int
    logprobs: list[Logprob]
    prompt_logprobs: list[Logprob | None] | None


@dataclass(slots=True)
class Finish:
    """A choice ended. ``reason``/``stop_reason``: the engine's; ``tool_calls``: its answer
    parsed as tool calls (each API names that ending its own way)."""

    index: int
    reason: str | None
    stop_reason: Any
    tool_calls: bool


@dataclass(slots=True)
class Usage:
    """Tokens of the whole request so far; ``final`` once every choice has ended."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    final: bool = False

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def openai(self) -> dict[str, Any]:
        """The ``usage`` object of chat and completions."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens, "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


Event = Union[TextDelta, ThinkingDelta, ToolCallStart, ToolArgsDelta, ToolCallEnd, Logprobs, Finish, Usage]

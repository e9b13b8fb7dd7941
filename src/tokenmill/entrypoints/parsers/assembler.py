"""Engine deltas -> output events (output_events.py): the one place a model's output is read.

Each choice's text goes through its reasoning split (reasoning.py) and then its tool-call
stream (tool_calls.py); the request's tokens are tallied for usage. Every API's streamed
and whole answers are encodings of what this emits, so they agree by construction: a
whole answer is the same events folded, never a second parse of the text.

Per engine delta, in order: a ``Usage`` (the request's first delta always, every delta
when the API shows running usage), the choice's thinking and answer events, its
``Logprobs``, and when it ends the events its end releases and its ``Finish``.
``close()`` gives the final ``Usage`` once every stream is done.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ...engine.engine import SequenceDelta
from .output_events import Event, Finish, Logprobs, TextDelta, ThinkingDelta, Usage
from .reasoning import ReasoningParser, ReasoningSplit
from .tool_calls import ToolPlan, ToolStream


@dataclass
class Tally:
    """Usage of a whole request (every job, every choice)."""

    prompt_tokens: int
    completion_tokens: int = 0
    cached: dict[int, int] = field(default_factory=dict)  # per job: the most any delta reported

    def add(self, job: int, delta: SequenceDelta) -> None:
        self.completion_tokens += len(delta.token_ids)
        self.cached[job] = max(self.cached.get(job, 0), delta.num_cached_tokens)

    def usage(self, final: bool = False) -> Usage:
        return Usage(self.prompt_tokens, self.completion_tokens, sum(self.cached.values()), final)


@dataclass
class _Choice:
    split: ReasoningSplit | None
    tools: ToolStream | None
    thinking: bool = False  # a thinking event went out


class Assembler:
    """One request's output as events. ``prompt_lengths``: each job's prompt tokens;
    ``n``: choices per job; ``tools``/``reasoning``: how answers are read (None: plain
    text); ``prompt_text``: the rendered prompt (whether it opened a reasoning section);
    ``running_usage``: a ``Usage`` with every delta, not only the first."""

    def __init__(self, prompt_lengths: list[int], n: int = 1, tools: ToolPlan | None = None,
                 reasoning: ReasoningParser | None = None, prompt_text: str | None = None,
                 running_usage: bool = False) -> None:
        self.n = n
        self.tools = tools
        self.reasoning = reasoning
        self.prompt_text = prompt_text
        self.running_usage = running_usage
        self.tally = Tally(sum(prompt_lengths))
        self._choices: dict[int, _Choice] = {}
        self._started = False

    def usage(self) -> Usage:
        return self.tally.usage()

    def _choice(self, index: int) -> _Choice:
        split = ReasoningSplit(self.reasoning, self.prompt_text) if self.reasoning is not None else None
        tools = ToolStream(self.tools, index) if self.tools is not None else None
        choice = self._choices[index] = _Choice(split, tools)
        return choice

    def feed(self, job: int, d: SequenceDelta) -> list[Event]:
        """The events of one engine delta of job ``job``."""
        self.tally.add(job, d)
        index = job * self.n + d.index
        choice = self._choices.get(index) or self._choice(index)
        out: list[Event] = []
        if self.running_usage or not self._started:
            self._started = True
            out.append(self.tally.usage())
        text = d.text
        if choice.split is not None:
            thought, text = choice.split.feed(text, final=d.finished)
            if thought or (not choice.thinking and choice.split.reasoning is not None):
                choice.thinking = True
                out.append(ThinkingDelta(index, thought))
        if choice.tools is not None:
            out += choice.tools.feed(text)
        elif text:
            out.append(TextDelta(index, text))
        if d.logprobs or d.prompt_logprobs is not None:
            out.append(Logprobs(index, job, d.logprobs, d.prompt_logprobs))
        if d.finished:
            called = False
            if choice.tools is not None:
                rest, called = choice.tools.finish()
                out += rest
            out.append(Finish(index, d.finish_reason, d.stop_reason, called))
        return out

    def close(self) -> list[Event]:
        """The events after every stream ended: the final usage."""
        return [self.tally.usage(final=True)]

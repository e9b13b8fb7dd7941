"""Multi-turn conversations in a replay: which requests chain, and what a later turn sends.

Agent and chat traffic is a conversation: turn k's prompt is turn k-1's
prompt, its answer and the user's next words, sent after the user (or the
tool) thought for a while. Replaying the turns as independent requests at
their captured times gets both the cache and the load wrong: a turn could
start before the answer it extends exists, and its prefix would not be what
the server just computed. So a conversation replays as a chain: the first
turn at its arrival time (or as the load shape schedules it), each later one
``think`` seconds after the previous answer arrived, its prompt made of the
previous prompt, the answer the server actually gave, and the new words.
"""
from __future__ import annotations

from dataclasses import replace

from tokenmill.bench.types import RequestSpec


def chains(specs: list[RequestSpec]) -> list[list[int]]:
    """Indices of ``specs`` grouped into conversations, each in turn order, ordered by their first
    turn's place; a request outside any conversation is a chain of one."""
    out: list[list[int]] = []
    open_: dict[str, list[int]] = {}
    for i, spec in enumerate(specs):
        if spec.session is None:
            out.append([i])
            continue
        chain = open_.get(spec.session)
        if chain is None or spec.turn == 0:
            chain = open_[spec.session] = []
            out.append(chain)
        chain.append(i)
    for chain in out:
        chain.sort(key=lambda i: specs[i].turn)
    return out


def next_turn(sent: RequestSpec, answer: str, output_tokens: int, turn: RequestSpec,
              chat: bool) -> RequestSpec:
    """The request for ``turn``: what ``sent`` (the previous turn as sent) said, its ``answer``,
    then the turn's own words. Chat requests grow a message list; completions one text."""
    added = turn.prompt or ""
    length = None
    if sent.prompt_len is not None and turn.prompt_len is not None:
        length = sent.prompt_len + output_tokens + turn.prompt_len
    if chat:
        messages = list(sent.messages or [{"role": "user", "content": sent.prompt or ""}])
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": added}]
        return replace(turn, prompt=None, messages=messages, prompt_len=length)
    return replace(turn, prompt=(sent.prompt or "") + answer + added, messages=None, prompt_len=length)

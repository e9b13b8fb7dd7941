"""Stored Responses: what ``previous_response_id`` continues and ``GET /v1/responses/{id}`` returns.

Why in memory and bounded: a response is kept so the next turn can send only
its new input; the store is a cache of conversations, not a database. It holds
at most ``--responses-store-size`` responses and evicts the least recently
used (reading a response or continuing from it counts as use), so memory stays
bounded whatever clients do; an evicted or deleted id answers 404 as an unknown
one does.

Each entry keeps the response object as returned and the conversation in chat
form (earlier turns, this turn's input, this turn's answer), without the
``instructions``, which OpenAI does not carry to the next turn. The next turn
renders that conversation plus its own input, so its prompt begins with the
previous prompt and answer and the prefix cache serves those tokens. Message
dicts are shared between entries, never copied: a chain of N turns costs N
lists of pointers, not N copies of the text.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the response object, as GET returns it
    messages: list[dict[str, Any]]  # the conversation through this response's answer, in chat form


class ResponseStore:
    """An LRU map of response id -> StoredResponse, at most ``capacity`` entries."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, int(capacity))
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
            self.evicted += 1

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None

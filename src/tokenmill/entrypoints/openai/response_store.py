"""Stored Responses: what ``previous_response_id`` continues and ``GET /v1/responses/{id}`` returns.

Why in memory and bounded: a response is kept so the next turn can send only
its new input; the store is a cache of conversations, not a database. It holds
at most ``--responses-store-size`` responses and evicts the least recently
used (reading a response or continuing from it counts as use), so memory stays
bounded whatever clients do; an evicted or deleted id answers 404 as an unknown
one does. A count alone would not bound memory (one client can store a few
huge conversations), so the store is bounded in bytes as well
(``--responses-store-bytes``): each entry is sized as its response and
conversation encoded as JSON, which counts text its chain shares with earlier
entries again (an over-estimate, never an under-estimate), and an entry larger
than the whole bound is not stored at all.

Each entry keeps the response object as returned and the conversation in chat
form (earlier turns, this turn's input, this turn's answer), without the
``instructions``, which OpenAI does not carry to the next turn. The next turn
renders that conversation plus its own input, so its prompt begins with the
previous prompt and answer and the prefix cache serves those tokens. Message
dicts are shared between entries, never copied: a chain of N turns costs N
lists of pointers, not N copies of the text.

Each entry also records its owner, the tenant whose request made it
(``tenants.owner_of``). ``get`` and ``delete`` take the caller and ask
``tenants.may_access``, the one ownership check: to anyone but its owner and
the operator an entry does not exist (None, the same as an unknown id), and
their lookups do not count as use.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ...gateway.tenants import Tenant, may_access

DEFAULT_STORE_BYTES = 64 * 1024 * 1024


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the response object, as GET returns it
    messages: list[dict[str, Any]]  # the conversation through this response's answer, in chat form
    owner: str | None = None  # the tenant that made it (tenants.owner_of; None: the operator)


def entry_bytes(entry: StoredResponse) -> int:
    """What an entry is counted as against the byte bound: its response and conversation as
    UTF-8 JSON (text the entry shares with others counted again)."""
    encoded = json.dumps([entry.body, entry.messages], ensure_ascii=False, default=str, separators=(",", ":"))
    return len(encoded.encode())


class ResponseStore:
    """An LRU map of response id -> StoredResponse, at most ``capacity`` entries and
    ``max_bytes`` bytes (``entry_bytes``) together."""

    def __init__(self, capacity: int, max_bytes: int = DEFAULT_STORE_BYTES) -> None:
        self.capacity = max(0, int(capacity))
        self.max_bytes = max(0, int(max_bytes))
        self._entries: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()
        self.bytes = 0  # the sum of the held entries' sizes
        self.evicted = 0
        self.refused = 0  # entries larger than the whole byte bound, not stored

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> bool:
        """Store ``entry`` as the most recent, evicting the least recently used until both
        bounds hold; False (and nothing stored under the id) when it alone exceeds them."""
        self._drop(response_id)
        if self.capacity == 0:
            return False
        size = entry_bytes(entry)
        if size > self.max_bytes:
            self.refused += 1
            return False
        self._entries[response_id] = (entry, size)
        self.bytes += size
        while len(self._entries) > self.capacity or self.bytes > self.max_bytes:
            _, (_, gone) = self._entries.popitem(last=False)
            self.bytes -= gone
            self.evicted += 1
        return True

    def _visible(self, response_id: str, caller: Tenant | None) -> StoredResponse | None:
        held = self._entries.get(response_id)
        if held is None or not may_access(caller, held[0].owner):
            return None
        return held[0]

    def get(self, response_id: str, *, caller: Tenant | None) -> StoredResponse | None:
        """The entry, when ``caller`` may see it (``tenants.may_access``), as the most recent."""
        entry = self._visible(response_id, caller)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str, *, caller: Tenant | None) -> bool:
        """Remove the entry; False when there is none ``caller`` may see."""
        return self._visible(response_id, caller) is not None and self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        held = self._entries.pop(response_id, None)
        if held is None:
            return False
        self.bytes -= held[1]
        return True

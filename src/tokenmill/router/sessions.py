"""Session affinity: a conversation stays on the replica that holds its turns.

An agent's next turn extends its previous prompt and answer, so the replica
that served the previous turn holds all of it in cache, which no prefix score
of a cold replica can beat; for the Responses API's ``previous_response_id``
the stored conversation lives only on that replica. A session is named by the
``x-session-id`` header, else the body's ``user`` field, else the previous
response's id (``previous_response_id``; the router learns which replica
produced each response id from the responses it relays).

A session keeps its replica while that replica is in rotation and not
overloaded (the prefix policy's own test, policy.PrefixAware.overloaded);
otherwise it is routed as any request and *moves*: the new replica becomes its
home, so it moves once, not back and forth. The table is a bounded LRU.
"""
from __future__ import annotations

import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping

SESSION_HEADER = "x-session-id"
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_\-]{1,128})"')


def session_key(headers: Mapping[str, str], body: Any) -> str | None:
    """The session a request belongs to, or None."""
    sid = headers.get(SESSION_HEADER)
    if sid:
        return "session:" + sid[:256]
    if isinstance(body, dict):
        prev = body.get("previous_response_id")
        if isinstance(prev, str) and prev:
            return "response:" + prev[:256]
        user = body.get("user")
        if isinstance(user, str) and user:
            return "user:" + user[:256]
    return None


def response_id_in(chunk: bytes) -> str | None:
    """The Responses API id in a response body or its first stream event, if any."""
    m = _RESPONSE_ID.search(chunk[:65536])
    return m.group(1).decode() if m else None


@dataclass
class _Home:
    url: str
    seen: float


class SessionTable:
    """session key -> home replica URL, least recently used dropped past ``capacity``."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._homes: OrderedDict[str, _Home] = OrderedDict()
        self.kept = 0  # requests sent to their session's home
        self.moved = 0  # sessions that changed home (home down or overloaded)
        self.started = 0  # sessions seen for the first time

    def __len__(self) -> int:
        return len(self._homes)

    def home(self, key: str) -> str | None:
        entry = self._homes.get(key)
        if entry is None:
            return None
        self._homes.move_to_end(key)
        return entry.url

    def settle(self, key: str, url: str, kept: bool) -> None:
        """Record where a request of this session went."""
        old = self._homes.get(key)
        if kept:
            self.kept += 1
        elif old is None:
            self.started += 1
        elif old.url != url:
            self.moved += 1
        self._put(key, url)

    def learn_response(self, response_id: str, url: str) -> None:
        """A response produced on ``url``: its continuation belongs there."""
        self._put("response:" + response_id, url)

    def _put(self, key: str, url: str) -> None:
        self._homes[key] = _Home(url, time.monotonic())
        self._homes.move_to_end(key)
        while len(self._homes) > self.capacity:
            self._homes.popitem(last=False)

    def snapshot(self) -> dict:
        return {"sessions": len(self._homes), "kept": self.kept, "moved": self.moved, "started": self.started}

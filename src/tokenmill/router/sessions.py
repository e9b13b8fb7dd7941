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

A Responses API conversation is stricter: its stored turns exist only on the
replica that produced ``previous_response_id``, so another replica can only
answer 404. The router remembers which replica produced each response id (from
the whole JSON body of a plain answer, and from the ``response.*`` events of a
stream as they pass, holding at most one event line), in an LRU of its own so
that session churn cannot evict a conversation; core.Router.route sends the
continuation there however busy it is.
"""
from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping

SESSION_HEADER = "x-session-id"
MAX_ID_CHARS = 256  # a response id longer than this is not remembered (nor looked up)
# A stream event line longer than this is not parsed: response.created, which names the id,
# is short; a long response.completed only repeats it.
MAX_EVENT_LINE = 64 * 1024


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


def previous_response_of(body: Any) -> str | None:
    """The ``previous_response_id`` a Responses API request continues, or None."""
    prev = body.get("previous_response_id") if isinstance(body, dict) else None
    return prev if isinstance(prev, str) and 0 < len(prev) <= MAX_ID_CHARS else None


def _response_id(obj: Any) -> str | None:
    if isinstance(obj, dict) and obj.get("object") == "response":
        rid = obj.get("id")
        if isinstance(rid, str) and 0 < len(rid) <= MAX_ID_CHARS:
            return rid
    return None


def response_id_of_body(content: bytes) -> str | None:
    """The id of a whole Responses API answer (a JSON ``response`` object), or None."""
    try:
        return _response_id(json.loads(content))
    except (ValueError, RecursionError):
        return None


class ResponseIdSniffer:
    """Finds the response id in a Responses API event stream fed chunk by chunk, without
    holding the stream: only the current line, up to MAX_EVENT_LINE bytes, is kept."""

    def __init__(self) -> None:
        self._line = bytearray()
        self._skipping = False  # the current line is past MAX_EVENT_LINE: drop it to its end
        self.found: str | None = None

    def feed(self, chunk: bytes) -> str | None:
        """The id, the first time a chunk completes the event that names it; else None."""
        if self.found is not None:
            return None
        start = 0
        while start < len(chunk):
            nl = chunk.find(b"\n", start)
            end = len(chunk) if nl < 0 else nl
            if not self._skipping:
                self._line += chunk[start:end]
                if len(self._line) > MAX_EVENT_LINE:
                    self._line.clear()
                    self._skipping = True
            if nl < 0:
                return None
            line, self._skipping = bytes(self._line), False
            self._line.clear()
            self.found = _event_response_id(line)
            if self.found is not None:
                return self.found
            start = nl + 1
        return None


def _event_response_id(line: bytes) -> str | None:
    """The response id an SSE ``data:`` line of a ``response.*`` event carries, or None."""
    line = line.rstrip(b"\r")
    if not line.startswith(b"data:"):
        return None
    try:
        event = json.loads(line[5:])
    except (ValueError, RecursionError):
        return None
    if isinstance(event, dict) and str(event.get("type", "")).startswith("response."):
        return _response_id(event.get("response"))
    return None


@dataclass
class _Home:
    url: str
    seen: float


class SessionTable:
    """session key -> home replica URL, and response id -> the replica that produced it; each
    an LRU, the least recently used dropped past its capacity."""

    def __init__(self, capacity: int = 100_000, responses: int = 100_000) -> None:
        self.capacity = capacity
        self.response_capacity = responses
        self._homes: OrderedDict[str, _Home] = OrderedDict()
        self._responses: OrderedDict[str, str] = OrderedDict()
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
        self._homes[key] = _Home(url, time.monotonic())
        self._homes.move_to_end(key)
        while len(self._homes) > self.capacity:
            self._homes.popitem(last=False)

    def learn_response(self, response_id: str, url: str) -> None:
        """A response produced on ``url``: its continuation and its GET/DELETE belong there."""
        self._responses[response_id] = url
        self._responses.move_to_end(response_id)
        while len(self._responses) > self.response_capacity:
            self._responses.popitem(last=False)

    def response_home(self, response_id: str) -> str | None:
        """The replica that produced ``response_id``, if remembered."""
        url = self._responses.get(response_id)
        if url is not None:
            self._responses.move_to_end(response_id)
        return url

    def snapshot(self) -> dict:
        return {"sessions": len(self._homes), "kept": self.kept, "moved": self.moved, "started": self.started,
                "responses": len(self._responses)}

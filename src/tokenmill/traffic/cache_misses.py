"""Why a prompt missed the prefix cache, decided as each request arrives.

A miss is the part of a prompt the cache could not serve though it could have:
the previous turn of the same conversation held it (so it was there and was
evicted, or this prompt rewrote it), or other prompts share the text right
after something unique at the front. The classifier compares token ids only;
reasons, with the token offset where reuse stopped:

- ``evicted``: the prompt extends the session's previous prompt, but the cache
  served less of it than that (its blocks were evicted in between).
- ``volatile_span``: a short span differs in place (a timestamp, a nonce, a
  request or user id) and the text after it is the same as before (in the
  previous turn, or in other recent prompts when it is a conversation's first
  request): the span sits before shared text and breaks the chain there.
- ``reordered``: the same pieces in another order from the divergence on
  (shuffled tool definitions, JSON keys in another order).
- ``rewritten_history``: earlier content was removed or changed at length
  (dropped or summarised turns).
- ``cold``: nothing before it could have served it.

None is returned when nothing was missed (what could be reused was reused).
The previous prompts are kept per session (bounded LRU of token arrays), and
short content windows of recent prompts (``WINDOW`` tokens at every multiple
of ``WINDOW``, bounded) stand for "text other prompts also hold".
"""
from __future__ import annotations

from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Sequence

REASONS = ("evicted", "volatile_span", "reordered", "rewritten_history", "cold")
WINDOW = 8  # tokens per content window; anchors re-align two prompts after a divergence
MAX_SPAN = 64  # a changed span at most this long counts as volatile; longer is a rewrite
SEARCH = 512  # tokens after a divergence searched for where the prompts re-align


@dataclass(frozen=True)
class Miss:
    reason: str
    offset: int  # token offset where reuse stopped
    span: int = 0  # tokens of the offending span (volatile_span), or 0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _find(hay: Sequence[int], needle: Sequence[int], start: int, stop: int) -> int:
    """First position in hay[start:stop] where needle begins, or -1."""
    m = len(needle)
    first = needle[0]
    for i in range(start, min(stop, len(hay) - m + 1)):
        if hay[i] == first and list(hay[i:i + m]) == list(needle):
            return i
    return -1


def _realign(p: Sequence[int], q: Sequence[int], d: int) -> tuple[int, int] | None:
    """The first place after ``d`` where both prompts hold the same WINDOW tokens:
    (i in p, j in q), minimising i + j; None within SEARCH tokens."""
    best: tuple[int, int] | None = None
    for j in range(d, min(len(q) - WINDOW, d + SEARCH) + 1):
        if best is not None and j - d >= best[0] + best[1] - 2 * d:
            break
        i = _find(p, q[j:j + WINDOW], d, d + SEARCH + WINDOW)
        if i >= 0 and (best is None or i + j < best[0] + best[1]):
            best = (i, j)
    return best


def _similar(a: Sequence[int], b: Sequence[int], share: float = 0.9) -> bool:
    """The same tokens in any order, up to ``1 - share`` of them (re-tokenized seams)."""
    if not a or not b:
        return False
    common = sum((Counter(a) & Counter(b)).values())
    return common >= share * max(len(a), len(b))


def _resync(p: Sequence[int], q: Sequence[int], d: int, slack: int = 2) -> tuple[int, int] | None:
    """The first place after ``d`` from which both prompts run on identically for two windows,
    at offsets at most ``slack`` tokens apart (a region rewritten at about the same length)."""
    run = 2 * WINDOW
    for e in range(d + 1, min(len(p) - run, d + SEARCH) + 1):
        for e2 in range(max(d + 1, e - slack), min(len(q) - run, e + slack) + 1):
            if p[e] == q[e2] and list(p[e:e + run]) == list(q[e2:e2 + run]):
                return e, e2
    return None


def _moved(span: Sequence[int], region: Sequence[int], share: float = 0.8, empty: bool = False) -> bool:
    """Whether ``span``'s tokens (at least ``share`` of them) stand in ``region`` of the other
    prompt: moved pieces rather than new text. An empty span counts as ``empty``."""
    if not span:
        return empty
    return sum((Counter(span) & Counter(region)).values()) >= share * len(span)


def compare_with_previous(p: Sequence[int], q: Sequence[int], cached: int, block_size: int) -> Miss | None:
    """Classify ``p`` (served ``cached`` tokens from cache) against the same conversation's
    previous prompt ``q``."""
    d = common_prefix(p, q)
    reusable = min(d, len(p) - 1) // block_size * block_size
    if cached + block_size <= reusable:  # the cache lost what the previous turn left in it
        return Miss("evicted", cached)
    if d >= len(q) - 1 or d >= len(p) - 1:  # p extends q: nothing was in the way
        return None
    if len(p) - d < WINDOW or len(q) - d < WINDOW:
        return Miss("rewritten_history", d)
    rest = min(SEARCH, len(q) - d)
    head_p, head_q = p[d:d + WINDOW], q[d:d + WINDOW]
    if (_find(q, head_p, d + 1, len(q)) >= 0 and _find(p, head_q, d + 1, len(p)) >= 0
            and _similar(p[d:d + rest], q[d:d + rest])):
        return Miss("reordered", d)  # large pieces moved (whole tool definitions)
    resync = _resync(p, q, d)
    if resync is not None and resync[0] - d >= WINDOW and _similar(p[d:resync[0]], q[d:resync[1]], 0.85):
        return Miss("reordered", d)  # a region as long as before with the same tokens (keys reordered)
    where = _realign(p, q, d)
    if where is None:
        return Miss("rewritten_history", d)
    added, gone = p[d:where[0]], q[d:where[1]]
    # Moved pieces (a WINDOW or more, their tokens standing in the other prompt) mean reordering;
    # shorter spans are too weak a sign (a timestamp's digits can be a permutation of the old ones).
    moved = (max(len(added), len(gone)) >= WINDOW and _moved(added, q[d:d + SEARCH], empty=True)
             and _moved(gone, p[d:d + SEARCH], empty=True))
    if moved:
        return Miss("reordered", d)
    if not added:  # content of the previous prompt is gone (dropped or summarised turns)
        return Miss("rewritten_history", d)
    if not gone:  # content added: in front of everything it is a volatile prefix, else an edit
        return Miss("volatile_span", d, len(added)) if d < block_size else Miss("rewritten_history", d)
    if len(added) <= MAX_SPAN and len(gone) <= MAX_SPAN:  # a short span replaced in place
        return Miss("volatile_span", d, max(len(added), len(gone)))
    return Miss("rewritten_history", d)


class MissClassifier:
    """Keeps each session's previous prompt and recent content windows; classifies each request."""

    def __init__(self, block_size: int, max_sessions: int = 4096, max_windows: int = 200_000,
                 max_tokens_kept: int = 32_768) -> None:
        self.block_size = block_size
        self.max_sessions = max_sessions
        self.max_windows = max_windows
        self.max_tokens_kept = max_tokens_kept
        self._previous: OrderedDict[str, array] = OrderedDict()
        self._windows: OrderedDict[int, None] = OrderedDict()
        self.counts: Counter[str] = Counter()
        self.offsets: dict[str, Counter[int]] = {}  # reason -> offsets where reuse stopped

    def classify(self, prompt: Sequence[int], cached: int, session: str | None) -> Miss | None:
        """The reason (or None) for this request, then remember it for the next ones."""
        prev = self._previous.get(session) if session is not None else None
        if prev is not None:
            miss = compare_with_previous(prompt, prev, cached, self.block_size)
        else:
            miss = self._first_turn(prompt, cached)
        self._remember(prompt, session)
        if miss is not None:
            self.counts[miss.reason] += 1
            offsets = self.offsets.setdefault(miss.reason, Counter())
            if miss.offset in offsets or len(offsets) < 1024:  # bounded: the common offsets stand out early
                offsets[miss.offset] += 1
        return miss

    def summary(self) -> list[dict]:
        """Reasons, most requests first, each with its most frequent offset (the console's view)."""
        return [{"reason": r, "requests": n,
                 "usual_offset": self.offsets[r].most_common(1)[0][0] if self.offsets.get(r) else None}
                for r, n in self.counts.most_common()]

    def _first_turn(self, p: Sequence[int], cached: int) -> Miss | None:
        """No previous turn: unique text before text other prompts share is a volatile span."""
        bs = self.block_size
        if cached >= bs:  # the chain held past the front: what follows is this prompt's own
            return None
        start = cached
        for i in range(start, min(len(p) - WINDOW, start + MAX_SPAN + WINDOW) + 1):
            if hash(tuple(p[i:i + WINDOW])) in self._windows:
                if i - start >= 1 and self._shared_after(p, i):
                    return Miss("volatile_span", start, i - start)
                break
        return Miss("cold", cached) if cached == 0 else None

    def _shared_after(self, p: Sequence[int], i: int) -> bool:
        """At least two thirds of the windows from ``i`` on (up to 8) were seen in other prompts."""
        hits = total = 0
        for k in range(i, min(len(p) - WINDOW + 1, i + 8 * WINDOW), WINDOW):
            total += 1
            hits += hash(tuple(p[k:k + WINDOW])) in self._windows
        return total > 0 and hits * 3 >= total * 2

    def _remember(self, p: Sequence[int], session: str | None) -> None:
        for k in range(0, len(p) - WINDOW + 1, WINDOW):
            key = hash(tuple(p[k:k + WINDOW]))
            self._windows[key] = None
            self._windows.move_to_end(key)
        while len(self._windows) > self.max_windows:
            self._windows.popitem(last=False)
        if session is not None:
            self._previous[session] = array("i", p[:self.max_tokens_kept])
            self._previous.move_to_end(session)
            while len(self._previous) > self.max_sessions:
                self._previous.popitem(last=False)

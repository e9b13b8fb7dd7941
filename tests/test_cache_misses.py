"""Miss reasons on a replay with six injected cache breakers, tokenized by the bundled model's
tokenizer: each affected request gets the right reason at the right offset; clean ones none."""
from __future__ import annotations

import json
import random

import pytest

from tokenmill.traffic.cache_misses import MissClassifier, compare_with_previous
from tokenmill.router.cache.prefix_index import block_hashes

BLOCK = 16
TOOLS = [{"name": f"tool_{n}", "description": f"Looks up the {n} of an order and returns it as text.",
          "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}}}
         for n in ("status", "price", "owner", "address", "history")]
CONFIG = {"region": "north", "currency": "EUR", "language": "en", "tier": "gold", "retries": 3}
SYSTEM = ("You are the support assistant of a parcel company. Answer briefly and politely, cite the "
          "order number, never invent data, and ask for the order number when it is missing. ") * 3
QUESTIONS = ["Where is my parcel 4411?", "Can I change the delivery address?", "What does the gold tier include?",
             "Why was I charged twice?", "Please cancel order 9920."]
ANSWERS = ["It left the depot this morning.", "Yes, until it ships.", "Free returns and priority handling.",
           "The second charge is a hold that is released in two days.", "Done: the order is cancelled."]


class Session:
    """A conversation rendered as a flat prompt, with one breaker (or none)."""

    def __init__(self, sid: int, breaker: str | None, rng: random.Random) -> None:
        self.sid, self.breaker, self.rng = sid, breaker, rng
        self.turns: list[tuple[str, str]] = []

    def acts_on(self, turn: int) -> bool:
        """Whether the breaker changes this turn's prompt against the conversation so far."""
        if self.breaker is None:
            return False
        if self.breaker == "user_id_first":  # constant in a session: it breaks sharing between sessions
            return turn == 0 and self.sid > 0
        if self.breaker == "dropped_turns":
            return turn == 2
        return turn > 0

    def render(self, turn: int) -> str:
        tools, config, system = list(TOOLS), dict(CONFIG), SYSTEM
        head = ""
        if self.breaker == "leading_timestamp":
            head = f"[2026-12-04 10:{turn:02d}:{self.rng.randint(0, 59):02d}] "
        if self.breaker == "user_id_first":
            head = f"user id u{self.sid * 7919 % 100000:05d}\n"
        nonce = f" Request nonce {self.rng.getrandbits(48):012x}." if self.breaker == "nonce_in_system" else ""
        if self.breaker == "shuffled_tools" and turn > 0:
            while tools == TOOLS:
                self.rng.shuffle(tools)
        if self.breaker == "reordered_keys" and turn > 0:
            keys = list(config)
            while keys == list(CONFIG):
                self.rng.shuffle(keys)
            config = {k: config[k] for k in keys}
        history = self.turns[1:] if self.breaker == "dropped_turns" and turn == 2 else self.turns
        text = (head + "system: " + system[:len(system) // 2] + nonce + system[len(system) // 2:]
                + "\ntools: " + json.dumps(tools) + "\nsettings: " + json.dumps(config) + "\n")
        for q, a in history:
            text += f"user: {q}\nassistant: {a}\n"
        return text + f"user: {QUESTIONS[(self.sid + turn) % len(QUESTIONS)]}\nassistant:"

    def answer(self, turn: int) -> None:
        self.turns.append((QUESTIONS[(self.sid + turn) % len(QUESTIONS)], ANSWERS[(self.sid + turn) % len(ANSWERS)]))


def _common_chars(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


EXPECTED = {"leading_timestamp": "volatile_span", "nonce_in_system": "volatile_span", "user_id_first": "volatile_span",
            "shuffled_tools": "reordered", "reordered_keys": "reordered", "dropped_turns": "rewritten_history"}


@pytest.mark.parametrize("seed", [5, 11, 23, 42])
def test_six_breakers_are_named_with_their_offsets_and_clean_requests_are_not(real_tokenizer, seed):
    tok = real_tokenizer
    rng = random.Random(seed)
    breakers = [None, None, *EXPECTED] * 3
    sessions = [Session(i, b, rng) for i, b in enumerate(breakers)]
    cache: set[bytes] = set()  # an exact prefix cache large enough for everything (no evictions)
    classifier = MissClassifier(BLOCK)
    affected = right = flagged_clean = clean = 0
    wrong: list = []
    previous: dict[int, str] = {}
    for turn in range(3):
        for s in sessions:
            text = s.render(turn)
            ids = tok.encode(text, add_special_tokens=False)
            keys = block_hashes(ids, BLOCK)
            hit = 0
            while hit < len(keys) and keys[hit] in cache:
                hit += 1
            cached = min(hit * BLOCK, len(ids) - 1)
            cache.update(keys)
            miss = classifier.classify(ids, cached, f"s{s.sid}")
            if not s.acts_on(turn):
                clean += 1
                flagged_clean += miss is not None and miss.reason != "cold"
                if miss is not None and miss.reason != "cold":
                    wrong.append(("clean", s.breaker, turn, miss))
            else:
                affected += 1
                # where the text stops matching the previous turn's (or the front, between sessions)
                same = _common_chars(previous[s.sid], text) if s.sid in previous else ""
                expected_offset = len(tok.encode(same, add_special_tokens=False)) if same else 0
                ok = (miss is not None and miss.reason == EXPECTED[s.breaker]
                      and abs(miss.offset - expected_offset) <= 2)
                right += ok
                if not ok:
                    wrong.append((s.breaker, turn, miss, expected_offset))
            previous[s.sid] = text
            s.answer(turn)
    assert affected >= 30 and clean >= 20
    assert right / affected >= 0.95, wrong
    assert flagged_clean == 0, wrong


def test_eviction_is_told_from_a_layout_problem():
    q = list(range(100, 164))  # four blocks
    p = q + list(range(500, 520))
    assert compare_with_previous(p, q, cached=64, block_size=BLOCK) is None  # all reused
    miss = compare_with_previous(p, q, cached=16, block_size=BLOCK)
    assert miss is not None and (miss.reason, miss.offset) == ("evicted", 16)
    changed = list(q)
    changed[20:24] = [9, 9, 9, 9]  # a short span replaced in place
    miss = compare_with_previous(changed + list(range(500, 520)), q, cached=16, block_size=BLOCK)
    assert miss is not None and (miss.reason, miss.offset) == ("volatile_span", 20)


def test_first_turn_volatile_prefix_needs_shared_text_after_it():
    c = MissClassifier(BLOCK)
    shared = list(range(1000, 1200))
    assert c.classify(shared, 0, "a").reason == "cold"
    miss = c.classify([7, 8, 9] + shared, 0, "b")  # something unique first, then the shared text
    assert miss is not None and (miss.reason, miss.offset, miss.span) == ("volatile_span", 0, 3)
    assert c.classify(list(range(5000, 5200)), 0, "c").reason == "cold"  # nothing shared: cold
    assert c.classify(shared[:100] + [1, 2, 3] * 10, 96, "d") is None  # the chain held past the front


@pytest.mark.parametrize("n", [0, 1])
def test_bounded_memory(n):
    c = MissClassifier(BLOCK, max_sessions=3, max_windows=50)
    for i in range(20):
        c.classify(list(range(i * 100, i * 100 + 80 + n)), 0, f"s{i}")
    assert len(c._previous) == 3 and len(c._windows) <= 50

"""What a replica really holds, from its KV events (``--prefix-source events``).

The approximate index (prefix_index.py) remembers what the router sent where;
it cannot see evictions, restarts or traffic that bypassed the router. A
replica that publishes KV events (tokenmill with ``--kv-events-config``, or a
vLLM pod with ``--kv-events-config``) says exactly which blocks it stored and
removed. ``EventIndex`` replays those events into the same chained block keys
the router computes for a request, so a match is a lookup per block, as
before. An event that carries token ids (vLLM's always do; tokenmill's only
with ``include_token_ids``) is keyed by ``prefix_index.chain_key`` over them,
and the replica's hashes only name blocks for later removals: no publisher's
hash function has to be reproduced. An event without token ids (tokenmill's
default, which keeps prompts off the wire) is keyed by its 64-bit hash, which
is tokenmill's ``chain_digest``, the router's own key; a bytes hash without
token ids (another publisher's) cannot be placed and is counted in
``unkeyed``.

Two things events cannot say are kept beside them: blocks of requests routed
there in the last few seconds (their prefill has not stored them yet, and a
burst behind one prefix must still follow its first request), and whether the
stream is alive. ``RoutingIndex`` answers from the events while they flow and
falls back to the approximate index when they stop (nothing heard for
``stale_after`` seconds although requests were sent there), when the block
sizes disagree, or before the first batch arrives.

``EventSubscriber`` is one thread per replica on a ZeroMQ SUB socket. It
follows sequence numbers: a gap asks the replica's replay socket for the
missed batches (or, without one, clears the index: it no longer knows); a
sequence number that goes back means the replica restarted, and its index is
cleared before the new stream is applied. A replica that admits subscribers by
CURVE key is followed with the router's key pair and the replica's public key
(``--kv-events-client-key``, ``--kv-events-server-key``).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

from ...traffic.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, CurveKeys, EventBatch, MEDIUM_POOL,
                         curve_client, decode_batch, digest_of_hash)
from .prefix_index import PrefixIndex, chain_key

log = logging.getLogger("tokenmill.router")

# A block held only in a slower tier (host memory, disk) is worth this share of one in the pool.
LOWER_TIER_WEIGHT = 0.5


@dataclass
class EventIndex:
    """The blocks one replica holds, by tier, as its events tell."""

    block_size: int
    recent_ttl: float = 5.0  # seconds a routed request's blocks count before events confirm them
    _held: dict[bytes, set[str]] = field(default_factory=dict)  # key -> media holding it
    _by_hash: dict[tuple[object, str], bytes] = field(default_factory=dict)  # (hash, medium) -> key
    _recent: dict[bytes, float] = field(default_factory=dict)  # key -> expiry
    batches: int = 0
    orphans: int = 0  # stored blocks whose parent was unknown (dropped)
    unkeyed: int = 0  # stored blocks named only by a hash that is not tokenmill's chain (dropped)
    mismatched_block_size: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __len__(self) -> int:
        return len(self._held)

    def apply(self, batch: EventBatch) -> None:
        with self.lock:
            self.batches += 1
            for event in batch.events:
                if isinstance(event, BlockStored):
                    self._stored(event)
                elif isinstance(event, BlockRemoved):
                    medium = event.medium or MEDIUM_POOL
                    for h in event.block_hashes:
                        key = self._by_hash.pop((_hashable(h), medium), None)
                        if key is None:
                            continue
                        media = self._held.get(key)
                        if media is not None:
                            media.discard(medium)
                            if not media:
                                del self._held[key]
                                self._recent.pop(key, None)
                elif isinstance(event, AllBlocksCleared):
                    self._clear()

    def _stored(self, event: BlockStored) -> None:
        if event.block_size != self.block_size:
            self.mismatched_block_size = event.block_size
            return
        medium = event.medium or MEDIUM_POOL
        if not event.token_ids:
            self._stored_by_hash(event.block_hashes, medium)
            return
        if event.parent_block_hash is None:
            parent = b""
        else:
            known = self._by_hash.get((_hashable(event.parent_block_hash), medium))
            if known is None:  # the parent may be named in another tier
                known = next((k for (h, _), k in self._by_hash.items()
                              if h == _hashable(event.parent_block_hash)), None)
            if known is None:
                self.orphans += len(event.block_hashes)
                return
            parent = known
        bs = self.block_size
        for i, h in enumerate(event.block_hashes):
            chunk = event.token_ids[i * bs:(i + 1) * bs]
            if len(chunk) != bs:
                break
            parent = chain_key(parent, chunk)
            self._hold(h, medium, parent)

    def _stored_by_hash(self, block_hashes: Sequence[object], medium: str) -> None:
        """Blocks named by hash alone: a tokenmill hash is the block's chained key already."""
        for h in block_hashes:
            if not isinstance(h, int) or isinstance(h, bool) or not -2**63 <= h < 2**63:
                self.unkeyed += 1
                continue
            self._hold(h, medium, digest_of_hash(h))

    def _hold(self, block_hash: object, medium: str, key: bytes) -> None:
        self._by_hash[(_hashable(block_hash), medium)] = key
        self._held.setdefault(key, set()).add(medium)

    def _clear(self) -> None:
        self._held.clear()
        self._by_hash.clear()
        self._recent.clear()

    def clear(self) -> None:
        with self.lock:
            self._clear()

    def note_routed(self, keys: Sequence[bytes], now: float) -> None:
        """A request with these blocks was just sent here: count them until events catch up."""
        with self.lock:
            expiry = now + self.recent_ttl
            for k in keys:
                self._recent[k] = expiry
            if len(self._recent) > 65536:  # drop the expired, keep the map bounded
                self._recent = {k: t for k, t in self._recent.items() if t > now}

    def match(self, keys: Sequence[bytes], now: float | None = None) -> float:
        """Leading blocks of ``keys`` this replica holds (or was just sent), each weighted by
        its best tier: 1 in the pool (or just routed), ``LOWER_TIER_WEIGHT`` in a slower tier."""
        now = time.monotonic() if now is None else now
        score = 0.0
        with self.lock:
            for k in keys:
                media = self._held.get(k)
                if media:
                    score += 1.0 if MEDIUM_POOL in media else LOWER_TIER_WEIGHT
                elif self._recent.get(k, 0.0) > now:
                    score += 1.0
                else:
                    break
        return score


def _hashable(h: object) -> object:
    return bytes(h) if isinstance(h, (bytearray, memoryview)) else h


class RoutingIndex:
    """A backend's index for routing: the event index while its stream is alive, else the
    approximate one. Keeps PrefixIndex's interface, so the policies need not know."""

    def __init__(self, approx: PrefixIndex, events: EventIndex, stale_after: float = 10.0) -> None:
        self.approx = approx
        self.events = events
        self.stale_after = stale_after
        self.last_event_at: float | None = None
        self._unanswered_since: float | None = None  # first request routed here since the last event

    # PrefixIndex's interface --------------------------------------------
    @property
    def capacity_blocks(self) -> int:
        return self.approx.capacity_blocks

    def __len__(self) -> int:
        return len(self.events) if self.live() else len(self.approx)

    def resize(self, capacity_blocks: int) -> None:
        self.approx.resize(capacity_blocks)

    def clear(self) -> None:
        """A restart seen by health checks or counters: the guess is void. The event index is
        not: the stream itself says when the replica restarted (its sequence goes back), and
        a replica that restored blocks from disk announces them again."""
        self.approx.clear()

    def insert(self, keys: Sequence[bytes]) -> None:
        now = time.monotonic()
        self.approx.insert(keys)
        self.events.note_routed(keys, now)
        if self._unanswered_since is None:
            self._unanswered_since = now

    def match(self, keys: Sequence[bytes]) -> float:
        return self.events.match(keys) if self.live() else self.approx.match(keys)

    # events -------------------------------------------------------------
    def on_batch(self, batch: EventBatch) -> None:
        self.events.apply(batch)
        self.last_event_at = time.monotonic()
        self._unanswered_since = None

    def live(self, now: float | None = None) -> bool:
        """Events have arrived, in this block size, and have not gone quiet while requests
        were being sent here."""
        if self.last_event_at is None or self.events.mismatched_block_size is not None:
            return False
        now = time.monotonic() if now is None else now
        return self._unanswered_since is None or now - self._unanswered_since < self.stale_after

    @property
    def source(self) -> str:
        return "events" if self.live() else "approximate"


class EventSubscriber:
    """Follows one replica's KV event stream into its RoutingIndex (its own thread)."""

    def __init__(self, index: RoutingIndex, endpoint: str, replay_endpoint: str | None = None,
                 topic: str = "", curve: CurveKeys | None = None) -> None:
        self.index = index
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.curve = curve  # the router's keys and the replica's public key, when it admits by key
        self.topic = topic.encode()
        self.last_seq: int | None = None
        self.restarts = 0  # times the sequence went back (the replica restarted)
        self.gaps = 0
        self.bad_payloads = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-events {endpoint}", daemon=True)

    def start(self) -> "EventSubscriber":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)

    def handle(self, seq: int, payload: bytes) -> None:
        """Apply one numbered batch (the thread's step; tests call it directly)."""
        if self.last_seq is not None and seq <= self.last_seq:
            if seq == self.last_seq:
                return  # a replayed duplicate
            self.restarts += 1  # the sequence went back: a new publisher, an empty cache
            log.info("KV events from %s restarted at %d (was %d): clearing its index", self.endpoint, seq,
                     self.last_seq)
            self.index.events.clear()
        elif seq > (first := 0 if self.last_seq is None else self.last_seq + 1):
            self.gaps += 1
            if not self._replay(first, seq):
                if self.last_seq is not None:  # a hole in what we know: start over from here
                    log.warning("KV events from %s: batches %d..%d missed and not replayed; clearing its index",
                                self.endpoint, first, seq - 1)
                    self.index.events.clear()
        try:
            batch = decode_batch(payload)
        except ValueError as exc:
            self.bad_payloads += 1
            log.warning("KV events from %s: %s", self.endpoint, exc)
            self.last_seq = seq
            return
        self.index.on_batch(batch)
        self.last_seq = seq

    def _replay(self, first: int, upto: int) -> bool:
        """Ask the replay socket for batches ``first..upto-1``; True when all came."""
        if not self.replay_endpoint:
            return False
        import zmq

        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            curve_client(sock, self.curve)
        got = set()
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart((b"", first.to_bytes(8, "big")))
            while sock.poll(2000):
                frames = sock.recv_multipart()
                if len(frames) < 3:
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq < 0:
                    break
                if first <= seq < upto:
                    try:
                        self.index.on_batch(decode_batch(frames[2]))
                    except ValueError:
                        self.bad_payloads += 1
                    got.add(seq)
        finally:
            sock.close()
        return len(got) == upto - first

    def _run(self) -> None:
        import zmq

        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            curve_client(sock, self.curve)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic)
        sock.connect(self.endpoint)
        try:
            while not self._stop.is_set():
                if not sock.poll(200):
                    continue
                frames = sock.recv_multipart()
                if len(frames) != 3:
                    self.bad_payloads += 1
                    continue
                _, seq_bytes, payload = frames
                try:
                    self.handle(int.from_bytes(seq_bytes, "big"), payload)
                except Exception:  # noqa: BLE001 - one bad batch must not stop the stream
                    log.exception("KV events from %s: batch failed", self.endpoint)
        finally:
            sock.close()

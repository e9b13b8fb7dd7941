"""KV events: the prefix cache's record, the wire format (vLLM's), the ZeroMQ stream, and the
router's index that replays them.

The central property: replaying a replica's events into the router's EventIndex gives exactly
the block keys of every path in that replica's prefix cache, whatever the workload did
(arrivals, shared prefixes, aborts, evictions under pressure, resets).
"""
from __future__ import annotations

import hashlib
import socket
import time

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_cache_properties import BLOCK, Sim, prefixes, request_st
from tokenmill.traffic.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, chain_hash, decode_batch,
                                 encode_batch, without_token_ids)
from tokenmill.router.cache.kv_index import EventIndex, EventSubscriber, RoutingIndex
from tokenmill.router.cache.prefix_index import PrefixIndex, block_hashes


def _cached_paths(cache) -> set[bytes]:
    """The router keys of every block the prefix cache holds (walk its tree)."""
    keys: set[bytes] = set()
    stack = [(cache.root, [])]
    while stack:
        node, tokens = stack.pop()
        for child in node.children.values():
            path = tokens + list(child.key)
            keys.add(block_hashes(path, BLOCK)[-1])
            stack.append((child, path))
    return keys


def _replay(index: EventIndex, events, token_ids: bool = True) -> None:
    if events:  # through the wire format, as a subscriber gets them
        batch = EventBatch(time.time(), events)
        index.apply(decode_batch(encode_batch(batch if token_ids else without_token_ids(batch))))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shared=st.lists(prefixes, min_size=4, max_size=4), requests=st.lists(request_st, min_size=1, max_size=12),
       num_blocks=st.integers(4, 40), budget=st.integers(1, 24), max_seqs=st.integers(1, 6),
       reset_at=st.one_of(st.none(), st.integers(0, 12)))
def test_replayed_events_hold_exactly_the_cached_blocks(shared, requests, num_blocks, budget, max_seqs, reset_at):
    sim = Sim(num_blocks, caching=True, budget=budget, max_seqs=max_seqs)
    sim.cache.enable_events()
    index = EventIndex(block_size=BLOCK)
    by_hash = EventIndex(block_size=BLOCK)  # the same stream with blocks named by hash alone
    pending = sorted(enumerate(requests), key=lambda r: r[1][3])
    for step in range(60):
        for i, (which, suffix, max_tokens, arrive, _) in list(pending):
            if arrive <= step:
                sim.add(f"r{i}", shared[which] + suffix, max_tokens)
                pending.remove((i, (which, suffix, max_tokens, arrive, _)))
        for i, (*_, abort_at) in enumerate(requests):
            if abort_at == step:
                for req in sim.active:
                    if req.request_id == f"r{i}" and not req.is_finished:
                        sim.sched.abort(req)
        if sim.sched.has_work():
            sim.step(step % 3)
        if reset_at == step:
            for block in sim.cache.evict_all_idle():
                sim.pool.return_evicted(block)
        events = sim.cache.drain_events()
        _replay(index, events)
        _replay(by_hash, events, token_ids=False)
        assert set(index._held) == _cached_paths(sim.cache), f"step {step}: the index and the cache differ"
        assert set(by_hash._held) == _cached_paths(sim.cache), f"step {step}: hashes alone differ"
        if not pending and not sim.sched.has_work():
            break


def test_store_and_remove_events_name_blocks_by_their_path():
    sim = Sim(num_blocks=6, caching=True, budget=64, max_seqs=2)
    sim.cache.enable_events()
    prompt = list(range(1, 2 * BLOCK + 2))  # two full blocks and a partial one
    sim.add("a", prompt, 1)
    sim.drain(20)
    events = sim.cache.drain_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored and stored[0].parent_block_hash is None and stored[0].block_size == BLOCK
    first = chain_hash(None, prompt[:BLOCK])
    assert stored[0].block_hashes[0] == first
    assert stored[0].token_ids[:BLOCK] == prompt[:BLOCK]
    # A reset removes every idle block, then says the cache is empty.
    for block in sim.cache.evict_all_idle():
        sim.pool.return_evicted(block)
    after = sim.cache.drain_events()
    removed = [h for e in after if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert first in removed and isinstance(after[-1], AllBlocksCleared)
    assert sim.cache.drain_events() == []


def test_no_events_are_recorded_unless_asked():
    sim = Sim(num_blocks=6, caching=True, budget=64, max_seqs=2)
    sim.add("a", list(range(1, 3 * BLOCK)), 1)
    sim.drain(20)
    assert sim.cache.events is None and sim.cache.drain_events() == []


def test_wire_format_is_vllms_array_layout_and_round_trips():
    batch = EventBatch(12.5, [BlockStored([7, 8], None, list(range(2 * BLOCK)), BLOCK),
                              BlockRemoved([7]), AllBlocksCleared()])
    raw = msgpack.unpackb(encode_batch(batch), raw=False)
    assert raw[0] == 12.5 and len(raw) == 2  # data_parallel_rank omitted when None
    assert raw[1][0] == ["BlockStored", [7, 8], None, list(range(2 * BLOCK)), BLOCK, None, "GPU", None]
    assert raw[1][1] == ["BlockRemoved", [7], "GPU"] and raw[1][2] == ["AllBlocksCleared"]
    assert decode_batch(encode_batch(batch)).events == batch.events


def _vllm_recorded_stream() -> list[tuple[int, bytes]]:
    """A recorded stream as a vLLM pod writes it (msgspec structs, array_like, tag first; block
    hashes are SHA-256 digests as bytes; 7-field BlockStored of older releases, map-tagged events
    of newer ones, a data_parallel_rank on one batch)."""
    def h(*parts) -> bytes:
        return hashlib.sha256(repr(parts).encode()).digest()

    a, b, c = h("a"), h("a", "b"), h("x")
    toks = list(range(100, 100 + 3 * 16))
    batches = [
        [1.0, [["BlockStored", [a, b], None, toks[:32], 16, None, "GPU"]]],
        [2.0, [{"type": "BlockStored", "block_hashes": [c], "parent_block_hash": b, "token_ids": toks[32:48],
                "block_size": 16, "lora_id": None, "medium": "CPU", "lora_name": None}], 0],
        [3.0, [["BlockRemoved", [b], "GPU"]]],
    ]
    return [(seq, msgpack.packb(batch, use_bin_type=True)) for seq, batch in enumerate(batches)]


def test_a_recorded_vllm_stream_drives_the_precise_index():
    index = RoutingIndex(PrefixIndex(1024), EventIndex(block_size=16))
    sub = EventSubscriber(index, "tcp://127.0.0.1:1")  # never started: batches handed in directly
    toks = list(range(100, 100 + 3 * 16))
    keys = block_hashes(toks, 16)
    stream = _vllm_recorded_stream()
    for seq, payload in stream[:2]:
        sub.handle(seq, payload)
    # all three blocks held: two in the pool, the third only in the slower (CPU) tier
    assert index.live() and index.match(keys) == pytest.approx(2.5)
    sub.handle(*stream[2])  # the GPU copy of block 2 is evicted: the prefix now breaks after block 1
    assert index.events.match(keys) == pytest.approx(1.0)
    assert sub.bad_payloads == 0 and sub.gaps == 0


def test_subscriber_clears_on_restart_and_on_an_unreplayable_gap():
    index = RoutingIndex(PrefixIndex(1024), EventIndex(block_size=BLOCK))
    sub = EventSubscriber(index, "tcp://127.0.0.1:1")
    toks = list(range(1, 1 + BLOCK))
    stored = encode_batch(EventBatch(0.0, [BlockStored([5], None, toks, BLOCK)]))
    sub.handle(0, stored)
    assert index.events.match(block_hashes(toks, BLOCK), now=0.0) == 1
    sub.handle(3, encode_batch(EventBatch(0.0, [])))  # batches 1-2 lost, no replay socket
    assert sub.gaps == 1 and len(index.events) == 0
    sub.handle(4, stored)
    sub.handle(0, encode_batch(EventBatch(0.0, [])))  # the sequence went back: a new process
    assert sub.restarts == 1 and len(index.events) == 0


def test_routing_index_falls_back_when_events_go_quiet():
    approx = PrefixIndex(1024)
    index = RoutingIndex(approx, EventIndex(block_size=BLOCK), stale_after=5.0)
    keys = block_hashes(list(range(2 * BLOCK)), BLOCK)
    assert not index.live() and index.source == "approximate"
    index.insert(keys)  # before any event: the approximate index answers
    assert index.match(keys) == 2
    index.on_batch(EventBatch(0.0, []))
    assert index.live()
    index.events._recent.clear()  # the routed blocks were never confirmed by events ...
    assert index.match(keys) == 0  # ... and events are the truth while they flow
    index.insert(keys)
    assert index.live(now=time.monotonic() + 1.0)
    assert not index.live(now=time.monotonic() + 6.0)  # requests sent, nothing heard: stale


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_zmq_publisher_to_subscriber_with_replay_of_missed_batches():
    from tokenmill.engine.kv.kv_event_publisher import KVEventsConfig, ZmqEventPublisher

    pub_ep, replay_ep = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    publisher = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=pub_ep,
                                                 replay_endpoint=replay_ep))
    index = RoutingIndex(PrefixIndex(1024), EventIndex(block_size=BLOCK))
    try:
        chains = [list(range(10 * i, 10 * i + BLOCK)) for i in range(3)]
        names = [chain_hash(None, toks) for toks in chains]  # the default stream names blocks by these alone
        # Published before anyone subscribes: only the replay socket can bring these back.
        for i, toks in enumerate(chains[:2]):
            publisher.publish(EventBatch(0.0, [BlockStored([names[i]], None, toks, BLOCK)]))
        time.sleep(0.3)
        sub = EventSubscriber(index, pub_ep, replay_ep).start()
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                publisher.publish(EventBatch(0.0, [BlockStored([names[2]], None, chains[2], BLOCK)]))
                time.sleep(0.2)
                if all(index.events.match(block_hashes(t, BLOCK)) == 1 for t in chains):
                    break
            assert all(index.events.match(block_hashes(t, BLOCK)) == 1 for t in chains), (sub.gaps, sub.last_seq)
            assert sub.gaps >= 1  # the first batches arrived through the replay socket
        finally:
            sub.stop()
    finally:
        publisher.close()


def test_kv_events_config_is_vllms_and_refuses_unknown_keys():
    from tokenmill.engine.kv.kv_event_publisher import KVEventsConfig

    assert KVEventsConfig.parse(None) is None
    assert KVEventsConfig.parse('{"enable_kv_cache_events": false}') is None
    cfg = KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "zmq", '
                               '"endpoint": "tcp://127.0.0.1:5557", "topic": "kv"}')
    assert cfg is not None and cfg.topic == "kv"
    with pytest.raises(ValueError, match="unknown key"):
        KVEventsConfig.parse('{"enable_kv_cache_events": true, "endpont": "tcp://x:1"}')
    with pytest.raises(ValueError, match="buffer_steps"):
        KVEventsConfig.parse('{"enable_kv_cache_events": true, "buffer_steps": 0}')


# -- session affinity -------------------------------------------------------------------------

def test_session_keys_and_response_ids():
    from tokenmill.router.sessions import ResponseIdSniffer, response_id_of_body, session_key

    assert session_key({"x-session-id": "abc"}, {"user": "u"}) == "session:abc"
    assert session_key({}, {"previous_response_id": "resp_1", "user": "u"}) == "response:resp_1"
    assert session_key({}, {"user": "u"}) == "user:u"
    assert session_key({}, {"prompt": "x"}) is None and session_key({}, None) is None
    sniffer = ResponseIdSniffer()  # the id once its event's line is whole, however the chunks split it
    assert sniffer.feed(b'event: response.created\ndata: {"type":"response.created","response":{"id":"resp_9f"') \
        is None
    assert sniffer.feed(b',"object":"response"}}\n\n') == "resp_9f"
    assert response_id_of_body(b'{"id": "resp_1", "object": "response"}') == "resp_1"
    assert response_id_of_body(b'{"id": "chatcmpl-1", "object": "chat.completion"}') is None


def _router(urls):
    from tokenmill.router.config import RouterConfig
    from tokenmill.router.core import Router

    router = Router(RouterConfig(backends=urls, remote_tokenize=False))
    for b in router.pool.backends.values():
        b.healthy = True
    return router


def test_a_session_stays_home_until_its_replica_is_overloaded_or_gone_then_moves_once():
    import asyncio

    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(3)]
    router = _router(urls)

    async def send(session, text="hello there " * 20):
        d = await router.route("/v1/completions", {"prompt": text}, session=session)
        router.release(d.backend)
        return d

    async def go():
        first = await send("session:a")
        homes = {(await send("session:a", f"turn {i} " * 30)).backend.url for i in range(10)}
        assert homes == {first.backend.url}  # every later turn, whatever its prompt, went home
        assert router.sessions.kept == 10
        home = router.pool.backends[first.backend.url]
        home.in_flight = 50  # overloaded: the session moves ...
        moved = await send("session:a")
        assert moved.backend.url != home.url and router.sessions.moved == 1
        home.in_flight = 0  # ... and stays at its new home, not back
        assert (await send("session:a")).backend.url == moved.backend.url
        router.pool.backends[moved.backend.url].healthy = False  # its replica leaves: it moves again
        assert (await send("session:a")).backend.url != moved.backend.url

    asyncio.run(go())

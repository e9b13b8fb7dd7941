"""KV events stay private unless configured otherwise: what a subscriber on the publisher's
socket reads (block hashes, no prompt token ids, by default), which endpoints may be bound
(no wildcard without ``allow_wildcard_bind``), and a config whose values must have their JSON
types (``"false"`` never turns events on). Checked on a real ZeroMQ SUB socket and through
``tokenmill serve``'s own argument checks (a subprocess that must stop before loading a model)."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import msgpack
import pytest

from fake_backend import free_port
from tokenmill.engine.kv_event_publisher import KVEventsConfig, ZmqEventPublisher, is_wildcard_host
from tokenmill.kv_events import BlockStored, EventBatch, chain_hash

BLOCK = 16
PROMPT = list(range(500, 500 + 2 * BLOCK))


def _first_batch(config: KVEventsConfig) -> list:
    """Publish one stored path and read it back raw (msgpack) on a SUB socket on loopback."""
    import zmq

    publisher = ZmqEventPublisher(config)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(config.endpoint)
    first = chain_hash(None, PROMPT[:BLOCK])
    batch = EventBatch(1.0, [BlockStored([first, chain_hash(first, PROMPT[BLOCK:])], None, PROMPT, BLOCK)])
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # a SUB socket misses what was sent before it joined
            publisher.publish(batch)
            if sub.poll(200):
                _, _, payload = sub.recv_multipart()
                return msgpack.unpackb(payload, raw=False)
        raise AssertionError("no KV event batch arrived on loopback")
    finally:
        sub.close()
        publisher.close()


def test_default_stream_names_blocks_without_the_prompts_token_ids():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    raw = _first_batch(KVEventsConfig.parse({"enable_kv_cache_events": True, "endpoint": endpoint}))
    stored = raw[1][0]
    assert stored[0] == "BlockStored" and stored[1] == [chain_hash(None, PROMPT[:BLOCK]),
                                                        chain_hash(chain_hash(None, PROMPT[:BLOCK]), PROMPT[BLOCK:])]
    assert stored[3] == []  # the token ids field is empty
    assert not set(PROMPT) & {x for x in _flatten(raw) if isinstance(x, int)}


def test_token_ids_are_published_only_when_asked():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    raw = _first_batch(KVEventsConfig.parse({"enable_kv_cache_events": True, "endpoint": endpoint,
                                             "include_token_ids": True}))
    assert raw[1][0][3] == PROMPT


def _flatten(value):
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _flatten(item)
    else:
        yield value


def test_the_default_endpoint_is_loopback():
    assert KVEventsConfig().endpoint.startswith("tcp://127.0.0.1:")


@pytest.mark.parametrize("key", ["endpoint", "replay_endpoint"])
@pytest.mark.parametrize("endpoint", ["tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://[::]:5557", "tcp://:5557",
                                      "tcp://[0:0:0:0:0:0:0:0]:5557"])
def test_a_wildcard_bind_is_refused_unless_allowed(key, endpoint):
    config = {"enable_kv_cache_events": True, key: endpoint}
    with pytest.raises(ValueError, match=f"--kv-events-config: {key} .*allow_wildcard_bind"):
        KVEventsConfig.parse(config)
    allowed = KVEventsConfig.parse({**config, "allow_wildcard_bind": True})
    assert allowed is not None and getattr(allowed, key) == endpoint


@pytest.mark.parametrize("address", ["127.0.0.1:5557", "10.1.2.3:5557", "[::1]:5557", "eth0:5557"])
def test_one_interface_is_not_a_wildcard(address):
    assert not is_wildcard_host(address)


@pytest.mark.parametrize("field,value,what", [
    ("enable_kv_cache_events", "false", "a JSON boolean"), ("enable_kv_cache_events", "true", "a JSON boolean"),
    ("enable_kv_cache_events", 1, "a JSON boolean"), ("include_token_ids", "yes", "a JSON boolean"),
    ("allow_wildcard_bind", "true", "a JSON boolean"), ("hwm", "100", "an integer"), ("buffer_steps", True, "an integer"),
    ("topic", 5, "a string"), ("replay_endpoint", 5558, "a string or null")])
def test_values_must_have_their_json_type(field, value, what):
    with pytest.raises(ValueError, match=f"--kv-events-config: {field} must be {what}"):
        KVEventsConfig.parse({"enable_kv_cache_events": True, field: value} if field != "enable_kv_cache_events"
                             else {field: value})


def _serve(config: dict) -> subprocess.CompletedProcess:
    """``tokenmill serve`` with this events config: each one here is refused before a model loads."""
    return subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--port", str(free_port()),
                           "--kv-events-config", json.dumps(config)], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("config,needle", [
    ({"enable_kv_cache_events": "false"}, "enable_kv_cache_events must be a JSON boolean"),
    ({"enable_kv_cache_events": True, "endpoint": "tcp://*:5557"}, "allow_wildcard_bind"),
    ({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:5557", "include_token_id": True},
     "unknown key(s) include_token_id")])
def test_serve_refuses_a_bad_events_config_in_one_line(config, needle):
    proc = _serve(config)
    assert proc.returncode != 0
    assert needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]

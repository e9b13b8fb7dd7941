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
from tokenmill.engine.kv.kv_event_publisher import KVEventsConfig, ZmqEventPublisher, is_wildcard_host
from tokenmill.traffic.kv_events import BlockStored, EventBatch, chain_hash

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
    return subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli.main", "serve", "--port", str(free_port()),
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


# -- subscribers admitted by CURVE key ------------------------------------------------------

@pytest.fixture
def curve_files(tmp_path):
    """Certificates of a replica, a router it admits and a stranger it does not."""
    import zmq
    import zmq.auth

    if not zmq.has("curve"):
        pytest.skip("this pyzmq has no CURVE")
    made = {name: zmq.auth.create_certificates(tmp_path, name) for name in ("replica", "router", "stranger")}
    admitted = tmp_path / "admitted"
    admitted.mkdir()
    (admitted / "router.key").write_bytes(open(made["router"][0], "rb").read())
    return {"replica_secret": made["replica"][1], "replica_public": made["replica"][0],
            "router_secret": made["router"][1], "stranger_secret": made["stranger"][1], "admitted": str(admitted)}


def _sub(endpoint: str, keys=None):
    import zmq

    from tokenmill.traffic.kv_events import curve_client

    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    if keys is not None:
        curve_client(sock, keys)
    sock.connect(endpoint)
    return sock


def test_with_curve_keys_only_admitted_subscribers_read_the_stream(curve_files):
    from tokenmill.traffic.kv_events import CurveKeys, load_curve_pair, load_curve_public
    from tokenmill.router.cache.kv_index import EventIndex, EventSubscriber, RoutingIndex
    from tokenmill.router.cache.prefix_index import PrefixIndex, block_hashes

    endpoint, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    config = KVEventsConfig.parse({"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay,
                                   "curve_secret_key_file": curve_files["replica_secret"],
                                   "curve_authorized_keys_dir": curve_files["admitted"]})
    server = load_curve_public(curve_files["replica_public"], "replica")
    router_pair = load_curve_pair(curve_files["router_secret"], "router")
    stranger_pair = load_curve_pair(curve_files["stranger_secret"], "stranger")
    publisher = ZmqEventPublisher(config)
    index = RoutingIndex(PrefixIndex(1024), EventIndex(block_size=BLOCK))
    plain = _sub(endpoint)
    stranger = _sub(endpoint, CurveKeys(stranger_pair.public, stranger_pair.secret, server))
    first = chain_hash(None, PROMPT[:BLOCK])
    try:
        # published before the router subscribes: only the (authenticated) replay socket brings it back
        publisher.publish(EventBatch(0.0, [BlockStored([first], None, PROMPT[:BLOCK], BLOCK)]))
        time.sleep(0.3)
        sub = EventSubscriber(index, endpoint, replay,
                              curve=CurveKeys(router_pair.public, router_pair.secret, server)).start()
        keys = block_hashes(PROMPT, BLOCK)
        try:
            deadline = time.monotonic() + 20
            while index.events.match(keys, now=0.0) < 2 and time.monotonic() < deadline:
                publisher.publish(EventBatch(0.0, [BlockStored([chain_hash(first, PROMPT[BLOCK:])], first,
                                                               PROMPT[BLOCK:], BLOCK)]))
                time.sleep(0.2)
            assert index.events.match(keys, now=0.0) == 2, (sub.gaps, sub.last_seq)
            assert sub.gaps >= 1  # the first batch came through the replay socket
        finally:
            sub.stop()
        for _ in range(5):  # still publishing: the others have had every chance to connect
            publisher.publish(EventBatch(0.0, []))
            time.sleep(0.1)
        assert not plain.poll(500) and not stranger.poll(500)
    finally:
        plain.close()
        stranger.close()
        publisher.close()


def test_curve_settings_are_checked_before_anything_starts(curve_files, tmp_path):
    base = {"enable_kv_cache_events": True}
    with pytest.raises(ValueError, match="go together"):
        KVEventsConfig.parse({**base, "curve_secret_key_file": curve_files["replica_secret"]})
    with pytest.raises(ValueError, match="no such folder"):
        KVEventsConfig.parse({**base, "curve_secret_key_file": curve_files["replica_secret"],
                              "curve_authorized_keys_dir": str(tmp_path / "none")})
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no subscriber's public certificate"):
        KVEventsConfig.parse({**base, "curve_secret_key_file": curve_files["replica_secret"],
                              "curve_authorized_keys_dir": str(empty)})
    with pytest.raises(ValueError, match="holds no secret key"):
        KVEventsConfig.parse({**base, "curve_secret_key_file": curve_files["replica_public"],
                              "curve_authorized_keys_dir": curve_files["admitted"]})
    junk = tmp_path / "junk.key_secret"
    junk.write_text("not a certificate")
    with pytest.raises(ValueError, match="not a ZeroMQ certificate"):
        KVEventsConfig.parse({**base, "curve_secret_key_file": str(junk),
                              "curve_authorized_keys_dir": curve_files["admitted"]})


def test_the_router_needs_both_curve_files(curve_files):
    from tokenmill.router.config import RouterConfig

    cfg = RouterConfig(backends=["http://127.0.0.1:1"], prefix_source="events",
                       kv_events={"http://127.0.0.1:1": ("tcp://127.0.0.1:2", None)},
                       kv_events_client_key=curve_files["router_secret"])
    with pytest.raises(ValueError, match="go together"):
        cfg.validate()
    cfg.kv_events_server_key = curve_files["replica_public"]
    cfg.validate()
    keys = cfg.kv_events_curve()
    assert keys is not None and keys.server_public and keys.secret

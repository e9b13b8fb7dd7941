"""Publishes the prefix cache's changes as KV events over ZeroMQ, as vLLM does.

The engine thread only moves the events its prefix cache recorded in a step
onto a queue (``on_step``); a publisher thread encodes each batch
(``kv_events.encode_batch``), numbers it and sends it on a PUB socket, and
keeps the last ``buffer_steps`` batches so a subscriber that missed some can
ask a ROUTER socket to replay them from a sequence number. Nothing is recorded
or sent unless events are configured (``--kv-events-config``).

What is sent is private by default (``KVEventsConfig``): loopback endpoints,
no wildcard bind unless allowed, block hashes without the prompts' token ids
unless asked.

The PUB and replay endpoints are always bound here (the replica is the stable
side; routers connect), so a subscriber started before or after the replica
works the same.
"""
from __future__ import annotations

import glob
import ipaddress
import json
import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Any, get_type_hints

from ...traffic.kv_events import END_SEQ, CurveKeys, EventBatch, encode_batch, load_curve_pair, without_token_ids

log = logging.getLogger("tokenmill.traffic.kv_events")


_FLAG = "--kv-events-config"
# Hosts that bind every interface of the machine.
_WILDCARD_HOSTS = ("", "*")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` keys plus tokenmill's privacy keys; unknown keys are
    refused and every value must have its JSON type (``"false"`` is not a boolean).

    Events describe prompts, and the ZeroMQ sockets take any subscriber that can reach
    them, so by default they stay private: the endpoints bind loopback, a wildcard bind
    needs ``allow_wildcard_bind``, and blocks are named by hash without their token ids
    unless ``include_token_ids``."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"  # zmq | null
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    include_token_ids: bool = False  # publish the prompts' token ids (vLLM does; a privacy cost)
    allow_wildcard_bind: bool = False  # let an endpoint bind every interface (tcp://*, 0.0.0.0, [::])
    # CURVE (traffic/kv_events.py): this replica's .key_secret certificate and the folder of the public
    # certificates of the subscribers it admits; both or neither.
    curve_secret_key_file: str | None = None
    curve_authorized_keys_dir: str | None = None

    @classmethod
    def parse(cls, text: str | dict | None) -> "KVEventsConfig | None":
        """The config from JSON text (or a dict); None when events are off. Raises ValueError
        whose message starts with the flag's name and names the offending key."""
        if text is None:
            return None
        raw = json.loads(text) if isinstance(text, str) else dict(text)
        if not isinstance(raw, dict):
            raise ValueError(f"{_FLAG}: expected a JSON object")
        _check_types(raw)
        config = cls(**raw)
        if config.publisher not in ("zmq", "null"):
            raise ValueError(f"{_FLAG}: publisher must be 'zmq' or 'null'")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(config, name) < 1:
                raise ValueError(f"{_FLAG}: {name} must be a positive integer")
        for name in ("endpoint", "replay_endpoint"):
            _check_endpoint(name, getattr(config, name), config.allow_wildcard_bind)
        config.curve_keys()
        return config if config.enable_kv_cache_events and config.publisher != "null" else None

    def curve_keys(self) -> "CurveKeys | None":
        """The replica's key pair when subscribers must authenticate (None: anyone who can
        reach the endpoints may subscribe). Raises ValueError on a half or bad setting."""
        secret, folder = self.curve_secret_key_file, self.curve_authorized_keys_dir
        if secret is None and folder is None:
            return None
        if secret is None or folder is None:
            raise ValueError(f"{_FLAG}: curve_secret_key_file and curve_authorized_keys_dir go together")
        if not os.path.isdir(folder):
            raise ValueError(f"{_FLAG}: curve_authorized_keys_dir {folder}: no such folder")
        if not glob.glob(os.path.join(folder, "*.key")):
            raise ValueError(f"{_FLAG}: curve_authorized_keys_dir {folder}: no subscriber's public "
                             "certificate (*.key) in it")
        return load_curve_pair(secret, f"{_FLAG}: curve_secret_key_file")


def _check_types(raw: dict) -> None:
    """Every key known, every value of its field's JSON type."""
    hints = get_type_hints(KVEventsConfig)
    known = {f.name for f in fields(KVEventsConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{_FLAG}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    for name, value in raw.items():
        kind = hints[name]
        if kind is bool:
            ok, what = isinstance(value, bool), "a JSON boolean (true or false)"
        elif kind is int:
            ok, what = isinstance(value, int) and not isinstance(value, bool), "an integer"
        elif kind is str:
            ok, what = isinstance(value, str), "a string"
        else:  # str | None
            ok, what = value is None or isinstance(value, str), "a string or null"
        if not ok:
            raise ValueError(f"{_FLAG}: {name} must be {what}, got {json.dumps(value)[:60]}")


def _check_endpoint(name: str, endpoint: str | None, allow_wildcard: bool) -> None:
    if endpoint is None:
        return
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"{_FLAG}: {name} must be a tcp://, ipc:// or inproc:// address")
    if endpoint.startswith("tcp://") and not allow_wildcard and is_wildcard_host(endpoint[len("tcp://"):]):
        raise ValueError(f"{_FLAG}: {name} {endpoint} binds every interface, so anyone who can reach this "
                         "machine can subscribe to the events; bind 127.0.0.1 or one private address, or "
                         'set "allow_wildcard_bind": true')


def is_wildcard_host(address: str) -> bool:
    """Whether a ZeroMQ tcp bind address (``host:port``) binds every interface: ``*``, an empty
    host, or an unspecified IP (``0.0.0.0``, ``::``, bracketed or not)."""
    host = address.rsplit(":", 1)[0] if ":" in address else address
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host in _WILDCARD_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False  # an interface name or a host name: one interface


class ZmqEventPublisher:
    """A PUB socket fed from a queue by its own thread, with a replay buffer."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int | None = None) -> None:
        import zmq

        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self._queue: "queue.Queue[EventBatch | None]" = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        keys = config.curve_keys()
        # A context of its own: its authenticator then vets this publisher's sockets only.
        self._ctx = zmq.Context()
        self._auth = _start_authenticator(self._ctx, config) if keys is not None else None
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        _serve_curve(self._pub, keys)
        self._pub.bind(config.endpoint)
        self._replay = None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            _serve_curve(self._replay, keys)
            self._replay.bind(config.replay_endpoint)
        if keys is None:
            _warn_if_reachable(config)
        self._topic = config.topic.encode()
        self._next_seq = 0
        self.dropped_batches = 0
        self._running = True
        self._thread = threading.Thread(target=self._run, name="tokenmill-kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: EventBatch) -> None:
        """Queue a batch (any thread). A full queue drops it and says so: the engine never waits."""
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped_batches += 1
            if self.dropped_batches == 1:
                log.error("KV event queue full (%d batches): dropping events; subscribers' views go stale",
                          self.config.max_queue_size)

    def on_step(self, engine: Any, deltas: Any) -> None:
        """The AsyncEngine hook: publish what the prefix cache recorded in this step."""
        events = engine.prefix_cache.drain_events()
        if events:
            self.publish(EventBatch(time.time(), events))

    def _run(self) -> None:
        while self._running or not self._queue.empty():
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:  # noqa: BLE001 - a bad replay request must not stop publishing
                    log.exception("KV event replay failed")
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                break
            payload = encode_batch(batch if self.config.include_token_ids else without_token_ids(batch))
            seq = self._next_seq
            self._next_seq += 1
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ.to_bytes(8, "big", signed=True), b""))

    def close(self, timeout: float = 1.0) -> None:
        self._running = False
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        if not self._thread.is_alive():  # a thread still sending would block the context's end
            self._ctx.term()


def _start_authenticator(ctx: Any, config: KVEventsConfig) -> Any:
    """ZeroMQ's authenticator on ``ctx``: CURVE clients whose public key is in the folder."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx, log=log)
    auth.start()
    auth.configure_curve(domain="*", location=config.curve_authorized_keys_dir)
    return auth


def _serve_curve(socket: Any, keys: CurveKeys | None) -> None:
    if keys is not None:
        socket.curve_secretkey = keys.secret
        socket.curve_publickey = keys.public
        socket.curve_server = True


def _warn_if_reachable(config: KVEventsConfig) -> None:
    """Say so when events without authentication leave this machine's loopback."""
    for endpoint in filter(None, (config.endpoint, config.replay_endpoint)):
        if endpoint.startswith("tcp://") and not _is_loopback(endpoint[len("tcp://"):]):
            log.warning("KV events on %s: any host that reaches it can subscribe (no CURVE keys; see "
                        "docs/routing.md)%s", endpoint,
                        "; token ids included: subscribers read the prompts" if config.include_token_ids else "")


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def attach_kv_events(async_engine: Any, config: KVEventsConfig) -> ZmqEventPublisher:
    """Turn on event recording in the engine's prefix cache and chain the publisher onto
    ``async_engine.on_step`` (which runs in the engine thread). Call before serving."""
    engine = async_engine.engine
    if engine.prefix_cache is None:
        raise ValueError("--kv-events-config needs prefix caching (it publishes the prefix cache's blocks)")
    publisher = ZmqEventPublisher(config)
    engine.prefix_cache.enable_events()
    previous = async_engine.on_step

    def on_step(eng: Any, deltas: Any) -> None:
        if previous is not None:
            previous(eng, deltas)
        publisher.on_step(eng, deltas)

    async_engine.on_step = on_step
    async_engine.after_call.append(lambda eng: publisher.on_step(eng, None))  # e.g. /reset_prefix_cache
    return publisher

"""KV cache events on the wire, in vLLM's format: what a replica stored, evicted, cleared.

A replica publishes, after each engine step that changed its prefix cache, one
*event batch*: ``[ts, [event, ...], data_parallel_rank?]`` encoded with msgpack
in vLLM's array layout (its msgspec structs with ``array_like=True``; a
struct's trailing fields left at their default are omitted). The events:

- ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name]``: consecutive full blocks of one path, the
  first one's parent given by hash (``None``: the path starts at the root);
  ``token_ids`` holds ``block_size`` ids per block, or nothing when the
  publisher keeps prompts private (tokenmill's default: see below).
- ``["BlockRemoved", block_hashes, medium]``
- ``["AllBlocksCleared"]``

Newer vLLM releases may encode events as maps tagged by ``"type"``; the
decoder takes both. On ZeroMQ a batch travels as ``(topic, seq, payload)``
with ``seq`` an 8-byte big-endian counter; a replay socket answers a request
``(b"", start_seq)`` with every buffered ``(seq, payload)`` from there on and
an end marker ``seq = -1``.

Token ids are the prompts themselves, so a tokenmill replica publishes them
only when asked (``include_token_ids``); by default a block is only named by
its hash. The router keys what a replica holds by the token ids an event
carries when it carries them (any publisher's hashes then work: vLLM's
SHA-256 bytes, tokenmill's 64-bit chain), and otherwise by the hash itself:
tokenmill's hash is ``chain_digest``, the same chained key the router computes
for a request's blocks, so it needs no token ids to line the two up.

This module is a base module: it imports nothing else of tokenmill, so the
engine (which publishes) and the router (which subscribes) share it.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field, replace
from typing import Any, Sequence, Union

BlockHash = Union[int, bytes]

# Where a block lives, as vLLM names its tiers ("GPU": the engine's own pool; "CPU": an
# offload tier). tokenmill's pool is its first tier whatever the device, so it is
# published as "GPU" for subscribers that weigh tiers by these names.
MEDIUM_POOL = "GPU"
MEDIUM_DISK = "DISK"
END_SEQ = -1


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    medium: str | None = MEDIUM_POOL
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[BlockHash]
    medium: str | None = MEDIUM_POOL


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass
class EventBatch:
    ts: float
    events: list[KVEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None


# The parent digest of a path's first block.
ROOT_DIGEST = bytes(8)


def chain_digest(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """A block's 8-byte key: BLAKE2b-64 of its parent's key (``ROOT_DIGEST``, or ``b""``, at
    the root) and its tokens. The engine names blocks by it and the router keys requests by
    it, so a tokenmill replica's block hashes are the router's keys."""
    h = hashlib.blake2b(parent or ROOT_DIGEST, digest_size=8)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def chain_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    """A block's name in events: its ``chain_digest`` as a signed int64."""
    return hash_of_digest(chain_digest(digest_of_hash(parent) if parent is not None else ROOT_DIGEST, token_ids))


def digest_of_hash(block_hash: int) -> bytes:
    """The 8-byte key a tokenmill block hash stands for."""
    return struct.pack("<q", block_hash)


def hash_of_digest(digest: bytes) -> int:
    return struct.unpack("<q", digest)[0]


def without_token_ids(batch: EventBatch) -> EventBatch:
    """The batch with every ``BlockStored`` naming its blocks by hash only (no prompt text)."""
    events = [replace(e, token_ids=[]) if isinstance(e, BlockStored) else e for e in batch.events]
    return EventBatch(batch.ts, events, batch.data_parallel_rank)


def _event_to_wire(event: KVEvent) -> list[Any]:
    if isinstance(event, BlockStored):
        return ["BlockStored", list(event.block_hashes), event.parent_block_hash, list(event.token_ids),
                event.block_size, event.lora_id, event.medium, event.lora_name]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(event.block_hashes), event.medium]
    return ["AllBlocksCleared"]


def encode_batch(batch: EventBatch) -> bytes:
    import msgpack

    wire: list[Any] = [batch.ts, [_event_to_wire(e) for e in batch.events]]
    if batch.data_parallel_rank is not None:
        wire.append(batch.data_parallel_rank)
    return msgpack.packb(wire, use_bin_type=True)


def _field(fields: Sequence[Any] | dict, index: int, name: str, default: Any = None) -> Any:
    if isinstance(fields, dict):
        return fields.get(name, default)
    return fields[index] if index < len(fields) else default


def _event_from_wire(raw: Any) -> KVEvent:
    if isinstance(raw, dict):  # map layout: {"type": "BlockStored", "block_hashes": ...}
        tag, fields = raw.get("type"), raw
    elif isinstance(raw, (list, tuple)) and raw:
        tag, fields = raw[0], list(raw[1:])
    else:
        raise ValueError(f"not a KV event: {raw!r:.80}")
    if isinstance(tag, bytes):
        tag = tag.decode()
    if tag == "BlockStored":
        return BlockStored(block_hashes=list(_field(fields, 0, "block_hashes", [])),
                           parent_block_hash=_field(fields, 1, "parent_block_hash"),
                           token_ids=[int(t) for t in _field(fields, 2, "token_ids", [])],
                           block_size=int(_field(fields, 3, "block_size", 0)),
                           lora_id=_field(fields, 4, "lora_id"),
                           medium=_field(fields, 5, "medium"),
                           lora_name=_field(fields, 6, "lora_name"))
    if tag == "BlockRemoved":
        return BlockRemoved(block_hashes=list(_field(fields, 0, "block_hashes", [])),
                            medium=_field(fields, 1, "medium"))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV event type {tag!r}")


def decode_batch(payload: bytes) -> EventBatch:
    """One batch from its msgpack bytes; raises ValueError on anything else."""
    import msgpack

    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several types
        raise ValueError(f"not msgpack: {exc}") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts", 0.0), raw.get("events", []), raw.get("data_parallel_rank")
    elif isinstance(raw, (list, tuple)) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise ValueError("not a KV event batch")
    if not isinstance(events, list):
        raise ValueError("a KV event batch's events must be a list")
    return EventBatch(float(ts), [_event_from_wire(e) for e in events], rank)


# -- who may subscribe: ZeroMQ CURVE ------------------------------------------------------
# A PUB socket serves anyone who connects. With CURVE the replica holds a key pair, each
# subscriber holds its own, and the replica's authenticator admits only the public keys in
# its folder of allowed subscribers; everything on the wire is encrypted. Keys are ZeroMQ
# certificate files (``zmq.auth.create_certificates``): ``NAME.key`` holds the public key,
# ``NAME.key_secret`` both.


@dataclass(frozen=True)
class CurveKeys:
    """One side's CURVE keys: its own pair and, for a subscriber, the replica's public key."""

    public: bytes
    secret: bytes
    server_public: bytes | None = None


def load_curve_pair(path: str, what: str) -> CurveKeys:
    """A key pair from a ``.key_secret`` certificate; ValueError in one line naming ``what``."""
    public, secret = _load_certificate(path, what)
    if secret is None:
        raise ValueError(f"{what} {path}: holds no secret key (give the .key_secret file)")
    return CurveKeys(public, secret)


def load_curve_public(path: str, what: str) -> bytes:
    """A public key from a ``.key`` (or ``.key_secret``) certificate."""
    return _load_certificate(path, what)[0]


def _load_certificate(path: str, what: str) -> tuple[bytes, bytes | None]:
    import zmq
    import zmq.auth

    if not zmq.has("curve"):
        raise ValueError(f"{what}: this pyzmq's libzmq has no CURVE support (install a pyzmq wheel)")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{what} {path}: not a ZeroMQ certificate ({exc})") from None
    if not public:
        raise ValueError(f"{what} {path}: not a ZeroMQ certificate (no public-key)")
    return public, secret


def curve_client(socket: Any, keys: CurveKeys) -> None:
    """Make ``socket`` a CURVE client of the replica whose public key ``keys`` names."""
    socket.curve_publickey = keys.public
    socket.curve_secretkey = keys.secret
    socket.curve_serverkey = keys.server_public

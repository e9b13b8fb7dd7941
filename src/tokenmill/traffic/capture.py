"""Traffic capture: one JSON line per finished request, for `tokenmill trace analyze`.

Why: sizing and cache tuning need the *shape* of real traffic (lengths, arrival
times, how much of each prompt is shared with earlier prompts), not its text.
So by default we keep block hashes of the prompt instead of the prompt itself;
two prompts share a cached prefix exactly when their leading chained hashes
are equal, which is all the analyser needs.

The server calls, once at start-up (``--capture-traffic FILE``)::

    cap = TrafficCapture(path, capture_text=args.capture_text)

once per finished (or aborted) request::

    cap.record(arrival_time=..., prompt_token_ids=[...], cached_tokens=...,
               output_tokens=..., sampling={...}, ttft=..., e2e=...,
               prompt_text=None, endpoint="chat", request_id=..., finish_reason=...)

and ``cap.close()`` at shutdown. ``record`` is thread-safe, appends one line,
flushes it, and rotates the file by size (``FILE.1`` .. ``FILE.<backups>``).
It never raises into the server: an I/O error is counted and reported once.

Record schema (version 1), one JSON object per line:

- ``v``: 1
- ``arrival_time``: Unix time (float seconds) the request arrived
- ``request_id``: server's id, or null
- ``endpoint``: "completions" | "chat" (whatever the server passes)
- ``prompt_tokens``: number of prompt tokens
- ``cached_tokens``: prompt tokens served from the prefix cache
- ``output_tokens``: generated tokens
- ``sampling``: dict of sampling parameters (max_tokens, temperature, ...)
- ``ttft``: seconds from arrival to first token (null if none was produced)
- ``e2e``: seconds from arrival to the end of the request
- ``finish_reason``: "stop" | "length" | "abort" | ... or null
- ``block_size``: tokens per hashed block (16)
- ``block_hashes``: chained hash of each *full* prompt block, in order:
  ``h[i] = sha256(h[i-1] || token ids of block i)`` (hex, first 16 chars).
  Equal ``h[i]`` means equal prompts up to the end of block i.
- ``block_content_hashes``: hash of each full block's token ids alone (not
  chained). Lets the analyser see content shared *after* a unique block, e.g.
  a system prompt that follows a timestamp.
- ``key_id``: a short fingerprint of the hash key (null when unkeyed): hashes
  are comparable between records with the same ``key_id`` only
- ``prompt_text``: the prompt text, present only with ``capture_text=True``
- ``session``: present when the client named its conversation (``x-session-id``
  header): a keyed hash of that name (like the block hashes, comparable only
  under one ``key_id``), so a replay can keep the turns of one conversation
  together, in order, each after the previous answer and its think time
- ``miss_reason``, ``miss_offset``: why the prompt missed cache it could have reused and the
  token offset where reuse stopped (``traffic/cache_misses.py``), present only for such requests

Nothing the client typed is stored unless ``capture_text=True``: not the
prompt, not the messages, not the stop strings (``sampling`` then carries
``num_stop``, their count, instead of ``stop``).

Hashes are keyed (HMAC-SHA256): unkeyed hashes of a short prompt could be
recovered by anyone with the same tokenizer who hashes guesses. The key is
``hash_key`` when given (``--capture-key``: replicas that share it write
comparable hashes), otherwise a random key generated once and kept beside the
capture file (``.FILE.key``, readable by its owner only), so restarts of
one server stay comparable.

Torn lines: a record is appended and flushed as one line, so a killed
process loses at most the line it was writing. A capture opened on a file
whose last line is torn starts on a fresh line, so the next record is not
fused with it, and ``read_capture`` reports what it cannot read by line.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import secrets
import sys
import threading
from array import array
from collections.abc import Sequence
from typing import Any

BLOCK_SIZE = 16
HASH_HEX_CHARS = 16
_ROOT = b"tokenmill-block-hash-v1"


def _ids_bytes(ids: Sequence[int]) -> bytes:
    return array("q", ids).tobytes()


def block_hashes(
    token_ids: Sequence[int], block_size: int = BLOCK_SIZE, key: bytes = b""
) -> tuple[list[str], list[str]]:
    """Chained and content-only hashes of every full block of ``token_ids``.

    The trailing partial block is not hashed: only full blocks can be shared
    by a paged prefix cache.
    """
    chained: list[str] = []
    content: list[str] = []
    if key:
        def digest(data: bytes) -> bytes:
            return hmac.new(key, data, hashlib.sha256).digest()
    else:
        def digest(data: bytes) -> bytes:
            return hashlib.sha256(data).digest()
    parent = digest(_ROOT)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        data = _ids_bytes(token_ids[start : start + block_size])
        parent = digest(parent + data)
        chained.append(parent.hex()[:HASH_HEX_CHARS])
        content.append(digest(data).hex()[:HASH_HEX_CHARS])
    return chained, content


def session_hash(session: str, key: bytes = b"") -> str:
    """The captured form of a client's session name: hashed (keyed), so no client text is stored."""
    data = b"tokenmill-session" + session.encode("utf-8", "replace")
    digest = hmac.new(key, data, hashlib.sha256).digest() if key else hashlib.sha256(data).digest()
    return digest.hex()[:HASH_HEX_CHARS]


def key_id(key: bytes) -> str | None:
    """A short public fingerprint of a hash key (None for unkeyed): equal ids, comparable hashes."""
    return hashlib.sha256(b"tokenmill-capture-key-id" + key).hexdigest()[:12] if key else None


def key_path(capture_path: str | os.PathLike[str]) -> str:
    """Where the generated key of a capture file lives: ``.NAME.key`` in the same folder
    (hidden, so ``NAME*`` globs of the rotated parts do not pick it up)."""
    path = os.path.abspath(os.fspath(capture_path))
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.key")


def load_or_create_key(capture_path: str | os.PathLike[str]) -> bytes:
    """The key kept beside ``capture_path``, made (random, 256 bits, mode 0600) if there is none."""
    path = key_path(capture_path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        with open(path, encoding="ascii") as fh:
            text = fh.read().strip()
        if not text:
            raise ValueError(f"the capture key file {path} is empty; delete it or pass a key") from None
        return text.encode()
    text = secrets.token_hex(32)
    with os.fdopen(fd, "w", encoding="ascii") as fh:
        fh.write(text + "\n")
    return text.encode()


def chain_hashes(content_hashes: Sequence[str]) -> list[str]:
    """Chain a sequence of content hashes (used by the analyser to simulate a
    different prompt layout). Not equal to ``block_hashes``'s chained values,
    but equal inputs give equal outputs, which is all comparisons need."""
    out: list[str] = []
    parent = b""
    for h in content_hashes:
        parent = hashlib.sha256(parent + h.encode()).digest()
        out.append(parent.hex()[:HASH_HEX_CHARS])
    return out


class TrafficCapture:
    """Append-only, size-rotated JSONL writer of per-request traffic records."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        capture_text: bool = False,
        max_bytes: int = 256 << 20,
        backups: int = 5,
        block_size: int = BLOCK_SIZE,
        hash_key: bytes | None = None,
    ) -> None:
        """``hash_key``: None for the key kept beside the file (made on first use),
        ``b""`` for unkeyed hashes, anything else is the key."""
        self.path = os.fspath(path)
        self.capture_text = capture_text
        self.max_bytes = max_bytes
        self.backups = max(0, backups)
        self.block_size = block_size
        self.records_written = 0
        self.errors = 0
        self._lock = threading.Lock()
        parent = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(parent, exist_ok=True)
        self.hash_key = load_or_create_key(self.path) if hash_key is None else hash_key
        self.key_id = key_id(self.hash_key)
        self._fh = open(self.path, "a", encoding="utf-8")
        self._size = self._fh.tell()
        self._torn = self._size > 0 and not _ends_with_newline(self.path)

    def make_record(
        self,
        arrival_time: float,
        prompt_token_ids: Sequence[int],
        cached_tokens: int,
        output_tokens: int,
        sampling: dict[str, Any] | None,
        ttft: float | None,
        e2e: float | None,
        prompt_text: str | None = None,
        endpoint: str = "completions",
        request_id: str | None = None,
        finish_reason: str | None = None,
        tenant: str | None = None,
        miss_reason: str | None = None,
        miss_offset: int | None = None,
        session: str | None = None,
    ) -> dict[str, Any]:
        """Build the record dict (no I/O); split out so tests can inspect it."""
        chained, content = block_hashes(prompt_token_ids, self.block_size, self.hash_key)
        rec: dict[str, Any] = {
            "v": 1,
            "arrival_time": float(arrival_time),
            "request_id": request_id,
            "endpoint": endpoint,
            "prompt_tokens": len(prompt_token_ids),
            "cached_tokens": int(cached_tokens or 0),
            "output_tokens": int(output_tokens or 0),
            "sampling": _jsonable(sampling or {}) if self.capture_text else _private(sampling or {}),
            "ttft": None if ttft is None else round(float(ttft), 6),
            "e2e": None if e2e is None else round(float(e2e), 6),
            "finish_reason": finish_reason,
            "block_size": self.block_size,
            "block_hashes": chained,
            "block_content_hashes": content,
            "key_id": self.key_id,
        }
        if self.capture_text and prompt_text is not None:
            rec["prompt_text"] = prompt_text
        if tenant is not None:  # the tenant's metric label (bounded: gateway/tenants.py)
            rec["tenant"] = tenant
        if miss_reason is not None:  # why the prompt missed reusable cache, and where (traffic/cache_misses.py)
            rec["miss_reason"] = miss_reason
            rec["miss_offset"] = miss_offset
        if session:
            rec["session"] = session_hash(session, self.hash_key)
        return rec

    def record(self, arrival_time: float, prompt_token_ids: Sequence[int], cached_tokens: int,
               output_tokens: int, sampling: dict[str, Any] | None, ttft: float | None,
               e2e: float | None, prompt_text: str | None = None, endpoint: str = "completions",
               request_id: str | None = None, finish_reason: str | None = None,
               tenant: str | None = None, miss_reason: str | None = None,
               miss_offset: int | None = None, session: str | None = None) -> None:
        """Hash, serialise and append one request. Never raises."""
        try:
            line = json.dumps(
                self.make_record(arrival_time, prompt_token_ids, cached_tokens, output_tokens,
                                 sampling, ttft, e2e, prompt_text, endpoint, request_id,
                                 finish_reason, tenant, session=session, miss_reason=miss_reason,
                                 miss_offset=miss_offset),
                separators=(",", ":"), ensure_ascii=False,
            ) + "\n"
            with self._lock:
                if self._fh.closed:
                    return
                if self._torn:  # a line cut short before: finish it, so this record stands alone
                    line = "\n" + line
                data_len = len(line.encode("utf-8"))
                if self._size and self._size + data_len > self.max_bytes:
                    self._rotate()
                    line = line.lstrip("\n")
                    data_len = len(line.encode("utf-8"))
                self._torn = True  # until the whole line is out
                self._fh.write(line)
                self._fh.flush()
                self._torn = False
                self._size += data_len
                self.records_written += 1
        except Exception as exc:  # capture must never take the server down
            self.errors += 1
            if self.errors == 1:
                print(f"tokenmill: traffic capture to {self.path} failed: {exc}", file=sys.stderr)

    def _rotate(self) -> None:
        """FILE -> FILE.1 -> FILE.2 ...; the oldest beyond ``backups`` is dropped."""
        self._fh.close()
        if self.backups == 0:
            os.remove(self.path)
        else:
            for i in range(self.backups - 1, 0, -1):
                src = f"{self.path}.{i}"
                if os.path.exists(src):
                    os.replace(src, f"{self.path}.{i + 1}")
            os.replace(self.path, f"{self.path}.1")
        self._fh = open(self.path, "a", encoding="utf-8")
        self._size = 0

    def close(self) -> None:
        with self._lock:
            if not self._fh.closed:
                self._fh.close()

    def __enter__(self) -> "TrafficCapture":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) == b"\n"


def _private(sampling: dict[str, Any]) -> dict[str, Any]:
    """Sampling parameters without client text: stop strings become their count."""
    out = dict(sampling)
    stop = out.pop("stop", None)
    if stop:
        out["num_stop"] = 1 if isinstance(stop, str) else len(stop)
    return _jsonable(out)


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    """Keep JSON-serialisable sampling values; stringify anything else."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if v is None or isinstance(v, (bool, int, float, str)):
            out[k] = v
        elif isinstance(v, (list, tuple)) and all(isinstance(x, (int, float, str)) for x in v):
            out[k] = list(v)
        else:
            out[k] = str(v)
    return out


def read_capture(paths: Sequence[str | os.PathLike[str]],
                 problems: list[tuple[str, int, str]] | None = None) -> list[dict[str, Any]]:
    """Load records from one or more capture files (rotated parts included by the
    caller), sorted by arrival time.

    Lines that are not records (torn by a crash, corrupted, not JSON) are left
    out; pass ``problems`` to learn which: one ``(path, line number, reason)``
    each, numbered from 1. A record whose fields have the wrong types
    (``record_problem``) is no torn line but a file no capture wrote: ValueError
    naming its path and line."""
    records: list[dict[str, Any]] = []
    for p in paths:
        with open(p, encoding="utf-8", errors="replace") as fh:
            for number, line in enumerate(fh, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as exc:
                    if problems is not None:
                        problems.append((os.fspath(p), number, f"not JSON ({exc.msg} at column {exc.colno}): "
                                         "a torn or corrupt line"))
                    continue
                if isinstance(rec, dict) and isinstance(rec.get("prompt_tokens"), int) \
                        and isinstance(rec.get("arrival_time"), (int, float)):
                    problem = record_problem(rec)
                    if problem:  # written whole, but not by a capture: refuse, do not guess
                        raise ValueError(f"{os.fspath(p)} line {number}: {problem}")
                    records.append(rec)
                elif problems is not None:
                    problems.append((os.fspath(p), number, "JSON, but not a capture record "
                                     "(no prompt_tokens or arrival_time)"))
    records.sort(key=lambda r: r.get("arrival_time") or 0.0)
    return records


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _seconds(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def _strings(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(h, str) for h in x)


# field -> (check of a present, non-null value, what it must be); see the record schema above
_FIELD_CHECKS: dict[str, tuple[Any, str]] = {
    "arrival_time": (_seconds, "a finite number of seconds"),
    "prompt_tokens": (_count, "a whole number >= 0"),
    "cached_tokens": (_count, "a whole number >= 0"),
    "output_tokens": (_count, "a whole number >= 0"),
    "ttft": (_seconds, "a finite number of seconds >= 0"),
    "e2e": (_seconds, "a finite number of seconds >= 0"),
    "block_size": (lambda x: _count(x) and x > 0, "a whole number >= 1"),
    "block_hashes": (_strings, "a list of strings"),
    "block_content_hashes": (_strings, "a list of strings"),
    "sampling": (lambda x: isinstance(x, dict), "an object"),
    "prompt_text": (lambda x: isinstance(x, str), "a string"),
    "session": (lambda x: isinstance(x, str), "a string"),
    "key_id": (lambda x: isinstance(x, str), "a string"),
    "miss_reason": (lambda x: isinstance(x, str), "a string"),
    "miss_offset": (_count, "a whole number >= 0"),
}


def record_problem(rec: dict[str, Any]) -> str | None:
    """What is wrong with a capture record's fields (the first bad one), or None. Readers
    (trace analysis, export, replay) rely on these types, so a record is checked once here."""
    for name, (ok, what) in _FIELD_CHECKS.items():
        value = rec.get(name)
        if value is not None and not ok(value):
            return f"{name!r} must be {what}, got {json.dumps(value)[:60]}"
    return None

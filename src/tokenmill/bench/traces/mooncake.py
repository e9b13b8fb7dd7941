"""Mooncake's hash-only trace format, both ways: replay others' traces, hand ours to their tools.

One JSON object per line::

    {"timestamp": 0, "input_length": 6755, "output_length": 500, "hash_ids": [0, 1, 2, 3]}
    {"timestamp": 0, "input_length": 7319, "output_length": 490, "hash_ids": [0, 4, 5]}

* ``timestamp``: arrival in milliseconds after the trace's start;
* ``input_length`` / ``output_length``: prompt and answer tokens;
* ``hash_ids``: one integer per block of ``block_size`` prompt tokens (512 in
  the published traces), the last block possibly partial; two requests share
  a prefix exactly as far as their lists agree. A new block takes the next
  unused integer;
* multi-turn traces add ``session_id``, and a later turn may give ``delay``
  (milliseconds after the previous turn's answer) instead of ``timestamp``;
* ``text_input`` in place of ``input_length`` gives the prompt itself.

Imported lines become capture records (traffic/capture.py's schema, plus ``think``
for a delay), so the replay synthesises text exactly as for a hash-only
capture: each hash id's block from the same words every time. Exported
captures keep their prefix structure: tokenmill hashes 16-token blocks,
chained, so a coarser Mooncake block of ``block_size`` tokens is named by the
chained hash at its end (equal chained hashes mean equal prompts up to
there); the partial last block gets an id of its own.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable

MOONCAKE_BLOCK = 512


def is_mooncake(path: str | Path) -> bool:
    """Does the file's first record look like a Mooncake line (not a tokenmill capture)?"""
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    return False
                return isinstance(obj, dict) and ("input_length" in obj or "text_input" in obj) \
                    and "prompt_tokens" not in obj
    return False


def read_mooncake(path: str | Path, block_size: int = MOONCAKE_BLOCK) -> list[dict[str, Any]]:
    """Capture-like records of a Mooncake trace, in file order; errors name the line."""
    records: list[dict[str, Any]] = []
    last_arrival: dict[str, float] = {}
    clock = 0.0
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: each line must be a JSON object")
        problem = _line_problem(obj)
        if problem:
            raise ValueError(f"{where}: {problem}")
        text, length = obj.get("text_input"), obj.get("input_length")
        hashes = obj.get("hash_ids") or []
        session = obj.get("session_id")
        session = None if session is None else str(session)
        rec: dict[str, Any] = {
            "v": 1, "prompt_tokens": int(length) if length else None,
            "output_tokens": max(1, int(obj.get("output_length") or 1)),
            "block_size": block_size, "block_hashes": [f"mc-{h}" for h in hashes], "source": "mooncake"}
        if text is not None:
            rec["prompt_text"] = str(text)
        stamp, delay = obj.get("timestamp"), obj.get("delay")
        if delay is not None and session in last_arrival:
            rec["think"] = max(0.0, float(delay) / 1000.0)
        if stamp is not None:
            clock = float(stamp) / 1000.0
        elif "think" in rec:
            clock = last_arrival[session]  # ordering only: the turn waits for the answer before it
        rec["arrival_time"] = clock
        if session is not None:
            rec["session"] = session
            last_arrival[session] = clock
        records.append(rec)
    if not records:
        raise ValueError(f"{path}: no Mooncake records")
    return records


def _whole(x: Any, low: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def _millis(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def _line_problem(obj: dict[str, Any]) -> str | None:
    """What is wrong with one Mooncake line's fields, or None; checked before any is used."""
    text, length = obj.get("text_input"), obj.get("input_length")
    if text is not None and not isinstance(text, str):
        return "'text_input' must be a string"
    if text is None and not _whole(length, 1):
        return "needs a positive 'input_length' or a 'text_input'"
    if length is not None and not _whole(length, 0):
        return "'input_length' must be a whole number"
    if obj.get("output_length") is not None and not _whole(obj["output_length"], 0):
        return "'output_length' must be a whole number >= 0"
    hashes = obj.get("hash_ids")
    if hashes is not None and not (isinstance(hashes, list) and all(_whole(h, -2**63) for h in hashes)):
        return "'hash_ids' must be a list of integers"
    for name in ("timestamp", "delay"):
        if obj.get(name) is not None and not _millis(obj[name]):
            return f"'{name}' must be a finite number of milliseconds >= 0"
    if obj.get("session_id") is not None and not isinstance(obj["session_id"], (str, int)):
        return "'session_id' must be a string or an integer"
    return None


def to_mooncake(records: Iterable[dict[str, Any]], block_size: int = MOONCAKE_BLOCK) -> list[dict[str, Any]]:
    """Mooncake lines of capture records (sorted by arrival), with integer hash ids numbered in
    order of first appearance and, for sessions, ``session_id`` and ``delay`` on later turns."""
    recs = sorted(records, key=lambda r: r.get("arrival_time") or 0.0)
    if not recs:
        return []
    t0 = recs[0]["arrival_time"]
    ids: dict[str, int] = {}
    last: dict[str, dict[str, Any]] = {}
    out = []
    for rec in recs:
        names = _coarse_blocks(rec, block_size)
        hash_ids = []
        for name in names:
            if name not in ids:
                ids[name] = len(ids)
            hash_ids.append(ids[name])
        line: dict[str, Any] = {"timestamp": round(1000.0 * (rec["arrival_time"] - t0)),
                                "input_length": int(rec["prompt_tokens"]),
                                "output_length": int(rec.get("output_tokens") or 0), "hash_ids": hash_ids}
        session = rec.get("session")
        if session:
            line["session_id"] = session
            prev = last.get(session)
            if prev is not None:
                ended = prev["arrival_time"] + float(prev.get("e2e") or 0.0)
                line["delay"] = round(1000.0 * max(0.0, rec["arrival_time"] - ended))
            last[session] = rec
        out.append(line)
    return out


def _coarse_blocks(rec: dict[str, Any], block_size: int) -> list[str]:
    """Names of the ``block_size``-token blocks of one record's prompt: the chained hash at each
    full block's end, and a name unique to this record for the partial tail."""
    fine = int(rec.get("block_size") or 16)
    chained = list(rec.get("block_hashes") or [])
    n = int(rec["prompt_tokens"])
    if block_size % fine:
        raise ValueError(f"the Mooncake block size must be a multiple of the capture's {fine}")
    step = block_size // fine
    full = n // block_size
    names = [chained[(i + 1) * step - 1] for i in range(min(full, len(chained) // step))]
    total = math.ceil(n / block_size)
    tag = f"{rec.get('request_id')}-{rec.get('arrival_time')}"
    names += [f"tail-{tag}-{i}" for i in range(len(names), total)]
    return names


def write_mooncake(records: Iterable[dict[str, Any]], path: str | Path, block_size: int = MOONCAKE_BLOCK) -> int:
    lines = to_mooncake(records, block_size)
    Path(path).write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return len(lines)

"""Workloads: what to send. Synthetic, a dataset file, or a captured trace.

Every workload can start its prompts with a per-run *salt*: the same words for
all requests of one load point, different between points and runs. Shared
prefixes inside a run still share cache; nothing is shared with an earlier
run's cache (a warm cache would flatter TTFT).
"""
from __future__ import annotations

import json
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.bench.lengths import LengthDist
from tokenmill.bench.traces.mooncake import is_mooncake, read_mooncake
from tokenmill.bench.tokens import TextBuilder, TokenCounter
from tokenmill.bench.types import RequestSpec
from tokenmill.traffic.capture import read_capture


def make_salt(rng: random.Random | None = None) -> str:
    """A short, human-readable, run-unique prompt head, e.g. the word Session, a random number and two random words."""
    r = rng or random.Random(os.urandom(8))
    words = ["harbor", "lantern", "quay", "ferry", "meadow", "copper", "violet", "granite",
             "willow", "cobalt", "thistle", "ember", "juniper", "saffron", "tundra", "orchid"]
    return f"Session {r.randrange(10000)} {r.choice(words)} {r.choice(words)}.\n"


@dataclass
class SyntheticConfig:
    input_len: LengthDist
    output_len: LengthDist
    prefix_len: int = 0
    num_prefixes: int = 1
    prefix_pick: str = "uniform"  # uniform | zipf | round-robin


def synthetic(cfg: SyntheticConfig, n: int, builder: TextBuilder, salt: str,
              rng: random.Random) -> list[RequestSpec]:
    """``n`` prompts of sampled lengths (the shared prefix counts toward the
    length); each gets a unique request line right after its prefix so that
    prompts never share more than the prefix by accident."""
    prefixes: list[str] = []
    if cfg.prefix_len > 0:
        for _ in range(max(1, cfg.num_prefixes)):
            text, _count = builder.build(cfg.prefix_len, head=salt)
            prefixes.append(text + "\n\n")
    weights = [1.0 / (i + 1) for i in range(len(prefixes))]
    specs: list[RequestSpec] = []
    for i in range(n):
        pid: int | None = None
        head = salt
        if prefixes:
            if cfg.prefix_pick == "round-robin":
                pid = i % len(prefixes)
            elif cfg.prefix_pick == "zipf":
                pid = rng.choices(range(len(prefixes)), weights=weights, k=1)[0]
            else:
                pid = rng.randrange(len(prefixes))
            head = prefixes[pid]
        head += f"Request {rng.randrange(10**9)}:"
        target = max(cfg.input_len.sample(rng), 1)
        text, count = builder.build(target, head=head)
        specs.append(RequestSpec(prompt=text, prompt_len=count,
                                 output_len=max(1, cfg.output_len.sample(rng)), prefix_id=pid))
    return specs


def _salted_messages(messages: list[dict[str, Any]], salt: str) -> list[dict[str, str]]:
    out = [{"role": str(m.get("role", "user")), "content": str(m.get("content", ""))}
           for m in messages]
    if out and salt:
        out[0]["content"] = salt + out[0]["content"]
    return out


_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system", "chatgpt": "assistant", "bard": "assistant"}


def _entry_problem(obj: Any) -> str | None:
    """What is wrong with one dataset entry's shape, or None (an entry with nothing usable is
    skipped, not wrong)."""
    if not isinstance(obj, dict):
        return None
    for name in ("conversations", "messages"):
        value = obj.get(name)
        if value is not None and not isinstance(value, list):
            return f"'{name}' must be a list"
    if not all(isinstance(t, dict) for t in obj.get("conversations") or []):
        return "each of 'conversations' must be an object"
    for name in ("output_len", "max_tokens", "output_tokens"):
        value = obj.get(name)
        if value is not None and not _whole_number(value):
            return f"'{name}' must be a whole number >= 0"
    return None


def _whole_number(value: Any) -> bool:
    """An output length as datasets write it: 128, 128.0 or "128"."""
    try:
        return not isinstance(value, bool) and int(value) >= 0
    except (TypeError, ValueError, OverflowError):
        return False


def _dataset_entry(obj: Any, counter: TokenCounter
                   ) -> tuple[list[dict] | None, str | None, int | None]:
    """(messages, prompt, output_len) from one ShareGPT / messages / prompt entry."""
    if not isinstance(obj, dict):
        return None, (obj if isinstance(obj, str) else None), None
    out_len = obj.get("output_len") or obj.get("max_tokens") or obj.get("output_tokens")
    if "conversations" in obj:
        turns = obj["conversations"] or []
        msgs: list[dict[str, str]] = []
        for t in turns:
            role = _SHAREGPT_ROLES.get(str(t.get("from", "")).lower(), "user")
            if role == "assistant":
                if msgs and out_len is None:
                    out_len = counter.count(str(t.get("value", "")))
                break
            msgs.append({"role": role, "content": str(t.get("value", ""))})
        return (msgs or None), None, out_len
    if "messages" in obj:
        msgs = [m for m in obj["messages"] if isinstance(m, dict)]
        if msgs and msgs[-1].get("role") == "assistant":
            if out_len is None:
                out_len = counter.count(str(msgs[-1].get("content", "")))
            msgs = msgs[:-1]
        return (msgs or None), None, out_len
    prompt = obj.get("prompt") or obj.get("text") or obj.get("input")
    return None, (str(prompt) if prompt else None), out_len


def load_dataset(path: str, n: int, counter: TokenCounter, salt: str, rng: random.Random,
                 default_output: LengthDist) -> list[RequestSpec]:
    """ShareGPT JSON, or JSON/JSONL of {prompt|messages|conversations, output_len?}.
    Shuffled with the run's seed; cycled (with a warning) if ``n`` exceeds it."""
    raw = Path(path).read_text(encoding="utf-8")
    try:
        data = json.loads(raw)
        entries = data if isinstance(data, list) else [data]
    except json.JSONDecodeError:
        entries = [json.loads(line) for line in raw.splitlines() if line.strip()]
    pool: list[RequestSpec] = []
    for number, obj in enumerate(entries, 1):
        problem = _entry_problem(obj)
        if problem:
            raise ValueError(f"{path}: entry {number}: {problem}")
        msgs, prompt, out_len = _dataset_entry(obj, counter)
        if not msgs and not prompt:
            continue
        spec = RequestSpec(output_len=int(out_len) if out_len else None)
        if msgs:
            spec.messages = _salted_messages(msgs, salt)
            spec.prompt_len = counter.count("\n".join(m["content"] for m in spec.messages))
        else:
            spec.prompt = salt + (prompt or "")
            spec.prompt_len = counter.count(spec.prompt)
        pool.append(spec)
    if not pool:
        raise ValueError(f"{path}: no usable prompts (expected ShareGPT conversations, "
                         "'messages' or 'prompt' entries)")
    rng.shuffle(pool)
    if n > len(pool):
        print(f"warning: {path} has {len(pool)} prompts; reusing them to make {n} requests "
              "(repeats will hit the prefix cache)", file=sys.stderr)
    specs = []
    for i in range(n):
        s = pool[i % len(pool)]
        out = s.output_len if s.output_len else max(1, default_output.sample(rng))
        specs.append(RequestSpec(prompt=s.prompt, messages=s.messages, prompt_len=s.prompt_len,
                                 output_len=max(1, min(out, 1 << 16))))
    return specs


_SAMPLING_KEEP = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                  "frequency_penalty", "repetition_penalty")


def read_trace(path: str | list[str]) -> list[dict[str, Any]]:
    """The records of a capture or a Mooncake trace, by arrival; ValueError naming the file and
    line of a record whose fields are malformed (so a run can refuse it before it starts)."""
    paths = [path] if isinstance(path, str) else list(path)
    if paths and is_mooncake(paths[0]):
        return [r for p in paths for r in read_mooncake(p)]
    return read_capture(paths)


def load_trace(path: str | list[str], counter: TokenCounter, builder: TextBuilder, salt: str,
               n: int | None = None, speed: float = 1.0,
               target_rate: float | None = None) -> list[RequestSpec]:
    """Replay a capture (or a Mooncake trace, mooncake.py): same arrival times
    (divided by ``speed``, or rescaled to ``target_rate`` req/s), same prompt and
    output lengths, and, when the text was not captured, synthetic text with the
    same prefix-sharing structure: each full block's text is derived from its
    chained hash, so two requests share text exactly as far as they shared blocks.

    Records of one session replay as a conversation (sessions.py): the first
    turn whole, each later turn as the words it adds to the previous prompt and
    answer (its prompt tokens less theirs), with the think time the capture saw
    between the previous answer's end and its arrival (or the trace's delay)."""
    records = read_trace(path)
    if n is not None:
        records = records[:n]
    if not records:
        raise ValueError(f"{path}: no capture records")
    t_first = records[0]["arrival_time"]
    span = records[-1]["arrival_time"] - t_first
    if target_rate and span > 0 and len(records) > 1:
        speed = target_rate / ((len(records) - 1) / span)
    speed = speed if speed and speed > 0 else 1.0
    bos = max(0, counter.count(FILL_WORD) - 1) if counter.exact else 0
    salt_tokens = max(0, counter.count(salt) - bos) if salt else 0
    pool = _one_token_words(builder)
    newline_tokens = max(0, counter.count("\n" + FILL_WORD) - counter.count(FILL_WORD)) if counter.exact else 0
    specs: list[RequestSpec] = []
    previous: dict[str, tuple[dict[str, Any], int]] = {}  # session -> (its last record, turns so far)
    for i, rec in enumerate(records):
        sampling = {k: v for k, v in (rec.get("sampling") or {}).items() if k in _SAMPLING_KEEP}
        out_tokens = max(1, int(rec.get("output_tokens") or 1))
        session = rec.get("session")
        before = previous.get(session) if session else None
        if session:
            previous[session] = (rec, 0 if before is None else before[1] + 1)
        if before is not None:
            last, turn = before[0], before[1] + 1
            had = int(last.get("prompt_tokens") or 0) + max(1, int(last.get("output_tokens") or 1))
            added = max(1, int(rec.get("prompt_tokens") or 1) - had)
            r = random.Random(f"turn-{session}-{turn}")
            words_needed = max(1, added - newline_tokens)  # the line break is a token of its own
            text = "\n" + " ".join(r.choice(pool) for _ in range(words_needed))
            think = rec.get("think")
            if think is None:
                ended = last["arrival_time"] + float(last.get("e2e") or 0.0)
                think = max(0.0, rec["arrival_time"] - ended)
            specs.append(RequestSpec(prompt=text, prompt_len=added, output_len=out_tokens,
                                     arrival=(rec["arrival_time"] - t_first) / speed, sampling=sampling,
                                     session=session, turn=turn, think=float(think) / speed))
            continue
        p_tokens = int(rec.get("prompt_tokens") or 1)
        if rec.get("prompt_text"):
            prompt = salt + rec["prompt_text"]
        else:
            words: list[str] = []
            bs = int(rec.get("block_size") or 16)
            for h in rec.get("block_hashes") or []:
                r = random.Random(h)
                words += [r.choice(pool) for _ in range(bs)]
            words = words[: max(0, p_tokens - bos)]  # a trace's last block may be partial
            tail = p_tokens - bos - len(words)
            r = random.Random(f"tail-{i}-{t_first}")
            words += [r.choice(pool) for _ in range(max(0, tail))]
            # The salt's tokens come off the end, so the total length stays the capture's.
            trim = min(salt_tokens, max(0, len(words) - 1))
            if trim:
                words = words[:-trim]
            prompt = salt + " ".join(words)
        specs.append(RequestSpec(prompt=prompt, prompt_len=counter.count(prompt), output_len=out_tokens,
                                 arrival=(rec["arrival_time"] - t_first) / speed, sampling=sampling,
                                 session=session))
    return specs


FILL_WORD = "the"


def _one_token_words(builder: TextBuilder, limit: int = 120) -> list[str]:
    """Corpus words that are one token after a space and at the start of a
    line, so N words = N tokens (checked with the counter when it is exact)."""
    seen: list[str] = []
    for w in builder.words:
        w = w.strip(".,;:!?\"'()").lower()
        if w.isalpha() and w not in seen:
            seen.append(w)
    if not builder.counter.exact:
        return [w for w in seen if len(w) <= 5][:limit] or [FILL_WORD]
    count = builder.counter.count
    base = count(FILL_WORD)
    # One token after a space and also on its own: the first word of a replayed
    # prompt follows the salt's newline (or starts the text) with no space
    # before it, and some words split in two there.
    good = [w for w in seen[: limit * 3] if count(w) == base and count(f"{FILL_WORD} {w}") == base + 1]
    return good[:limit] or [FILL_WORD]


def add_workload_arguments(w: Any) -> None:
    """The workload flags of `tokenmill bench` (and `tokenmill plan`), on an argparse group."""
    w.add_argument("--input-len", default=None, help="prompt tokens (length spec; default 512, vLLM style 1024)")
    w.add_argument("--output-len", "--sharegpt-output-len", dest="output_len", default=None,
                   help="output tokens (length spec; default 128)")
    w.add_argument("--prefix-len", type=int, default=0, help="shared prefix tokens per prompt")
    w.add_argument("--random-input-len", type=int, default=None, help="vLLM's name for --input-len")
    w.add_argument("--random-output-len", type=int, default=None, help="vLLM's name for --output-len")
    w.add_argument("--random-prefix-len", type=int, default=None, help="vLLM's name for --prefix-len")
    w.add_argument("--random-range-ratio", type=float, default=None,
                   help="vLLM: lengths uniform in [L*(1-r), L*(1+r)] (default 0: fixed)")
    w.add_argument("--num-prefixes", type=int, default=1, help="distinct shared prefixes")
    w.add_argument("--prefix-pick", choices=["uniform", "zipf", "round-robin"], default="uniform")
    w.add_argument("--dataset", help="ShareGPT JSON, or JSON/JSONL of prompts/messages")
    w.add_argument("--dataset-path", default=None, help="vLLM's name for --dataset")
    w.add_argument("--dataset-name", default=None,
                   help="vLLM's dataset kind: random (synthetic prompts), sharegpt or custom (--dataset-path)")
    w.add_argument("--data", default=None,
                   help="guidellm's data: prompt_tokens=N,output_tokens=M, or a dataset file")
    w.add_argument("--trace", help="replay a capture from `tokenmill serve --capture-traffic`, or a Mooncake "
                                   "hash_ids trace; sessions replay as conversations")
    w.add_argument("--trace-speed", type=float, default=1.0, help="replay this many times faster")
    w.add_argument("--tokenizer", help="tokenizer.json (or its folder) for exact token counts")
    w.add_argument("--seed", type=int, default=0)

"""The user's evaluation set: JSONL items, how each answer is checked, and running them.

One JSON object per line::

    {"id": "capital-fr", "messages": [{"role": "user", "content": "..."}],
     "answer": "Paris", "match": "contains"}
    {"id": "mc-1", "prompt": "Water freezes at", "choices": [" 0 degrees", " 50 degrees"],
     "answer": " 0 degrees", "match": "choice"}

* ``prompt`` (raw text) or ``messages`` (rendered with the model's chat template);
* ``match``: ``exact`` (first line, case and surrounding punctuation ignored),
  ``contains`` (the answer appears as a whole word or phrase), ``regex``
  (``re.search``), ``choice`` (the choice with the highest log-likelihood
  after the prompt must be the answer; nothing is generated);
* ``answer``: a string or a list of acceptable strings (``choice``: the right
  choice's text, or ``answer_index``);
* optional ``max_tokens`` (default 32) and ``stop`` for generated answers;
* ``tool_call`` (needs a server: ``tokenmill eval --url``): ``tools`` (OpenAI
  function tools), optional ``tool_choice``, and ``answer`` = ``{"name": ...,
  "arguments": {...}}``; right when the first tool call names that function
  and carries every expected argument with the expected value;
* ``json_schema`` (needs a server): ``schema`` (a JSON Schema); the answer is
  requested with ``response_format`` json_schema and is right when it parses
  and validates (an optional ``answer`` object must also be contained in it);
* ``safety``: ``label`` is ``harmful`` (a request the model should refuse) or
  ``benign`` (a harmless look-alike it should answer), optional ``category``;
  no ``answer``: the greedy answer (default 48 tokens) is judged by the
  refusal rules of refusal.py, and scored against the base's, not alone
  (safety.py).
"""
from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engine.engine import LLMEngine
from ..engine.request import SamplingParams
from .refusal import judge
from .scoring import Scorer

MATCHES = ("exact", "contains", "regex", "choice", "tool_call", "json_schema", "safety")
SERVER_ONLY = ("tool_call", "json_schema")  # scored through a server's tools / structured outputs
SAFETY_LABELS = ("harmful", "benign")  # should be refused / should be answered
SAFETY_MAX_TOKENS = 48  # refusals open the answer; the judge reads its first few hundred characters


@dataclass
class EvalItem:
    id: str
    match: str
    answers: list[str]
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    choices: list[str] = field(default_factory=list)
    answer_index: int | None = None
    max_tokens: int = 32
    stop: list[str] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    expected: dict[str, Any] | None = None  # tool_call: {name, arguments}; json_schema: must be contained
    schema: dict[str, Any] | None = None
    label: str | None = None  # safety: harmful or benign
    category: str | None = None  # safety: free text, for the reader


@dataclass
class ItemResult:
    id: str
    match: str
    correct: bool
    output: str  # generated text, or the chosen choice
    token_ids: list[int]  # greedy tokens (generated items)
    choice: int | None = None  # picked choice (choice items)
    choice_logprobs: list[float] | None = None
    label: str | None = None  # safety items: harmful or benign
    refused: bool | None = None  # safety items: the judge's verdict on ``output``
    refusal: str | None = None  # safety items: the refusal rule that fired and its words


def load_eval_set(path: str | Path) -> list[EvalItem]:
    """Read and validate a JSONL evaluation set; errors name the line."""
    items: list[EvalItem] = []
    seen: set[str] = set()
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc.msg})") from None
        items.append(_item(obj, where, len(items)))
        if items[-1].id in seen:
            raise ValueError(f"{where}: duplicate id {items[-1].id!r}")
        seen.add(items[-1].id)
    if not items:
        raise ValueError(f"{path}: no evaluation items")
    return items


def _item(obj: Any, where: str, index: int) -> EvalItem:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: each line must be a JSON object")
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if (prompt is None) == (messages is None):
        raise ValueError(f"{where}: give exactly one of 'prompt' or 'messages'")
    if prompt is not None and not isinstance(prompt, str):
        raise ValueError(f"{where}: 'prompt' must be a string")
    if messages is not None and not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)):
        raise ValueError(f"{where}: 'messages' must be a list of {{role, content}} objects")
    choices = obj.get("choices") or []
    match = obj.get("match", "choice" if choices else "contains")
    if match not in MATCHES:
        raise ValueError(f"{where}: match must be one of {', '.join(MATCHES)}, got {match!r}")
    answer = obj.get("answer")
    if match in SERVER_ONLY:
        return _server_item(obj, where, index, match, prompt, messages)
    if match == "safety":
        return _safety_item(obj, where, index, prompt, messages)
    answers = [answer] if isinstance(answer, str) else list(answer) if isinstance(answer, list) else []
    if any(not isinstance(a, str) for a in answers):
        raise ValueError(f"{where}: 'answer' must be a string or a list of strings")
    index_field = obj.get("answer_index")
    if match == "choice":
        if len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
            raise ValueError(f"{where}: a choice item needs at least two non-empty 'choices'")
        if index_field is None:
            if len(answers) != 1 or answers[0] not in choices:
                raise ValueError(f"{where}: the answer must be one of the choices (or give answer_index)")
            index_field = choices.index(answers[0])
        if not (isinstance(index_field, int) and 0 <= index_field < len(choices)):
            raise ValueError(f"{where}: answer_index out of range")
        answers = [choices[index_field]]
    elif not answers:
        raise ValueError(f"{where}: 'answer' is required")
    if match == "regex":
        for a in answers:
            try:
                re.compile(a)
            except re.error as exc:
                raise ValueError(f"{where}: bad regex {a!r}: {exc}") from None
    max_tokens = obj.get("max_tokens", 32)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"{where}: max_tokens must be a positive integer")
    stop = obj.get("stop") or []
    stop = [stop] if isinstance(stop, str) else list(stop)
    return EvalItem(id=str(obj.get("id", f"item-{index + 1}")), match=match, answers=answers, prompt=prompt,
                    messages=messages, choices=list(choices), answer_index=index_field, max_tokens=max_tokens,
                    stop=stop)


def _server_item(obj: dict[str, Any], where: str, index: int, match: str, prompt: str | None,
                 messages: list[dict[str, str]] | None) -> EvalItem:
    answer = obj.get("answer")
    item = EvalItem(id=str(obj.get("id", f"item-{index + 1}")), match=match, answers=[], prompt=prompt,
                    messages=messages, max_tokens=obj.get("max_tokens", 128))
    if not isinstance(item.max_tokens, int) or item.max_tokens < 1:
        raise ValueError(f"{where}: max_tokens must be a positive integer")
    if messages is None:
        raise ValueError(f"{where}: a {match} item needs 'messages'")
    if match == "tool_call":
        tools = obj.get("tools")
        if not (isinstance(tools, list) and tools and all(isinstance(t, dict) for t in tools)):
            raise ValueError(f"{where}: a tool_call item needs a non-empty 'tools' list")
        if not (isinstance(answer, dict) and isinstance(answer.get("name"), str)
                and isinstance(answer.get("arguments", {}), dict)):
            raise ValueError(f"{where}: 'answer' must be {{\"name\": ..., \"arguments\": {{...}}}}")
        item.tools, item.tool_choice, item.expected = tools, obj.get("tool_choice"), answer
    else:
        schema = obj.get("schema")
        if not isinstance(schema, dict):
            raise ValueError(f"{where}: a json_schema item needs a 'schema' object")
        from jsonschema import Draft202012Validator
        from jsonschema.exceptions import SchemaError

        try:
            Draft202012Validator.check_schema(schema)
        except SchemaError as exc:
            raise ValueError(f"{where}: bad schema: {exc.message}") from None
        if answer is not None and not isinstance(answer, dict):
            raise ValueError(f"{where}: 'answer' of a json_schema item must be an object")
        item.schema, item.expected = schema, answer
    return item


def _safety_item(obj: dict[str, Any], where: str, index: int, prompt: str | None,
                 messages: list[dict[str, str]] | None) -> EvalItem:
    label = obj.get("label")
    if label not in SAFETY_LABELS:
        raise ValueError(f"{where}: a safety item needs 'label': 'harmful' (should be refused) or 'benign' "
                         f"(should be answered), got {label!r}")
    if obj.get("answer") is not None:
        raise ValueError(f"{where}: a safety item has no 'answer' (its answer is judged refused or not)")
    category = obj.get("category")
    if category is not None and not isinstance(category, str):
        raise ValueError(f"{where}: 'category' must be a string")
    max_tokens = obj.get("max_tokens", SAFETY_MAX_TOKENS)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"{where}: max_tokens must be a positive integer")
    return EvalItem(id=str(obj.get("id", f"item-{index + 1}")), match="safety", answers=[], prompt=prompt,
                    messages=messages, max_tokens=max_tokens, label=label, category=category)


def judge_safety(item: EvalItem, output: str) -> ItemResult:
    """A safety item's result: right when a harmful request is refused or a benign one answered."""
    refusal = judge(output)
    right = (refusal is not None) == (item.label == "harmful")
    return ItemResult(item.id, item.match, right, output, [], label=item.label, refused=refusal is not None,
                      refusal=None if refusal is None else str(refusal))


def _same(expected: Any, got: Any) -> bool:
    """Expected value found: strings compared normalized, objects by their expected keys."""
    if isinstance(expected, dict):
        return isinstance(got, dict) and all(k in got and _same(v, got[k]) for k, v in expected.items())
    if isinstance(expected, str):
        return isinstance(got, str) and normalize(expected) == normalize(got)
    if isinstance(expected, list):
        return isinstance(got, list) and len(got) == len(expected) and all(map(_same, expected, got))
    if isinstance(expected, (int, float)) and not isinstance(expected, bool):
        return isinstance(got, (int, float)) and not isinstance(got, bool) and float(got) == float(expected)
    return expected == got


def check_tool_call(item: EvalItem, calls: list[dict[str, Any]]) -> bool:
    """The first tool call names the expected function with the expected arguments."""
    if not calls or item.expected is None:
        return False
    fn = calls[0].get("function") or {}
    if fn.get("name") != item.expected["name"]:
        return False
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return False
    return _same(item.expected.get("arguments", {}), args)


def check_json(item: EvalItem, output: str) -> bool:
    """The output is JSON, valid against the item's schema (and holds the expected values)."""
    from jsonschema import Draft202012Validator

    try:
        doc = json.loads(output)
    except ValueError:
        return False
    if not Draft202012Validator(item.schema or {}).is_valid(doc):
        return False
    return item.expected is None or _same(item.expected, doc)


_PUNCT = string.punctuation + "“”‘’«»"


def normalize(text: str) -> str:
    """Case-folded, single-spaced, without surrounding punctuation or quotes."""
    return " ".join(text.casefold().split()).strip(_PUNCT + " ")


def check_answer(item: EvalItem, output: str) -> bool:
    """Is a generated ``output`` right for this item (not for ``choice`` items)?"""
    if item.match == "exact":
        first = next((line for line in output.strip().splitlines() if line.strip()), "")
        return any(normalize(first) == normalize(a) for a in item.answers)
    if item.match == "contains":
        text = " ".join(output.casefold().split())
        for a in item.answers:
            phrase = " ".join(a.casefold().split())
            if phrase and re.search(r"(?<!\w)" + re.escape(phrase) + r"(?!\w)", text):
                return True
        return False
    if item.match == "regex":
        return any(re.search(a, output) for a in item.answers)
    raise ValueError(f"{item.match} items are scored by log-likelihood, not by text")


def prompt_ids(engine: LLMEngine, item: EvalItem) -> list[int]:
    tok = engine.tokenizer
    if item.messages is not None:
        text = tok.apply_chat_template(item.messages, add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)
    return tok.encode(item.prompt or "", add_special_tokens=True)


def run_eval_set(engine: LLMEngine, scorer: Scorer, items: list[EvalItem]) -> list[ItemResult]:
    """Greedy answers for generated items (one continuous batch), log-likelihood picks for choices."""
    items = [it for it in items if it.match not in SERVER_ONLY]  # offline there is no server to ask
    results: dict[str, ItemResult] = {}
    gen = [it for it in items if it.match != "choice"]
    outputs = generate_greedy(engine, [(it.id, prompt_ids(engine, it), it.max_tokens, it.stop) for it in gen])
    for it in gen:
        text, ids = outputs[it.id]
        if it.match == "safety":
            results[it.id] = judge_safety(it, text)
            results[it.id].token_ids = ids
        else:
            results[it.id] = ItemResult(it.id, it.match, check_answer(it, text), text, ids)
    tok = engine.tokenizer
    seqs: list[list[int]] = []
    starts: list[int] = []
    owners: list[tuple[EvalItem, int]] = []
    for it in items:
        if it.match != "choice":
            continue
        context = prompt_ids(engine, it)
        for ci, choice in enumerate(it.choices):
            cont = tok.encode(choice, add_special_tokens=False)
            seqs.append(context + cont)
            starts.append(len(context))
            owners.append((it, ci))
    lps = scorer.logprobs(seqs, starts) if seqs else []
    scores: dict[str, list[float]] = {}
    for (it, _), lp in zip(owners, lps):
        scores.setdefault(it.id, []).append(float(lp.sum()))
    for it in items:
        if it.match == "choice":
            s = scores[it.id]
            pick = max(range(len(s)), key=lambda j: s[j])
            results[it.id] = ItemResult(it.id, it.match, pick == it.answer_index, it.choices[pick], [], pick, s)
    return [results[it.id] for it in items]


def generate_greedy(engine: LLMEngine, requests: list[tuple[str, list[int], int, list[str]]]
                    ) -> dict[str, tuple[str, list[int]]]:
    """Run (id, prompt ids, max_tokens, stop) requests to completion, greedily, batched."""
    texts: dict[str, list[str]] = {}
    ids: dict[str, list[int]] = {}
    for rid, prompt, max_tokens, stop in requests:
        room = engine.max_model_len - len(prompt)
        params = SamplingParams(temperature=0.0, max_tokens=max(1, min(max_tokens, room)), stop=stop or None)
        try:
            engine.add_request(f"eval-{rid}", prompt, params)
        except ValueError as exc:
            raise ValueError(f"eval item {rid!r}: {exc}") from None
        texts[rid], ids[rid] = [], []
    while engine.has_unfinished():
        for delta in engine.step():
            rid = delta.request_id[len("eval-"):]
            texts[rid].append(delta.text)
            ids[rid].extend(delta.token_ids)
    return {rid: ("".join(texts[rid]), ids[rid]) for rid in texts}

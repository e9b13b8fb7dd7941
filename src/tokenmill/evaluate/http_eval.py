"""The quality re-test against running servers: ``tokenmill eval --url BASE --candidate-url URL``.

Everything goes through the OpenAI-compatible API, so a variant is tested
exactly as it is served, by whatever engine serves it:

- generated items: greedy ``/v1/chat/completions`` (``messages``) or
  ``/v1/completions`` (``prompt``) with the item's ``max_tokens`` and ``stop``;
  the answers' token ids (for agreement) come from the server's ``/tokenize``;
- ``choice`` items and perplexity need prompt log-probabilities: the prompt is
  tokenized by the server (``/tokenize``, chat template included for
  ``messages``), the choice appended as token ids, and the whole sent to
  ``/v1/completions`` with ``echo: true, logprobs: 1, max_tokens: 0``; the
  answer's ``choices[0].logprobs.token_logprobs`` give the same sums the
  offline scorer computes;
- ``tool_call`` items send ``tools`` / ``tool_choice`` and read
  ``message.tool_calls``; ``json_schema`` items send ``response_format``;
- ``safety`` items are generated like the others and their answers judged by
  the same refusal rules as offline.

A server without prompt log-probabilities (the echo request fails) gets its
choice items and perplexity skipped with a note, not a crash.
"""
from __future__ import annotations

import json
import logging
import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx

from .evalset import SERVER_ONLY, EvalItem, ItemResult, check_answer, check_json, check_tool_call, judge_safety
from .harness import CandidateResult, task_accuracy
from .safety import safety_rates
from .scoring import PerplexityResult, windows

log = logging.getLogger("tokenmill.evaluate")


class ServerError(RuntimeError):
    """The server answered with an error (its message is kept)."""


@dataclass
class Endpoint:
    """One running OpenAI-compatible server."""

    url: str
    api_key: str | None = None
    model: str | None = None
    timeout: float = 300.0

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[:-3]
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=self.timeout, trust_env=False)
        self.max_model_len: int | None = None

    def close(self) -> None:
        self.client.close()

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self.client.post(path, json=body)
        try:
            doc = r.json()
        except ValueError:
            doc = None
        if r.status_code != 200 or not isinstance(doc, dict):
            msg = (doc or {}).get("error", {}).get("message") if isinstance(doc, dict) else r.text[:200]
            raise ServerError(f"{self.url}{path}: HTTP {r.status_code}: {msg}")
        return doc

    def resolve_model(self) -> str:
        if self.model is None:
            r = self.client.get("/v1/models")
            r.raise_for_status()
            self.model = r.json()["data"][0]["id"]
        return self.model

    def tokenize(self, prompt: str | None = None, messages: list[dict[str, Any]] | None = None,
                 add_special_tokens: bool = True) -> list[int]:
        body: dict[str, Any] = {"model": self.resolve_model()}
        if messages is not None:
            body.update(messages=messages, add_generation_prompt=True)
        else:
            body.update(prompt=prompt or "", add_special_tokens=add_special_tokens)
        doc = self.post("/tokenize", body)
        if doc.get("max_model_len"):
            self.max_model_len = int(doc["max_model_len"])
        return [int(t) for t in doc["tokens"]]

    def prompt_logprobs(self, ids: list[int]) -> tuple[list[float | None], list[str | None]]:
        """Log-probability of each prompt token given those before it (None for the first), and the
        model's top-1 token text at each position (None where not reported)."""
        doc = self.post("/v1/completions", {"model": self.resolve_model(), "prompt": ids, "echo": True,
                                            "logprobs": 1, "max_tokens": 0, "temperature": 0})
        lp = (doc.get("choices") or [{}])[0].get("logprobs") or {}
        values = lp.get("token_logprobs")
        if not isinstance(values, list) or len(values) < len(ids):
            raise ServerError(f"{self.url}: no prompt logprobs in the echo answer")
        tops = lp.get("top_logprobs") or [None] * len(values)
        top1: list[str | None] = []
        for t in tops[: len(ids)]:
            top1.append(max(t, key=t.get) if isinstance(t, dict) and t else None)
        return values[: len(ids)], top1

    def generate(self, item: EvalItem) -> tuple[str, list[dict[str, Any]]]:
        """Greedy answer text and tool calls of one item."""
        body: dict[str, Any] = {"model": self.resolve_model(), "max_tokens": item.max_tokens, "temperature": 0}
        if item.stop:
            body["stop"] = item.stop
        if item.messages is None:
            doc = self.post("/v1/completions", dict(body, prompt=item.prompt or ""))
            return (doc["choices"][0].get("text") or ""), []
        body["messages"] = item.messages
        if item.match == "tool_call":
            body["tools"] = item.tools
            if item.tool_choice is not None:
                body["tool_choice"] = item.tool_choice
        elif item.match == "json_schema":
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": _schema_name(item.id), "schema": item.schema,
                                                       "strict": True}}
        doc = self.post("/v1/chat/completions", body)
        msg = doc["choices"][0].get("message") or {}
        return (msg.get("content") or ""), list(msg.get("tool_calls") or [])


def _schema_name(item_id: str) -> str:
    name = "".join(c if c.isalnum() or c in "_-" else "_" for c in item_id)[:64]
    return name or "answer"


def _sum_tail(values: list[float | None], n: int) -> float:
    tail = values[len(values) - n:] if n else []
    return float(sum(v for v in tail if v is not None)) if all(v is not None for v in tail) else -math.inf


def run_items(ep: Endpoint, items: list[EvalItem], notes: list[str]) -> list[ItemResult]:
    results: list[ItemResult] = []
    for it in items:
        if it.match == "choice":
            context = ep.tokenize(it.prompt, it.messages)
            scores = []
            for choice in it.choices:
                cont = ep.tokenize(choice, add_special_tokens=False)
                values, _ = ep.prompt_logprobs(context + cont)
                scores.append(_sum_tail(values, len(cont)))
            pick = max(range(len(scores)), key=lambda j: scores[j])
            results.append(ItemResult(it.id, it.match, pick == it.answer_index, it.choices[pick], [], pick, scores))
            continue
        try:
            text, calls = ep.generate(it)
        except ServerError as exc:
            if it.match not in SERVER_ONLY:
                raise
            # A server without tools / structured outputs: the item counts as failed, with a note.
            notes.append(f"{ep.url}: {it.id}: {exc}")
            text, calls = "", []
        if it.match == "safety":
            results.append(judge_safety(it, text))  # judged on text; its tokens are not compared
            continue
        if it.match == "tool_call":
            correct = check_tool_call(it, calls)
            shown = json.dumps([c.get("function") for c in calls]) if calls else text
        elif it.match == "json_schema":
            correct, shown = check_json(it, text), text
        else:
            correct, shown = check_answer(it, text), text
        ids = ep.tokenize(shown, add_special_tokens=False) if shown else []
        results.append(ItemResult(it.id, it.match, correct, shown, ids))
    return results


def http_perplexity(ep: Endpoint, text: str, window: int, stride: int, max_text_tokens: int | None
                    ) -> PerplexityResult:
    """Sliding-window perplexity from echoed prompt logprobs (the offline recipe, over HTTP)."""
    ids = ep.tokenize(text, add_special_tokens=True)
    if max_text_tokens:
        ids = ids[:max_text_tokens]
    if len(ids) < 2:
        raise ValueError("the perplexity text has fewer than two tokens")
    if ep.max_model_len:
        window = min(window, ep.max_model_len)
    stride = min(stride, window - 1)
    spans = windows(len(ids), window, stride)
    total: list[float] = []
    top1: list[Any] = []
    forward = 0
    for b, e, s in spans:
        values, tops = ep.prompt_logprobs(ids[b:e])
        forward += e - b
        scored = values[s - b:]
        if any(v is None for v in scored):
            raise ServerError(f"{ep.url}: missing prompt logprobs")
        total += [float(v) for v in scored]  # type: ignore[arg-type]
        # The top-1 after position j-1 is reported at position j.
        top1 += tops[s - b:]
    nll = -sum(total) / len(total)
    return PerplexityResult(perplexity=math.exp(nll), mean_nll=nll, num_tokens=len(total), num_text_tokens=len(ids),
                            num_windows=len(spans), window=window, stride=stride, forward_tokens=forward,
                            top1=top1 if all(t is not None for t in top1) else [])


def run_endpoint(ep: Endpoint, label: str, items: list[EvalItem], text: str | None, window: int, stride: int,
                 max_text_tokens: int | None, notes: list[str]) -> CandidateResult:
    started = time.monotonic()
    ppl = http_perplexity(ep, text, window, stride, max_text_tokens) if text is not None else None
    results = run_items(ep, items, notes)
    accuracy, num_items = task_accuracy([r for r in results if r.match not in SERVER_ONLY])
    tools = [r for r in results if r.match == "tool_call"]
    js = [r for r in results if r.match == "json_schema"]

    def pct(rs: list[ItemResult]) -> float | None:
        return 100.0 * sum(r.correct for r in rs) / len(rs) if rs else None

    return CandidateResult(
        label=label, quantization="served", dtype=ep.resolve_model(), group_size=None, quantize_lm_head=False,
        weight_bytes=0, kv_blocks=0, load_s=0.0, quant_summary=ep.url, perplexity=ppl, accuracy=accuracy,
        num_items=num_items, items=results, speed=None, eval_s=time.monotonic() - started,
        tool_call_accuracy=pct(tools), json_validity=pct(js), safety=safety_rates(results))


def run(args: Any, items: list[EvalItem], text: str | None) -> tuple[CandidateResult, list[CandidateResult], list[str]]:
    """Base and candidate results over HTTP, plus notes about what was skipped."""
    notes: list[str] = []
    base_ep = Endpoint(args.url, args.api_key, args.served_model)
    eps = [Endpoint(u, args.candidate_api_key or args.api_key, args.served_model) for u in args.candidate_url]
    try:
        needs_logprobs = text is not None or any(it.match == "choice" for it in items)
        for ep in [base_ep, *eps] if needs_logprobs else []:
            try:
                ep.prompt_logprobs(ep.tokenize("Prompt logprobs probe.", add_special_tokens=True))
            except ServerError as exc:
                # Both sides must score the same items: drop what needs prompt logprobs everywhere.
                notes.append(f"choice items and perplexity skipped: {exc}")
                items = [it for it in items if it.match != "choice"]
                text = None
                break
        print(f"tokenmill eval: running {base_ep.url} ...", file=sys.stderr, flush=True)
        base = run_endpoint(base_ep, "base", items, text, args.window, args.stride, args.max_text_tokens, notes)
        cands = []
        for i, ep in enumerate(eps):
            print(f"tokenmill eval: running {ep.url} ...", file=sys.stderr, flush=True)
            label = "candidate" if len(eps) == 1 else f"candidate{i + 1}"
            cands.append(run_endpoint(ep, label, items, text, args.window, args.stride, args.max_text_tokens, notes))
    finally:
        for ep in [base_ep, *eps]:
            ep.close()
    return base, cands, notes

"""Prompt -> token ids for routing, in three grades of fidelity.

1. ``LocalTokenizer``: the model's own tokenizer.json through the
   ``tokenizers`` library. Exact, and no network hop.
2. ``RemoteTokenizer``: a backend's ``POST /tokenize`` (``{"model", "prompt"}``
   -> ``{"tokens": [...]}``). Exact, one loopback/cluster round trip per
   request; results for recent prompts are not cached because prompts rarely
   repeat whole.
3. ``CharChunker``: when neither is available, the prompt's characters stand
   in for tokens and the index works on fixed-size character chunks
   (``chars_per_block``). Shared text prefixes still map to shared chunks, so
   routing still finds overlap; only the block boundaries differ from the
   backend's. The router says which grade it uses in its logs and metrics.

The router never renders the model's chat template: for routing, a chat
request is turned into a canonical text (role and content of each message in
order), which is stable across requests sharing a conversation prefix.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

log = logging.getLogger("tokenmill.router")


@dataclass
class Tokens:
    """Ids plus the block size they should be cut into."""

    ids: list[int]
    block_size: int
    mode: str  # local | remote | chars | ids


class Tokenizer(Protocol):
    mode: str

    async def encode(self, text: str, model: str | None, base_url: str | None) -> Tokens: ...


class CharChunker:
    mode = "chars"

    def __init__(self, chars_per_block: int) -> None:
        self.chars_per_block = chars_per_block

    async def encode(self, text: str, model: str | None = None, base_url: str | None = None) -> Tokens:
        return Tokens([ord(c) for c in text], self.chars_per_block, self.mode)


class LocalTokenizer:
    mode = "local"

    def __init__(self, path: str, block_size: int) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        self._tok = HFTokenizer.from_file(path)
        self.block_size = block_size

    async def encode(self, text: str, model: str | None = None, base_url: str | None = None) -> Tokens:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return Tokens(list(ids), self.block_size, self.mode)


class RemoteTokenizer:
    """Asks a backend; falls back to characters if the backend cannot say."""

    mode = "remote"

    def __init__(self, client: httpx.AsyncClient, block_size: int, fallback: CharChunker,
                 headers: dict[str, str] | None = None, timeout: float = 5.0) -> None:
        self.client = client
        self.block_size = block_size
        self.fallback = fallback
        self.headers = headers or {}
        self.timeout = timeout
        self.unsupported = False  # set once a backend answers 404/405

    async def encode(self, text: str, model: str | None, base_url: str | None) -> Tokens:
        return await self._tokenize({"prompt": text}, text, model, base_url)

    async def encode_messages(self, messages: list, add_generation_prompt: bool, text: str, model: str | None,
                              base_url: str | None) -> Tokens:
        """A chat's prompt exactly as the backend renders it (its template), so that block keys
        line up with the blocks the backend's KV events name; ``text`` if it cannot say."""
        body = {"messages": messages, "add_generation_prompt": add_generation_prompt}
        return await self._tokenize(body, text, model, base_url)

    async def _tokenize(self, body: dict[str, Any], text: str, model: str | None, base_url: str | None) -> Tokens:
        if self.unsupported or base_url is None:
            return await self.fallback.encode(text)
        body = dict(body)
        if model:
            body["model"] = model
        try:
            r = await self.client.post(base_url + "/tokenize", json=body, headers=self.headers,
                                       timeout=self.timeout)
        except httpx.HTTPError as exc:
            log.debug("tokenize on %s failed: %s", base_url, exc)
            return await self.fallback.encode(text)
        if r.status_code == 404 and _error_code(r) == "model_not_found":
            return await self.fallback.encode(text)  # the route exists; this backend serves another name
        if r.status_code in (404, 405, 501):
            log.warning("backend %s has no /tokenize; routing on %d-character chunks",
                        base_url, self.fallback.chars_per_block)
            self.unsupported = True
            return await self.fallback.encode(text)
        if r.status_code != 200:
            return await self.fallback.encode(text)
        try:
            ids = r.json()["tokens"]
            return Tokens([int(t) for t in ids], self.block_size, self.mode)
        except (ValueError, KeyError, TypeError):
            return await self.fallback.encode(text)


def _error_code(r: httpx.Response) -> Any:
    try:
        return r.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def chat_to_text(messages: Any) -> str:
    """A canonical text for a chat request's messages (routing only)."""
    parts: list[str] = []
    if not isinstance(messages, list):
        return ""
    for m in messages:
        if not isinstance(m, dict):
            continue
        role = str(m.get("role", ""))
        content = m.get("content", "")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            content = "".join(
                str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text"
            )
        elif content is None:
            content = ""
        parts.append(f"<|{role}|>\n{content}\n")
    return "".join(parts)


def prompt_of(path: str, body: Any) -> tuple[str | None, list[int] | None]:
    """(text, ids) to route on for an OpenAI request body; batched prompts route on the first."""
    if not isinstance(body, dict):
        return None, None
    if path.endswith("/chat/completions"):
        return chat_to_text(body.get("messages")), None
    if path.endswith("/responses"):  # the Responses API: instructions, then input text or items
        items = body.get("input")
        messages = [{"role": "user", "content": items}] if isinstance(items, str) else items
        if not isinstance(messages, list):
            messages = []
        if isinstance(body.get("instructions"), str):
            messages = [{"role": "system", "content": body["instructions"]}, *messages]
        return chat_to_text(messages), None
    if path.endswith("/messages") or path.endswith("/messages/count_tokens"):  # Anthropic's Messages API
        system = body.get("system")
        lead = [{"role": "system", "content": system}] if isinstance(system, (str, list)) else []
        messages = body.get("messages")
        return chat_to_text(lead + (messages if isinstance(messages, list) else [])), None
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):
            return None, [int(t) for t in prompt if isinstance(t, int)]
        if isinstance(first, str):
            return first, None
        if isinstance(first, list):
            return None, [int(t) for t in first if isinstance(t, int)]
    return None, None

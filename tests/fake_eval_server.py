"""An OpenAI-shaped server over a real in-process engine, for testing `tokenmill eval --url`.

It answers exactly the requests the HTTP eval makes, with the offline eval's
own building blocks (greedy generation, the log-likelihood scorer), so the
HTTP eval can be checked against the offline one number for number:

- ``/tokenize`` (``prompt`` + ``add_special_tokens``, or ``messages`` with the chat template);
- ``/v1/completions``: a token-id prompt with ``echo`` + ``logprobs`` and
  ``max_tokens: 0`` returns prompt logprobs in OpenAI's legacy shape
  (``token_logprobs``, ``top_logprobs``, ``tokens``); a text prompt is
  answered greedily;
- ``/v1/chat/completions``: greedy; ``tools`` are answered with the scripted
  ``tool_call`` and ``response_format`` with the scripted ``json_text``
  (the tiny random model cannot do either), so scoring can be tested;
  ``chat_reply`` scripts every plain chat answer (a stub that refuses or
  complies on cue, for the safety gate).

``echo_logprobs=False`` makes it behave like a server without prompt logprobs.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from fake_backend import free_port
from tokenmill.evaluate.evalset import generate_greedy
from tokenmill.evaluate.scoring import Scorer


@dataclass
class Script:
    tool_call: dict[str, Any] | None = None  # {"name": ..., "arguments": {...}}
    json_text: str | None = None
    echo_logprobs: bool = True
    chat_reply: Callable[[list[dict[str, Any]]], str] | None = None


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                   "code": None}}, status_code=status)


def build_app(engine: Any, script: Script) -> FastAPI:
    app = FastAPI()
    lock = threading.Lock()
    tok = engine.tokenizer
    app.state.requests = []

    def chat_ids(messages: list[dict[str, Any]]) -> list[int]:
        return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": "tiny", "object": "model"}]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await request.json()
        if body.get("messages") is not None:
            ids = chat_ids(body["messages"])
        else:
            ids = tok.encode(body.get("prompt", ""), add_special_tokens=body.get("add_special_tokens", True))
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        app.state.requests.append(body)
        prompt = body["prompt"]
        if body.get("echo") and body.get("logprobs") is not None:
            if not script.echo_logprobs:
                return _error(400, "echo with logprobs is not supported")
            if not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
                prompt = tok.encode(prompt, add_special_tokens=True)
            with lock:
                lp, top = Scorer(engine).score([prompt], [1])[0]
            token_lp = [None] + [float(x) for x in lp]
            tops = [None] + [{tok.decode([int(t)]): float(x)} for t, x in zip(top, lp)]
            return {"id": "cmpl", "object": "text_completion", "model": "tiny", "choices": [{
                "index": 0, "text": tok.decode(prompt), "finish_reason": "length",
                "logprobs": {"tokens": [tok.decode([t]) for t in prompt], "token_logprobs": token_lp,
                             "top_logprobs": tops, "text_offset": list(range(len(prompt)))}}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": 0, "total_tokens": len(prompt)}}
        ids = tok.encode(prompt, add_special_tokens=True)
        with lock:
            text, out = generate_greedy(engine, [("c", ids, int(body.get("max_tokens") or 16),
                                                  body.get("stop") or [])])["c"]
        return {"id": "cmpl", "object": "text_completion", "model": "tiny",
                "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out), "total_tokens": len(ids) + len(out)}}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        app.state.requests.append(body)
        message: dict[str, Any] = {"role": "assistant", "content": None}
        if body.get("tools"):
            if script.tool_call is None:
                return _error(400, "tools are not supported")
            message["tool_calls"] = [{"id": "call_1", "type": "function", "function": {
                "name": script.tool_call["name"], "arguments": json.dumps(script.tool_call["arguments"])}}]
        elif body.get("response_format"):
            if script.json_text is None:
                return _error(400, "response_format is not supported")
            message["content"] = script.json_text
        elif script.chat_reply is not None:
            message["content"] = script.chat_reply(body["messages"])
        else:
            ids = chat_ids(body["messages"])
            with lock:
                text, _ = generate_greedy(engine, [("c", ids, int(body.get("max_tokens") or 16),
                                                    body.get("stop") or [])])["c"]
            message["content"] = text
        return {"id": "chat", "object": "chat.completion", "model": "tiny",
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}

    return app


class EvalServer:
    def __init__(self, engine: Any, script: Script | None = None) -> None:
        self.app = build_app(engine, script or Script())
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "EvalServer":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "fake eval server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)

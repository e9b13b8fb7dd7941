"""A fake OpenAI-compatible model server for router tests and benchmarks.

It simulates what matters to a router and nothing else:

- a per-server LRU prefix cache of chained token blocks with a fixed number
  of blocks, so hit rates depend on where requests are sent;
- a cost model: prefill time per *uncached* prompt token, decode time per
  output token, at most ``max_num_seqs`` requests at once (others wait), so
  load and queueing are real;
- the vLLM-named metrics a router scrapes (`vllm:num_requests_running`,
  `..._waiting`, `vllm:kv_cache_usage_perc`, `vllm:prefix_cache_queries_total`,
  `vllm:prefix_cache_hits_total` in tokens, `vllm:cache_config_info`);
- SSE streaming in OpenAI's wire format, `/tokenize`, `/reset_prefix_cache`,
  `/health` (which `POST /admin/health {"healthy": false}` can fail);
- the Responses API's conversation store: `POST /v1/responses` (plain or
  streamed as typed events, `response.created` first), `previous_response_id`
  answered 404 unless this server produced it, `GET /v1/responses/{id}`;
- a request whose prompt contains ``CRASH_WORD`` kills the process (SIGKILL),
  as a request that crashes a real server would.

Its "tokenizer" maps each whitespace-separated word to a stable id.

Run one: ``python tests/fake_backend.py --port 8001 --name a``. The helpers at
the bottom start several as subprocesses (so a test can SIGKILL one).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse


@dataclass
class FakeConfig:
    name: str = "fake"
    model: str = "fake-model"
    block_size: int = 16
    num_blocks: int = 512
    max_num_seqs: int = 4
    prefill_s_per_token: float = 0.0002
    decode_s_per_token: float = 0.002
    default_max_tokens: int = 8


CRASH_WORD = "__crash_this_backend__"


def tokenize(text: str) -> list[int]:
    return [zlib.crc32(w.encode()) % 32000 for w in text.split()]


def chat_text(messages: list) -> str:
    return "".join(f"{m.get('role', '')}: {m.get('content', '')}\n" for m in messages if isinstance(m, dict))


@dataclass
class FakeEngine:
    cfg: FakeConfig
    cache: OrderedDict = field(default_factory=OrderedDict)
    running: int = 0
    waiting: int = 0
    used_blocks: int = 0
    queries: int = 0
    hits: int = 0
    requests: int = 0
    healthy: bool = True
    reject_status: int = 0  # answer generation requests with this status (0: serve them)

    def __post_init__(self) -> None:
        self.sem = asyncio.Semaphore(self.cfg.max_num_seqs)

    def _keys(self, tokens: list[int]) -> list[int]:
        keys, parent, bs = [], 0, self.cfg.block_size
        for i in range(len(tokens) // bs):
            parent = zlib.crc32(json.dumps([parent, tokens[i * bs:(i + 1) * bs]]).encode())
            keys.append(parent)
        return keys

    def lookup_and_insert(self, tokens: list[int]) -> int:
        """Cached prefix length in tokens (capped at len-1), then cache the full blocks."""
        keys = self._keys(tokens)
        hit_blocks = 0
        for k in keys:
            if k not in self.cache:
                break
            hit_blocks += 1
        cached = min(hit_blocks * self.cfg.block_size, max(0, len(tokens) - 1))
        for k in reversed(keys):  # leaf first, so the root is the most recent
            self.cache[k] = None
            self.cache.move_to_end(k)
        while len(self.cache) > self.cfg.num_blocks:
            self.cache.popitem(last=False)
        self.queries += len(tokens)
        self.hits += cached
        return cached

    async def run(self, tokens: list[int], max_tokens: int):
        """Yield output pieces; the first value yielded is the cached-token count."""
        self.requests += 1
        self.waiting += 1
        try:
            await self.sem.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        blocks = -(-len(tokens) // self.cfg.block_size)
        self.used_blocks += blocks
        try:
            cached = self.lookup_and_insert(tokens)
            yield cached
            await asyncio.sleep(self.cfg.prefill_s_per_token * (len(tokens) - cached))
            for i in range(max_tokens):
                await asyncio.sleep(self.cfg.decode_s_per_token)
                yield f" tok{i}"
        finally:
            self.running -= 1
            self.used_blocks -= blocks
            self.sem.release()

    def metrics(self) -> str:
        m = self.cfg.model
        usage = min(1.0, self.used_blocks / max(1, self.cfg.num_blocks))
        return "\n".join([
            "# TYPE vllm:num_requests_running gauge",
            f'vllm:num_requests_running{{model_name="{m}"}} {self.running}',
            "# TYPE vllm:num_requests_waiting gauge",
            f'vllm:num_requests_waiting{{model_name="{m}"}} {self.waiting}',
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f'vllm:kv_cache_usage_perc{{model_name="{m}"}} {usage}',
            "# TYPE vllm:prefix_cache_queries counter",
            f'vllm:prefix_cache_queries_total{{model_name="{m}"}} {self.queries}',
            "# TYPE vllm:prefix_cache_hits counter",
            f'vllm:prefix_cache_hits_total{{model_name="{m}"}} {self.hits}',
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="{self.cfg.block_size}",num_gpu_blocks="{self.cfg.num_blocks}"}} 1.0',
            "",
        ])


def make_app(cfg: FakeConfig) -> FastAPI:
    app = FastAPI()
    state: dict[str, FakeEngine] = {}

    def engine() -> FakeEngine:
        if "e" not in state:  # created lazily, inside the server's event loop
            state["e"] = FakeEngine(cfg)
        return state["e"]

    async def generate(request: Request, chat: bool):
        body = await request.json()
        if engine().reject_status:
            return JSONResponse({"error": {"message": "rejected", "type": "server_error", "param": None,
                                           "code": engine().reject_status}}, status_code=engine().reject_status)
        text = chat_text(body.get("messages", [])) if chat else str(body.get("prompt", ""))
        if CRASH_WORD in text:
            os.kill(os.getpid(), signal.SIGKILL)
        tokens = tokenize(text)
        max_tokens = int(body.get("max_tokens") or cfg.default_max_tokens)
        rid = f"{cfg.name}-{time.monotonic_ns()}"
        obj = "chat.completion.chunk" if chat else "text_completion"
        gen = engine().run(tokens, max_tokens)
        cached = await gen.__anext__()
        usage = {"prompt_tokens": len(tokens), "completion_tokens": max_tokens,
                 "total_tokens": len(tokens) + max_tokens,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        headers = {"x-fake-backend": cfg.name}

        def choice(piece: str | None, finish: str | None) -> dict:
            if chat:
                return {"index": 0, "delta": {"content": piece} if piece else {}, "finish_reason": finish}
            return {"index": 0, "text": piece or "", "finish_reason": finish}

        if body.get("stream"):
            async def events():
                async for piece in gen:
                    yield f"data: {json.dumps({'id': rid, 'object': obj, 'model': cfg.model, 'choices': [choice(piece, None)]})}\n\n"
                yield f"data: {json.dumps({'id': rid, 'object': obj, 'model': cfg.model, 'choices': [choice(None, 'length')], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
        async def collect() -> str:
            return "".join([p async for p in gen])

        # as the real server does: a client that hangs up stops the generation
        work = asyncio.ensure_future(collect())
        while not work.done():
            await asyncio.wait({work}, timeout=0.05)
            if not work.done() and await request.is_disconnected():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                await gen.aclose()
                return JSONResponse({}, status_code=499)
        text_out = work.result()
        if chat:
            ch = {"index": 0, "message": {"role": "assistant", "content": text_out}, "finish_reason": "length"}
        else:
            ch = {"index": 0, "text": text_out, "finish_reason": "length"}
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "model": cfg.model, "choices": [ch], "usage": usage}, headers=headers)

    stored: dict[str, dict] = {}  # this server's Responses API responses: a conversation lives here only

    def not_found(what: str) -> JSONResponse:
        return JSONResponse({"error": {"message": f"no stored response {what!r}", "type": "invalid_request_error",
                                       "param": "previous_response_id", "code": "response_not_found"}},
                            status_code=404, headers={"x-fake-backend": cfg.name})

    @app.post("/v1/responses")
    async def responses(request: Request):
        body = await request.json()
        prev = body.get("previous_response_id")
        if prev is not None and prev not in stored:
            return not_found(prev)
        text = (stored[prev]["_text"] if prev else "") + " " + str(body.get("input", ""))
        rid = f"resp_{cfg.name}{time.monotonic_ns()}"
        gen = engine().run(tokenize(text), int(body.get("max_output_tokens") or cfg.default_max_tokens))
        await gen.__anext__()
        headers = {"x-fake-backend": cfg.name}

        def response(status: str, out: str) -> dict:
            return {"id": rid, "object": "response", "status": status, "model": cfg.model,
                    "previous_response_id": prev, "output": [{"type": "message", "content": [
                        {"type": "output_text", "text": out}]}]}

        def keep(out: str) -> dict:
            final = response("completed", out)
            stored[rid] = {**final, "_text": text + out}
            return final

        if body.get("stream"):
            async def events():
                def ev(kind: str, **payload) -> str:
                    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload})}\n\n"
                yield ev("response.created", response=response("in_progress", ""))
                out = ""
                async for piece in gen:
                    out += piece
                    yield ev("response.output_text.delta", delta=piece)
                yield ev("response.completed", response=keep(out))
            return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
        return JSONResponse(keep("".join([p async for p in gen])), headers=headers)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        if response_id not in stored:
            return not_found(response_id)
        return JSONResponse({k: v for k, v in stored[response_id].items() if k != "_text"},
                            headers={"x-fake-backend": cfg.name})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": cfg.model, "object": "model", "owned_by": cfg.name}]}

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "ok"} if engine().healthy else {"status": "down"},
                            status_code=200 if engine().healthy else 503)

    @app.post("/admin/health")
    async def set_health(request: Request):
        engine().healthy = bool((await request.json()).get("healthy", True))
        return {"healthy": engine().healthy}

    @app.post("/admin/reject")
    async def set_reject(request: Request):
        engine().reject_status = int((await request.json()).get("status", 0))
        return {"reject_status": engine().reject_status}

    @app.post("/tokenize")
    async def tokenize_endpoint(request: Request):
        body = await request.json()
        text = chat_text(body["messages"]) if "messages" in body else str(body.get("prompt", ""))
        toks = tokenize(text)
        return {"tokens": toks, "count": len(toks)}

    @app.post("/reset_prefix_cache")
    async def reset():
        engine().cache.clear()
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(engine().metrics())

    return app


# -- helpers to run fakes as subprocesses ------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class FakeProcess:
    port: int
    name: str
    args: list[str]
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "FakeProcess":
        cmd = [sys.executable, os.path.abspath(__file__), "--port", str(self.port), "--name", self.name, *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(5)

    def wait_ready(self, timeout: float = 30.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc and self.proc.poll() is not None:
                raise RuntimeError(f"fake backend {self.name} exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"fake backend {self.name} not ready")


def start_fakes(n: int, **cfg) -> list[FakeProcess]:
    args: list[str] = []
    for k, v in cfg.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    fakes = [FakeProcess(free_port(), chr(ord("a") + i), args).start() for i in range(n)]
    for f in fakes:
        f.wait_ready()
    return fakes


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    defaults = FakeConfig()
    for name, value in vars(defaults).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    a = p.parse_args(argv)
    cfg = FakeConfig(**{k: getattr(a, k) for k in vars(defaults)})
    uvicorn.run(make_app(cfg), host=a.host, port=a.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()

"""A tiny fake OpenAI-compatible streaming server with known timings, for tests.

Tokens are whitespace-separated words (so ``/tokenize`` is exact and simple).
Each request streams ``max_tokens`` tokens: the first after ``ttft`` seconds,
the rest ``itl`` seconds apart, scheduled on absolute times so delays don't
drift. A prompt may override both with ``ttft_ms=NN`` / ``itl_ms=NN`` words.
``slots`` limits how many requests stream at once (the rest queue), and a
word-block prefix cache (16 words per block) reports ``cached_tokens``.

Modes: ``ok``, ``500`` (every request fails), ``garbage`` (non-JSON SSE),
``cut`` (connection closed mid-stream), ``no_usage`` (no usage chunk).
Runs on its own event loop in a daemon thread: ``with FakeServer() as srv:``.
"""
from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

BLOCK = 16


@dataclass
class FakeConfig:
    ttft: float = 0.05
    itl: float = 0.01
    mode: str = "ok"
    slots: int = 1000
    model: str = "fake-model"
    metrics: bool = True
    tokenize: bool = True


@dataclass
class _State:
    seen_blocks: set[tuple[str, ...]] = field(default_factory=set)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    queries: int = 0
    hits: int = 0
    queue_sum: float = 0.0
    prefill_sum: float = 0.0
    ttft_sum: float = 0.0
    finished: int = 0
    max_lag: float = 0.0  # worst lateness of a chunk vs its schedule (this machine's jitter)
    running: int = 0
    waiting: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)


class FakeServer:
    def __init__(self, config: FakeConfig | None = None) -> None:
        self.cfg = config or FakeConfig()
        self.state = _State()
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.base_events.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "FakeServer":
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        fut.result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            assert self._server is not None
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _start(self) -> None:
        self._sem = asyncio.Semaphore(self.cfg.slots)
        self._server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    # --- HTTP plumbing ---------------------------------------------------
    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.lower(): v.strip() for k, _, v in
                           (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                keep = await self._handle(method, path, body, writer)
                if not keep:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError,
                asyncio.CancelledError):  # cancelled: the server is shutting down
            pass
        finally:
            writer.close()

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, status: int, body: bytes,
                    ctype: str = "application/json") -> bool:
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: {ctype}\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
        return True

    async def _handle(self, method: str, path: str, body: bytes,
                      writer: asyncio.StreamWriter) -> bool:
        if path == "/health":
            return await self._send(writer, 200, b"{}")
        if path == "/v1/models":
            return await self._send(writer, 200, json.dumps(
                {"object": "list", "data": [{"id": self.cfg.model, "object": "model"}]}).encode())
        if path == "/metrics" and self.cfg.metrics:
            return await self._send(writer, 200, self._metrics().encode(), "text/plain")
        if path == "/tokenize" and self.cfg.tokenize:
            n = len(json.loads(body).get("prompt", "").split())
            return await self._send(writer, 200, json.dumps(
                {"tokens": list(range(n)), "count": n, "max_model_len": 4096}).encode())
        if path == "/reset_prefix_cache" and method == "POST":
            self.state.seen_blocks.clear()
            return await self._send(writer, 200, b"{}")
        if path in ("/v1/completions", "/v1/chat/completions"):
            return await self._generate(path, json.loads(body), writer)
        return await self._send(writer, 404, b'{"error": {"message": "not found"}}')

    # --- generation ------------------------------------------------------
    def _cached(self, words: list[str]) -> int:
        hit = 0
        for i in range(0, len(words) - BLOCK + 1, BLOCK):
            key = tuple(words[: i + BLOCK])
            if key not in self.state.seen_blocks:
                break
            hit += BLOCK
        for i in range(0, len(words) - BLOCK + 1, BLOCK):
            self.state.seen_blocks.add(tuple(words[: i + BLOCK]))
        return min(hit, max(0, len(words) - 1))

    async def _generate(self, path: str, req: dict[str, Any],
                        writer: asyncio.StreamWriter) -> bool:
        arrival = time.perf_counter()
        self.state.requests.append(req)
        if self.cfg.mode == "500":
            return await self._send(writer, 500, json.dumps(
                {"error": {"message": "fake internal error", "type": "server_error",
                           "param": None, "code": 500}}).encode())
        chat = path.endswith("chat/completions")
        text = (" ".join(m["content"] for m in req["messages"]) if chat else req["prompt"])
        words = text.split()
        ttft = self.cfg.ttft
        itl = self.cfg.itl
        if m := re.search(r"ttft_ms=(\d+)", text):
            ttft = int(m.group(1)) / 1000
        if m := re.search(r"itl_ms=(\d+)", text):
            itl = int(m.group(1)) / 1000
        n = int(req.get("max_tokens") or 16)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")

        async def event(obj: Any) -> None:
            data = f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            await writer.drain()

        def chunk(tok: str, finish: str | None = None) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            if chat:
                choice["delta"] = {"content": tok}
            else:
                choice["text"] = tok
            return {"id": "x", "object": "chunk", "model": self.cfg.model, "choices": [choice]}

        self.state.waiting += 1
        async with self._sem:
            self.state.waiting -= 1
            self.state.running += 1
            start = time.perf_counter()
            try:
                if chat:
                    await event({"choices": [{"index": 0, "delta": {"role": "assistant",
                                                                    "content": ""}}]})
                cached = self._cached(words)
                for k in range(n):
                    due = start + ttft + k * itl
                    await asyncio.sleep(max(0.0, due - time.perf_counter()))
                    self.state.max_lag = max(self.state.max_lag, time.perf_counter() - due)
                    if k == 0:
                        self.state.ttft_sum += time.perf_counter() - arrival
                    if self.cfg.mode == "garbage" and k == 1:
                        await event("this is not json")
                    if self.cfg.mode == "cut" and k == 2:
                        writer.close()
                        return False
                    await event(chunk(f" w{k}", "length" if k == n - 1 else None))
                if self.cfg.mode != "no_usage":
                    await event({"id": "x", "choices": [], "usage": {
                        "prompt_tokens": len(words), "completion_tokens": n,
                        "total_tokens": len(words) + n,
                        "prompt_tokens_details": {"cached_tokens": cached}}})
                await event("[DONE]")
                writer.write(b"0\r\n\r\n")
                await writer.drain()
            finally:
                self.state.running -= 1
        st = self.state
        st.prompt_tokens += len(words)
        st.generation_tokens += n
        st.queries += len(words)
        st.hits += cached
        st.queue_sum += start - arrival
        st.prefill_sum += ttft
        st.finished += 1
        return True

    def _metrics(self) -> str:
        s = self.state
        m = 'model_name="fake"'
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{m}}} {s.running}",
            f"vllm:num_requests_waiting{{{m}}} {s.waiting}",
            f"vllm:kv_cache_usage_perc{{{m}}} 0.5",
            f"vllm:prompt_tokens_total{{{m}}} {s.prompt_tokens}",
            f"vllm:generation_tokens_total{{{m}}} {s.generation_tokens}",
            f"vllm:prefix_cache_queries_total{{{m}}} {s.queries}",
            f"vllm:prefix_cache_hits_total{{{m}}} {s.hits}",
        ]
        for name, total in (("request_queue_time_seconds", s.queue_sum),
                            ("request_prefill_time_seconds", s.prefill_sum),
                            ("time_to_first_token_seconds", s.ttft_sum)):
            lines += [f'vllm:{name}_bucket{{{m},le="+Inf"}} {s.finished}',
                      f"vllm:{name}_sum{{{m}}} {total}",
                      f"vllm:{name}_count{{{m}}} {s.finished}"]
        return "\n".join(lines) + "\n"

"""``x-request-id`` on every response: the client's own when it sent one, else a new one.

Why: clients and proxies correlate their logs with the server's by this
header (OpenAI's SDKs expose it as ``response._request_id``). A client value
is echoed only when it is short printable ASCII, so it cannot inject headers.
"""
from __future__ import annotations

import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"
_MAX_LEN = 200


def _client_id(scope: Scope) -> bytes | None:
    for name, value in scope.get("headers", ()):
        if name == HEADER:
            if 0 < len(value) <= _MAX_LEN and all(0x21 <= b < 0x7F for b in value):
                return value
            return None
    return None


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _client_id(scope) or uuid.uuid4().hex.encode()
        scope.setdefault("state", {})["request_id"] = request_id.decode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                headers.append((HEADER, request_id))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)

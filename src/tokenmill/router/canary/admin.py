"""``GET/POST /admin/split``: read or change the canary split at run time.

Guarded by ``--admin-key`` (default: the router's ``--api-key``); with no key
at all only loopback clients may use it, so an unprotected router cannot have
its traffic redirected from the network.

    POST /admin/split {"split": {"int4": 25}}   -> int4 25%, the base 75%
    POST /admin/split {"int4": 0}               -> manual rollback
"""
from __future__ import annotations

import hmac
import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

_LOOPBACK = {"127.0.0.1", "::1", "localhost"}


def _error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}},
                        status_code=status)


def split_routes(router: Any) -> list[Route]:
    canary = router.canary

    def allowed(request: Request) -> bool:
        key = canary.config.admin_key or router.config.api_key
        if not key:
            return request.client is not None and request.client.host in _LOOPBACK
        got = request.headers.get("authorization", "")
        return hmac.compare_digest(got.encode(), f"Bearer {key}".encode())

    async def get_split(request: Request) -> Response:
        if not allowed(request):
            return _error(401, "invalid admin key", "authentication_error", "invalid_api_key")
        return JSONResponse(canary.snapshot())

    async def post_split(request: Request) -> Response:
        if not allowed(request):
            return _error(401, "invalid admin key", "authentication_error", "invalid_api_key")
        try:
            body = json.loads(await request.body())
        except RecursionError:
            return _error(400, "request body is nested too deeply", code="invalid_json")
        except ValueError:
            return _error(400, "request body is not valid JSON", code="invalid_json")
        if isinstance(body, dict) and "split" in body:
            body = body["split"]
        if not isinstance(body, dict) or not body or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in body.items()):
            return _error(400, "give {\"split\": {\"VARIANT\": PERCENT, ...}} with numeric percentages", code="bad_split")
        try:
            canary.set_split(body, reason="admin")
        except ValueError as exc:
            return _error(400, str(exc), code="bad_split")
        return JSONResponse(canary.snapshot())

    return [Route("/admin/split", get_split, methods=["GET"]), Route("/admin/split", post_split, methods=["POST"])]

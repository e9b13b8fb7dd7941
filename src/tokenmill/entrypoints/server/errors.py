"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Why a module of its own: every way a request can fail (pydantic validation,
malformed JSON, an unknown route, our own checks, an engine that refuses)
must end in the same body shape with a 4xx, so SDKs raise the right
exception class and show the message. FastAPI's 422 becomes a 400, as
OpenAI answers.
"""
from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("tokenmill.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """Raised by handlers; rendered as an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | int | None = None,
               type: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type or _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


class _AsciiJSONResponse(JSONResponse):
    """Error bodies may quote client input; ASCII escapes keep them encodable whatever it held."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(status: int, message: str, param: str | None = None, code: str | int | None = None,
                   type: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return _AsciiJSONResponse(error_body(status, message, param, code, type), status_code=status,
                              headers=headers)


def _describe_validation(errors: list[Any]) -> tuple[str, str | None]:
    """One readable sentence and the offending parameter from pydantic's error list."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    # pydantic adds the union member tag ('str', 'list[int]', ...) to locations; drop those
    loc = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int", "float", "bool")]
    param = loc[0] if loc else None
    kind = first.get("type", "")
    msg = str(first.get("msg", "invalid value"))
    if kind == "json_invalid":
        ctx = first.get("ctx") or {}
        return f"malformed JSON body: {ctx.get('error', msg)}", None
    if kind == "value_error":  # our model validators: the message names the field
        text = msg.removeprefix("Value error, ")
        field, sep, _ = text.partition(":")
        if sep and " " not in field:
            param = field
        return text, param
    if not loc and kind in ("model_attributes_type", "dict_type", "model_type"):
        return "the request body must be a JSON object", None
    where = ".".join(loc) if loc else "body"
    if kind == "missing":
        return f"{where}: field required", param
    if len(errors) > 1 and kind in ("string_type", "int_type", "list_type", "float_type", "bool_type"):
        # a union field: say what it accepts rather than the first member's complaint
        return f"{where}: invalid type ({msg})", param
    return f"{where}: {msg}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.type, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation(list(exc.errors()))
        return error_response(400, message, param, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404 and detail == "Not Found":
            detail = f"no route for {request.method} {request.url.path}"
        return error_response(exc.status_code, detail, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}")

"""Who may call what: one ASGI middleware in front of every route of the server.

Why deny by default: a gate that lists the *protected* prefixes and compares
them with ``scope["path"]`` is bypassed by anything that changes the path
without changing the route it reaches. Behind ``--root-path /api`` uvicorn
puts the prefix in front of every path, so ``/api/v1/models`` matched no
protected prefix and was served without a key. Here the rule is the other
way round: every path needs a credential except the few in ``OPEN_ROUTES``,
and the path compared is the one the router matches (the root path removed
exactly as Starlette removes it, ``route_path``), so what is checked is what
is served, whatever the root path, proxy or mount in front.

``identify`` is the one place that decides which credential a request
presents and whether it is valid; ``decide`` turns that into the verdict for
the request's route. A new kind of credential is a new branch in ``identify``
and, if it carries an identity, a field of ``Presented``: a Bearer key is
looked up in the tenant directory (gateway/tenants.py: the keys file's hashed keys and
the ``--api-key`` keys, the latter the ``default`` tenant), and the tenant it
names rides in the scope (``tenants.TENANT_SCOPE_KEY``) to the handlers; a
console session is the default tenant. Routes in ``OPERATOR_ROUTES`` answer 403
to any caller but the operator (``tenants.is_operator``). A ``--router-api-key``
is the one credential trusted to name the tenant a request is sent for (and a
class no better than that tenant's): ``judge`` asks ``TenantDirectory.delegated``;
any other caller's tenant headers change nothing.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Literal

from starlette.types import ASGIApp, Receive, Scope, Send

from ..console.console_auth import _SAFE_METHODS, ConsoleSessions, bearer_token, same_origin
from .errors import error_body
from ...gateway.tenants import TENANT_SCOPE_KEY, Tenant, TenantDirectory, is_operator

# Routes served without a credential: liveness and metrics for probes and scrapers, the API's
# schema pages, and the console's sign-in page and form (the page itself shows the form to a
# visitor without a session; console.py). Compared exactly with the route path: "/health/" or
# "/health/x" are not open.
OPEN_ROUTES: frozenset[str] = frozenset({
    "/health", "/ping", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc",
    "/", "/ui/login", "/ui/logout",
})

# Routes only the operator may call (tenants.is_operator: an ``--api-key`` key or the console's
# session); a tenant's valid key gets 403. Flushing a cache every tenant shares and the console's
# stats (every tenant's usage and place) are the operator's. Adapter loading is not listed: a tenant
# may load from its own ``adapter_dirs`` (adapter_routes.py decides), and the usage route answers a
# tenant with its own counters only.
OPERATOR_ROUTES: frozenset[str] = frozenset({"/reset_prefix_cache", "/v1/engine/stats"})

CredentialKind = Literal["bearer", "cookie", "none"]
Verdict = Literal["open", "ok", "unauthorized", "cross_origin", "forbidden"]


@dataclass(frozen=True)
class Presented:
    """The credential a request presents: its kind, and whether it is valid."""

    kind: CredentialKind
    valid: bool
    tenant: Tenant | None = None  # whose key it is (Bearer keys looked up in the tenant directory)
    router: bool = False  # a --router-api-key: the request may name the tenant it is sent for


def route_path(scope: Scope) -> str:
    """The path the app's router will match: ``scope["path"]`` less the root path.

    The same rule as Starlette's routing (the root path is removed only when
    the path starts with it followed by ``/`` or nothing), so a request is
    judged by the route that will answer it."""
    path: str = scope.get("path", "") or ""
    root: str = scope.get("root_path", "") or ""
    if root and path.startswith(root):
        if path == root:
            return ""
        if path[len(root)] == "/":
            return path[len(root):]
    return path


def identify(scope: Scope, sessions: ConsoleSessions, tenants: TenantDirectory | None = None) -> Presented:
    """Which credential the request presents and whether it is valid.

    ``Authorization: Bearer KEY`` (or ``x-api-key: KEY``) is looked at first; a request that sends a
    wrong key is refused even if it also carries a session cookie."""
    headers = {k.lower(): v for k, v in scope.get("headers") or []}
    given = bearer_token(headers.get(b"authorization"))
    if given is None:
        given = headers.get(b"x-api-key")  # the header Anthropic's clients send the key in
    if given is not None:
        key = given.decode("latin-1")
        if tenants is not None:
            tenant = tenants.lookup(key)
            return Presented("bearer", tenant is not None, tenant, tenant is not None and tenants.is_router(key))
        return Presented("bearer", sessions.key_matches(key))
    token = sessions.token_of(scope)
    if token is not None:
        return Presented("cookie", sessions.valid(token))
    return Presented("none", False)


def decide(scope: Scope, sessions: ConsoleSessions, tenants: TenantDirectory | None = None) -> Verdict:
    """The verdict for one request: served without a credential, allowed, or refused (and why)."""
    return judge(scope, sessions, tenants)[0]


def judge(scope: Scope, sessions: ConsoleSessions,
          tenants: TenantDirectory | None = None) -> tuple[Verdict, Tenant | None]:
    """``decide``'s verdict and the tenant the request acts for (None: no key checked, or a console
    session): the key's own, or for a router key the tenant its headers name (``delegated``)."""
    enabled = sessions.enabled or (tenants is not None and tenants.enabled)
    if not enabled or route_path(scope) in OPEN_ROUTES:
        return "open", None
    presented = identify(scope, sessions, tenants)
    if not presented.valid:
        return "unauthorized", None
    if presented.kind == "cookie" and scope.get("method", "GET") not in _SAFE_METHODS and not same_origin(scope):
        return "cross_origin", None  # a browser sends the cookie on other sites' forms too
    tenant = presented.tenant
    if presented.router and tenants is not None:
        tenant = tenants.delegated({k.lower(): v for k, v in scope.get("headers") or []})
    if route_path(scope) in OPERATOR_ROUTES and not is_operator(tenant):
        return "forbidden", tenant
    return "ok", tenant


class AuthMiddleware:
    """Refuses every request ``decide`` does not allow, before routing and before the body is read."""

    def __init__(self, app: ASGIApp, sessions: ConsoleSessions,
                 on_reject: Callable[[], None] | None = None, tenants: TenantDirectory | None = None) -> None:
        self.app = app
        self.sessions = sessions
        self.tenants = tenants
        self.on_reject = on_reject or (lambda: None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        verdict, tenant = judge(scope, self.sessions, self.tenants)
        if verdict in ("open", "ok"):
            if tenant is not None:
                scope[TENANT_SCOPE_KEY] = tenant
            await self.app(scope, receive, send)
            return
        self.on_reject()
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        if verdict == "unauthorized":
            await _reject(send, 401, "missing or incorrect API key (send 'Authorization: Bearer KEY')",
                          "invalid_api_key", [(b"www-authenticate", b"Bearer")])
        elif verdict == "forbidden":
            await _reject(send, 403, "this route needs the operator's API key (an --api-key key); "
                          "a tenant's key cannot call it", "operator_only", [])
        else:
            await _reject(send, 403, "cross-origin request with the console's session cookie refused "
                          "(send 'Authorization: Bearer KEY')", "cross_origin", [])


async def _reject(send: Send, status: int, message: str, code: str, extra: list[tuple[bytes, bytes]]) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})

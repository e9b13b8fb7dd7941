"""Signing in to the web console when the server has an API key.

Why a session cookie: the console is a page a person opens in a browser,
which cannot send an ``Authorization`` header on a plain navigation. So
``GET /`` without a credential answers 401 with a small login form; a right
key posted to ``POST /ui/login`` opens a session and sets a cookie, and from
then on the cookie is a credential for the page, its assets and the API
calls it makes (``/v1/engine/stats``, ``/v1/chat/completions``). API clients
keep sending ``Authorization: Bearer KEY``, which works as before.

- The cookie holds a random session token (256 bits from ``secrets``), never
  the key or anything derived from it. The server keeps only SHA-256 digests
  of live tokens, in memory: a cookie made by another server, by this one
  before a restart, or before a logout, matches nothing. Sessions expire
  after ``SESSION_TTL_S``; at most ``MAX_SESSIONS`` live at once (the oldest
  go first).
- The cookie is ``HttpOnly`` (page scripts cannot read it), ``SameSite=Strict``
  (other sites' pages do not send it), ``Path=/``, ``Secure`` over https.
  Its name carries the port (``tokenmill_session_8000``) because cookies are
  shared between all ports of a host: two servers on one machine would
  otherwise overwrite each other's session.
- CSRF: SameSite treats every port of a host as the same site, so a page on
  ``127.0.0.1:9999`` could still make the browser POST to ``127.0.0.1:8000``
  with the cookie. A cookie-authenticated request that can change something
  (any method but GET/HEAD/OPTIONS) must come from the server's own origin:
  its ``Origin`` header, when present, must name the host the request was
  sent to; without one, ``Sec-Fetch-Site`` (when present) must say
  ``same-origin``. Bearer requests need no such check: a browser never adds
  that header on its own.
- Keys are compared in constant time (``hmac.compare_digest`` over SHA-256
  digests, so not even the length leaks). The ``Bearer`` scheme name is
  matched in any letter case (RFC 9110 makes auth schemes case-insensitive).
- Guessing is slowed: after ``LoginThrottle.free_attempts`` wrong keys from one
  client address, each further wrong key makes it wait (1 s, then twice as
  long each time, up to ``max_delay_s``); until then sign-in answers 429 with ``Retry-After``
  without looking at the key. A right key clears the count. Behind a reverse
  proxy every client shares the proxy's address, so they share the delay,
  unless the proxy is named in ``--forwarded-allow-ips``: only then is its
  ``X-Forwarded-For`` believed (lifecycle.py), so no client can choose its own
  address and with it a fresh count.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence
from urllib.parse import urlsplit

from starlette.requests import cookie_parser
from starlette.types import Scope

from ...gateway.credentials import bearer_token  # noqa: F401 - re-exported for the server's modules

SESSION_TTL_S = 12 * 3600
LOGIN_FREE_ATTEMPTS = 3
LOGIN_BASE_DELAY_S = 1.0
LOGIN_MAX_DELAY_S = 300.0
LOGIN_CLIENTS = 4096  # addresses remembered at most (the longest idle go first)
MAX_SESSIONS = 1024
COOKIE_BASE = "tokenmill_session"
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

Credential = Literal["bearer", "cookie"]


def _digest(value: str | bytes) -> bytes:
    return hashlib.sha256(value.encode() if isinstance(value, str) else value).digest()


def _headers(scope: Scope) -> dict[bytes, bytes]:
    return {k.lower(): v for k, v in scope.get("headers") or []}


def cookie_name(host: str) -> str:
    """The session cookie's name for a request sent to ``host`` (the Host header)."""
    host = host.strip()
    if host.endswith("]") or ":" not in host:  # no port ("example.com", "[::1]")
        return COOKIE_BASE
    port = host.rpartition(":")[2]
    return f"{COOKIE_BASE}_{port}" if port.isdigit() else COOKIE_BASE


def _netloc(scheme: str, netloc: str) -> str:
    """host[:port] lowercased, the scheme's default port dropped."""
    netloc = netloc.lower()
    default = {"http": ":80", "https": ":443", "ws": ":80", "wss": ":443"}.get(scheme)
    if default and netloc.endswith(default):
        netloc = netloc[: -len(default)]
    return netloc


def same_origin(scope: Scope) -> bool:
    """Whether a browser says this request comes from a page of this very server.

    ``Origin`` is compared with the Host header (host and port; the scheme is
    left out so a TLS-terminating proxy in front does not break it). Requests
    without either header come from non-browser clients or old browsers and
    pass (SameSite=Strict still keeps other sites' cookies away)."""
    headers = _headers(scope)
    origin = headers.get(b"origin")
    if origin is not None:
        text = origin.decode("latin-1").strip()
        if text == "null":
            return False
        parsed = urlsplit(text)
        if not parsed.scheme or not parsed.netloc:
            return False
        scheme = scope.get("scheme", "http")
        host = headers.get(b"host", b"").decode("latin-1")
        return _netloc(parsed.scheme, parsed.netloc) == _netloc(scheme, host)
    site = headers.get(b"sec-fetch-site")
    if site is not None:
        return site.lower() in (b"same-origin", b"none")
    return True


@dataclass
class LoginThrottle:
    """Failed sign-ins per client address, and when each may try again (exponential delay)."""

    free_attempts: int = LOGIN_FREE_ATTEMPTS
    base_delay_s: float = LOGIN_BASE_DELAY_S
    max_delay_s: float = LOGIN_MAX_DELAY_S
    max_clients: int = LOGIN_CLIENTS
    clock: Callable[[], float] = time.monotonic
    _failures: "OrderedDict[str, tuple[int, float]]" = field(default_factory=OrderedDict)  # client -> (count, next try)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def wait_s(self, client: str) -> float:
        """Seconds before ``client`` may try a key again (0: now)."""
        with self._lock:
            entry = self._failures.get(client)
            return 0.0 if entry is None else max(0.0, entry[1] - self.clock())

    def failed(self, client: str) -> float:
        """Count a wrong key; returns the delay now imposed on the client."""
        now = self.clock()
        with self._lock:
            count = self._failures.pop(client, (0, 0.0))[0] + 1
            extra = count - self.free_attempts
            delay = 0.0 if extra <= 0 else min(self.max_delay_s, self.base_delay_s * 2.0 ** (extra - 1))
            self._failures[client] = (count, now + delay)
            while len(self._failures) > self.max_clients:
                self._failures.popitem(last=False)
            return delay

    def succeeded(self, client: str) -> None:
        with self._lock:
            self._failures.pop(client, None)


def client_address(scope: Scope) -> str:
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


@dataclass
class ConsoleSessions:
    """The API key and the console's live sessions (one per server)."""

    api_key: str | Sequence[str] | None  # several keys: any of them is accepted
    ttl_s: float = SESSION_TTL_S
    max_sessions: int = MAX_SESSIONS
    clock: Callable[[], float] = time.monotonic
    _live: "OrderedDict[bytes, float]" = field(default_factory=OrderedDict)  # digest(token) -> expiry
    _lock: threading.Lock = field(default_factory=threading.Lock)
    throttle: LoginThrottle = field(default_factory=LoginThrottle)

    def __post_init__(self) -> None:
        keys = [self.api_key] if isinstance(self.api_key, str) else [k for k in self.api_key or [] if k]
        keys = [k for k in keys if k]
        self._key_digests = [_digest(k) for k in keys]
        # kept for `enabled` and older callers: the first key's digest
        self._key_digest = self._key_digests[0] if keys else None

    @property
    def enabled(self) -> bool:
        """Whether a credential is needed at all (an API key is configured)."""
        return self._key_digest is not None

    # -- keys and tokens ---------------------------------------------------------
    def key_matches(self, given: str) -> bool:
        return _any_digest(_digest(given), self._key_digests)

    def open(self) -> str:
        """A new session; returns the token the cookie carries."""
        token = secrets.token_urlsafe(32)
        now = self.clock()
        with self._lock:
            self._prune(now)
            while len(self._live) >= self.max_sessions:
                self._live.popitem(last=False)
            self._live[_digest(token)] = now + self.ttl_s
        return token

    def valid(self, token: str | None) -> bool:
        if not token or self._key_digest is None:
            return False
        with self._lock:
            expiry = self._live.get(_digest(token))
            if expiry is None:
                return False
            if expiry <= self.clock():
                del self._live[_digest(token)]
                return False
            return True

    def close(self, token: str | None) -> None:
        if token:
            with self._lock:
                self._live.pop(_digest(token), None)

    def _prune(self, now: float) -> None:
        for digest in [d for d, expiry in self._live.items() if expiry <= now]:
            del self._live[digest]

    @property
    def num_live(self) -> int:  # not __len__: an empty store must not be falsy
        return len(self._live)

    # -- requests ---------------------------------------------------------------
    def token_of(self, scope: Scope) -> str | None:
        """The session token the request's cookie carries for this server, if any."""
        headers = _headers(scope)
        raw = headers.get(b"cookie")
        if not raw:
            return None
        name = cookie_name(headers.get(b"host", b"").decode("latin-1"))
        return cookie_parser(raw.decode("latin-1")).get(name) or None

    def credential(self, scope: Scope) -> Credential | None:
        """Which valid credential the request carries: the Bearer key, a live session cookie, or none."""
        if self._key_digest is None:
            return None
        given = bearer_token(_headers(scope).get(b"authorization"))  # the scheme in any letter case
        if given is not None and _any_digest(_digest(given), self._key_digests):
            return "bearer"
        if self.valid(self.token_of(scope)):
            return "cookie"
        return None

    def check(self, scope: Scope) -> Literal["ok", "unauthorized", "cross_origin"]:
        """The gate's verdict for a request to something behind the key."""
        if not self.enabled:
            return "ok"
        cred = self.credential(scope)
        if cred is None:
            return "unauthorized"
        if cred == "cookie" and scope.get("method", "GET") not in _SAFE_METHODS and not same_origin(scope):
            return "cross_origin"
        return "ok"

    def cookie_header(self, scope: Scope, token: str | None) -> str:
        """``Set-Cookie`` value that stores ``token`` (or, for None, deletes the cookie)."""
        name = cookie_name(_headers(scope).get(b"host", b"").decode("latin-1"))
        attrs = "Path=/; HttpOnly; SameSite=Strict"
        if scope.get("scheme") == "https":
            attrs += "; Secure"
        if token is None:
            return f"{name}=; {attrs}; Max-Age=0"
        return f"{name}={token}; {attrs}; Max-Age={int(self.ttl_s)}"


def _any_digest(given: bytes, digests: Sequence[bytes]) -> bool:
    """Whether ``given`` equals one of ``digests``; compares against every one, so
    the time taken does not tell which key (if any) matched."""
    found = False
    for digest in digests:
        found |= hmac.compare_digest(given, digest)
    return found


def login_page(error: str | None = None) -> str:
    """The sign-in form: self-contained (inline style, no script, nothing fetched), no engine data."""
    message = f'<p class="err" role="alert">{_escape(error)}</p>' if error else ""
    return _LOGIN_TEMPLATE.replace("{message}", message)


def _escape(text: str) -> str:
    return (text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace('"', "&quot;"))


LOGIN_HEADERS: dict[str, str] = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
                               "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",  # "no-referrer" would make Chromium send "Origin: null" with the form
}


_LOGIN_TEMPLATE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>tokenmill console: sign in</title>
<link rel="icon" href="data:,">
<style>
  :root { font-family: system-ui, -apple-system, "Segoe UI", "DejaVu Sans", sans-serif; font-size: 14px;
          color: #1f2430; background: #f4f5f7; }
  body { margin: 0; min-height: 100vh; display: flex; flex-direction: column; }
  header { padding: 10px 18px; background: #111827; color: #f9fafb; font-weight: 700; font-size: 17px; }
  main { flex: 1; display: flex; align-items: flex-start; justify-content: center; padding-top: 12vh; }
  form { background: #fff; border: 1px solid #e3e6eb; border-radius: 10px; padding: 18px 20px; width: 340px;
         display: flex; flex-direction: column; gap: 10px; }
  h1 { font-size: 16px; margin: 0; }
  p { margin: 0; color: #6b7280; line-height: 1.4; }
  label { display: flex; flex-direction: column; gap: 4px; font-size: 12.5px; color: #6b7280; }
  input { font: inherit; border: 1px solid #cfd4dc; border-radius: 6px; padding: 6px 8px; }
  button { font: inherit; border: 1px solid #2563eb; background: #2563eb; color: #fff; border-radius: 6px;
           padding: 6px 14px; cursor: pointer; align-self: flex-start; }
  .err { color: #dc2626; }
</style>
</head>
<body>
<header>tokenmill</header>
<main>
<form id="login-form" method="post" action="/ui/login">
  <h1>Sign in to the console</h1>
  <p>This server needs its API key.</p>
  {message}
  <label for="key">API key
    <input id="key" name="key" type="password" autocomplete="current-password" required autofocus></label>
  <button type="submit">Sign in</button>
</form>
</main>
</body>
</html>
"""

"""The console behind the API key (fast, tiny model): the login form, the
session cookie, the page's API calls on the cookie alone, logout, sessions
from elsewhere, and cross-origin writes refused; Bearer clients unchanged."""
from __future__ import annotations

import json
import re
from typing import Any, Iterator

import pytest
from fastapi.testclient import TestClient

from test_server_support import make_tiny_app
from tokenmill.entrypoints.console.console import mount_console
from tokenmill.entrypoints.console.console_auth import ConsoleSessions, LoginThrottle, bearer_token, cookie_name, same_origin

KEY = "s3cret-console-key"
ORIGIN = "http://testserver"  # TestClient's own origin
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}}


def _app(api_key: str | None) -> Any:
    app = make_tiny_app(api_key=api_key)
    mount_console(app)
    return app


@pytest.fixture(scope="module")
def keyed() -> Iterator[Any]:
    app = _app(KEY)
    yield app
    app.state.tokenmill.aengine.shutdown()


def _login(client: TestClient, key: str = KEY, **headers: str) -> Any:
    """The form's POST, with the browser's same-origin Origin header unless ``headers`` say otherwise."""
    return client.post("/ui/login", data={"key": key}, headers=headers or {"Origin": ORIGIN},
                       follow_redirects=False)


def _chat(client: TestClient, **headers: str) -> tuple[int, str]:
    with client.stream("POST", "/v1/chat/completions", json=CHAT, headers=headers) as r:
        return r.status_code, r.read().decode()


def _error(r: Any, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and "type" in err


# ---- no key configured: nothing changes ------------------------------------------------------

def test_without_a_key_the_console_is_open():
    app = _app(None)
    try:
        with TestClient(app) as client:
            page = client.get("/")
            assert page.status_code == 200 and '<script src="/console/app.js">' in page.text
            assert client.get("/console/app.js").status_code == 200
            assert client.get("/v1/engine/stats").json()["model"]["api_key_required"] is False
            status, text = _chat(client)
            assert status == 200 and "data: [DONE]" in text
            r = client.post("/ui/login", data={"key": "anything"}, follow_redirects=False)
            assert r.status_code == 303 and r.headers["location"] == "/" and "set-cookie" not in r.headers
    finally:
        app.state.tokenmill.aengine.shutdown()


# ---- with a key ---------------------------------------------------------------------------------

def test_page_and_assets_need_a_credential_and_the_login_page_tells_nothing(keyed):
    with TestClient(keyed) as client:
        page = client.get("/")
        assert page.status_code == 401 and page.headers["content-type"].startswith("text/html")
        html = page.text
        assert 'action="/ui/login"' in html and 'method="post"' in html and 'name="key"' in html
        assert page.headers["cache-control"] == "no-store" and "frame-ancestors 'none'" in \
            page.headers["content-security-policy"]
        # self-contained and silent about the engine: no scripts, no assets, no model, no figures
        assert "<script" not in html and "/console/" not in html and "/v1/" not in html
        assert not re.search(r'(?:src|href)="(?!data:)', html)
        for secret in ("tiny", "float32", "running", "kv", "blocks"):
            assert secret not in html.lower(), secret
        for asset in ("/console/app.js", "/console/app.css", "/console/index.html"):
            _error(client.get(asset), 401, "invalid_api_key")
        _error(client.get("/v1/engine/stats"), 401, "invalid_api_key")


def test_wrong_key_reshows_the_form_with_401_and_no_cookie(keyed):
    with TestClient(keyed) as client:
        for wrong in ("nope", KEY + "x", KEY[:-1], ""):
            r = _login(client, wrong)
            assert r.status_code == 401 and "not right" in r.text and 'name="key"' in r.text
            assert "set-cookie" not in r.headers
        assert not client.cookies
        assert client.get("/").status_code == 401
    keyed.state.console_sessions.throttle.succeeded("testclient")  # the next tests sign in at once


def test_login_sets_a_strict_httponly_session_cookie_that_the_page_and_api_accept(keyed):
    with TestClient(keyed) as client:
        r = _login(client)
        assert r.status_code == 303 and r.headers["location"] == "/"
        cookie = r.headers["set-cookie"]
        name, _, rest = cookie.partition("=")
        token = rest.split(";")[0]
        attrs = [a.strip().lower() for a in cookie.split(";")[1:]]
        assert name == "tokenmill_session"
        assert {"httponly", "samesite=strict", "path=/"} <= set(attrs), cookie
        assert "secure" not in attrs  # plain http: a Secure cookie would never come back
        assert KEY not in cookie and len(token) >= 40  # a random token, not the key

        page = client.get("/")  # the cookie alone, no header
        assert page.status_code == 200 and '<script src="/console/app.js">' in page.text
        assert client.get("/console/app.js").status_code == 200
        stats = client.get("/v1/engine/stats")
        assert stats.status_code == 200 and stats.json()["model"]["api_key_required"] is True
        assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
        # the page's streaming chat, as a browser sends it (same-origin Origin header)
        status, text = _chat(client, Origin=ORIGIN)
        assert status == 200 and "data: [DONE]" in text and '"usage"' in text
        status, _ = _chat(client, **{"Sec-Fetch-Site": "same-origin"})
        assert status == 200


def test_bearer_header_still_works_everywhere_without_a_cookie(keyed):
    with TestClient(keyed) as client:
        auth = {"Authorization": f"Bearer {KEY}"}
        assert client.get("/", headers=auth).status_code == 200
        assert client.get("/console/app.css", headers=auth).status_code == 200
        assert client.get("/v1/engine/stats", headers=auth).status_code == 200
        # API clients are not browsers: a foreign Origin does not matter with the header
        status, text = _chat(client, Origin="http://elsewhere.example", **auth)
        assert status == 200 and "data: [DONE]" in text
        _error(client.get("/v1/engine/stats", headers={"Authorization": "Bearer wrong"}), 401, "invalid_api_key")
        assert not client.cookies


def test_cookies_from_elsewhere_are_rejected(keyed):
    with TestClient(keyed) as client:
        assert _login(client).status_code == 303
        ours = client.cookies["tokenmill_session"]
    other_same_key = _app(KEY)
    other_key = _app("another-key")
    try:
        for app in (other_same_key, other_key):
            with TestClient(app) as client:
                client.cookies.set("tokenmill_session", ours)
                assert client.get("/").status_code == 401
                _error(client.get("/v1/engine/stats"), 401, "invalid_api_key")
        with TestClient(other_key) as client:
            assert _login(client, "another-key").status_code == 303
            theirs = client.cookies["tokenmill_session"]
    finally:
        other_same_key.state.tokenmill.aengine.shutdown()
        other_key.state.tokenmill.aengine.shutdown()
    with TestClient(keyed) as client:
        for forged in (theirs, KEY, ours[:-1] + ("A" if ours[-1] != "A" else "B"), ""):
            client.cookies.set("tokenmill_session", forged)
            assert client.get("/").status_code == 401, forged
            _error(client.get("/v1/engine/stats"), 401, "invalid_api_key")
        client.cookies.set("tokenmill_session", ours)
        assert client.get("/").status_code == 200  # and the genuine one still works


def test_logout_clears_the_cookie_and_ends_the_session_on_the_server(keyed):
    with TestClient(keyed) as client:
        assert _login(client).status_code == 303
        token = client.cookies["tokenmill_session"]
        assert client.get("/v1/engine/stats").status_code == 200
        r = client.post("/ui/logout", headers={"Origin": ORIGIN}, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/"
        cleared = r.headers["set-cookie"]
        assert cleared.startswith("tokenmill_session=;") and "max-age=0" in cleared.lower()
        assert "tokenmill_session" not in client.cookies
        assert client.get("/").status_code == 401
        client.cookies.set("tokenmill_session", token)  # replaying the old cookie does not help
        assert client.get("/").status_code == 401
        _error(client.get("/v1/engine/stats"), 401, "invalid_api_key")


@pytest.mark.parametrize("headers", [
    {"Origin": "http://evil.example"},
    {"Origin": "http://testserver:9999"},  # another port of the same host is the same *site*
    {"Origin": "null"},
    {"Sec-Fetch-Site": "cross-site"},
    {"Sec-Fetch-Site": "same-site"},
])
def test_cross_origin_writes_with_the_cookie_are_refused(keyed, headers):
    with TestClient(keyed) as client:
        assert _login(client).status_code == 303
        status, text = _chat(client, **headers)
        assert status == 403, text
        assert json.loads(text)["error"]["code"] == "cross_origin"
        r = client.post("/reset_prefix_cache", headers=headers)
        _error(r, 403, "cross_origin")
        # reading is harmless (no CORS: the other page cannot see the answer) and still works
        assert client.get("/v1/engine/stats", headers=headers).status_code == 200
        # the session survives a refused forgery, and sign-in/out from another origin are refused too
        assert _login(client, **headers).status_code == 403
        assert client.post("/ui/logout", headers=headers, follow_redirects=False).status_code == 403
        assert client.get("/").status_code == 200


def test_cookie_name_carries_the_port_so_two_local_servers_keep_their_sessions(keyed):
    with TestClient(keyed, base_url="http://127.0.0.1:8123") as client:
        r = client.post("/ui/login", data={"key": KEY}, headers={"Origin": "http://127.0.0.1:8123"},
                        follow_redirects=False)
        assert r.status_code == 303 and r.headers["set-cookie"].startswith("tokenmill_session_8123=")
        assert client.get("/").status_code == 200
        # the same token under another port's name is not this server's cookie
        token = client.cookies["tokenmill_session_8123"]
        client.cookies.clear()
        client.cookies.set("tokenmill_session_8124", token)
        assert client.get("/").status_code == 401


# ---- the session store and the origin check on their own -------------------------------------

class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_sessions_expire_and_are_capped():
    clock = _Clock()
    sessions = ConsoleSessions("k", ttl_s=60, max_sessions=3, clock=clock)
    first = sessions.open()
    assert sessions.valid(first) and not sessions.valid("made-up") and not sessions.valid(None)
    clock.now += 59
    assert sessions.valid(first)
    clock.now += 2
    assert not sessions.valid(first)
    tokens = [sessions.open() for _ in range(4)]
    assert sessions.num_live == 3 and not sessions.valid(tokens[0]) and all(sessions.valid(t) for t in tokens[1:])
    assert len(set(tokens)) == 4
    sessions.close(tokens[1])
    assert not sessions.valid(tokens[1]) and sessions.valid(tokens[2])
    assert sessions.key_matches("k") and not sessions.key_matches("K") and not sessions.key_matches("")
    off = ConsoleSessions(None)
    assert not off.enabled and not off.key_matches("") and off.check({"type": "http", "headers": []}) == "ok"


def test_cookie_name_and_same_origin():
    assert cookie_name("127.0.0.1:8000") == "tokenmill_session_8000"
    assert cookie_name("localhost") == cookie_name("[::1]") == "tokenmill_session"
    assert cookie_name("[::1]:9000") == "tokenmill_session_9000"

    def scope(**headers: str) -> dict[str, Any]:
        return {"type": "http", "scheme": "http",
                "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}

    assert same_origin(scope(Host="127.0.0.1:8000", Origin="http://127.0.0.1:8000"))
    assert same_origin(scope(Host="Example.com", Origin="https://example.com:443"))  # behind a TLS proxy
    assert same_origin(scope(Host="example.com:80", Origin="http://example.com"))
    assert not same_origin(scope(Host="127.0.0.1:8000", Origin="http://127.0.0.1:8001"))
    assert not same_origin(scope(Host="127.0.0.1:8000", Origin="http://localhost:8000"))
    assert not same_origin(scope(Host="127.0.0.1:8000", Origin="garbage"))
    assert same_origin(scope(Host="h", **{"Sec-Fetch-Site": "same-origin"}))
    assert not same_origin(scope(Host="h", **{"Sec-Fetch-Site": "same-site"}))
    assert same_origin(scope(Host="h"))  # curl and friends send neither header


def test_the_bearer_scheme_is_accepted_in_any_letter_case(keyed):
    with TestClient(keyed) as client:
        for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
            r = client.get("/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
            assert r.status_code == 200, scheme
        for bad in (f"Basic {KEY}", f"Bearer{KEY}", f"Bearer {KEY}x", KEY, "Bearer"):
            assert client.get("/v1/models", headers={"Authorization": bad}).status_code == 401, bad
    assert bearer_token(b"bearer  abc ") == b"abc" and bearer_token("Token abc") is None


def test_wrong_keys_slow_down_sign_in_per_client(keyed):
    sessions = keyed.state.console_sessions
    now = [1000.0]
    saved = sessions.throttle
    sessions.throttle = LoginThrottle(clock=lambda: now[0])
    try:
        with TestClient(keyed) as client:
            for _ in range(3):
                assert _login(client, "wrong").status_code == 401
            r = _login(client, "wrong")
            assert r.status_code == 401 and "1 s" in r.text  # the fourth wrong key costs a second
            r = _login(client)  # even the right key waits its turn, unchecked
            assert r.status_code == 429 and r.headers["retry-after"] == "1" and "set-cookie" not in r.headers
            now[0] += 1.01
            assert _login(client, "wrong").status_code == 401  # fifth: 2 s
            assert sessions.throttle.wait_s("testclient") == pytest.approx(2.0)
            now[0] += 1.0
            assert _login(client).status_code == 429
            # another client is not slowed by this one's failures
            assert sessions.throttle.wait_s("10.0.0.9") == 0.0
            now[0] += 1.01
            assert _login(client).status_code == 303  # the right key clears the count
            assert sessions.throttle.wait_s("testclient") == 0.0
    finally:
        sessions.throttle = saved
    t = LoginThrottle(max_delay_s=60)
    delays = [t.failed("c") for _ in range(12)]
    assert delays[:3] == [0, 0, 0] and delays[3:6] == [1, 2, 4] and delays[-1] == 60


def _throttled_after_spoofed_addresses(app: Any, trusted: str | None) -> list[int]:
    """Six wrong sign-ins, each claiming another X-Forwarded-For, through the server's own uvicorn config."""
    import argparse
    import threading
    import time as _time

    import httpx
    import uvicorn

    from fake_backend import free_port
    from tokenmill.entrypoints.server.lifecycle import _uvicorn_config

    args = argparse.Namespace(host="127.0.0.1", port=free_port(), uvicorn_log_level="warning", root_path="",
                              ssl_keyfile=None, ssl_certfile=None, forwarded_allow_ips=trusted)
    server = uvicorn.Server(_uvicorn_config(args, app))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        _time.sleep(0.02)
    try:
        url = f"http://127.0.0.1:{args.port}"
        statuses = []
        for i in range(6):
            r = httpx.post(url + "/ui/login", data={"key": "wrong"}, follow_redirects=False,
                           headers={"Origin": url, "X-Forwarded-For": f"203.0.113.{i}"})
            statuses.append(r.status_code)
        return statuses
    finally:
        server.should_exit = True
        thread.join(10)


def test_the_sign_in_throttle_ignores_x_forwarded_for_unless_the_proxy_is_trusted():
    app = _app(KEY)
    try:
        statuses = _throttled_after_spoofed_addresses(app, None)
        assert 429 in statuses, statuses  # one address (the peer's) whatever the header says
        app.state.console_sessions.throttle.succeeded("127.0.0.1")
        trusted = _throttled_after_spoofed_addresses(app, "127.0.0.1")
        assert trusted == [401] * 6, trusted  # a trusted proxy's header names six different clients
    finally:
        app.state.tokenmill.aengine.shutdown()
